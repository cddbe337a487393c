"""A rollback job's report names the model the device went back to as MODEL@VERSION, whatever folder it was
installed from (`serve --model DIR` links the store to the user's folder)."""
from __future__ import annotations

import shutil

from agent.engine.bundle import open_bundle
from agent.updates.jobs import UpdateJob
from agent.wire import JobDocument, JobState
from fleet.artifacts import ArtifactServer
from updates_support import Device, build_bundles, job, make_keys


def test_a_rollback_to_a_model_seeded_from_a_folder_reports_model_at_version(tiny_checkpoint, tmp_path):
    """Found by a new user: `edge-fleet rollback` reported "rolled_back_to": "smollm2-fp32", the folder name."""
    v1, v2 = build_bundles(tiny_checkpoint, tmp_path / "bundles")  # folders named v1 and v2
    (tmp_path / "keys").mkdir()
    keys = make_keys(tmp_path / "keys")
    dev = Device(tmp_path / "dev", v1, keys)
    seeded = dev.store.models / f"{v1.manifest.name}@{v1.manifest.version}"
    shutil.rmtree(seeded)
    seeded.symlink_to(v1.path.resolve(), target_is_directory=True)  # as serve --model DIR seeds the store
    dev.serving = open_bundle(seeded)
    server = ArtifactServer(tmp_path / "artifacts").start()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        install = job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)
        assert UpdateJob(dev.ctx, install).run() is JobState.SUCCEEDED
    finally:
        server.stop()
    assert UpdateJob(dev.ctx, JobDocument(job_id="rb", operation="rollback")).run() is JobState.SUCCEEDED
    assert dev.serving.manifest.version == v1.manifest.version
    assert dev.reports[-1].figures == {"rolled_back_to": f"tiny@{v1.manifest.version}"}
