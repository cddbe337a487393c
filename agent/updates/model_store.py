"""The models installed on the device and the updater's files beside them: which bundle is `current` and
which `previous` (symlinks swapped by rename), the model to boot, the staging area of downloads, the job
journal that survives a crash, the queue of accepted job documents and the last signed job begun.

Layout under the state directory:
    models/NAME@VERSION/   verified bundles        current -> models/...   previous -> models/...
    models/.staging/DIGEST/ downloads in progress  updates/job.json        the journal
    updates/queue/N-JOB.json accepted jobs not yet run                     agent.lock (agent.service.serve)
    adapters/NAME@VERSION/ADAPTER/  the LoRA adapters served with that build of a model, as BASE:ADAPTER (one
                           version of each: an adapter fits one build, and a request names it without a version)
Every rename here is followed by an fsync of its directory (agent.durable): an update reported SUCCEEDED
survives a power cut.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from agent import durable
from agent.engine.bundle import Bundle, BundleError, open_bundle
from agent.updates.errors import JobFailed
from agent.wire import JobDocument, JobState, JobStep, Manifest

log = logging.getLogger(__name__)
ADAPTERS_DIR = "adapters"  # under the state directory: see the layout above


class JobJournal(BaseModel):
    """updates/job.json: where the last job stood, written before each status it reports and read back at
    start (agent.updates.service.recover). The fields are every key an agent has written, so a journal
    carrying any other key is damaged; a key left out was not written (see ModelStore.write_journal)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    state: JobState
    step: JobStep | None = None  # while IN_PROGRESS
    target: str | None = None  # its staging directory, or the bundle it installs or rolls back to
    reason: str | None = None  # why it ended FAILED / REJECTED
    ts: float | None = None  # time.time() of the status: a replayed final status keeps it
    paused: bool = False  # stopped during its download: its queued document runs again after the restart

    @field_validator("ts", mode="wrap")
    @classmethod
    def _ts_or_none(cls, value, handler):
        """A ts that is no number reads as none: the status is replayed stamped at boot, the rest still holds."""
        try:
            return handler(value)
        except ValidationError:
            return None


class ModelStore:
    def __init__(self, state_dir: Path):
        self.root = Path(state_dir)
        self.models = self.root / "models"
        self.staging_root = self.models / ".staging"
        self.journal = self.root / "updates" / "job.json"
        self.queue = self.root / "updates" / "queue"  # accepted job documents not yet run, one file each
        self._last_issued = self.root / "updates" / "last_signed_job.json"  # the last signed job begun (replays)
        # the bundle the last rollback left: `previous` naming it means that rollback is done. An install that
        # serves forgets it, so the same name@version deployed again is not taken for the one rolled back
        # from; a failed rollback leaves current naming it, which no rollback targets.
        self._rolled_back_from = self.root / "updates" / "rolled_back_from"
        for d in (self.models, self.staging_root, self.journal.parent, self.queue):
            d.mkdir(parents=True, exist_ok=True)
        self.fallback: dict | None = None  # what bootable() did when `current` did not verify: the event's detail

    def adapters_for(self, manifest: Manifest) -> dict[str, Path]:
        """The adapters installed for this build of a model, by the name requests use (their folder's)."""
        folder = self.root / ADAPTERS_DIR / f"{manifest.name}@{manifest.version}"
        if not folder.is_dir():
            return {}
        return {p.name: p for p in sorted(folder.iterdir()) if p.is_dir() and not p.name.startswith(".")}

    def discard_adapter(self, folder: Path) -> bool:
        """After a crash mid-install: the adapter at folder (under adapters/) goes, never health-checked, and the
        version it replaced (set aside as .NAME.old-PID) comes back; False if folder is not an adapter's."""
        folder = Path(folder)
        if folder.parent.parent != self.root / ADAPTERS_DIR:
            return False
        shutil.rmtree(folder, ignore_errors=True)
        for aside in sorted(folder.parent.glob(f".{folder.name}.old-*"))[-1:]:
            os.replace(aside, folder)
        return True

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
        """Delete what .staging holds but keep, a partial download of one manifest, which the next job for the
        same model resumes rather than fetching it all again (as Ollama's and Mender's downloads do). At most
        one is kept, so the disk holds at most one bundle's worth."""
        self.staging_root.mkdir(parents=True, exist_ok=True)
        for p in self.staging_root.iterdir():
            if keep is not None and p.resolve() == keep.resolve():
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def remove_orphans(self) -> list[str]:
        """At start, delete what models/ holds that neither link names (a power cut between a rollback's two
        link swaps, both then naming one bundle, or during a deletion left a bundle there for good) and the
        adapter folders a removal hid but had not yet deleted. Returns their names."""
        kept = {self.link("current"), self.link("previous")} - {None}
        if not kept:
            return []
        orphans = [p for p in self.models.iterdir() if p != self.staging_root and p.resolve() not in kept]
        # an adapter removal cut short after it hid the folder (agent.updates.adapter_job): never served again
        orphans += sorted((self.root / ADAPTERS_DIR).glob("*/.*.removed-*"))
        for p in orphans:
            if p.is_symlink():  # seeded by `serve --model DIR`: the link goes, DIR is the user's
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)
        return sorted(str(p.relative_to(self.root)) if p.parent.parent == self.root / ADAPTERS_DIR else p.name
                      for p in orphans)

    def rollback(self) -> Path | None:
        """Make `previous` current (and current previous); None if that was the last thing done: a rollback
        already done, so a retried command, a copy redelivered by the broker or a replay does not undo the
        rollback it repeats. Going back to the model rolled back from takes a deployment of it, as with
        Mender's artifacts."""
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
        """The model to serve: `current` if it verifies, else `previous`, which becomes current and the only
        link (were both links to name it, a rollback would 'succeed' to the model serving); the fallback is
        said in the log and in self.fallback, for the fleet's model_fallback event."""
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

    def write_journal(self, entry: JobJournal) -> None:
        """The keys given when entry was made, and only those (as every agent has written them)."""
        durable.write_text(self.journal, entry.model_dump_json(exclude_unset=True))

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

    def read_journal(self) -> JobJournal | None:
        """The journal's entry; None if there is none or it does not validate (not JSON, not an object, a
        field of the wrong type, a key no agent writes): a damaged journal must not stop recover(), and so
        every start."""
        try:
            return JobJournal.model_validate_json(self.journal.read_bytes())
        except (OSError, ValueError):  # ValueError: pydantic's ValidationError, for JSON or a field
            return None
