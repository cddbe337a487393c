"""Rollout policy for model updates: waves of devices, the next wave only after the current one succeeded,
and a halt when failures pass the allowed rate. Pure: it reads device job states and says what to do.

A job's devices are split into waves of `wave_size` in the order given. A wave has succeeded when all its
devices have ended and the failures so far are within `max_failure_rate`; only then does the next start.
Job states:
    IN_PROGRESS -> SUCCEEDED (every device SUCCEEDED)
                -> FAILED    (failures / devices started so far > max_failure_rate: the rollout halts,
                              devices not yet notified are CANCELED)
"""
from __future__ import annotations

from dataclasses import dataclass

from agent.wire import TERMINAL_JOB_STATES, JobState

FAILURES = frozenset({JobState.FAILED, JobState.REJECTED, JobState.TIMED_OUT})


@dataclass(frozen=True)
class DeviceJob:
    device_id: str
    wave: int
    state: JobState  # QUEUED until the fleet notifies the device; then what the device reports


@dataclass(frozen=True)
class Decision:
    notify: list[str]  # devices whose wave starts now: send them the job document
    cancel: list[str]  # devices never notified, because the rollout halted
    job_state: JobState  # IN_PROGRESS, SUCCEEDED or FAILED
    reason: str | None = None


def plan_waves(devices: list[str], wave_size: int) -> list[DeviceJob]:
    if wave_size < 1:
        raise ValueError("wave size must be at least 1")
    return [DeviceJob(d, i // wave_size, JobState.QUEUED) for i, d in enumerate(devices)]


def decide(devices: list[DeviceJob], notified: set[str], max_failure_rate: float) -> Decision:
    """What to do next, given each device's state and which devices were already sent the job."""
    started = [d for d in devices if d.device_id in notified]
    failed = [d for d in started if d.state in FAILURES]
    if started and len(failed) / len(started) > max_failure_rate:  # of those started: a failed first wave halts
        waiting = [d.device_id for d in devices if d.device_id not in notified]
        return Decision([], waiting, JobState.FAILED,
                        f"{len(failed)} of {len(started)} devices started failed "
                        f"(max failure rate {max_failure_rate:.0%})")
    if all(d.state is JobState.SUCCEEDED for d in devices):
        return Decision([], [], JobState.SUCCEEDED)
    if all(d.state in TERMINAL_JOB_STATES for d in devices):
        return Decision([], [], JobState.FAILED, f"{len(failed)} of {len(devices)} devices did not succeed")
    # the current wave is the first with a device still in flight; it starts once every earlier wave has
    # ended (its failures, if any, within the rate: otherwise we halted above)
    current = min((d.wave for d in devices if d.state not in TERMINAL_JOB_STATES), default=None)
    earlier_done = all(d.state in TERMINAL_JOB_STATES for d in devices if current is not None and d.wave < current)
    if current is None or not earlier_done:
        return Decision([], [], JobState.IN_PROGRESS)
    start = [d.device_id for d in devices if d.wave == current and d.device_id not in notified]
    return Decision(start, [], JobState.IN_PROGRESS)
