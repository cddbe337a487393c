"""Telemetry consumer: MQTT messages in, validated rows committed, acknowledgements out, in that order.

Data flow (one owner per step):

    paho network thread --Inbound--> queue --> writer thread: gather <= WINDOW_S of messages
        -> parse each (size cap, wire schema, device id in payload == device id in topic)
        -> FleetStore.commit(one transaction) -> PUBACK every message of the batch

A message is acknowledged to the broker only after the transaction holding it has committed (manual
acks), so a crash or a lost connection before then means the broker sends it again; the store drops the
copy. Bad messages are counted per device and reason in `rejected`, logged, acknowledged (so the broker
does not resend them forever) and never stop ingestion. Devices spread over several brokers (fleet.shards): one
Link per broker, all feeding the one queue, and each message acked on the link that delivered it.

Run: edge-fleet serve --mqtt mqtt://HOST:PORT[,mqtt://HOST2:PORT...] --db fleet.db [--client-id ID] [--shared-group G]
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import ValidationError

from agent.mqtt_link import Credentials
from agent.wire import MAX_PAYLOAD_BYTES, DeviceState, TelemetryBatch, TelemetryRecord, device_of, topic
from fleet.mqtt import Inbound, Link, Session
from fleet.db import database_errors
from fleet.shards import Links, Routes
from fleet.rollups import ROLLUP_REFRESH_EVERY_S
from fleet.store import EXPIRED, TELEMETRY_TABLES, Committed, FleetStore, Ingest

log = logging.getLogger(__name__)

WINDOW_S = 0.05  # gather messages this long before one commit: ~20 commits/s whatever the message rate
MAX_BATCH_MESSAGES = 1000  # ...or this many messages, to bound a commit while draining a backlog
RETRY_CAP_S = 5.0  # a failing commit (disk full, database locked) is retried with backoff up to this delay
COMMIT_FAILURES_LOGGED = 5  # a failing commit's first attempts are logged, then one an hour
LOG_EVERY_S = 600.0  # ingest-rate summary period (every 10 s was 8,640 lines a day of nothing new)
REJECTION_LOG_EVERY_S = 60.0  # at most one log line per (device, reason) per period: garbage can be a flood
REJECTION_LINES = 20  # ...and at most this many lines per period in all (300 devices sending a schema this
# server does not know would write 300 lines a minute; ids that change with every message, 2,900)
MAX_WHERE_CHARS = 120  # of the field a logged schema rejection names (an unknown field's name is the sender's)
PRUNE_EVERY_S = 3600.0  # how often the writer deletes telemetry older than the retention period
# How often the writer makes the telemetry tables' day partitions due (PostgreSQL, fleet.partitions.upkeep: days
# ahead are made AHEAD_DAYS early, so hourly leaves days of slack), and how soon it tries again after a failure
PARTITIONS_EVERY_S, PARTITIONS_RETRY_S = 3600.0, 60.0
IDLE_WAIT_S = 0.2  # the writer's wait for a first message (it checks for stop and retention in between)
PUBACK_WAIT_S = 5.0  # a rollout notice without the broker's PUBACK by then goes again next pass
# Messages received and not yet written. Bounded: QoS 0 is outside the broker's flow control (Receive
# Maximum), so one device flooding its topic at QoS 0 grows an unbounded inbox to 1 GB in 20 s. A full
# inbox blocks paho's network thread, which stops reading: TCP then pushes back on the broker.
INBOX_MAX_MESSAGES = 20_000

# rejection reasons, as stored in rejected.reason
TOO_LARGE = "too_large"  # payload over MAX_PAYLOAD_BYTES
INVALID_JSON = "invalid_json"
SCHEMA = "schema"  # valid JSON that is not the wire message for this topic (agent.wire says what each field
# allows: closed sets such as finish_reason, strict ints such as seq, bounded ids and names such as boot_id, model)
DEVICE_MISMATCH = "device_mismatch"  # payload device_id differs from the topic's
EVENT_MISMATCH = "event_mismatch"  # evt/{kind} carrying records that are not `kind` events
BAD_TOPIC = "bad_topic"  # a topic this consumer does not handle


class Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def subscriptions(shared_group: str | None = None) -> list[tuple[str, int]]:
    """State is a normal subscription on every replica (each keeps the whole registry); telemetry and events
    go to one member of the shared group (MQTT v5 4.8.2) when replicas split the load."""
    share = f"$share/{shared_group}/" if shared_group else ""
    return [(topic("+", "state"), 1), (share + topic("+", "tele"), 1), (share + topic("+", "evt", "+"), 1)]


# ---- parsing (pure) -----------------------------------------------------------------------------------------
def _validate(model, payload: bytes):
    try:
        return model.model_validate_json(payload)
    except ValidationError as e:
        first = e.errors()[0]
        reason = INVALID_JSON if first["type"] == "json_invalid" else SCHEMA
        where = ".".join(str(p) for p in first["loc"]) or "message"
        if len(where) > MAX_WHERE_CHARS:
            where = where[:MAX_WHERE_CHARS] + "..."
        raise Rejected(reason, f"{where}: {first['msg']} ({e.error_count()} errors)") from None


def _check_record(record: TelemetryRecord) -> None:
    bodies = {"request": record.request, "sample": record.sample, "event": record.event}
    if bodies[record.kind] is None or any(v is not None for k, v in bodies.items() if k != record.kind):
        raise Rejected(SCHEMA, f"record seq {record.seq}: kind {record.kind!r} must carry exactly its own body")


def _check_device(device_id: str, topic_device: str) -> None:
    if device_id != topic_device:
        raise Rejected(DEVICE_MISMATCH, f"payload says {device_id!r}, topic says {topic_device!r}")


def parse_state(msg: Inbound, topic_device: str) -> DeviceState:
    state = _validate(DeviceState, msg.payload)
    _check_device(state.device_id, topic_device)
    return state


def parse_telemetry(msg: Inbound, topic_device: str, event_kind: str | None = None) -> TelemetryBatch:
    batch = _validate(TelemetryBatch, msg.payload)
    _check_device(batch.device_id, topic_device)
    for record in batch.records:
        _check_record(record)
        if event_kind is not None and (record.kind != "event" or record.event.kind != event_kind):
            raise Rejected(EVENT_MISMATCH, f"record seq {record.seq} is not a {event_kind!r} event")
    return batch


def add_message(ingest: Ingest, msg: Inbound, topic_device: str, received_at: float) -> None:
    """Parse one message into `ingest`; raises Rejected. Contact time: when we received a live message
    from the device itself; a retained state or a Will (offline) only tells us the state's own ts."""
    if len(msg.payload) > MAX_PAYLOAD_BYTES:
        raise Rejected(TOO_LARGE, f"{len(msg.payload)} bytes > {MAX_PAYLOAD_BYTES}")
    kind = msg.topic.split("/")[3:]
    if kind == ["state"] and not msg.payload:
        return  # MQTT's way to delete a retained message (a decommissioned device): nothing to record, no error
    if kind == ["state"]:
        state = parse_state(msg, topic_device)
        live = not msg.retain and state.status != "offline"
        # not live: the device's own clock, which may run ahead; contact is never later than now
        ingest.add_state(state, received_at if live else min(state.ts, received_at), live, msg.broker)
    elif kind == ["tele"]:
        ingest.add_records(topic_device, parse_telemetry(msg, topic_device).records, received_at)
    elif len(kind) == 2 and kind[0] == "evt":
        ingest.add_records(topic_device, parse_telemetry(msg, topic_device, kind[1]).records, received_at)
    else:
        raise Rejected(BAD_TOPIC, msg.topic)


