"""The fleet's MQTT link: the only module in fleet/ that imports paho.

A `Link` is one MQTT v5 client with its own reconnect loop (capped exponential backoff with jitter, started
over after a connection that lasted; the states and backoff are agent.mqtt_link's, shared with the device's
link), its subscriptions renewed on every connect, and messages handed to a callback as plain `Inbound`
values. The consumer uses it with a persistent session and manual acknowledgement; the `cmd` CLI uses it
with a clean session for request/response. Nothing here knows the message formats.

    link = Link("mqtt://127.0.0.1:1883", Session("edge-fleet"), [("edge/v1/+/tele", 1)], on_message)
    link.start(); link.wait_ready(5); ...; link.ack(msg); ...; link.stop()
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.mqtt_link import KEEPALIVE_S, Backoff, Credentials, LinkError, LinkState, LinkStateMachine, parse_url
from agent.wire import MAX_EXPIRY_S, NO_MATCHING_SUBSCRIBERS

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.5  # after a lasting connection, 0.25-0.5 s: a broker restart is usually over within a second...
BACKOFF_CAP_S = 30.0  # ...but a fleet of consumers must not hammer a broker that is down for long
# A message publish_confirmed got no PUBACK for is waited on again, not published again, for this long: over a
# link gone silent without closing, a rollout's pass every 0.5 s would publish a new copy of a notice each time
# (each given up on after its wait), and paho would send them all after the reconnect (8-9 copies to a device).
UNCONFIRMED_HOLD_S = 60.0
PUBACK_RESULTS_KEPT = 4096  # PUBACK reason codes remembered for publish_confirmed (message ids wrap at 65535)


@dataclass(frozen=True)
class Session:
    """How the link presents itself to the broker.

    persistent: MQTT v5 Clean Start = 0 with a Session Expiry Interval (MQTT v5 3.1.2.4, 3.1.2.11.2), so
    QoS 1 messages published while we are away are queued by the broker and unacknowledged ones are resent
    on reconnect. receive_maximum bounds how many QoS 1 messages the broker sends us before we acknowledge
    (MQTT v5 3.1.2.11.3, 4.9): with acks sent only after a commit it is the ingest pipeline's depth.
    """

    client_id: str
    persistent: bool = True
    session_expiry_s: int = 24 * 3600  # how long the broker queues telemetry while the fleet is down
    receive_maximum: int = 2000  # unacked messages in flight; with ~20 commits/s, the ceiling is ~40k messages/s
    manual_ack: bool = True


@dataclass(frozen=True)
class Inbound:
    """A received message. `generation` counts connections: an ack is only valid on the connection that
    delivered the message."""

    topic: str
    payload: bytes
    qos: int
    mid: int
    retain: bool
    generation: int
    response_topic: str | None = None
    correlation_data: bytes | None = None
    broker: str | None = None  # the URL of the link that received it: its ack goes back there


OnMessage = Callable[[Inbound], None]


class Link(LinkStateMachine):
    """One MQTT v5 client that keeps itself connected until stop(). Thread-safe: ack() and publish() may
    be called from any thread; callbacks run on paho's network thread.

    The shipped broker config (systemd/mosquitto) makes the user name the client id, so every concurrent
    fleet connection needs its own user in `credentials`."""

    def __init__(self, url: str, session: Session, subscriptions: list[tuple[str, int]], on_message: OnMessage,
                 credentials: Credentials = Credentials(), seed: int | None = None):
        super().__init__()
        self.url, self.endpoint = url, parse_url(url)
        if credentials.ca_file is not None and not self.endpoint.tls:
            raise LinkError("a CA file needs an mqtts:// broker URL")
        self.session = session
        self.credentials = credentials
        self.subscriptions = list(subscriptions)
        self._on_message = on_message
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # the connection's generation, and the state beside it, as ack() reads them
        self._generation = 0
        self._dropped = threading.Event()
        self._ready = threading.Event()  # connected and SUBACK received on the current connection
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._accepted = False  # the current connection got a successful CONNACK
        # why the broker last turned us down (a refused subscription); None once subscribed
        self.refusal: str | None = None
        self.connect_error: str | None = None  # why the last connection attempt failed, until one succeeds
        # message id -> (arrival number, PUBACK reason code), insertion-ordered and bounded; the arrival number
        # tells a PUBACK for this publish from one for an earlier publish with the same (wrapped) id
        self._pubacks: dict[int, tuple[int, object]] = {}
        self._puback_count = 0
        self._puback_cond = threading.Condition()
        # (topic, payload, response topic, correlation) -> (message id, puback count before, give up after)
        self._unconfirmed: dict[tuple, tuple[int, int, float]] = {}
        self._client = self._make_client()

    # ---- public ---------------------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self._generation

    def start(self) -> "Link":
        assert self.state is LinkState.IDLE, "a Link starts once"
        self._thread = threading.Thread(target=self._supervise, name=f"mqtt-{self.session.client_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._move(LinkState.STOPPING)
        self._stop.set()
        self._ready.clear()
        self._client.disconnect()  # a clean DISCONNECT: no Will, the session stays for session_expiry_s
        self._dropped.set()
        if self._thread:
            self._thread.join(timeout_s)
        self._move(LinkState.STOPPED)

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def ack(self, msg: Inbound) -> bool:
        """PUBACK a QoS 1 message now that it is safely handled. A message from an earlier connection is not
        acked here: the broker resends it on the new connection with its original packet id (MQTT v5 4.4),
        and that copy gets its own ack (the store drops it as a duplicate)."""
        if msg.qos == 0 or not self.session.manual_ack:
            return True
        with self._lock:
            if msg.generation != self._generation or not self.is_connected:
                return False
            return self._client.ack(msg.mid, msg.qos) == paho.MQTT_ERR_SUCCESS

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                response_topic: str | None = None, correlation_data: bytes | None = None,
                expiry_s: int | None = None) -> bool:
        """Queue a message; False if we are not connected. Response topic, correlation data and message
        expiry are MQTT v5 PUBLISH properties (3.3.2.3.3, 3.3.2.3.5, 3.3.2.3.6)."""
        return self._publish(topic, payload, qos, retain, response_topic, correlation_data, expiry_s) is not None

    def publish_confirmed(self, topic: str, payload: bytes, timeout_s: float, response_topic: str | None = None,
                          correlation_data: bytes | None = None, expiry_s: int | None = None,
                          unmatched: str | None = None) -> bool | str:
        """Publish at QoS 1 and wait for the broker's PUBACK: True if it took the message, False if it was not
        sent or no PUBACK came (try again), or the reason it refused (MQTT v5 3.4.2.1, e.g. "Not
        authorized" from its ACL: trying again will not help), so that a refused command or rollout notice is
        not counted as sent and then taken for a device that never answered. `unmatched`: what to
        return instead of True when the PUBACK says no subscriber matched (0x10: the broker dropped it)."""
        key = (topic, payload, response_topic, correlation_data)
        with self._puback_cond:
            now = time.monotonic()
            self._unconfirmed = {k: v for k, v in self._unconfirmed.items() if v[2] > now}
            mid, before, _ = self._unconfirmed.get(key, (None, self._puback_count, 0.0))
        if mid is None:  # not under the condition's lock: paho calls on_publish holding a lock publish() takes
            mid = self._publish(topic, payload, 1, False, response_topic, correlation_data, expiry_s)
            if mid is None:
                return False
        with self._puback_cond:
            if not self._puback_cond.wait_for(lambda: self._pubacks.get(mid, (0,))[0] > before, timeout_s):
                self._unconfirmed[key] = (mid, before, time.monotonic() + UNCONFIRMED_HOLD_S)
                return False
            self._unconfirmed.pop(key, None)
            reason = self._pubacks.pop(mid)[1]
        if reason.is_failure:
            return f"the broker refused it: {reason}"
        return unmatched if unmatched is not None and reason.value == NO_MATCHING_SUBSCRIBERS else True

    def _publish(self, topic, payload, qos, retain, response_topic, correlation_data, expiry_s) -> int | None:
        """paho's message id of the queued message, or None if it was not queued."""
        if not self.is_connected:
            # paho would queue it anyway and send it after the reconnect, while our caller, told False,
            # tries again: a rollout's notices would pile up through an outage and go out as a burst of copies
            return None
        props = Properties(PacketTypes.PUBLISH)
        if response_topic is not None:
            props.ResponseTopic = response_topic
        if correlation_data is not None:
            props.CorrelationData = correlation_data
        if expiry_s is not None:
            props.MessageExpiryInterval = max(1, int(min(expiry_s, MAX_EXPIRY_S)))
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        return info.mid if info.rc == paho.MQTT_ERR_SUCCESS else None

    # ---- connection loop ------------------------------------------------------------------------------
    def _supervise(self) -> None:
        # before any connection has lasted, the first retry already waits 0.5-1 s (attempt 1)
        backoff = Backoff(BACKOFF_BASE_S, BACKOFF_CAP_S, self._rng, first_attempt=1)
        while not self._stop.is_set():
            began = time.monotonic()
            accepted = self._connect_once()
            lasted_s = time.monotonic() - began if accepted else 0.0
            if self._stop.is_set():
                break
            self._move(LinkState.BACKOFF)
            self._stop.wait(backoff.next_delay_s(lasted_s))
        self._client.disconnect()  # in case stop() raced with a connect in progress
        self._client.loop_stop()

    def _connect_once(self) -> bool:
        """One connection: connect, run paho's network thread until the connection drops. True if the broker
        accepted it (the backoff then starts again from the bottom)."""
        self._dropped.clear()
        if self._stop.is_set():  # stop() set _dropped just before the clear above: do not connect after it
            return False
        self._accepted = False
        self._move(LinkState.CONNECTING)
        try:
            self._client.connect(self.endpoint.host, self.endpoint.port, keepalive=KEEPALIVE_S,
                                 clean_start=not self.session.persistent, properties=self._connect_properties())
        except OSError as e:
            log.warning("cannot reach MQTT broker %s:%d: %s", self.endpoint.host, self.endpoint.port, e)
            self.connect_error = str(e)
            return False
        self._client.loop_start()
        self._dropped.wait()
        self._client.loop_stop()
        return self._accepted

    def _connect_properties(self) -> Properties:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session.session_expiry_s if self.session.persistent else 0
        props.ReceiveMaximum = self.session.receive_maximum
        return props

    # ---- paho callbacks (paho's network thread; they must not raise) ------------------------------------
    def _make_client(self) -> paho.Client:
        client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.session.client_id,
                             protocol=paho.MQTTv5, reconnect_on_failure=False, manual_ack=self.session.manual_ack)
        self.credentials.apply(client, self.endpoint.tls)
        client.on_connect = self._handle_connect
        client.on_disconnect = self._handle_disconnect
        client.on_subscribe = self._handle_subscribe
        client.on_message = self._handle_message
        client.on_publish = self._handle_publish
        return client

    def _handle_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("MQTT broker refused %s: %s", self.session.client_id, reason_code)
            self.connect_error = f"the broker refused the connection: {reason_code}"
            self._dropped.set()
            return
        self.connect_error = None
        with self._lock:
            self._generation += 1
            self._move(LinkState.CONNECTED)
        self._accepted = True
        log.info("connected to %s:%d as %s (session present: %s)", self.endpoint.host, self.endpoint.port,
                 self.session.client_id, flags.session_present)
        if self.subscriptions:
            client.subscribe(self.subscriptions)
        else:
            self._ready.set()

    def _handle_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        refused = [f"{t} ({rc})" for (t, _), rc in zip(self.subscriptions, reason_codes) if rc.is_failure]
        if refused:
            # Without its subscriptions the link is deaf: ready, the consumer would store nothing of what devices
            # send (acknowledged to them by the broker). Drop the connection, so that it stays not ready and
            # retries them after its backoff.
            self.refusal = "the broker refused the subscription to " + ", ".join(refused)
            log.error("%s: reconnecting to retry (check the broker's ACL for %s)", self.refusal,
                      self.credentials.username or self.session.client_id)
            client.disconnect()
            return
        self.refusal = None
        self._ready.set()

    def _handle_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self._puback_cond:
            self._puback_count += 1
            self._pubacks.pop(mid, None)  # re-inserted last: the oldest entries are the ones evicted
            self._pubacks[mid] = (self._puback_count, reason_code)
            while len(self._pubacks) > PUBACK_RESULTS_KEPT:
                del self._pubacks[next(iter(self._pubacks))]
            self._puback_cond.notify_all()

    def _handle_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._ready.clear()
        if not self._stop.is_set() and self.connect_error is None:  # a refusal was said already, with its reason
            # Mosquitto closes the older of two connections with one client id ("session taken over", often
            # without saying so): two `edge-fleet serve` with the default id flap, and this line names the cause
            log.warning("disconnected from MQTT broker: %s (if this repeats every few seconds, another client "
                        "may be connecting as %r: give each its own --client-id, or its own broker user where the "
                        "user name is the client id, as in the shipped Mosquitto config)", reason_code,
                        self.session.client_id)
        self._dropped.set()

    def _handle_message(self, client, userdata, message) -> None:
        props = getattr(message, "properties", None)
        msg = Inbound(topic=message.topic, payload=bytes(message.payload), qos=message.qos, mid=message.mid,
                      retain=bool(message.retain), generation=self._generation,
                      response_topic=getattr(props, "ResponseTopic", None),
                      correlation_data=getattr(props, "CorrelationData", None), broker=self.url)
        try:
            self._on_message(msg)
        except Exception:  # a bug in the handler must not kill the network thread
            log.exception("message handler failed on %s", message.topic)
