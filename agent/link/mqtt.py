"""The device's MQTT v5 link to the fleet (the only paho import): presence, the telemetry outbox, commands.

Threads, one job each:
- link ("mqtt-link"): connects, watches the connection, reconnects after capped exponential backoff with
  jitter. Each connection is a fresh paho client whose own network thread (loop_start) runs with
  reconnect_on_failure=False, so retry policy, the Will's counter and the session stay ours.
- outbox ("mqtt-outbox", agent.link.outbox): publishes unsent store rows as TelemetryBatch (QoS 1) and marks
  them sent on PUBACK only. Rows unacknowledged when a connection ends stay unsent and go again on the next
  one (the fleet drops replays on (device, boot, seq)).
- commands ("mqtt-commands"): validates cmd/req/{name} messages, calls the handler, answers on the
  request's Response Topic with its Correlation Data (MQTT v5 §4.10). A command that finds COMMAND_QUEUE_MAX
  waiting is answered "busy" from paho's thread; warnings about single commands go out once a minute a kind.

Presence: on connect, a retained DeviceState "online" (birth); the Last Will, registered in CONNECT, is a
retained "offline" with the same connection number; a clean stop publishes "stopped" and then sends
DISCONNECT with reason 0x00, which makes the broker discard the Will (MQTT v5 §3.14.4).

Example:
    link = MqttLink(MqttConfig(url="mqtt://broker:1883"), "dev-1", store, handler=commands)
    link.start(); ...; link.notify()  # after store.append(); link.stop() on shutdown
"""
from __future__ import annotations

import logging
import queue
import random
import socket
import threading
import time
from collections.abc import Callable

import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions
from pydantic import ValidationError

from agent.config import MqttConfig
from agent.logs import Repeats, by_format
from agent.mqtt_link import Backoff, Credentials, LinkState, LinkStateMachine, parse_url
from agent.link.outbox import Outbox
from agent.link.store import TelemetryStore
from agent.wire import COMMANDS, MAX_PAYLOAD_BYTES, CommandRequest, CommandResponse, DeviceState, topic

log = logging.getLogger(__name__)
# Warnings about single commands (dropped, refused, expired, not answerable): a publisher decides how many there
# are, so each kind goes to the journal once a minute, with the count of those held back.
each_command = logging.getLogger(__name__ + ".commands")
COMMAND_REPEATS = Repeats(key=by_format)
each_command.addFilter(COMMAND_REPEATS)

CommandHandler = Callable[[str, CommandRequest], CommandResponse]

# The broker must not send us packets larger than this (MQTT v5 §3.1.2.11.4 Maximum Packet Size; it drops
# them instead). Above MAX_PAYLOAD_BYTES so that a too-large command still reaches us and gets an error
# answer; a bound so that no publisher can make the device buffer megabytes.
MAX_PACKET_BYTES = 4 * MAX_PAYLOAD_BYTES
# The most QoS 1 messages (commands, job documents) the broker may send us unacknowledged (MQTT v5 §3.1.2.11.3,
# §4.9; 65,535 if left out): what a flood can make paho hold for us at once, busy answers included (below).
RECEIVE_MAXIMUM = 64
COMMAND_QUEUE_MAX = 32  # commands waiting for the worker; more are answered busy: a flood must not grow memory
BUSY_ERROR = f"busy: {COMMAND_QUEUE_MAX} commands are already waiting on this device; try again later"
STOP_ACK_TIMEOUT_S = 2.0  # how long a clean stop waits for the "stopped" state's PUBACK
PUBLISH_OVERHEAD_BYTES = 512  # a PUBLISH's fixed header, topic and properties around its payload
JOB_STATUSES_KEPT = 8  # job statuses re-sent after a reconnect (a status reported while away is not lost)


