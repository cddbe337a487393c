"""One signed model update on the device: verify, download, check, activate, and roll back.

A job moves QUEUED -> IN_PROGRESS (downloading -> verifying -> loading -> health_check -> activating)
-> SUCCEEDED, or ends FAILED / REJECTED with a reason. Nothing is downloaded before the signature, the
budget, the compatibility and the version order check out (REJECTED otherwise). Files land in a staging
directory named by the manifest's content hash, resume with HTTP Range after an interruption, and must
match their sha256 and size. The new model must reproduce the manifest's golden greedy continuation and
decode above a tokens/s floor before `current` (a symlink, swapped by rename) points at it; `previous`
keeps the old one for rollback. Every step is journalled, so after a crash the agent comes back on a
verified model and reports what really happened to the job (agent.updates.service).
"""
from __future__ import annotations

import enum
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent import durable, wire
from agent.engine.bundle import Bundle, BundleError, open_bundle, safe_member
from agent.engine.memory import MB
from agent.updates import download
from agent.updates.errors import JobFailed, JobPaused
from agent.updates.model_store import JobJournal, ModelStore
from agent.updates.trust import TrustError, verify_job, verify_manifest
from agent.wire import JobDocument, JobState, JobStep

log = logging.getLogger(__name__)

RUNTIME_OVERHEAD_BYTES = 96 * MB  # ONNX Runtime + Python beside the weights (measured ~80 MB for SmolLM2)


# ---- what the updater needs from the running agent -------------------------------------------------------
@dataclass
class UpdateContext:
    device_id: str
    store: ModelStore
    trusted_keys: dict  # key id -> public key: the manifests' signers
    memory_budget_mb: int
    current: Callable[[], Bundle]  # the bundle now serving
    report: Callable[[wire.JobStatusUpdate], None]
    # swap(bundle, check=None): make the engine serve this bundle. The old one drains, stops and gives back its
    # memory; then check(bundle), if given, runs and the new one loads. If check raises, the old one serves
    # again and the exception propagates.
    swap: Callable[..., None]
    # measure(bundle, n_tokens) -> (golden ids, decode tokens/s): the manifest's golden prompt continued greedily
    # for n_tokens on this device (agent.engine.golden.measure_golden, bound to the engine's threads)
    measure: Callable[[Bundle, int], tuple[list[int], float]]
    # generate(prompt_ids, n_tokens, adapter) -> (ids, decode tokens/s): a greedy continuation through the serving
    # engine with that adapter (None: the base) active: an adapter install's health check (agent.updates.adapter_job)
    generate: Callable[[list[int], int, str | None], tuple[list[int], float]] | None = None
    health_check_tokens: int = 16  # config [updates]: the least golden tokens that must match, whatever the job says
    allow_downgrade: bool = True  # config [updates]: False refuses an older model whatever the job says
    min_tokens_per_s: float = 0.0  # config [updates]: the least decode speed a new model must reach, whatever the job says
    artifacts_url: str | None = None  # config [updates]: downloads only from under this URL
    job_keys: dict = field(default_factory=dict)  # config [updates]: the jobs' signers; empty: jobs need no signature
    # the KV cache types the engine would run the new model with: now, and after a restart (the config file's)
    kv_dtypes: Callable[[], tuple[str, ...]] = lambda: ("fp32",)
    current_tokens_per_s: dict = field(default_factory=dict)  # version -> measured tokens/s, cached
    # publish a status again that is no news (the last job's end, at each start); default: report
    replay: Callable[[wire.JobStatusUpdate], None] | None = None


# ---- one job -----------------------------------------------------------------------------------------------
class JobPhase(enum.Enum):
    """Where one job stands on this device. What it reports is coarser and unchanged by these: the wire's
    JobState, and while IN_PROGRESS its JobStep (noted beside each phase)."""

    QUEUED = "queued"  # taken from the queue, nothing checked yet
    CHECKING = "checking"  # the job's notice and signature, the manifest's signature, budget and order (QUEUED)
    DOWNLOADING = "downloading"  # the files into staging, resumed where they stopped (downloading)
    VERIFYING = "verifying"  # the staged files against the manifest, the KV graphs this device runs (verifying)
    STAGING = "staging"  # the verified bundle moves into models/ and the serving model stops (loading)
    HEALTH_CHECKING = "health_checking"  # golden tokens and decode speed, alone in the budget (loading, health_check)
    SWAPPING = "swapping"  # the links move and the new model loads (activating)
    REVERTING = "reverting"  # the new model would not run once the links moved: both links and the old model back
    ROLLING_BACK = "rolling_back"  # a rollback job: `previous` becomes current and serves (activating)
    REMOVING = "removing"  # an adapter removal: its folder goes and the engine restarts without it (activating)
    PAUSED = "paused"  # the agent stopped during the download: unreported, the job runs again after the restart
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"  # refused before any download
    ROLLED_BACK = "rolled_back"  # failed after the links moved, the model it replaced serving again (FAILED)


