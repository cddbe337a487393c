"""The telemetry database's schema: ordered, named migrations, each run once in its own transaction.

`migrate()` applies, in order, the MIGRATIONS a database lacks and records each name in its `migrations`
table, so a device's file, whatever agent version made it, ends up with the same schema: the `records` table
(with its delivery flag and indexes), the `meta` counters, the `requests` view and the stored-bytes
triggers. Never edit a shipped migration: a change is a new one, appended (the names are what databases in
the field have recorded). The schema is documented in docs/telemetry.md.

Example:
    applied = migrate(Database(sqlite3.connect("telemetry.db")))  # e.g. ["0004_stored_bytes"] on an upgrade
"""
from __future__ import annotations

import time
from collections.abc import Callable

from sqlite_utils import Database

# What a row costs beyond its JSON body (columns, rowid, two index entries), in bytes: the byte cap
# counts body + this, an estimate of the pages the row holds. Freed pages are reused, so the file stays
# near its high-water mark rather than growing past the cap.
ROW_OVERHEAD_BYTES = 64


def _m0001_records(db: Database) -> None:
    # AUTOINCREMENT: row ids never repeat, even after retention empties the table, so the outbox's
    # "after this id" cursor can never skip a new row.
    db.execute("""
        CREATE TABLE records (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            device_id TEXT NOT NULL,
            boot_id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            ts REAL NOT NULL,
            kind TEXT NOT NULL CHECK (kind IN ('request', 'sample', 'event')),
            body TEXT NOT NULL,
            sent INTEGER NOT NULL DEFAULT 0 CHECK (sent IN (0, 1)),
            sent_at REAL
        )""")
    db.execute("CREATE UNIQUE INDEX records_boot_seq ON records (boot_id, seq)")
    db.execute("CREATE INDEX records_unsent ON records (id) WHERE sent = 0")
    db.execute("CREATE INDEX records_ts ON records (ts)")


def _m0002_meta(db: Database) -> None:
    db.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)")
    db.execute("INSERT INTO meta (key, value) VALUES ('dropped_undelivered', 0), ('connections', 0)")


def _m0003_requests_view(db: Database) -> None:
    f = "json_extract(body, '$.request.figures.{}')".format
    db.execute(f"""
        CREATE VIEW requests AS SELECT
            id, device_id, boot_id, seq, ts, sent,
            json_extract(body, '$.request.model') AS model,
            json_extract(body, '$.request.version') AS version,
            {f('finish_reason')} AS finish_reason,
            {f('prompt_tokens')} AS prompt_tokens,
            {f('completion_tokens')} AS completion_tokens,
            {f('ttft_ms')} AS ttft_ms,
            {f('decode_tokens_per_s')} AS decode_tokens_per_s,
            {f('prefill_tokens_per_s')} AS prefill_tokens_per_s,
            {f('e2e_ms')} AS e2e_ms
        FROM records WHERE kind = 'request'""")


def _m0004_stored_bytes(db: Database) -> None:
    # The byte cap's measure, kept up to date by triggers in the same transactions as the rows: a sum over
    # the whole table at every retention pass costs ~60 ms at 100,000 rows, under the lock every finishing
    # request's append waits for. ROW_OVERHEAD_BYTES is written into the triggers: a new value needs a
    # migration that makes them again.
    size = "(length(CAST({}.body AS BLOB)) + " + str(ROW_OVERHEAD_BYTES) + ")"
    db.execute("INSERT INTO meta (key, value) SELECT 'stored_bytes', "
               f"COALESCE(SUM({size.format('records')}), 0) FROM records")
    add = "UPDATE meta SET value = value + {} WHERE key = 'stored_bytes';"
    sub = "UPDATE meta SET value = value - {} WHERE key = 'stored_bytes';"
    new, old = size.format("NEW"), size.format("OLD")
    db.execute(f"CREATE TRIGGER records_bytes_insert AFTER INSERT ON records BEGIN {add.format(new)} END")
    db.execute(f"CREATE TRIGGER records_bytes_delete AFTER DELETE ON records BEGIN {sub.format(old)} END")
    db.execute("CREATE TRIGGER records_bytes_update AFTER UPDATE OF body ON records BEGIN "
               f"{sub.format(old)} {add.format(new)} END")
    # the oldest delivered rows, found without walking the undelivered ones: a device offline at its cap
    # holds little else, and a pass would step through all of them (120,000 rows)
    db.execute("CREATE INDEX records_sent ON records (id) WHERE sent = 1")


def _m0005_requests_view_adapter(db: Database) -> None:
    # 0003's view, with the LoRA adapter a request ran with (NAME@VERSION; NULL for the base alone)
    view = next(row["sql"] for row in db.query("SELECT sql FROM sqlite_master WHERE name = 'requests'"))
    db.execute("DROP VIEW requests")
    db.execute(view.replace("AS version,", "AS version, json_extract(body, '$.request.adapter') AS adapter,", 1))


MIGRATIONS: list[tuple[str, Callable[[Database], None]]] = [
    ("0001_records", _m0001_records),
    ("0002_meta", _m0002_meta),
    ("0003_requests_view", _m0003_requests_view),
    ("0004_stored_bytes", _m0004_stored_bytes),
    ("0005_requests_view_adapter", _m0005_requests_view_adapter),
]


def migrate(db: Database) -> list[str]:
    """Apply the migrations this database lacks, in order; returns the names applied."""
    db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at REAL NOT NULL)")
    done = {row["name"] for row in db.query("SELECT name FROM migrations")}
    applied = []
    for name, step in MIGRATIONS:
        if name in done:
            continue
        with db.atomic():
            step(db)
            db.execute("INSERT INTO migrations (name, applied_at) VALUES (?, ?)", [name, time.time()])
        applied.append(name)
    return applied
