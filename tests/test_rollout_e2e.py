"""A full signed rollout over real processes: Mosquitto, `edge-fleet serve` with artifacts, two agents on
the tiny model. Two waves of one device each; the job succeeds, both agents serve the new version, and
their telemetry afterwards carries it."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from broker import free_port
from processes import BIN, Agent, FleetServer, client, health, wait
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
    db, keys = tmp_path / "fleet.db", tmp_path / "fleet.key"
    subprocess.run([BIN / "edge-fleet", "keygen", "--out", keys], check=True, capture_output=True)
    server = FleetServer(tmp_path, broker.url, "--artifacts-http", f"127.0.0.1:{free_port()}", "--artifacts-dir",
                         tmp_path / "artifacts")
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
    finally:
        for agent in agents:
            agent.stop()
        server.stop()
