"""The consumer against a real Mosquitto and simulated devices: exactly-once storage through a broker restart,
acknowledgement only after commit, garbage counted and dropped, the device registry from state and Wills,
replicas on a shared subscription."""
from __future__ import annotations

import json
import logging
import random
import re
import sqlite3
import threading
import time

import paho.mqtt.client as paho
import pytest

from agent.wire import MAX_PAYLOAD_BYTES, TelemetryBatch, topic
from fleet_support import wait_until
from fleet.db import open_database
from fleet.store import FleetStore
from simdevice import event_record, request_record


def stored_keys(db_path) -> set[tuple]:
    db = open_database(db_path)
    return {tuple(r) for t in ("requests", "samples", "events")
            for r in db.execute(f"select device_id, boot_id, seq from {t}").fetchall()}


def stored_count(db_path) -> int:
    db = open_database(db_path)
    return sum(db.execute(f"select count(*) from {t}").fetchone()[0] for t in ("requests", "samples", "events"))


def produced_keys(*devices) -> set[tuple]:
    return {(d.device_id, r.boot_id, r.seq) for d in devices for r in d.produced}


def raw_client(broker) -> paho.Client:
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, protocol=paho.MQTTv5)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    return client


def publish(client, topic_, payload, retain=False):
    client.publish(topic_, payload, qos=1, retain=retain).wait_for_publish(5)


def test_two_devices_through_a_broker_restart_store_exactly_their_records(broker, consumers, devices, fleet_db):
    consumer = consumers()
    a, b = devices("dev-a", seed=1), devices("dev-b", seed=2)
    for _ in range(20):
        a.emit(5)
        b.emit(3)
        time.sleep(0.01)
    acked_before_restart = a.produced[-5:]
    broker.restart(down_s=1.0)
    for device in (a, b):
        wait_until(lambda: device.connects >= 2, message=f"{device.device_id} to reconnect")
    a.send(acked_before_restart)  # a replay, as after a device crash between PUBACK and marking them sent
    for _ in range(20):
        a.emit(5)
        b.emit(3)
        time.sleep(0.01)
    wait_until(lambda: a.unacked == 0 and b.unacked == 0, message="devices' outboxes to drain")
    expected = produced_keys(a, b)
    assert len(expected) == 20 * 8 * 2
    wait_until(lambda: stored_keys(fleet_db) == expected, message="every record stored")
    assert stored_count(fleet_db) == len(expected)
    wait_until(lambda: consumer.stats.duplicates >= 5, message="the replay to be seen and dropped")
    first = a.produced[0]
    db = open_database(fleet_db)
    assert db.execute("select ttft_ms from requests where device_id='dev-a' and seq=?",
                      [first.seq]).fetchone()[0] == first.request.figures.ttft_ms


class BlockingStore(FleetStore):
    """The real store whose commits wait for a signal: a consumer 'crashing' before it commits."""

    def __init__(self, path):
        super().__init__(path)
        self.release = threading.Event()
        self.entered = threading.Event()

    def commit(self, ingest):
        self.entered.set()
        self.release.wait()
        return super().commit(ingest)


class ReadOnlyStore(FleetStore):
    """The real store on a disk that went read-only: every commit fails."""

    def __init__(self, path):
        super().__init__(path)
        self.attempts = 0

    def commit(self, ingest):
        self.attempts += 1
        raise sqlite3.OperationalError("attempt to write a readonly database")


def test_a_commit_that_keeps_failing_is_logged_a_few_times_then_hourly(broker, consumers, devices, tmp_path,
                                                                       monkeypatch, caplog):
    """Found in review: on a disk gone read-only, a line every 5 s for good (~17,000 a day)."""
    import fleet.consumer

    monkeypatch.setattr(fleet.consumer, "RETRY_CAP_S", 0.02)  # 180,000 attempts an hour: the hourly line never
    store = ReadOnlyStore(tmp_path / "ro.db")
    consumers(client_id="fleet-ro", store=store)
    devices("dev-a").emit(3)
    wait_until(lambda: store.attempts >= 40, message="commits retried")
    lines = [r for r in caplog.records if "commit of" in r.getMessage()]
    assert len(lines) == fleet.consumer.COMMIT_FAILURES_LOGGED and "said again hourly" in lines[-1].getMessage()


