"""The fleet database's schema: every migration, in the order it runs, and the telemetry tables' columns.

A migration that has shipped is never edited: `FleetStore.migrate` applies, each in its own transaction,
those of MIGRATIONS a database has not recorded in its `_migrations` table, so a new schema change is a new
entry at the end of the list. The registry and telemetry tables come first (0001-0003, 0007), the rollout
tables after (0004-0006, 0008-0009, 0016; fleet.updates reads and writes them), the request rollups and their
stale marks (0012-0013, keyed by adapter from 0017; fleet.rollups), and PostgreSQL's day partitions of the
telemetry tables (0015; fleet.partitions). The store's row writers insert
KEY, REQUEST_FIGURES_COLUMNS and SAMPLE_COLUMNS in the order given here.
"""
from __future__ import annotations

from typing import Callable

from fleet.db import Database

KEY = {"device_id": str, "boot_id": str, "seq": int, "ts": float}  # ts: the device's clock, s since the epoch
PRIMARY_KEY = ("device_id", "boot_id", "seq")  # PostgreSQL's from 0015 adds sent_ts (fleet.partitions)
TELEMETRY_TABLES = ("requests", "samples", "events")  # what retention prunes; the registry and jobs stay
# A stamp before this (2020-01-01) is a clock that was never set (a box without an RTC boots in 1970): no set
# clock running this software reads earlier. The store replaces such stamps (fleet.store.Ingest.add_records).
UNSET_CLOCK_BEFORE_TS = 1_577_836_800.0

# The request columns 0002 creates: fixed, as a shipped migration is (columns added later come in migrations of
# their own, below)
REQUEST_FIGURES_COLUMNS_0002 = {
    "prompt_tokens": int, "completion_tokens": int, "cached_prompt_tokens": int, "queue_ms": float,
    "ttft_ms": float, "prefill_tokens_per_s": float, "decode_tokens_per_s": float, "itl_p50_ms": float,
    "itl_p95_ms": float, "e2e_ms": float, "kv_bytes": int, "finish_reason": str, "preemptions": int,
    "drafted_tokens": int, "accepted_tokens": int,
}
REQUEST_CONSTRAINT_COLUMNS = {"constrained": int, "constraint_ms": float}  # 0010
# RequestFigures fields stored as request columns (tests check that every field of the wire model is here)
REQUEST_FIGURES_COLUMNS = {**REQUEST_FIGURES_COLUMNS_0002, **REQUEST_CONSTRAINT_COLUMNS}
# 0012: per (period, device, model, version). width_s: 3600 or 86400; start_ts: the period's start, s since
# the epoch; *_hist: fleet.rollups' histogram texts. The key leads with (width_s, start_ts): a window is one range.
# Fixed, as a shipped migration is: 0017 rebuilds both tables with the adapter in their key.
REQUEST_ROLLUP_COLUMNS_0012 = {"width_s": int, "start_ts": int, "device_id": str, "model": str, "version": str,
                               "requests": int, "errors": int, "tokens_served": int, "ttft_hist": str,
                               "decode_hist": str}
REQUEST_ROLLUP_KEY_0012 = ("width_s", "start_ts", "device_id", "model", "version")
# 0013: the hour rollups stale since their last refresh, per (hour, device, model, version). claimed: 0 as ingest
# marks it, 1 once a refresh has taken it (fleet.rollups.refresh_step); marked_at: the fleet's clock when first
# marked (the refresh lag runs from it).
REQUEST_ROLLUP_DIRTY_COLUMNS_0013 = {"claimed": int, "start_ts": int, "device_id": str, "model": str, "version": str,
                                     "marked_at": float}
REQUEST_ROLLUP_DIRTY_KEY_0013 = ("claimed", "start_ts", "device_id", "model", "version")
# 0017: both keyed by adapter too, after version. adapter: the request's LoRA adapter NAME@VERSION, '' for the base
# model alone (the requests table's NULL): a key column, and NULLs never compare equal, so a NULL would let one
# bucket hold many rows and its marks never dedupe.
NO_ADAPTER = ""
REQUEST_ROLLUP_COLUMNS = {"width_s": int, "start_ts": int, "device_id": str, "model": str, "version": str,
                          "adapter": str, "requests": int, "errors": int, "tokens_served": int, "ttft_hist": str,
                          "decode_hist": str}
