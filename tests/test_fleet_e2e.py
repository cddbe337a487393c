"""Two real agents (tiny model) and one fleet server over a real Mosquitto, restarted in the middle: the
fleet database ends with exactly the request records each agent committed, once each."""
from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from quantize.package import build_bundle
from quantize.precision import QuantSpec

BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("fe2e") / "fp32", name="tiny",
                        progress=lambda s: None)


def ready(sock: Path) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=2) as c:
            return c.get("http://agent/health").status_code == 200
    except httpx.HTTPError:
        return False


def ask(sock: Path, n: int) -> None:
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
        for i in range(n):
            r = c.post("http://agent/v1/completions", json={"model": "tiny", "prompt": f"q{i}", "max_tokens": 3})
            assert r.status_code == 200


def wait(condition, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.3)


def rows(db: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_fleet_holds_exactly_what_two_agents_committed_across_a_broker_restart(tiny_bundle, broker, tmp_path):
    db = tmp_path / "fleet.db"
    procs = [subprocess.Popen([BIN / "edge-fleet", "serve", "--mqtt", broker.url, "--db", db],
                              stderr=open(tmp_path / "fleet.log", "w"))]
    socks = {d: tmp_path / f"{d}.sock" for d in ("dev-a", "dev-b")}
    try:
        for dev, sock in socks.items():
            procs.append(subprocess.Popen(
                [BIN / "edge-agent", "serve", "--model", tiny_bundle.path, "--socket", sock, "--state-dir",
                 tmp_path / dev, "--mqtt", broker.url, "--device-id", dev, "--memory-budget-mb", "2048"],
                stderr=open(tmp_path / f"{dev}.log", "w")))
        for sock in socks.values():
            wait(lambda: ready(sock), "agent ready")
        for sock in socks.values():
            ask(sock, 10)
        broker.stop()  # mid-run: the agents keep serving and keep their records
        for sock in socks.values():
            ask(sock, 10)
        time.sleep(2)
        broker.start()
        for sock in socks.values():
            ask(sock, 10)

        def committed(dev: str) -> set:
            return set(rows(tmp_path / dev / "telemetry.db", "select boot_id, seq from records where kind = 'request'"))

        def stored(dev: str) -> set:
            return set(rows(db, f"select boot_id, seq from requests where device_id = '{dev}'"))

        for dev in socks:
            wait(lambda: db.exists() and stored(dev) == committed(dev), f"{dev}'s records in the fleet")
            assert len(committed(dev)) == 30
            total = rows(db, f"select count(*) from requests where device_id = '{dev}'")[0][0]
            assert total == 30  # once each: replays after the reconnect were dropped
        print("each agent: 30 requests committed, 30 stored in the fleet after a broker restart")
    finally:
        for p in reversed(procs):
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