def test_a_message_is_acked_only_after_its_commit(broker, consumers, devices, fleet_db, tmp_path):
    blocked = BlockingStore(tmp_path / "crashed.db")
    stuck = consumers(client_id="fleet-1", store=blocked)
    device = devices("dev-a")
    device.emit(4)
    assert blocked.entered.wait(10)
    stuck.links.stop()  # the connection goes away before the commit: no PUBACK was sent
    survivor = consumers(client_id="fleet-1")  # same session: the broker resends what was never acked
    wait_until(lambda: stored_keys(fleet_db) == produced_keys(device), message="redelivery after reconnect")
    blocked.release.set()  # the old commit finishes; its ack belongs to a dead connection and is not sent
    wait_until(lambda: stuck.stats.commits == 1)
    assert stuck.stats.acks_deferred >= 1 and survivor.stats.inserted == 4


def test_garbage_is_counted_and_dropped_and_ingestion_goes_on(broker, consumers, devices, fleet_db):
    consumers(client_id="fleet-1")
    good = devices("dev-good")
    raw = raw_client(broker)
    records = [request_record("boot-x", seq, time.time(), random.Random(seq)) for seq in (1, 2)]
    valid = json.loads(TelemetryBatch(device_id="dev-x", records=records).model_dump_json())
    bad_type = json.loads(json.dumps(valid))
    bad_type["records"][0]["seq"] = "not a number"
    extra = json.loads(json.dumps(valid))
    extra["records"][0]["sneaky"] = 1
    wrong_body = json.loads(json.dumps(valid))
    wrong_body["records"][0]["kind"] = "sample"  # says sample, carries a request
    garbage = [
        (topic("dev-x", "tele"), b"\x00\xffnot json", "invalid_json"),
        (topic("dev-x", "tele"), b'{"hello": "world"}', "schema"),
        (topic("dev-x", "tele"), json.dumps(bad_type).encode(), "schema"),
        (topic("dev-x", "tele"), json.dumps(extra).encode(), "schema"),
        (topic("dev-x", "tele"), json.dumps(wrong_body).encode(), "schema"),
        (topic("dev-x", "tele"), json.dumps({"device_id": "dev-x", "records": []}).encode(), "schema"),
        (topic("dev-x", "tele"), b"[" * (MAX_PAYLOAD_BYTES + 1), "too_large"),
        (topic("dev-y", "tele"), json.dumps(valid).encode(), "device_mismatch"),  # dev-x's batch on dev-y's topic
        (topic("dev-x", "evt", "error"), json.dumps(valid).encode(), "event_mismatch"),  # requests on evt/error
        (topic("dev-x", "state"), b'{"device_id": "dev-x", "status": "sleeping"}', "schema"),
        (topic("dev-z", "state"), good.state("online").model_dump_json().encode(), "device_mismatch"),
    ]
    for t, payload, _ in garbage:
        publish(raw, t, payload)
    good.emit(3)
    event = event_record(good.boot_id, 1000, time.time(), "error", message="boom")
    good.send([event], subtopic=("evt", "error"))
    expected = {}
    for t, _, reason in garbage:
        key = (t.split("/")[2], reason)
        expected[key] = expected.get(key, 0) + 1
    db = open_database(fleet_db)
    wait_until(lambda: {(r["device_id"], r["reason"]): r["count"] for r in db["rejected"].rows} == expected,
               message="every bad message counted")
    wait_until(lambda: stored_keys(fleet_db) == produced_keys(good) | {("dev-good", good.boot_id, 1000)})
    assert not db.execute("select 1 from devices where id in ('dev-x', 'dev-y', 'dev-z')").fetchall()
    raw.loop_stop()


