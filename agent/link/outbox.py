"""The telemetry sender: unsent store rows -> TelemetryBatch -> QoS 1 publish -> PUBACK -> mark_sent.

The outbox thread ("mqtt-outbox") of agent.link.mqtt's link. It publishes the store's unsent rows in batches
that fit the broker's packet limit, keeps at most `max_inflight_batches` unacknowledged, and marks rows sent
on PUBACK only (durable before delivered). Rows unacknowledged when a connection ends go again on the next
one (the fleet drops replays on (device, boot, seq)); after such an end, the bytes in flight start small and
grow with each PUBACK (slow start). A refusal (PUBACK reason >= 0x80, or 0x10 no matching subscribers)
keeps the rows and pauses. It knows the connection only through `Connection`: no paho here.

Example:
    outbox = Outbox(store, "dev-1", config, stop)  # the link: outbox.attach(conn) on CONNACK, None on loss
    threading.Thread(target=outbox.run).start(); outbox.wake()  # after store.append()
"""
from __future__ import annotations

import logging
import queue
import sqlite3
import threading
import time
from typing import Protocol

from agent.config import MqttConfig
from agent.link.store import OutboxRow, StoreFull, TelemetryStore
from agent.wire import MAX_PAYLOAD_BYTES, NO_MATCHING_SUBSCRIBERS, TelemetryBatch, topic

log = logging.getLogger(__name__)

REFUSED_PAUSE_S = 30.0  # after the broker refuses a batch (PUBACK reason >= 0x80), wait before trying again
REFUSAL_LOG_EVERY_S = 3600.0  # a refusal that goes on is logged this often
# After a connection ended with batches unacknowledged, the next sends this many bytes at first and grows
# the bytes in flight with each PUBACK (TCP's slow start), to at most what arrived within half a keepalive.
# Over an uplink of 600-1,000 B/s, enough for the backlog, a full window of 200-record batches takes longer
# than two keepalives to send: paho closes the connection for want of a PINGRESP queued behind them, and
# a next connection sending the same full window first again would never deliver anything.
SLOW_START_BYTES = 8 << 10
# {"device_id": ..., "records": []} around a batch's records, at the longest device id (64 characters)
EMPTY_BATCH_BYTES = len(TelemetryBatch.model_construct(device_id="d" * 64, records=[]).model_dump_json())


class Connection(Protocol):
    """What the outbox needs of one MQTT connection (agent.link.mqtt's _Connection)."""

    @property
    def is_up(self) -> bool: ...

    @property
    def payload_limit(self) -> int: ...  # the largest payload the broker takes, bytes

    def publish(self, topic: str, payload: str) -> int | None: ...  # QoS 1; the message id, None if not sent


