"""The MQTT link against a real Mosquitto: telemetry delivered across outages, crashes and slow uplinks, and the
device's retained presence.

This file is also the publisher subprocess of the crash tests: `python tests/agent/test_mqtt_delivery.py child ...`.

Run: .venv/bin/pytest tests/agent/test_mqtt_delivery.py -q
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.config import AgentConfig, TelemetryConfig
from agent.mqtt_link import LinkState
from agent.link.mqtt import MqttLink
from agent.link.outbox import fit_batch
from agent.link.store import OutboxRow, TelemetryStore
from agent.wire import MAX_PAYLOAD_BYTES, EventRecord, TelemetryBatch, TelemetryRecord
from mqtt_support import REPO, TIMEOUT_S, Fleet, fast_config, retained_state, wait_until


def test_a_batch_stays_under_the_payload_limit():
    body = EventRecord(kind="tick", detail={"x": "y" * 100_000})
    text = TelemetryRecord(boot_id="b", seq=0, ts=0.0, kind="event", event=body).model_dump_json()
    rows = [OutboxRow(i, text, TelemetryRecord.model_validate_json(text)) for i in range(5)]
    fitted = fit_batch(rows)
    assert len(fitted) == 2
    assert len(TelemetryBatch(device_id="d", records=[r.record for r in fitted]).model_dump_json()) < MAX_PAYLOAD_BYTES


def test_every_record_arrives_across_a_broker_outage(broker, links):
    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"])
    link = links(broker.url, "dev-a")
    assert wait_until(lambda: link.is_connected)
    store = link.store
    for i in range(1000):
        store.append(EventRecord(kind="tick", detail={"i": i}))
        link.notify()
        if i == 250:
            broker.stop()  # records keep being committed while the broker is away
        elif i == 700:
            time.sleep(0.5)  # several refused attempts, backing off
            assert link.state in (LinkState.BACKOFF, LinkState.CONNECTING) and store.count_unsent() >= 450
            broker.start()
    expected = {(store.boot_id, seq) for seq in range(1000)}
    assert fleet.wait(lambda f: f.tele_keys >= expected), f"missing {len(expected - fleet.tele_keys)} records"
    assert wait_until(lambda: store.count_unsent() == 0)
    assert store.connections >= 3  # refused attempts, then it reconnected by itself
    fleet.close()


class Child:
    """The publisher subprocess (child_main below), with its stdout read into lines."""

    def __init__(self, db: Path, url: str, device: str, count: int):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, __file__, "child", str(db), url, device, str(count)],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_line(self, predicate, timeout_s: float = TIMEOUT_S) -> bool:
        return wait_until(lambda: any(predicate(line) for line in list(self.lines)), timeout_s)

    def committed(self) -> int:
        return max((int(line.split()[1]) for line in list(self.lines) if line.startswith("committed ")), default=-1)


@pytest.fixture
def spawn():
    """spawn(db, url, device, count) -> a running Child; any still alive at the end is killed."""
    children: list[Child] = []

    def make(*args) -> Child:
        children.append(Child(*args))
        return children[-1]

    yield make
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait(10)


def child_main(db: str, url: str, device: str, count: int) -> None:
    """Append `count` records through the store, announcing each commit, while the link publishes; then
    keep delivering until SIGTERM, and stop cleanly."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    store = TelemetryStore(Path(db), device)
    link = MqttLink(fast_config(url), device, store)
    link.start()
    for i in range(count):
        store.append(EventRecord(kind="tick", detail={"i": i}))
        print(f"committed {i}", flush=True)  # after the commit: everything printed must survive a SIGKILL
    print("appended", flush=True)
    while not stop.wait(0.1):
        pass
    link.stop()
    print("stopped", flush=True)


def db_rows(db: Path) -> list[tuple[str, int, int]]:
    with sqlite3.connect(db) as conn:
        return conn.execute("SELECT boot_id, seq, sent FROM records ORDER BY id").fetchall()


def test_sigkill_while_publishing_loses_nothing_committed(broker, tmp_path, spawn):
    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"])
    db = tmp_path / "telemetry.db"
    child = spawn(db, broker.url, "dev-k", 1000)
    assert child.wait_line(lambda line: line == "committed 600")
    assert fleet.wait(lambda f: len(f.tele_keys) > 0)  # delivery is under way
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait(10)
    rows = db_rows(db)
    (boot,) = {b for b, _, _ in rows}
    assert [seq for _, seq, _ in rows] == list(range(len(rows)))  # contiguous: no committed row lost
    assert len(rows) > child.committed() >= 600
    assert any(sent == 0 for *_, sent in rows), "killed after everything was delivered: nothing was tested"

    again = spawn(db, broker.url, "dev-k", 0)  # a new boot of the same device delivers what is left
    expected = {(boot, seq) for _, seq, _ in rows}
    assert fleet.wait(lambda f: f.tele_keys >= expected), f"missing {len(expected - fleet.tele_keys)} records"
    assert wait_until(lambda: all(sent for *_, sent in db_rows(db)))
    again.proc.terminate()
    assert again.proc.wait(10) == 0 and again.wait_line(lambda line: line == "stopped", 1)
    fleet.close()