def test_invented_finish_reasons_string_seqs_and_unbounded_ids_or_names_are_refused_and_counted(
        broker, consumers, devices, fleet_db, caplog):
    """Found by an outside probe: a device could invent finish_reasons (new rows in `tps` and the report), a
    string seq was coerced, a 100 kB boot_id was stored with every row, and model and version had no bound."""
    caplog.set_level(logging.WARNING, logger="fleet.consumer")
    consumers(client_id="fleet-1")
    good = devices("dev-good")
    raw = raw_client(broker)

    def request(device_id: str, change) -> bytes:  # one valid request record, changed by change(record)
        body = json.loads(TelemetryBatch(device_id=device_id, records=[
            request_record("boot-x", 1, time.time(), random.Random(1))]).model_dump_json())
        change(body["records"][0])
        return json.dumps(body).encode()

    def state(device_id: str, **fields) -> bytes:
        return json.dumps({**json.loads(good.state("online").model_dump_json()), "device_id": device_id,
                           **fields}).encode()

    cases = {  # device -> (the field its message breaks, topic, payload)
        "dev-finish": ("finish_reason", "tele", request(
            "dev-finish", lambda r: r["request"]["figures"].update(finish_reason="invented"))),
        "dev-seq": ("seq", "tele", request("dev-seq", lambda r: r.update(seq="7"))),
        "dev-boot": ("boot_id", "tele", request("dev-boot", lambda r: r.update(boot_id="b" * 100_000))),
        "dev-model": ("model", "tele", request("dev-model", lambda r: r["request"].update(model="m" * 65))),
        "dev-version": ("version", "tele", request("dev-version", lambda r: r["request"].update(version="v" * 1000))),
        "dev-state-boot": ("boot_id", "state", state("dev-state-boot", boot_id="b" * 100_000)),
        "dev-state-model": ("model", "state", state("dev-state-model", model="a model/with spaces")),
        "dev-state-connection": ("connection", "state", state("dev-state-connection", connection="3")),
        "dev-state-precision": ("precision", "state", state("dev-state-precision", precision="int3")),
    }
    for device_id, (_, kind, payload) in cases.items():
        assert len(payload) <= MAX_PAYLOAD_BYTES  # refused for its field, not for its size
        publish(raw, topic(device_id, kind), payload)
    good.emit(3)
    db = open_database(fleet_db)
    wait_until(lambda: {(r["device_id"], r["reason"]): r["count"] for r in db["rejected"].rows}
               == {(device_id, "schema"): 1 for device_id in cases}, message="every bad message counted")
    wait_until(lambda: stored_keys(fleet_db) == produced_keys(good), message="the good device's records stored")
    assert not db.execute(f"select id from devices where id in ({', '.join('?' * len(cases))})", list(cases)).fetchall()
    for device_id, (field, _, _) in cases.items():  # the logged reason names the field
        [line] = [r.getMessage() for r in caplog.records if f"device {device_id!r}" in r.getMessage()]
        assert re.search(rf"schema: (records\.0\.(request\.(figures\.)?)?)?{field}: ", line), line
        assert len(line) < 400, line  # the 100 kB value is not repeated
    raw.loop_stop()


def test_rejected_messages_are_acked_so_never_recounted(broker, consumers, fleet_db):
    first = consumers(client_id="fleet-1")
    raw = raw_client(broker)
    for _ in range(3):
        publish(raw, topic("dev-x", "tele"), b"garbage")
    wait_until(lambda: first.stats.rejected == 3)
    first.stop()
    second = consumers(client_id="fleet-1")  # the same session: anything unacked would come again
    time.sleep(1.0)
    assert second.stats.rejected == 0
    assert open_database(fleet_db)["rejected"].get(("dev-x", "invalid_json"))["count"] == 3
    raw.loop_stop()


