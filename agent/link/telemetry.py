"""Telemetry wiring for the serving agent: records requests, samples the process and the engine, keeps retention.

`Telemetry.open(config)` builds the store (state_dir/telemetry.db), the MQTT link when a broker is
configured (without one the agent just keeps records) and the command handler. Serve wiring calls
`start()`, `bind_engine(engine)` once the model is loaded, `record_request(...)` for every finished
request, and `stop()` on shutdown. A sampler thread appends a SampleRecord every sample_interval_s and
runs retention every retention_interval_s. `summary()` is the read side of `edge-agent telemetry`.

Example:
    telemetry = Telemetry.open(config, describe=lambda: {"model": "smollm2", "version": "int4-..."})
    telemetry.start(); telemetry.bind_engine(engine)
    telemetry.record_request("smollm2", "int4-...", finished.figures)
"""
from __future__ import annotations

import logging
import os
import re
import socket
import sqlite3
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import ValidationError

from agent.link.commands import BenchmarkArgs, CommandError, Commands, Device, LiveSettings, run_benchmark
from agent.config import AgentConfig, TelemetryConfig
from agent.process import rss_bytes
from agent.link.reader import TelemetryReader
from agent.link.store import RetentionReport, StoreFull, TelemetryStore, max_file_bytes
from agent.figures import decode_speed_samples, percentile, ttft_samples
from agent.wire import EventRecord, RequestFigures, RequestRecord, SampleRecord

if TYPE_CHECKING:
    from agent.link.mqtt import MqttLink

log = logging.getLogger(__name__)

DB_NAME = "telemetry.db"
MB = 1 << 20
# Samples are committed this many at a time (a minute's at the default interval): each commit is an fsync of
# ~5 pages, and one per sample would write ~250 MB a day to an idle box's SD card. A crash loses at most these.
SAMPLES_PER_COMMIT = 6
FAILURE_LOG_EVERY_S = 3600.0  # records that cannot be stored are logged at most this often while it lasts


class EngineProbe(Protocol):
    """What the sampler reads from the engine (agent.engine.engine.Engine has these)."""

    num_running: int
    num_waiting: int

    def kv_utilization(self) -> float: ...


def default_device_id() -> str:
    """This host's name, made a valid device id (wire.DEVICE_ID_PATTERN)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()).lstrip("-_.")[:64]
    return name or "device"


class _CpuMeter:
    """CPU use of this process between two reads, in percent of one core (os.times: user + system)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._last = self._read()

    def _read(self) -> tuple[float, float]:
        t = os.times()
        return self.clock(), t.user + t.system

    def percent(self) -> float:
        (wall0, cpu0), (wall1, cpu1) = self._last, self._read()
        self._last = (wall1, cpu1)
        return 100.0 * (cpu1 - cpu0) / (wall1 - wall0) if wall1 > wall0 else 0.0


