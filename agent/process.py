"""This process's facts as Linux reports them (/proc, cgroups) and its hold on memory: the CPUs it may use
and how busy others keep them, its resident and peak memory and its limit, and giving memory back to the
OS (freed heap, pages of lazily zeroed buffers, clean pages of mapped files).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

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
    has the controller, so that a quota or a memory limit on a v1 box (older distributions, Docker on them)
    counts too."""
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
    return_free_heap()


def return_free_heap() -> None:
    """Return glibc's free heap pages to the OS without a garbage collection: for native code's transient
    memory (a parse, a session's load), where a gc would only hold the GIL (over a second in a big process)."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim this way


PROC_STAT = Path("/proc/stat")


def cpu_quota_cores() -> float | None:
    """The tightest cgroup CPU quota on this process's cgroup and its parents, in cores: v2's cpu.max, or
    v1's cpu.cfs_quota_us over cpu.cfs_period_us (-1: none)."""
    quotas = []
    for value in cgroup_values("cpu.max"):
        try:
            quota, period = value.split()
            if quota != "max":
                quotas.append(int(quota) / int(period))
        except ValueError:
            pass
    for group in cgroup_dirs("cpu"):
        try:
            quota, period = (int((group / f"cpu.cfs_{x}_us").read_text()) for x in ("quota", "period"))
        except (OSError, ValueError):
            continue
        if quota > 0 and period > 0:
            quotas.append(quota / period)
    return min(quotas) if quotas else None


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota if one is set."""
    cores, quota = len(os.sched_getaffinity(0)), cpu_quota_cores()
    return max(1, min(cores, int(quota)) if quota is not None else cores)


def cpu_busy_elsewhere(seconds: float = 0.25) -> float:
    """Cores' worth of CPU that others used on this process's CPUs over `seconds` (hypervisor steal included)."""
    cpus, hz = os.sched_getaffinity(0), os.sysconf("SC_CLK_TCK")

    def sample() -> tuple[float, float]:
        busy = 0
        for line in PROC_STAT.read_text().splitlines():
            name, *fields = line.split()
            if name[3:].isdigit() and name.startswith("cpu") and int(name[3:]) in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
                busy += user + nice + system + irq + softirq + steal
        own = os.times()
        return busy / hz, own.user + own.system

    (busy0, own0), t0 = sample(), time.monotonic()
    time.sleep(seconds)
    (busy1, own1), elapsed = sample(), time.monotonic() - t0
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / elapsed


def lazy_zeros(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    """A zero-filled array that becomes resident 4 KB page by page, as it is first written.

    numpy asks for transparent huge pages on arrays of 4 MB or more (madvise MADV_HUGEPAGE), so the
    first write into a KV buffer made a whole 2 MB page resident, and khugepaged later filled in more
    in the background: a 1,024-token sequence cost ~36 MB more RSS than the 47 MB its keys and values
    need. An anonymous mapping marked MADV_NOHUGEPAGE costs exactly the pages written.
    """
    count = int(np.prod(shape))
    buf = mmap.mmap(-1, max(1, count * np.dtype(dtype).itemsize), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere there are no transparent huge pages to refuse
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype, count).reshape(shape)  # the array keeps the mapping alive


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED = 4  # Linux: drop the pages; anonymous ones read back as zeros, clean file ones from the file


def drop_pages(start: int, end: int) -> bool:
    """madvise(MADV_DONTNEED) over the whole pages inside [start, end). False if the kernel refused (e.g. the
    pages are locked): they stay resident, which costs memory but loses nothing, so callers carry on."""
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo and _libc.madvise(lo, hi - lo, MADV_DONTNEED) != 0:
        log.debug("madvise(MADV_DONTNEED) refused: %s", os.strerror(ctypes.get_errno()))
        return False
    return True


def release_pages(arr: np.ndarray) -> None:
    """Give the whole pages of a contiguous view of a lazy_zeros buffer back to the OS; they read as zeros.

    A freed KV slot keeps its pages resident otherwise, so RSS would stay at its high-water mark.
    """
    assert arr.flags.c_contiguous
    drop_pages(arr.ctypes.data, arr.ctypes.data + arr.nbytes)


def clean_file_mappings(directory: Path) -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of this process's mappings of files in `directory` that hold no
    copy-on-write page (smaps' Anonymous is 0): their pages can be dropped and read back unchanged."""
    spans, current = [], None
    # a mapped file's name need not be UTF-8 (it is bytes to the kernel): read it as Path itself does
    for line in Path("/proc/self/smaps").read_text(errors="surrogateescape").splitlines():
        head = line.split(None, 5)  # a mapping's header: range perms offset dev inode [path, may hold spaces]
        if ":" not in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            path = head[5] if len(head) > 5 else ""
            current = [lo, hi, 0, 0] if path.startswith("/") and Path(path).parent == directory else None
            if current is not None:
                spans.append(current)
        elif current is not None and head[0] in ("Rss:", "Anonymous:"):
            current[2 if head[0] == "Rss:" else 3] = int(head[1]) * 1024
    return [(lo, hi, rss) for lo, hi, rss, anonymous in spans if anonymous == 0]


def release_clean_file_pages(directory: Path) -> int:
    """Drop this process's resident pages of files in `directory` that it has not modified; returns bytes.

    ONNX Runtime maps external weight data (MAP_PRIVATE) and reads every weight once to prepack it into
    its own buffers. The originals it keeps mapped (the tied embedding/lm_head table: a Gather reads it
    too) stay resident although a decode step touches a few rows of them: ~35 MB of SmolLM2's INT4 RSS.
    Clean pages are dropped without loss (they read back from the file); a mapping with any
    copy-on-write page is left alone.
    """
    return sum(rss for lo, hi, rss in clean_file_mappings(directory) if rss > 0 and drop_pages(lo, hi))


@contextmanager
def periodically(interval_s: float, action: Callable[[], bool | None], name: str) -> Iterator[None]:
    """Call action every interval_s from a daemon thread while the block runs, until it returns False; the
    thread is joined when the block ends, so no call outlives it."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(interval_s):
            if action() is False:
                return

    worker = threading.Thread(target=run, name=name, daemon=True)
    worker.start()
    try:
        yield
    finally:
        done.set()
        worker.join()
