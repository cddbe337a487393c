"""Model rollouts, fleet side: the published-model registry, jobs and their devices, and the driver that
runs inside `edge-fleet serve`: it notifies each wave's devices over MQTT, records what they report on
jobs/update, and advances, completes or halts each job by fleet.rollout's policy.

Job documents travel over MQTT (QoS 1 to a persistent device session); the files they name are served by
fleet.artifacts over HTTP with Range. Tables (migration 0004_updates in fleet/migrations.py):
    models(name, version, manifest, signature, key_id, published_at)
    jobs(id, operation, model, version, state, wave_size, max_failure_rate, allow_downgrade,
         min_tokens_per_s, reason, created_at, updated_at, device_timeout_s, adapter, adapter_version)
         (an adapter job's model and version are its base's; adapters: fleet.adapter_registry)
    job_devices(job_id, device_id, wave, state, step, percent, reason, figures, notified, updated_at,
                notified_at, reported_ts)
"""
from __future__ import annotations

import collections
import json
import logging
import math
import re
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent import durable
from agent.engine.bundle import open_bundle
from agent.wire import (ADAPTER_OPERATIONS, MAX_EXPIRY_S, MODEL_NAME_PATTERN, TERMINAL_JOB_STATES, JobDocument,
                        JobState, JobStatusUpdate, Manifest, device_of, is_device_id, topic)
from fleet.adapter_registry import adapter_document_fields, adapter_target, is_adapter, publish_adapter
from fleet.db import Database, database_errors, open_database, unavailable_errors
from fleet.leader import RETRY_S, Leadership
from fleet.mqtt import UNCONFIRMED_HOLD_S
from fleet.rollout import DeviceJob, decide, plan_waves
from fleet.signing import load_private_key, sign_job, sign_manifest

log = logging.getLogger(__name__)

# what publish_mqtt answers when the broker's PUBACK says no session subscribes to the notice's topic (0x10)
NO_JOB_SUBSCRIBER = "no device session subscribes to its job notices"
OPEN_JOB_STATES = sorted(s.value for s in JobState if s not in TERMINAL_JOB_STATES)  # QUEUED, IN_PROGRESS
STATUS_INBOX_MAX = 100_000  # device reports waiting for the driver's thread
BUSY_TIMEOUT_S = 10.0  # how long a SQLite write waits for another connection's lock (a backup, a replica)


def applies(state: JobState, reported_ts: float | None, update: JobStatusUpdate) -> bool:
    """Whether a device's status report replaces the state recorded for it.

    Reports arrive out of order and again: the device publishes them retained, so the broker replays the
    last one whenever the fleet reconnects. A final state is never replaced by one that is not (a replayed
    IN_PROGRESS would revive a SUCCEEDED or TIMED_OUT device), and an older progress report never replaces
    a newer one. A final report always replaces progress, whatever its stamp: the device's clock may have
    stepped back meanwhile (NTP, or a reboot with no RTC after a power cut mid-install), and such a
    SUCCEEDED ignored would leave the device to time out. A device counted TIMED_OUT that
    later reports how it really ended is recorded as it ended.
    """
    final = update.state in TERMINAL_JOB_STATES
    if state is JobState.TIMED_OUT:
        return final and update.state is not JobState.TIMED_OUT
    if state in TERMINAL_JOB_STATES:
        return False
    return final or reported_ts is None or update.ts >= reported_ts


