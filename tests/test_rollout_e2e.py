"""A full signed rollout over real processes: Mosquitto, `edge-fleet serve` with artifacts, two agents on
the tiny model. Two waves of one device each; the job succeeds, both agents serve the new version, and
their telemetry afterwards carries it."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from broker import free_port
from processes import BIN, Agent, FleetServer, client, health, signing_fleet, wait
from agent import wire
from quantize.package import build_bundle
from quantize.precision import QuantSpec


@pytest.fixture(scope="module")
def bundles(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    v1 = build_bundle(tiny_checkpoint, QuantSpec(), root / "v1", name="tiny", progress=lambda s: None)
    v2 = build_bundle(tiny_checkpoint, QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={}),
                      root / "v2", name="tiny", progress=lambda s: None)
    return v1, v2


def fleet(*args, db: Path) -> str:
    return subprocess.run([BIN / "edge-fleet", *map(str, args), "--db", str(db)], capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_two_agents_two_waves(bundles, broker, tmp_path):
    v1, v2 = bundles
    db = tmp_path / "fleet.db"
    server, keys = signing_fleet(tmp_path, broker.url)
    agents = [Agent(tmp_path, "--model", v1.path, "--mqtt", broker.url, "--trusted-key", f"{keys}.pub",
                    "--memory-budget-mb", 2048, device_id=dev) for dev in ("dev-a", "dev-b")]
    try:
        for agent in agents:
            agent.start()
        wait(lambda: fleet("devices", "--json", db=db).count('"online": true') == 2
             or fleet("devices", "--json", db=db).count('"online": 1') == 2, "both devices online in the fleet")
        target = fleet("publish", v2.path, "--key", keys, "--artifacts-dir", tmp_path / "artifacts",
                       db=db).strip().splitlines()[-1]
        out = subprocess.run([BIN / "edge-fleet", "deploy", target, "--to", "dev-a", "--to", "dev-b", "--wave-size",
                              "1", "--wait", "--timeout", "240", "--min-tokens-per-s", "0", "--db", db],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr + agents[0].log.read_text()[-3000:]
        assert "SUCCEEDED" in out.stdout
        for agent in agents:
            wait(lambda: (health(agent.sock) or {}).get("version") == v2.manifest.version, "the new version serving")
            with client(agent.sock) as c:
                r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4})
            assert r.status_code == 200
        new = f"tiny@{v2.manifest.version}"
        wait(lambda: sum(r["requests"] for r in json.loads(fleet("tps", "--by", "version", "--json", db=db))
                         if r["version"] == new) >= 2, "telemetry with the new version")
        # the registry names the new model while the devices stay connected (found in review: only their next
        # connection said so, and deploy skips devices by it)
        registry = {d["id"]: d["model"] for d in json.loads(fleet("devices", "--json", db=db))}
        assert registry == {"dev-a": new, "dev-b": new}, registry
    finally:
        for agent in agents:
            agent.stop()
        server.stop()


def test_a_device_that_trusts_a_job_key_takes_the_fleets_signed_jobs_only(bundles, broker, tmp_path):
    """`edge-fleet serve --job-key` signs each device's job; an agent with [updates] job_keys installs it,
    refuses the unsigned rollback command, and takes the signed rollback job."""
    v1, v2 = bundles
    db, keys, job_key = tmp_path / "fleet.db", tmp_path / "fleet.key", tmp_path / "job.key"
    for out in (keys, job_key):
        subprocess.run([BIN / "edge-fleet", "keygen", "--out", out], check=True, capture_output=True)
    config = tmp_path / "agent.toml"
    config.write_text(f'[updates]\njob_keys = ["{job_key}.pub"]\n')
    server = FleetServer(tmp_path, broker.url, "--artifacts-http", f"127.0.0.1:{free_port()}", "--artifacts-dir",
                         tmp_path / "artifacts", "--job-key", job_key)
    agent = Agent(tmp_path, "--model", v1.path, "--mqtt", broker.url, "--trusted-key", f"{keys}.pub",
                  "--memory-budget-mb", 2048, "--config", config, device_id="dev-j")
    try:
        agent.start()
        wait(lambda: '"dev-j"' in fleet("devices", "--json", db=db), "the device in the fleet")
        target = fleet("publish", v2.path, "--key", keys, "--artifacts-dir", tmp_path / "artifacts",
                       db=db).strip().splitlines()[-1]
        out = subprocess.run([BIN / "edge-fleet", "deploy", target, "--to", "dev-j", "--wait", "--timeout", "240",
                              "--min-tokens-per-s", "0", "--db", db], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "SUCCEEDED" in out.stdout, out.stdout + out.stderr + agent.log.read_text()[-3000:]
        wait(lambda: (health(agent.sock) or {}).get("version") == v2.manifest.version, "the new version serving")
        cmd = subprocess.run([BIN / "edge-fleet", "cmd", "dev-j", "rollback", "--mqtt", broker.url, "--json"],
                             capture_output=True, text=True, timeout=60)
        assert "takes rollbacks only as signed jobs" in cmd.stdout and cmd.returncode == 1, cmd.stdout + cmd.stderr
        job_id = fleet("rollback", "dev-j", db=db).split()[1].rstrip(":")
        wait(lambda: (health(agent.sock) or {}).get("version") == v1.manifest.version, "rolled back by the signed job")
        assert "SUCCEEDED" in fleet("job", job_id, db=db)
    finally:
        agent.stop()
        server.stop()


def drafted_tokens(sock: Path) -> float:
    """The agent's edge:spec_decode_num_draft_tokens counter, from /metrics."""
    with client(sock) as c:
        text = c.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("edge:spec_decode_num_draft_tokens"))


