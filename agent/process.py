"""This process's memory, as Linux reports it (/proc/self), and giving freed heap back to it."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from pathlib import Path


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_values(name: str) -> list[str]:
    """The cgroup v2 file `name` (cpu.max, memory.max) of this process's cgroup and of each parent that has
    it, innermost first: a systemd service's CPUQuota= and MemoryMax= sit on its own cgroup, not the root's."""
    try:
        own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::"))
    except (OSError, StopIteration):
        own = "/"
    values, group = [], CGROUP_ROOT / own.strip().lstrip("/")
    while True:
        try:
            values.append((group / name).read_text().strip())
        except OSError:
            pass  # no such controller here
        if group == CGROUP_ROOT or CGROUP_ROOT not in group.parents:
            return values
        group = group.parent


def memory_limit_bytes() -> int | None:
    """The most memory this process can have, if known: the machine's RAM, or less under a cgroup v2
    memory.max (a service's MemoryMax=)."""
    limits = [int(v) for v in cgroup_values("memory.max") if v.isdigit()]  # "max": no limit there
    try:
        limits += [int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:")]
    except (OSError, ValueError, IndexError):
        pass  # unknown
    return min(limits) if limits else None


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return _status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since start or since the last reset_peak_rss()."""
    return _status_kb("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0), so a peak can be measured."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not permitted here: the peak then covers the whole process life, which overestimates safely


def trim_heap() -> None:
    """Free what is unreachable (gc), then return glibc's free heap pages to the OS (malloc_trim): after a
    model or session is dropped its freed memory otherwise stays in this process's RSS, and the next one's
    budget is measured on top of it."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way
