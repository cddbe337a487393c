"""Publishing LoRA adapters and the jobs that roll them out, fleet side (fleet.adapter_registry, fleet.updates): what
the registry holds, what a deploy target must name, and the job document devices get. The devices' side:
tests/agent/test_adapter_job.py; both together over Mosquitto: tests/test_adapter_rollout_e2e.py."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from lora_support import base_and_other_build
from agent import wire
from agent.engine.bundle import BundleError
from agent.updates.trust import load_trusted_keys, verify_manifest
from fleet.adapter_registry import adapter_target
from fleet.signing import keygen


@pytest.fixture(scope="module")
def made(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    keygen(root / "fleet.key")
    base, folders = base_and_other_build(tiny_checkpoint, root, {"good": "base", "foreign": "other"})
    return base, folders, root / "fleet.key"


@pytest.fixture
def store(tmp_path):
    from fleet.store import FleetStore

    return FleetStore(tmp_path / "fleet.db")


def test_an_adapter_is_published_signed_and_named_by_its_base(made, store, tmp_path):
    from fleet.updates import publish

    base, folders, key = made
    good = wire.AdapterManifest.read(folders["good"])
    target = publish(store.db, folders["good"], key, tmp_path / "artifacts")
    assert target == f"tiny@{base.manifest.version}:good@{good.version}"
    row = store.db["adapters"].get(("good", good.version))
    assert (row["base_name"], row["base_version"]) == ("tiny", base.manifest.version)
    verify_manifest(good, row["signature"], row["key_id"], load_trusted_keys([key.with_name("fleet.key.pub")]))
    copied = tmp_path / "artifacts" / "adapters" / f"good@{good.version}"
    assert sorted(p.name for p in copied.iterdir()) == sorted([wire.ADAPTER_FILE, wire.ADAPTER_MANIFEST])


def test_a_damaged_adapter_is_never_signed(made, store, tmp_path):
    from fleet.updates import publish

    damaged = shutil.copytree(made[1]["good"], tmp_path / "damaged")
    blob = damaged / wire.ADAPTER_FILE
    data = blob.read_bytes()
    blob.write_bytes(data[:-1] + bytes([255 - data[-1]]))
    with pytest.raises(BundleError, match="does not match its sha256"):
        publish(store.db, damaged, made[2], tmp_path / "artifacts")
    assert not store.db["adapters"].count_where("1 = 1", [])


def test_a_deploy_target_names_the_base_the_adapter_was_published_for(made, store, tmp_path):
    from fleet.updates import publish

    target = publish(store.db, made[1]["foreign"], made[2], tmp_path / "artifacts")
    assert adapter_target(store.db, target).name == "foreign"
    foreign = target.split(":")[1]
    with pytest.raises(ValueError, match=f"{foreign} is for {target.split(':')[0]}, not tiny@v1: deploy {target}"):
        adapter_target(store.db, f"tiny@v1:{foreign}")
    with pytest.raises(ValueError, match="nope@1 is not published"):
        adapter_target(store.db, "tiny@v1:nope@1")
    with pytest.raises(ValueError, match="MODEL@VERSION:ADAPTER@VERSION"):
        adapter_target(store.db, "tiny@v1:nope")


@pytest.mark.parametrize("operation", ["install_adapter", "remove_adapter"])
def test_the_job_document_carries_the_signed_adapter_manifest(made, fleet_target, tmp_path, operation):
    """On both backends: migration 0016, the job's target as `edge-fleet jobs` prints it, the document."""
    from fleet.store import FleetStore
    from fleet.updates import RolloutDriver, create_job, list_jobs, publish

    store = FleetStore(fleet_target)
    target = publish(store.db, made[1]["good"], made[2], tmp_path / "artifacts")
    job_id = create_job(store.db, target, ["dev-a"], 1, 0.0, operation=operation)
    assert [j["target"] for j in list_jobs(store.db)] == [target]
    driver = RolloutDriver(fleet_target, lambda t, p, e: True, "http://fleet:8000")
    doc = driver._document(store.db, store.db["jobs"].get(job_id))
    assert doc.operation == operation and doc.manifest is None and doc.signed_manifest == doc.adapter
    assert doc.adapter == wire.AdapterManifest.read(made[1]["good"])
    assert doc.base_url == (f"http://fleet:8000/adapters/{target.split(':')[1]}" if operation == "install_adapter"
                            else None)
    assert json.loads(doc.wire_bytes())["adapter"]["name"] == "good"


def test_remove_takes_an_adapter_target_only(tmp_path):
    from fleet.cli import cli

    out = CliRunner().invoke(cli, ["deploy", "tiny@v1", "--remove", "--to", "dev-a", "--db", str(tmp_path / "f.db")])
    assert out.exit_code == 2 and "--remove takes an adapter: MODEL@VERSION:ADAPTER@VERSION" in out.output