_TRANSITIONS = {
    JobPhase.QUEUED: {JobPhase.CHECKING},
    JobPhase.CHECKING: {JobPhase.DOWNLOADING, JobPhase.ROLLING_BACK, JobPhase.SUCCEEDED, JobPhase.REJECTED,
                        JobPhase.FAILED},  # SUCCEEDED: the model asked for already serves
    JobPhase.DOWNLOADING: {JobPhase.VERIFYING, JobPhase.PAUSED, JobPhase.FAILED},
    JobPhase.VERIFYING: {JobPhase.STAGING, JobPhase.FAILED},
    JobPhase.STAGING: {JobPhase.HEALTH_CHECKING, JobPhase.FAILED},
    JobPhase.HEALTH_CHECKING: {JobPhase.SWAPPING, JobPhase.FAILED},
    JobPhase.SWAPPING: {JobPhase.SUCCEEDED, JobPhase.REVERTING, JobPhase.FAILED},
    JobPhase.REVERTING: {JobPhase.ROLLED_BACK},
    JobPhase.ROLLING_BACK: {JobPhase.SUCCEEDED, JobPhase.FAILED},
    JobPhase.PAUSED: set(),
    JobPhase.SUCCEEDED: set(),
    JobPhase.FAILED: set(),
    JobPhase.REJECTED: set(),
    JobPhase.ROLLED_BACK: set(),
}
_ENDS = {JobState.SUCCEEDED: JobPhase.SUCCEEDED, JobState.FAILED: JobPhase.FAILED, JobState.REJECTED: JobPhase.REJECTED}


