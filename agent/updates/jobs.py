"""Signed model updates on the device: verify, download, check, activate, and roll back.

A job moves QUEUED -> IN_PROGRESS (downloading -> verifying -> loading -> health_check -> activating)
-> SUCCEEDED, or ends FAILED / REJECTED with a reason. Nothing is downloaded before the signature, the
budget, the compatibility and the version order check out (REJECTED otherwise). Files land in a staging
directory named by the manifest's content hash, resume with HTTP Range after an interruption, and must
match their sha256 and size. The new model must reproduce the manifest's golden greedy continuation and
decode above a tokens/s floor before `current` (a symlink, swapped by rename) points at it; `previous`
keeps the old one for rollback. Every step is journalled, so after a crash the agent comes back on a
verified model and reports what really happened to the job.

Layout under the state directory:
    models/NAME@VERSION/   verified bundles        current -> models/...   previous -> models/...
    models/.staging/DIGEST/ downloads in progress  updates/job.json        the journal
    updates/queue/N-JOB.json accepted jobs not yet run                     agent.lock (agent.service.serve)
Every rename here is followed by an fsync of its directory (agent.durable): an update reported SUCCEEDED
survives a power cut.
"""
from __future__ import annotations

import errno
import hashlib
import http.client
import json
import logging
import os
import queue
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from agent import durable, wire
from agent.engine.bundle import Bundle, BundleError, open_bundle, safe_member
from agent.engine.memory import MB
from agent.updates.trust import JobTimeError, TrustError, verify_job, verify_manifest
from agent.wire import JobDocument, JobState, JobStep

log = logging.getLogger(__name__)

RUNTIME_OVERHEAD_BYTES = 96 * MB  # ONNX Runtime + Python beside the weights (measured ~80 MB for SmolLM2)
# A download that adds less than CHUNK_BYTES for this long fails (found in review: 5 attempts, ~11 s of
# outage, failed a job that Mender's client would have carried through). What it got is kept for the next try.
DOWNLOAD_STALL_S = 300.0
DOWNLOAD_BACKOFF_MAX_S = 30.0
CHUNK_BYTES = 1 << 20
# An attempt slower than MIN_DOWNLOAD_BYTES_PER_S over any LOW_SPEED_WINDOW_S is cut off and resumed (curl's
# --speed-limit / --speed-time); a download whose attempts stay that slow for DOWNLOAD_STALL_S fails. Found in
# review: the limit was an average over the whole file, so a link crawling at 200 B/s held a 51 MB download
# (and every job behind it) for ~52 minutes and a 100 MB one, which got 1 MiB an attempt, for ~19 hours.
MIN_DOWNLOAD_BYTES_PER_S = 16 << 10
LOW_SPEED_WINDOW_S = 60.0
PROGRESS_EVERY_S = 30.0  # a status at least this often while bytes arrive, besides one a MiB


class JobFailed(Exception):
    def __init__(self, state: JobState, reason: str, keep_download: bool = False):
        super().__init__(reason)
        self.state, self.reason = state, reason
        self.keep_download = keep_download  # the network failed: a later job for this manifest resumes it


