"""Real API servers for tests: the socket server and a running engine in this process (`serving`, with `http`
for a client of its socket), or `edge-agent serve` as its own process (`agent_process`) for models whose memory
planning must not count this test process's heap."""
from __future__ import annotations

import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai

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


@contextmanager
def agent_process(bundle, workdir: Path):
    """`edge-agent serve` on a real-architecture bundle, as its own process: the memory planner counts its
    process's peak RSS as the model's, and this test process holds far more than a device would."""
    from processes import Agent

    agent = Agent(workdir, "--model", bundle.path, "--memory-budget-mb", 4096)
    agent.start(timeout_s=180)
    try:
        yield openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0, timeout=120,
                            http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(agent.sock))))
    finally:
        assert agent.stop() == 0


def http(path: Path, timeout_s: float = 60) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=timeout_s)
