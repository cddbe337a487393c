"""What the device's and the fleet's MQTT links share (agent.mqtt_link): states, backoff, broker URLs.

Pure: no broker, no paho. The links' own behaviour against a real Mosquitto is in tests/agent/test_mqtt_*.py
and tests/fleet/test_mqtt.py.

Run: .venv/bin/pytest tests/agent/test_mqtt_link.py -q
"""
from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from agent.mqtt_link import (STABLE_CONNECTION_S, TRANSITIONS, Backoff, Endpoint, LinkError, LinkState,
                             LinkStateMachine, backoff_delay_s, parse_url)

REPO = Path(__file__).resolve().parents[2]


def test_the_shared_module_needs_no_paho():
    code = 'import sys; sys.modules["paho"] = None; import agent.mqtt_link, agent.config'
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ---- states -----------------------------------------------------------------------------------------------
def test_a_link_moves_only_along_the_table():
    link = LinkStateMachine()
    assert link.state is LinkState.IDLE and not link.is_connected
    assert not link.can_move(LinkState.CONNECTED) and not link._move(LinkState.CONNECTED)
    assert link.state is LinkState.IDLE
    for to in (LinkState.CONNECTING, LinkState.CONNECTED, LinkState.BACKOFF, LinkState.CONNECTING):
        assert link._move(to) and link.state is to
    assert link._move(LinkState.CONNECTED) and link.is_connected


@pytest.mark.parametrize("start", [s for s in LinkState if s not in (LinkState.STOPPING, LinkState.STOPPED)])
def test_stopping_is_reachable_from_every_running_state_and_final(start):
    link = LinkStateMachine()
    link._state = start
    assert link._move(LinkState.STOPPING)
    assert [to for to in LinkState if link.can_move(to)] == [LinkState.STOPPED]
    assert link._move(LinkState.STOPPED)
    assert not any(link.can_move(to) for to in LinkState) and TRANSITIONS[LinkState.STOPPED] == set()


# ---- backoff ----------------------------------------------------------------------------------------------
def test_backoff_doubles_up_to_the_cap_with_jitter():
    rng = random.Random(1)
    for attempt in range(12):
        cap = min(8.0, 0.5 * 2 ** attempt)
        delays = [backoff_delay_s(attempt, 0.5, 8.0, rng) for _ in range(50)]
        assert all(cap / 2 <= d <= cap for d in delays) and len(set(delays)) > 1
    assert backoff_delay_s(10_000, 0.5, 8.0, rng) <= 8.0  # no overflow on a long outage


@pytest.mark.parametrize("first_attempt", [0, 1])
def test_backoff_starts_over_only_after_a_connection_that_lasted(first_attempt):
    backoff = Backoff(1.0, 1000.0, random.Random(2), first_attempt=first_attempt)
    caps = []
    for lasted_s in (0.0, 0.0, STABLE_CONNECTION_S - 1, 0.0, STABLE_CONNECTION_S, 0.0):
        caps.append(2 ** backoff.attempt)
        delay_s = backoff.next_delay_s(lasted_s)
        cap = 1.0 if lasted_s >= STABLE_CONNECTION_S else caps[-1]
        assert cap / 2 <= delay_s <= cap
    # a short connection (one the broker accepted and dropped at once) does not reset the count
    assert backoff.attempt == 2


# ---- broker URLs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, endpoint", [("mqtt://broker.lan:1884", Endpoint("broker.lan", 1884)),
                                           ("mqtt://10.0.0.2", Endpoint("10.0.0.2", 1883)),
                                           ("mqtts://broker.lan", Endpoint("broker.lan", 8883, tls=True))])
def test_urls(url, endpoint):
    assert parse_url(url) == endpoint


@pytest.mark.parametrize("url", ["http://broker", "broker:1883", "mqtt://", "mqtt://h:notaport", "mqtt://h/x"])
def test_bad_urls(url):
    with pytest.raises(LinkError, match="bad broker URL"):
        parse_url(url)


def test_port_zero_is_refused():
    with pytest.raises(LinkError, match="bad broker URL 'mqtt://h:0': port 0"):
        parse_url("mqtt://h:0")