class Outbox:
    """Unsent rows -> TelemetryBatch -> QoS 1 publish -> PUBACK -> mark_sent.

    Only the outbox thread touches `_inflight` (message id -> row ids) and `_cursor`: paho's thread only
    queues acks. The ack of a batch can arrive before publish() returns; it is then still queued until
    this thread has recorded the mapping, so it is never lost. (Holding a lock across publish() instead
    would deadlock: paho calls on_publish while holding the lock publish() needs.)
    """

    def __init__(self, store: TelemetryStore, device_id: str, config: MqttConfig, stop: threading.Event):
        self.store, self.device_id, self.config, self._stop = store, device_id, config, stop
        self.topic = topic(device_id, "tele")
        self._acks: queue.SimpleQueue = queue.SimpleQueue()  # (connection, mid, reason code)
        self._wake = threading.Event()
        self._target: Connection | None = None  # set by the link thread
        self._conn: Connection | None = None  # the connection _inflight belongs to
        self._inflight: dict[int, list[int]] = {}
        self._sizes: dict[int, tuple[int, float]] = {}  # message id -> (payload bytes, when published)
        self._window: int | None = None  # payload bytes allowed in flight; None: as many batches as configured
        self._cursor = 0  # the last row id published on this connection
        self._paused_until = 0.0
        self._refusal_logged_at = -float("inf")  # when a refused batch was last logged; reset by an accepted one
        self._unmarked_logged_at = -float("inf")  # when delivered rows that could not be marked sent were logged

    def attach(self, conn: Connection | None) -> None:
        self._target = conn
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def on_ack(self, client, conn: Connection, mid: int, reason_code, properties) -> None:
        self._acks.put((conn, mid, reason_code))  # paho's thread: queue it, touch nothing else
        self._wake.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.config.outbox_poll_s)
            self._wake.clear()
            try:
                self._pass()
            except Exception:  # a database error must not end delivery for good; the next pass retries
                log.exception("mqtt: outbox pass failed")

    def _pass(self) -> None:
        self._drain_acks()  # acks that came before a disconnect still count
        if self._target is not self._conn:  # a new connection (or none): unacked rows go again from the start
            if self._inflight:  # and this one ended with batches unacknowledged: the link may be too slow for them
                self._window = SLOW_START_BYTES
            self._conn, self._inflight, self._sizes, self._cursor = self._target, {}, {}, 0
        while self._can_publish() and self._publish_batch():
            self._drain_acks()

    def _can_publish(self) -> bool:
        return (self._conn is not None and self._conn.is_up and not self._stop.is_set()
                and len(self._inflight) < self.config.max_inflight_batches and time.monotonic() >= self._paused_until
                and (self._window is None or self._bytes_in_flight() < self._window))

    def _bytes_in_flight(self) -> int:
        return sum(size for size, _ in self._sizes.values())

    def _grow_window(self, size: int, published: float) -> None:
        """An acknowledged batch of `size` bytes: double the window, to at most what this link carried in half
        a keepalive; past a full window of the largest batches, no limit again."""
        rate = size / max(time.monotonic() - published, 1e-3)
        grown = min(2 * self._window, max(SLOW_START_BYTES, int(rate * self.config.keepalive_s / 2)))
        self._window = None if grown >= self.config.max_inflight_batches * MAX_PAYLOAD_BYTES else grown

    def _drain_acks(self) -> None:
        while True:
            try:
                conn, mid, reason = self._acks.get_nowait()
            except queue.Empty:
                return
            rows = self._inflight.pop(mid, None) if conn is self._conn else None
            if rows is None:
                continue  # a state or response publish, or an ack from an earlier connection
            size, published = self._sizes.pop(mid)
            # MQTT v5 §3.4.2.1: the broker did not accept it (e.g. 0x87 not authorized), or accepted it for no
            # one (0x10: the fleet server's session is gone, e.g. a broker restarted without persistence):
            # neither is a delivery, so both keep the rows unsent and retry later.
            if reason.is_failure or reason.value == NO_MATCHING_SUBSCRIBERS:
                # said once an hour while it lasts (no fleet server subscribed can last for good); the retries
                # go on every REFUSED_PAUSE_S
                if time.monotonic() - self._refusal_logged_at >= REFUSAL_LOG_EVERY_S:
                    self._refusal_logged_at = time.monotonic()
                    log.warning("mqtt: the broker %s a batch of %d records: %s; retrying every %.0f s%s",
                                "refused" if reason.is_failure else "delivered to no one", len(rows), reason,
                                REFUSED_PAUSE_S, "" if reason.is_failure else " (is the fleet server running?)")
                self._cursor = min(self._cursor, rows[0] - 1)
                self._paused_until = time.monotonic() + REFUSED_PAUSE_S
                continue
            self._refusal_logged_at = -float("inf")  # accepted: the next refusal is news
            if self._window is not None:
                self._grow_window(size, published)
            try:
                self.store.mark_sent(rows)
                self._unmarked_logged_at = -float("inf")  # marked: the next failure is news
            except (sqlite3.Error, StoreFull, OSError) as e:
                # Locked, full or read-only: they go again (the fleet drops replays), not weeks later, after a
                # pause (a card remounted read-only fails every mark, for good), said once an hour while it
                # lasts.
                self._cursor = min(self._cursor, rows[0] - 1)
                self._paused_until = time.monotonic() + REFUSED_PAUSE_S
                if time.monotonic() - self._unmarked_logged_at >= REFUSAL_LOG_EVERY_S:
                    self._unmarked_logged_at = time.monotonic()
                    log.warning("mqtt: delivered %d records but cannot mark them sent (%s); they go again in "
                                "%.0f s (the fleet keeps one copy)", len(rows), e, REFUSED_PAUSE_S)

    def _publish_batch(self) -> bool:
        rows = self.store.unsent(self.config.batch_max_records, after=self._cursor)
        if not rows:
            return False
        limit = self._conn.payload_limit
        window = limit if self._window is None else max(self._window - self._bytes_in_flight(), 1)
        rows = fit_batch(rows, min(limit, window))  # at least one record, whatever the window
        payload = TelemetryBatch(device_id=self.device_id, records=[r.record for r in rows]).model_dump_json()
        if len(payload.encode()) > limit:  # one record alone is over this broker's limit: it can never go
            log.warning("mqtt: a %d-byte record is over the broker's packet limit (%d): dropped", len(payload), limit)
            self.store.drop_undeliverable([rows[0].row_id], "too_large")
            return True
        mid = self._conn.publish(self.topic, payload)
        if mid is None:
            return False  # the connection just went; the link thread will notice
        self._inflight[mid] = [r.row_id for r in rows]
        self._sizes[mid] = (len(payload.encode()), time.monotonic())
        self._cursor = rows[-1].row_id
        return True


def fit_batch(rows: list[OutboxRow], max_bytes: int = MAX_PAYLOAD_BYTES) -> list[OutboxRow]:
    """The longest prefix of rows whose batch stays under max_bytes, at least one row.

    Measured as sent, not as stored: a row an older agent wrote gains this one's new default fields."""
    total = EMPTY_BATCH_BYTES
    for i, row in enumerate(rows):
        total += len(row.record.model_dump_json().encode()) + 1
        if total > max_bytes:
            return rows[:max(i, 1)]
    return rows