REQUEST_ROLLUP_KEY = (*REQUEST_ROLLUP_KEY_0012, "adapter")
REQUEST_ROLLUP_DIRTY_COLUMNS = {"claimed": int, "start_ts": int, "device_id": str, "model": str, "version": str,
                                "adapter": str, "marked_at": float}
REQUEST_ROLLUP_DIRTY_KEY = (*REQUEST_ROLLUP_DIRTY_KEY_0013, "adapter")
SAMPLE_COLUMNS = {
    "interval_s": float, "rss_mb": float, "cpu_percent": float, "kv_utilization": float, "queue_depth": int,
    "running": int, "tokens_per_s": float,
}


def _create_devices(db: Database) -> None:
    db.create_table("devices", {
        "id": str, "status": str, "connection": int, "state_ts": float, "first_seen": float, "last_seen": float,
        "boot_id": str, "model": str, "version": str, "precision": str, "hardware": str, "agent_version": str,
    }, "id")


def _create_telemetry(db: Database) -> None:
    db.create_table("requests", {**KEY, "model": str, "version": str, **REQUEST_FIGURES_COLUMNS_0002}, PRIMARY_KEY)
    db.create_index("requests", ["ts"])
    db.create_index("requests", ["model", "version", "ts"])
    db.create_index("requests", ["device_id", "ts"])
    db.create_table("samples", {**KEY, **SAMPLE_COLUMNS}, PRIMARY_KEY)
    db.create_index("samples", ["device_id", "ts"])
    db.create_table("events", {**KEY, "kind": str, "detail": str}, PRIMARY_KEY)
    db.create_index("events", ["device_id", "ts"])


def _create_rejected(db: Database) -> None:
    db.create_table("rejected", {"device_id": str, "reason": str, "count": int, "first_ts": float, "last_ts": float},
                          ("device_id", "reason"))


def create_update_tables(db: Database) -> None:
    db.create_table("models", {"name": str, "version": str, "manifest": str, "signature": str, "key_id": str,
                         "published_at": float}, ("name", "version"))
    db.create_table("jobs", {"id": str, "operation": str, "model": str, "version": str, "state": str, "wave_size": int,
                       "max_failure_rate": float, "allow_downgrade": int, "min_tokens_per_s": float, "reason": str,
                       "created_at": float, "updated_at": float}, "id")
    db.create_table("job_devices", {"job_id": str, "device_id": str, "wave": int, "state": str, "step": str,
                              "percent": float, "reason": str, "figures": str, "notified": int, "updated_at": float},
                             ("job_id", "device_id"))


def add_device_timeout(db: Database) -> None:
    db.add_column("jobs", "device_timeout_s", float)


def add_report_times(db: Database) -> None:
    """notified_at: the device timeout runs from it; reported_ts: the device clock's ts of the report applied."""
    db.add_column("job_devices", "notified_at", float)
    db.add_column("job_devices", "reported_ts", float)
    db.execute("update job_devices set notified_at = updated_at where notified = 1")


def _index_telemetry_ts(db: Database) -> None:
    for table in ("samples", "events"):  # requests has one: retention finds old rows without a table scan
        db.create_index(table, ["ts"], if_not_exists=True)


def add_notified_connection(db: Database) -> None:
    """notified_connection: the device's connection counter when its notice went (a later one: it came back).
    Notices sent before this column count from the device's connection now, or every device that had not
    answered yet would be sent its notice again at the upgrade."""
    db.add_column("job_devices", "notified_connection", int)
    db.execute("update job_devices set notified_connection = (select connection from devices where id = "
               "job_devices.device_id) where notified = 1")


def index_job_device_state(db: Database) -> None:
    """The driver asks every 0.5 s for the devices still QUEUED or IN_PROGRESS. Without an index that scanned
    every device of every rollout ever run: 23 ms a pass at 100,000 rows, ~5% of a core doing nothing after a
    year of weekly rollouts to 2,000 devices."""
    db.create_index("job_devices", ["state"], if_not_exists=True)


def add_request_constraint(db: Database) -> None:
    """Whether a request's output was held to a grammar and what its matcher cost; 0 for rows from before."""
    for column, kind in REQUEST_CONSTRAINT_COLUMNS.items():
        db.add_column("requests", column, kind, not_null_default=0)