class _Connection:
    """One network connection: its paho client, its number (DeviceState.connection) and its events."""

    def __init__(self, client: paho.Client, number: int):
        self.client, self.number = client, number
        self.connack = threading.Event()
        self.closed = threading.Event()
        self.reason: ReasonCode | None = None  # the CONNACK's reason code (MQTT v5 §3.2.2.2)
        self.max_packet: int | None = None  # the broker's Maximum Packet Size, if it sent one (§3.2.2.3.6)
        self.subscriptions: dict[int, str] = {}  # SUBSCRIBE message id -> topic, to name a refused one

    @property
    def payload_limit(self) -> int:
        """The largest payload the broker takes: a larger packet makes it drop the connection (§3.1.2.11.4),
        and the same batch would go first again on the next one."""
        if self.max_packet is None:
            return MAX_PAYLOAD_BYTES
        return min(MAX_PAYLOAD_BYTES, self.max_packet - PUBLISH_OVERHEAD_BYTES)

    @property
    def is_up(self) -> bool:
        return self.connack.is_set() and not self.reason.is_failure and not self.closed.is_set()

    def publish(self, topic: str, payload: str) -> int | None:
        """A QoS 1 publish: paho's message id, or None if the connection is gone."""
        info = self.client.publish(topic, payload, qos=1)
        return info.mid if info.rc == paho.MQTT_ERR_SUCCESS else None


