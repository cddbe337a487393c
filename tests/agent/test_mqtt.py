"""The MQTT link against a real Mosquitto: delivery across outages and crashes, presence, commands, the ACL.

The fleet side here is a plain paho client (tests only; the agent's paho stays in agent/link/mqtt.py). This
file is also the publisher subprocess of the crash tests: `python tests/agent/test_mqtt.py child ...`.

Run: .venv/bin/pytest tests/agent/test_mqtt.py -q
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import ValidationError

import agent.link.outbox
from agent.link.commands import CommandError, Commands, Device, LiveSettings
from agent.config import AgentConfig, MqttConfig, TelemetryConfig
from agent.mqtt_link import LinkState
from agent.link.mqtt import MqttLink
from agent.link.outbox import fit_batch
from agent.link.store import OutboxRow, TelemetryStore
from agent.wire import (COMMANDS, MAX_PAYLOAD_BYTES, CommandRequest, CommandResponse, DeviceState, EventRecord,
                        TelemetryBatch, TelemetryRecord, topic)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 20.0


def fast_config(url: str, **kw) -> MqttConfig:
    return MqttConfig(**{"url": url, "backoff_min_s": 0.05, "backoff_max_s": 0.5, "outbox_poll_s": 0.05,
                         "connect_timeout_s": 2, **kw})


def wait_until(predicate, timeout_s: float = TIMEOUT_S, every_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


# ---- the fleet's side ---------------------------------------------------------------------------------------
class Fleet:
    """An MQTT v5 client with a persistent session (it gets what was published while the broker was down)
    that records every message, indexed for the assertions."""

    def __init__(self, broker, subscribe: list[str], client_id: str = "fleet-test", username: str | None = None,
                 password: str | None = None, ca_file: Path | None = None):
        self.subscriptions = subscribe
        self.cond = threading.Condition()
        self.messages: list[paho.MQTTMessage] = []
        self.tele_keys: set[tuple[str, int]] = set()
        self.states: list[DeviceState] = []
        self.responses: dict[bytes, paho.MQTTMessage] = {}
        self.subscribed = threading.Event()
        c = self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        c.reconnect_delay_set(0.05, 0.5)
        if username:
            c.username_pw_set(username, password)
        if ca_file:
            c.tls_set(ca_certs=str(ca_file))
        c.on_connect, c.on_message, c.on_subscribe = self._on_connect, self._on_message, self._on_subscribe
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 300
        c.connect("127.0.0.1", broker.port, clean_start=False, properties=props)
        c.socket().setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the broker does (set_tcp_nodelay): no ~40 ms Nagle waits
        c.loop_start()
        assert self.subscribed.wait(5), "the fleet client did not subscribe"

    def _on_connect(self, client, userdata, flags, reason_code, properties):
        client.subscribe([(t, paho.SubscribeOptions(qos=1)) for t in self.subscriptions])

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties):
        self.subscribed.set()

    def _on_message(self, client, userdata, msg):
        with self.cond:
            self.messages.append(msg)
            try:
                self._index(msg)
            except ValidationError:
                pass  # a test's own raw payload (the ACL test's markers)
            self.cond.notify_all()

    def _index(self, msg) -> None:
        if msg.topic.endswith("/tele"):
            batch = TelemetryBatch.model_validate_json(msg.payload)
            self.tele_keys.update((r.boot_id, r.seq) for r in batch.records)
        elif msg.topic.endswith("/state"):
            self.states.append(DeviceState.model_validate_json(msg.payload))
        elif "/cmd/res" in msg.topic:
            self.responses[getattr(msg.properties, "CorrelationData", b"")] = msg

    def wait(self, predicate, timeout_s: float = TIMEOUT_S) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: predicate(self), timeout_s)

    def publish(self, mqtt_topic: str, payload: bytes, retain: bool = False, properties: Properties | None = None):
        self.client.publish(mqtt_topic, payload, qos=1, retain=retain, properties=properties).wait_for_publish(5)

    def request(self, device: str, name: str, payload: bytes, correlation: bytes | None = None,
                response_topic: str | None = "default", expiry_s: int | None = None) -> None:
        props = Properties(PacketTypes.PUBLISH)
        if expiry_s is not None:
            props.MessageExpiryInterval = expiry_s
        if response_topic:
            props.ResponseTopic = topic(device, "cmd", "res") if response_topic == "default" else response_topic
        if correlation is not None:
            props.CorrelationData = correlation
        self.publish(topic(device, "cmd", "req", name), payload, properties=props)

    def call(self, device: str, name: str, args: dict | None = None, timeout_s: float = 5.0) -> CommandResponse:
        correlation = os.urandom(8)
        self.request(device, name, json.dumps({"args": args or {}}).encode(), correlation)
        assert self.wait(lambda f: correlation in f.responses, timeout_s), f"no answer to {name}"
        return CommandResponse.model_validate_json(self.responses[correlation].payload)

    def last_state(self, device: str) -> DeviceState | None:
        with self.cond:
            mine = [s for s in self.states if s.device_id == device]
            return mine[-1] if mine else None

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def retained_state(broker, device: str, **auth) -> DeviceState:
    """What a client connecting now is told about the device (the retained state)."""
    got: queue.Queue = queue.Queue()
    c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"probe-{os.getpid()}-{time.monotonic_ns()}",
                    protocol=paho.MQTTv5)
    if auth:
        c.username_pw_set(auth["username"], auth["password"])
    c.on_connect = lambda client, *a: client.subscribe(topic(device, "state"), qos=1)
    c.on_message = lambda client, u, msg: got.put(msg)
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    try:
        msg = got.get(timeout=5)
        assert msg.retain
        return DeviceState.model_validate_json(msg.payload)
    finally:
        c.disconnect()
        c.loop_stop()


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


def commands_for(config: MqttConfig, flush=None) -> Commands:
    return Commands(Device(AgentConfig(telemetry=TelemetryConfig(mqtt=config)), LiveSettings(), flush=flush))


# ---- pure pieces ------------------------------------------------------------------------------------------
def test_a_batch_stays_under_the_payload_limit():
    body = EventRecord(kind="tick", detail={"x": "y" * 100_000})
    text = TelemetryRecord(boot_id="b", seq=0, ts=0.0, kind="event", event=body).model_dump_json()
    rows = [OutboxRow(i, text, TelemetryRecord.model_validate_json(text)) for i in range(5)]
    fitted = fit_batch(rows)
    assert len(fitted) == 2
    assert len(TelemetryBatch(device_id="d", records=[r.record for r in fitted]).model_dump_json()) < MAX_PAYLOAD_BYTES


# ---- (a) delivery across a broker outage --------------------------------------------------------------------
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


# ---- (b) the publisher SIGKILLed while publishing ----------------------------------------------------------------
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


# ---- (c) presence and commands ---------------------------------------------------------------------------
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


def test_a_command_that_expires_behind_a_slow_one_is_not_run(broker, links):
    """The desk ran commands in turn whatever their age, so a set_config queued behind a
    benchmark was applied after `edge-fleet cmd` had told the operator "no response" and exited 1."""
    ran = []

    def handler(name: str, request: CommandRequest) -> CommandResponse:
        ran.append(name)
        if name == "benchmark":
            time.sleep(2.0)
        return CommandResponse(command=name, ok=True, result={})

    link = links(broker.url, "dev-e", handler=handler)
    fleet = Fleet(broker, subscribe=["edge/v1/dev-e/cmd/res/#"])
    assert wait_until(lambda: link.is_connected)
    fleet.request("dev-e", "benchmark", b"{}", correlation=b"slow")
    fleet.request("dev-e", "set_config", b"{}", correlation=b"late", expiry_s=1)
    fleet.request("dev-e", "ping", b"{}", correlation=b"patient", expiry_s=30)
    assert fleet.wait(lambda f: b"patient" in f.responses, 10)
    assert ran == ["benchmark", "ping"] and b"late" not in fleet.responses
    fleet.close()


def test_commands_round_trip_with_correlation_data(broker, links):
    config = fast_config(broker.url, username="dev-c", password="hunter2")
    made = []
    handler = commands_for(config, flush=lambda: made[0].flush(1.0))
    link = links(broker.url, "dev-c", handler=handler, username="dev-c", password="hunter2")
    made.append(link)
    # telemetry too: a batch nobody subscribes to is kept (PUBACK "no matching subscribers")
    fleet = Fleet(broker, subscribe=["edge/v1/dev-c/cmd/res/#", "edge/v1/dev-c/tele", "edge/v1/dev-c/state"])
    # "online" follows the command subscription on the same connection, so the broker has it: a request sent
    # on is_connected alone could reach the broker first and be lost (seen under load)
    assert fleet.wait(lambda f: (s := f.last_state("dev-c")) is not None and s.status == "online")

    fleet.request("dev-c", "ping", b"{}", correlation=b"\x00\xffcorr")
    assert fleet.wait(lambda f: b"\x00\xffcorr" in f.responses)
    msg = fleet.responses[b"\x00\xffcorr"]
    assert msg.topic == "edge/v1/dev-c/cmd/res" and msg.properties.MessageExpiryInterval > 0
    pong = CommandResponse.model_validate_json(msg.payload)
    assert pong.ok and pong.command == "ping" and pong.result["pong"] is True

    got = fleet.call("dev-c", "get_config")
    assert got.ok and got.result["config"]["telemetry"]["mqtt"]["password"] == "**********"
    changed = fleet.call("dev-c", "set_config", {"threads": 3, "sampling": {"temperature": 0.2}})
    assert not changed.ok and "threads" in changed.result["refused"]
    assert changed.result["applied"]["sampling"] == {"temperature": 0.2}
    bad_range = fleet.call("dev-c", "set_config", {"sampling": {"top_p": 0}})
    assert not bad_range.ok and "top_p" in bad_range.error and "Value error" not in bad_range.error
    unknown = fleet.call("dev-c", "reboot")
    assert not unknown.ok and "unknown command 'reboot'" in unknown.error
    assert "not available" in fleet.call("dev-c", "rollback").error
    link.store.append(EventRecord(kind="tick"))
    flushed = fleet.call("dev-c", "telemetry_flush")
    assert flushed.ok and flushed.result == {"unsent": 0, "connected": True}

    fleet.request("dev-c", "ping", b"{}", correlation=b"elsewhere", response_topic="edge/v1/dev-x/cmd/res")
    assert not fleet.wait(lambda f: b"elsewhere" in f.responses, 0.5)  # never answered outside our topics

    link.stop()  # commands sent while the device is away wait in its persistent session
    fleet.request("dev-c", "ping", b"", correlation=b"queued")
    links(broker.url, "dev-c", handler=commands_for(config), username="dev-c", password="hunter2", db=link.store.path)
    assert fleet.wait(lambda f: b"queued" in f.responses)
    fleet.close()


def test_a_retained_command_is_not_run_on_connect(broker, links):
    """A command published with retain (by mistake) would otherwise run again on every reconnect."""
    fleet = Fleet(broker, subscribe=["edge/v1/dev-r/cmd/res/#"], client_id="fleet-retain")
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic, props.CorrelationData = topic("dev-r", "cmd", "res"), b"retained"
    fleet.publish(topic("dev-r", "cmd", "req", "ping"), b'{"args": {}}', retain=True, properties=props)
    link = links(broker.url, "dev-r", handler=commands_for(fast_config(broker.url)))
    assert wait_until(lambda: link.is_connected)
    assert fleet.call("dev-r", "ping").ok  # live commands are answered...
    assert b"retained" not in fleet.responses  # ...the retained one never was
    fleet.publish(topic("dev-r", "cmd", "req", "ping"), b"", retain=True)  # clear it from the broker
    fleet.close()


# ---- regressions: each of these left a device offline or its telemetry stuck ------------------------------
def fail_once(obj, name: str, error: Exception) -> list[int]:
    """Make obj.name raise `error` on its first call; returns the list its calls are counted in."""
    real, calls = getattr(obj, name), []

    def once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kw)

    setattr(obj, name, once)
    return calls


def test_a_database_error_while_connecting_is_a_failed_attempt_not_the_end_of_the_link(broker, tmp_path):
    """SQLite locked (a backup, the CLI) while counting the connection ended the link thread for good."""
    store = TelemetryStore(tmp_path / "dev-l.db", "dev-l")
    calls = fail_once(store, "next_connection", sqlite3.OperationalError("database is locked"))
    link = MqttLink(fast_config(broker.url), "dev-l", store)
    link.start()
    try:
        assert wait_until(lambda: link.is_connected), link.state
        assert len(calls) == 2
    finally:
        link.stop()
        store.close()


def test_a_device_whose_disk_is_full_still_connects(broker, tmp_path):
    store = TelemetryStore(tmp_path / "dev-f.db", "dev-f")
    store.db.execute("PRAGMA query_only = 1")  # every write fails, as on a full disk
    link = MqttLink(fast_config(broker.url), "dev-f", store)
    link.start()
    try:
        assert wait_until(lambda: link.is_connected), link.state
    finally:
        link.stop()
        store.close()


def test_a_failed_mark_sent_sends_the_rows_again_on_the_same_connection(broker, links, monkeypatch):
    """The rows stayed unsent until the next reconnect, weeks away on a steady link."""
    monkeypatch.setattr(agent.link.outbox, "REFUSED_PAUSE_S", 0.2)
    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"], client_id="fleet-marksent")
    link = links(broker.url, "dev-m")
    assert wait_until(lambda: link.is_connected)
    calls = fail_once(link.store, "mark_sent", sqlite3.OperationalError("database is locked"))
    for i in range(3):
        link.store.append(EventRecord(kind="tick", detail={"i": i}))
    link.notify()
    assert wait_until(lambda: link.store.count_unsent() == 0), link.store.count_unsent()
    assert len(calls) >= 2 and link.store.connections == 1
    fleet.close()


def test_rows_that_cannot_be_marked_sent_go_again_after_a_pause_said_once(broker, links, caplog):
    """On a card remounted read-only: mark_sent failed after every PUBACK and the same batch
    went again every second, for good, with a traceback each time (a cellular link pays for each copy)."""
    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"], client_id="fleet-readonly")
    link = links(broker.url, "dev-ro")
    assert wait_until(lambda: link.is_connected)

    def read_only(rows):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    link.store.mark_sent = read_only
    link.store.append(EventRecord(kind="tick"))
    link.notify()
    batches = lambda: [m for m in fleet.messages if m.topic.endswith("/tele")]  # noqa: E731
    assert fleet.wait(lambda f: len(batches()) >= 1)
    time.sleep(4.0)  # four outbox passes at least
    assert len(batches()) == 1 and link.store.count_unsent() >= 1
    said = [r for r in caplog.records if "cannot mark them sent" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None and "outbox pass failed" not in caplog.text
    fleet.close()


def test_a_connection_the_broker_drops_at_once_backs_off(broker, links):
    """A second device with the same id (a cloned image) takes the session over at each connect: both
    reconnected twice a second for good, since every CONNACK reset the backoff."""
    a = links(broker.url, "dev-clone", backoff_max_s=1.0)
    b = links(broker.url, "dev-clone", backoff_max_s=1.0)
    time.sleep(5.0)
    attempts = a.store.connections + b.store.connections
    assert attempts <= 20, f"{attempts} connections in 5 s"


def test_an_answer_goes_out_on_the_connection_up_when_the_command_ends(broker, links):
    """A command still running when the connection changed was answered on the dead one: lost."""
    entered, release = threading.Event(), threading.Event()

    def slow(name: str, request: CommandRequest) -> CommandResponse:
        entered.set()
        release.wait(TIMEOUT_S)
        return CommandResponse(command=name, ok=True, result={"done": True})

    fleet = Fleet(broker, subscribe=["edge/v1/dev-s/cmd/res/#"], client_id="fleet-slow")
    link = links(broker.url, "dev-s", handler=slow)
    assert wait_until(lambda: link.is_connected)
    fleet.request("dev-s", "ping", b"{}", correlation=b"slow")
    assert entered.wait(TIMEOUT_S)  # the device has the request (and acknowledged it)
    fleet.subscribed.clear()
    broker.restart()
    assert fleet.subscribed.wait(TIMEOUT_S)  # the broker may not have saved our session: subscribed again
    assert wait_until(lambda: link.is_connected and link.store.connections >= 2)
    release.set()
    assert fleet.wait(lambda f: b"slow" in f.responses), "the answer was lost with the old connection"
    fleet.close()


def test_a_command_flood_is_answered_ok_or_busy_and_logged_in_a_few_counted_lines(broker, links):
    """A burst on a device's command topic: each command dropped for a full queue went unanswered (`edge-fleet
    cmd` waited out its --timeout) and wrote a warning of its own. Now every one is answered, ok or busy, and
    the warnings go out once a window (shortened to 1 s here) with the count of those held back."""
    import agent.link.mqtt as mqtt_module
    from agent.logs import Repeats, by_format
    from loglines import LogLines  # here, not at the top: the SIGKILL child runs this file as a script

    flood, batch = 2000, 250  # in batches, so that the broker's queue for the device (1,000) never overflows
    held = threading.Event()

    def held_up(name: str, request: CommandRequest) -> CommandResponse:
        held.wait(TIMEOUT_S)  # the worker holds the first command until the flood is in: the queue stays full
        return CommandResponse(command=name, ok=True, result={})

    link = links(broker.url, "dev-flood", handler=held_up)
    fleet = Fleet(broker, subscribe=["edge/v1/dev-flood/cmd/res/#"], client_id="fleet-flood")
    assert wait_until(lambda: link.is_connected)
    repeats, logs = Repeats(1.0, key=by_format), LogLines()
    mqtt_module.each_command.removeFilter(mqtt_module.COMMAND_REPEATS)  # one without the other tests' history
    mqtt_module.each_command.addFilter(repeats)
    logging.getLogger("agent.link.mqtt").addHandler(logs)

    def send(first: int, last: int) -> None:
        for i in range(first, last):
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic, props.CorrelationData = topic("dev-flood", "cmd", "res"), b"flood-%d" % i
            fleet.client.publish(topic("dev-flood", "cmd", "req", "ping"), b"{}", qos=1, properties=props)
        waiting = mqtt_module.COMMAND_QUEUE_MAX + 1  # answered once released: the one held and its queue
        answered = fleet.wait(lambda f: len(f.responses) >= last - waiting, TIMEOUT_S)
        missing = [i for i in range(first, last - waiting) if b"flood-%d" % i not in fleet.responses]
        assert answered, (f"{len(missing)} commands of {first}..{last} unanswered (first {missing[:5]}); "
                          f"{len(fleet.responses)} answers in all, link connections {link.store.connections}, "
                          f"{len(logs.lines)} log lines")

    try:
        started = time.monotonic()
        for first in range(0, flood, batch):
            send(first, first + batch)
        elapsed_s = time.monotonic() - started
        time.sleep(1.1)  # past the window: the next drop's line says how many were held back
        send(flood, flood + 1)
        held.set()
        assert fleet.wait(lambda f: all(b"flood-%d" % i in f.responses for i in range(flood + 1)), TIMEOUT_S)
    finally:
        held.set()
        logging.getLogger("agent.link.mqtt").removeHandler(logs)
        mqtt_module.each_command.removeFilter(repeats)
        mqtt_module.each_command.addFilter(mqtt_module.COMMAND_REPEATS)
    answers = [CommandResponse.model_validate_json(fleet.responses[b"flood-%d" % i].payload)
               for i in range(flood + 1)]
    ok = [a for a in answers if a.ok]
    busy = [a for a in answers if not a.ok]
    assert len(ok) == mqtt_module.COMMAND_QUEUE_MAX + 1  # the one held, and those that queued behind it
    assert all(a.command == "ping" and a.error.startswith("busy: ") for a in busy), {a.error for a in busy}
    lines = [line for line in logs.lines if "was dropped" in line]
    assert len(lines) <= elapsed_s / 1.0 + 2, lines  # once a window, not once a command
    counted = sum(int(m.group(1)) for line in lines if (m := re.search(r"\((\d+) more in the last 1 s\)", line)))
    assert len(lines) + counted == len(busy), lines  # each drop in a line or in a count
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


def test_an_oversized_job_document_is_dropped_with_a_log_line(broker, tmp_path, caplog):
    """It was dropped without a word."""
    from agent.wire import MAX_PAYLOAD_BYTES

    got = []
    store = TelemetryStore(tmp_path / "dev-j.db", "dev-j")
    link = MqttLink(fast_config(broker.url), "dev-j", store,
                    on_job=lambda payload, expiry_s: got.append((payload, expiry_s)))
    link.start()
    fleet = Fleet(broker, subscribe=["edge/v1/dev-j/state"], client_id="fleet-jobs-test")
    try:
        assert wait_until(lambda: link.is_connected) and fleet.wait(lambda f: f.last_state("dev-j") is not None)
        fleet.publish(topic("dev-j", "jobs", "notify"), b"x" * (MAX_PAYLOAD_BYTES + 1))
        fleet.publish(topic("dev-j", "jobs", "notify"), b"{}")
        expiring = Properties(PacketTypes.PUBLISH)
        expiring.MessageExpiryInterval = 600
        fleet.publish(topic("dev-j", "jobs", "notify"), b"[]", properties=expiring)  # the updater gets what is left
        assert wait_until(lambda: len(got) == 2) and got[0] == (b"{}", None)
        assert got[1][0] == b"[]" and 595 <= got[1][1] <= 600
        assert f"a job document of {MAX_PAYLOAD_BYTES + 1} bytes" in caplog.text
    finally:
        fleet.close()
        link.stop()
        store.close()


def test_commands_dispatch_without_an_engine():
    """The handler is pure dispatch over Device: a fake benchmark stands in for the engine."""
    from agent.link.commands import BenchmarkArgs
    from agent.wire import RequestFigures

    seen: list[BenchmarkArgs] = []

    def benchmark(spec: BenchmarkArgs) -> RequestFigures:
        seen.append(spec)
        return RequestFigures(prompt_tokens=5, completion_tokens=spec.max_tokens, queue_ms=0, ttft_ms=12.5,
                              prefill_tokens_per_s=400, decode_tokens_per_s=25, itl_p50_ms=40, itl_p95_ms=45,
                              e2e_ms=300, kv_bytes=1024, finish_reason="length")

    settings_ = LiveSettings()
    commands = Commands(Device(AgentConfig(), settings_, benchmark=benchmark))
    done = commands("benchmark", CommandRequest(args={"max_tokens": 8}))
    assert done.ok and done.result["figures"]["completion_tokens"] == 8 and seen[0].max_tokens == 8
    assert "max_tokens" in commands("benchmark", CommandRequest(args={"max_tokens": 0})).error
    assert "extra" in commands("ping", CommandRequest(args={"x": 1})).error.lower()
    same = commands("set_config", CommandRequest(args={"threads": None, "memory_budget_mb": 1024}))
    assert same.ok and same.result["applied"] == {"memory_budget_mb": 1024}  # already so: nothing to refuse
    assert not commands("set_config", CommandRequest(args={})).ok
    unknown = commands("set_config", CommandRequest(args={"max_batch": 8})).error  # the
    assert "'max_batch'" in unknown and "memory_budget_mb, threads, sampling" in unknown  # help's own example
    commands("set_config", CommandRequest(args={"sampling": {"temperature": 0.5}}))
    commands("set_config", CommandRequest(args={"sampling": {"top_k": 40}}))
    assert settings_.sampling.given() == {"temperature": 0.5, "top_k": 40}  # updates merge
    cleared = commands("set_config", CommandRequest(args={"sampling": {"temperature": None}}))
    assert cleared.ok and settings_.sampling.given() == {"top_k": 40}  # null clears (not ignored)
    assert "no broker" in commands("telemetry_flush", CommandRequest()).error
    assert "no model" in Commands(Device(AgentConfig(), LiveSettings()))("benchmark", CommandRequest()).error
    wired = Commands(Device(AgentConfig(), LiveSettings(), rollback=lambda: {"queued": True}))
    assert wired("rollback", CommandRequest()).result == {"queued": True}
    assert "bad args" in wired("rollback", CommandRequest(args={"why": "test"})).error  # refused, not ignored

    def refuse():
        raise CommandError("no previous model to roll back to")

    refused = Commands(Device(AgentConfig(), LiveSettings(), rollback=refuse))("rollback", CommandRequest())
    assert not refused.ok and refused.error == "no previous model to roll back to"  # edge-fleet cmd exits 1


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


def test_mqtts_verifies_the_broker_against_the_given_ca(tmp_path, links, caplog):
    from broker import Broker
    from tls_files import write_tls_files

    ca, crt, key = write_tls_files(tmp_path)
    b = Broker(tmp_path / "broker", extra_config=(f"certfile {crt}\nkeyfile {key}\nallow_anonymous true\n"
                                                 )).start()
    try:
        url = f"mqtts://127.0.0.1:{b.port}"
        link = links(url, "dev-tls", ca_file=ca)
        assert wait_until(lambda: link.is_connected)
        fleet = Fleet(b, subscribe=["edge/v1/dev-tls/tele"], ca_file=ca)
        link.store.append(EventRecord(kind="tick"))
        assert link.flush(5) == {"unsent": 0, "connected": True}
        fleet.close()
        untrusting = links(url, "dev-tls2")  # the system's CAs do not know the test CA: no connection
        assert wait_until(lambda: "certificate verify failed" in caplog.text, 5)
        assert not untrusting.is_connected
    finally:
        b.stop()


# ---- (d) the shipped ACL -------------------------------------------------------------------------------------
USERS = {"dev-a": "pw-a", "dev-b": "pw-b", "_fleet": "pw-fleet", "_fleet-cmd": "pw-cmd"}


@pytest.fixture
def acl_broker(tmp_path):
    from broker import Broker

    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(USERS.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, password],
                       check=True, capture_output=True)
    b = Broker(tmp_path / "broker", extra_config=(
        f"allow_anonymous false\npassword_file {passwd}\nacl_file {REPO / 'systemd' / 'mosquitto' / 'acl'}\n"
        "use_username_as_clientid true\n")).start()
    yield b
    b.stop()


def as_user(broker, user: str, subscribe: list[str]) -> Fleet:
    return Fleet(broker, subscribe, client_id=user, username=user, password=USERS[user])


def test_the_acl_keeps_each_device_to_its_own_topics(acl_broker, links, caplog):
    fleet = as_user(acl_broker, "_fleet", ["edge/v1/#"])  # the consumer: reads everything, writes nothing
    operator = as_user(acl_broker, "_fleet-cmd", ["edge/v1/+/cmd/res/#"])  # edge-fleet cmd
    dev_b = as_user(acl_broker, "dev-b", ["edge/v1/dev-b/cmd/req/#"])
    dev_a = as_user(acl_broker, "dev-a", ["edge/v1/dev-b/cmd/req/#", "edge/v1/+/cmd/req/#", "edge/v1/#"])

    # A cannot read B's commands: B gets its command, A gets only its own marker published after it; the
    # consumer's user cannot command anyone
    fleet.publish("edge/v1/dev-b/cmd/req/ping", b"from-the-consumer")
    operator.publish("edge/v1/dev-b/cmd/req/ping", b"for-b")
    operator.publish("edge/v1/dev-a/cmd/req/ping", b"marker-a")
    assert dev_b.wait(lambda f: any(m.payload == b"for-b" for m in f.messages))
    assert dev_a.wait(lambda f: any(m.payload == b"marker-a" for m in f.messages))
    assert not any(m.payload == b"for-b" for m in dev_a.messages)
    assert not any(m.payload == b"from-the-consumer" for m in dev_b.messages)

    # A cannot publish as B, nor command anyone (itself included); its own telemetry goes through
    forged = ["edge/v1/dev-b/tele", "edge/v1/dev-b/state", "edge/v1/dev-b/cmd/res", "edge/v1/dev-b/cmd/req/ping",
              "edge/v1/dev-a/cmd/req/ping", "edge/v1/dev-a/jobs/notify"]
    for t in forged:
        dev_a.publish(t, b"forged")
    dev_a.publish("edge/v1/dev-a/tele", b"marker-tele")
    assert fleet.wait(lambda f: any(m.payload == b"marker-tele" for m in f.messages))
    assert not [m.topic for m in fleet.messages if m.payload == b"forged"]
    dev_a.close()

    # The real link, as A, works under the ACL: birth, telemetry, a command round trip
    config = fast_config(acl_broker.url, username="dev-a", password="pw-a")
    link = links(acl_broker.url, "dev-a", handler=commands_for(config), username="dev-a", password="pw-a")
    assert fleet.wait(lambda f: (s := f.last_state("dev-a")) is not None and s.status == "online")
    link.store.append(EventRecord(kind="tick"))
    link.notify()
    assert fleet.wait(lambda f: (link.store.boot_id, 0) in f.tele_keys)
    assert operator.call("dev-a", "ping").ok

    # A link posing as B with A's credentials: the broker refuses its batches, so they stay unsent
    caplog.set_level(logging.WARNING, logger="agent.link.outbox")
    link.stop()
    impostor = links(acl_broker.url, "dev-b", username="dev-a", password="pw-a")
    for _ in range(3):
        impostor.store.append(EventRecord(kind="tick"))
    impostor.notify()
    assert wait_until(lambda: "refused a batch" in caplog.text, 5)
    assert impostor.store.count_unsent() == 3
    assert not any(m.topic == "edge/v1/dev-b/tele" for m in fleet.messages)
    for c in (fleet, operator, dev_b):
        c.close()


# ---- (e) malformed and oversized commands -----------------------------------------------------------------
def is_valid_request(payload: bytes) -> bool:
    if len(payload) > MAX_PAYLOAD_BYTES:
        return False
    try:
        CommandRequest.model_validate_json(payload or b"{}")
        return True
    except ValidationError:
        return False


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)
_dumps = lambda v: json.dumps(v).encode()  # noqa: E731
PAYLOADS = st.one_of(
    st.binary(min_size=1, max_size=300),  # mostly not JSON, often not UTF-8
    _json.map(_dumps),  # JSON, mostly not an object
    st.dictionaries(st.text(max_size=10).filter(lambda k: k != "args"), _json, min_size=1, max_size=4).map(_dumps),
    _json.filter(lambda v: not isinstance(v, dict)).map(lambda v: _dumps({"args": v})),  # args not an object
    st.integers(MAX_PAYLOAD_BYTES - 16, MAX_PAYLOAD_BYTES + 4096).map(  # over the limit (else well formed)
        lambda n: b'{"args": {"x": "' + b"a" * n + b'"}}'),
)
NAMES = st.one_of(st.sampled_from(COMMANDS), st.text(
    st.characters(exclude_categories=("Cc", "Cs", "Cn", "Co"), exclude_characters="/+#"), min_size=1, max_size=40))


COMMAND_CASES = 1000


def test_malformed_and_oversized_commands_are_refused_and_the_link_keeps_serving(broker, links, figures):
    """(e) >= 1,000 bad requests: each is answered with an error, or (no response topic) dropped with a logged
    reason; a ping afterwards still works."""
    config = fast_config(broker.url)
    link = links(broker.url, "dev-f", handler=commands_for(config))
    fleet = Fleet(broker, subscribe=["edge/v1/dev-f/cmd/res/#"])
    assert wait_until(lambda: link.is_connected)
    from loglines import LogLines  # here, not at the top: the SIGKILL child runs this file as a script

    logs = LogLines()
    logging.getLogger("agent.link.mqtt").addHandler(logs)
    n = itertools.count()

    @settings(max_examples=COMMAND_CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(name=NAMES, payload=PAYLOADS, answer=st.integers(0, 3))
    def bad_request_is_refused(name, payload, answer):
        assume(name not in COMMANDS or not is_valid_request(payload))
        i = next(n)
        if answer:  # 3 in 4 carry a response topic
            correlation = f"fuzz-{i}".encode()
            fleet.request("dev-f", name, payload, correlation)
            assert fleet.wait(lambda f: correlation in f.responses, 5), (name, payload[:80])
            response = CommandResponse.model_validate_json(fleet.responses[correlation].payload)
            assert not response.ok and response.error
        else:
            before = logs.count("has no response topic")
            fleet.request("dev-f", name, payload, response_topic=None)
            assert wait_until(lambda: logs.count("has no response topic") > before, 5), (name, payload[:80])

    started = time.monotonic()
    try:
        bad_request_is_refused()
    finally:
        logging.getLogger("agent.link.mqtt").removeHandler(logs)
    cases = next(n)
    assert cases >= COMMAND_CASES
    assert link.is_connected and fleet.call("dev-f", "ping").ok
    fleet.close()
    figures.append(f"command payloads: {cases} fuzzed MQTT requests through Mosquitto in "
                   f"{time.monotonic() - started:.0f} s, each refused with a reason, no crash; ping still answered")


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    child_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))


# ---- (e) a broker that refuses or delivers to no one ---------------------------------------------------------

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


def test_a_refused_subscription_takes_the_device_offline_and_is_retried(tmp_path, links, caplog):
    """With its command subscription refused the link stayed connected and 'online', deaf to
    commands and updates, and never subscribed again."""
    from broker import acl_denying_broker

    b = acl_denying_broker(tmp_path / "dynsec", {"dev-s": "pw"}, {"dev-s": ["edge/v1/dev-s/#"]}, {})
    try:
        link = links(b.url, "dev-s", username="dev-s", password="pw")
        assert wait_until(lambda: "refused our subscription to edge/v1/dev-s/cmd/req/+" in caplog.text)
        assert wait_until(lambda: not link.is_connected)
        assert wait_until(lambda: caplog.text.count("refused our subscription") >= 2)  # it asks again
    finally:
        b.stop()


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