class Telemetry:
    def __init__(self, store: TelemetryStore, config: TelemetryConfig, link: MqttLink | None = None):
        self.store, self.config, self.link = store, config, link
        self.settings = LiveSettings()
        self._engine: EngineProbe | None = None
        self._tokens = 0  # completion tokens of requests recorded since the last sample
        self._tokens_lock = threading.Lock()
        self._steps_told = 0  # store.clock_steps already recorded as events (under _tokens_lock)
        self._pending_samples: list[tuple[SampleRecord, float]] = []  # (sample, uptime when taken): sampler thread
        self._failures_logged: dict[str, float] = {}  # kind of failure -> when it was last logged
        self._unnamed: set[tuple[str, str]] = set()  # (model, version) whose requests RequestRecord refuses
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._full_logged_at = -float("inf")

    @classmethod
    def open(cls, config: AgentConfig, describe: Callable[[], dict] = dict,
             rollback: Callable[[], dict] | None = None) -> "Telemetry":
        """The store under config.telemetry.state_dir, plus the MQTT link and its command handler if a broker
        is configured. describe() returns DeviceState's optional fields (model, version, hardware, ...);
        rollback() queues a rollback job for the `rollback` command (agent.link.commands.Device.rollback)."""
        tc = config.telemetry
        device_id = tc.device_id or default_device_id()
        store = TelemetryStore(Path(tc.state_dir) / DB_NAME, device_id, max_file_bytes=max_file_bytes(tc.max_bytes))
        telemetry = cls(store, tc)
        if tc.mqtt is not None:
            from agent.link.mqtt import MqttLink  # paho only when a broker is configured

            commands = Commands(Device(config, telemetry.settings, benchmark=telemetry._benchmark,
                                       flush=telemetry.flush, rollback=rollback))
            telemetry.link = MqttLink(tc.mqtt, device_id, telemetry.store, describe=describe, handler=commands)
        return telemetry

    # ---- called by the serve wiring ----
    def start(self) -> None:
        self.record_event("start", {"pid": os.getpid()})
        if self.store.recovered_from is not None:  # the fleet learns that earlier undelivered records were set aside
            self.record_event("store_recovered", {"corrupt_file": str(self.store.recovered_from)})
        if self.store.in_memory_because is not None:  # the fleet learns that the device's disk is full
            self.record_event("store_in_memory", {"reason": self.store.in_memory_because})
        if self.link is not None:
            self.link.start()
        self._thread = threading.Thread(target=self._run, name="telemetry-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._commit_samples()
        self.record_event("stop", {})
        if self.link is not None:
            self.link.flush(wait_s=1.0)  # best effort: what is not delivered now goes after the next start
            self.link.stop()
        self.store.close()

    def bind_engine(self, engine: EngineProbe) -> None:
        self._engine = engine

    def record_request(self, model: str, version: str, figures: RequestFigures, adapter: str | None = None) -> None:
        with self._tokens_lock:
            self._tokens += figures.completion_tokens
        try:
            record = RequestRecord(model=model, version=version, figures=figures, adapter=adapter)
        except ValidationError as e:  # a bundle named before names were checked: the fleet would refuse it
            if (model, version) not in self._unnamed:  # said once per model, not per request
                self._unnamed.add((model, version))
                log.warning("telemetry: requests to %r@%r are not recorded: %s (rebuild the bundle with "
                            "edge-quantize build --name)", model, version, e.errors(include_url=False)[0]["msg"])
            return
        self._append(record)

    def record_event(self, kind: str, detail: dict) -> None:
        try:
            event = EventRecord(kind=kind, detail=detail)
        except ValidationError as e:  # a NaN figure, say: the fleet would refuse it, and telemetry never raises
            log.warning("telemetry: a %r event cannot be recorded: %s", kind, e.errors(include_url=False)[0]["msg"])
            return
        self._append(event)

    def flush(self, wait_s: float = 5.0) -> dict:
        if self.link is None:
            return {"unsent": self.store.count_unsent(), "connected": False}
        return self.link.flush(wait_s)

    def _append(self, body) -> None:
        """Commit one record, never raising: telemetry must not fail the request it describes."""
        self._append_all([(body, 0.0)])

    def _append_all(self, items: list[tuple[object, float]]) -> None:
        """Commit (record, age in seconds) pairs in one transaction, never raising."""
        try:
            self._commit(items)
        except StoreFull:
            self.store.count_unwritten(len(items))  # the next retention pass reports them as a dropped_rows event
            return
        except (sqlite3.Error, ValueError) as e:  # damaged file, read-only disk, a record over the batch limit
            if isinstance(e, sqlite3.Error) and self.store.move_to_memory(e):  # the disk went read-only
                self.record_event("store_in_memory", {"reason": self.store.in_memory_because})
                self._append_all(items)
                return
            self.store.count_unwritten(len(items))  # lost, and said so
            self._say_failure(f"{len(items)} record(s) could not be stored (counted as dropped)", e)
            return
        self._tell_clock_steps()
        if self.link is not None:
            self.link.notify()

    def _tell_clock_steps(self) -> None:
        """A step the store found (NTP setting the clock) becomes an event, and the device's state is published
        again: its retained birth was stamped by the wrong clock, and a fleet that reads it after a restart
        ranks it against the previous boot's states by that stamp (a birth behind them showed the device
        offline until it next connected)."""
        with self._tokens_lock:
            steps = self.store.clock_steps[self._steps_told:]
            self._steps_told += len(steps)
        for step in steps:
            self.record_event("clock_step", {"step_s": round(step, 3)})
        if steps and self.link is not None:
            self.link.publish_state()

    def _commit(self, items: list[tuple[object, float]]) -> None:
        try:
            self.store.append_all(items)  # committed before anything tries to send them
        except StoreFull:
            # The file's hard limit (or the disk) is full: make room now, not at the next retention pass,
            # and try once more; a disk that stays full drops the records (counted).
            before = self.store.stored_bytes()
            self.enforce_retention()
            if self.store.stored_bytes() >= before:
                raise  # nothing could be freed: the disk itself is full
            self.store.append_all(items)

    def _benchmark(self, spec: BenchmarkArgs) -> RequestFigures:
        if self._engine is None:
            raise CommandError("the model is still loading")
        return run_benchmark(self._engine, spec)

    # ---- the sampler thread ----
    def _run(self) -> None:
        cpu = _CpuMeter()
        last_sample = last_retention = time.monotonic()
        while not self._stop.wait(min(self.config.sample_interval_s, self.config.retention_interval_s, 1.0)):
            now = time.monotonic()
            try:
                if now - last_sample >= self.config.sample_interval_s:
                    self._pending_samples.append((self.sample(now - last_sample, cpu.percent()), self.store.uptime()))
                    last_sample = now
                    if len(self._pending_samples) >= SAMPLES_PER_COMMIT:
                        self._commit_samples()
                if now - last_retention >= self.config.retention_interval_s:
                    last_retention = now  # a pass that fails waits for the next interval, not the next second
                    self.enforce_retention()  # (a read-only card fails every pass)
            except (sqlite3.Error, OSError) as e:  # a full or read-only disk, a locked database: keep sampling
                self._say_failure("sampling or retention failed", e)
            except Exception:
                log.exception("telemetry: sampling or retention failed")

    def _say_failure(self, what: str, e: Exception) -> None:
        """Log a failure once an hour while it lasts (a card gone read-only fails every request and every
        retention pass), each kind of failure on its own clock, so that one does
        not hide the first of another; a traceback only for what is not SQLite's or the OS's own report."""
        kind = f"{what.lstrip('0123456789 ')}|{type(e).__name__}|{e}"[:200]  # a count in `what` is not the kind
        now = time.monotonic()
        if now - self._failures_logged.get(kind, -float("inf")) < FAILURE_LOG_EVERY_S:
            return
        if len(self._failures_logged) >= 64:  # bounded: the oldest kinds are forgotten
            del self._failures_logged[min(self._failures_logged, key=self._failures_logged.get)]
        self._failures_logged[kind] = now
        log.error("telemetry: %s: %s (said again in an hour if it goes on)", what, e,
                  exc_info=not isinstance(e, (sqlite3.OperationalError, OSError)))

    def _commit_samples(self) -> None:
        """Samples taken since the last commit, stamped by when each was taken (by the time since boot, so a
        clock step meanwhile moves them too)."""
        pending, self._pending_samples = self._pending_samples, []
        if pending:
            now = self.store.uptime()
            self._append_all([(sample, now - taken) for sample, taken in pending])

    def sample(self, interval_s: float, cpu_percent: float) -> SampleRecord:
        with self._tokens_lock:
            tokens, self._tokens = self._tokens, 0
        engine = self._engine
        return SampleRecord(interval_s=interval_s, rss_mb=rss_bytes() / MB, cpu_percent=cpu_percent,
                            kv_utilization=engine.kv_utilization() if engine else 0.0,
                            queue_depth=engine.num_waiting if engine else 0,
                            running=engine.num_running if engine else 0,
                            tokens_per_s=tokens / interval_s if interval_s > 0 else 0.0)

    def enforce_retention(self) -> RetentionReport | None:
        """One retention pass; None when the disk is too full for it (said in the log, once a pass interval)."""
        try:
            report = self.store.enforce(self.config.max_age_s, self.config.max_bytes)
        except StoreFull:
            now = time.monotonic()
            if now - self._full_logged_at >= self.config.retention_interval_s:
                self._full_logged_at = now
                log.warning("telemetry: the disk is full: %d records dropped so far (lifetime)",
                            self.store.dropped_total)
            return None
        if report.dropped_undelivered:
            # both causes in one count, so the message names both: a full disk's refusals are not the byte cap's
            log.warning("telemetry: dropped %d undelivered records, deleted to stay under max_bytes (%d) or "
                        "refused by a full disk", report.dropped_undelivered, self.config.max_bytes)
            if self.link is not None:
                self.link.notify()
        return report


# ---- the read side: `edge-agent telemetry` -----------------------------------------------------------------
_WINDOW = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(text: str) -> float:
    """'90s', '30m', '6h', '2d' -> seconds."""
    m = _WINDOW.match(text.strip())
    if not m:
        raise ValueError(f"--since must be a number and a unit (s, m, h or d), e.g. 30m or 6h; got {text!r}")
    seconds = float(m.group(1)) * _UNIT_S[m.group(2)]
    if seconds > 100 * 365 * 86400:  # past it, the arithmetic on times overflows
        raise ValueError(f"--since is at most 100 years; got {text!r}")
    return seconds


def summary(state_dir: Path, since_s: float, now: float | None = None) -> dict:
    """Speed and latency by model, version and hour, and request counts by finish reason, over a window."""
    reader = TelemetryReader(Path(state_dir) / DB_NAME)
    since_ts = (time.time() if now is None else now) - since_s
    try:
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for row in reader.request_rows(since_ts):
            groups[(row["model"], row["version"], row["hour"])].append(row)
        return {"since_s": since_s, "by_hour": [_figures(key, rows) for key, rows in groups.items()],
                "finish_reasons": reader.finish_reasons(since_ts), "store": reader.counts(),
                "unread_wal_bytes": reader.unread_wal_bytes}
    finally:
        reader.close()


def _figures(key: tuple, rows: list[dict]) -> dict:
    tps, ttft = decode_speed_samples(rows), ttft_samples(rows)
    return {"model": key[0], "version": key[1], "hour": key[2], "requests": len(rows),
            "decode_tokens_per_s_p50": percentile(tps, 50), "decode_tokens_per_s_p95": percentile(tps, 95),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p95": percentile(ttft, 95)}


def _cell(x: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"  # None: no request in the hour had one


def format_summary(s: dict) -> str:
    lines = [f"{'model':<24} {'version':<22} {'hour (UTC)':<18} {'reqs':>5} {'tok/s p50':>10} {'p95':>8} "
             f"{'TTFT ms p50':>12} {'p95':>8}"]
    for r in s["by_hour"]:
        lines.append(f"{r['model']:<24} {r['version']:<22} {r['hour']:<18} {r['requests']:>5} "
                     f"{_cell(r['decode_tokens_per_s_p50'], 10, 1)} {_cell(r['decode_tokens_per_s_p95'], 8, 1)} "
                     f"{_cell(r['ttft_ms_p50'], 12, 0)} {_cell(r['ttft_ms_p95'], 8, 0)}")
    reasons = ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items()) or "none"
    st = s["store"]
    lines.append(f"finish reasons: {reasons}")
    if s.get("unread_wal_bytes"):
        lines.append(f"not counted: {s['unread_wal_bytes']} bytes of records in telemetry.db-wal, which a read-only "
                     "file system keeps from being read (they are once the agent starts on it writable)")
    lines.append(f"store: {st['records']} records, {st['unsent']} not yet delivered, "
                 f"{st['dropped_undelivered']} dropped undelivered (lifetime)")
    return "\n".join(lines)