def test_birth_is_retained_the_will_says_offline_and_a_clean_stop_says_stopped(broker, tmp_path, links, spawn):
    fleet = Fleet(broker, subscribe=["edge/v1/+/state"])
    db = tmp_path / "telemetry.db"
    child = spawn(db, broker.url, "dev-p", 0)
    assert fleet.wait(lambda f: (s := f.last_state("dev-p")) is not None and s.status == "online")
    birth = fleet.last_state("dev-p")
    assert retained_state(broker, "dev-p") == birth

    child.proc.send_signal(signal.SIGKILL)  # the connection dies without a DISCONNECT: the broker sends the Will
    child.proc.wait(10)
    assert fleet.wait(lambda f: f.last_state("dev-p").status == "offline")
    will = retained_state(broker, "dev-p")
    assert (will.status, will.connection, will.boot_id) == ("offline", birth.connection, birth.boot_id)

    link = links(broker.url, "dev-p", db=db)  # the same device starts again, then stops cleanly
    assert fleet.wait(lambda f: f.last_state("dev-p").status == "online")
    assert fleet.last_state("dev-p").connection == birth.connection + 1  # the counter survived the crash
    link.stop()
    assert fleet.wait(lambda f: f.last_state("dev-p").status == "stopped")
    time.sleep(0.3)  # a Will, if the broker were to send one, would come now
    final = retained_state(broker, "dev-p")
    assert (final.status, final.connection) == ("stopped", birth.connection + 1)
    assert fleet.last_state("dev-p").status == "stopped"
    fleet.close()


def test_the_state_is_published_again_when_the_model_changes(broker, tmp_path):
    """After an update the fleet's registry named the old model until the device reconnected,
    and `edge-fleet deploy` skips the devices it says are already on the target."""
    fleet = Fleet(broker, subscribe=["edge/v1/+/state"])
    described = {"model": "smollm2", "version": "int4-a"}
    store = TelemetryStore(tmp_path / "t.db", "dev-m")
    link = MqttLink(fast_config(broker.url), "dev-m", store, describe=lambda: dict(described))
    link.start()
    try:
        assert fleet.wait(lambda f: (s := f.last_state("dev-m")) is not None and s.version == "int4-a")
        birth = fleet.last_state("dev-m")
        described["version"] = "int4-b"
        link.publish_state()
        assert fleet.wait(lambda f: f.last_state("dev-m").version == "int4-b")
        now = retained_state(broker, "dev-m")
        assert (now.status, now.connection, now.boot_id, now.version) == ("online", birth.connection,
                                                                          birth.boot_id, "int4-b")
    finally:
        link.stop()
        store.close()
        fleet.close()


def test_a_record_over_the_brokers_packet_limit_is_dropped_and_the_rest_delivered(tmp_path, links):
    """A broker with a smaller packet limit dropped the connection at the first batch, which went first again
    on every new connection: nothing was delivered, and the device reconnected for good."""
    from broker import Broker

    small = Broker(tmp_path / "small", extra_config="allow_anonymous true\nmax_packet_size 2000\n").start()
    try:
        fleet = Fleet(small, subscribe=["edge/v1/+/tele"], client_id="fleet-small")
        link = links(small.url, "dev-p")
        assert wait_until(lambda: link.is_connected)
        link.store.append(EventRecord(kind="tick", detail={"big": "x" * 3000}))
        for i in range(5):
            link.store.append(EventRecord(kind="tick", detail={"i": i}))
        link.notify()
        boot = link.store.boot_id
        assert fleet.wait(lambda f: {(boot, seq) for seq in range(1, 6)} <= f.tele_keys), fleet.tele_keys
        assert wait_until(lambda: link.store.count_unsent() == 0)
        assert (boot, 0) not in fleet.tele_keys and link.store.connections == 1
        events = [r.event for m in fleet.messages for r in TelemetryBatch.model_validate_json(m.payload).records]
        assert [e.detail["too_large"] for e in events if e.kind == "dropped_rows"] == [1]
        fleet.close()
    finally:
        small.stop()