# ---- the model store: symlinks and directories ------------------------------------------------------------
class ModelStore:
    def __init__(self, state_dir: Path):
        self.root = Path(state_dir)
        self.models = self.root / "models"
        self.staging_root = self.models / ".staging"
        self.journal = self.root / "updates" / "job.json"
        self.queue = self.root / "updates" / "queue"  # accepted job documents not yet run, one file each
        self._last_issued = self.root / "updates" / "last_signed_job.json"  # the last signed job begun (replays)
        # the bundle the last rollback left: `previous` naming it means that rollback is done. An install that
        # serves forgets it (found in review: the same name@version deployed again was taken for the one
        # rolled back from); a failed rollback leaves current naming it, which no rollback targets.
        self._rolled_back_from = self.root / "updates" / "rolled_back_from"
        for d in (self.models, self.staging_root, self.journal.parent, self.queue):
            d.mkdir(parents=True, exist_ok=True)
        self.fallback: dict | None = None  # what bootable() did when `current` did not verify: the event's detail

    def link(self, name: str) -> Path | None:
        p = self.root / name
        return p.resolve() if p.is_symlink() else None

    def _set_link(self, name: str, target: Path) -> None:
        tmp = self.root / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(os.path.relpath(target, self.root))
        tmp.rename(self.root / name)  # rename(2) replaces the old link atomically
        durable.fsync_path(self.root)  # ... and this makes it survive a power cut

    def activate(self, bundle_dir: Path, keep_displaced: bool = False) -> tuple[Path | None, Path | None]:
        """Make bundle_dir current and the current one previous; returns (current, previous) as they were.
        The bundle `previous` named is deleted unless keep_displaced: an update keeps it until the engine
        runs the new one, since a failed activation puts both links back (`restore`)."""
        current, displaced = self.link("current"), self.link("previous")
        if current and current != bundle_dir.resolve():
            self._set_link("previous", current)
        self._set_link("current", bundle_dir)
        if not keep_displaced:
            self.remove_unlinked(displaced)
        return current, displaced

    def remove_unlinked(self, bundle_dir: Path | None) -> None:
        """Delete an installed bundle that neither link names any more: every update left one behind, and
        months of them filled the disk. A directory outside models/ (`serve --model DIR`) is the user's."""
        if (bundle_dir is None or bundle_dir.parent != self.models.resolve()
                or bundle_dir in (self.link("current"), self.link("previous"))):
            return
        shutil.rmtree(bundle_dir, ignore_errors=True)

    def clear_staging(self, keep: Path | None = None) -> None:
        """Delete what .staging holds but keep, a partial download of one manifest (found in review: every
        failure and restart deleted it, and the next job for the same model fetched it all again, as Ollama's
        and Mender's downloads do not). At most one is kept, so the disk holds at most one bundle's worth."""
        self.staging_root.mkdir(parents=True, exist_ok=True)
        for p in self.staging_root.iterdir():
            if keep is not None and p.resolve() == keep.resolve():
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def remove_orphans(self) -> list[str]:
        """At start, delete what models/ holds that neither link names: a power cut between a rollback's two
        link swaps (both then name one bundle) or during a deletion left a bundle there for good."""
        kept = {self.link("current"), self.link("previous")} - {None}
        if not kept:
            return []
        orphans = [p for p in self.models.iterdir() if p != self.staging_root and p.resolve() not in kept]
        for p in orphans:
            if p.is_symlink():  # seeded by `serve --model DIR`: the link goes, DIR is the user's
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)
        return sorted(p.name for p in orphans)

    def rollback(self) -> Path | None:
        """Make `previous` current (and current previous); None if that was the last thing done: a rollback
        already done. Found in review: the links swapped on every rollback, so a retried command, a copy
        redelivered by the broker or a replay undid the rollback it repeated. Going back to the model
        rolled back from takes a deployment of it, as with Mender's artifacts."""
        previous = self.link("previous")
        if previous is None or not previous.exists() or previous == self.link("current"):
            raise JobFailed(JobState.FAILED, "no previous model to roll back to")
        current = self.link("current")
        if self._rolled_back_from.exists() and self._rolled_back_from.read_text().strip() == previous.name:
            return None
        if current:  # first: a crash before the swap leaves it naming current, which no rollback targets
            durable.write_text(self._rolled_back_from, current.name)
        self._set_link("current", previous)
        if current:
            self._set_link("previous", current)
        return previous

    def forget_rollback(self) -> None:
        self._rolled_back_from.unlink(missing_ok=True)

    def restore(self, current: Path | None, previous: Path | None) -> None:
        """Put both links back as they were (a rollback the engine could not carry out)."""
        for name, target in (("previous", previous), ("current", current)):
            if target is not None:
                self._set_link(name, target)
            else:
                (self.root / name).unlink(missing_ok=True)

    def bootable(self) -> Bundle:
        """The model to serve: `current` if it verifies, else `previous` (which becomes current, and the only
        one: found in review, both links then named it, so a rollback 'succeeded' to the model serving, and
        the fallback was said nowhere)."""
        errors = []
        for name in ("current", "previous"):
            target = self.link(name)
            if target is None:
                continue
            try:
                bundle = open_bundle(target)
            except BundleError as e:
                errors.append(f"{name}: {e}")
                continue
            if name == "previous":
                reason = "; ".join(errors) or "current is missing"
                log.error("serving the previous model, %s: the current one does not verify (%s)", target.name, reason)
                damaged = self.link("current")
                self._set_link("current", target)
                (self.root / "previous").unlink(missing_ok=True)
                self.remove_unlinked(damaged)  # with or without an updater (whose recover() would as well)
                self.fallback = {"to": target.name, "reason": reason}
            return bundle
        raise BundleError("no verified model to serve" + (f" ({'; '.join(errors)})" if errors else ""))

    def write_journal(self, entry: dict) -> None:
        durable.write_text(self.journal, json.dumps(entry))

    def save_queued(self, doc: JobDocument) -> Path:
        """Keep an accepted job document on disk until it has run: the broker's PUBACK goes when the MQTT
        callback returns, so a job only queued in memory was lost by a restart, and the fleet timed it out."""
        # numbered, not timed, so the names sort in arrival order even if the clock steps back meanwhile
        n = 1 + max((int(p.name.partition("-")[0]) for p in self.queue.glob("*.json")
                     if p.name.partition("-")[0].isdigit()), default=0)
        path = self.queue / f"{n:020d}-{doc.job_id}.json"
        durable.write_text(path, doc.model_dump_json())
        return path

    def queued(self) -> list[tuple[Path, JobDocument]]:
        """The saved documents, oldest first; one that no longer parses is removed (logged)."""
        out = []
        for path in sorted(self.queue.glob("*.json")):
            try:
                out.append((path, JobDocument.model_validate_json(path.read_bytes())))
            except (OSError, ValueError) as e:
                log.warning("dropping the queued job file %s: %s", path.name, str(e).splitlines()[0])
                path.unlink(missing_ok=True)
        return out

    def last_run(self) -> tuple[float, str] | None:
        """(issued_at, job_id) of the last signed job this device began, or None."""
        try:
            entry = json.loads(self._last_issued.read_text())
            return float(entry["issued_at"]), str(entry["job_id"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def set_last_run(self, issued_at: float, job_id: str) -> None:
        durable.write_text(self._last_issued, json.dumps({"issued_at": issued_at, "job_id": job_id}))

    def read_journal(self) -> dict | None:
        """The journal's entry; None if there is none or it is damaged (found in review: a journal holding
        JSON that is not an object, or a target that is not a string, stopped recover() and so every start)."""
        try:
            entry = json.loads(self.journal.read_text())
        except (OSError, ValueError):
            return None
        if not (isinstance(entry, dict) and isinstance(entry.get("job_id"), str)
                and isinstance(entry.get("state"), str) and entry["state"] in {s.value for s in JobState}
                and all(isinstance(entry.get(k), (str, type(None))) for k in ("step", "target", "reason"))):
            return None
        return entry


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
    threads: int | None = None
    health_check_tokens: int = 16  # config [updates]: the least golden tokens that must match, whatever the job says
    allow_downgrade: bool = True  # config [updates]: False refuses an older model whatever the job says
    min_tokens_per_s: float = 0.0  # config [updates]: the least decode speed a new model must reach, whatever the job says
    artifacts_url: str | None = None  # config [updates]: downloads only from under this URL
    job_keys: dict = field(default_factory=dict)  # config [updates]: the jobs' signers; empty: jobs need no signature
    measure: Callable[[Bundle, int], tuple[list[int], float]] | None = None  # (golden ids, decode tokens/s)
    # the KV cache types the engine would run the new model with: now, and after a restart (the config file's)
    kv_dtypes: Callable[[], tuple[str, ...]] = lambda: ("fp32",)
    current_tokens_per_s: dict = field(default_factory=dict)  # version -> measured tokens/s, cached
    # publish a status again that is no news (the last job's end, at each start); default: report
    replay: Callable[[wire.JobStatusUpdate], None] | None = None


def default_measure(bundle: Bundle, threads: int | None, n_tokens: int) -> tuple[list[int], float]:
    """Greedy continuation of the manifest's golden prompt, and its decode tokens/s, on this device."""
    runner = bundle.runner(threads)
    prompt = bundle.manifest.golden.prompt_ids
    cache = runner.new_cache(1, len(prompt) + n_tokens + 1)
    p = len(prompt)
    logits = runner.forward(np.array([prompt]), np.array([p - 1]), np.array([p]), np.array([[p - 1]]), cache)
    out = [int(logits[0, 0].argmax())]
    t0 = time.perf_counter()
    for t in range(p, p + n_tokens - 1):
        logits = runner.forward(np.array([[out[-1]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64), cache)
        out.append(int(logits[0, 0].argmax()))
    return out, (n_tokens - 1) / max(time.perf_counter() - t0, 1e-9)


# ---- one job ---------------------------------------------------------------------------------------------
class JobPaused(Exception):
    """The agent is stopping during the job's download: it ends unreported and runs again after the restart."""


class UpdateJob:
    def __init__(self, ctx: UpdateContext, doc: JobDocument, deadline: float | None = None,
                 stopping: threading.Event | None = None):
        self.ctx, self.doc = ctx, doc
        self.deadline = deadline  # time.monotonic() after which its notice had expired, if it had an expiry
        self.stopping = stopping  # set when the agent stops; None: the job cannot be taken up again after a restart
        self.staging: Path | None = None

    def status(self, state: JobState, step: JobStep | None = None, **kw) -> None:
        """Journal, then report. A journal that cannot be written (a full disk) fails a running job, since a
        crash after it could not be recovered; the report goes out either way."""
        ts = time.time()
        try:  # ts too: a report replayed after a restart keeps it (stamped anew by a clock that is behind at
            # boot, it looked older than the job's earlier reports, and the fleet ignored it)
            self.ctx.store.write_journal({"job_id": self.doc.job_id, "state": state.value,
                                          "step": step.value if step else None, "ts": ts,
                                          "target": str(self.staging) if self.staging else None, **{
                                              k: v for k, v in kw.items() if k == "reason"}})
            unjournaled = None
        except OSError as e:
            log.error("job %s: cannot write the update journal: %s", self.doc.job_id, e)
            unjournaled = e
        self.ctx.report(wire.JobStatusUpdate(job_id=self.doc.job_id, device_id=self.ctx.device_id, state=state,
                                             step=step, ts=ts, **kw))
        if unjournaled is not None and state not in wire.TERMINAL_JOB_STATES:
            raise JobFailed(JobState.FAILED, f"cannot write the update journal: {unjournaled}")

    def run(self) -> JobState:
        try:
            self._check_job()
            if self.doc.operation == "rollback":
                return self._rollback()
            self.status(JobState.QUEUED)
            self._check()
            self._download()
            figures = self._activate(self._verify())
            self.status(JobState.SUCCEEDED, figures=figures)
            return JobState.SUCCEEDED
        except JobPaused:
            self._pause()
            return JobState.QUEUED
        except JobFailed as e:
            if not (e.keep_download and self._has_download()):
                self._clean_staging()
            log.warning("job %s %s: %s", self.doc.job_id, e.state.value, e.reason)
            self.status(e.state, reason=e.reason)
            return e.state

    # -- before any download: REJECTED --
    def _check_job(self) -> None:
        """With [updates] job_keys, the job itself must be signed, for this device, unexpired and newer than
        the last one run; then the fields outside the manifest's signature are the fleet's too. Signed or not, it
        must not have outlived its notice (found in review: an unsigned one that expired while it waited behind
        another job ran after the fleet had counted it TIMED_OUT and halted its rollout)."""
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
        try:
            verify_manifest(m, self.doc.signature, self.doc.key_id, self.ctx.trusted_keys)
        except TrustError as e:
            raise JobFailed(JobState.REJECTED, str(e)) from e
        if m.schema_version != wire.MANIFEST_SCHEMA_VERSION:
            raise JobFailed(JobState.REJECTED, f"incompatible manifest schema {m.schema_version}")
        staging = self.ctx.store.staging_root / self._digest()
        for rel in m.files:
            try:
                safe_member(staging, rel)
            except BundleError as e:
                raise JobFailed(JobState.REJECTED, f"unsafe file name in manifest: {rel!r}") from e
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
        prefix = self.ctx.artifacts_url
        if prefix and not (self.doc.base_url or "").startswith(prefix.rstrip("/") + "/"):
            raise JobFailed(JobState.REJECTED, f"base_url {self.doc.base_url!r} is not under this device's "
                                               f"[updates] artifacts_url {prefix!r}")

    def _digest(self) -> str:
        return hashlib.sha256(self.doc.manifest.canonical_bytes()).hexdigest()[:32]

    # -- download with resume --
    def _download(self) -> None:
        m = self.doc.manifest
        if not self.doc.base_url:
            raise JobFailed(JobState.FAILED, "job has no base_url to download from")
        self.staging = self.ctx.store.staging_root / self._digest()
        total = sum(f.size_bytes for f in m.files.values()) or 1
        done = 0
        try:
            self.ctx.store.clear_staging(keep=self.staging)  # another manifest's partial download: not resumed
            self.staging.mkdir(parents=True, exist_ok=True)
            # before the first byte: the first progress report came after a MiB or a whole file, so a restart
            # during it was reported as "before it started" (found in review)
            self.status(JobState.IN_PROGRESS, JobStep.DOWNLOADING, percent=0.0)
            for rel, entry in sorted(m.files.items()):
                self._fetch(rel, entry, lambda n: self.status(JobState.IN_PROGRESS, JobStep.DOWNLOADING,
                                                              percent=round(100 * (done + n) / total, 1)))
                done += entry.size_bytes
            (self.staging / wire.MANIFEST).write_text(m.model_dump_json(indent=2))
        except OSError as e:  # the local side (_fetch retries the network): a signed 300-character file name
            # raised ENAMETOOLONG out of the job; 'a' listed beside 'a/b', or a full disk, end here as well
            raise JobFailed(JobState.FAILED, f"cannot write the download to {self.staging}: {e}") from e

    def _fetch(self, rel: str, entry: wire.FileEntry, progress: Callable[[int], None]) -> None:
        path = safe_member(self.staging, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        # Quoted: a signed file name with a control character raised http.client.InvalidURL out of the job, and
        # a '#', '?' or '%' in a name would change what the URL points at.
        url = f"{self.doc.base_url.rstrip('/')}/{urllib.parse.quote(rel)}"
        stalled = 0  # attempts in a row that got (nearly) nowhere: one that progresses resets the count
        progressed = time.monotonic()
        while time.monotonic() - progressed < DOWNLOAD_STALL_S:
            self._stopped()
            have = path.stat().st_size if path.exists() else 0
            if path.exists() and have == entry.size_bytes:  # exists: a 0-byte file must still be created
                return
            if have > entry.size_bytes:
                path.unlink()
                have = 0
            started = time.monotonic()
            try:
                self._get(url, path, have, entry.size_bytes, progress, self._stopped)
            except urllib.error.HTTPError as e:
                if e.code == 416:  # the server's file ends before what we have: not the signed one
                    raise JobFailed(JobState.FAILED, f"download of {rel}: the server's file ends at or before the "
                                                     f"{have} bytes already fetched (the manifest lists "
                                                     f"{entry.size_bytes})") from e
                if 400 <= e.code < 500:  # not there or not ours: retrying will not help
                    raise JobFailed(JobState.FAILED, f"download of {rel} refused: HTTP {e.code} {e.reason}") from e
                log.info("download of %s: HTTP %s, retrying", rel, e.code)
            except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
                # HTTPException: a body cut off mid-chunk (IncompleteRead) or a garbled status line
                if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # the disk, not the network
                    raise JobFailed(JobState.FAILED, f"no space left for {rel} on the device: {e}") from e
                if getattr(e, "errno", None) in STORAGE_ERRNOS:  # found in review: retried as a network fault
                    raise JobFailed(JobState.FAILED, f"cannot write {rel} on the device: {e}") from e
                log.info("download of %s interrupted (%s), resuming", rel, e)
            gained = (path.stat().st_size if path.exists() else 0) - have  # < 0: a server that ignored Range
            # progress: a MiB (or the rest), or the minimum rate over the attempt (a link that drops every
            # 40 s at 20 kB/s never got a MiB in one attempt, yet carries the download)
            enough = gained >= min(CHUNK_BYTES, entry.size_bytes - have)
            fast = gained >= MIN_DOWNLOAD_BYTES_PER_S * (time.monotonic() - started)
            stalled = 0 if gained > 0 and (enough or fast) else stalled + 1
            if not stalled:
                progressed = time.monotonic()
            else:
                delay = min(0.2 * 2 ** min(stalled, 16), DOWNLOAD_BACKOFF_MAX_S)
                if self.stopping is None:
                    time.sleep(delay)
                elif self.stopping.wait(delay):  # a stop cuts the wait short
                    raise JobPaused()
        raise JobFailed(JobState.FAILED, f"download of {rel} incomplete: no progress for {DOWNLOAD_STALL_S:.0f} s",
                        keep_download=True)

    @staticmethod
    def _get(url: str, path: Path, have: int, size: int, progress: Callable[[int], None],
             stopped: Callable[[], None] = lambda: None) -> None:
        # the socket timeout bounds one read; the low-speed check bounds a crawl (a server trickling a byte every
        # few seconds held the update thread, and every job queued behind it, for days)
        req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
        with urllib.request.urlopen(req, timeout=30) as resp:
            mode = "ab" if have and resp.status == 206 else "wb"  # a 200 means the server ignored Range
            written = reported = window_bytes = have if mode == "ab" else 0
            declared_end = written + resp.length if resp.length is not None else None  # Content-Length
            reported_at = window_start = time.monotonic()
            with open(path, mode) as f:
                while chunk := resp.read1(CHUNK_BYTES):  # what has arrived: read() waits for a whole chunk
                    if written + len(chunk) > size:  # a wrong or endless body must not fill the disk
                        raise JobFailed(JobState.FAILED, f"{url} sent more than the {size} bytes the signed "
                                                         f"manifest lists")
                    f.write(chunk)
                    written += len(chunk)
                    stopped()  # raises JobPaused: what arrived is kept
                    now = time.monotonic()
                    # a status a MiB or every PROGRESS_EVERY_S, not a read: at 200 B/s the fleet saw 0% for an hour
                    if written - reported >= CHUNK_BYTES or written == size or now - reported_at >= PROGRESS_EVERY_S:
                        progress(reported := written)
                        reported_at = now
                    if now - window_start >= LOW_SPEED_WINDOW_S:  # what arrived is kept: the next attempt resumes
                        if written - window_bytes < MIN_DOWNLOAD_BYTES_PER_S * (now - window_start):
                            raise TimeoutError(f"slower than {MIN_DOWNLOAD_BYTES_PER_S >> 10} kB/s over "
                                               f"{now - window_start:.0f} s")
                        window_start, window_bytes = now, written
            if written < size and declared_end is not None and written < declared_end:  # read1 does not raise
                raise ConnectionError(f"the connection closed after {written} of {declared_end} bytes")  # a cut
            if written < size:  # the body ended where the server said it would: its file is shorter than the
                # signed one, and asking again gets the same (it was retried, then for minutes)
                raise JobFailed(JobState.FAILED, f"{url} ended after {written} bytes; the signed manifest lists {size}")

    # -- verify, load, check --
    def _verify(self) -> Bundle:
        self.status(JobState.IN_PROGRESS, JobStep.VERIFYING)
        try:
            return open_bundle(self.staging)
        except BundleError as e:
            raise JobFailed(JobState.FAILED, f"verification failed: {e}") from e

    def _check_kv_graph(self, bundle: Bundle) -> None:
        """Found in review: a bundle without the int8 KV graph this device runs passed the health check (which
        runs the fp32-KV graph), then failed to load. Checked before the serving model stops, for the type the
        config file asks for too: a kv_dtype edit waiting for a restart (SIGHUP cannot apply it) made a model
        that installed fine fail at every later start."""
        for kv_dtype in set(self.ctx.kv_dtypes()) - {"fp32"}:  # every bundle has the fp32-KV graph
            try:
                bundle.graph(kv_dtype)
            except BundleError as e:
                raise JobFailed(JobState.FAILED, f"the device runs kv_dtype = \"{kv_dtype}\" (now, or after a "
                                                 f"restart by its config file): {e}") from e

    def _health_check(self, bundle: Bundle) -> dict:
        self.status(JobState.IN_PROGRESS, JobStep.LOADING)
        measure = self.ctx.measure or (lambda b, n: default_measure(b, self.ctx.threads, n))
        golden = bundle.manifest.golden.continuation_ids
        # the job may ask for more than the device's own floor, never for less (found in review: the config's
        # health_check_tokens was read nowhere)
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
        Found in review: checked beside the serving model, the new model's session took the process ~210 MB
        past memory_budget_mb (526 MB at 420, SmolLM2 INT4 -> INT8)."""
        m = bundle.manifest
        store = self.ctx.store
        self._check_kv_graph(bundle)
        final = store.models / _install_name(m)
        # journalled before anything moves: after a crash from here on, recover() removes `final` unless it
        # became current (journalled after the rename, a crash in between left the bundle there for good)
        store.write_journal({"job_id": self.doc.job_id, "state": JobState.IN_PROGRESS.value,
                             "step": JobStep.LOADING.value, "target": str(final)})
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
            # Both links as they were, and the bundle that failed gone. Found in review: a rollback made the
            # failed bundle `previous`, the target of the next rollback, and deleted the one `previous` named,
            # the device's last good fallback.
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
        self.staging = kept  # journalled as the target: after a crash, recover() sees whether current became it
        self.status(JobState.IN_PROGRESS, JobStep.ACTIVATING)
        target = store.rollback()
        if target is None:  # repeated: what was asked holds already
            self.status(JobState.SUCCEEDED, figures={"rolled_back_to": serving.name if serving else None,
                                                     "already": True})
            return JobState.SUCCEEDED
        try:
            bundle = open_bundle(target)  # verified in full: it may be the model whose activation failed
            self._check_kv_graph(bundle)  # found in review: a rollback skipped it, and the next start failed
            self.ctx.swap(bundle)
        except Exception as e:  # the links must name what the engine serves, or the next start boots `target`
            store.restore(serving, kept)
            if isinstance(e, JobFailed):
                raise JobFailed(JobState.FAILED, f"rollback to {target.name} refused: {e.reason}") from e
            first_line = (str(e).splitlines() or [""])[0][:300]
            raise JobFailed(JobState.FAILED, f"rollback to {target.name} failed, still serving "
                                             f"{serving.name if serving else 'the current model'}: {first_line}") from e
        self.status(JobState.SUCCEEDED, figures={"rolled_back_to": target.name})
        return JobState.SUCCEEDED

    def _pause(self) -> None:
        """Found in review: a stop during a download (which may retry for minutes) was cut off by the exit and
        reported FAILED at the restart. The journal says it is paused: recover() keeps its download and does
        not settle it, and the document still queued on disk runs again, resuming the download."""
        log.info("job %s paused by the agent stopping: it resumes after the restart", self.doc.job_id)
        try:
            self.ctx.store.write_journal({"job_id": self.doc.job_id, "state": JobState.QUEUED.value,
                                          "step": JobStep.DOWNLOADING.value, "target": str(self.staging),
                                          "paused": True})
        except OSError as e:  # the restart then reports it FAILED, as before
            log.error("job %s: cannot write the update journal: %s", self.doc.job_id, e)

    def _stopped(self) -> None:
        if self.stopping is not None and self.stopping.is_set():
            raise JobPaused()

    def _has_download(self) -> bool:
        return bool(self.staging) and any(p.is_file() and p.stat().st_size for p in self.staging.rglob("*"))

    def _clean_staging(self) -> None:
        if self.staging and self.staging.parent == self.ctx.store.staging_root:
            shutil.rmtree(self.staging, ignore_errors=True)


def recover(ctx: UpdateContext) -> wire.JobStatusUpdate | None:
    """At start: settle a job the last run left unfinished, and report its real state.

    A job that had ended is reported again: its final status lived only in the MQTT client's memory until
    the broker acknowledged it, so a job that ended offline, or just before a power cut, was never heard
    of and the fleet timed it out. The fleet ignores a repeated final status.
    """
    entry = ctx.store.read_journal()
    target = Path(entry["target"]) if entry and entry.get("target") else None  # read_journal checked its type
    ctx.store.clear_staging(keep=target)  # what the last job downloaded: a job for the same manifest resumes it
    if orphans := ctx.store.remove_orphans():
        log.warning("removed model directories no link names (left by an interrupted update): %s", orphans)
    if not entry or entry.get("paused"):  # nothing, or a job the last stop paused: its document runs again
        return None
    if JobState(entry["state"]) in wire.TERMINAL_JOB_STATES:
        update = _last_end(entry, ctx.device_id)
        if update is not None:
            (ctx.replay or ctx.report)(update)  # not news: not a model_change event at every boot
        return update
    current = ctx.store.link("current")
    if entry.get("step") == JobStep.ACTIVATING.value and target and current == target.resolve():
        state, reason = JobState.SUCCEEDED, None  # the swap happened before the crash
    else:  # IN_PROGRESS, or QUEUED (accepted: the fleet waits for how it ends)
        during = f"during {entry['step']}" if entry.get("step") else "before it started"
        state, reason = JobState.FAILED, f"interrupted by an agent restart {during}"  # what it moved into
        # models/ without activating it went with the orphans above
    update = wire.JobStatusUpdate(job_id=entry["job_id"], device_id=ctx.device_id, state=state, reason=reason,
                                  ts=time.time())
    try:
        ctx.store.write_journal({"job_id": entry["job_id"], "state": state.value, "step": None,  # the download
                                 "target": str(target) if target else None})  # it names stays for the next start
    except OSError as e:  # a full disk: the agent must still start and serve; it settles again next start
        log.error("cannot write the update journal: %s", e)
    ctx.report(update)
    return update


def _last_end(entry: dict, device_id: str) -> wire.JobStatusUpdate | None:
    """The journal's final status as it was reported; None if the journal (damaged, or an older agent's) says
    too little to report it."""
    for extra in ({"reason": entry.get("reason"), "ts": entry.get("ts") or time.time()}, {"ts": time.time()}):
        try:
            return wire.JobStatusUpdate(job_id=entry["job_id"], device_id=device_id, state=entry["state"], **extra)
        except ValidationError:
            continue
    log.warning("the update journal's last job cannot be reported again: %s", str(entry)[:200])
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
        if entry and entry.get("state") in {s.value for s in wire.TERMINAL_JOB_STATES}:
            self.done[entry["job_id"]] = JobState(entry["state"])
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
        """None queued begins (found in review: the marker went behind them, so a job queued when SIGTERM came
        began during the shutdown, was cut off by the exit and was reported FAILED), and a job downloading
        pauses; their saved documents stay on disk, and start() runs them after the restart, the download
        resumed. A job past its download goes on until it ends or the process exits (waited for 5 s)."""
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
        queued or remembered under the job id it claims, it let whoever can publish on the topic take a
        rollout's job id (the fleet's real job was then "already REJECTED") or fill the queue (found in review).
        Except a job the fleet did sign for this device that this device's clock refuses: REJECTED with the
        reason, once, or the fleet saw only a device timeout (a device clock ahead by more than the job's
        timeout refused every job silently; found in review).
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
                final = UpdateJob(self.ctx, doc, self._deadlines.pop(doc.job_id, None),
                                  self._stopping if self._pending.get(doc.job_id) else None).run()
                if final is JobState.QUEUED:  # paused by stop(): its document stays queued for the restart
                    break
            except Exception as e:  # a bug must not end updates for good; the old model keeps serving
                final = JobState.FAILED
                if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:  # the card, not a bug (found in review:
                    log.error("update job %s: %s", doc.job_id, e)      # reported as "internal error")
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
            except OSError as e:  # found in review: a read-only card ended this thread, and every later job
                log.error("job %s: cannot remove its queued copy: %s", doc.job_id, e)  # waited for ever


# A card that failed under us: ext4 remounts itself read-only after an I/O error (errors=remount-ro)
STORAGE_ERRNOS = (errno.EROFS, errno.EIO)


def _install_name(m: wire.Manifest) -> str:
    return f"{m.name}@{m.version}"  # the bundle's directory under models/


def _is_entry_name(name: str) -> bool:
    """True if name can be a single directory entry: no '/', no NUL, encodable, at most NAME_MAX (255) bytes."""
    try:
        return "/" not in name and "\x00" not in name and len(os.fsencode(name)) <= 255
    except UnicodeEncodeError:
        return False


def _job_id_of(payload: bytes) -> str | None:
    # RecursionError: json.loads recurses once per nesting level, and a few thousand '[' (far below
    # MAX_PAYLOAD_BYTES) raised it out of offer()
    try:
        job_id = json.loads(payload).get("job_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return job_id if isinstance(job_id, str) and 0 < len(job_id) <= 64 else None