class MqttLink(LinkStateMachine):
    """The device's connection to the fleet broker. start() once, stop() once; thread-safe otherwise."""

    def __init__(self, config: MqttConfig, device_id: str, store: TelemetryStore,
                 describe: Callable[[], dict] = dict, handler: CommandHandler | None = None,
                 rng: random.Random | None = None, clock: Callable[[], float] = time.time,
                 on_job: Callable[[bytes, int | None], None] | None = None):
        super().__init__()
        self.config, self.device_id, self.store = config, device_id, store
        self.url = config.broker_url(device_id)
        self.endpoint = parse_url(self.url)
        self.describe, self.clock = describe, clock
        self.rng = rng or random.Random()
        self._stop = threading.Event()
        self._conn: _Connection | None = None
        self.outbox = Outbox(store, device_id, config, self._stop)
        self.commands = _CommandDesk(device_id, handler or _no_handler, config.response_expiry_s, self._stop,
                                     self._current)
        self.on_job = on_job  # model-update job documents (jobs/notify), handed over raw
        self._job_status: dict[str, str] = {}  # job id -> latest JobStatusUpdate JSON, re-sent on reconnect
        self._job_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._state_changes = 0  # publish_state() calls: one landing before CONNECTED is published after it

    def _current(self) -> _Connection | None:
        conn = self._conn
        return conn if self.is_connected and conn is not None and conn.is_up else None

    # ---- public ----
    def start(self) -> None:
        assert self.state is LinkState.IDLE, "start() once"
        for target, name in ((self._run, "mqtt-link"), (self.outbox.run, "mqtt-outbox"),
                             (self.commands.run, "mqtt-commands")):
            self._threads.append(threading.Thread(target=target, name=name, daemon=True))
            self._threads[-1].start()

    def stop(self) -> None:
        """Publish "stopped", disconnect cleanly (the Will is discarded) and end the threads."""
        if not self._move(LinkState.STOPPING):
            return
        self._stop.set()
        self.outbox.wake()
        for t in self._threads:
            t.join()
        conn = self._conn
        if conn is not None and conn.is_up:
            self._farewell(conn)
        elif conn is not None:
            conn.client.loop_stop()
        self._move(LinkState.STOPPED)

    def notify(self) -> None:
        """New rows were appended: let the outbox look now rather than at its next poll."""
        self.outbox.wake()

    def flush(self, wait_s: float = 5.0) -> dict:
        """Force an outbox pass and wait (up to wait_s) until every row is delivered."""
        self.outbox.wake()
        deadline = time.monotonic() + wait_s
        while (unsent := self.store.count_unsent()) and self.is_connected and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"unsent": unsent, "connected": self.is_connected}

    # ---- the link thread: connect, watch, back off, again ----
    def _run(self) -> None:
        # Backoff starts over only after a connection that lasted: each retry costs a birth, a Will and a
        # write to disk (the connection count).
        backoff = Backoff(self.config.backoff_min_s, self.config.backoff_max_s, self.rng)
        while self._move(LinkState.CONNECTING):
            conn = self._attempt()
            lasted_s = 0.0
            if conn is not None:
                up_at = time.monotonic()
                self._watch(conn)
                lasted_s = time.monotonic() - up_at
            if not self._move(LinkState.BACKOFF):
                return  # stopping: stop() takes over the connection
            delay = backoff.next_delay_s(lasted_s)
            log.info("mqtt: reconnecting in %.1f s", delay)
            self._stop.wait(delay)

    def _attempt(self) -> _Connection | None:
        """_connect, and any error of ours in it (SQLite locked or full, a bad CA file) is a failed attempt:
        uncaught, it ended the link thread and the device stayed offline until the agent restarted."""
        try:
            return self._connect()
        except Exception:
            log.exception("mqtt: the connection attempt failed")
            self.outbox.attach(None)
            if self._conn is not None:
                self._conn.client.disconnect()
                self._conn.client.loop_stop()
            return None

    def _connect(self) -> _Connection | None:
        """One attempt: CONNECT with clean_start=0 (keep the session) and the Will; on CONNACK, subscribe and
        publish the birth. None if the broker is unreachable or refuses us."""
        conn = self._new_connection(self.store.next_connection())
        self._conn = conn
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.config.session_expiry_s  # MQTT v5 §3.1.2.11.2
        props.MaximumPacketSize = MAX_PACKET_BYTES  # MQTT v5 §3.1.2.11.4
        props.ReceiveMaximum = RECEIVE_MAXIMUM  # MQTT v5 §3.1.2.11.3
        try:  # MQTT v5 §3.1.2.4: Clean Start 0 resumes the session (our cmd/req subscription, queued commands)
            conn.client.connect(self.endpoint.host, self.endpoint.port, self.config.keepalive_s, clean_start=False,
                                properties=props)
        except (OSError, ValueError) as e:  # refused, unreachable, DNS, TLS handshake
            log.warning("mqtt: cannot connect to %s: %s", self.url, e)
            return None
        _no_delay(conn.client)
        conn.client.loop_start()
        if not conn.connack.wait(self.config.connect_timeout_s) or conn.reason.is_failure:
            log.warning("mqtt: %s refused the connection: %s", self.url,
                        conn.reason if conn.reason is not None else "no CONNACK in time")
            conn.client.disconnect()
            conn.client.loop_stop()
            return None
        return conn if self._on_connected(conn) else None

    def _on_connected(self, conn: _Connection) -> bool:
        # A command or job comes from a live publisher, never a retained copy: one retained by mistake would
        # run again (a rollback, a set_config) on every reconnect.
        live_only = SubscribeOptions(qos=1, retainHandling=SubscribeOptions.RETAIN_DO_NOT_SEND)
        wanted = [topic(self.device_id, "cmd", "req", "+")]
        wanted += [topic(self.device_id, "jobs", "notify")] if self.on_job is not None else []
        for name in wanted:
            conn.subscriptions[conn.client.subscribe(name, options=live_only)[1]] = name
        changes = self._state_changes
        # "online" before CONNECTED, so that a stop() beginning now says "stopped" after it, never before
        conn.client.publish(topic(self.device_id, "state"), self._state_json("online", conn.number), qos=1,
                            retain=True)
        if not self._move(LinkState.CONNECTED):
            return False  # stop() began meanwhile; it says goodbye on this connection
        if self._state_changes != changes:  # a change told while not yet CONNECTED: the birth may predate it
            self.publish_state()
        log.info("mqtt: connected to %s (connection %d)", self.url, conn.number)
        self.outbox.attach(conn)
        with self._job_lock:
            for payload in self._job_status.values():  # statuses reported while the broker was away
                conn.client.publish(topic(self.device_id, "jobs", "update"), payload, qos=1, retain=True)
        return True

    def publish_state(self) -> None:
        """Publish our state again (retained) on the live connection, after what describe() says changed (a
        model update or rollback): the fleet's registry must name the model now, not the one at the last
        reconnect, since `edge-fleet deploy` picks the devices it skips by it. Offline, the next birth says it.
        The Will registered at CONNECT still names the model of that moment (MQTT cannot change it)."""
        self._state_changes += 1
        conn = self._conn if self.is_connected else None
        if conn is not None:
            conn.client.publish(topic(self.device_id, "state"), self._state_json("online", conn.number), qos=1,
                                retain=True)

    def publish_job_status(self, update_json: str, job_id: str) -> None:
        """Report a job's state (QoS 1, retained: the fleet sees the latest even after its own restart).
        Kept and re-sent after a reconnect, so a status reported while offline is not lost."""
        with self._job_lock:
            # the latest job last: on a reconnect they go out in order, and the topic retains the last one
            self._job_status.pop(job_id, None)
            self._job_status[job_id] = update_json
            while len(self._job_status) > JOB_STATUSES_KEPT:  # months of rollouts: only the recent ones matter
                self._job_status.pop(next(iter(self._job_status)))
            conn = self._conn if self.is_connected else None
        if conn is not None:
            conn.client.publish(topic(self.device_id, "jobs", "update"), update_json, qos=1, retain=True)

    def _route(self, client, conn: _Connection, msg) -> None:
        """paho's on_message: job documents to the updater, everything else is a command."""
        if msg.topic.endswith("/jobs/notify"):
            if self.on_job is not None and len(msg.payload) > MAX_PAYLOAD_BYTES:
                log.warning("mqtt: a job document of %d bytes (over %d) was dropped", len(msg.payload),
                            MAX_PAYLOAD_BYTES)
            elif self.on_job is not None:
                try:  # with what is left of its expiry (MQTT v5 §3.3.2.3.3): a job that outlives it must not run
                    self.on_job(msg.payload, getattr(msg.properties, "MessageExpiryInterval", None))
                except Exception:  # the updater validates and reports; nothing it raises may stop the link
                    log.exception("mqtt: the job document on %s was not accepted", msg.topic)
            return
        self.commands.offer(msg, client)

    def _watch(self, conn: _Connection) -> None:
        while not conn.closed.wait(0.2):
            if self._stop.is_set():
                return
        self.outbox.attach(None)
        conn.client.loop_stop()

    def _farewell(self, conn: _Connection) -> None:
        info = conn.client.publish(topic(self.device_id, "state"), self._state_json("stopped", conn.number),
                                   qos=1, retain=True)
        try:
            info.wait_for_publish(STOP_ACK_TIMEOUT_S)
        except (ValueError, RuntimeError) as e:
            log.warning("mqtt: the stopped state may not have reached the broker: %s", e)
        # Reason 0x00: normal disconnection, the broker discards the Will (MQTT v5 §3.14.4)
        conn.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, "Normal disconnection"))
        conn.client.loop_stop()

    # ---- the paho client of one connection ----
    def _new_connection(self, number: int) -> _Connection:
        client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=self.device_id,
                             protocol=paho.MQTTv5, reconnect_on_failure=False)
        conn = _Connection(client, number)
        client.user_data_set(conn)
        client.connect_timeout = self.config.connect_timeout_s
        client.on_connect, client.on_disconnect, client.on_subscribe = _on_connect, _on_disconnect, _on_subscribe
        client.on_publish, client.on_message = self.outbox.on_ack, self._route
        client.will_set(topic(self.device_id, "state"), self._state_json("offline", number), qos=1, retain=True)
        password = self.config.password.get_secret_value() if self.config.password else None
        Credentials(self.config.username, password, self.config.ca_file, self.config.cert_file,
                    self.config.key_file).apply(client, self.config.uses_tls)
        return conn

    def _state_json(self, status: str, number: int) -> str:
        base = dict(device_id=self.device_id, status=status, connection=number, boot_id=self.store.boot_id,
                    ts=self.clock())
        try:
            return DeviceState(**{**self.describe(), **base}).model_dump_json()
        except Exception as e:  # a failing or invalid description must not cost us our presence
            log.warning("mqtt: the device description is invalid, sending a bare state: %s", e)
            return DeviceState(**base).model_dump_json()


