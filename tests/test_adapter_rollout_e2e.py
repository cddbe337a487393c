"""A signed LoRA adapter rollout over real processes: Mosquitto, `edge-fleet serve` with artifacts, two agents on
an adapter-ready tiny model. The adapter installs on both in one job whose figures show only the adapter's bytes
travelled (at most 10% of the base bundle's), and each agent then answers BASE:ADAPTER with the adapter's golden
continuation; a tampered adapter, one converted for another build and one signed by a key the devices do not
trust are each refused with the reason while the base keeps answering; and removal is a job too, after which
BASE:ADAPTER is a 404."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lora_support import base_and_other_build
from processes import BIN, Agent, client, signing_fleet, wait
from agent import wire
from agent.engine.tokenizer import TextTokenizer

DEVICES = ("dev-a", "dev-b")


@pytest.fixture(scope="module")
def builds(tiny_checkpoint, tmp_path_factory):
    """The base the devices run (fp32, LoRA on q and v up to rank 8), another build of the same model (int8),
    and adapters: good, tampered and unknown-key for the base, and one converted for the other build."""
    return base_and_other_build(tiny_checkpoint, tmp_path_factory.mktemp("adapters"),
                                {"good": "base", "tampered": "base", "unknown-key": "base", "other-base": "other"})


def fleet(*args, db: Path, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([BIN / "edge-fleet", *map(str, args), "--db", str(db)], capture_output=True, text=True,
                          check=check, timeout=300)


def deploy(target: str, db: Path, *extra) -> tuple[str, list[dict]]:
    """Deploy to both devices in one wave and wait: (the job's state, its device rows with figures parsed)."""
    out = fleet("deploy", target, *(x for d in DEVICES for x in ("--to", d)), "--wave-size", len(DEVICES),
                "--max-failure-rate", 1, "--min-tokens-per-s", 0, "--wait", "--timeout", 240, *extra, db=db, check=False)
    job_id = out.stdout.split()[1].rstrip(":")
    rows = json.loads(fleet("job", job_id, "--json", db=db).stdout)
    for r in rows:
        r["figures"] = json.loads(r["figures"] or "{}")
    return out.stdout.strip().splitlines()[-1].split()[-1], rows


def completion(sock: Path, model: str, prompt_ids: list[int], n: int):
    with client(sock) as c:
        return c.post("/v1/completions", json={"model": model, "prompt": prompt_ids, "max_tokens": n,
                                               "temperature": 0, "ignore_eos": True})


def test_a_signed_adapter_rollout_installs_refuses_and_removes(builds, broker, tmp_path):
    base, adapters = builds
    db, artifacts = tmp_path / "fleet.db", tmp_path / "artifacts"
    server, key = signing_fleet(tmp_path, broker.url)
    unknown = tmp_path / "unknown.key"
    subprocess.run([BIN / "edge-fleet", "keygen", "--out", unknown], check=True, capture_output=True)
    agents = [Agent(tmp_path, "--model", base.path, "--mqtt", broker.url, "--trusted-key", f"{key}.pub",
                    "--memory-budget-mb", 2048, device_id=d) for d in DEVICES]
    try:
        for agent in agents:
            agent.start()
        wait(lambda: all(f'"{d}"' in fleet("devices", "--json", db=db).stdout for d in DEVICES), "both devices known")
        publish = lambda name, k=key: fleet("publish", adapters[name], "--key", k, "--artifacts-dir", artifacts,  # noqa: E731
                                            db=db).stdout.strip().splitlines()[-1]
        good = wire.AdapterManifest.read(adapters["good"])
        target = publish("good")
        assert target == f"tiny@{base.manifest.version}:good@{good.version}"

        state, rows = deploy(target, db)
        assert state == "SUCCEEDED", rows
        base_bytes = sum(f.size_bytes for f in base.manifest.files.values())
        for r in rows:
            sent = r["figures"][wire.DOWNLOADED_BYTES]
            assert sent == sum(f.size_bytes for f in good.files.values()) and sent <= 0.10 * base_bytes, (sent, base_bytes)
        n = len(good.golden.continuation_ids)
        tokenizer = TextTokenizer(base.tokenizer_json(), base.config)
        assert tokenizer.decode(good.golden.continuation_ids) != tokenizer.decode(base.manifest.golden.continuation_ids)
        for agent in agents:
            with client(agent.sock) as c:
                assert "tiny:good" in [m["id"] for m in c.get("/v1/models").json()["data"]]
            r = completion(agent.sock, "tiny:good", good.golden.prompt_ids, n)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tokenizer.decode(good.golden.continuation_ids)

        tampered = publish("tampered")
        blob = artifacts / "adapters" / tampered.split(":")[1] / wire.ADAPTER_FILE
        data = bytearray(blob.read_bytes())
        data[-8:] = bytes(255 - b for b in data[-8:])  # same size, other bytes: only its sha256 tells
        blob.write_bytes(bytes(data))
        refusals = {tampered: ("FAILED", "does not match its sha256"),
                    publish("other-base"): ("REJECTED", "this device runs tiny@" + base.manifest.version),
                    publish("unknown-key", unknown): ("REJECTED", "signed by unknown key")}
        for target, (device_state, reason) in refusals.items():
            state, rows = deploy(target, db)
            assert state == "FAILED", rows
            for r in rows:
                assert r["state"] == device_state and reason in r["reason"], (target, r)
            for agent in agents:  # the base, and the adapter installed before, keep answering
                assert completion(agent.sock, "tiny", base.manifest.golden.prompt_ids, 4).status_code == 200
                assert completion(agent.sock, "tiny:good", good.golden.prompt_ids, 4).status_code == 200

        state, rows = deploy(f"tiny@{base.manifest.version}:good@{good.version}", db, "--remove")
        assert state == "SUCCEEDED", rows
        for agent in agents:
            with client(agent.sock) as c:
                assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny"]
            assert completion(agent.sock, "tiny:good", good.golden.prompt_ids, 4).status_code == 404
            assert completion(agent.sock, "tiny", base.manifest.golden.prompt_ids, 4).status_code == 200
    finally:
        for agent in agents:
            agent.stop()
        server.stop()
