"""Signed LoRA adapter jobs on the device (agent.updates.adapter_job) with a real store, real signatures and a real
artifact server: the refusals before any download, the install's download of the adapter alone, a failed health
check putting things back, and removal. The engine's side (restart, golden continuation) is the e2e test's:
tests/test_adapter_rollout_e2e.py; here `generate` answers what a serving engine would."""
from __future__ import annotations

import json
import shutil

import pytest

from lora_support import base_and_other_build
from updates_support import Device, make_keys
from agent import wire
from agent.updates.adapter_job import AdapterJob
from agent.updates.jobs import JobPhase, UpdateJob
from agent.wire import JobDocument, JobState
from fleet.artifacts import ArtifactServer
from fleet.signing import load_private_key, sign_manifest


@pytest.fixture(scope="module")
def made(tiny_checkpoint, tmp_path_factory):
    """(base bundle, {adapter name: folder}, keys): 'good' fits the base, 'foreign' another build of it."""
    root = tmp_path_factory.mktemp("adapter-job")
    base, folders = base_and_other_build(tiny_checkpoint, root, {"good": "base", "foreign": "other"})
    return base, folders, make_keys(root)


@pytest.fixture
def served(made, tmp_path):
    """An artifact server holding the adapters under adapters/NAME@VERSION: (server, folder -> its base_url)."""
    server = ArtifactServer(tmp_path / "artifacts").start()
    urls = {}
    for name, folder in made[1].items():
        m = wire.AdapterManifest.read(folder)
        shutil.copytree(folder, tmp_path / "artifacts" / "adapters" / f"{m.name}@{m.version}")
        urls[name] = f"{server.base_url}/adapters/{m.name}@{m.version}"
    yield urls
    server.stop()


def job(folder, keyfile, base_url=None, operation="install_adapter", job_id="job-a") -> JobDocument:
    m = wire.AdapterManifest.read(folder)
    sig, kid = sign_manifest(m, load_private_key(keyfile))
    return JobDocument(job_id=job_id, operation=operation, adapter=m, signature=sig, key_id=kid, base_url=base_url,
                       min_tokens_per_s=0)


def device(made, tmp_path, answer=None) -> Device:
    """A device serving the base; generate answers with `answer` (default: the adapter's golden ids)."""
    base, folders, keys = made
    d = Device(tmp_path / "device", base, keys)
    golden = wire.AdapterManifest.read(folders["good"]).golden.continuation_ids
    d.swaps = 0

    def swap(bundle, check=None):
        d.swaps += 1
        d.serving = bundle

    d.ctx.swap = swap
    d.ctx.generate = lambda ids, n, adapter: ((answer or golden)[:n], 50.0)
    return d


def run(d: Device, doc: JobDocument) -> tuple[AdapterJob, wire.JobStatusUpdate]:
    j = AdapterJob(d.ctx, doc)
    assert j.run() is d.reports[-1].state
    return j, d.reports[-1]


def test_an_adapter_for_another_build_is_rejected_before_any_download(made, served, tmp_path):
    d = device(made, tmp_path)
    j, last = run(d, job(made[1]["foreign"], made[2] / "fleet.key", served["foreign"]))
    assert last.state is JobState.REJECTED and j.phase is JobPhase.REJECTED
    assert "this device runs tiny@" + made[0].manifest.version in last.reason
    assert d.staging_empty() and d.swaps == 0 and not d.store.adapters_for(made[0].manifest)


def test_an_adapter_signed_by_an_unknown_key_is_rejected(made, served, tmp_path):
    d = device(made, tmp_path)
    _, last = run(d, job(made[1]["good"], made[2] / "other.key", served["good"]))
    assert last.state is JobState.REJECTED and "signed by unknown key" in last.reason
    assert d.staging_empty() and d.swaps == 0


def test_an_install_downloads_the_adapter_alone_then_removal_takes_it_away(made, served, tmp_path):
    d = device(made, tmp_path)
    good = wire.AdapterManifest.read(made[1]["good"])
    _, last = run(d, job(made[1]["good"], made[2] / "fleet.key", served["good"]))
    assert last.state is JobState.SUCCEEDED, last.reason
    assert last.figures[wire.DOWNLOADED_BYTES] == sum(f.size_bytes for f in good.files.values())
    assert last.figures["adapter"] == f"good@{good.version}" and d.swaps == 1
    assert list(d.store.adapters_for(made[0].manifest)) == ["good"]
    _, again = run(d, job(made[1]["good"], made[2] / "fleet.key", served["good"], job_id="job-b"))
    assert again.state is JobState.SUCCEEDED and "already installed" in again.reason and d.swaps == 1
    j, removed = run(d, job(made[1]["good"], made[2] / "fleet.key", operation="remove_adapter", job_id="job-c"))
    assert removed.state is JobState.SUCCEEDED and removed.figures == {"removed": f"good@{good.version}"}
    assert j.phase is JobPhase.SUCCEEDED and d.swaps == 2 and not d.store.adapters_for(made[0].manifest)
    _, nothing = run(d, job(made[1]["good"], made[2] / "fleet.key", operation="remove_adapter", job_id="job-d"))
    assert nothing.state is JobState.SUCCEEDED and "not installed" in nothing.reason and d.swaps == 2