def _no_delay(client: paho.Client) -> None:
    # Without TCP_NODELAY, Nagle holds a command's answer until the PUBACK written just before it is
    # acknowledged, and the peer delays that ACK: ~40 ms per hop on Linux. Our messages are few and whole.
    sock = client.socket()
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _on_connect(client, conn: _Connection, flags, reason_code, properties) -> None:
    conn.reason = reason_code
    conn.max_packet = getattr(properties, "MaximumPacketSize", None)
    conn.connack.set()


def _on_disconnect(client, conn: _Connection, flags, reason_code, properties) -> None:
    if not conn.closed.is_set():
        log.info("mqtt: connection %d closed: %s", conn.number, reason_code)
    conn.closed.set()


def _on_subscribe(client, conn: _Connection, mid, reason_codes, properties) -> None:
    refused = [code for code in reason_codes if code.is_failure]  # MQTT v5 §3.9.3: >= 0x80 is a refusal
    if refused:
        # Without its subscriptions the link is deaf to commands and updates, so it must not stay connected
        # and "online": leave with the Will (the fleet sees it offline) and retry after the backoff.
        log.error("mqtt: the broker refused our subscription to %s: %s (check its ACL); reconnecting to retry",
                  conn.subscriptions.get(mid, "a command topic"), refused[0])
        client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message"))