def test_a_bundle_and_its_draft_model_ship_as_one_signed_rollout(tiny_checkpoint, broker, tmp_path):
    """A device drafting with the model its bundle carries (speculative = "draft") takes a signed job to another
    pair: one publish, one download, one health gate; afterwards it serves the new pair and drafts with it."""
    build = lambda spec, out, **kw: build_bundle(tiny_checkpoint, spec, tmp_path / out, name=kw.pop("name", "tiny"),  # noqa: E731
                                                 progress=lambda s: None, **kw)
    draft_v1 = build(QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={}), "d1", name="tiny-draft")
    draft_v2 = build(QuantSpec(head_vocab=256), "d2", name="tiny-draft")
    v1, v2 = build(QuantSpec(), "pair1", draft=draft_v1.path), build(QuantSpec(), "pair2", draft=draft_v2.path)
    assert v1.manifest.version != v2.manifest.version  # the same target weights: the drafts tell them apart
    db, config = tmp_path / "fleet.db", tmp_path / "agent.toml"
    config.write_text('[engine]\nspeculative = "draft"\n')
    server, keys = signing_fleet(tmp_path, broker.url)
    agent = Agent(tmp_path, "--model", v1.path, "--mqtt", broker.url, "--trusted-key", f"{keys}.pub",
                  "--memory-budget-mb", 2048, "--config", config, device_id="dev-s")
    try:
        agent.start()
        wait(lambda: '"dev-s"' in fleet("devices", "--json", db=db), "the device in the fleet")
        target = fleet("publish", v2.path, "--key", keys, "--artifacts-dir", tmp_path / "artifacts",
                       db=db).strip().splitlines()[-1]
        out = subprocess.run([BIN / "edge-fleet", "deploy", target, "--to", "dev-s", "--wait", "--timeout", "240",
                              "--min-tokens-per-s", "0", "--db", db], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "SUCCEEDED" in out.stdout, out.stdout + out.stderr + agent.log.read_text()[-3000:]
        wait(lambda: (health(agent.sock) or {}).get("version") == v2.manifest.version, "the new pair serving")
        installed = agent.state_dir / "models" / f"tiny@{v2.manifest.version}" / "draft" / wire.MANIFEST
        assert wire.Manifest.model_validate_json(installed.read_text()).version == draft_v2.manifest.version
        before = drafted_tokens(agent.sock)
        with client(agent.sock) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert drafted_tokens(agent.sock) > before
    finally:
        agent.stop()
        server.stop()


@pytest.mark.real_model
def test_a_signed_update_moves_a_device_to_the_qwen_int4_bundle(bundles, real_arch_bundle, broker, tmp_path):
    """A device on the tiny model takes a signed job to Qwen2.5-Coder INT4 (the health gate's golden
    continuation included), then answers a chat with it."""
    v1, _ = bundles
    qwen = real_arch_bundle("qwen2.5-coder-0.5b-instruct", "int4")
    db = tmp_path / "fleet.db"
    server, keys = signing_fleet(tmp_path, broker.url)
    agent = Agent(tmp_path, "--model", v1.path, "--mqtt", broker.url, "--trusted-key", f"{keys}.pub",
                  "--memory-budget-mb", 4096, device_id="dev-q")
    try:
        agent.start()
        wait(lambda: '"dev-q"' in fleet("devices", "--json", db=db), "the device known to the fleet")
        target = fleet("publish", qwen.path, "--key", keys, "--artifacts-dir", tmp_path / "artifacts",
                       db=db).strip().splitlines()[-1]
        # the session may have built the Qwen bundle before the tiny one: by build time, an older model
        out = subprocess.run([BIN / "edge-fleet", "deploy", target, "--to", "dev-q", "--wait", "--timeout", "240",
                              "--min-tokens-per-s", "0", "--allow-downgrade", "--db", db], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0 and "SUCCEEDED" in out.stdout, out.stdout + out.stderr + agent.log.read_text()[-3000:]
        wait(lambda: (health(agent.sock) or {}).get("version") == qwen.manifest.version, "Qwen serving")
        with client(agent.sock, timeout_s=120) as c:
            r = c.post("/v1/chat/completions", json={"model": "qwen2.5-coder-0.5b-instruct", "max_tokens": 32,
                                                     "temperature": 0, "messages": [
                                                         {"role": "user", "content": "Write hello world in Python."}]})
        answer = r.json()
        assert r.status_code == 200 and answer["model"] == "qwen2.5-coder-0.5b-instruct", r.text
        assert answer["choices"][0]["message"]["content"].strip() and answer["usage"]["completion_tokens"] > 0
    finally:
        agent.stop()
        server.stop()