class UpdateJob:
    TRANSITIONS = _TRANSITIONS  # the phases this kind of job moves through, and only those

    def __init__(self, ctx: UpdateContext, doc: JobDocument, deadline: float | None = None,
                 stopping: threading.Event | None = None):
        self.ctx, self.doc = ctx, doc
        self.phase = JobPhase.QUEUED
        self.deadline = deadline  # time.monotonic() after which its notice had expired, if it had an expiry
        self.stopping = stopping  # set when the agent stops; None: the job cannot be taken up again after a restart
        self.staging: Path | None = None
        self.downloaded_bytes = 0  # fetched over HTTP by this run of the job (wire.DOWNLOADED_BYTES)

    def can_enter(self, phase: JobPhase) -> bool:
        return phase in self.TRANSITIONS.get(self.phase, ())

    def _enter(self, phase: JobPhase) -> None:
        """Move to phase; a move the table does not allow is a bug in this module, raised as one."""
        if not self.can_enter(phase):
            raise AssertionError(f"job {self.doc.job_id}: no transition {self.phase.value} -> {phase.value}")
        self.phase = phase

    def status(self, state: JobState, step: JobStep | None = None, **kw) -> None:
        """Journal, then report. A journal that cannot be written (a full disk) fails a running job, since a
        crash after it could not be recovered; the report goes out either way."""
        ts = time.time()
        try:  # ts too: a report replayed after a restart keeps it (stamped anew by a clock that is behind at
            # boot, it looked older than the job's earlier reports, and the fleet ignored it)
            # the journal keeps why a job ended, not why its download is retrying (that is only news)
            ended = {"reason": kw["reason"]} if "reason" in kw and state in wire.TERMINAL_JOB_STATES else {}
            self.ctx.store.write_journal(JobJournal(job_id=self.doc.job_id, state=state, step=step, ts=ts,
                                                    target=str(self.staging) if self.staging else None, **ended))
            unjournaled = None
        except OSError as e:
            log.error("job %s: cannot write the update journal: %s", self.doc.job_id, e)
            unjournaled = e
        self.ctx.report(wire.JobStatusUpdate(job_id=self.doc.job_id, device_id=self.ctx.device_id, state=state,
                                             step=step, ts=ts, **kw))
        if unjournaled is not None and state not in wire.TERMINAL_JOB_STATES:
            raise JobFailed(JobState.FAILED, f"cannot write the update journal: {unjournaled}")

    def run(self) -> JobState:
        """Carry the job out from QUEUED to its end; returns the state reported last (QUEUED: paused)."""
        try:
            self._enter(JobPhase.CHECKING)
            self._check_job()
            return self._carry_out()
        except JobPaused:
            self._enter(JobPhase.PAUSED)
            self._pause()
            return JobState.QUEUED
        except JobFailed as e:
            self._enter(JobPhase.ROLLED_BACK if self.phase is JobPhase.REVERTING else _ENDS[e.state])
            if not (e.keep_download and self._has_download()):
                self._clean_staging()
            log.warning("job %s %s: %s", self.doc.job_id, e.state.value, e.reason)
            self.status(e.state, reason=e.reason)
            return e.state

    def _carry_out(self) -> JobState:
        """The operation, once the job itself checked out; JobFailed / JobPaused end it early."""
        if self.doc.operation == "rollback":
            return self._rollback()
        self.status(JobState.QUEUED)
        self._check()
        self._download()
        return self._succeed(self._activate(self._verify()))

    def _succeed(self, figures: dict) -> JobState:
        self._enter(JobPhase.SUCCEEDED)
        self.status(JobState.SUCCEEDED, figures={**figures, wire.DOWNLOADED_BYTES: self.downloaded_bytes})
        return JobState.SUCCEEDED

    # -- before any download: REJECTED --
    def _check_job(self) -> None:
        """With [updates] job_keys, the job itself must be signed, for this device, unexpired and newer than
        the last one run; then the fields outside the manifest's signature are the fleet's too. Signed or not, it
        must not have outlived its notice: by then the fleet has counted it TIMED_OUT (and may have halted its
        rollout), and it may have expired while it waited behind another job."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise JobFailed(JobState.REJECTED, f"its notice expired {time.monotonic() - self.deadline:.0f} s before it "
                                               f"could run (it waited behind another job): the fleet has timed it out")
        if not self.ctx.job_keys:
            return
        store = self.ctx.store
        try:
            verify_job(self.doc, self.ctx.job_keys, self.ctx.device_id, time.time(), store.last_run())
        except TrustError as e:
            raise JobFailed(JobState.REJECTED, str(e)) from e
        try:  # before it runs: a replay after a crash mid-job is refused too (the same job, still queued
            # because the agent stopped before it journalled anything, may run: verify_job lets it)
            store.set_last_run(self.doc.issued_at, self.doc.job_id)
        except OSError as e:
            raise JobFailed(JobState.FAILED, f"cannot record the job's issue time: {e}") from e

    def _check(self) -> None:
        m = self.doc.manifest
        self._check_signed(wire.MANIFEST_SCHEMA_VERSION)
        install = _install_name(m)
        if not _is_entry_name(install):  # a signed name 'a/b' crashed the final move into models/ ('../x' escaped it)
            raise JobFailed(JobState.REJECTED, f"unsafe model name or version in manifest: {install!r}")
        weights = sum(f.size_bytes for rel, f in m.files.items() if rel.startswith(wire.GRAPH))
        if weights + RUNTIME_OVERHEAD_BYTES > self.ctx.memory_budget_mb * MB:
            raise JobFailed(JobState.REJECTED, f"model needs about {(weights + RUNTIME_OVERHEAD_BYTES) // MB} MB, "
                                               f"more than memory_budget_mb={self.ctx.memory_budget_mb}")
        current = self.ctx.current().manifest
        if (m.name, m.version) == (current.name, current.version):  # what the fleet wants is already so (Mender
            # skips an installed artifact too): a failure here halted a re-run rollout at its first wave
            raise JobFailed(JobState.SUCCEEDED, f"{m.name}@{m.version} is already the current model: nothing to do")
        if m.created_at < current.created_at and not (self.doc.allow_downgrade and self.ctx.allow_downgrade):
            why = "without allow_downgrade" if self.ctx.allow_downgrade else "by this device ([updates] allow_downgrade)"
            raise JobFailed(JobState.REJECTED, f"downgrade from {current.version} ({current.created_at}) refused {why}")
        self._check_base_url()

    def _check_signed(self, schema_version: int) -> None:
        """The manifest the job carries is signed by a trusted key, in a schema this agent reads, and names only
        files inside the staging directory; REJECTED otherwise."""
        m = self.doc.signed_manifest
        try:
            verify_manifest(m, self.doc.signature, self.doc.key_id, self.ctx.trusted_keys)
        except TrustError as e:
            raise JobFailed(JobState.REJECTED, str(e)) from e
        if m.schema_version != schema_version:
            raise JobFailed(JobState.REJECTED, f"incompatible manifest schema {m.schema_version}")
        staging = self.ctx.store.staging_root / self._digest()
        for rel in m.files:
            try:
                safe_member(staging, rel)
            except BundleError as e:
                raise JobFailed(JobState.REJECTED, f"unsafe file name in manifest: {rel!r}") from e

    def _check_base_url(self) -> None:
        prefix = self.ctx.artifacts_url
        if prefix and not (self.doc.base_url or "").startswith(prefix.rstrip("/") + "/"):
            raise JobFailed(JobState.REJECTED, f"base_url {self.doc.base_url!r} is not under this device's "
                                               f"[updates] artifacts_url {prefix!r}")

    def _digest(self) -> str:
        return hashlib.sha256(self.doc.signed_manifest.canonical_bytes()).hexdigest()[:32]

    # -- download with resume --
    def _download(self) -> None:
        self._enter(JobPhase.DOWNLOADING)
        m = self.doc.signed_manifest
        if not self.doc.base_url:
            raise JobFailed(JobState.FAILED, "job has no base_url to download from")
        self.staging = self.ctx.store.staging_root / self._digest()
        total = sum(f.size_bytes for f in m.files.values()) or 1
        done = 0  # bytes of the files before the one downloading

        def report(n_bytes: int, retrying: str | None) -> None:  # n_bytes of this file; retrying: why it retries
            self.status(JobState.IN_PROGRESS, JobStep.DOWNLOADING, percent=round(100 * (done + n_bytes) / total, 1),
                        **({"reason": retrying} if retrying else {}))

        try:
            self.ctx.store.clear_staging(keep=self.staging)  # another manifest's partial download: not resumed
            self.staging.mkdir(parents=True, exist_ok=True)
            # journalled before the first byte (the first progress report comes after a MiB or a whole file): a
            # restart during the download is reported as one, not "before it started"
            self.status(JobState.IN_PROGRESS, JobStep.DOWNLOADING, percent=0.0)
            for rel, entry in sorted(m.files.items()):
                had = _size(self.staging / rel)  # what an earlier run fetched: resumed, not fetched again
                download.fetch_file(self.doc.base_url, self.staging, rel, entry, report, self.stopping)
                self.downloaded_bytes += entry.size_bytes - min(had, entry.size_bytes)
                done += entry.size_bytes
            manifest_file = wire.ADAPTER_MANIFEST if isinstance(m, wire.AdapterManifest) else wire.MANIFEST
            (self.staging / manifest_file).write_text(m.model_dump_json(indent=2))
        except OSError as e:  # the local side (fetch_file retries the network): a signed 300-character file name
            # raised ENAMETOOLONG out of the job; 'a' listed beside 'a/b', or a full disk, end here as well
            raise JobFailed(JobState.FAILED, f"cannot write the download to {self.staging}: {e}") from e

    # -- verify, load, check --
    def _verify(self) -> Bundle:
        self._enter(JobPhase.VERIFYING)
        self.status(JobState.IN_PROGRESS, JobStep.VERIFYING)
        try:
            return open_bundle(self.staging)
        except BundleError as e:
            raise JobFailed(JobState.FAILED, f"verification failed: {e}") from e

    def _check_kv_graph(self, bundle: Bundle) -> None:
        """The bundle must hold the graph of every KV cache type this device runs: the health check runs the
        fp32-KV graph, so a bundle without the int8 one would pass it and then fail to load. Checked before the
        serving model stops, for the type the config file asks for too: a kv_dtype edit waiting for a restart
        (SIGHUP cannot apply it) would make a model that installed fine fail at every later start."""
        for kv_dtype in set(self.ctx.kv_dtypes()) - {"fp32"}:  # every bundle has the fp32-KV graph
            try:
                bundle.graph(kv_dtype)
            except BundleError as e:
                raise JobFailed(JobState.FAILED, f"the device runs kv_dtype = \"{kv_dtype}\" (now, or after a "
                                                 f"restart by its config file): {e}") from e

    def _health_check(self, bundle: Bundle) -> dict:
        self._enter(JobPhase.HEALTH_CHECKING)
        self.status(JobState.IN_PROGRESS, JobStep.LOADING)
        measure = self.ctx.measure
        golden = bundle.manifest.golden.continuation_ids
        # the job may ask for more than the device's own floor ([updates] health_check_tokens), never for less
        n = min(max(self.doc.golden_tokens, self.ctx.health_check_tokens), len(golden))
        self.status(JobState.IN_PROGRESS, JobStep.HEALTH_CHECK)
        try:
            ids, tps = measure(bundle, max(n, 16))
        except Exception as e:  # ONNX Runtime cannot load or run it (a signed manifest without model.onnx, a
            # golden prompt past the vocabulary): an unhealthy model, FAILED with the reason, not an internal error
            first_line = (str(e).splitlines() or [""])[0][:300]
            raise JobFailed(JobState.FAILED, f"health check could not run the model: {type(e).__name__}: "
                                             f"{first_line}") from e
        if ids[:n] != golden[:n]:
            first = next(i for i in range(n) if ids[i] != golden[i])
            raise JobFailed(JobState.FAILED, f"golden output mismatch at token {first} of {n}")
        floor = self.doc.min_tokens_per_s
        if floor is None:
            floor = 0.7 * self._current_tps(measure)
        floor = max(floor, self.ctx.min_tokens_per_s)  # the job's floor is not signed: the device's own holds
        if tps < floor:
            raise JobFailed(JobState.FAILED, f"decode {tps:.1f} tokens/s is below the floor {floor:.1f}")
        return {"decode_tokens_per_s": round(tps, 2), "tokens_per_s_floor": round(floor, 2), "golden_tokens": n}

    def _current_tps(self, measure) -> float:
        cur = self.ctx.current()
        if cur.manifest.version not in self.ctx.current_tokens_per_s:
            self.ctx.current_tokens_per_s[cur.manifest.version] = measure(cur, 16)[1]
        return self.ctx.current_tokens_per_s[cur.manifest.version]

    # -- activate --
    def _activate(self, bundle: Bundle) -> dict:
        """Move the bundle into models/ and switch to it: the serving model stops and gives back its memory, the
        new one is health-checked alone in the budget, the links move and it loads. Returns the check's figures.
        Never checked beside the serving model: both sessions take the process ~210 MB past memory_budget_mb
        (526 MB at 420, SmolLM2 INT4 -> INT8)."""
        m = bundle.manifest
        store = self.ctx.store
        self._check_kv_graph(bundle)
        self._enter(JobPhase.STAGING)
        final = store.models / _install_name(m)
        # journalled before anything moves: after a crash from here on, recover() removes `final` unless it
        # became current (journalled after the rename, a crash in between left the bundle there for good)
        store.write_journal(JobJournal(job_id=self.doc.job_id, state=JobState.IN_PROGRESS, step=JobStep.LOADING,
                                       target=str(final)))
        if final.is_symlink():  # seeded by `serve --model DIR`: the link goes, DIR stays
            final.unlink()
        # on disk before a link names it, let alone the fleet; a copy already there (the `previous` model
        # installed again) stays until the new one is synced, as every replaced tree does (durable)
        durable.replace_tree(self.staging, final, final.with_name(f".{final.name}.old-{os.getpid()}"))
        self.staging = final
        figures: dict = {}
        links: list[tuple[Path | None, Path | None]] = []  # (current, previous) as they were, once moved

        def check_then_link(new: Bundle) -> None:
            figures.update(self._health_check(new))
            self._enter(JobPhase.SWAPPING)
            self.status(JobState.IN_PROGRESS, JobStep.ACTIVATING)  # a crash from here is settled by the links
            before = store.link("current"), store.link("previous")
            try:
                links.append(store.activate(final, keep_displaced=True))
            except BaseException:  # a link moved and the other not (a full disk): both as they were
                store.restore(*before)
                raise

        try:
            self.ctx.swap(open_bundle(final, verify_files=False), check_then_link)
        except JobFailed:  # the health check failed: the links never moved, and the old model serves again
            store.remove_unlinked(final)
            raise
        except Exception as e:  # the new model would not run here after all: back to the one that did
            log.exception("activating %s failed", final.name)
            if not links:
                store.remove_unlinked(final)
                raise JobFailed(JobState.FAILED, f"activation failed: {e}") from e
            # Both links as they were, and the bundle that failed gone: `previous` stays the device's last good
            # fallback, and the failed bundle never becomes the next rollback's target.
            self._enter(JobPhase.REVERTING)
            serving, kept = links[0]
            store.restore(serving, kept)
            # serving was verified when it loaded: hashing every file again held the switch (and the watchdog)
            # up to tens of seconds on an SD card; the failed bundle goes once the old model serves again
            self.ctx.swap(open_bundle(serving, verify_files=False))
            store.remove_unlinked(final)
            raise JobFailed(JobState.FAILED, f"activation failed, rolled back to {serving.name}: {e}") from e
        store.remove_unlinked(links[0][1])
        store.forget_rollback()  # a new model serves: it may be rolled back from
        self.ctx.current_tokens_per_s[m.version] = figures["decode_tokens_per_s"]  # the next update's floor
        return figures

    def _rollback(self) -> JobState:
        store = self.ctx.store
        serving, kept = store.link("current"), store.link("previous")
        self._enter(JobPhase.ROLLING_BACK)
        self.staging = kept  # journalled as the target: after a crash, recover() sees whether current became it
        self.status(JobState.IN_PROGRESS, JobStep.ACTIVATING)
        target = store.rollback()
        if target is None:  # repeated: what was asked holds already
            self._enter(JobPhase.SUCCEEDED)
            self.status(JobState.SUCCEEDED, figures={"rolled_back_to": serving.name if serving else None,
                                                     "already": True})
            return JobState.SUCCEEDED
        try:
            bundle = open_bundle(target)  # verified in full: it may be the model whose activation failed
            self._check_kv_graph(bundle)  # as for an install: or the next start fails to load it
            self.ctx.swap(bundle)
        except Exception as e:  # the links must name what the engine serves, or the next start boots `target`
            store.restore(serving, kept)
            if isinstance(e, JobFailed):
                raise JobFailed(JobState.FAILED, f"rollback to {target.name} refused: {e.reason}") from e
            first_line = (str(e).splitlines() or [""])[0][:300]
            raise JobFailed(JobState.FAILED, f"rollback to {target.name} failed, still serving "
                                             f"{serving.name if serving else 'the current model'}: {first_line}") from e
        self._enter(JobPhase.SUCCEEDED)
        self.status(JobState.SUCCEEDED, figures={"rolled_back_to": _install_name(bundle.manifest)})  # MODEL@VERSION
        return JobState.SUCCEEDED

    def _pause(self) -> None:
        """A stop during a download (which may retry for minutes) pauses the job rather than failing it: the
        journal says it is paused, recover() keeps its download and does not settle it, and the document still
        queued on disk runs again after the restart, resuming the download."""
        log.info("job %s paused by the agent stopping: it resumes after the restart", self.doc.job_id)
        try:
            self.ctx.store.write_journal(JobJournal(job_id=self.doc.job_id, state=JobState.QUEUED,
                                                    step=JobStep.DOWNLOADING, target=str(self.staging), paused=True))
        except OSError as e:  # the restart then reports it FAILED, as before
            log.error("job %s: cannot write the update journal: %s", self.doc.job_id, e)

    def _has_download(self) -> bool:
        return bool(self.staging) and any(p.is_file() and p.stat().st_size for p in self.staging.rglob("*"))

    def _clean_staging(self) -> None:
        if self.staging and self.staging.parent == self.ctx.store.staging_root:
            shutil.rmtree(self.staging, ignore_errors=True)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _install_name(m: wire.Manifest) -> str:
    return f"{m.name}@{m.version}"  # the bundle's directory under models/


def _is_entry_name(name: str) -> bool:
    """True if name can be a single directory entry: no '/', no NUL, encodable, at most NAME_MAX (255) bytes."""
    try:
        return "/" not in name and "\x00" not in name and len(os.fsencode(name)) <= 255
    except UnicodeEncodeError:
        return False
