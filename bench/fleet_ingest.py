"""Fleet ingest throughput: simulated devices -> Mosquitto -> `edge-fleet serve` (1 or 2 replicas) -> SQLite or
PostgreSQL; with --table, issue #38's comparison: SQLite x1, PostgreSQL x1 and x2, each as a ratio to SQLite x1.

One configuration (a database, a number of replicas) runs on a fresh database with replicas of its own, against a
real Mosquitto and real `edge-fleet serve` processes (2 replicas: one --shared-group, each its own --client-id);
the broker and the devices serve the whole run:
  drain:     capacity: the replicas stop, the devices publish a BACKLOG of records that the broker queues in the
             replicas' persistent sessions, the replicas start and we time how fast the queue empties into the
             database, from the first replica's CONNACK to the last commit.
  sustained: DEVICES simulated devices each publish one QoS 1 TelemetryBatch of RATE records every second
             (staggered across devices) for DURATION s. A step sustains its rate when the backlog (records
             published and not yet committed, sampled every SAMPLE_EVERY_S) never exceeds one second's worth and
             the last record is committed within a second of the last publish. Without --rate, RATE starts at
             0.8 x the drain rate and steps up by --step until a step fails (down while the first ones fail),
             then tries the bracket's geometric middle; a later round (--rounds, the configurations
             interleaved) starts at the best so far, in steps of sqrt(--step). The figure is the highest
             offered rate sustained in any round.
Nothing may be lost: every record offered is counted in the database (through fleet.db, whichever it is) exactly
once, or the run stops with an error.
  CPU:       each step reads the CPU of the bench (the devices), the broker, the replicas, the PostgreSQL server and
             the rest of the machine from /proc (bench/fleet_cpu.py); the tables give it per record for each
             configuration's best sustained step, which says what limits it on a shared host.

Databases: `sqlite`, a file in the bench's temporary directory (every commit fsynced, synchronous=FULL);
`postgresql`, a throwaway PostgreSQL (tests/postgres.py) with its data directory beside that file and durability
on as in production (fsync, synchronous_commit: tests/postgres.py turns both off); `postgresql://URL`, a server
of yours on which the bench creates and drops a database per configuration (the URL's user needs CREATEDB).
The devices are paho clients in this process publishing payloads built from a pool of wire-valid records (a
small cost beside the consumers'); the consumers run in their own processes, so the figures are theirs, but on
one machine all of it (devices, broker, replicas, PostgreSQL) shares the CPUs: compare ratios from one run.

Run: .venv/bin/python bench/fleet_ingest.py --table --rounds 3       # the comparison, ~10 min on 2 cores
     .venv/bin/python bench/fleet_ingest.py --db postgresql --replicas 2
     .venv/bin/python bench/fleet_ingest.py --db sqlite --rate 10 --duration 30    # one step: 2,000 records/s
     add --write-docs to put what it prints in docs/benchmarks.md
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "fleet"), str(REPO / "bench")]

import paho.mqtt.client as paho
from benchdocs import machine, replace_section, stamp
from broker import Broker
from fleet_cpu import CpuMeter, cpu_table
from fleet_devices import BenchDevice, offered, start_devices, stop_devices

from fleet.db import Database, describe, is_url, open_database
from fleet.store import TELEMETRY_TABLES

# Let the consumer's session queue a whole backlog (Mosquitto's default max_queued_messages, 1000, silently
# drops messages beyond it, see docs/scaling.md).
BROKER_CONFIG = "allow_anonymous true\nmax_queued_messages 1000000\n"
MAX_BACKLOG_S = 1.0  # issue #38's bar: backlog under a second's worth of records, last commit within a second
# backlog sampling period: each sample counts the step's rows (PostgreSQL: ~20 ms of server CPU at 200,000 rows,
# SQLite ~3 ms), CPU the consumers then lack on a small host
SAMPLE_EVERY_S = 0.5
SETTLE_S = 60.0  # after the last publish, records still missing after this are lost
DRAIN_TIMEOUT_S = 300.0
# tests/postgres.py's server with durability back on: the SQLite file's commits are fsynced, so these are too
BENCH_PG_OPTIONS = ("fsync=on", "synchronous_commit=on", "full_page_writes=on", "listen_addresses=127.0.0.1")
TABLE = (("sqlite", 1), ("postgresql", 1), ("postgresql", 2))  # --table's rows; the first is the ratios' base
TITLE = "## Fleet ingest (bench/fleet_ingest.py)"  # docs/benchmarks.md's section (--write-docs)


@dataclass
class Sustained:
    devices: int
    offered_per_s: float  # records/s the devices actually published
    stored: int
    produced: int
    stored_per_s: float  # records committed / (last commit - first publish)
    max_backlog: int  # records published but not yet in the database, at worst
    tail_s: float  # last publish -> last record committed
    rate: float = 0.0  # records/s per device asked for
    cpu: dict[str, float] = field(default_factory=dict)  # party -> CPU s over the step (bench/fleet_cpu.py)
    cpu_wall_s: float = 0.0  # the step's wall time those were read over

    @property
    def is_sustained(self) -> bool:
        return (self.stored == self.produced and self.tail_s <= MAX_BACKLOG_S
                and self.max_backlog <= self.offered_per_s * MAX_BACKLOG_S)


@dataclass
class Drain:
    backlog: int
    stored_per_s: float
    split: list[int]  # records each replica stored (its summary line), to show the broker shared the queue


@dataclass
class Result:
    """One configuration in one round."""

    label: str
    drain: Drain | None
    steps: list[Sustained]
    summaries: list[str]

    @property
    def best(self) -> Sustained | None:
        return max((s for s in self.steps if s.is_sustained), key=lambda s: s.offered_per_s, default=None)


# ---- the database -------------------------------------------------------------------------------------------
class StoredCount:
    """Telemetry rows in a fleet database (SQLite path or postgresql:// URL), read through fleet.db; with since_ts,
    only those stamped since then (each table's ts index: a step's count costs its own rows, not the whole
    table's, which polled every 20 ms took CPU from the consumers as the tables grew)."""

    def __init__(self, target: str | Path, since_ts: float = 0.0):
        self.db: Database = open_database(target, readonly=True)
        self.since_ts = since_ts
        self.sql = "select " + " + ".join(f"(select count(*) from {t} where ts >= ?)" for t in TELEMETRY_TABLES)

    def __call__(self) -> int:
        return self.db.execute(self.sql, [self.since_ts] * len(TELEMETRY_TABLES)).fetchone()[0]

    def close(self) -> None:
        self.db.close()


def stored_count(db: str | Path) -> int:
    if not is_url(db) and not Path(db).exists():
        return 0
    count = StoredCount(db)
    try:
        return count()
    finally:
        count.close()


class Databases:
    """A fresh fleet database per configuration: a SQLite file in `tmp`, or a new database on a PostgreSQL
    server (one of tests/postgres.py's, started on first use, or the server `url` names)."""

    def __init__(self, tmp: Path, url: str | None = None):
        self.tmp, self.url = tmp, url
        self.server = None  # tests/postgres.py's Postgres
        self.created: list[str] = []  # databases made on `url`'s server, dropped at close()
        self.made = 0

    def fresh(self, kind: str) -> str:
        self.made += 1
        if kind == "sqlite":
            return str(self.tmp / f"fleet-{self.made}.db")
        if self.url:
            return self._create_on_url(f"fleet_bench_{os.getpid()}_{self.made}")
        if self.server is None:
            self.server = start_postgres(self.tmp / "postgres")
        return self.server.fresh_database()

    def _create_on_url(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f'create database "{name}"')
        self.created.append(name)
        parts = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit(parts._replace(path=f"/{name}"))

    def close(self) -> None:
        if self.created:
            import psycopg

            with psycopg.connect(self.url, autocommit=True) as conn:
                for name in self.created:
                    conn.execute(f'drop database if exists "{name}" with (force)')
        if self.server is not None:
            self.server.stop()


def start_postgres(workdir: Path):
    """tests/postgres.py's throwaway server, on disk beside the SQLite files, durable (BENCH_PG_OPTIONS)."""
    import postgres

    postgres.SERVER_OPTIONS = BENCH_PG_OPTIONS  # read by Postgres.start(); nothing else runs one in this process
    workdir.parent.chmod(0o755)  # the postgres user must reach its workdir: TemporaryDirectory makes it 0o700
    return postgres.Postgres(workdir).start()


# ---- edge-fleet serve ---------------------------------------------------------------------------------------
class Serve:
    """One `edge-fleet serve` process; returns once it has connected to the broker."""

    def __init__(self, url: str, db: str | Path, log: Path, client_id: str = "fleet-bench",
                 shared_group: str | None = None, wait: bool = True):
        self.log = log
        self.offset = log.stat().st_size if log.exists() else 0  # "connected to" from an earlier run is not ours
        argv = [sys.executable, "-m", "fleet.cli", "serve", "--mqtt", url, "--db", str(db), "--client-id", client_id]
        self.proc = subprocess.Popen(argv + (["--shared-group", shared_group] if shared_group else []), cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=open(log, "ab"), text=True)
        if wait:
            self.wait_connected()

    def is_connected(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"edge-fleet serve exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
        with open(self.log, "rb") as f:
            f.seek(self.offset)
            return b"connected to" in f.read()

    def wait_connected(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_connected():
            if time.monotonic() > deadline:
                raise RuntimeError(f"edge-fleet serve did not connect: {self.log.read_text()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=90)
        return out.strip()


class Replicas:
    """n `edge-fleet serve` processes on one database; two or more share the telemetry (--shared-group `name`).
    Client ids `name`-0, `name`-1...: each configuration its own, so that none takes over another's session."""

    def __init__(self, url: str, db: str, n: int, logs: Path, name: str):
        self.url, self.db, self.n, self.logs, self.name = url, db, n, logs, name
        self.client_ids = [f"{name}-{i}" for i in range(n)]
        self.running: list[Serve] = []

    def start(self) -> float:
        """Start them all at once; returns (monotonic) when the first had connected, once all have."""
        group = self.name if self.n > 1 else None
        self.logs.mkdir(parents=True, exist_ok=True)
        self.running = [Serve(self.url, self.db, self.logs / f"{client_id}.log", client_id, group, wait=False)
                        for client_id in self.client_ids]
        first, waiting = None, list(self.running)
        deadline = time.monotonic() + 60
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError(f"edge-fleet serve did not connect: see {self.logs}")
            waiting = [r for r in waiting if not r.is_connected()]
            if first is None and len(waiting) < self.n:
                first = time.monotonic()
            time.sleep(0.02)
        return first

    def stop(self) -> list[str]:
        for serve in self.running:  # all signalled before any is waited for: they flush together
            serve.proc.send_signal(signal.SIGTERM)
        summaries = [serve.proc.communicate(timeout=90)[0].strip() for serve in self.running]
        self.running = []
        return summaries

    def kill(self) -> None:
        """After a failure: none outlives the run (a leftover reconnects to its broker's port for ever)."""
        for serve in self.running:
            serve.proc.kill()
            serve.proc.wait()
        self.running = []


def end_session(port: int, client_id: str) -> None:
    """Discard a finished configuration's session, or the broker queues every later message for it: a CONNECT
    with Clean Start and no Session Expiry Interval (0) ends it at the DISCONNECT (MQTT v5 3.1.2.4, 3.1.2.11.2)."""
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
    connected = threading.Event()
    client.on_connect = lambda *_: connected.set()
    client.connect("127.0.0.1", port, clean_start=True)
    client.loop_start()
    try:
        if not connected.wait(30):
            raise RuntimeError(f"could not connect as {client_id} to end its session")
    finally:
        client.disconnect()
        client.loop_stop()


def wait_stored(count: StoredCount, target: int, timeout_s: float, poll_s: float = 0.05) -> int:
    """Polls until `target` rows are stored or the time is up; returns the rows stored."""
    deadline = time.monotonic() + timeout_s
    while (stored := count()) < target and time.monotonic() < deadline:
        time.sleep(poll_s)
    return stored


# ---- measurements -------------------------------------------------------------------------------------------
def publish_paced(devices: list[BenchDevice], rate: float, duration_s: float, batch_interval_s: float) -> float:
    """Each device sends rate * batch_interval_s records every batch_interval_s, device i offset by
    i / n of the interval. Returns the time the first batch went out."""
    per_batch = max(1, round(rate * batch_interval_s))
    ticks = int(duration_s / batch_interval_s)
    start = time.monotonic() + 0.1
    for k in range(ticks):
        for i, device in enumerate(devices):
            delay = start + (k + i / len(devices)) * batch_interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            device.emit(per_batch)
    return start


def sample_backlog(devices: list[BenchDevice], count: StoredCount, base: int, stop: threading.Event,
                   worst: list[int]) -> None:
    """worst[0]: the most records published and not yet stored. Counted first, offered read after: an
    overestimate by what is published meanwhile, never an underestimate."""
    while not stop.wait(SAMPLE_EVERY_S):
        stored = count()
        worst[0] = max(worst[0], offered(devices) - base - stored)


def measure_sustained(devices: list[BenchDevice], db: str | Path, rate: float, duration_s: float,
                      batch_interval_s: float = 1.0, settle_s: float = SETTLE_S) -> Sustained:
    count = StoredCount(db, since_ts=time.time())  # devices stamp records with this clock when they emit them
    try:
        already, before = count(), offered(devices)
        stop, worst = threading.Event(), [0]
        sampler = threading.Thread(target=sample_backlog, args=(devices, count, before - already, stop, worst))
        sampler.start()
        try:
            first = publish_paced(devices, rate, duration_s, batch_interval_s)
            last_publish = time.monotonic()
            produced = offered(devices) - before
            stored = wait_stored(count, already + produced, settle_s) - already
        finally:
            stop.set()
            sampler.join()
    finally:
        count.close()
    done = time.monotonic()
    return Sustained(devices=len(devices), offered_per_s=produced / (last_publish - first), stored=stored,
                     produced=produced, stored_per_s=stored / (done - first), max_backlog=worst[0],
                     tail_s=done - last_publish, rate=rate)


def queue_backlog(devices: list[BenchDevice], backlog: int, batch_records: int) -> int:
    """Publish about `backlog` records and wait until the broker has them all (every PUBACK in); returns how many."""
    batches = max(1, backlog // (batch_records * len(devices)))
    for _ in range(batches):
        for device in devices:
            device.emit(batch_records)
    while any(d.unacked for d in devices):
        time.sleep(0.05)
    return batches * batch_records * len(devices)


def measure_drain(replicas: Replicas, devices: list[BenchDevice], backlog: int, batch_records: int = 10) -> Drain:
    """With the replicas stopped (their sessions kept by the broker), queue a backlog, start them and time it."""
    count = StoredCount(replicas.db, since_ts=time.time())
    try:
        already = count()
        total = queue_backlog(devices, backlog, batch_records)
        started = replicas.start()
        stored = wait_stored(count, already + total, DRAIN_TIMEOUT_S) - already
    finally:
        count.close()
    if stored != total:
        raise RuntimeError(f"drain: {stored} of {total} queued records stored after {DRAIN_TIMEOUT_S:g} s")
    elapsed_s = time.monotonic() - started
    split = [int(line.split("stored ")[1].split()[0]) for line in replicas.stop()]
    return Drain(backlog=total, stored_per_s=total / elapsed_s, split=split)


def step_rates(devices: list[BenchDevice], db: str, first_rate: float, factor: float, refine: int, args,
               label: str, meter: CpuMeter) -> list[Sustained]:
    """Sustained steps from first_rate (records/s per device), up by `factor` while they sustain, down while they
    do not, until a sustained rate and the next one up that is not bracket the limit; then `refine` more steps,
    each at the geometric middle of the bracket. At most args.max_steps."""
    steps: list[Sustained] = []
    passed, failed, rate = None, None, first_rate  # the bracket: highest sustained, lowest not sustained
    while len(steps) < args.max_steps:
        s = step(devices, db, rate, args, label, meter)
        steps.append(s)
        if s.is_sustained:
            passed = max(passed or 0.0, rate)
        else:
            failed = min(failed or float("inf"), rate)
        if args.rate:
            break
        if passed is None or failed is None:
            rate = max(1.0, round(rate * factor if s.is_sustained else rate / factor))
            continue
        middle = round((passed * failed) ** 0.5)
        if refine <= 0 or middle in (passed, failed):
            break
        refine, rate = refine - 1, middle
    return steps


def step(devices: list[BenchDevice], db: str, rate: float, args, label: str, meter: CpuMeter) -> Sustained:
    before, started = meter.read(), time.monotonic()
    s = measure_sustained(devices, db, rate, args.duration)
    s.cpu, s.cpu_wall_s = CpuMeter.spent(before, meter.read()), time.monotonic() - started
    print(f"  {label}: {s.offered_per_s:,.0f} records/s offered, backlog <= {s.max_backlog}, tail "
          f"{s.tail_s:.2f} s: {'sustained' if s.is_sustained else 'NOT sustained'}", file=sys.stderr)
    if s.stored != s.produced:
        raise RuntimeError(f"{label}: lost {s.produced - s.stored} of {s.produced} records")
    return s


def run_configuration(kind: str, n_replicas: int, name: str, databases: Databases, broker: Broker,
                      devices: list[BenchDevice], work: Path, args, earlier: list[Result]) -> Result:
    """One row of the table in one round, on a fresh database and replicas of its own (`name`: their client ids
    and group): the drain first, then the sustained steps, from 0.8 x the drain rate or from the best of an
    earlier round (`earlier`)."""
    label = label_of(kind, n_replicas)
    base = offered(devices)
    db = databases.fresh(kind)
    replicas = Replicas(broker.url, db, n_replicas, work / name, name)
    try:
        replicas.start()  # creates the database and the replicas' sessions
        warm_up(devices, db, base)
        summaries = replicas.stop()
        drain = measure_drain(replicas, devices, args.backlog) if args.backlog else None
        if drain:
            print(f"  {label}: drained {drain.stored_per_s:,.0f} records/s (replicas: "
                  f"{' + '.join(map(str, drain.split))})", file=sys.stderr)
        replicas.start()
        meter = CpuMeter({"devices": [os.getpid()], "broker": [broker.proc.pid],
                          "replicas": [r.proc.pid for r in replicas.running]}
                         | ({"postgresql": [databases.server.proc.pid]} if kind != "sqlite" and databases.server else {}))
        if any(r.best for r in earlier):  # a later round: from the best so far, in the last round's fine steps
            steps = step_rates(devices, db, first_rate(args, drain, earlier), args.step ** 0.5, 0, args, label, meter)
        else:
            steps = step_rates(devices, db, first_rate(args, drain, earlier), args.step, args.refine, args, label,
                               meter)
        summaries += replicas.stop()
        check_exactly_once(db, offered(devices) - base, label)
    finally:
        replicas.kill()
        for client_id in replicas.client_ids:
            end_session(broker.port, client_id)
    return Result(label, drain, steps, summaries)


def first_rate(args, drain: Drain | None, earlier: list[Result]) -> float:
    """records/s per device of the first sustained step."""
    best = max((r.best.offered_per_s for r in earlier if r.best), default=None)
    if args.rate or not (best or drain):
        return args.rate or 10.0
    return round((best if best else args.start * drain.stored_per_s) / args.devices)


def warm_up(devices: list[BenchDevice], db: str, base: int) -> None:
    """One record per device, all stored (the database is fresh; `base` records were offered before it): every
    replica is subscribed before the drain queues for it."""
    count = StoredCount(db)
    try:
        for device in devices:
            device.emit(1)
        if wait_stored(count, offered(devices) - base, 30) < offered(devices) - base:
            raise RuntimeError("warm-up records were not stored within 30 s")
    finally:
        count.close()


def check_exactly_once(db: str, total_offered: int, label: str) -> None:
    """Rows are unique on (device_id, boot_id, seq) and the database was fresh: equal counts mean each once."""
    stored = stored_count(db)
    if stored != total_offered:
        raise RuntimeError(f"{label}: {stored} records stored, {total_offered} offered")


# ---- output -------------------------------------------------------------------------------------------------
def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def best_sustained(rounds: list[Result]) -> float | None:
    return max((r.best.offered_per_s for r in rounds if r.best), default=None)


def best_drain(rounds: list[Result]) -> float | None:
    return max((r.drain.stored_per_s for r in rounds if r.drain), default=None)


def best_table(by_label: dict[str, list[Result]]) -> str:
    """Best of the rounds (noise on a shared host only ever slows a run), each round's figure beside it."""
    base = next(iter(by_label.values()))
    lines = ["| configuration | sustained records/s | x SQLite x1 | drain records/s | x SQLite x1 | sustained, each "
             "round | drain, each round |", "|---|--:|--:|--:|--:|---|---|"]
    for label, rounds in by_label.items():
        sustained, drain = best_sustained(rounds), best_drain(rounds)
        each = " / ".join(f"{r.best.offered_per_s:,.0f}" if r.best else "-" for r in rounds)
        drains = " / ".join(f"{r.drain.stored_per_s:,.0f}" if r.drain else "-" for r in rounds)
        lines.append(f"| {label} | {sustained or 0:,.0f} | {ratio(sustained, best_sustained(base))} | "
                     f"{drain or 0:,.0f} | {ratio(drain, best_drain(base))} | {each} | {drains} |")
    return "\n".join(lines)


def steps_table(by_label: dict[str, list[Result]]) -> str:
    lines = ["| configuration | round | offered records/s | stored records/s | max backlog | tail s | sustained |",
             "|---|--:|--:|--:|--:|--:|---|"]
    for label, rounds in by_label.items():
        for i, r in enumerate(rounds, 1):
            for s in sorted(r.steps, key=lambda s: s.offered_per_s):
                lines.append(f"| {label} | {i} | {s.offered_per_s:,.0f} | {s.stored_per_s:,.0f} | {s.max_backlog} | "
                             f"{s.tail_s:.2f} | {'yes' if s.is_sustained else 'no'} |")
    return "\n".join(lines)


def cpu_text(by_label: dict[str, list[Result]]) -> str:
    """Where the CPU went in each configuration's best sustained step (the highest rate the machine kept up with)."""
    rows = []
    for label, rounds in by_label.items():
        best = max((r.best for r in rounds if r.best), key=lambda s: s.offered_per_s, default=None)
        if best and best.cpu:
            rows.append((label, best.stored, best.cpu_wall_s, best.cpu))
    return ("CPU of the best sustained step, per record stored and as a share of all CPUs over the step:\n\n"
            + cpu_table(rows))


def label_of(kind: str, n_replicas: int) -> str:
    return f"{'SQLite' if kind == 'sqlite' else 'PostgreSQL'} x{n_replicas}"


def configurations(args) -> list[tuple[str, int]]:
    if args.table:
        return list(TABLE)
    return [("sqlite" if args.db == "sqlite" else "postgresql", args.replicas)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="sqlite", help="sqlite, postgresql (a throwaway server) or postgresql://URL "
                                                       "(a server to create a database per configuration on)")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=1)
    parser.add_argument("--table", action="store_true", help="SQLite x1, PostgreSQL x1, PostgreSQL x2 "
                                                             "(--db: which PostgreSQL)")
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--rate", type=float, default=None, help="records/s per device: one step at this rate "
                                                                 "(default: step to the highest sustained)")
    parser.add_argument("--start", type=float, default=0.8, help="first step's offered rate / the drain rate")
    parser.add_argument("--step", type=float, default=1.3, help="rate factor between steps")
    parser.add_argument("--refine", type=int, default=1, help="steps halving the bracket once found (first round)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of load per step")
    parser.add_argument("--backlog", type=int, default=60_000, help="records for the drain test (0: skip)")
    parser.add_argument("--rounds", type=int, default=1, help="run every configuration this many times, "
                                                              "interleaved; the tables give the best (default 1)")
    parser.add_argument("--write-docs", action="store_true", help=f"replace docs/benchmarks.md's {TITLE!r} with "
                                                                  "what this run prints (default: print only)")
    args = parser.parse_args()
    if args.db not in ("sqlite", "postgresql") and not is_url(args.db):
        parser.error(f"--db {args.db!r}: expected sqlite, postgresql or a postgresql:// URL")
    if args.table and args.db == "sqlite":
        args.db = "postgresql"
    return args


def main() -> None:
    args = parse_args()
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    by_label: dict[str, list[Result]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        databases = Databases(tmp, args.db if is_url(args.db) else None)
        broker = Broker(tmp / "broker", extra_config=BROKER_CONFIG).start()
        devices: list[BenchDevice] = []
        try:  # one broker and one set of devices for the whole run: a fresh database and replicas per configuration
            devices = start_devices(broker.port, args.devices, broker_log=broker.workdir / "mosquitto.log")
            for i in range(args.rounds):
                for j, (kind, n) in enumerate(configurations(args)):
                    rounds = by_label.setdefault(label_of(kind, n), [])
                    rounds.append(run_configuration(kind, n, f"fleet-bench-{i}{j}", databases, broker, devices,
                                                    tmp, args, rounds))
        finally:
            stop_devices(devices)
            broker.stop()
            databases.close()
    pg = describe(args.db) if is_url(args.db) else "a throwaway PostgreSQL 15 (fsync on)"
    parts = [f"{args.devices} devices, one QoS 1 batch each per second, {args.duration:g} s per step, {args.rounds} "
             f"round(s); drain of a {args.backlog:,}-record backlog; SQLite fsynced, {pg}; {os.cpu_count()} CPUs; "
             f"{time.strftime('%Y-%m-%d', time.gmtime())}, {time.monotonic() - started:.0f} s",
             best_table(by_label), cpu_text(by_label), steps_table(by_label)]
    for label, rounds in by_label.items():
        drains = [" + ".join(map(str, r.drain.split)) for r in rounds if r.drain]
        parts.append(f"{label}: drain per replica {', '.join(drains) or '-'}; consumers, last round: "
                     + "; ".join(s.splitlines()[-1] for s in rounds[-1].summaries if s))
    print("\n\n".join(parts))
    if args.write_docs:
        command = " ".join([".venv/bin/python bench/fleet_ingest.py", *sys.argv[1:]])
        replace_section(TITLE, f"{TITLE}\n\nCommand: `{command}`\nRun: {stamp()} at the end, "
                               f"{load_at_start:.2f} at the start. Machine: {machine()}.\n\n"
                               + "\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
