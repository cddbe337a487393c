"""One signed LoRA adapter job on the device: install an adapter beside the base model it fits, or remove one.

An install moves QUEUED -> IN_PROGRESS (downloading -> verifying -> activating -> health_check) -> SUCCEEDED,
or ends REJECTED before any download (the adapter manifest's signature, its schema, a device not running the
base build it was converted for, a base without the LoRA branches or rank it needs) or FAILED with a reason.
Only the adapter's files travel (its bytes are the job's DOWNLOADED_BYTES figure). Verified files move to
adapters/BASE@VERSION/NAME/ (agent.updates.model_store), the engine restarts on the same base and so serves
`BASE:NAME`, and the adapter's golden greedy continuation must come back through that engine, with the
adapter active, above the tokens/s floor; otherwise the adapter goes (or the version it replaced comes
back), the engine restarts without it, and the job ends FAILED. A removal takes the folder away and
restarts the engine likewise; removing an adapter the device does not hold succeeds with nothing to do.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from agent import durable, wire
from agent.engine.adapters import AdapterError, check_adapter, check_fit
from agent.updates.errors import JobFailed
from agent.updates.jobs import JobPhase, UpdateJob
from agent.updates.model_store import ADAPTERS_DIR, JobJournal
from agent.wire import JobState, JobStep

log = logging.getLogger(__name__)

HEALTH_CHECK_MIN_TOKENS = 16  # decoded for the speed figure even when fewer golden tokens must match

# An install: CHECKING -> DOWNLOADING -> VERIFYING -> STAGING (into adapters/) -> SWAPPING (the engine restarts
# with it) -> HEALTH_CHECKING (through that engine) -> SUCCEEDED. A removal: CHECKING -> REMOVING -> SUCCEEDED.
_TRANSITIONS = {
    JobPhase.QUEUED: {JobPhase.CHECKING},
    JobPhase.CHECKING: {JobPhase.DOWNLOADING, JobPhase.REMOVING, JobPhase.SUCCEEDED, JobPhase.REJECTED,
                        JobPhase.FAILED},  # SUCCEEDED: installed already, or nothing to remove
    JobPhase.DOWNLOADING: {JobPhase.VERIFYING, JobPhase.PAUSED, JobPhase.FAILED},
    JobPhase.VERIFYING: {JobPhase.STAGING, JobPhase.FAILED},
    JobPhase.STAGING: {JobPhase.SWAPPING, JobPhase.FAILED},
    JobPhase.SWAPPING: {JobPhase.HEALTH_CHECKING, JobPhase.REVERTING},
    JobPhase.HEALTH_CHECKING: {JobPhase.SUCCEEDED, JobPhase.REVERTING},
    JobPhase.REVERTING: {JobPhase.ROLLED_BACK},
    JobPhase.REMOVING: {JobPhase.SUCCEEDED, JobPhase.FAILED},
    JobPhase.PAUSED: set(),
    JobPhase.SUCCEEDED: set(),
    JobPhase.FAILED: set(),
    JobPhase.REJECTED: set(),
    JobPhase.ROLLED_BACK: set(),
}


class AdapterJob(UpdateJob):
    """install_adapter or remove_adapter; the job-level checks, journal, reports and download are UpdateJob's."""

    TRANSITIONS = _TRANSITIONS

    @property
    def adapter(self) -> wire.AdapterManifest:
        return self.doc.adapter

    def _carry_out(self) -> JobState:
        self.status(JobState.QUEUED)
        self._check_signed(wire.ADAPTER_SCHEMA_VERSION)
        if self.doc.operation == "remove_adapter":
            return self._remove()
        self._check_fits()
        installed = self._folder()
        if installed.is_dir() and _version_of(installed) == self.adapter.version:
            raise JobFailed(JobState.SUCCEEDED, f"{_label(self.adapter)} is already installed: nothing to do")
        self._check_base_url()
        self._download()
        self._verify_download()
        return self._succeed(self._activate_adapter())

    # -- before any download: REJECTED --
    def _check_fits(self) -> None:
        """The device serves the build the adapter was converted for, with LoRA branches for its targets and
        rank: an adapter's tensors mean nothing on other weights."""
        a, bundle = self.adapter, self.ctx.current()
        base = bundle.manifest
        if (a.base_name, a.base_version) != (base.name, base.version):
            raise JobFailed(JobState.REJECTED, f"{_label(a)} is for {a.base_name}@{a.base_version}; this device "
                                               f"runs {base.name}@{base.version}")
        try:
            check_fit(_label(a), a, bundle)
        except AdapterError as e:
            raise JobFailed(JobState.REJECTED, str(e)) from e

    def _folder(self) -> Path:
        """Where the adapter lives: adapters/BASE@VERSION/NAME (the name requests give after BASE:)."""
        a = self.adapter
        return self.ctx.store.root / ADAPTERS_DIR / f"{a.base_name}@{a.base_version}" / a.name

    # -- verify, install, restart, check --
    def _verify_download(self) -> None:
        self._enter(JobPhase.VERIFYING)
        self.status(JobState.IN_PROGRESS, JobStep.VERIFYING)
        try:  # every file against the signed manifest's sha256, and its fit, as the engine will check it again
            check_adapter(self.adapter.name, self.staging, self.ctx.current())
        except AdapterError as e:
            raise JobFailed(JobState.FAILED, f"verification failed: {e}") from e

    def _activate_adapter(self) -> dict:
        """Install, restart the engine with it, health-check it there; on failure the folder as it was (the
        version it replaced, or none) and the engine restarted again. Returns the check's figures."""
        self._enter(JobPhase.STAGING)
        self.status(JobState.IN_PROGRESS, JobStep.LOADING)
        floor = self._floor()  # the base's speed through the engine, before the adapter is in it
        final = self._folder()
        aside = final.with_name(f".{final.name}.old-{os.getpid()}")  # the version it replaces, until it serves
        shutil.rmtree(aside, ignore_errors=True)
        self.ctx.store.write_journal(JobJournal(job_id=self.doc.job_id, state=JobState.IN_PROGRESS,
                                                step=JobStep.LOADING, target=str(final)))
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                os.replace(final, aside)
            durable.move_into_place(self.staging, final)
        except OSError as e:
            _put_back(final, aside)
            raise JobFailed(JobState.FAILED, f"cannot install the adapter in {final}: {e}") from e
        self.staging = final
        try:
            self._enter(JobPhase.SWAPPING)
            self.status(JobState.IN_PROGRESS, JobStep.ACTIVATING)
            self.ctx.swap(self.ctx.current())  # a restart on the same base picks the store's adapters up
            figures = self._health_check(floor)
        except Exception as e:
            self._revert(final, aside, e)
        shutil.rmtree(aside, ignore_errors=True)
        return figures

    def _floor(self) -> float:
        floor = self.doc.min_tokens_per_s
        if floor is None:  # 70% of the base's decode of the same prompt, as an install's default floor is
            floor = 0.7 * self._generate(None, HEALTH_CHECK_MIN_TOKENS)[1]
        return max(floor, self.ctx.min_tokens_per_s)  # the job's floor is not signed: the device's own holds

    def _generate(self, adapter: str | None, n: int) -> tuple[list[int], float]:
        if self.ctx.generate is None:
            raise JobFailed(JobState.FAILED, "this agent runs no engine to health-check an adapter with")
        return self.ctx.generate(self.adapter.golden.prompt_ids, n, adapter)

    def _health_check(self, floor: float) -> dict:
        self._enter(JobPhase.HEALTH_CHECKING)
        self.status(JobState.IN_PROGRESS, JobStep.HEALTH_CHECK)
        golden = self.adapter.golden.continuation_ids
        n = min(max(self.doc.golden_tokens, self.ctx.health_check_tokens), len(golden))
        ids, tps = self._generate(self.adapter.name, max(n, HEALTH_CHECK_MIN_TOKENS))
        if ids[:n] != golden[:n]:
            first = next((i for i in range(n) if i >= len(ids) or ids[i] != golden[i]), n)
            raise JobFailed(JobState.FAILED, f"golden output mismatch at token {first} of {n} with the adapter active")
        if tps < floor:
            raise JobFailed(JobState.FAILED, f"decode {tps:.1f} tokens/s with the adapter is below the floor "
                                             f"{floor:.1f}")
        return {"decode_tokens_per_s": round(tps, 2), "tokens_per_s_floor": round(floor, 2), "golden_tokens": n,
                "adapter": f"{self.adapter.name}@{self.adapter.version}"}

    def _revert(self, final: Path, aside: Path, e: Exception) -> None:
        """The adapter failed in the engine: the folder as it was, the engine restarted on it; FAILED."""
        self._enter(JobPhase.REVERTING)
        shutil.rmtree(final, ignore_errors=True)
        _put_back(final, aside)
        self.ctx.swap(self.ctx.current())
        reason = e.reason if isinstance(e, JobFailed) else (str(e).splitlines() or [""])[0][:300]
        raise JobFailed(JobState.FAILED, f"{reason}; the adapter was removed again") from e

    # -- removal --
    def _remove(self) -> JobState:
        final = self._folder()
        if not final.is_dir():
            raise JobFailed(JobState.SUCCEEDED, f"{self.adapter.name} is not installed for "
                                                f"{self.adapter.base_name}@{self.adapter.base_version}: nothing to do")
        self._enter(JobPhase.REMOVING)
        self.status(JobState.IN_PROGRESS, JobStep.ACTIVATING)
        removed = f"{self.adapter.name}@{_version_of(final) or '?'}"
        gone = final.with_name(f".{final.name}.removed-{os.getpid()}")
        shutil.rmtree(gone, ignore_errors=True)
        os.replace(final, gone)
        durable.fsync_path(final.parent)
        base = self.ctx.current()
        if (base.manifest.name, base.manifest.version) == (self.adapter.base_name, self.adapter.base_version):
            try:
                self.ctx.swap(base)  # the engine restarts without it: BASE:NAME is a 404 from here
            except Exception as e:
                os.replace(gone, final)
                raise JobFailed(JobState.FAILED, f"removal failed, the adapter stays: {e}") from e
        shutil.rmtree(gone, ignore_errors=True)
        self._enter(JobPhase.SUCCEEDED)
        self.status(JobState.SUCCEEDED, figures={"removed": removed})
        return JobState.SUCCEEDED


def _label(a: wire.AdapterManifest) -> str:
    return f"adapter {a.name}@{a.version}"


def _version_of(folder: Path) -> str | None:
    try:
        return wire.AdapterManifest.read(folder).version
    except (OSError, ValueError):
        return None


def _put_back(final: Path, aside: Path) -> None:
    if aside.exists() and not final.exists():
        os.replace(aside, final)
