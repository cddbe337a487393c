"""A real engine and API server on a fresh Unix socket, for the tests that send HTTP requests to a real bundle
(tests/agent/test_structured.py, tests/agent/test_structured_fuzz.py)."""
from __future__ import annotations

import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from agent.api.backend import Backend
from agent.api.http_server import ApiServer, bind_unix
from agent.config import ApiConfig, EngineConfig
from agent.engine.engine import Engine
from agent.wire import Manifest


def engine_config() -> EngineConfig:
    """A budget of this process's resident memory + 1.5 GB: the engine measures its baseline as the process's
    RSS, which session fixtures run before (other models' checkpoints) may have taken to several GB."""
    rss_mb = int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) // 1024
    return EngineConfig(threads=2, memory_budget_mb=rss_mb + 1536, max_context=1024)


@contextmanager
def serving(bundle):
    """A real server and running engine on a fresh Unix socket (AF_UNIX paths are short: not under tmp_path)."""
    engine = Engine(bundle, engine_config())
    engine.start()
    folder = Path(tempfile.mkdtemp(prefix="edge-structured-", dir="/tmp"))
    config = ApiConfig(socket=folder / "api.sock", drain_timeout_s=2)
    server = ApiServer(Backend(Manifest.read(bundle.path)), [bind_unix(config.socket, config.socket_mode, None)],
                       config)
    server.start()
    server.load_in_background(lambda: engine)
    try:
        deadline = time.monotonic() + 30
        while server.backend.state.value != "ready":
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.01)
        yield folder / "api.sock"
    finally:
        server.stop()
        engine.stop()
        shutil.rmtree(folder, ignore_errors=True)


def http(path: Path, timeout_s: float = 60) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=timeout_s)
