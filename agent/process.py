"""This process's memory, as Linux reports it (/proc/self), and giving freed heap back to it."""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import re
from pathlib import Path


PROC_SELF = Path("/proc/self")


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as an octal escape."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_mounts() -> list[tuple[str, Path, str, set[str]]]:
    """(fstype, mount point, root within the hierarchy, options) of every cgroup and cgroup2 mount."""
    mounts = []
    try:
        lines = (PROC_SELF / "mountinfo").read_text().splitlines()
    except OSError:
        return mounts
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((tail[0], Path(_unescape(fields[4])), _unescape(fields[3]), set(tail[2].split(","))))
    return mounts


def _within(path: str, root: str) -> str:
    """A cgroup path (relative to its hierarchy's root) as a path under a mount of that hierarchy's `root`; a
    path outside the mounted part (a container that sees only its own cgroup) is the mount itself."""
    if root == "/":
        return path
    if path == root or path.startswith(root + "/"):
        return path[len(root):]
    return ""


def cgroup_dirs(controller: str) -> list[Path]:
    """This process's cgroup directories where `controller`'s files may be, innermost first and up to each
    hierarchy's mount point (a systemd service's CPUQuota= and MemoryMax= sit on its own cgroup, a container's
    or a slice's on a parent): the unified (v2) hierarchy, and on a v1 or hybrid system the v1 hierarchy that
    has the controller. Only v2 was read before: on a v1 box (older distributions, Docker on them) a quota or
    a memory limit went unseen (found in review)."""
    try:
        memberships = [line.split(":", 2) for line in (PROC_SELF / "cgroup").read_text().splitlines()]
    except OSError:
        return []
    dirs = []
    for fstype, mount, root, options in _cgroup_mounts():
        for _hierarchy, controllers, path in (m for m in memberships if len(m) == 3):
            v2 = fstype == "cgroup2" and controllers == ""
            if not (v2 or fstype == "cgroup" and controller in controllers.split(",") and controller in options):
                continue
            group = mount / _within(path, root).lstrip("/")
            while True:
                dirs.append(group)
                if group == mount or mount not in group.parents:
                    break
                group = group.parent
    return dirs


def cgroup_values(name: str) -> list[str]:
    """The cgroup file `name` (cpu.max, memory.max; v1's memory.limit_in_bytes) of every directory
    cgroup_dirs gives for its controller, innermost first."""
    values = []
    for group in cgroup_dirs(name.split(".")[0]):
        try:
            values.append((group / name).read_text().strip())
        except OSError:
            pass  # no such file or controller here
    return values


def memory_limit_bytes() -> int | None:
    """The most memory this process can have, if known: the machine's RAM, or less under a cgroup's memory
    limit (a service's MemoryMax=, a container's --memory)."""
    # "max" (v2) is no limit; v1's unlimited is a number near 2^63, above the RAM
    limits = [int(v) for v in cgroup_values("memory.max") + cgroup_values("memory.limit_in_bytes") if v.isdigit()]
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
