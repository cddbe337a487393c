"""200 simulated devices x 10 records/s x 30 s through Mosquitto into `edge-fleet serve`: nothing lost, and the
consumer keeps up with 2,000 records/s on this machine. bench/fleet_ingest.py does the measuring (and adds
a drain test of a queued backlog); this runs its sustained part and prints the figures."""
from __future__ import annotations

import importlib.util
import sys

from fleet_support import REPO

DEVICES, RATE, DURATION_S = 200, 10.0, 30.0


def load_bench():
    spec = importlib.util.spec_from_file_location("fleet_ingest", REPO / "bench" / "fleet_ingest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_200_devices_at_10_records_per_s_lose_nothing(tmp_path, capsys):
    bench = load_bench()
    broker = bench.Broker(tmp_path / "broker", extra_config=bench.BROKER_CONFIG).start()
    db = tmp_path / "fleet.db"
    devices = []
    try:
        serve = bench.Serve(broker.url, db, tmp_path / "serve.log")
        devices = bench.start_devices(broker.port, DEVICES)
        s = bench.measure_sustained(devices, db, RATE, DURATION_S)
        summary = serve.stop()
    finally:
        bench.stop_devices(devices)
        broker.stop()
    with capsys.disabled():
        print(f"\n{DEVICES} devices x {RATE:g} rec/s x {DURATION_S:g} s: offered {s.offered_per_s:,.0f} rec/s, "
              f"ingested {s.stored_per_s:,.0f} rec/s, max backlog {s.max_backlog} records, "
              f"tail {s.tail_s:.2f} s; {summary}")
    assert s.produced == DEVICES * RATE * DURATION_S
    assert s.stored == s.produced, f"lost {s.produced - s.stored} records"
    assert s.offered_per_s > 0.95 * DEVICES * RATE, "the simulated devices could not keep their pace"
    assert s.stored_per_s > 0.95 * DEVICES * RATE
    assert s.tail_s < 5 and s.max_backlog < 2 * DEVICES * RATE, "the consumer fell behind"