def add_device_broker(db: Database) -> None:
    """broker: the URL of the broker the device's newest state came through (devices spread over several
    brokers: commands and rollout notices go there); NULL until its next state arrives."""
    db.add_column("devices", "broker", str)


def add_request_rollups(db: Database) -> None:
    """Hourly and daily request rollups (fleet.rollups). The requests already stored are rolled up by 0017, which
    rebuilds this table with the adapter in its key: one backfill at an upgrade, not two."""
    db.create_table("request_rollups", REQUEST_ROLLUP_COLUMNS_0012, REQUEST_ROLLUP_KEY_0012)


def add_request_rollup_marks(db: Database) -> None:
    """Rollup buckets made stale by ingest, refreshed from the raw rows in the background (fleet.rollups). Empty
    at the upgrade: until now every commit kept its rollups current."""
    db.create_table("request_rollups_dirty", REQUEST_ROLLUP_DIRTY_COLUMNS_0013, REQUEST_ROLLUP_DIRTY_KEY_0013)


def add_request_adapter(db: Database) -> None:
    """adapter: the LoRA adapter a request ran with, NAME@VERSION (wire.RequestRecord.adapter); NULL for the base
    model alone, and for every row from before. The rollups key by it from 0017."""
    db.add_column("requests", "adapter", str)


def add_adapter_rollouts(db: Database) -> None:
    """adapters: the published LoRA adapters (fleet.updates.publish_adapter), keyed like models, each with the
    base build it fits; jobs.adapter / adapter_version: an adapter job's adapter (model / version: its base)."""
    db.create_table("adapters", {"name": str, "version": str, "base_name": str, "base_version": str, "manifest": str,
                                 "signature": str, "key_id": str, "published_at": float}, ("name", "version"))
    db.add_column("jobs", "adapter", str)
    db.add_column("jobs", "adapter_version", str)


def partition_telemetry(db: Database) -> None:
    """PostgreSQL: the telemetry tables range-partitioned by day on the stamp devices sent (fleet.partitions), rows
    kept. SQLite: nothing (recorded all the same, so both backends list the same migrations)."""
    import time

    from fleet import partitions  # here, not at the top: fleet.partitions imports this module's constants

    partitions.partition_tables(db, TELEMETRY_TABLES, time.time())


def add_rollup_adapter(db: Database) -> None:
    """The request rollups and their stale marks keyed by adapter too (NO_ADAPTER for the base alone), so that
    `tps --by adapter` over a long window reads rollups. Both tables rebuilt, the rollups from every request
    stored (fleet.rollups.backfill; once, in this transaction: a rollup from before mixed the adapters of its
    bucket, so none is kept): every rollup then equals its raw rows and no mark is needed; ingest marks anew.
    The raw rows are untouched."""
    from fleet import rollups  # here, not at the top: fleet.rollups imports this module's columns

    for table in ("request_rollups", "request_rollups_dirty"):
        db.execute(f"drop table {table}")
    db.create_table("request_rollups", REQUEST_ROLLUP_COLUMNS, REQUEST_ROLLUP_KEY)
    db.create_table("request_rollups_dirty", REQUEST_ROLLUP_DIRTY_COLUMNS, REQUEST_ROLLUP_DIRTY_KEY)
    rollups.backfill(db)


MIGRATIONS: tuple[tuple[str, Callable[[Database], None]], ...] = (
    ("0001_devices", _create_devices),
    ("0002_telemetry", _create_telemetry),
    ("0003_rejected", _create_rejected),
    ("0004_updates", create_update_tables),
    ("0005_job_device_timeout", add_device_timeout),
    ("0006_job_device_report_times", add_report_times),
    ("0007_telemetry_ts_index", _index_telemetry_ts),
    ("0008_job_device_notified_connection", add_notified_connection),
    ("0009_job_device_state_index", index_job_device_state),
    ("0010_request_constraint", add_request_constraint),
    ("0011_device_broker", add_device_broker),
    ("0012_request_rollups", add_request_rollups),
    ("0013_request_rollup_marks", add_request_rollup_marks),
    ("0014_request_adapter", add_request_adapter),
    ("0015_telemetry_partitions", partition_telemetry),
    ("0016_adapter_rollouts", add_adapter_rollouts),
    ("0017_request_rollup_adapter", add_rollup_adapter),
)
