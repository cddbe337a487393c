"""A simulated edge device for fleet tests: a plain paho MQTT v5 client speaking the shared wire messages.

It behaves like the agent's telemetry path as far as the fleet can tell: a retained birth state with a
Last Will, QoS 1 TelemetryBatch publishes from an in-memory outbox whose batches are marked sent only on
PUBACK and re-sent after every reconnect, and answers to cmd/req/{name} on the v5 response topic. The real
agent lives in agent/; this stays independent of it so the fleet is tested against the wire format alone.
"""
from __future__ import annotations

import random
import threading
import time
import uuid

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.wire import (CommandRequest, CommandResponse, DeviceState, EventRecord, Hardware, RequestFigures,
                        RequestRecord, SampleRecord, TelemetryBatch, TelemetryRecord, topic)


def request_record(boot_id: str, seq: int, ts: float, rng: random.Random, model: str = "smollm2",
                   version: str = "int4-a1") -> TelemetryRecord:
    completion = rng.randint(1, 200)
    decode = rng.uniform(5, 60)
    figures = RequestFigures(
        prompt_tokens=rng.randint(1, 500), completion_tokens=completion, queue_ms=rng.uniform(0, 50),
        ttft_ms=rng.uniform(20, 900), prefill_tokens_per_s=rng.uniform(100, 2000), decode_tokens_per_s=decode,
        itl_p50_ms=1000 / decode, itl_p95_ms=1300 / decode, e2e_ms=rng.uniform(100, 9000),
        kv_bytes=rng.randint(1, 1 << 24), finish_reason=rng.choice(["stop", "length"]))
    return TelemetryRecord(boot_id=boot_id, seq=seq, ts=ts, kind="request",
                           request=RequestRecord(model=model, version=version, figures=figures))


def sample_record(boot_id: str, seq: int, ts: float, rng: random.Random) -> TelemetryRecord:
    return TelemetryRecord(boot_id=boot_id, seq=seq, ts=ts, kind="sample", sample=SampleRecord(
        interval_s=10, rss_mb=rng.uniform(200, 400), cpu_percent=rng.uniform(0, 100),
        kv_utilization=rng.random(), queue_depth=rng.randint(0, 4), running=rng.randint(0, 4),
        tokens_per_s=rng.uniform(0, 50)))


def event_record(boot_id: str, seq: int, ts: float, kind: str = "model_change", **detail) -> TelemetryRecord:
    return TelemetryRecord(boot_id=boot_id, seq=seq, ts=ts, kind="event", event=EventRecord(kind=kind, detail=detail))