def test_registry_follows_state_wills_and_ignores_late_wills(broker, consumers, devices, fleet_db):
    consumers()
    db = open_database(fleet_db)
    device_row = lambda d: db["devices"].get(d)  # noqa: E731
    lost = devices("dev-lost")
    wait_until(lambda: db["devices"].count_where("id = 'dev-lost' and status = 'online'") == 1)
    row = device_row("dev-lost")
    assert (row["model"], row["version"], json.loads(row["hardware"])["cores"]) == ("smollm2", "int4-a1", 4)
    lost.kill()  # no DISCONNECT: the broker publishes its Will after the keepalive runs out
    wait_until(lambda: device_row("dev-lost")["status"] == "offline", timeout_s=60, message="the Will")

    newer = devices("dev-new", connection=5)
    raw = raw_client(broker)
    older_will = newer.state("offline").model_copy(update={"connection": 4})
    publish(raw, topic("dev-new", "state"), older_will.model_dump_json(), retain=True)
    newer.emit(1)
    wait_until(lambda: stored_count(fleet_db) == 1)
    assert (device_row("dev-new")["status"], device_row("dev-new")["connection"]) == ("online", 5)
    newer.stop()
    wait_until(lambda: device_row("dev-new")["status"] == "stopped")
    raw.loop_stop()


def test_two_replicas_on_a_shared_subscription_store_everything_exactly_once(broker, serve_processes, devices,
                                                                            fleet_db):
    replicas = [serve_processes(broker.url, fleet_db, f"fleet-{k}", shared_group="fleet") for k in range(2)]
    fleet = [devices(f"dev-{i:02d}", seed=i) for i in range(10)]
    for _ in range(30):
        for device in fleet:
            device.emit(4)
        time.sleep(0.02)
    wait_until(lambda: all(d.unacked == 0 for d in fleet))
    expected = produced_keys(*fleet)
    wait_until(lambda: stored_keys(fleet_db) == expected, message="every record stored")
    summaries = [r.stop() for r in replicas]
    stored_by = [int(s.split("stored ")[1].split()[0]) for s in summaries]
    assert all(n > 0 for n in stored_by), summaries  # both replicas took a share
    assert sum(stored_by) == len(expected) == stored_count(fleet_db)  # ... and no record was stored twice
    devices_seen = open_database(fleet_db).execute("select count(*) from devices where status = 'online'").fetchone()[0]
    assert devices_seen == 10


def test_only_a_state_the_device_sent_just_now_counts_as_live():
    """What the registry's cross-boot rule trusts over the clocks (fleet.store.is_newer_state)."""
    from agent.wire import DeviceState
    from fleet.consumer import Inbound, add_message
    from fleet.store import Ingest

    def live(status: str, retain: bool) -> bool:
        state = DeviceState(device_id="d1", status=status, connection=1, boot_id="b", ts=1000.0)
        ingest = Ingest()
        add_message(ingest, Inbound("edge/v1/d1/state", state.model_dump_json().encode(), 1, 1, retain, 0), "d1", 2000.0)
        return ingest.states[0][1]

    assert live("online", retain=False) and live("stopped", retain=False)
    assert not live("online", retain=True) and not live("offline", retain=False) and not live("stopped", retain=True)


def test_clearing_a_retained_state_is_not_bad_input():
    """Found in review: an empty retained payload, MQTT's way to delete a retained message, was rejected as
    invalid JSON with a warning."""
    from fleet.consumer import Inbound, add_message
    from fleet.store import Ingest

    ingest = Ingest()
    add_message(ingest, Inbound(topic("d1", "state"), b"", 1, 1, False, 0), "d1", time.time())
    assert ingest.states == [] and not ingest.seen


def test_an_event_detail_that_is_not_plain_json_is_refused():
    """Found in review: NaN / Infinity in an event's detail parsed and were stored as invalid JSON, which made
    json_extract() over the events table fail for every device."""
    from fleet.consumer import Inbound, Rejected, add_message
    from fleet.store import Ingest

    event = event_record("boot-x", 1, time.time(), "error", message="boom")
    for value in ("NaN", "Infinity", "1e400"):
        payload = TelemetryBatch(device_id="dev-x", records=[event]).model_dump_json().replace(
            '"message":"boom"', f'"message":{value}')
        assert value in payload
        with pytest.raises(Rejected) as e:
            add_message(Ingest(), Inbound(topic("dev-x", "tele"), payload.encode(), 1, 1, False, 0), "dev-x", time.time())
        assert e.value.reason == "schema" and "plain JSON" in str(e.value)


