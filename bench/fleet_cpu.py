"""Where bench/fleet_ingest.py's CPU goes: the CPU seconds of each party of a step, read from /proc (Linux).

Parties: the bench process itself (the simulated devices' paho threads, the payloads, the backlog sampler), the
broker, the replicas (`edge-fleet serve`), the PostgreSQL server (postmaster, its backends and workers), and the
rest of the machine (other jobs on a shared host), the machine's busy time from /proc/stat less the parties'.
A process tree's CPU is every live member's user + system time plus what its members reaped (cutime, cstime: a
backend that exited is counted in the postmaster's), so nothing is lost between two readings.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
OTHER = "other work"


def _children() -> dict[int, list[int]]:
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            found.setdefault(ppid, []).append(int(entry.name))
    return found


def _cpu_s(pid: int, reaped: bool) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # fields[11:15]: utime, stime, cutime, cstime (proc(5), counting from the state field)
    return sum(int(f) for f in fields[11:15 if reaped else 13]) * TICK_S


def tree_cpu_s(root: int, children: dict[int, list[int]]) -> float:
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += _cpu_s(pid, reaped=True)
        todo += children.get(pid, [])
    return total


def machine_busy_s() -> float:
    """All CPUs' non-idle time since boot (/proc/stat's first line: user nice system idle iowait irq softirq steal)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) * TICK_S


@dataclass
class CpuReading:
    parties: dict[str, float]  # party -> CPU seconds so far
    busy_s: float  # the machine's


class CpuMeter:
    """parties: name -> root pids; the bench's own process is counted without its children (they are parties)."""

    def __init__(self, parties: dict[str, list[int]]):
        self.parties = parties

    def read(self) -> CpuReading:
        children = _children()
        spent = {name: sum(_cpu_s(pid, reaped=False) if pid == os.getpid() else tree_cpu_s(pid, children)
                           for pid in pids) for name, pids in self.parties.items()}
        return CpuReading(spent, machine_busy_s())

    @staticmethod
    def spent(before: CpuReading, after: CpuReading) -> dict[str, float]:
        """CPU seconds of each party between two readings, and OTHER's."""
        out = {name: after.parties[name] - before.parties.get(name, 0.0) for name in after.parties}
        out[OTHER] = max(0.0, after.busy_s - before.busy_s - sum(out.values()))
        return out


def cpu_table(rows: list[tuple[str, float, float, dict[str, float]]]) -> str:
    """rows: (configuration, records stored, wall s, CPU s per party) -> a table of us per record and % of the
    machine's CPUs over the step."""
    names = list(dict.fromkeys(name for *_, spent in rows for name in spent))
    lines = ["| configuration | stored records/s | " + " | ".join(f"{n}: us/record (% of CPUs)" for n in names)
             + " | all: us/record |", "|---|--:|" + "--:|" * (len(names) + 1)]
    for label, stored, wall_s, spent in rows:
        cells = [f"{spent.get(n, 0.0) / stored * 1e6:.1f} ({spent.get(n, 0.0) / wall_s / os.cpu_count():.0%})"
                 for n in names]
        lines.append(f"| {label} | {stored / wall_s:,.0f} | " + " | ".join(cells)
                     + f" | {sum(spent.values()) / stored * 1e6:.1f} |")
    return "\n".join(lines)
