"""Fleet ingest throughput: simulated devices -> Mosquitto -> `edge-fleet serve` -> SQLite.

Two measurements, both against a real Mosquitto and the real `edge-fleet serve` in its own process:
  sustained: DEVICES simulated devices each produce RATE records/s for DURATION s, publishing one QoS 1
             TelemetryBatch every BATCH_INTERVAL s (staggered across devices); we watch the database fill
             and report the stored rate, the largest backlog (records published but not yet committed)
             and how long after the last publish the last record was committed. Nothing may be lost.
  drain:     capacity: the consumer is stopped, the devices publish a BACKLOG of records that the broker
             queues in the consumer's persistent session, then the consumer starts and we time how fast it
             empties the queue into the database.
The devices are tests/fleet/simdevice.py's (plain paho clients); they run in this process, the consumer
does not, so the figure is the consumer's own.

Run: .venv/bin/python bench/fleet_ingest.py [--devices 200] [--rate 10] [--duration 30] [--backlog 60000]
"""
from __future__ import annotations

import argparse
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "fleet")]

from broker import Broker  # noqa: E402
from simdevice import SimDevice  # noqa: E402

# Let the consumer's session queue a whole backlog (Mosquitto's default max_queued_messages, 1000, silently
# drops messages beyond it, see docs/scaling.md).
BROKER_CONFIG = "allow_anonymous true\nmax_queued_messages 1000000\n"


@dataclass
class Sustained:
    devices: int
    offered_per_s: float  # records/s the devices actually published
    stored: int
    produced: int
    stored_per_s: float  # records committed / (last commit - first publish)
    max_backlog: int  # records published but not yet in the database, at worst
    tail_s: float  # last publish -> last record committed


@dataclass
class Drain:
    backlog: int
    stored_per_s: float


def stored_count(db: Path) -> int:
    if not db.exists():
        return 0
    conn = sqlite3.connect(db, timeout=30)
    try:
        return sum(conn.execute(f"select count(*) from {t}").fetchone()[0] for t in ("requests", "samples", "events"))
    except sqlite3.OperationalError:  # tables not created yet
        return 0
    finally:
        conn.close()


class Serve:
    def __init__(self, url: str, db: Path, log: Path):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "serve", "--mqtt", url, "--db", str(db),
                                      "--client-id", "fleet-bench"], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=open(log, "a"), text=True)
        deadline = time.monotonic() + 30
        while "connected to" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"edge-fleet serve did not connect: {log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return out.strip()


def start_devices(port: int, n: int) -> list[SimDevice]:
    devices = [SimDevice(port, f"sim-{i:04d}", seed=i, answer_commands=False).start() for i in range(n)]
    for device in devices:
        device.wait_connected(30)
    return devices


def stop_devices(devices: list[SimDevice]) -> None:
    for device in devices:
        device.client.disconnect()
    for device in devices:
        device.client.loop_stop()


def publish_paced(devices: list[SimDevice], rate: float, duration_s: float, batch_interval_s: float, db: Path,
                  on_tick=None) -> float:
    """Each device sends rate * batch_interval_s records every batch_interval_s, device i offset by
    i / n of the interval. Returns the time the first batch went out."""
    per_batch = max(1, round(rate * batch_interval_s))
    ticks = int(duration_s / batch_interval_s)
    start = time.monotonic() + 0.1
    for k in range(ticks):
        for i, device in enumerate(devices):
            due = start + (k + i / len(devices)) * batch_interval_s
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            device.emit(per_batch)
        if on_tick:
            on_tick()
    return start


def measure_sustained(devices: list[SimDevice], db: Path, rate: float, duration_s: float,
                      batch_interval_s: float = 1.0, settle_s: float = 60.0) -> Sustained:
    backlog = [0]

    def sample() -> None:
        produced = sum(len(d.produced) for d in devices)
        backlog[0] = max(backlog[0], produced - stored_count(db))

    already = stored_count(db)
    first = publish_paced(devices, rate, duration_s, batch_interval_s, db, on_tick=sample)
    last_publish = time.monotonic()
    offered_s = last_publish - first
    produced = sum(len(d.produced) for d in devices)
    deadline = last_publish + settle_s
    while (stored := stored_count(db) - already) < produced and time.monotonic() < deadline:
        time.sleep(0.05)
    done = time.monotonic()
    return Sustained(devices=len(devices), offered_per_s=produced / offered_s, stored=stored, produced=produced,
                     stored_per_s=stored / (done - first), max_backlog=backlog[0], tail_s=done - last_publish)


def measure_drain(url: str, devices: list[SimDevice], db: Path, log: Path, backlog: int,
                  batch_records: int = 10) -> Drain:
    """Stop the consumer, queue `backlog` records in its session, restart it and time the drain."""
    Serve(url, db, log).stop()  # creates the session (if this is the first run) and leaves it
    already = stored_count(db)
    batches = max(1, backlog // (batch_records * len(devices)))
    for _ in range(batches):
        for device in devices:
            device.emit(batch_records)
    while any(d.unacked for d in devices):  # every batch is with the broker
        time.sleep(0.05)
    total = batches * batch_records * len(devices)
    serve = Serve(url, db, log)  # returns once it is connected: the queued messages start flowing
    started = time.monotonic()
    while stored_count(db) - already < total:
        time.sleep(0.02)
    elapsed = time.monotonic() - started
    serve.stop()
    return Drain(backlog=total, stored_per_s=total / elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=200)
    parser.add_argument("--rate", type=float, default=10.0, help="records/s per device")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of sustained load")
    parser.add_argument("--batch-interval", type=float, default=1.0, help="seconds between a device's batches")
    parser.add_argument("--backlog", type=int, default=60_000, help="records for the drain test (0: skip)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        broker = Broker(tmp / "broker", extra_config=BROKER_CONFIG).start()
        db, log = tmp / "fleet.db", tmp / "serve.log"
        try:
            serve = Serve(broker.url, db, log)
            devices = start_devices(broker.port, args.devices)
            s = measure_sustained(devices, db, args.rate, args.duration, args.batch_interval)
            summary = serve.stop()
            drain = measure_drain(broker.url, devices, db, log, args.backlog) if args.backlog else None
            stop_devices(devices)
        finally:
            broker.stop()
    print(f"{s.devices} devices x {args.rate:g} records/s x {args.duration:g} s, one batch per device every "
          f"{args.batch_interval:g} s\n")
    print("| measurement | records | records/s | notes |\n|---|--:|--:|---|")
    print(f"| offered by the devices | {s.produced} | {s.offered_per_s:,.0f} | |")
    print(f"| sustained ingest | {s.stored} | {s.stored_per_s:,.0f} | max backlog {s.max_backlog} records, "
          f"last record committed {s.tail_s:.2f} s after the last publish; lost {s.produced - s.stored} |")
    if drain:
        print(f"| drain of a queued backlog | {drain.backlog} | {drain.stored_per_s:,.0f} | timed from the "
              f"consumer's CONNACK to the last commit |")
    print(f"\nconsumer: {summary}")


if __name__ == "__main__":
    main()
