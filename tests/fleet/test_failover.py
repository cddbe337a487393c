"""The fleet's PostgreSQL failing over under load: a primary and its streaming standby, the primary stopped
while two replicas ingest, the standby promoted; the replicas reach it through libpq's multi-host URL and
every record the devices sent is there exactly once."""
from __future__ import annotations

import time

import pytest

from fleet.db import open_database
from fleet_support import ServeProcess, stop_all, wait_until
from simdevice import SimDevice


@pytest.fixture
def primary_and_standby():
    from postgres import Postgres, database_name

    primary = Postgres().start()
    url = primary.fresh_database()
    standby = primary.standby()  # after the database exists: the base backup carries it
    yield primary, standby, database_name(url)
    for server in (standby, primary):
        server.stop()


def keys(url: str) -> list[tuple]:
    with open_database(url) as db:
        return [tuple(r) for t in ("requests", "samples", "events")
                for r in db.execute(f"select device_id, boot_id, seq from {t}").fetchall()]


def test_a_promoted_standby_takes_over_and_every_record_is_there_once(primary_and_standby, broker, tmp_path):
    primary, standby, name = primary_and_standby
    url = (f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/{name}"
           "?target_session_attrs=read-write")
    replicas = [ServeProcess(broker.url, url, f"fleet-{k}", shared_group="fleet", log=tmp_path / f"fleet-{k}.log")
                for k in range(2)]
    fleet = [SimDevice(broker.port, f"dev-{i:02d}", seed=i).start() for i in range(50)]
    try:
        for r in replicas:
            r.wait_connected()
        for d in fleet:
            d.wait_connected()
        for round_ in range(40):
            for d in fleet:
                d.emit(2)
            if round_ == 10:
                primary.stop()  # under load: the replicas' commits fail from here
            if round_ == 15:
                standby.promote()
            time.sleep(0.1)
        wait_until(lambda: all(d.unacked == 0 for d in fleet), 60, message="every batch acknowledged")
        expected = {(d.device_id, r.boot_id, r.seq) for d in fleet for r in d.produced}
        new_primary = standby.database_url(name)
        wait_until(lambda: set(keys(new_primary)) == expected, 60, message="every record on the new primary")
        stored = keys(new_primary)
        assert len(stored) == len(set(stored)) == 50 * 40 * 2
        assert all(r.proc.poll() is None for r in replicas), "a replica gave up"
        assert any("failed" in r.log.read_text() for r in replicas)  # the outage was seen, and ridden out
    finally:
        stop_all(fleet, replicas)