def test_a_backlog_drains_over_an_uplink_too_slow_for_full_batches_within_a_keepalive(broker, links):
    """Over a 600-1,000 B/s uplink (enough for the backlog) a window of full batches took
    longer than two keepalives to send, paho closed the connection for want of a PINGRESP queued behind them,
    and the next connection sent the same batches first: nothing was delivered, for as long as it lasted.
    Here 60 kB wait behind a 3 kB/s uplink with a 5 s keepalive: the first connection dies under its full
    window, the next ones start small (SLOW_START_BYTES) and grow with each PUBACK."""
    from slowlink import SlowUplink

    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"])
    uplink = SlowUplink(broker.port, up_bytes_per_s=3000)
    try:
        link = links(uplink.url, "dev-slow", keepalive_s=5)
        assert wait_until(lambda: link.is_connected)
        for i in range(120):
            link.store.append(EventRecord(kind="tick", detail={"i": i, "pad": "x" * 400}))
        link.notify()
        boot = link.store.boot_id
        expected = {(boot, seq) for seq in range(120)}
        assert fleet.wait(lambda f: expected <= f.tele_keys, 120.0), f"{len(expected - fleet.tele_keys)} missing"
        assert wait_until(lambda: link.store.count_unsent() == 0)
        assert uplink.connections >= 2  # the full window did time out once
    finally:
        uplink.close()
        fleet.close()


def test_only_recent_job_statuses_are_kept_for_a_reconnect_and_the_latest_goes_last(tmp_path):
    """Every job's status was kept for good and re-sent at every reconnect, in the order the
    jobs first reported, so the retained one could be an old job's."""
    from agent.link.mqtt import JOB_STATUSES_KEPT

    store = TelemetryStore(tmp_path / "d.db", "dev-j")
    link = MqttLink(fast_config("mqtt://127.0.0.1:1"), "dev-j", store)  # never started: nothing is sent
    for i in range(20):
        link.publish_job_status(f'{{"job": {i}}}', f"job-{i}")
    link.publish_job_status('{"job": 15, "again": true}', "job-15")
    kept = [f"job-{i}" for i in range(20 - JOB_STATUSES_KEPT, 20) if i != 15] + ["job-15"]
    assert list(link._job_status) == kept
    store.close()


def test_telemetry_wiring_records_samples_and_delivers(broker, tmp_path):
    """What serve wiring does: open, start, bind the engine, record requests, stop."""
    from agent.link.telemetry import Telemetry
    from agent.wire import RequestFigures

    class FakeEngine:
        num_running, num_waiting = 2, 1

        def kv_utilization(self) -> float:
            return 0.25

    fleet = Fleet(broker, subscribe=["edge/v1/dev-t/#"])
    config = AgentConfig(telemetry=TelemetryConfig(state_dir=tmp_path, device_id="dev-t", sample_interval_s=0.1,
                                                   mqtt=fast_config(broker.url)))
    telemetry = Telemetry.open(config, describe=lambda: {"model": "smollm2", "version": "int4-x"})
    telemetry.start()
    telemetry.bind_engine(FakeEngine())
    figures = RequestFigures(prompt_tokens=5, completion_tokens=30, queue_ms=0, ttft_ms=12.5, prefill_tokens_per_s=400,
                             decode_tokens_per_s=25, itl_p50_ms=40, itl_p95_ms=45, e2e_ms=300, kv_bytes=1024,
                             finish_reason="stop")
    telemetry.record_request("smollm2", "int4-x", figures)
    (body,) = telemetry.store.db.execute("SELECT body FROM records WHERE kind = 'request'").fetchone()
    request = TelemetryRecord.model_validate_json(body)  # committed before record_request returned
    assert request.kind == "request" and request.request.figures == figures

    def received(f: Fleet) -> dict[int, object]:
        return {r.seq: r for m in f.messages if m.topic.endswith("/tele")
                for r in TelemetryBatch.model_validate_json(m.payload).records}

    assert fleet.wait(lambda f: request.seq in received(f) and any(
        r.kind == "sample" and seq > request.seq for seq, r in received(f).items()))
    records = received(fleet)
    assert records[request.seq] == request and records[0].event.kind == "start"
    sample = next(r.sample for seq, r in sorted(records.items()) if r.kind == "sample" and seq > request.seq)
    assert (sample.running, sample.queue_depth, sample.kv_utilization) == (2, 1, 0.25) and sample.rss_mb > 10
    assert sample.tokens_per_s * sample.interval_s == pytest.approx(30)  # the request's tokens, in that interval
    assert fleet.last_state("dev-t").model == "smollm2"
    flushed = fleet.call("dev-t", "telemetry_flush")
    assert flushed.ok and flushed.result["connected"]
    telemetry.stop()
    assert fleet.wait(lambda f: f.last_state("dev-t").status == "stopped")
    fleet.close()


