"""The read side of telemetry: summaries and percentiles, the CLI's table and JSON, a reader that never writes, the
documented queries, a read-only file system."""
from __future__ import annotations

import json
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from agent.link import reader as reader_module
from agent.service.cli import cli
from agent.link.reader import TelemetryReader
from agent.link.store import TelemetryStore
from agent.link.telemetry import DB_NAME, format_summary, parse_window, summary
from store_support import request


REPO = Path(__file__).resolve().parents[2]


def fill_requests(db_path: Path, now: float) -> TelemetryStore:
    store = TelemetryStore(db_path, "dev-1")
    rng = np.random.default_rng(0)
    for i in range(60):
        store.append(request(ttft_ms=float(rng.uniform(50, 500)), tps=float(rng.uniform(5, 30)),
                             reason="length" if i % 3 else "stop"), ts=now - 60 * i)
    store.append(request(model="other", version="fp32-bbbb", reason="cancelled"), ts=now - 10)
    store.append(request(reason="error"), ts=now - 10 * 86400)  # outside a day's window
    return store


def test_summary_gives_percentiles_by_model_version_and_hour_and_finish_reasons(db_path):
    now = 1_700_000_000.0  # 22:13:20 UTC
    store = fill_requests(db_path, now)
    result = summary(db_path.parent, since_s=86400, now=now)
    assert result["finish_reasons"] == {"length": 40, "stop": 20, "cancelled": 1}
    by = {(r["model"], r["hour"]): r for r in result["by_hour"]}
    assert sum(r["requests"] for r in result["by_hour"]) == 61 and by[("other", "2023-11-14T22:00Z")]["requests"] == 1
    rows = [json.loads(b)["request"]["figures"] for (b,) in store.db.execute(
        "SELECT body FROM records WHERE json_extract(body, '$.request.model') = 'smollm2' AND "
        "strftime('%H', ts, 'unixepoch') = '21'")]
    got = by[("smollm2", "2023-11-14T21:00Z")]
    assert got["requests"] == len(rows) == 60 - 14  # 22:13 back to 21:00 is 13 rows; the rest in 21:xx
    assert got["ttft_ms_p95"] == pytest.approx(np.percentile([r["ttft_ms"] for r in rows], 95))
    assert got["decode_tokens_per_s_p50"] == pytest.approx(np.percentile([r["decode_tokens_per_s"] for r in rows], 50))
    assert result["store"] == {"records": 62, "unsent": 62, "dropped_undelivered": 0}


def test_requests_without_a_token_count_in_no_ttft_or_speed_percentile(db_path):
    """A shed request (no token, ttft_ms 0) counted as a 0 ms TTFT and a 0 tok/s decode, so the
    more a device refused the faster it looked. A model with only such requests shows '-'."""
    now = 1_700_000_000.0
    store = TelemetryStore(db_path, "dev-1")
    for i in range(3):
        store.append(request(ttft_ms=400.0 + i, tps=20.0), ts=now - i)
    for i in range(5):
        store.append(request(ttft_ms=0.0, tps=0.0, reason="error", tokens=0), ts=now - 10 - i)
    store.append(request(model="shed", ttft_ms=0.0, tps=0.0, reason="error", tokens=0), ts=now - 20)
    result = summary(db_path.parent, since_s=3600, now=now)
    by = {r["model"]: r for r in result["by_hour"]}
    assert by["smollm2"]["requests"] == 8
    assert by["smollm2"]["ttft_ms_p50"] == 401.0 and by["smollm2"]["decode_tokens_per_s_p50"] == 20.0
    assert by["shed"]["ttft_ms_p50"] is None
    shed_line, = [line for line in format_summary(result).splitlines() if line.startswith("shed ")]
    assert shed_line.split()[-4:] == ["-", "-", "-", "-"]


def test_parse_window():
    assert [parse_window(w) for w in ("90s", "30m", "6h", "2d", "1.5h")] == [90, 1800, 21600, 172800, 5400]
    with pytest.raises(ValueError, match="unit"):
        parse_window("6 hours")
    with pytest.raises(ValueError, match="at most 100 years"):  # was an OverflowError further on
        parse_window("999999999999999999d")


def test_cli_telemetry_prints_a_table_and_json(db_path):
    import time

    fill_requests(db_path, time.time())
    out = CliRunner().invoke(cli, ["telemetry", "--state-dir", str(db_path.parent), "--since", "2h"])
    assert out.exit_code == 0, out.output
    assert "smollm2" in out.output and "finish reasons: length" in out.output
    out = CliRunner().invoke(cli, ["telemetry", "--state-dir", str(db_path.parent), "--since", "1d", "--json"])
    assert json.loads(out.output)["finish_reasons"]["stop"] == 20
    out = CliRunner().invoke(cli, ["telemetry", "--state-dir", str(db_path.parent / "nowhere")])
    assert out.exit_code == 1 and "no telemetry database" in out.output


def test_reader_does_not_write(db_path):
    TelemetryStore(db_path, "dev-1").append(request())
    reader = TelemetryReader(db_path)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.db.execute("DELETE FROM records")


def test_the_documented_queries_run(db_path):
    """Every `sqlite-utils query telemetry.db "..."` line in docs/telemetry.md works on a real store."""
    import time

    fill_requests(db_path, time.time()).close()
    lines = [line.strip() for line in (REPO / "docs" / "telemetry.md").read_text().splitlines()
             if line.strip().startswith("sqlite-utils query telemetry.db")]
    assert len(lines) >= 4
    exe = Path(sys.executable).parent / "sqlite-utils"
    for line in lines:
        args = shlex.split(line)
        done = subprocess.run([str(exe), *args[1:]], cwd=db_path.parent, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stderr)
        assert re.match(r"^\[", done.stdout.strip()), line


def test_the_reader_reads_a_database_on_a_read_only_file_system(tmp_path, monkeypatch):
    """`edge-agent telemetry` on a card remounted read-only said "not a telemetry database
    (unable to open database file)": SQLite cannot make the WAL index there. It reads the file as immutable
    then, and says how much of the WAL it could not read; anywhere else it reads as before (a user who may
    not write the directory still sees the WAL's rows)."""
    from agent.wire import EventRecord

    store = TelemetryStore(tmp_path / DB_NAME, "dev-1")
    store.append(EventRecord(kind="tick"))
    store.close()  # a clean stop: checkpointed, no -wal or -shm left
    running = TelemetryStore(tmp_path / DB_NAME, "dev-1")  # an agent killed (or running) with rows in its WAL
    for _ in range(3):
        running.append(EventRecord(kind="tick"))
    assert TelemetryReader(tmp_path / DB_NAME).counts()["records"] == 4  # writable: WAL and all
    real_open = reader_module._open_reading

    def as_on_a_read_only_disk(path, mode):
        if mode == "ro":  # what SQLite says there without the WAL index
            raise sqlite3.OperationalError("unable to open database file")
        return real_open(path, mode)

    monkeypatch.setattr(reader_module, "_open_reading", as_on_a_read_only_disk)
    monkeypatch.setattr(reader_module, "writable_dir", lambda d: Path(d) != tmp_path)
    result = summary(tmp_path, 3600)
    assert result["store"]["records"] == 1 and result["unread_wal_bytes"] > 0
    assert "not counted:" in format_summary(result)
    running.close()
    (tmp_path / "junk.db").write_bytes(b"not sqlite" * 100)
    with pytest.raises(ValueError, match="junk.db is not a telemetry database .on a read-only file system"):
        TelemetryReader(tmp_path / "junk.db")