# ---- the consumer -----------------------------------------------------------------------------------------
@dataclass
class Stats:
    messages: int = 0
    inserted: int = 0
    duplicates: int = 0
    rejected: int = 0
    commits: int = 0
    acks_deferred: int = 0  # messages whose connection dropped before their commit: the broker resends them
    rollup_buckets_refreshed: int = 0  # hour buckets re-rolled from raw rows (fleet.rollups)
    rollup_backlog_buckets: int = 0  # ended-hour buckets still stale after the last refresh pass
    rollup_lag_s: float = 0.0  # how long the oldest of them has waited, at the end of that pass

    def add(self, messages: int, committed: Committed, acks_deferred: int) -> None:
        self.messages += messages
        self.inserted += committed.inserted
        self.duplicates += committed.duplicates
        self.rejected += committed.rejected
        self.commits += 1
        self.acks_deferred += acks_deferred


def describe_retention(keep_s: dict[str, float]) -> str:
    """'requests 90 days, samples 14 days, events for good': how long each telemetry table is kept."""
    return ", ".join(f"{table} {keep_s[table] / 86400:g} days" if table in keep_s else f"{table} for good"
                     for table in TELEMETRY_TABLES)


@dataclass
class _Prune:
    """A retention pass under way in the writer thread."""

    before: dict[str, float]  # table -> delete rows stamped before this
    deleted: int = 0
    started: float = field(default_factory=time.monotonic)


