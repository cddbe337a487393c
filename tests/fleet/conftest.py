"""Fleet test fixtures: in-process consumers, `edge-fleet serve` subprocesses and simulated devices."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # simdevice.py, fleet_support.py

from fleet_support import ServeProcess  # noqa: E402
from simdevice import SimDevice  # noqa: E402


@pytest.fixture
def fleet_db(tmp_path) -> Path:
    return tmp_path / "fleet.db"


@pytest.fixture
def consumers(broker, fleet_db):
    """start(client_id=..., store=...) -> a started in-process Consumer; all stopped at teardown."""
    from fleet.consumer import Consumer
    from fleet.store import FleetStore

    started = []

    def start(client_id: str = "fleet-test", store=None, **kwargs):
        consumer = Consumer(store or FleetStore(fleet_db), broker.url, client_id=client_id, **kwargs).start()
        started.append(consumer)
        assert consumer.wait_ready(10), "consumer did not connect"
        return consumer

    yield start
    for consumer in started:
        consumer.stop()


@pytest.fixture
def devices(broker):
    """make(device_id, **kwargs) -> a started, connected SimDevice; all disconnected at teardown."""
    made = []

    def make(device_id: str, **kwargs) -> SimDevice:
        device = SimDevice(broker.port, device_id, **kwargs).start()
        device.wait_connected()
        made.append(device)
        return device

    yield make
    for device in made:
        device.client.disconnect()  # wakes paho's loop, so loop_stop() does not wait out a select timeout
        device.client.loop_stop()


@pytest.fixture
def serve_processes():
    started: list[ServeProcess] = []

    def start(*args, **kwargs) -> ServeProcess:
        p = ServeProcess(*args, **kwargs)
        started.append(p)
        p.wait_connected()
        return p

    yield start
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


@pytest.fixture(params=["sqlite", "postgresql"])
def fleet_target(request, tmp_path):
    """The fleet database on each backend: a SQLite file's path, or a fresh PostgreSQL database's URL."""
    if request.param == "sqlite":
        return tmp_path / "fleet.db"
    return request.getfixturevalue("postgres_url")
