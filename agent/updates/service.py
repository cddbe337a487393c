"""The updater's service: takes job documents from the MQTT link and runs them one at a time, in order, on
its own thread; keeps accepted documents on disk until they have run; at start, settles the job the last
run left unfinished (recover) and publishes again how the last one ended (replay).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path

from pydantic import ValidationError

from agent import wire
from agent.updates.errors import STORAGE_ERRNOS
from agent.updates.adapter_job import AdapterJob
from agent.updates.jobs import UpdateContext, UpdateJob
from agent.updates.model_store import JobJournal
from agent.updates.trust import JobTimeError, TrustError, verify_job
from agent.wire import JobDocument, JobState, JobStep

log = logging.getLogger(__name__)


def recover(ctx: UpdateContext) -> wire.JobStatusUpdate | None:
    """At start: settle a job the last run left unfinished, and report its real state.

    A job that had ended is reported again: its final status lived only in the MQTT client's memory until
    the broker acknowledged it, so a job that ended offline, or just before a power cut, was never heard
    of and the fleet timed it out. The fleet ignores a repeated final status.
    """
    entry = ctx.store.read_journal()
    target = Path(entry.target) if entry and entry.target else None
    ctx.store.clear_staging(keep=target)  # what the last job downloaded: a job for the same manifest resumes it
    if orphans := ctx.store.remove_orphans():
        log.warning("removed model directories no link names (left by an interrupted update): %s", orphans)
    if not entry or entry.paused:  # nothing, or a job the last stop paused: its document runs again
        return None
    if entry.state in wire.TERMINAL_JOB_STATES:
        update = _last_end(entry, ctx.device_id)
        if update is not None:
            (ctx.replay or ctx.report)(update)  # not news: not a model_change event at every boot
        return update
    current = ctx.store.link("current")
    if target and ctx.store.discard_adapter(target):  # before the engine loads: it never serves what was unchecked
        log.warning("removed the adapter an interrupted job was installing: %s", target)
        target = None  # a FAILED install, below
    if entry.step is JobStep.ACTIVATING and target and current == target.resolve():
        state, reason = JobState.SUCCEEDED, None  # the swap happened before the crash
    else:  # IN_PROGRESS, or QUEUED (accepted: the fleet waits for how it ends)
        during = f"during {entry.step.value}" if entry.step else "before it started"
        state, reason = JobState.FAILED, f"interrupted by an agent restart {during}"  # what it moved into
        # models/ without activating it went with the orphans above
    update = wire.JobStatusUpdate(job_id=entry.job_id, device_id=ctx.device_id, state=state, reason=reason,
                                  ts=time.time())
    try:
        ctx.store.write_journal(JobJournal(job_id=entry.job_id, state=state, step=None,  # the download it
                                           target=str(target) if target else None))  # names stays for the next start
    except OSError as e:  # a full disk: the agent must still start and serve; it settles again next start
        log.error("cannot write the update journal: %s", e)
    ctx.report(update)
    return update


def _last_end(entry: JobJournal, device_id: str) -> wire.JobStatusUpdate | None:
    """The journal's final status as it was reported; None if the journal (damaged, or an older agent's) says
    too little to report it."""
    for extra in ({"reason": entry.reason, "ts": entry.ts or time.time()}, {"ts": time.time()}):
        try:
            return wire.JobStatusUpdate(job_id=entry.job_id, device_id=device_id, state=entry.state, **extra)
        except ValidationError:
            continue
    log.warning("the update journal's last job cannot be reported again: %s",
                entry.model_dump_json(exclude_unset=True)[:200])
    return None


class UpdateService:
    """Takes job documents from the MQTT link and runs them one at a time, in order, on its own thread."""

    def __init__(self, ctx: UpdateContext):
        self.ctx = ctx
        self._queue: "queue.Queue[JobDocument | None]" = queue.Queue(maxsize=16)
        self._thread = threading.Thread(target=self._run, name="updates", daemon=True)
        self.done: dict[str, JobState] = {}
        self._pending: dict[str, Path | None] = {}  # queued or running -> its saved document (None: not saved)
        self._lock = threading.Lock()  # offer() runs on the MQTT thread, _run() on the updater's
        self._stopping = threading.Event()
        self._deadlines: dict[str, float] = {}  # job id -> time.monotonic() when its notice expires

    def start(self) -> None:
        recover(self.ctx)
        entry = self.ctx.store.read_journal()
        if entry and entry.state in wire.TERMINAL_JOB_STATES:
            self.done[entry.job_id] = entry.state
        for path, doc in self.ctx.store.queued():  # accepted before a restart: run now, unless recover() settled it
            if doc.job_id in self.done or doc.job_id in self._pending:
                path.unlink(missing_ok=True)
            elif not self._enqueue(doc, path):
                path.unlink(missing_ok=True)
                self.ctx.report(wire.JobStatusUpdate(job_id=doc.job_id, device_id=self.ctx.device_id,
                                                     state=JobState.REJECTED, reason="too many queued jobs",
                                                     ts=time.time()))
        self._thread.start()

    def stop(self) -> None:
        """None queued begins (a job begun during the shutdown would be cut off by the exit and reported
        FAILED), and a job downloading pauses; their saved documents stay on disk, and start() runs them after
        the restart, the download resumed. A job past its download goes on until it ends or the process exits
        (waited for 5 s)."""
        self._stopping.set()
        try:
            self._queue.put_nowait(None)  # wakes a thread waiting for a job; with jobs queued it sees _stopping
        except queue.Full:
            pass
        self._thread.join(timeout=5)

    def offer(self, payload: bytes, expiry_s: int | None = None) -> None:
        """A raw job document: validated here; a malformed one is logged and dropped (or REJECTED if it
        names a job id), a repeated one (QoS 1 redelivery) has its final state re-reported.

        With [updates] job_keys a document is verified first, and one that fails is only logged: reported,
        queued or remembered under the job id it claims, it would let whoever can publish on the topic take a
        rollout's job id (the fleet's real job then "already REJECTED") or fill the queue. Except a job the
        fleet did sign for this device that this device's clock refuses: REJECTED with the reason, once, so the
        fleet sees why rather than a device timeout (a device clock ahead by more than the job's timeout
        refuses every job).
        expiry_s: what was left of the notice's MQTT expiry as it arrived; the job keeps it (on the monotonic
        clock, in memory: a restart forgets it), and one that outlives it while it waits is refused when its
        turn comes. A signed job is held to its own expires_at as well.
        """
        try:
            doc = JobDocument.model_validate_json(payload)
        except ValueError as e:
            job_id = _job_id_of(payload)
            log.warning("malformed job document%s: %s", f" for {job_id}" if job_id else "", str(e).splitlines()[0])
            if job_id and not self.ctx.job_keys:
                self.ctx.report(wire.JobStatusUpdate(job_id=job_id, device_id=self.ctx.device_id,
                                                     state=JobState.REJECTED, reason="malformed job document",
                                                     ts=time.time()))
            return
        if self.ctx.job_keys:
            try:  # checked again when it runs: it may expire, or be overtaken, while it waits
                verify_job(doc, self.ctx.job_keys, self.ctx.device_id, time.time(), self.ctx.store.last_run())
            except JobTimeError as e:
                self._refuse_untimely(doc, e)
                return
            except TrustError as e:
                log.warning("job document for %s dropped: %s", doc.job_id, e)
                return
        with self._lock:
            running = doc.job_id in self._pending  # QoS 1 may deliver it again while it runs
            final = self.done.get(doc.job_id)
            queued = not running and final is None and self._enqueue(doc)
            if queued and expiry_s is not None:
                self._deadlines[doc.job_id] = time.monotonic() + expiry_s
            if not running and final is None and not queued:
                self.done[doc.job_id] = JobState.REJECTED  # a replay of it later must not run it
        if running:
            log.info("job %s is already queued or running: repeated document dropped", doc.job_id)
        elif final is not None:
            self.ctx.report(wire.JobStatusUpdate(job_id=doc.job_id, device_id=self.ctx.device_id, state=final,
                                                 ts=time.time()))
        elif not queued:
            self.ctx.report(wire.JobStatusUpdate(job_id=doc.job_id, device_id=self.ctx.device_id,
                                                 state=JobState.REJECTED, reason="too many queued jobs", ts=time.time()))

    def _refuse_untimely(self, doc: JobDocument, e: JobTimeError) -> None:
        """REJECTED, final like a full queue's refusal (a copy after the clock is set right must not run what
        the fleet recorded as refused); a late copy of a job running or ended here is only logged."""
        with self._lock:
            known = doc.job_id in self._pending or doc.job_id in self.done
            if not known:
                self.done[doc.job_id] = JobState.REJECTED
        log.warning("job %s refused: %s", doc.job_id, e)
        if not known:
            self.ctx.report(wire.JobStatusUpdate(job_id=doc.job_id, device_id=self.ctx.device_id,
                                                 state=JobState.REJECTED, reason=str(e), ts=time.time()))

    def _enqueue(self, doc: JobDocument, saved: Path | None = None) -> bool:
        """Queue doc (saved on disk first, unless it already is); False when the queue is full."""
        if self._queue.full():
            return False
        if saved is None:
            try:
                saved = self.ctx.store.save_queued(doc)
            except OSError as e:  # a full disk: it still runs, but a restart before then forgets it
                log.error("job %s: cannot save it to the queue: %s", doc.job_id, e)
        self._pending[doc.job_id] = saved
        self._queue.put_nowait(doc)  # only offer() (under _lock) and start() (before the thread) put
        return True

    def _run(self) -> None:
        while (doc := self._queue.get()) is not None and not self._stopping.is_set():
            try:
                kind = AdapterJob if doc.operation in wire.ADAPTER_OPERATIONS else UpdateJob
                final = kind(self.ctx, doc, self._deadlines.pop(doc.job_id, None),
                             self._stopping if self._pending.get(doc.job_id) else None).run()
                if final is JobState.QUEUED:  # paused by stop(): its document stays queued for the restart
                    break
            except Exception as e:  # a bug must not end updates for good; the old model keeps serving
                final = JobState.FAILED
                if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:  # the card, not a bug: said so
                    log.error("update job %s: %s", doc.job_id, e)
                    reason = f"the device's storage failed: {e}"
                else:
                    log.exception("update job %s crashed", doc.job_id)
                    reason = "internal error"
                self.ctx.report(wire.JobStatusUpdate(job_id=doc.job_id, device_id=self.ctx.device_id,
                                                     state=JobState.FAILED, reason=reason, ts=time.time()))
            with self._lock:
                self.done[doc.job_id] = final
                saved = self._pending.pop(doc.job_id, None)
            try:
                if saved is not None:  # after the journal holds its end: a restart now reports it, not reruns it
                    saved.unlink(missing_ok=True)
            except OSError as e:  # a read-only card: this thread must live on, or every later job waits for ever
                log.error("job %s: cannot remove its queued copy: %s", doc.job_id, e)


def _job_id_of(payload: bytes) -> str | None:
    # RecursionError: json.loads recurses once per nesting level, and a few thousand '[' (far below
    # MAX_PAYLOAD_BYTES) raised it out of offer()
    try:
        job_id = json.loads(payload).get("job_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return job_id if isinstance(job_id, str) and 0 < len(job_id) <= 64 else None