class Consumer:
    def __init__(self, store: FleetStore, url: str | Sequence[str], client_id: str = "edge-fleet",
                 shared_group: str | None = None, window_s: float = WINDOW_S, credentials: Credentials = Credentials(),
                 keep_s: dict[str, float] | None = None, refresh_every_s: float = ROLLUP_REFRESH_EVERY_S):
        """url: a broker, or the brokers devices are spread over (fleet.shards), each subscribed to alike, all
        feeding one writer. keep_s: table -> seconds; the table's older rows are deleted, hourly (a table not
        named is kept). refresh_every_s: the request rollups' refresh period."""
        self.store = store
        self.window_s, self.keep_s, self.refresh_every_s = window_s, keep_s or {}, refresh_every_s
        self.stats = Stats()
        self._inbox: queue.Queue[Inbound] = queue.Queue(INBOX_MAX_MESSAGES)
        self._stopping = threading.Event()
        self._rejection_logged: set[tuple[str, str]] = set()  # (device, reason) logged in this period
        self._rejection_period = (-REJECTION_LOG_EVERY_S, 0)  # (its start, rejections not logged in it)
        # the same client id on every broker: they are separate servers, each keeping this consumer's session
        self.links = Links({u: Link(u, Session(client_id), subscriptions(shared_group), self._inbox.put, credentials)
                            for u in ((url,) if isinstance(url, str) else url)})
        self._writer = threading.Thread(target=self._write_loop, name="fleet-writer", daemon=True)

    def start(self) -> "Consumer":
        self._writer.start()
        self.links.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        return self.links.wait_ready(timeout_s)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Commit and acknowledge what has arrived, then disconnect (the session stays with the broker).
        The wait covers a commit queued behind another replica's lock (store.BUSY_TIMEOUT_S)."""
        self._stopping.set()
        self._writer.join(timeout_s)
        self.links.stop()

    # ---- writer thread -------------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        last_log = (time.monotonic(), 0)
        # at start too: a fleet restarted after months prunes at once, and has its partitions for today on
        next_prune = next_refresh = next_partitions = time.monotonic()
        prune: _Prune | None = None  # retention under way: one batch between commits
        refreshing = False  # a rollup refresh pass under way: one batch between commits
        while not self._stopping.is_set():
            batch = self._gather(IDLE_WAIT_S if prune is None and not refreshing else 0.0)
            if batch:
                self._handle(batch)
            last_log = self._maybe_log_rate(last_log)
            if time.monotonic() >= next_partitions:
                next_partitions = time.monotonic() + self._prepare_partitions()
            if prune is None and self.keep_s and time.monotonic() >= next_prune:
                next_prune = time.monotonic() + PRUNE_EVERY_S
                now = time.time()
                prune = _Prune({table: now - keep_s for table, keep_s in self.keep_s.items()})
            if prune is not None and not self._prune_step(prune):
                prune = None
            if not refreshing and time.monotonic() >= next_refresh:
                next_refresh, refreshing = time.monotonic() + self.refresh_every_s, True
            if refreshing:
                refreshing = self._refresh_step()
        self._flush()

    def _refresh_step(self) -> bool:
        """One batch of the rollups' refresh, in the writer thread (the store's owner); at the end of a pass the
        backlog it leaves. Returns whether there is more; a failure waits for the next period."""
        try:
            n = self.store.refresh_rollups()
            if n:
                self.stats.rollup_buckets_refreshed += n
                return True
            backlog = self.store.rollup_backlog()
        except database_errors() as e:
            log.error("refreshing the request rollups failed (queries read their hours raw meanwhile): %s", e)
            return False
        self.stats.rollup_backlog_buckets, self.stats.rollup_lag_s = backlog.buckets, backlog.lag_s
        return False

    def _prepare_partitions(self) -> float:
        """The day partitions due (PostgreSQL), in the writer thread; returns the seconds until the next try."""
        try:
            made = self.store.prepare_partitions()
        except database_errors() as e:
            log.error("making the telemetry tables' next day partitions failed (rows past the last one go to the "
                      "default partition meanwhile); trying again in %.0f s: %s", PARTITIONS_RETRY_S, e)
            return PARTITIONS_RETRY_S
        if made:
            log.info("made %d day partitions of the telemetry tables", made)
        return PARTITIONS_EVERY_S

    def _prune_step(self, prune: "_Prune") -> bool:
        """One batch of retention, in the writer thread (the store's owner), so that ingest waits for one
        batch at most (the whole prune in one call holds ingest for 24 s on a day of expired rows, 149 s at
        the agent's default sample rate). Returns whether there is more; a failure waits for the next
        period."""
        ages = describe_retention(self.keep_s)
        try:
            n = self.store.prune_step(prune.before)
        except database_errors() as e:
            log.error("pruning telemetry older than it is kept (%s) failed: %s", ages, e)
            return False
        prune.deleted += n
        if not n and prune.deleted:
            log.info("pruned %d telemetry rows older than they are kept (%s) in %.1f s", prune.deleted, ages,
                     time.monotonic() - prune.started)
        return n > 0

    def _flush(self) -> None:
        """On stop: commit what has arrived so far; anything later is not acked and comes again next time."""
        batch = []
        while True:
            try:
                batch.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if batch:
            self._handle(batch)

    def _gather(self, wait_s: float) -> list[Inbound]:
        try:
            batch = [self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.window_s
        while len(batch) < MAX_BATCH_MESSAGES:
            remaining_s = deadline - time.monotonic()
            try:
                batch.append(self._inbox.get(timeout=remaining_s) if remaining_s > 0 else self._inbox.get_nowait())
            except queue.Empty:
                break
        return batch

    def _handle(self, batch: list[Inbound]) -> None:
        ingest = Ingest(kept_s=self.keep_s)
        received_at = time.time()
        for msg in batch:
            self._add(ingest, msg, received_at)
        for (device_id, reason), n in ingest.rejected.items():
            if reason == EXPIRED:
                self._log_rejection(device_id, Rejected(EXPIRED, f"{n} records older than they are kept "
                                                                 f"({describe_retention(self.keep_s)}), not stored"))
        committed = self._commit(ingest)
        if committed is None:
            return  # stopping while the database is failing: nothing acked, the broker resends it all
        deferred = sum(not self.links[msg.broker].ack(msg) for msg in batch)  # on the link it came from
        self.stats.add(len(batch), committed, deferred)

    def _add(self, ingest: Ingest, msg: Inbound, received_at: float) -> None:
        device_id = device_of(msg.topic) or ""
        try:
            add_message(ingest, msg, device_id, received_at)
        except Rejected as e:
            ingest.reject(device_id, e.reason)
            self._log_rejection(device_id, e)

    def _commit(self, ingest: Ingest) -> Committed | None:
        attempt, logged_at = 0, -float("inf")
        while True:
            try:
                committed = self.store.commit(ingest)
            except database_errors() as e:
                attempt += 1
                # the first few, then one an hour while it lasts (a database on a disk gone read-only fails
                # every 5 s for good: ~17,000 lines a day)
                if attempt <= COMMIT_FAILURES_LOGGED or time.monotonic() - logged_at >= 3600:
                    logged_at = time.monotonic()
                    log.error("commit of %d records failed (attempt %d), retrying%s: %s", ingest.num_records,
                              attempt, "; said again hourly" if attempt == COMMIT_FAILURES_LOGGED else "", e)
                # the exponent capped: 2 ** 1024 overflows a float after ~85 min of failures, which would end
                # the writer thread
                if self._stopping.wait(min(RETRY_CAP_S, 0.1 * 2 ** min(attempt, 16))):
                    return None
                continue
            if attempt > COMMIT_FAILURES_LOGGED:
                log.info("commit of %d records succeeded after %d failed attempts", ingest.num_records, attempt)
            return committed

    def _log_rejection(self, device_id: str, e: Rejected) -> None:
        """One line per (device, reason) per period, at most REJECTION_LINES in all; the `rejected` table
        counts every message either way."""
        now = time.monotonic()
        start, unlogged = self._rejection_period
        if now - start >= REJECTION_LOG_EVERY_S:  # a new period (the set forgets the last one's: bounded)
            if unlogged:  # said when the next rejection comes: the count is of a period that has ended
                log.warning("%d more rejected messages were not logged in the %.0f s after %d lines (edge-fleet "
                            "rejected counts them all)", unlogged, REJECTION_LOG_EVERY_S, REJECTION_LINES)
            self._rejection_logged.clear()
            start, unlogged = now, 0
        key = (device_id, e.reason)
        if key in self._rejection_logged or len(self._rejection_logged) >= REJECTION_LINES:
            self._rejection_period = (start, unlogged + 1)
            return
        self._rejection_logged.add(key)
        self._rejection_period = (start, unlogged)
        log.warning("rejected a message from device %r: %s: %s", device_id, e.reason, e.detail)

    def _maybe_log_rate(self, last: tuple[float, int]) -> tuple[float, int]:
        now, (then, inserted_then) = time.monotonic(), last
        if now - then < LOG_EVERY_S:
            return last
        if self.stats.inserted != inserted_then:
            log.info("ingested %.1f records/s (%d stored, %d duplicates, %d rejected in total); rollups: %d hour "
                     "buckets refreshed, %d stale, the oldest for %.0f s",
                     (self.stats.inserted - inserted_then) / (now - then), self.stats.inserted,
                     self.stats.duplicates, self.stats.rejected, self.stats.rollup_buckets_refreshed,
                     self.stats.rollup_backlog_buckets, self.stats.rollup_lag_s)
        return now, self.stats.inserted


@dataclass(frozen=True)
class Artifacts:
    """Where serve publishes bundles over HTTP for rollouts."""

    host: str
    port: int
    directory: Path
    credentials: Credentials | None = None  # the jobs link's own: a broker with use_username_as_clientid
    # closes one of two connections that share a user
    public_url: str | None = None  # what devices fetch from, when not http://host:port (a wildcard bind)
    job_key: Ed25519PrivateKey | None = None  # signs every job document (devices with [updates] job_keys need it)


def jobs_link(url: str, client_id: str, credentials: Credentials,
              on_status: Callable[[str, bytes, Callable[[], object]], None]) -> Link:
    """The rollout driver's MQTT link: device job reports in, notices out. Persistent, and each report is
    acked once recorded, so the reports devices send while the fleet is down wait for it in the broker."""
    link = Link(url, Session(client_id=f"{client_id}-jobs"), [("edge/v1/+/jobs/update", 1)],
                lambda m: on_status(m.topic, m.payload, lambda: link.ack(m)), credentials)
    return link


def jobs_links(url: str | Sequence[str], db_path: Path, client_id: str, credentials: Credentials,
               on_status: Callable[[str, bytes, Callable[[], object]], None]) -> tuple[Links, Routes]:
    """A jobs link on each broker, and the routes that pick the one reaching a device."""
    brokers = (url,) if isinstance(url, str) else tuple(url)
    links = Links({u: jobs_link(u, client_id, credentials, on_status) for u in brokers})
    return links, Routes(brokers, db_path)


def _start_rollouts(db_path: Path, url: str | Sequence[str], client_id: str, credentials: Credentials,
                    artifacts: Artifacts):
    """The artifact HTTP server, an MQTT link per broker for job documents and statuses, and the rollout driver
    (its notices routed to each device's broker: fleet.shards.Routes)."""
    from fleet.artifacts import ArtifactServer
    from fleet.updates import NO_JOB_SUBSCRIBER, RolloutDriver

    credentials = artifacts.credentials or credentials
    server = ArtifactServer(artifacts.directory, artifacts.host, artifacts.port,
                            public_url=artifacts.public_url).start()
    holder: dict = {}
    links, routes = jobs_links(url, db_path, client_id, credentials, lambda *a: holder["driver"].on_status(*a))
    holder["driver"] = driver = RolloutDriver(
        db_path, lambda t, p, e: links[routes.broker_of(device_of(t))].publish_confirmed(
            t, p, PUBACK_WAIT_S, expiry_s=e, unmatched=NO_JOB_SUBSCRIBER),
        server.base_url,
        job_key=artifacts.job_key)
    links.start()
    driver.start()
    log.info("artifacts on %s; rollouts running", server.base_url)
    return driver, links, server


def _log_rollup_backlog(store: FleetStore, refresh_every_s: float) -> None:
    """At start: the rollups' refresh backlog (a fleet down for a while, or refreshing slower than it ingests,
    starts with one) and the refresh period."""
    try:
        backlog = store.rollup_backlog()
    except database_errors() as e:
        log.warning("request rollups: backlog not known (%s); refreshed every %g s (--rollup-refresh)", e,
                    refresh_every_s)
        return
    log.info("request rollups: %d ended hour buckets to refresh, the oldest waiting %.0f s; refreshed every %g s "
             "(--rollup-refresh)", backlog.buckets, backlog.lag_s, refresh_every_s)


def serve(db_path: Path, url: str | Sequence[str], client_id: str, shared_group: str | None, stop: threading.Event,
          credentials: Credentials = Credentials(), artifacts: Artifacts | None = None,
          keep_s: dict[str, float] | None = None, refresh_every_s: float = ROLLUP_REFRESH_EVERY_S) -> Stats:
    """Run a consumer until `stop` is set; returns its totals. With artifacts it also serves published
    bundles over HTTP and drives model rollouts. keep_s: telemetry retention, table -> seconds;
    refresh_every_s: the request rollups' refresh period."""
    store = FleetStore(db_path)
    # said at every start, before the first prune: an upgrade can bring a retention the database never had
    # (the first start of a fleet from before --keep deletes everything older than 90 days)
    log.info("telemetry kept: %s (--keep, --keep-samples)", describe_retention(keep_s or {}))
    _log_rollup_backlog(store, refresh_every_s)
    consumer = Consumer(store, url, client_id, shared_group, credentials=credentials, keep_s=keep_s,
                        refresh_every_s=refresh_every_s).start()
    rollouts = _start_rollouts(db_path, url, client_id, credentials, artifacts) if artifacts else None
    started = time.monotonic()
    try:
        stop.wait()
    finally:
        if rollouts:
            driver, link, server = rollouts
            for part in (link, driver, server):  # no new reports first; the driver then records what it holds
                part.stop()
        consumer.stop()
        store.close()
    log.info("stopped after %.0f s", time.monotonic() - started)
    return consumer.stats
