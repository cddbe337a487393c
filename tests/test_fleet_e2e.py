"""Two real agents (tiny model) and one fleet server over a real Mosquitto, restarted in the middle: the
fleet database ends with exactly the request records each agent committed, once each."""
from __future__ import annotations

import time

from processes import Agent, FleetServer, client, committed, wait


def ask(agent: Agent, n: int) -> None:
    with client(agent.sock) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": f"q{i}", "max_tokens": 3})
            assert r.status_code == 200


def test_fleet_holds_exactly_what_two_agents_committed_across_a_broker_restart(tiny_fp32_bundle, broker, tmp_path):
    fleet = FleetServer(tmp_path, broker.url)
    agents = [Agent(tmp_path, "--model", tiny_fp32_bundle.path, "--mqtt", broker.url, "--memory-budget-mb", 2048,
                    device_id=dev) for dev in ("dev-a", "dev-b")]
    try:
        for agent in agents:
            agent.start()
        for agent in agents:
            ask(agent, 10)
        broker.stop()  # mid-run: the agents keep serving and keep their records
        for agent in agents:
            ask(agent, 10)
        time.sleep(2)
        broker.start()
        for agent in agents:
            ask(agent, 10)
        for agent in agents:
            wait(lambda: set(fleet.stored(agent.device_id)) == set(committed(agent.telemetry_db)),
                 f"{agent.device_id}'s records in the fleet")
            assert len(committed(agent.telemetry_db)) == 30
            assert len(fleet.stored(agent.device_id)) == 30  # once each: replays after the reconnect were dropped
    finally:
        for agent in agents:
            agent.stop()
        fleet.stop()
