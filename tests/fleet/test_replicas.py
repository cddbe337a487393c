"""Several `edge-fleet serve` replicas on one PostgreSQL: one rollout leader at a time (fleet.leader), a
replica SIGKILLed mid-stream or mid-rollout, and nothing lost or done twice."""
from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter

import pytest

from agent.wire import JobDocument, JobState, JobStatusUpdate, topic
from fleet.db import open_database
from fleet.leader import Leadership
from devicepool import DevicePool
from fleet_support import ServeProcess, stop_all, wait_until
from simdevice import SimDevice


# ---- the lock -----------------------------------------------------------------------------------------------
def test_one_replica_leads_until_it_lets_go(fleet_target):
    first, second = Leadership(fleet_target), Leadership(fleet_target)
    assert first.acquire() and first.acquire()  # held, and kept
    assert not second.acquire()
    first.release()
    assert second.acquire() and not first.acquire()
    second.release()


def test_a_leader_whose_connection_dies_loses_the_lead_and_another_takes_it(postgres_url, caplog):
    leader, follower = Leadership(postgres_url), Leadership(postgres_url)
    assert leader.acquire() and not follower.acquire()
    with leader.database() as db:
        pid = db.execute("select pg_backend_pid()").fetchone()[0]
    with open_database(postgres_url) as admin:
        admin.execute("select pg_terminate_backend(?)", [pid])  # as a network partition or a DBA would
    assert follower.acquire()
    with caplog.at_level(logging.WARNING, logger="fleet.leader"):
        assert not leader.acquire()
    assert "lost the leader lock" in caplog.text
    follower.release()


# ---- replicas as processes ------------------------------------------------------------------------------------
def serve(broker, target, tmp_path, name: str, *extra) -> ServeProcess:
    return ServeProcess(broker.url, target, name, shared_group="fleet", log=tmp_path / f"{name}.log",
                        extra_args=extra)


def rows(target, sql: str, params=()) -> list[dict]:
    with open_database(target) as db:
        return list(db.query(sql, params))


def stored(target) -> set[tuple]:
    with open_database(target) as db:
        return {tuple(r) for t in ("requests", "samples", "events")
                for r in db.execute(f"select device_id, boot_id, seq from {t}").fetchall()}


@pytest.fixture
def big_queue_broker(tmp_path):
    """Mosquitto with the shipped config's session queue (systemd/mosquitto): the default 1,000 drops what a
    dead replica's session is sent beyond it, already acknowledged to the devices (docs/scaling.md)."""
    from broker import Broker

    b = Broker(tmp_path / "broker", extra_config="allow_anonymous true\nmax_queued_messages 200000\n").start()
    yield b
    b.stop()


def test_a_replica_killed_mid_stream_loses_nothing_and_stores_nothing_twice(postgres_url, big_queue_broker, tmp_path):
    """200 devices over two replicas on one PostgreSQL; one is SIGKILLed mid-stream. The other carries on;
    what the broker held for the dead one's session arrives when it is back; each record is stored once."""
    broker = big_queue_broker
    replicas = [serve(broker, postgres_url, tmp_path, f"fleet-{k}") for k in range(2)]
    for r in replicas:
        r.wait_connected()
    # in a process of their own: 200 paho clients here would pass select()'s 1,024 descriptors in the full suite
    pool = DevicePool(broker.port, [f"dev-{i:03d}" for i in range(200)], records=60, rounds=30, every_s=0.1)
    try:
        wait_until(lambda: pool.rounds_done >= 10, 60, message="a third of the stream")
        replicas[0].proc.kill()  # mid-stream, no clean stop: its uncommitted batch is lost with it
        at_kill = len(stored(postgres_url))
        wait_until(lambda: len(stored(postgres_url)) > at_kill + 1000, 30, message="the survivor to carry on")
        replicas[0] = serve(broker, postgres_url, tmp_path, "fleet-0")  # its session's backlog comes back
        replicas[0].wait_connected()
        wait_until(lambda: pool.produced is not None, 60, message="every batch acknowledged by the broker")
        assert pool.unacked == 0 and len(pool.produced) == 200 * 60
        wait_until(lambda: stored(postgres_url) == pool.produced, 30, message="every record stored")
        for r in replicas:  # two replicas' commits queue on the registry's rows in one order
            assert "deadlock detected" not in r.log.read_text()
        with open_database(postgres_url) as db:
            total = sum(db.execute(f"select count(*) from {t}").fetchone()[0] for t in ("requests", "samples", "events"))
        assert total == len(pool.produced)  # keyed rows: a record stored twice would be refused
    finally:
        pool.stop()
        stop_all([], replicas)


