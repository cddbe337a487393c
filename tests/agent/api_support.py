"""What the local-API tests share: the tiny engine's settings, a real ApiServer on a fresh Unix socket (`serving`,
yielding a `Served` with an httpx client, an openai client and /metrics read back), polling and SSE parsing. The
fixtures built on them are in tests/agent/conftest.py."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from agent.api.backend import Backend
from agent.config import ApiConfig, EngineConfig
from agent.engine.engine import Engine
from agent.api.http_server import ApiServer, bind_unix
from agent.wire import Manifest


# an engine's baseline is the whole process's resident memory, which a full run's session fixtures keep at GBs:
# engines that do not test the budget get one with room for any of it (the KV pool's pages are lazy)
TINY_ENGINE = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=64)


USER_HI = [{"role": "user", "content": "Hello there"}]


@dataclass
class Served:
    server: ApiServer
    path: Path
    engine: Engine | None

    def http(self, timeout_s: float = 30.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path)), base_url="http://localhost",
                            timeout=timeout_s)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url="http://localhost/v1", api_key="x", max_retries=0,
                             http_client=httpx.Client(transport=httpx.HTTPTransport(uds=str(self.path))))

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v"}': value}."""
        text = self.http().get("/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out


@contextmanager
def serving(bundle, engine: Engine | None, load=None, **config):
    """A real server on a fresh Unix socket (AF_UNIX paths are short: not under pytest's tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="edge-api-", dir="/tmp"))
    path = folder / "api.sock"
    config = ApiConfig(**{"socket": path, "drain_timeout_s": 2, **config})
    server = ApiServer(Backend(Manifest.read(bundle.path)), [bind_unix(path, config.socket_mode, None)], config)
    server.start()
    server.load_in_background(load or (lambda: engine))
    try:
        if load is None:
            wait_for(lambda: server.backend.state.value == "ready")
        yield Served(server, path, engine)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def sse_events(raw: str) -> list[dict]:
    """The JSON events of a well-formed SSE body; asserts the framing and the closing [DONE]."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")[:-1]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    assert blocks[-1] == "data: [DONE]" and "data: [DONE]" not in blocks[:-1]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]
