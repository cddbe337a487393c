"""A telemetry store whose file cannot be written: said once, retention waits its interval, the rows not yet
delivered go on in memory."""
from __future__ import annotations

import sqlite3
from pathlib import Path

from agent.link import store as store_module
from agent.config import TelemetryConfig
from agent.link.store import TelemetryStore
from agent.link.telemetry import DB_NAME, Telemetry
from agent.wire import RequestFigures


def test_a_store_that_cannot_be_written_is_said_once_and_retention_waits_its_interval(tmp_path, caplog):
    """On a card remounted read-only: a traceback for every request recorded, and a failed
    retention pass retried every second, each with a traceback (~86,000 a day)."""
    import time

    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    passes = []

    def read_only(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    def failing_pass(*args, **kwargs):
        passes.append(time.monotonic())
        raise sqlite3.OperationalError("disk I/O error")

    store.append_all, store.enforce = read_only, failing_pass
    telemetry = Telemetry(store, TelemetryConfig(state_dir=tmp_path, sample_interval_s=600, retention_interval_s=1))
    figures = RequestFigures(prompt_tokens=5, completion_tokens=3, queue_ms=1, ttft_ms=2, prefill_tokens_per_s=3,
                             decode_tokens_per_s=4, itl_p50_ms=5, itl_p95_ms=6, e2e_ms=7, kv_bytes=8,
                             finish_reason="stop")
    for _ in range(50):
        telemetry.record_request("m", "v", figures)
    telemetry.start()
    time.sleep(3.5)
    telemetry._stop.set()
    telemetry._thread.join()
    said = sorted(r.getMessage() for r in caplog.records if r.name == "agent.link.telemetry" and r.levelname == "ERROR")
    assert len(said) == 2 and "could not be stored" in said[0] and "retention failed" in said[1], said
    assert not any(r.exc_info for r in caplog.records) and store.dropped_total >= 50

    def too_big(*args, **kwargs):
        raise ValueError("a request record of 300000 bytes exceeds the limit")

    store.append_all = too_big  # another kind of failure, not hidden by the first's hour
    telemetry.record_request("m", "v", figures)
    assert sum("could not be stored" in r.getMessage() for r in caplog.records) == 2
    assert 2 <= len(passes) <= 4, passes  # once a retention interval (1 s here), not at every 1 s wake-up only


def test_a_store_whose_disk_goes_read_only_goes_on_in_memory_with_its_undelivered_rows(tmp_path, monkeypatch):
    """When the card went read-only under a running agent, every record after that was
    dropped and the fleet never learned why. The store moves to memory with the file's undelivered rows (their
    ids kept: the outbox names them) and the fleet gets a store_in_memory event."""
    from sqlite_utils import Database

    from agent.wire import EventRecord

    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    telemetry = Telemetry(store, TelemetryConfig(state_dir=tmp_path))
    for i in range(5):
        store.append(EventRecord(kind="tick", detail={"i": i}))
    first_two = [r.row_id for r in store.unsent(2)]
    store.mark_sent(first_two)
    top = store.unsent(10)[-1].row_id
    # the card goes read-only: the connection can still read, every write fails
    store.db.close()
    store.db = Database(sqlite3.connect(f"file:{tmp_path / DB_NAME}?mode=ro", uri=True, check_same_thread=False))
    monkeypatch.setattr(store_module, "writable_dir", lambda d: Path(d) != tmp_path)
    telemetry.record_event("after", {})
    assert store.in_memory_because is not None
    rows = store.unsent(50)
    kinds = [(r.record.event.kind, r.record.event.detail.get("i")) for r in rows]
    assert kinds == [("tick", 2), ("tick", 3), ("tick", 4), ("store_in_memory", None), ("after", None)]
    assert [r.row_id for r in rows[:3]] == [first_two[-1] + 1, first_two[-1] + 2, top] and rows[3].row_id > top
    store.mark_sent([r.row_id for r in rows])
    assert store.count_unsent() == 0 and store.dropped_total == 0


def test_writable_dir_makes_a_file_to_know(tmp_path, monkeypatch):
    """access(2) says W_OK on ext4 remounted read-only after an error ("emergency_ro")."""
    import errno
    import os

    assert store_module.writable_dir(tmp_path) and list(tmp_path.iterdir()) == []  # the probe is gone
    real_open = os.open

    def failing(path, flags, *args):
        if str(path).startswith(str(tmp_path)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", failing)
    monkeypatch.setattr(os, "access", lambda *a, **k: True)  # as on emergency_ro
    assert not store_module.writable_dir(tmp_path)