class JobTaker(SimDevice):
    """A simulated device that takes rollout notices: counts each job's notices and reports SUCCEEDED
    (retained, as the agent does) `work_s` after the first."""

    def __init__(self, *args, work_s: float = 0.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.work_s, self.notices = work_s, Counter()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        super()._on_connect(client, userdata, flags, reason_code, properties)
        client.subscribe(topic(self.device_id, "jobs", "notify"), qos=1)

    def _on_message(self, client, userdata, message) -> None:
        if not message.topic.endswith("/jobs/notify"):
            return super()._on_message(client, userdata, message)
        job_id = JobDocument.model_validate_json(message.payload).job_id
        self.notices[job_id] += 1
        if self.notices[job_id] == 1:
            threading.Timer(self.work_s, self._done, [job_id]).start()

    def _done(self, job_id: str) -> None:
        update = JobStatusUpdate(job_id=job_id, device_id=self.device_id, state=JobState.SUCCEEDED, ts=time.time())
        self._publish_other(topic(self.device_id, "jobs", "update"), update.model_dump_json(), retain=True)


def leader_of(replicas) -> int | None:
    leading = [k for k, r in enumerate(replicas) if r.proc.poll() is None and "leads rollouts now" in r.log.read_text()]
    return leading[-1] if len(leading) == 1 else None


def test_the_rollout_leader_killed_mid_rollout_hands_the_job_to_another(postgres_url, broker, tmp_path):
    """Two replicas with rollouts on; the leader is SIGKILLed with waves still to go. The other takes the
    lead, finishes the job, and every device ends SUCCEEDED having been sent its notice once."""
    from fleet.updates import create_job

    artifacts = ("--artifacts-http", "127.0.0.1:0", "--artifacts-dir", tmp_path / "artifacts")
    replicas = [serve(broker, postgres_url, tmp_path, f"fleet-{k}", *artifacts) for k in range(2)]
    for r in replicas:
        r.wait_connected()
    leader = wait_until(lambda: leader_of(replicas) is not None, 20, message="a leader") and leader_of(replicas)
    fleet = [JobTaker(broker.port, f"dev-{i:02d}", seed=i).start() for i in range(20)]
    try:
        for d in fleet:
            d.wait_connected()
        wait_until(lambda: len(rows(postgres_url, "select id from devices where status = 'online'")) == 20, 20,
                   message="every device online in the registry")
        with open_database(postgres_url) as db:
            job_id = create_job(db, None, [d.device_id for d in fleet], 4, 0.0, operation="rollback")
        notified = f"select device_id from job_devices where job_id = '{job_id}' and notified = 1"
        wait_until(lambda: len(rows(postgres_url, notified)) >= 8, 30, message="two waves notified")
        replicas[leader].proc.send_signal(signal.SIGKILL)
        assert len(rows(postgres_url, notified)) < 20, "the job ended before the leader was killed"
        survivor = replicas[1 - leader]
        wait_until(lambda: "leads rollouts now" in survivor.log.read_text(), 20, message="the other replica to lead")
        wait_until(lambda: rows(postgres_url, "select state from jobs where id = ?", [job_id])[0]["state"]
                   != JobState.IN_PROGRESS.value, 60, message="the job to end")
        states = Counter(r["state"] for r in rows(postgres_url, "select state from job_devices where job_id = ?",
                                                   [job_id]))
        assert rows(postgres_url, "select state from jobs where id = ?", [job_id])[0]["state"] == "SUCCEEDED"
        assert states == {"SUCCEEDED": 20}
        assert {d.device_id: d.notices[job_id] for d in fleet} == {d.device_id: 1 for d in fleet}
    finally:
        stop_all(fleet, replicas)