def test_a_state_from_a_clock_ahead_device_never_sets_contact_in_the_future():
    """Found in review: an offline state (a Will) stamped by a clock five years ahead pinned last_seen there."""
    from agent.wire import DeviceState
    from fleet.consumer import Inbound, add_message
    from fleet.store import Ingest

    now = time.time()
    ahead = DeviceState(device_id="d1", status="offline", connection=1, boot_id="b", ts=now + 5 * 365 * 86400)
    ingest = Ingest()
    add_message(ingest, Inbound(topic("d1", "state"), ahead.model_dump_json().encode(), 1, 1, False, 0), "d1", now)
    assert ingest.seen["d1"] == now


def test_a_negative_count_or_time_is_refused():
    """Found in review: completion_tokens -1000 was stored, and the fleet's "tokens served" went down."""
    from fleet.consumer import Inbound, Rejected, add_message
    from fleet.store import Ingest

    good = TelemetryBatch(device_id="dev-x", records=[request_record("boot-x", 1, time.time(), random.Random(1))])
    for field in ("completion_tokens", "ttft_ms", "decode_tokens_per_s"):
        body = json.loads(good.model_dump_json())
        body["records"][0]["request"]["figures"][field] = -1000
        with pytest.raises(Rejected) as e:
            add_message(Ingest(), Inbound(topic("dev-x", "tele"), json.dumps(body).encode(), 1, 1, False, 0), "dev-x",
                        time.time())
        assert e.value.reason == "schema" and field in str(e.value)


def test_rejections_are_logged_once_per_device_and_reason_and_at_most_twenty_lines_a_minute(caplog, monkeypatch):
    """Found in review: one line per (device, reason) per minute had no fleet-wide cap (300 devices sending a
    schema this server does not know: 300 lines a minute; ids that change with every message: 2,900), and
    the map of what had been logged grew without bound."""
    import fleet.consumer as consumer_module
    from fleet.consumer import Consumer, Rejected

    now = [1000.0]
    monkeypatch.setattr(consumer_module.time, "monotonic", lambda: now[0])
    consumer = Consumer.__new__(Consumer)  # only the logging state: no broker, no store
    consumer._rejection_logged, consumer._rejection_period = set(), (-60.0, 0)
    caplog.set_level(logging.WARNING, logger="fleet.consumer")
    for i in range(300):
        for _ in range(3):
            consumer._log_rejection(f"dev-{i}", Rejected("schema", "unknown field"))
    assert len(caplog.records) == 20 and len(consumer._rejection_logged) == 20
    now[0] += 61
    consumer._log_rejection("dev-0", Rejected("schema", "unknown field"))
    assert "880 more rejected messages were not logged" in caplog.records[20].getMessage()
    assert "dev-0" in caplog.records[21].getMessage() and len(consumer._rejection_logged) == 1


def test_a_commit_failing_for_hours_keeps_its_thread(tmp_path, caplog):
    """Found in review: the backoff's 2 ** attempt overflowed a float at attempt 1024 (~85 min of failures)
    and the writer thread died, so nothing was ingested or acknowledged until a restart."""
    from fleet.consumer import Consumer

    class Stopping:  # waits return at once; the 1,100th ends the retries as a shutdown would
        waits = 0

        def wait(self, seconds):
            assert 0 < seconds <= 5.0
            Stopping.waits += 1
            return Stopping.waits >= 1100

    consumer = Consumer.__new__(Consumer)
    consumer.store, consumer._stopping = ReadOnlyStore(tmp_path / "ro.db"), Stopping()

    class Batch:
        num_records = 3

    assert consumer._commit(Batch()) is None and consumer.store.attempts == 1100
    assert sum("commit of 3 records failed" in r.getMessage() for r in caplog.records) == 5
