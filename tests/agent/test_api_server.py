"""The API server as a process on its socket: socket mode and stale sockets, the config file under flags, `edge-
agent serve` in the foreground, failing to bind or start, connections that would hold a descriptor for good, a read-
only state directory, a budget over the service's memory limit."""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from agent.api.http_server import ServeError, bind_unix, clear_stale_socket
from agent.service.serve import load_agent_config
from quantize.package import build_bundle
from quantize.precision import QuantSpec
from api_support import Served, serving, wait_for


def test_socket_mode_and_stale_socket_handling():
    folder = Path(tempfile.mkdtemp(prefix="edge-sock-", dir="/tmp"))
    path = folder / "a.sock"
    try:
        live = bind_unix(path, 0o660, None)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        with pytest.raises(ServeError, match="another server"):
            clear_stale_socket(path)
        live.close()  # a crash: the file stays, nothing listens
        bind_unix(path, 0o600, None).close()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        (folder / "file").write_text("not a socket")
        with pytest.raises(ServeError, match="not a socket"):
            bind_unix(folder / "file", 0o660, None)
        assert (folder / "file").read_text() == "not a socket"
    finally:
        shutil.rmtree(folder)


def test_config_file_with_flags_over_it(tmp_path):
    toml = tmp_path / "agent.toml"
    toml.write_text('model = "/m"\n[engine]\nthreads = 3\n[api]\nsocket_mode = "0600"\ntcp = "127.0.0.1:9000"\n')
    c = load_agent_config(toml, threads=1, socket=Path("/tmp/x.sock"), model=None, memory_budget_mb=None, tcp=None)
    assert (c.model, c.engine.threads, c.api.socket, c.api.socket_mode) == (Path("/m"), 1, Path("/tmp/x.sock"), 0o600)
    assert c.api.tcp_address == ("127.0.0.1", 9000)
    with pytest.raises(ValueError, match="not loopback"):
        load_agent_config(toml, tcp="0.0.0.0:9000")


@pytest.mark.parametrize("text, flags, where", [
    ('api = "x"\n', {"socket": Path("/tmp/x.sock")}, "api must be a table"),
    ("telemetry = 5\n", {"state_dir": Path("/tmp/s")}, "telemetry must be a table"),
    ('[telemetry]\nmqtt = "m"\n', {"mqtt": "mqtt://127.0.0.1"}, "telemetry.mqtt must be a table"),
])
def test_a_config_section_that_is_not_a_table_is_named_even_with_flags(text, flags, where, tmp_path):
    """Found in review: with the flags the unit passes, these were an internal TypeError naming no key."""
    toml = tmp_path / "agent.toml"
    toml.write_text(text)
    with pytest.raises(ServeError, match=where):
        load_agent_config(toml, **flags)


