"""Fixtures shared by several agent test modules: the telemetry database path, MQTT links on their own stores."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.link.mqtt import MqttLink
from agent.link.store import TelemetryStore
from agent.link.telemetry import DB_NAME

sys.path.insert(0, str(Path(__file__).parent))  # mqtt_support.py, importable from the crash tests' subprocess too

from mqtt_support import fast_config  # noqa: E402


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
