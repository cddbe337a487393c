"""What a deployment meets, found before its job exists (`edge-fleet deploy` and `rollback`): the devices it
goes to, the published versions a bare model name could mean, and the devices' own checks that would refuse
the model, so that the operator reads them once, before the start, rather than in every device's report.

The devices' checks (agent/updates/jobs.py): a model built before the one a device runs is a downgrade,
REJECTED unless the job allows it (manifests' `created_at`, the build time, ISO 8601 UTC); and a job that
sets no tokens/s floor gets 70% of the current model's decode speed as its health check's floor, which a
slower precision fails (SmolLM2 on 2 cores: INT8 decodes at 114 tokens/s, 0.69x INT4's 164;
docs/benchmarks.md). Read-only over the fleet database: the registry (`devices`) and `models`.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from pydantic import ValidationError

from agent.wire import Manifest
from fleet.db import Database
from fleet.queries import iso

# decode speed by precision, fastest first: a precision later in this list is slower (docs/benchmarks.md)
PRECISIONS_FASTEST_FIRST = ("int4", "int8", "fp32")
MAX_NAMED = 10  # device ids a message names before "..."


class DeployError(ValueError):
    """What stops a deployment before its job exists; the message says what to do instead."""


def named(ids: list[str]) -> str:
    return ", ".join(ids[:MAX_NAMED]) + (" ..." if len(ids) > MAX_NAMED else "")


def _manifest(text: str) -> Manifest | None:
    try:
        return Manifest.model_validate_json(text)
    except ValidationError:  # a row written by hand or by an older fleet: nothing to check against
        return None


def published_versions(db: Database, name: str) -> list[dict]:
    """NAME's published versions, oldest build first: what `deploy NAME@VERSION` accepts."""
    rows = []
    for r in db.query("select version, manifest, published_at from models where name = ?", [name]):
        m = _manifest(r["manifest"])
        rows.append({"target": f"{name}@{r['version']}", "precision": m.precision if m else None,
                     "built": m.created_at if m else None, "published": iso(r["published_at"])})
    return sorted(rows, key=lambda r: (r["built"] or "", r["target"]))


def published_manifest(db: Database, target: str) -> Manifest | None:
    """The manifest published as MODEL@VERSION (None if the row holds none this fleet can read)."""
    name, _, version = target.partition("@")
    row = next(db.query("select manifest from models where name = ? and version = ?", [name, version]), None)
    if row is None:
        raise DeployError(f"{target} is not published (edge-fleet publish BUNDLE --key KEY)")
    return _manifest(row["manifest"])


def choose_devices(db: Database, devices: list[str], group: str | None, to_all: bool) -> list[str]:
    """--all, --group GLOB or --to DEVICE...: registered device ids, each once."""
    known = [r["id"] for r in db.query("select id from devices order by id")]
    if to_all:
        return known
    if group:
        return [d for d in known if fnmatch.fnmatch(d, group)]
    registered = set(known)
    unknown = [d for d in devices if d not in registered]
    if unknown:  # it would never report: the job would wait out its device timeout and fail
        raise DeployError(f"unknown device {unknown[0]!r}: not in the fleet's registry (edge-fleet devices)")
    return list(dict.fromkeys(devices))


@dataclass(frozen=True)
class Needing:
    devices: list[str]  # the devices the job goes to
    skipped: dict[str, list[str]]  # why -> device ids left out


def needing(db: Database, chosen: list[str], target: str, offline_too: bool) -> Needing:
    """The chosen devices that need the job: not those already on the target (re-running a halted rollout),
    nor the offline devices of --all or --group, each of which would wait out its timeout: both would count
    as failures and halt the rollout at once. A device named with --to is deployed to even when offline."""
    rows = {r["id"]: r for r in db.query("select id, status, model, version from devices")}
    current = [d for d in chosen if d in rows and f"{rows[d]['model']}@{rows[d]['version']}" == target]
    offline = [] if offline_too else [d for d in chosen if d in rows and rows[d]["status"] != "online"]
    skipped = set(current) | set(offline)  # sets: list membership made 10,000 devices take 0.4 s
    why = {"already on " + target: current, "offline (--include-offline to add them)": offline}
    return Needing([d for d in chosen if d not in skipped], {k: ids for k, ids in why.items() if ids})


def refusals(db: Database, target: Manifest, devices: list[str], allow_downgrade: bool,
             min_tokens_per_s: float | None) -> list[str]:
    """Why the devices' own checks would refuse the target, as far as the registry knows what they run (its
    precision; its build time when that model is published here): one line per check, with the flag to give."""
    rows = {r["id"]: r for r in db.query("select id, model, version, precision from devices")}
    running = [rows[d] for d in devices if d in rows]
    problems = [] if min_tokens_per_s is not None else _slower(target, running)
    return problems + ([] if allow_downgrade else _older(db, target, running))


def _slower(target: Manifest, running: list[dict]) -> list[str]:
    if target.precision not in PRECISIONS_FASTEST_FIRST:
        return []
    faster = PRECISIONS_FASTEST_FIRST[:PRECISIONS_FASTEST_FIRST.index(target.precision)]
    ids = [r["id"] for r in running if r["precision"] in faster]
    if not ids:
        return []
    theirs = "/".join(p for p in faster if any(r["precision"] == p for r in running))
    return [f"{target.precision} decodes slower than the {theirs} that {len(ids)} device(s) run "
            f"({named(ids)}): the health check's default floor, 70% of the current model's tokens/s, would fail "
            f"it; set the floor with --min-tokens-per-s N (0: only each device's own [updates] min_tokens_per_s)"]


def _older(db: Database, target: Manifest, running: list[dict]) -> list[str]:
    newer, builds = [], {}  # builds: (model, version) -> its manifest, read once for all the devices running it
    for r in running:
        key = (r["model"], r["version"])
        if key not in builds:
            row = next(db.query("select manifest from models where name = ? and version = ?", list(key)), None)
            builds[key] = _manifest(row["manifest"]) if row else None  # a model seeded on a device: unknown
        current = builds[key]
        if current is not None and current.created_at > target.created_at:  # ISO 8601 UTC: ordered as text
            newer.append((r["id"], f"{current.name}@{current.version}", current.created_at))
    if not newer:
        return []
    device, model, built = newer[0]
    return [f"built {target.created_at}, before what {len(newer)} device(s) run ({named([n[0] for n in newer])}; "
            f"{device}: {model}, built {built}): devices refuse a downgrade unless --allow-downgrade"]
