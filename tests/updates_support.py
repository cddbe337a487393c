"""What the update tests share: two versions of the tiny model as bundles, a fleet key pair, a device whose
updater runs on a real ModelStore, a job document, a tampered manifest, a swap that fails on one version and the
journal written raw. Used by tests/agent/test_update_*.py and tests/reliability/test_fuzz_jobs.py.
"""
from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

from agent import wire
from agent.engine.bundle import Bundle, open_bundle
from agent.engine.golden import measure_golden
from agent.updates.trust import load_trusted_keys
from agent.updates.jobs import UpdateContext
from agent.updates.model_store import ModelStore
from agent.wire import JobDocument
from fleet.signing import keygen, load_private_key, sign_manifest
from quantize.package import build_bundle
from quantize.precision import QuantSpec


def build_bundles(checkpoint, root: Path) -> tuple[Bundle, Bundle]:
    """v1 (fp32) and v2 (int8): the same tiny model, two versions a device can move between."""
    v1 = build_bundle(checkpoint, QuantSpec(), root / "v1", name="tiny", progress=lambda s: None)
    v2 = build_bundle(checkpoint, QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={}),
                      root / "v2", name="tiny", progress=lambda s: None)
    return v1, v2


def make_keys(root: Path) -> Path:
    """root/fleet.key (the key devices trust) and root/other.key (one they do not), each with its .pub."""
    keygen(root / "fleet.key")
    keygen(root / "other.key")
    return root


class Device:
    """The updater with a real store, serving v1, and a record of every status it reported (thread-safe: an
    UpdateService reports from its own thread)."""

    def __init__(self, root: Path, v1: Bundle, keys: Path, budget_mb: int = 4096):
        self.root, self.v1 = root, v1
        self.reports: list[wire.JobStatusUpdate] = []
        self.reported = threading.Condition()
        self.store = self._fresh_store()
        self.ctx = UpdateContext(device_id="dev1", store=self.store,
                                 trusted_keys=load_trusted_keys([keys / "fleet.key.pub"]), memory_budget_mb=budget_mb,
                                 current=lambda: self.serving, report=self._report, swap=self._swap,
                                 measure=lambda b, n: measure_golden(b, 1, n))

    def _fresh_store(self) -> ModelStore:
        store = ModelStore(self.root / "state")
        dest = store.models / f"{self.v1.manifest.name}@{self.v1.manifest.version}"
        shutil.copytree(self.v1.path, dest)
        store.activate(dest)
        self.serving = open_bundle(dest)
        return store

    def reset(self) -> None:
        """Back to a store holding only v1, serving it (between fuzz cases; the updater must be idle)."""
        def gone_meanwhile(func, path, exc_info):  # the updater deletes a run job's saved document just after
            if not issubclass(exc_info[0], FileNotFoundError):  # its last report, which the case waited for
                raise exc_info[1]
        shutil.rmtree(self.root / "state", onerror=gone_meanwhile)
        self.store = self.ctx.store = self._fresh_store()

    def _report(self, update: wire.JobStatusUpdate) -> None:
        with self.reported:
            self.reports.append(update)
            self.reported.notify_all()

    def wait_report(self, predicate, timeout_s: float, since: int = 0) -> wire.JobStatusUpdate | None:
        """The first report from reports[since:] that satisfies predicate, waiting up to timeout_s for it."""
        def first():
            return next((r for r in self.reports[since:] if predicate(r)), None)

        with self.reported:
            self.reported.wait_for(lambda: first() is not None, timeout_s)
            return first()

    def _swap(self, bundle: Bundle, check=None) -> None:
        """As the lifecycle's swap: the check runs once the old model has stopped; if it fails, the old one serves."""
        if check is not None:
            check(bundle)
        self.serving = bundle

    def model_dirs(self) -> list[str]:
        return sorted(p.name for p in self.store.models.iterdir() if p.name != ".staging")

    def staging_empty(self) -> bool:
        return not any(self.store.staging_root.iterdir())


def job(manifest: wire.Manifest, keyfile: Path | None, base_url: str, job_id: str = "job-1", **kw) -> JobDocument:
    """An install job for manifest, signed with keyfile (unsigned if None)."""
    sig, kid = sign_manifest(manifest, load_private_key(keyfile)) if keyfile else (None, None)
    return JobDocument(job_id=job_id, manifest=manifest, signature=sig, key_id=kid, base_url=base_url, **kw)


def write_raw_journal(store: ModelStore, entry) -> None:
    """The journal as it lies on disk, written by this agent, an older one or a damaged card."""
    store.journal.write_text(json.dumps(entry))


def _tamper_manifest(m: wire.Manifest, **changes) -> wire.Manifest:
    return wire.Manifest.model_validate(m.model_dump() | changes)


def swap_failing_on(dev, version: str, calls: list | None = None):
    """A swap whose engine cannot start `version` (after its check ran); any other bundle serves."""
    def swap(bundle, check=None):
        if calls is not None:
            calls.append(bundle.manifest.version)
        if check:
            check(bundle)
        if bundle.manifest.version == version:
            raise RuntimeError("engine failed to start")
        dev.serving = bundle
    return swap
