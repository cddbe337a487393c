"""Slow and greedy clients against the local API over its real Unix socket: floods of connections that dribble
their request heads beside normal traffic (from another user and from the same one), the connection limits'
503 in OpenAI's error shape, the per-peer cap, and the limits' bookkeeping (agent.api.admission) on its own.

Tests that connect as another user fork a child that switches to nobody (65534): they need root.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from agent.api.admission import SLOW_HEAD_S, ConnectionLimits, ConnState
from agent.api.backend import Backend
from agent.api.http_server import ApiServer, bind_unix
from agent.config import ApiConfig, EngineConfig
from agent.engine.engine import Engine
from agent.wire import Manifest

NOBODY = 65534
HEAD_START = b"POST /v1/completions HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 3}


@pytest.fixture(scope="module")
def tiny_engine(tiny_fp32_bundle):
    engine = Engine(tiny_fp32_bundle, EngineConfig(threads=1, memory_budget_mb=16000, min_context=64))
    engine.start()
    yield engine
    engine.stop()


@contextmanager
def serving(bundle, engine: Engine, **config):
    """A real server on a fresh Unix socket that any user may reach (a folder under /tmp: AF_UNIX paths are
    short). Yields the socket's path."""
    folder = Path(tempfile.mkdtemp(prefix="edge-slow-", dir="/tmp"))
    os.chmod(folder, 0o755)
    path = folder / "api.sock"
    config = ApiConfig(**{"socket": path, "socket_mode": 0o666, "drain_timeout_s": 2, **config})
    server = ApiServer(Backend(Manifest.read(bundle.path)), [bind_unix(path, config.socket_mode, None)], config)
    server.start()
    server.load_in_background(lambda: engine)
    try:
        deadline = time.monotonic() + 10
        while server.backend.state.value != "ready":
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.01)
        yield path
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def fresh_client(path: Path) -> httpx.Client:
    """A client that opens a new connection for every request (the worst case for the limits)."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=10,
                        limits=httpx.Limits(max_keepalive_connections=0))


def dribble(path: Path, count: int, duration_s: float, report: Callable[[dict], None], interval_s: float = 1.5,
            reconnect: bool = True) -> None:
    """`count` connections that each send one more header line every interval_s and never end their head; one
    the server closes is opened again when `reconnect`. Stops by itself after duration_s; stdlib only (it
    runs in forked children). Reports {"opened"} once all are open, then {"opened", "closed_by_server"}."""
    deadline = time.monotonic() + duration_s
    opened = closed = 0

    def connect() -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(1.0)
        try:
            conn.connect(str(path))
            conn.sendall(HEAD_START)
            return conn
        except OSError:
            conn.close()
            return None

    def top_up(conns: list[socket.socket]) -> None:
        nonlocal opened
        while len(conns) < count and time.monotonic() < deadline:
            if (conn := connect()) is not None:
                conns.append(conn)
                opened += 1

    conns: list[socket.socket] = []
    top_up(conns)
    report({"opened": opened})
    line = 0
    while time.monotonic() + interval_s < deadline:
        time.sleep(interval_s)
        line, alive = line + 1, []
        for conn in conns:
            try:
                conn.sendall(b"X-Slow-%d: %d\r\n" % (line, line))
                alive.append(conn)
            except OSError:  # closed by the server (EPIPE / ECONNRESET)
                conn.close()
                closed += 1
        conns = alive
        if reconnect:
            top_up(conns)
    for conn in conns:
        conn.close()
    report({"opened": opened, "closed_by_server": closed})


@contextmanager
def as_nobody(work: Callable[[Callable[[dict], None], Callable[[], None]], None]):
    """Run work(report, hold) in a child forked and switched to uid and gid 65534: a second peer for the
    per-peer cap (only root may switch). report(dict) sends the parent a report; hold() blocks until the parent
    leaves the block. Yields a function returning the child's next report. The child ends when work returns,
    when the block ends, or after 30 s whatever happens (SIGALRM)."""
    if os.geteuid() != 0:
        pytest.skip("connecting as another user needs root")
    reports_r, reports_w = os.pipe()
    release_r, release_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: stdlib only, and it never returns into pytest
        os.close(reports_r)
        os.close(release_w)
        _run_child(work, reports_w, release_r)
    os.close(reports_w)
    os.close(release_r)
    reports = os.fdopen(reports_r)
    try:
        yield lambda: json.loads(reports.readline() or "null")
    finally:
        os.close(release_w)
        _, status = os.waitpid(pid, 0)
        reports.close()
    assert os.waitstatus_to_exitcode(status) == 0, "the child failed (its traceback is on stderr)"


def _run_child(work, reports_w: int, release_r: int) -> None:
    status = 1
    try:
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(30)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        out = os.fdopen(reports_w, "w", buffering=1)
        work(lambda report: out.write(json.dumps(report) + "\n"), lambda: os.read(release_r, 1))
        status = 0
    except BaseException:  # noqa: BLE001  anything: the child must end in os._exit, never back in pytest
        traceback.print_exc()
    finally:
        os._exit(status)


def raw_request(path: Path, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request on a new connection, read to its end (it asks the server to close): status, headers, body."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(str(path))
        conn.sendall(head.rstrip(b"\r\n") + b"\r\nConnection: close\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_and_headers, _, body = answer.partition(b"\r\n\r\n")
    lines = status_and_headers.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def normal_traffic(path: Path, duration_s: float) -> list[tuple[str, int, str]]:
    """Completions and /health, each on a new connection, for duration_s: (what, status, body) of each."""
    answers = []
    deadline = time.monotonic() + duration_s
    with fresh_client(path) as http:
        while time.monotonic() < deadline:
            r = http.post("/v1/completions", json=COMPLETION)
            answers.append(("completion", r.status_code, r.text[:300]))
            r = http.get("/health")
            answers.append(("health", r.status_code, r.text[:300]))
            time.sleep(0.2)
    return answers


def refused_as_openai(status: int, headers: dict, body: bytes) -> bool:
    error = json.loads(body)["error"]
    return (status == 503 and headers.get("retry-after") == "1" and headers.get("content-type") == "application/json"
            and error["type"] == "server_error" and error["code"] == "too_many_connections" and error["message"])


# ---- floods beside normal traffic ------------------------------------------------------------------------
def test_a_slow_header_flood_from_another_user_leaves_requests_and_health_answering(tiny_fp32_bundle, tiny_engine):
    """300 connections from one user, each sending a header line every 1.5 s and opening again when closed,
    took every place of max_connections (256) for 30 s at a time: every other request and /health got a
    plain-text 503. Now that user holds at most half the places, the rest serve others, and each dribbling
    connection is closed head_timeout_s (5 s) after it opened."""
    with (serving(tiny_fp32_bundle, tiny_engine) as path,
          as_nobody(lambda report, hold: dribble(path, 300, 7.5, report)) as child_report):
        assert child_report()["opened"] == 300
        answers = normal_traffic(path, 6.0)
        end = child_report()
    assert answers and all(status == 200 for _, status, _ in answers), [a for a in answers if a[1] != 200][:3]
    assert end["closed_by_server"] >= 100, end  # the head deadline, not the 30 s request timeout


def test_connections_that_dribble_their_head_make_way_for_requests_of_the_same_user(tiny_fp32_bundle, tiny_engine):
    """The same flood from the test's own user (runs unprivileged): a connection that has sent no head for a
    second is closed when a connection that has sent one needs its place, so the user's own requests and
    /health still answer."""
    with serving(tiny_fp32_bundle, tiny_engine) as path:
        reports: list[dict] = []
        flood = threading.Thread(target=dribble, args=(path, 300, 5.0, reports.append), kwargs={"reconnect": False})
        flood.start()
        try:
            deadline = time.monotonic() + 10
            while not reports:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert reports[0]["opened"] == 300
            time.sleep(SLOW_HEAD_S + 0.2)
            answers = normal_traffic(path, 2.0)
        finally:
            flood.join()
    assert answers and all(status == 200 for _, status, _ in answers), [a for a in answers if a[1] != 200][:3]


# ---- the limits' answers -------------------------------------------------------------------------------
def test_a_request_past_the_connection_limit_gets_openai_json_with_retry_after(tiny_fp32_bundle, tiny_engine):
    """uvicorn answered "Service Unavailable" in plain text, with no Retry-After: openai's clients read it as an
    unknown error. The refusal is now OpenAI's error shape, it closes the connection, and /metrics counts it."""
    with serving(tiny_fp32_bundle, tiny_engine, max_connections=2) as path:
        idle = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        for conn in idle:
            conn.connect(str(path))
        with fresh_client(path) as http:
            r = http.post("/v1/completions", json=COMPLETION)
            assert refused_as_openai(r.status_code, r.headers, r.content), (r.status_code, r.headers, r.text)
            assert r.headers["connection"] == "close"
        for conn in idle:
            conn.close()
        time.sleep(0.2)  # the server sees them go
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost") as http:
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
            assert 'code="too_many_connections"} 1.0' in http.get("/metrics").text  # on the same connection