class SimDevice:
    def __init__(self, port: int, device_id: str, model: str = "smollm2", version: str = "int4-a1",
                 connection: int = 1, seed: int = 0, host: str = "127.0.0.1", answer_commands: bool = True,
                 password: str | None = None, ca_file=None, take_jobs: bool = False):
        self.device_id = device_id
        self.model, self.version = model, version
        self.boot_id = uuid.uuid4().hex[:12]
        self.connection = connection
        self.rng = random.Random(seed)
        self.seq = 0
        self.produced: list[TelemetryRecord] = []
        self.config: dict = {"max_batch": 4}
        self._lock = threading.Lock()
        self._outbox: dict[int, tuple[bytes, tuple[str, ...]]] = {}  # batch number -> (payload, topic), until PUBACKed
        self._in_flight: dict[int, int] = {}  # mid -> batch number
        self._early_acks: set[int] = set()  # PUBACKs that arrived before publish() returned their mid
        self._other_mids: set[int] = set()  # mids of state / answer publishes (not outbox batches)
        self._next_batch = 0
        self.connects = 0
        self.answer_commands = answer_commands
        self.take_jobs = take_jobs  # subscribe to jobs/notify and keep the notices, as received
        self.notices: list[bytes] = []
        self.on_notice = None  # called with each notice's payload too (paho's thread), when set
        self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"dev-{device_id}",
                                  protocol=paho.MQTTv5)
        self.client.on_connect = self._on_connect
        self.client.on_publish = self._on_publish
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.1, 0.5)
        if password is not None:  # the shipped broker config: user name = device id = client id
            self.client.username_pw_set(device_id, password)
        if ca_file is not None:
            self.client.tls_set(ca_certs=str(ca_file))
        self.client.will_set(topic(device_id, "state"), self.state("offline").model_dump_json(), qos=1, retain=True)
        self.host, self.port = host, port

    def state(self, status: str) -> DeviceState:
        return DeviceState(device_id=self.device_id, status=status, connection=self.connection, boot_id=self.boot_id,
                           ts=time.time(), model=self.model, version=self.version, precision="int4",
                           hardware=Hardware(cpu="sim", cores=4, memory_mb=4096, arch="aarch64"),
                           agent_version="0.1.0")

    def start(self) -> "SimDevice":
        self.client.connect(self.host, self.port, keepalive=30)
        self.client.loop_start()
        return self

    def wait_connected(self, timeout_s: float = 10) -> None:
        deadline = time.monotonic() + timeout_s
        while self.connects == 0:
            assert time.monotonic() < deadline, f"{self.device_id} did not connect"
            time.sleep(0.02)

    def stop(self) -> None:
        info = self.client.publish(topic(self.device_id, "state"), self.state("stopped").model_dump_json(), qos=1,
                                   retain=True)
        info.wait_for_publish(5)
        self.client.disconnect()
        self.client.loop_stop()

    def kill(self) -> None:
        """Drop the connection without DISCONNECT, so the broker publishes the Will."""
        self.client.loop_stop()
        self.client.socket().close()

    # ---- telemetry -----------------------------------------------------------------------------------------
    def make_records(self, n: int, ts: float | None = None) -> list[TelemetryRecord]:
        records = []
        for _ in range(n):
            self.seq += 1
            now = ts if ts is not None else time.time()
            records.append(request_record(self.boot_id, self.seq, now, self.rng, self.model, self.version)
                           if self.seq % 10 else sample_record(self.boot_id, self.seq, now, self.rng))
        self.produced.extend(records)
        return records

    def send(self, records: list[TelemetryRecord], subtopic: tuple[str, ...] = ("tele",)) -> None:
        payload = TelemetryBatch(device_id=self.device_id, records=records).model_dump_json().encode()
        with self._lock:
            number = self._next_batch
            self._next_batch += 1
            self._outbox[number] = (payload, subtopic)
        self._publish(number)

    def emit(self, n: int) -> None:
        self.send(self.make_records(n))

    @property
    def unacked(self) -> int:
        with self._lock:
            return len(self._outbox)

    def _publish(self, number: int) -> None:
        # paho calls on_publish holding its own lock, so never call publish() holding ours (lock order); the
        # PUBACK can therefore arrive before we have recorded the mid: on_publish parks it in _early_acks.
        with self._lock:
            payload, subtopic = self._outbox[number]
        mid = self.client.publish(topic(self.device_id, *subtopic), payload, qos=1).mid
        with self._lock:
            if mid in self._early_acks:
                self._early_acks.discard(mid)
                self._outbox.pop(number, None)
            else:
                self._in_flight[mid] = number

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self._lock:
            number = self._in_flight.pop(mid, None)
            if number is not None:
                self._outbox.pop(number, None)
            elif mid in self._other_mids:
                self._other_mids.discard(mid)
            else:
                self._early_acks.add(mid)

    def _publish_other(self, topic_: str, payload, retain: bool = False, properties=None):
        """A publish outside the outbox (state, command answers), made on paho's thread: its PUBACK is
        handled on that same thread afterwards, so recording the mid first is race-free."""
        info = self.client.publish(topic_, payload, qos=1, retain=retain, properties=properties)
        with self._lock:
            self._other_mids.add(info.mid)
        return info

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            return
        self.connects += 1
        self._publish_other(topic(self.device_id, "state"), self.state("online").model_dump_json(), retain=True)
        client.subscribe(topic(self.device_id, "cmd", "req", "+"), qos=1)  # answered only if answer_commands
        if self.take_jobs:
            client.subscribe(topic(self.device_id, "jobs", "notify"), qos=1)
        with self._lock:
            pending = sorted(self._outbox)
            self._in_flight.clear()
            self._early_acks.clear()
        for number in pending:  # the outbox is the truth: everything not PUBACKed goes again
            self._publish(number)

    # ---- commands ------------------------------------------------------------------------------------------
    def _on_message(self, client, userdata, message) -> None:
        if message.topic == topic(self.device_id, "jobs", "notify"):
            self.notices.append(bytes(message.payload))
            if self.on_notice is not None:
                self.on_notice(bytes(message.payload))
            return
        if not self.answer_commands:
            return
        name = message.topic.rsplit("/", 1)[-1]
        request = CommandRequest.model_validate_json(message.payload)
        if name == "ping":
            response = CommandResponse(command=name, ok=True, result={"pong": True, "boot_id": self.boot_id})
        elif name == "get_config":
            response = CommandResponse(command=name, ok=True, result=dict(self.config))
        elif name == "set_config":
            self.config.update(request.args)
            response = CommandResponse(command=name, ok=True, result=dict(self.config))
        else:
            response = CommandResponse(command=name, ok=False, error=f"unknown command {name!r}")
        props = Properties(PacketTypes.PUBLISH)
        props.CorrelationData = message.properties.CorrelationData
        self._publish_other(message.properties.ResponseTopic, response.model_dump_json(), properties=props)