def _no_handler(name: str, request: CommandRequest) -> CommandResponse:
    return CommandResponse(command=name, ok=False, error="this agent does not handle commands")


# ---- commands -----------------------------------------------------------------------------------------
class _CommandDesk:
    """cmd/req/{name} messages -> validated CommandRequest -> handler -> CommandResponse on the Response Topic.

    paho's thread only queues messages; the worker validates and answers them one at a time, so a slow
    command (a benchmark) never stalls the network loop. Nothing a publisher sends can end the worker. A
    command that finds COMMAND_QUEUE_MAX waiting is answered "busy" at once, so `edge-fleet cmd` says so
    instead of waiting out its --timeout.
    """

    def __init__(self, device_id: str, handler: CommandHandler, response_expiry_s: int, stop: threading.Event,
                 current: Callable[[], _Connection | None]):
        self.device_id, self.handler, self.response_expiry_s, self._stop = device_id, handler, response_expiry_s, stop
        self.current = current  # the link's connection now, if it is up
        self.response_base = topic(device_id, "cmd", "res")
        self._queue: queue.Queue = queue.Queue(maxsize=COMMAND_QUEUE_MAX)

    def offer(self, msg, client: paho.Client) -> None:
        """From paho's thread: queue the command for the worker, or answer it busy on the client it came by."""
        try:
            self._queue.put_nowait((msg, time.monotonic()))
        except queue.Full:
            self._answer_busy(msg, client)

    def _answer_busy(self, msg, client: paho.Client) -> None:
        # paho's network thread must not wait, and it does not: publish() appends the packet to the client's
        # out-queue, as paho does with the PUBACK it sends for this request once we return. QoS 0: no PUBACK to
        # wait for, and no in-flight slot taken from the telemetry outbox. The broker sends us at most
        # RECEIVE_MAXIMUM unacknowledged requests, and each request's PUBACK is queued behind its answer, so even
        # a broker that stops reading from us can leave at most that many answers waiting to be written.
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None)  # MQTT v5 §3.3.2.3.5
        if response_topic is not None and self._may_answer_on(response_topic):
            busy = CommandResponse(command=msg.topic.rsplit("/", 1)[-1][:64], ok=False, error=BUSY_ERROR)
            try:
                client.publish(response_topic, busy.model_dump_json(), qos=0, properties=self._answer_properties(props))
            except Exception as e:  # raised in paho's thread, it would end the connection's network loop
                each_command.warning("mqtt: a busy answer could not be sent: %s", e)
        each_command.warning("mqtt: a command was dropped: %d commands were already waiting (answered busy if it "
                             "asked for an answer)", COMMAND_QUEUE_MAX)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                msg, arrived = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            # The broker sends what is left of the request's Message Expiry Interval (MQTT v5 §3.3.2.3.3), which
            # `edge-fleet cmd` sets to its --timeout: past it, nobody waits for the answer, and a command (a
            # set_config queued behind a benchmark) must not run after the operator was told "no response".
            # Mosquitto sends whole seconds, rounded down, and leaves the property out in a message's last
            # second: a request with a --timeout of a second or two may come without it, and is then run
            # whatever its wait (measured with Mosquitto 2.0.11).
            expiry = getattr(msg.properties, "MessageExpiryInterval", None)
            if expiry is not None and time.monotonic() - arrived > expiry:
                each_command.warning("mqtt: command %r expired while it waited for the one before; not run",
                                     msg.topic.rsplit("/", 1)[-1][:64])
                continue
            try:
                self._answer(msg)
            except Exception:  # a bug of ours in one command must not end the service of all the next ones
                log.exception("mqtt: answering %s failed", msg.topic)

    def _answer(self, msg) -> None:
        name = msg.topic.rsplit("/", 1)[-1]
        response = self.respond(name, msg.payload)
        props = msg.properties
        response_topic = getattr(props, "ResponseTopic", None)  # MQTT v5 §3.3.2.3.5
        if response_topic is None:
            # the only trace of a request that asked for no answer: in full when it came alone; in a burst (others
            # wait behind it), counted like the rest
            (each_command if self._queue.qsize() else log).warning(
                "mqtt: command %r has no response topic; not answered%s", name[:64],
                f" (it was refused: {response.error})" if not response.ok else "")
            return
        if not self._may_answer_on(response_topic):
            each_command.warning("mqtt: command %r asks for an answer on %r, outside %s/#; not answered", name[:64],
                                 response_topic[:200], self.response_base)
            return
        out = self._answer_properties(props)
        # On the connection up now, not the one the request came on: a long command (a benchmark) can outlive
        # that one, and the broker will not send the request again (it was acknowledged).
        deadline = time.monotonic() + self.response_expiry_s
        while (conn := self.current()) is None:
            if self._stop.wait(0.2) or time.monotonic() > deadline:
                each_command.warning("mqtt: the answer to command %r expired while the link was down", name[:64])
                return
        conn.client.publish(response_topic, response.model_dump_json(), qos=1, properties=out)

    def _answer_properties(self, request: Properties) -> Properties:
        out = Properties(PacketTypes.PUBLISH)
        out.MessageExpiryInterval = self.response_expiry_s  # MQTT v5 §3.3.2.3.3: stale answers are dropped
        correlation = getattr(request, "CorrelationData", None)
        if correlation is not None:
            out.CorrelationData = correlation  # MQTT v5 §3.3.2.3.6: returned unchanged
        return out

    def respond(self, name: str, payload: bytes) -> CommandResponse:
        """The answer to one request: the handler's, or an error saying what was wrong (and logged)."""
        error = self._check(name, payload)
        if error is None:
            try:
                request = CommandRequest.model_validate_json(payload or b"{}")  # an empty body means no args
            except ValidationError as e:
                error = "malformed request: " + _summarize(e)
        if error is not None:
            each_command.warning("mqtt: command %r refused: %s", name[:64], error)
            return CommandResponse(command=name[:64], ok=False, error=error)
        try:
            return self.handler(name, request)
        except Exception as e:
            log.exception("mqtt: command %r failed", name)
            return CommandResponse(command=name, ok=False, error=f"internal error: {type(e).__name__}")

    @staticmethod
    def _check(name: str, payload: bytes) -> str | None:
        if name not in COMMANDS:
            return f"unknown command {name[:64]!r}; known: {', '.join(COMMANDS)}"
        if len(payload) > MAX_PAYLOAD_BYTES:
            return f"the request is {len(payload)} bytes; the limit is {MAX_PAYLOAD_BYTES}"
        return None

    def _may_answer_on(self, response_topic: str) -> bool:
        # Only our own cmd/res subtree (the broker ACL allows nothing else); never a wildcard (MQTT v5 §4.7.1)
        inside = response_topic == self.response_base or response_topic.startswith(self.response_base + "/")
        return inside and "+" not in response_topic and "#" not in response_topic and "\0" not in response_topic


def _summarize(e: ValidationError, most: int = 3) -> str:
    parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:most]]
    return "; ".join(parts) + (f" (and {e.error_count() - most} more)" if e.error_count() > most else "")