def test_one_user_over_its_cap_is_refused_while_others_are_served(tiny_fp32_bundle, tiny_engine):
    """Connections are counted per peer uid (SO_PEERCRED): a user holding max_connections_per_peer gets 503 for
    one more, while another user, here the test's own, is served beside it, /health included."""
    def greedy(report, hold) -> None:
        held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
        for conn in held:
            conn.connect(str(path))
        status, headers, body = raw_request(path, b"GET /v1/models HTTP/1.1\r\nHost: agent\r\n")
        report({"status": status, "headers": headers, "body": body.decode()})
        hold()  # its two connections stay open while the parent is served

    with (serving(tiny_fp32_bundle, tiny_engine, max_connections=8, max_connections_per_peer=2) as path,
          as_nobody(greedy) as child_report):
        refused = child_report()
        assert refused_as_openai(refused["status"], refused["headers"], refused["body"].encode()), refused
        assert "uid 65534" in json.loads(refused["body"])["error"]["message"]
        with fresh_client(path) as http:  # while the other user still holds its two
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
            assert http.get("/health").status_code == 200


# ---- the bookkeeping on its own --------------------------------------------------------------------------
def test_the_last_places_are_kept_for_health_and_metrics():
    limits = ConnectionLimits(max_connections=4, per_peer=4, status_reserve=1)
    for key in "abc":
        limits.open(key, "uid 1", 0.0)
        assert limits.admit(key, "/v1/completions", 0.0).refusal is None
    limits.open("d", "uid 1", 0.0)
    assert limits.state("d") is ConnState.OVERFLOW
    refused = limits.admit("d", "/v1/chat/completions", 0.0)
    assert refused.limit == "max_connections" and "kept for /health" in refused.refusal
    assert limits.state("d") is ConnState.REFUSED
    limits.open("e", "uid 1", 0.0)
    assert limits.admit("e", "/health", 0.0).refusal is None
    limits.responded("e", 0.1)  # the reserved place goes back: e waits without one
    assert limits.state("e") is ConnState.OVERFLOW and limits.num_places == 3


