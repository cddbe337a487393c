"""A Mixture of Experts served by the agent as a real process: tiny Granite-MoE and Qwen3-MoE bundles (INT4 QMoE)
answer the OpenAI API over the Unix socket, their requests reach the fleet as telemetry, a signed rollout moves the
device from one to the other, and the fleet's report gives each version's total and active parameters. Before
that: check-config and the engine's plan name both counts (every expert is resident in the budget; decode reads
the routed ones).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from processes import BIN, Agent, client, committed, health, signing_fleet, wait
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.memory import MemoryBudgetError, describe_parameters
from quantize.checkpoint import load_checkpoint
from quantize.package import build_bundle
from quantize.precision import QuantSpec

FIXTURES = Path(__file__).parent / "quantize" / "data" / "arch_logits"


@pytest.fixture(scope="module")
def moe_bundles(tmp_path_factory):
    """(v1, v2): Granite-MoE then Qwen3-MoE, both INT4 (QMoE experts, round to nearest)."""
    root = tmp_path_factory.mktemp("moe")
    spec = QuantSpec(precision="int4", method="rtn")
    return tuple(build_bundle(load_checkpoint(FIXTURES / arch / "model.gguf"), spec, root / arch, name=f"tiny-{arch}",
                              progress=lambda s: None) for arch in ("granitemoe", "qwen3moe"))


def test_check_config_and_the_engines_plan_give_total_and_active_parameters(moe_bundles, tmp_path):
    v1, _ = moe_bundles
    p = v1.manifest.parameters
    both = describe_parameters(p)
    assert p.active < p.total
    config = tmp_path / "agent.toml"
    config.write_text(f'model = "{v1.path}"\n[telemetry]\nstate_dir = "{tmp_path / "state"}"\n')
    r = subprocess.run([sys.executable, "-m", "agent.service.cli", "check-config", "--config", str(config)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and both in r.stdout, r.stdout + r.stderr
    with pytest.raises(MemoryBudgetError) as refused:  # this test process alone is past 64 MB
        Engine(v1, EngineConfig(memory_budget_mb=64))
    assert both in str(refused.value), refused.value


def fleet(*args, db: Path) -> str:
    return subprocess.run([BIN / "edge-fleet", *map(str, args), "--db", str(db)], capture_output=True, text=True,
                          check=True, timeout=120).stdout


def complete(sock: Path, model: str) -> dict:
    with client(sock) as c:
        r = c.post("/v1/completions", json={"model": model, "prompt": "Experts", "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def served_requests(db: Path, target: str) -> int:
    return sum(r["requests"] for r in json.loads(fleet("tps", "--by", "version", "--json", db=db))
               if r["version"] == target)


def test_a_moe_bundle_serves_reports_and_moves_to_another_by_a_signed_rollout(moe_bundles, broker, tmp_path):
    v1, v2 = moe_bundles
    db = tmp_path / "fleet.db"
    server, keys = signing_fleet(tmp_path, broker.url)
    agent = Agent(tmp_path, "--model", v1.path, "--mqtt", broker.url, "--trusted-key", f"{keys}.pub",
                  "--memory-budget-mb", 2048, device_id="dev-moe")
    try:
        agent.start()
        assert "active per token" in agent.log.read_text()  # the engine's plan
        answer = complete(agent.sock, v1.manifest.name)
        assert answer["model"] == v1.manifest.name and answer["usage"]["completion_tokens"] > 0, answer
        wait(lambda: len(committed(agent.telemetry_db)) >= 1, "the request's telemetry row in the agent's store")
        old, new = (f"{b.manifest.name}@{b.manifest.version}" for b in (v1, v2))
        wait(lambda: served_requests(db, old) >= 1, "the request's telemetry in the fleet")
        for bundle in (v1, v2):
            fleet("publish", bundle.path, "--key", keys, "--artifacts-dir", tmp_path / "artifacts", db=db)
        out = subprocess.run([BIN / "edge-fleet", "deploy", new, "--to", "dev-moe", "--wait", "--timeout", "240",
                              "--min-tokens-per-s", "0", "--db", db], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "SUCCEEDED" in out.stdout, (out.stdout + out.stderr
                                                                   + agent.log.read_text()[-3000:])
        wait(lambda: (health(agent.sock) or {}).get("version") == v2.manifest.version, "Qwen3-MoE serving")
        assert complete(agent.sock, v2.manifest.name)["usage"]["completion_tokens"] > 0
        wait(lambda: served_requests(db, new) >= 1, "telemetry with the new version")
        report = tmp_path / "report.html"
        fleet("report", "--out", report, db=db)
        html = report.read_text()
        assert "<th>parameters_total</th><th>parameters_active</th>" in html
        for b in (v1, v2):
            p = b.manifest.parameters
            assert f"<td>{b.manifest.name}@{b.manifest.version}</td><td>{p.total}</td><td>{p.active}</td>" in html
    finally:
        agent.stop()
        server.stop()
