"""Rollout waves and the failure-rate halt, as pure decisions."""
from __future__ import annotations

from dataclasses import replace

from fleet.rollout import decide, plan_waves
from rollout_support import F, P, S


def states(devices, **by_id):
    return [replace(d, state=by_id.get(d.device_id, d.state)) for d in devices]


def test_waves_start_one_after_another():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    d = decide(devs, set(), 0.5)
    assert d.notify == ["a", "b"] and d.job_state is P
    d = decide(states(devs, a=P, b=P), {"a", "b"}, 0.5)
    assert d.notify == [] and d.job_state is P  # wave 0 still running
    d = decide(states(devs, a=S, b=S), {"a", "b"}, 0.5)
    assert d.notify == ["c", "d"]
    d = decide(states(devs, a=S, b=S, c=S, d=S), {"a", "b", "c", "d"}, 0.5)
    assert d.job_state is S


def test_halts_when_failures_exceed_the_rate():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    d = decide(states(devs, a=F, b=S), {"a", "b"}, max_failure_rate=0.2)
    assert d.job_state is F and d.cancel == ["c", "d"] and "1 of 2 devices started failed" in d.reason


def test_the_rate_counts_the_devices_started_so_far_not_the_whole_fleet():
    """Found in review: a first wave of 2 that failed entirely let a 20-device rollout go on at a 25% limit."""
    devs = plan_waves([f"dev-{i:02d}" for i in range(20)], wave_size=2)
    d = decide(states(devs, **{"dev-00": F, "dev-01": F}), {"dev-00", "dev-01"}, max_failure_rate=0.25)
    assert d.job_state is F and d.notify == [] and len(d.cancel) == 18


def test_a_failure_within_the_rate_lets_the_next_wave_start_once_the_wave_ended():
    devs = plan_waves(["a", "b", "c", "d"], wave_size=2)
    assert decide(states(devs, a=F, b=P), {"a", "b"}, max_failure_rate=0.5).notify == []
    d = decide(states(devs, a=F, b=S), {"a", "b"}, max_failure_rate=0.5)
    assert d.job_state is P and d.notify == ["c", "d"]
    d = decide(states(devs, a=F, b=S, c=S, d=S), {"a", "b", "c", "d"}, max_failure_rate=0.5)
    assert d.job_state is F and "1 of 4" in d.reason
