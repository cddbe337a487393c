"""What the agent's MQTT tests share: fast link settings, polling, the fleet's side as a plain paho client (tests
only; the agent's paho stays in agent/link/mqtt.py), the retained device state and a command handler.

It sits in tests/agent, not tests/, because test_mqtt_delivery.py also runs as the publisher subprocess of the crash
tests, with tests/agent as its sys.path[0].
"""
from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import ValidationError

from agent.link.commands import Commands, Device, LiveSettings
from agent.config import AgentConfig, MqttConfig, TelemetryConfig
from agent.wire import CommandResponse, DeviceState, TelemetryBatch, topic


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


def commands_for(config: MqttConfig, flush=None) -> Commands:
    return Commands(Device(AgentConfig(telemetry=TelemetryConfig(mqtt=config)), LiveSettings(), flush=flush))