def test_a_failed_health_check_removes_the_adapter_and_restarts_the_engine_without_it(made, served, tmp_path):
    d = device(made, tmp_path, answer=[0] * 64)
    j, last = run(d, job(made[1]["good"], made[2] / "fleet.key", served["good"]))
    assert last.state is JobState.FAILED and "golden output mismatch at token 0" in last.reason
    assert j.phase is JobPhase.ROLLED_BACK and d.swaps == 2  # restarted with it, then without it
    assert not d.store.adapters_for(made[0].manifest) and d.staging_empty()


def test_every_phase_belongs_to_a_kind_of_job():
    assert set(UpdateJob.TRANSITIONS) | set(AdapterJob.TRANSITIONS) == set(JobPhase)
    assert JobPhase.REMOVING not in UpdateJob.TRANSITIONS and JobPhase.ROLLING_BACK not in AdapterJob.TRANSITIONS


def test_a_job_without_an_adapter_keeps_its_wire_and_signed_bytes():
    """Agents from before adapter jobs forbid unknown keys, and a job signed then must verify now."""
    doc = JobDocument(job_id="j", operation="rollback")
    assert "adapter" not in json.loads(doc.wire_bytes()) and b'"adapter"' not in doc.signed_bytes()


def test_an_install_interrupted_by_a_restart_is_undone_before_the_engine_loads(made, tmp_path):
    """recover(): an adapter moved into adapters/ but never health-checked goes, the version it replaced comes
    back, and the job is reported FAILED."""
    from agent.updates.model_store import ADAPTERS_DIR, JobJournal
    from agent.updates.service import recover

    d = device(made, tmp_path)
    folder = d.store.root / ADAPTERS_DIR / f"tiny@{made[0].manifest.version}" / "good"
    shutil.copytree(made[1]["good"], folder.with_name(".good.old-123"))
    shutil.copytree(made[1]["foreign"], folder)  # the new version, mid-check when the agent died
    d.store.write_journal(JobJournal(job_id="job-x", state=JobState.IN_PROGRESS, step=wire.JobStep.HEALTH_CHECK,
                                     target=str(folder)))
    update = recover(d.ctx)
    assert update.state is JobState.FAILED and "interrupted by an agent restart during health_check" in update.reason
    assert wire.AdapterManifest.read(folder).name == "good"  # the replaced version is back
    assert not list(folder.parent.glob(".good.*"))


def test_a_removal_cut_short_after_hiding_the_folder_leaves_nothing_behind_after_a_restart(made, tmp_path):
    from agent.updates.model_store import ADAPTERS_DIR
    from agent.updates.service import recover

    d = device(made, tmp_path)
    folder = d.store.root / ADAPTERS_DIR / f"tiny@{made[0].manifest.version}" / "good"
    shutil.copytree(made[1]["good"], folder.with_name(".good.removed-123"))  # hidden, not yet deleted
    assert recover(d.ctx) is None
    assert not folder.parent.exists() or not list(folder.parent.iterdir())
    assert not d.store.adapters_for(made[0].manifest)


def test_without_a_floor_the_adapter_must_decode_at_70_percent_of_the_base_through_the_engine(made, served, tmp_path):
    d = device(made, tmp_path)
    golden = wire.AdapterManifest.read(made[1]["good"]).golden.continuation_ids
    speeds = {None: 50.0, "good": 30.0}  # tokens/s the engine decodes at: the base, and with the adapter
    d.ctx.generate = lambda ids, n, adapter: (golden[:n], speeds[adapter])
    doc = job(made[1]["good"], made[2] / "fleet.key", served["good"]).model_copy(update={"min_tokens_per_s": None})
    _, last = run(d, doc)
    assert last.state is JobState.FAILED and "decode 30.0 tokens/s with the adapter is below the floor 35.0" in last.reason
    assert not d.store.adapters_for(made[0].manifest)
