"""The agent as a service: SIGTERM during streaming requests ends every stream properly, every request's
telemetry is in SQLite, the exit status is 0 and the fleet broker is told "stopped"."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import paho.mqtt.client as paho
import pytest

from quantize.package import build_bundle
from quantize.precision import QuantSpec

VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("svc") / "fp32", name="tiny",
                        progress=lambda s: None)


def start_agent(bundle, tmp_path: Path, broker_url: str) -> tuple[subprocess.Popen, Path]:
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([str(VENV_BIN / "edge-agent"), "serve", "--model", str(bundle.path), "--socket", str(sock),
                             "--memory-budget-mb", "4000", "--state-dir", str(tmp_path / "state"),
                             "--mqtt", broker_url, "--device-id", "dev1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stderr.read()
        if sock.exists():
            try:
                r = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock))).get("http://agent/health")
                if r.status_code == 200:
                    return proc, sock
            except httpx.TransportError:
                pass
        assert time.monotonic() < deadline, "the agent did not become ready"
        time.sleep(0.1)


def stream(sock: Path, results: list, i: int) -> None:
    body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": 400, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=60) as c:
        with c.stream("POST", "http://agent/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
    results[i] = lines


def retained_state(broker_url: str) -> dict:
    host, port = broker_url.removeprefix("mqtt://").split(":")
    got: dict = {}
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    c.on_message = lambda cl, u, msg: got.update(json.loads(msg.payload))
    c.connect(host, int(port))
    c.subscribe("edge/v1/dev1/state", qos=1)
    c.loop_start()
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    c.loop_stop()
    c.disconnect()
    return got


def test_sigterm_during_eight_streams(tiny_bundle, tmp_path, broker):
    proc, sock = start_agent(tiny_bundle, tmp_path, broker.url)
    results: list = [None] * 8
    threads = [threading.Thread(target=stream, args=(sock, results, i)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # all eight are streaming
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert proc.wait(60) == 0, proc.stderr.read()
    for lines in results:
        assert lines and lines[-1] == "data: [DONE]"  # a proper end of stream for every client
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"  # finished within the drain grace period
    db = sqlite3.connect(tmp_path / "state" / "telemetry.db")
    requests = db.execute("select count(*) from records where kind = 'request'").fetchone()[0]
    assert requests == 8
    assert retained_state(broker.url).get("status") == "stopped"


def test_sighup_reloads_the_live_settings(tiny_bundle, tmp_path, broker):
    """max_queue changes live on SIGHUP; a too-deep burst is then refused as overloaded (429)."""
    config = tmp_path / "agent.toml"
    config.write_text("[engine]\nmax_queue = 64\n")
    sock = tmp_path / "agent.sock"
    proc = subprocess.Popen([str(VENV_BIN / "edge-agent"), "serve", "--config", str(config), "--model",
                             str(tiny_bundle.path), "--socket", str(sock), "--memory-budget-mb", "4000",
                             "--state-dir", str(tmp_path / "state")], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (sock.exists() and _healthy(sock)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        config.write_text("[engine]\nmax_queue = 0\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=30) as c:
            r = c.post("http://agent/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 429 and r.headers.get("retry-after")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _healthy(sock: Path) -> bool:
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=2) as c:
            return c.get("http://agent/health").status_code == 200
    except httpx.HTTPError:
        return False