def test_a_peer_at_its_cap_makes_way_only_from_its_own_slow_connections():
    limits = ConnectionLimits(max_connections=8, per_peer=2, status_reserve=0)
    for key in ("a1", "a2"):
        limits.open(key, "uid 1", 0.0)
    limits.open("b1", "uid 2", 0.0)  # another peer's slow connection is never taken for peer 1's cap
    limits.open("a3", "uid 1", 0.5)
    assert limits.admit("a3", "/health", 0.5).limit == "max_connections_per_peer"  # a1, a2 are not slow yet
    limits.open("a4", "uid 1", 0.5)
    decision = limits.admit("a4", "/v1/models", SLOW_HEAD_S)
    assert decision.refusal is None and decision.evict == ("a1",)  # the one waiting longest
    assert limits.state("a1") is None and limits.state("b1") is ConnState.WAITING
    limits.closed("a1")  # its connection_lost comes later: nothing to do


def test_overflow_is_bounded_and_sheds_its_slowest_first():
    limits = ConnectionLimits(max_connections=2, per_peer=1, status_reserve=0)
    limits.open("held", "uid 1", 0.0)
    for key in ("o1", "o2"):
        assert limits.open(key, "uid 1", 0.0).refusal is None
    assert limits.num_overflow == 2
    assert limits.open("o3", "uid 1", 0.5).refusal is not None  # overflow full, nobody slow: closed at once
    assert limits.open("o4", "uid 1", SLOW_HEAD_S).evict == ("o1",)
    assert limits.num_overflow == 2 and limits.state("o4") is ConnState.OVERFLOW


def test_the_per_peer_cap_is_validated_against_max_connections():
    with pytest.raises(ValidationError, match="max_connections_per_peer"):
        ApiConfig(max_connections=4, max_connections_per_peer=5)
    assert ApiConfig().connections_per_peer == 128 and ApiConfig(max_connections=2).status_places == 1
    assert ApiConfig(request_timeout_s=0.5).head_deadline_s == 0.5
