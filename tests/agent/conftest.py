"""Fixtures shared by several agent test modules: the telemetry database path, MQTT links on their own stores, the
tiny model served by a real ApiServer (module-scoped: each test module builds its own) and the real model's, and for
the update tests two bundles of the tiny model, a fleet key pair and an artifact server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.link.mqtt import MqttLink
from agent.link.store import TelemetryStore
from agent.link.telemetry import DB_NAME
from fleet.artifacts import ArtifactServer
from quantize.package import build_bundle
from quantize.precision import QuantSpec

sys.path.insert(0, str(Path(__file__).parent))  # *_support.py; mqtt_support.py from the crash tests' subprocess too

from api_support import TINY_ENGINE, serving  # noqa: E402
from mqtt_support import fast_config  # noqa: E402
from updates_support import build_bundles, make_keys  # noqa: E402


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / DB_NAME


@pytest.fixture
def links(tmp_path):
    """make(broker_url, device_id, **config) -> a started MqttLink on its own store; all stopped at the end."""
    made: list[MqttLink] = []

    def make(url: str, device: str, handler=None, db: Path | None = None, **config) -> MqttLink:
        store = TelemetryStore(db or tmp_path / f"{device}-{len(made)}.db", device)
        link = MqttLink(fast_config(url, **config), device, store, handler=handler,
                        describe=lambda: {"model": "smollm2", "version": "int4-test"})
        made.append(link)
        link.start()
        return link

    yield make
    for link in made:
        link.stop()
        link.store.close()


@pytest.fixture(scope="module")
def tiny_bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("api") / "fp32", name="tiny",
                        progress=lambda s: None)


@pytest.fixture(scope="module")
def tiny_engine(tiny_bundle):
    engine = Engine(tiny_bundle, TINY_ENGINE)
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def tiny(tiny_bundle, tiny_engine):
    with serving(tiny_bundle, tiny_engine) as served:
        yield served


@pytest.fixture(scope="module")
def real(real_fp32_bundle):
    # the engine's baseline is this whole process's resident memory, which the session's fixtures (checkpoints
    # held in float32) keep grown in a full run: a budget with room for any of it, as every engine here not
    # testing the budget has (the KV pool's pages are lazy, so it costs nothing)
    engine = Engine(real_fp32_bundle, EngineConfig(threads=2, memory_budget_mb=16000, max_context=1024))
    engine.start()
    with serving(real_fp32_bundle, engine) as served:
        yield served
    engine.stop()


@pytest.fixture(scope="module")
def bundles(tiny_checkpoint, tmp_path_factory):
    return build_bundles(tiny_checkpoint, tmp_path_factory.mktemp("upd"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return make_keys(tmp_path_factory.mktemp("keys"))


@pytest.fixture
def server(tmp_path):
    s = ArtifactServer(tmp_path / "artifacts").start()
    yield s
    s.stop()
