"""Nothing is lost between an agent and the fleet, over real processes (Mosquitto, `edge-fleet serve`,
`edge-agent serve` on the tiny model) under steady load:

- the broker stopped for 60 s and restarted, three times: the fleet database ends with exactly one row per
  request the agent served;
- the agent SIGKILLed at random moments ten times and restarted: it always comes back ready on its verified
  model, both SQLite databases pass `PRAGMA integrity_check`, every record the agent committed reaches the
  fleet exactly once.
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from processes import Agent, FleetServer, client, committed, integrity, wait

OUTAGES, OUTAGE_S, UP_S = 3, 60.0, 10.0
KILLS = 10
CRASH_SEED = 20261202



class Load:
    """Clients sending short completions until stopped; an agent that is down is retried, not a failure."""

    def __init__(self, sock: Path, clients: int = 4):
        self.sock, self.stop_event = sock, threading.Event()
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        n = 0
        while not self.stop_event.is_set():
            n += 1
            try:
                with client(self.sock, timeout_s=30) as c:
                    r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"client {i} request {n}",
                                                        "max_tokens": 4, "ignore_eos": True})
            except httpx.TransportError:  # killed, restarting, or not yet listening
                self.counts["unreachable"] += 1
                time.sleep(0.2)
                continue
            if r.status_code == 200:
                self.counts["answered"] += 1
            elif r.status_code == 503:  # loading after a restart, or draining
                self.counts["not ready"] += 1
                time.sleep(0.2)
            else:
                self.failures.append(f"{r.status_code}: {r.text[:200]}")
            time.sleep(0.05)

    def stop(self) -> Counter:
        self.stop_event.set()
        for t in self.threads:
            t.join(60)
        assert not self.failures, self.failures[:5]
        return self.counts


def delivered_once(agent: Agent, fleet: FleetServer, timeout_s: float = 120) -> int:
    """Wait until the fleet holds exactly the agent's committed request records, each once; their number."""
    wait(lambda: set(fleet.stored(agent.device_id)) == set(committed(agent.telemetry_db)),
         "every committed record in the fleet", timeout_s, every_s=1.0)
    stored = fleet.stored(agent.device_id)
    assert len(stored) == len(set(stored)), "a record was stored twice"
    return len(stored)


def test_three_sixty_second_broker_outages_lose_nothing(tiny_fp32_bundle, broker, tmp_path, figures):
    fleet = FleetServer(tmp_path, broker.url)
    # Reconnect delays capped at 5 s rather than the default 120 s, so the test does not wait minutes for them.
    config = tmp_path / "agent.toml"
    config.write_text(f'[telemetry.mqtt]\nurl = "{broker.url}"\nbackoff_max_s = 5\n')
    agent = Agent(tmp_path, "--model", tiny_fp32_bundle.path, "--config", config, "--memory-budget-mb", 2048)
    try:
        agent.start()
        load = Load(agent.sock)
        time.sleep(UP_S)
        for _ in range(OUTAGES):
            broker.stop()
            time.sleep(OUTAGE_S)
            broker.start()
            time.sleep(UP_S)
        counts = load.stop()
        n = delivered_once(agent, fleet)
        assert n == counts["answered"]  # every request served, once (nothing was killed: answered = committed)
        assert agent.stop() == 0
        fleet.stop()
        assert integrity(agent.telemetry_db) == "ok" and integrity(fleet.db) == "ok"
        figures.append(f"broker outage: {OUTAGES} x {OUTAGE_S:.0f} s down under load; {counts['answered']} "
                       f"requests served, {n} rows in the fleet database, each once")
    finally:
        agent.stop()
        fleet.stop()


def test_ten_sigkills_under_load_lose_no_committed_record(tiny_fp32_bundle, broker, tmp_path, figures):
    rng = random.Random(CRASH_SEED)
    fleet = FleetServer(tmp_path, broker.url)
    agent = Agent(tmp_path, "--mqtt", broker.url, "--memory-budget-mb", 2048)
    version = tiny_fp32_bundle.manifest.version
    try:
        # the first boot names the model; every restart after a kill boots what the store holds, verified
        assert agent.start("--model", tiny_fp32_bundle.path)["version"] == version
        load = Load(agent.sock)
        boots = 1
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.5, 5.0))  # a random moment: mid-request, mid-commit, mid-publish
            agent.kill()
            assert agent.start()["version"] == version  # back, ready, on the verified model
            boots += 1
        time.sleep(3)
        counts = load.stop()
        n = delivered_once(agent, fleet)
        assert agent.stop() == 0
        fleet.stop()
        records = committed(agent.telemetry_db)
        assert len(records) == n >= counts["answered"]  # a record is committed before its answer is sent
        boot_ids = {boot for boot, _ in records}
        assert integrity(agent.telemetry_db) == "ok" and integrity(fleet.db) == "ok"
        figures.append(f"crashes: {KILLS} SIGKILLs under load (seed {CRASH_SEED}), {boots} boots all ready on "
                       f"the verified model; {counts['answered']} answered, {len(records)} committed in "
                       f"{len(boot_ids)} boots, {n} in the fleet each once; integrity_check ok on both databases")
    finally:
        agent.stop()
        fleet.stop()
