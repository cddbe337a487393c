"""The read side of the telemetry database, for `edge-agent telemetry`: read-only queries, never a write.

A reader opens telemetry.db read-only beside a running agent (WAL readers do not block its writer) and
returns plain rows: requests per model, version and hour, finish reasons, record counts. On a read-only file
system, where SQLite cannot make the WAL index, it reads the file as immutable and says how many WAL bytes
it could not see.

Example:
    reader = TelemetryReader(Path("/var/lib/edge-agent/telemetry.db"))
    reader.counts()  # {"records": ..., "unsent": ..., "dropped_undelivered": ...}
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

from sqlite_utils import Database

from agent.link.store import BUSY_TIMEOUT_S, writable_dir


def _open_reading(path: Path, mode: str) -> Database:
    """A read-only connection to a telemetry database; sqlite3.DatabaseError if it is not one."""
    db = Database(sqlite3.connect(f"file:{path}?mode={mode}", uri=True, timeout=BUSY_TIMEOUT_S))
    try:
        if "records" not in db.table_names():
            raise sqlite3.DatabaseError("no records table")
    except sqlite3.DatabaseError:
        db.close()
        raise
    return db


class TelemetryReader:
    """Read-only queries over a telemetry.db (the agent may be writing it meanwhile: WAL readers don't block)."""

    def __init__(self, path: Path):
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"no telemetry database at {path}")
        self.unread_wal_bytes = 0
        try:
            self.db = _open_reading(path, "ro")
        except sqlite3.DatabaseError as e:  # "file is not a database" named no file
            # On a read-only file system SQLite cannot make the WAL index a reader needs ("unable to open
            # database file", which is not "not a telemetry database"): read it as immutable
            # there, which sees what was checkpointed (all of it after a clean stop) and not what the WAL
            # still holds (an agent killed, or running, when the disk failed), which is said.
            if writable_dir(path.parent) or not isinstance(e, sqlite3.OperationalError):
                raise ValueError(f"{path} is not a telemetry database ({e})") from None
            wal = path.with_name(path.name + "-wal")
            self.unread_wal_bytes = wal.stat().st_size if wal.exists() else 0
            try:
                self.db = _open_reading(path, "ro&immutable=1")
            except sqlite3.DatabaseError as e:
                unread = f"; its {wal.name} cannot be read there" if self.unread_wal_bytes else ""
                raise ValueError(f"{path} is not a telemetry database (on a read-only file system: {e}{unread})"
                                 ) from None

    def request_rows(self, since_ts: float) -> list[dict]:
        """One row per request since since_ts: model, version, hour (UTC), ttft_ms, decode_tokens_per_s,
        completion_tokens."""
        return list(self.db.query(
            "SELECT model, version, strftime('%Y-%m-%dT%H:00Z', ts, 'unixepoch') AS hour, ttft_ms, "
            "decode_tokens_per_s, completion_tokens FROM requests WHERE ts >= ? ORDER BY model, version, hour", [since_ts]))

    def finish_reasons(self, since_ts: float) -> dict[str, int]:
        return {row["finish_reason"]: row["n"] for row in self.db.query(
            "SELECT finish_reason, count(*) AS n FROM requests WHERE ts >= ? GROUP BY finish_reason "
            "ORDER BY n DESC", [since_ts])}

    def counts(self) -> dict[str, int]:
        row = next(self.db.query("SELECT count(*) AS records, COALESCE(SUM(sent = 0), 0) AS unsent FROM records"))
        dropped = next(self.db.query("SELECT value FROM meta WHERE key = 'dropped_undelivered'"))["value"]
        return {**row, "dropped_undelivered": dropped}

    def close(self) -> None:
        self.db.close()