# ---- registry and jobs (CLI side) -------------------------------------------------------------------------
def publish(db: Database, bundle_dir: Path, key_path: Path, artifacts_dir: Path) -> str:
    """Verify a bundle, sign its manifest, copy it where the artifact server serves it; returns NAME@VERSION.
    A LoRA adapter's folder is published the same way (fleet.adapter_registry): MODEL@VERSION:ADAPTER@VERSION."""
    if is_adapter(bundle_dir):
        return publish_adapter(db, bundle_dir, key_path, artifacts_dir)
    bundle = open_bundle(bundle_dir)
    m = bundle.manifest
    if not all(re.fullmatch(MODEL_NAME_PATTERN, x) for x in (m.name, m.version)):  # a path and URL segment each
        raise ValueError(f"{m.name}@{m.version}: a published model's name and version must each be 1-64 letters, "
                         f"digits and . _ + - (rebuild it with edge-quantize build --name)")
    signature, kid = sign_manifest(m, load_private_key(key_path))
    dest = Path(artifacts_dir) / f"{m.name}@{m.version}"
    if not dest.exists():
        import shutil

        tmp = dest.with_name(f".{dest.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(bundle.path, tmp)
        durable.move_into_place(tmp, dest)  # on disk before the row below offers it to devices
    db["models"].upsert({"name": m.name, "version": m.version, "manifest": m.model_dump_json(), "signature": signature,
                         "key_id": kid, "published_at": time.time()}, pk=("name", "version"))
    return f"{m.name}@{m.version}"


def create_job(db: Database, target: str | None, devices: list[str], wave_size: int,
               max_failure_rate: float, allow_downgrade: bool = False, min_tokens_per_s: float | None = None,
               operation: str = "install", device_timeout_s: float = 1800.0) -> str:
    devices = list(dict.fromkeys(devices))  # a device named twice is deployed to once
    if not devices:
        raise ValueError("no devices to deploy to")
    bad = [d for d in devices if not is_device_id(d)]
    if bad:  # it would name an MQTT topic: a wildcard there stalled every rollout's pass
        raise ValueError(f"not a device id: {bad[0]!r} (letters, digits, '_', '.', '-'; at most 64)")
    if wave_size < 1:
        raise ValueError(f"wave size must be at least 1, got {wave_size}")
    wave_size = min(wave_size, len(devices))  # a wave larger than the job is the whole job
    if not 0 <= max_failure_rate <= 1:
        raise ValueError(f"max failure rate must be in [0, 1], got {max_failure_rate}")
    if min_tokens_per_s is not None and not 0 <= min_tokens_per_s < math.inf:
        raise ValueError(f"min tokens/s must be a number >= 0, got {min_tokens_per_s}")
    if not 0 < device_timeout_s <= MAX_EXPIRY_S:  # the notice expires with it (an MQTT four-byte integer)
        raise ValueError(f"device timeout must be a positive number of seconds up to {MAX_EXPIRY_S}, "
                         f"got {device_timeout_s}")
    name = version = adapter = None
    if operation == "install":
        name, _, version = (target or "").partition("@")
        if not db["models"].count_where("name = ? and version = ?", [name, version]):
            raise ValueError(f"{target} is not published (edge-fleet publish BUNDLE --key KEY)")
    elif operation in ADAPTER_OPERATIONS:
        adapter = adapter_target(db, target or "")
        name, version = adapter.base_name, adapter.base_version
    job_id = f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
    now = time.time()
    with db.transaction():  # a failed insert of its devices must not leave the job row
        db["jobs"].insert({"id": job_id, "operation": operation, "model": name, "version": version,
                           "state": JobState.IN_PROGRESS.value, "wave_size": wave_size,
                           "max_failure_rate": max_failure_rate, "allow_downgrade": int(allow_downgrade),
                           "min_tokens_per_s": min_tokens_per_s, "reason": None, "created_at": now, "updated_at": now,
                           "device_timeout_s": device_timeout_s,
                           **({"adapter": adapter.name, "adapter_version": adapter.version} if adapter else {})})
        db["job_devices"].insert_all({"job_id": job_id, "device_id": d.device_id, "wave": d.wave,
                                      "state": JobState.QUEUED.value, "step": None, "percent": None,
                                      "reason": None, "figures": None, "notified": 0, "updated_at": now}
                                     for d in plan_waves(devices, wave_size))
    return job_id


def cancel_job(db: Database, job_id: str) -> list[str]:
    """Stop a rollout: the job is CANCELED and no device it has not notified yet will be; returns the devices
    it did notify that have not ended, which may still install it (a notice cannot be taken back). It ends
    a job that would otherwise stay IN_PROGRESS for good (no driver running, a device never notified)."""
    final = sorted(s.value for s in TERMINAL_JOB_STATES)
    with db.transaction():  # the driver's next pass sees the job ended with its devices
        ended = db.execute("update jobs set state = ?, reason = 'canceled by the operator', updated_at = ? "
                           "where id = ? and state = ?",
                           [JobState.CANCELED.value, time.time(), job_id, JobState.IN_PROGRESS.value]).rowcount
        if not ended:  # unknown, or it ended first (checked in the statement: the driver may be ending it)
            row = next(db.query("select state from jobs where id = ?", [job_id]), None)
            raise ValueError(f"unknown job {job_id!r} (edge-fleet jobs lists them)" if row is None
                             else f"job {job_id} has already ended: {row['state']}")
        db.execute("update job_devices set state = ?, updated_at = ? where job_id = ? and notified = 0",
                   [JobState.CANCELED.value, time.time(), job_id])
    return [r["device_id"] for r in db.query(
        f"select device_id from job_devices where job_id = ? and notified = 1 and state not in "
        f"({', '.join('?' * len(final))}) order by device_id", [job_id, *final])]


def job_rows(db: Database, job_id: str) -> list[dict]:
    return list(db.query("select device_id, wave, state, step, percent, reason, figures from job_devices "
                         "where job_id = ? order by wave, device_id", [job_id]))


def list_jobs(db: Database) -> list[dict]:
    return list(db.query(
        "select j.id, j.operation, coalesce(j.model || '@' || j.version, '') || "
        "coalesce(':' || j.adapter || '@' || j.adapter_version, '') as target, j.state, j.reason, "
        "count(d.device_id) as devices, count(case when d.state = 'SUCCEEDED' then 1 end) as succeeded, "
        "count(case when d.state in ('FAILED', 'REJECTED', 'TIMED_OUT') then 1 end) as failed, "
        f"{db.dialect.day_time('j.created_at')} as created from jobs j left join job_devices d on d.job_id = j.id "
        "group by j.id order by j.created_at desc"))


def wait_for_job(target: Path | str, job_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        with open_database(target, readonly=True) as db:
            state = db["jobs"].get(job_id)["state"]
        if state in {s.value for s in TERMINAL_JOB_STATES} or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


# ---- the driver (inside edge-fleet serve) -----------------------------------------------------------------
class RolloutDriver:
    """Publishes job documents as waves open and records device reports. One per replica: every replica
    records the reports it receives (recording is idempotent), and only the leader (fleet.leader) runs passes."""

    def __init__(self, target: Path | str, publish_mqtt: Callable[[str, bytes, float], bool | str],
                 artifacts_base_url: str, interval_s: float = 0.5, job_key: Ed25519PrivateKey | None = None):
        """publish_mqtt(topic, payload, expiry_s): QoS 1 with that message expiry; True once the broker took
        it, False if not sent (tried again next pass), or the reason the broker refused it (the device fails).
        job_key: sign each device's job document (devices with [updates] job_keys require it)."""
        self.target, self.publish_mqtt, self.base_url, self.interval_s = target, publish_mqtt, artifacts_base_url, interval_s
        self.job_key = job_key
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rollouts", daemon=True)
        # Reports wait here for the driver's thread: written on the MQTT network thread, a database locked
        # for 10 s (a backup, a replica) lost the report (already acknowledged), and waiting for _lock
        # there stalled the PUBACKs a pass was waiting for. Bounded: one device flooding its topic at QoS 0
        # must not grow it without limit (a device's last report is retained and replayed at reconnect).
        # Each with its PUBACK, sent once the report is recorded, over a persistent session: acked on receipt,
        # or without the session, the reports sent while the fleet is down would be lost but for each device's
        # last, retained one, and a job finished before another one would time out and fail its rollout.
        self._reports: collections.deque[tuple[JobStatusUpdate, Callable[[], object]]] = collections.deque(
            maxlen=STATUS_INBOX_MAX)
        self._notified: dict[tuple[str, str], float] = {}  # (job, device) -> time.monotonic() of the notice
        # (job, device) -> (the signed notice last published unconfirmed, when): sent again as it was, so that
        # the link waits on that copy (for UNCONFIRMED_HOLD_S) rather than adding one signed anew each pass
        self._unconfirmed: dict[tuple[str, str], tuple[bytes, float]] = {}
        self._wake = threading.Event()
        self.leadership = Leadership(target, BUSY_TIMEOUT_S)  # only the leader's driver runs passes
        self._next_try = -math.inf  # a follower's next try for the lead

    def start(self) -> "RolloutDriver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(5)

    def on_status(self, mqtt_topic: str, payload: bytes, ack: Callable[[], object] = lambda: None) -> None:
        """A device's jobs/update message (on the MQTT thread): queued for the driver if it is valid and
        really from that device; ack() once it is recorded or dropped (unacked, the broker sends it again)."""
        try:
            u = JobStatusUpdate.model_validate_json(payload)
        except ValueError as e:
            log.warning("bad job status on %s: %s", mqtt_topic, str(e).splitlines()[0])
            ack()
            return
        if u.device_id != device_of(mqtt_topic):
            log.warning("job status for %s arrived on %s: dropped", u.device_id, mqtt_topic)
            ack()
            return
        if len(self._reports) == self._reports.maxlen:
            log.warning("job status inbox full (%d): the oldest report is dropped", STATUS_INBOX_MAX)
        self._reports.append((u, ack))
        self._wake.set()

    def apply_reports(self) -> int:
        """Record the queued reports, in arrival order; returns how many are still waiting (a database
        error leaves the rest queued for the next try)."""
        if not self._reports:
            return 0
        with self._lock, self._open() as db:
            while self._reports:
                u, ack = self._reports.popleft()
                try:
                    self._record(db, u)
                except unavailable_errors():
                    self._reports.appendleft((u, ack))  # locked or full: first in line again next time
                    raise
                except Exception:  # one report that cannot be recorded must not hold up the others
                    log.exception("job status of %s for %s could not be recorded: dropped", u.device_id, u.job_id)
                ack()
        return len(self._reports)

    @staticmethod
    def _record(db: Database, u: JobStatusUpdate) -> None:
        row = next(db.query("select state, reported_ts, notified from job_devices where job_id = ? and device_id = ?",
                            [u.job_id, u.device_id]), None)
        # not notified yet: the device cannot have the job from us, so a report is about someone else's
        # document under that id (applied, it would settle a later wave's device, never notified after)
        if row is None or not row["notified"] or not applies(JobState(row["state"]), row["reported_ts"], u):
            return
        db.execute("update job_devices set state = ?, step = ?, percent = ?, reason = ?, figures = ?, "
                   "updated_at = ?, reported_ts = ? where job_id = ? and device_id = ?",
                   [u.state.value, u.step.value if u.step else None, u.percent, u.reason,
                    json.dumps(u.figures) if u.figures else None, time.time(), u.ts, u.job_id, u.device_id])

    def _run(self) -> None:
        last_pass = -math.inf
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                self.apply_reports()  # first: a device that reported must not be timed out meanwhile
                if time.monotonic() - last_pass >= self.interval_s and self._lead():
                    last_pass = time.monotonic()
                    # each statement commits alone: a notice is marked sent as soon as it went, so a leader
                    # killed mid-pass leaves its successor the fewest notices to send again
                    with self._lock, self.leadership.database() as db:
                        self._pass(db)
            except unavailable_errors() as e:  # locked or full: the reports wait, the pass runs again
                log.warning("rollouts: the database is unavailable (%s); trying again", e)
            except Exception:  # a bad database state must not stop the driver
                log.exception("rollout pass failed")
        self.leadership.release()
        try:  # what arrived during the last pass, taken off the broker already
            if left := self.apply_reports():
                log.warning("rollouts: %d device reports not recorded at stop (the database is busy)", left)
        except Exception as e:
            log.warning("rollouts: %d device reports not recorded at stop: %s", len(self._reports), e)

    def _lead(self) -> bool:
        """Whether this replica drives rollouts now (fleet.leader). A follower asks every RETRY_S; one that
        takes over starts from what the database says, not from what it remembered of an earlier lead."""
        if not self.leadership.leading and time.monotonic() < self._next_try:
            return False
        was = self.leadership.leading
        if self.leadership.acquire():
            if not was:
                self._notified, self._unconfirmed = {}, {}
            return True
        self._next_try = time.monotonic() + RETRY_S
        return False

    def _pass(self, db: Database) -> None:
        """Time out silent devices, notify again those that came back, then advance every job in progress."""
        self._time_out_devices(db)
        self._renotify_returned(db)
        for job in list(db.query("select * from jobs where state = ?", [JobState.IN_PROGRESS.value])):
            try:
                self._advance(db, job)
            except database_errors():
                raise  # the database, not the job: the next pass retries
            except Exception as e:  # this job cannot be carried out: it ends, the others go on
                log.exception("rollout %s failed", job["id"])
                db.execute("update jobs set state = ?, reason = ?, updated_at = ? where id = ?",
                           [JobState.FAILED.value, f"cannot be carried out: {e}", time.time(), job["id"]])

    def _time_out_devices(self, db: Database) -> None:
        """A notified device that has not finished within its job's device timeout of the notice is TIMED_OUT
        (progress reports do not extend it: a device stuck at 99% must end too). Every job's devices: those
        of a halted job still installing would otherwise stay IN_PROGRESS for good. The timeout runs on the
        monotonic clock: on the wall clock, a fleet clock stepped back after running ahead would keep devices
        from ever timing out, and one stepped forward would time them out at once. A notice
        sent before this process started counts from its stored time, once, at most one timeout ago."""
        mono, wall = time.monotonic(), time.time()
        pending, expired = {}, []
        rows = list(db.query("select job_id, device_id, notified_at, coalesce(device_timeout_s, 1800.0) as timeout_s "
                             "from job_devices join jobs on jobs.id = job_devices.job_id where notified = 1 and "
                             f"job_devices.state in ({', '.join('?' * len(OPEN_JOB_STATES))})",
                             OPEN_JOB_STATES))  # read before any row changes; "in" the open states, which the
        # index on state serves, where "not in" the final ones scanned the table
        for r in rows:
            key = (r["job_id"], r["device_id"])
            since = self._notified.get(key)
            stamped = wall if r["notified_at"] is None else r["notified_at"]
            elapsed = mono - since if since is not None else min(max(wall - stamped, 0.0), r["timeout_s"])
            if elapsed >= r["timeout_s"]:
                expired.append(key)
            else:
                pending[key] = mono - elapsed
        self._notified = pending  # what ended is forgotten
        self._unconfirmed = {k: v for k, v in self._unconfirmed.items() if mono - v[1] < UNCONFIRMED_HOLD_S}
        final = sorted(s.value for s in TERMINAL_JOB_STATES)
        for i in range(0, len(expired), 1000):  # the state test in the statement itself: a final report another
            batch = expired[i:i + 1000]  # replica commits meanwhile is not overwritten
            db.execute("update job_devices set state = ?, reason = 'no final status within the device timeout', "
                       f"updated_at = ? where state not in ({', '.join('?' * len(final))}) and "
                       f"(job_id, device_id) in (values {', '.join(['(?, ?)'] * len(batch))})",
                       [JobState.TIMED_OUT.value, wall, *final, *(x for key in batch for x in key)])

    def _renotify_returned(self, db: Database) -> None:
        """Send the notice again to a device that connected anew since it went and has not answered it: a
        device away longer than its broker session lasts (7 days) loses the notice with the session, and the
        fleet would wait out the whole device timeout after its return. A device that did get it drops the
        copy (or reports again how the job ended)."""
        rows = list(db.query(
            "select jd.job_id, jd.device_id, jd.notified_at, d.connection, coalesce(j.device_timeout_s, 1800.0) "
            "as timeout_s from job_devices jd join jobs j on j.id = jd.job_id join devices d on d.id = jd.device_id "
            "where j.state = ? and jd.notified = 1 and jd.state = ? and jd.reported_ts is null and d.status = 'online' "
            "and d.connection > coalesce(jd.notified_connection, -1)",
            [JobState.IN_PROGRESS.value, JobState.QUEUED.value]))
        for r in rows:
            since = self._notified.get((r["job_id"], r["device_id"]))
            elapsed = time.monotonic() - since if since is not None else time.time() - (r["notified_at"] or 0.0)
            ttl_s = r["timeout_s"] - elapsed  # the device timeout still runs from the first notice
            if ttl_s < 1:
                continue
            sent = self._notify(self._document(db, db["jobs"].get(r["job_id"])), r["device_id"], ttl_s)
            if sent == NO_JOB_SUBSCRIBER:
                sent = True  # it dropped its session again; the next connection gets another try
            if sent is True:
                log.info("job %s: notified %s again (it connected anew since the notice)", r["job_id"], r["device_id"])
            if sent:  # sent, or refused (logged when it first was): either way not again for this connection
                db.execute("update job_devices set notified_connection = ? where job_id = ? and device_id = ?",
                           [r["connection"], r["job_id"], r["device_id"]])

    def _advance(self, db: Database, job: dict) -> None:
        rows = list(db.query("select device_id, wave, state, notified from job_devices where job_id = ? "
                             f"order by wave, {db.dialect.row_id}", [job["id"]]))
        devices = [DeviceJob(r["device_id"], r["wave"], JobState(r["state"])) for r in rows]
        notified = {r["device_id"] for r in rows if r["notified"]}
        d = decide(devices, notified, job["max_failure_rate"])
        doc = self._document(db, job) if d.notify else None
        for device_id in d.notify:
            if db.execute("select state from jobs where id = ?", [job["id"]]).fetchone()[0] != JobState.IN_PROGRESS.value:
                return  # canceled meanwhile (edge-fleet cancel): no notice more
            # expires with the device's timeout: a device offline past it would otherwise install, on its
            # return, a rollout the fleet had already counted as TIMED_OUT and perhaps halted
            ttl_s = job.get("device_timeout_s") or 1800.0
            sent = self._notify(doc, device_id, ttl_s)
            if sent == NO_JOB_SUBSCRIBER:  # an offline device's session expired (notified again when it is back),
                # or an online one does not take jobs: it fails now rather than after a whole device timeout
                online = db.execute("select 1 from devices where id = ? and status = 'online'", [device_id]).fetchone()
                sent = (f"the device is online but not subscribed to its job notices (does the broker's ACL let it "
                        f"read {topic(device_id, 'jobs', 'notify')}?)" if online else True)
            if sent is True:  # a cancel that got in between the check above and here: it did go out, so its
                # reports must count and its timeout run (left CANCELED, it would install unseen)
                db.execute("update job_devices set notified = 1, notified_at = ?, updated_at = ?, notified_connection = "
                           "(select connection from devices where id = ?), state = case state when ? then ? else state "
                           "end where job_id = ? and device_id = ?",
                           [now := time.time(), now, device_id, JobState.CANCELED.value, JobState.QUEUED.value,
                            job["id"], device_id])
                self._notified[(job["id"], device_id)] = time.monotonic()
            elif sent:  # refused (an ACL): it fails now, rather than counted as notified and timed out later
                log.error("job %s: the notice to %s was not delivered: %s", job["id"], device_id, sent)
                db.execute("update job_devices set notified = 1, state = ?, reason = ?, notified_at = ?, "
                           "updated_at = ? where job_id = ? and device_id = ?",
                           [JobState.FAILED.value, f"job notice not delivered: {sent}", now := time.time(), now,
                            job["id"], device_id])
        for device_id in d.cancel:
            db.execute("update job_devices set state = ? where job_id = ? and device_id = ?",
                       [JobState.CANCELED.value, job["id"], device_id])
        if d.job_state is not JobState.IN_PROGRESS:
            db.execute("update jobs set state = ?, reason = ?, updated_at = ? where id = ?",
                       [d.job_state.value, d.reason, time.time(), job["id"]])
            log.info("job %s %s%s", job["id"], d.job_state.value, f": {d.reason}" if d.reason else "")

    def _notify(self, doc: JobDocument, device_id: str, ttl_s: float) -> bool | str:
        """Publish the device's notice, expiring in ttl_s; publish_mqtt's answer. A notice whose publish was not
        confirmed goes again as the same bytes for as long as the link holds it: signed anew each pass (its
        issued_at), every copy would be a new message, and over a link gone silent all of them would reach
        the device."""
        key, now = (doc.job_id, device_id), time.monotonic()
        payload, signed = self._unconfirmed.pop(key, (None, now))
        if payload is None or now - signed >= UNCONFIRMED_HOLD_S:
            payload, signed = self._for(doc, device_id, ttl_s).wire_bytes(), now
        answer = self.publish_mqtt(topic(device_id, "jobs", "notify"), payload, ttl_s)
        if answer is False:
            self._unconfirmed[key] = (payload, signed)
        return answer

    def _for(self, doc: JobDocument, device_id: str, ttl_s: float) -> JobDocument:
        """The document one device gets: signed for it alone, until the message itself expires, with a job key."""
        return doc if self.job_key is None else sign_job(doc, self.job_key, device_id, time.time(), ttl_s)

    def _open(self) -> Database:
        """A short-lived connection (SQLite's WAL: the consumer writes through its own; PostgreSQL's pool)."""
        return open_database(self.target, busy_timeout_s=BUSY_TIMEOUT_S, pooled=True)

    def _document(self, db: Database, job: dict) -> JobDocument:
        if job["operation"] == "rollback":
            return JobDocument(job_id=job["id"], operation="rollback")
        if job["operation"] in ADAPTER_OPERATIONS:
            return JobDocument(job_id=job["id"], operation=job["operation"], min_tokens_per_s=job["min_tokens_per_s"],
                               **adapter_document_fields(db, job, self.base_url))
        model = db["models"].get((job["model"], job["version"]))
        # quoted: a space or an 'é' in a model name is not a URL (JobDocument refuses it; devices could not fetch it)
        path = quote(f"{job['model']}@{job['version']}", safe="@")
        return JobDocument(job_id=job["id"], manifest=Manifest.model_validate_json(model["manifest"]),
                           signature=model["signature"], key_id=model["key_id"], base_url=f"{self.base_url}/{path}",
                           min_tokens_per_s=job["min_tokens_per_s"], allow_downgrade=bool(job["allow_downgrade"]))