def test_a_clock_step_is_an_event_and_the_state_is_published_again(broker, tmp_path):
    """A box without an RTC boots in 1970: its retained birth carried that stamp, and a fleet that read it after
    its own restart ranked it behind the previous boot's states (the device showed offline until it next
    connected). When NTP steps the clock, the state goes out again with the right stamp."""
    from agent.link.telemetry import Telemetry

    wall = [60.0]
    fleet = Fleet(broker, subscribe=["edge/v1/dev-c/#"])
    config = AgentConfig(telemetry=TelemetryConfig(state_dir=tmp_path, device_id="dev-c",
                                                   mqtt=fast_config(broker.url)))
    telemetry = Telemetry.open(config, describe=lambda: {"model": "smollm2", "version": "int4-x"})
    telemetry.store.clock = telemetry.link.clock = lambda: wall[0]
    telemetry.store.uptime = lambda: 100.0
    telemetry.start()
    try:
        assert fleet.wait(lambda f: (s := f.last_state("dev-c")) is not None and s.ts == 60.0)
        birth = fleet.last_state("dev-c")
        wall[0] += 1_764_000_000.0  # NTP
        telemetry.record_event("tick", {})
        assert fleet.wait(lambda f: f.last_state("dev-c").ts == wall[0])
        again = fleet.last_state("dev-c")
        assert (again.status, again.connection, again.boot_id) == ("online", birth.connection, birth.boot_id)
        assert retained_state(broker, "dev-c").ts == wall[0]
        rows = telemetry.store.db.execute("SELECT ts, body FROM records ORDER BY id").fetchall()
        kinds = [json.loads(body)["event"]["kind"] for _, body in rows]
        assert kinds == ["start", "tick", "clock_step"] and {ts for ts, _ in rows} == {wall[0]}
        assert json.loads(rows[2][1])["event"]["detail"] == {"step_s": 1_764_000_000.0}
    finally:
        telemetry.stop()
        fleet.close()


def test_a_batch_no_one_subscribes_to_is_kept_until_someone_does(broker, links, monkeypatch, caplog):
    """PUBACK 0x10 'no matching subscribers' (the fleet's session gone with a broker that lost
    its state) counted as delivered, and the rows were marked sent and lost. It was also logged at every retry
    (every 30 s, for good, while no fleet server ran): now once, then hourly."""
    import agent.link.outbox

    monkeypatch.setattr(agent.link.outbox, "REFUSED_PAUSE_S", 0.3)
    caplog.set_level(logging.WARNING, logger="agent.link.outbox")
    link = links(broker.url, "dev-n")
    assert wait_until(lambda: link.is_connected)
    link.store.append(EventRecord(kind="tick"))
    assert link.flush(1.0) == {"unsent": 1, "connected": True}
    time.sleep(1.5)  # several retries, each delivered to no one
    fleet = Fleet(broker, subscribe=["edge/v1/dev-n/tele"], client_id="fleet-late")
    assert wait_until(lambda: link.flush(0.2)["unsent"] == 0, 10)
    assert fleet.wait(lambda f: any(m.topic == "edge/v1/dev-n/tele" for m in f.messages))
    fleet.close()
    said = [r.getMessage() for r in caplog.records if "delivered to no one" in r.getMessage()]
    assert len(said) == 1 and "is the fleet server running?" in said[0], said


def test_a_state_change_told_while_the_link_connects_is_published_once_it_is_connected(broker, tmp_path):
    """publish_state() called after the birth "online" went out but before the link counts itself connected
    was dropped, leaving the fleet's registry on the old model until the next reconnect."""
    fleet = Fleet(broker, subscribe=["edge/v1/+/state"])
    described = {"model": "smollm2", "version": "int4-a"}
    store = TelemetryStore(tmp_path / "t.db", "dev-g")
    link = MqttLink(fast_config(broker.url), "dev-g", store, describe=lambda: dict(described))
    move = link._move

    def change_in_the_gap(to):  # the update lands between the birth and CONNECTED
        if to is LinkState.CONNECTED and described["version"] == "int4-a":
            described["version"] = "int4-b"
            link.publish_state()
        return move(to)

    link._move = change_in_the_gap
    link.start()
    try:
        assert fleet.wait(lambda f: (s := f.last_state("dev-g")) is not None and s.version == "int4-b")
        assert retained_state(broker, "dev-g").version == "int4-b"
    finally:
        link.stop()
        store.close()
        fleet.close()


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