def test_serve_command_runs_in_the_foreground_and_drains_on_sigterm(tiny_bundle):
    folder = Path(tempfile.mkdtemp(prefix="edge-cli-", dir="/tmp"))
    path = folder / "api.sock"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = folder / "agent.toml"
    config.write_text("[engine]\nmin_context = 64\n[api]\nsocket_mode = 0o600\n")
    cmd = [sys.executable, "-m", "agent.service.cli", "serve", "--model", str(tiny_bundle.path), "--socket", str(path),
           "--config", str(config), "--memory-budget-mb", "2048", "--threads", "1", "--tcp", f"127.0.0.1:{port}",
               "--state-dir", str(folder / "state")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        wait_for(path.exists, timeout_s=20)
        served = Served(None, path, None)
        wait_for(lambda: served.http().get("/health").status_code == 200, timeout_s=30)
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["model"] == "tiny"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # Found in review: a second agent on another socket and the same state directory ran beside it
        second = subprocess.run([*cmd[:cmd.index("--socket") + 1], str(folder / "b.sock"),
                                 *cmd[cmd.index("--socket") + 2:cmd.index("--tcp")], *cmd[cmd.index("--tcp") + 2:]],
                                capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
        assert second.returncode != 0 and "Traceback" not in second.stderr
        assert f"another edge-agent (pid {proc.pid}) is using the state directory" in second.stderr, second.stderr
        assert not (folder / "b.sock").exists() and served.http().get("/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
        assert not path.exists()
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_serve_that_cannot_bind_changes_nothing(tiny, tiny_bundle, tiny_checkpoint, tmp_path):
    """Found in review: a second `serve --model OTHER` on a live agent's socket failed but had already made
    OTHER the store's current model, so the next restart would boot it."""
    from agent.service.serve import boot_model, serve_forever
    from agent.updates.model_store import ModelStore

    state = tmp_path / "state"
    store = ModelStore(state)
    boot_model(store, tiny_bundle.path)
    before = store.link("current")
    other = build_bundle(tiny_checkpoint, QuantSpec(precision="int8"), tmp_path / "int8", name="tiny",
                         progress=lambda s: None)
    config = load_agent_config(None, model=other.path, socket=tiny.path, tcp=None, threads=1, memory_budget_mb=16000,
                               state_dir=state)
    with pytest.raises(ServeError, match="another server is answering"):
        serve_forever(config)
    assert store.link("current") == before and store.link("previous") is None
    assert tiny.http().get("/health").status_code == 200  # the live one still serves on its socket


def raw_connection(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5)
    conn.connect(str(path))
    return conn


def closed_by_server(conn: socket.socket) -> bytes:
    """What the server sent before closing (b"" if nothing); fails if it keeps the connection open."""
    received = b""
    while chunk := conn.recv(4096):
        received += chunk
    return received


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\n"])
def test_a_connection_that_never_completes_a_request_head_is_closed(sent, tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine, request_timeout_s=0.5) as s:
        conn = raw_connection(s.path)
        conn.sendall(sent)
        t0 = time.monotonic()
        assert closed_by_server(conn) == b"" and time.monotonic() - t0 < 4
        with s.http() as http:  # the server still serves
            assert http.get("/health").status_code == 200


def test_a_body_that_stops_arriving_gets_408(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine, request_timeout_s=0.5) as s:
        conn = raw_connection(s.path)
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
        answer = b""
        while b"request_timeout" not in answer and (chunk := conn.recv(4096)):  # head and body may come apart
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        conn.close()


def test_connections_past_the_limit_get_503_not_a_descriptor_each(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine, max_connections=2) as s:
        idle = [raw_connection(s.path) for _ in range(2)]
        conn = raw_connection(s.path)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: agent\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 503")
        for c in (*idle, conn):
            c.close()


def test_a_serve_that_fails_to_start_lets_go_of_the_state_directory(tmp_path, tiny_bundle):
    """Found in review: the state directory's lock was taken outside the try, so a serve that failed early
    (here: models/ is a file) kept it, and the next serve in the same process was refused as 'another agent'."""
    from agent.service.preflight import lock_state_dir
    from agent.service.serve import serve_forever

    state = tmp_path / "state"
    state.mkdir()
    (state / "models").write_text("not a directory")
    config = load_agent_config(None, model=tiny_bundle.path, socket=tmp_path / "a.sock", tcp=None, threads=1,
                               memory_budget_mb=16000, state_dir=state)
    with pytest.raises(OSError):
        serve_forever(config)
    os.close(lock_state_dir(state))  # free again


def test_bodies_held_while_being_read_are_bounded_and_refused_as_overloaded(tiny_bundle, tiny_engine):
    """Found in review: 200 connections each sending a 4 MiB body and holding back its last byte made the
    agent hold 1.35 GB (budget 350 MB) before any queue limit applied. Bodies being read or tokenized now take
    at most INTAKE_BODIES x max_body_bytes together; past that a large body is refused 429 with a
    Retry-After, while small ones (every ordinary request) are still served: a first version locked everyone
    out with four slow uploads (found in review of the fix)."""
    from agent.api.app import INTAKE_BODIES, INTAKE_SMALL_BYTES

    limit = 2 * INTAKE_SMALL_BYTES
    with serving(tiny_bundle, tiny_engine, max_body_bytes=limit, request_timeout_s=5) as s:
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1}).encode().ljust(limit - 1024)
        held = []
        for _ in range(INTAKE_BODIES):  # each sends all but its last byte, and waits
            conn = raw_connection(s.path)
            conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:-1])
            held.append(conn)
        time.sleep(0.3)  # read by the server
        refused = s.http().post("/v1/completions", content=body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded", refused.text
        assert "retry-after" in refused.headers
        small = s.http().post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert small.status_code == 200, small.text
        for conn in held:  # they complete, and the room is free again
            conn.sendall(body[-1:])
            answer = b""
            while b"\r\n\r\n" not in answer and (chunk := conn.recv(4096)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            conn.close()
        assert s.http().post("/v1/completions", content=body).status_code == 200


def test_a_client_sending_garbage_is_logged_once_a_minute_not_once_a_connection(tiny, caplog):
    """Found in review: uvicorn logged "Invalid HTTP request received." for every bad connection, 4,200 lines a
    second into the journal from one local client. Each warning now goes through once a minute with a count."""
    import socket as socket_module

    from agent.api.http_server import _Repeats

    caplog.set_level(logging.WARNING, logger="uvicorn.error")
    for _ in range(50):
        with socket_module.socket(socket_module.AF_UNIX) as s:
            s.connect(str(tiny.path))
            s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
            s.recv(1024)
    assert tiny.http().get("/health").status_code == 200
    lines = [r for r in caplog.records if "Invalid HTTP request" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]
    now = [0.0]
    repeats = _Repeats(60.0, clock=lambda: now[0])
    record = lambda: logging.LogRecord("uvicorn.error", logging.WARNING, "", 0, "Invalid HTTP request", (), None)  # noqa: E731
    assert [repeats.filter(record()) for _ in range(4)] == [True, False, False, False]
    now[0] = 61.0
    again = record()
    assert repeats.filter(again) and again.getMessage() == "Invalid HTTP request (3 more in the last 60 s)"
    try:  # a crash is news every time, whatever its message (uvicorn's is always the same)
        raise KeyError("x")
    except KeyError:
        crash = logging.LogRecord("uvicorn.error", logging.ERROR, "", 0, "Exception in ASGI application", (),
                                  sys.exc_info())
    assert all(repeats.filter(crash) for _ in range(3))


def test_a_read_only_state_directory_still_serves_with_telemetry_in_memory(tmp_path, monkeypatch, caplog):
    """Found in review (an SD card that ext4 remounted read-only after an I/O error): every start failed at the
    state directory's lock file, so the box served nothing though its model was readable. The lock is on the
    directory, telemetry goes to memory (and says so), and a second agent is still refused, by a message
    that does not name a dead run's pid."""
    import errno

    import agent.link.store
    from agent.service.preflight import lock_state_dir
    from agent.link.store import TelemetryStore
    from agent.wire import EventRecord

    state = tmp_path / "state"
    os.close(lock_state_dir(state))  # as a run before the card failed left it
    TelemetryStore(state / "telemetry.db", "dev-1").close()
    (state / "agent.lock").write_text("999999999\n")  # a dead run's pid, which a read-only disk keeps
    real_write_text = Path.write_text

    def read_only(self, *args, **kwargs):
        if self.parent == state:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", read_only)
    monkeypatch.setattr(agent.link.store, "writable_dir", lambda d: Path(d) != state)
    fd = lock_state_dir(state)
    try:
        assert "read-only file system" in caplog.text
        with pytest.raises(ServeError, match=r"another edge-agent is using the state directory"):
            lock_state_dir(state)
        store = TelemetryStore(state / "telemetry.db", "dev-1")
        assert "read-only" in store.in_memory_because
        store.append(EventRecord(kind="tick"))
        assert store.count_unsent() == 1
        store.close()
    finally:
        os.close(fd)
    monkeypatch.undo()  # writable again: the next agent takes the same lock, on the directory
    fd = lock_state_dir(state)
    try:
        with pytest.raises(ServeError, match=f"another edge-agent \\(pid {os.getpid()}\\)"):
            lock_state_dir(state)
    finally:
        os.close(fd)


def test_a_budget_above_the_services_memory_limit_is_lowered_to_fit_and_said(tmp_path, monkeypatch, caplog):
    """Found in review: nothing compared memory_budget_mb with systemd's MemoryMax= (cgroup memory.max) or the
    RAM, so a budget above them ended with the kernel killing the agent under load, where the budget would
    have refused requests. It is lowered to fit, at ERROR; a tighter parent cgroup counts, "max" does not."""
    import agent.process
    from agent.config import AgentConfig
    from agent.service.preflight import fitted_budget

    root = tmp_path / "cg"
    (root / "system.slice").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")
    (root / "system.slice" / "memory.max").write_text(f"{1000 * 2**20}\n")  # a slice of 1000 MB
    monkeypatch.setattr(agent.process, "cgroup_values", lambda name: [  # a v2 system: no v1 files
        (root / "system.slice" / name).read_text().strip(), (root / name).read_text().strip()]
        if name == "memory.max" else [])
    config = AgentConfig.model_validate({"engine": {"memory_budget_mb": 1024}})
    fitted = fitted_budget(config)
    assert fitted.engine.memory_budget_mb == 800 and config.engine.memory_budget_mb == 1024
    assert "memory_budget_mb = 1024 is above 80% of the 1000 MB" in caplog.text and "using 800 MB" in caplog.text
    small = AgentConfig.model_validate({"engine": {"memory_budget_mb": 512}})
    assert fitted_budget(small) is small  # within the limit: as configured
    (root / "system.slice" / "memory.max").write_text("max\n")
    monkeypatch.setattr(agent.process, "memory_limit_bytes", lambda: None)  # unknown: as configured
    monkeypatch.setattr("agent.service.preflight.memory_limit_bytes", lambda: None)
    assert fitted_budget(config) is config
