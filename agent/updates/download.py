"""The resumable downloader of a signed bundle's files: each file is fetched over HTTP with a Range
request from where the last attempt stopped, never past its signed size, with a low-speed cut-off per
attempt (curl's --speed-limit / --speed-time), a backoff between attempts that got nowhere, a give-up after
DOWNLOAD_STALL_S without progress, and a status at least every PROGRESS_EVERY_S: progress as bytes arrive
(and one a MiB), "retrying: <why>" while attempts fail. The file's sha256 is checked afterwards, when the job
opens the staged bundle (agent.engine.bundle).
"""
from __future__ import annotations

import errno
import functools
import http.client
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from agent import wire
from agent.engine.bundle import safe_member
from agent.updates.errors import STORAGE_ERRNOS, JobFailed, JobPaused
from agent.wire import JobState

log = logging.getLogger(__name__)

# A download that adds less than CHUNK_BYTES for this long fails, what it got kept for the next try. A count of
# attempts instead (5, ~11 s of outage) fails a job through an outage Mender's client carries it through.
DOWNLOAD_STALL_S = 300.0
DOWNLOAD_BACKOFF_MAX_S = 30.0
CHUNK_BYTES = 1 << 20
# An attempt slower than MIN_DOWNLOAD_BYTES_PER_S over any LOW_SPEED_WINDOW_S is cut off and resumed (curl's
# --speed-limit / --speed-time); a download whose attempts stay that slow for DOWNLOAD_STALL_S fails. The rate
# is over a window, not the whole file: averaged over the file, a link crawling at 200 B/s holds a 51 MB download
# (and every job behind it) for ~52 minutes and a 100 MB one, at 1 MiB an attempt, for ~19 hours.
MIN_DOWNLOAD_BYTES_PER_S = 16 << 10
LOW_SPEED_WINDOW_S = 60.0
# A status at least this often, bytes arriving or not (besides one a MiB), so that the fleet tells a download that
# retries from a device gone quiet. Late by at most one attempt blocked in the network, which ATTEMPT_TIMEOUT_S
# bounds: a connect or a read with nothing arriving.
PROGRESS_EVERY_S = 30.0
ATTEMPT_TIMEOUT_S = 30.0


def fetch_file(base_url: str, staging: Path, rel: str, entry: wire.FileEntry,
               progress: Callable[[int, str | None], None], stopping: threading.Event | None) -> None:
    """Fetch staging/rel from base_url/rel until it holds entry.size_bytes, resuming after each interruption.
    progress(bytes of this file, retrying) at least every PROGRESS_EVERY_S: as the file grows (retrying None),
    and while attempts fail, with why ("retrying: Connection refused (...)"). stopping set: JobPaused, what
    arrived kept."""
    stopped = functools.partial(check_stopping, stopping)
    path = safe_member(staging, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Quoted: a signed file name with a control character raised http.client.InvalidURL out of the job, and
    # a '#', '?' or '%' in a name would change what the URL points at.
    url = f"{base_url.rstrip('/')}/{urllib.parse.quote(rel)}"
    beat = _Beat(progress)
    stalled = 0  # attempts in a row that got (nearly) nowhere: one that progresses resets the count
    progressed = time.monotonic()
    while time.monotonic() - progressed < DOWNLOAD_STALL_S:
        stopped()
        have = path.stat().st_size if path.exists() else 0
        if path.exists() and have == entry.size_bytes:  # exists: a 0-byte file must still be created
            return
        if have > entry.size_bytes:
            path.unlink()
            have = 0
        started = time.monotonic()
        why = _attempt(url, path, have, entry.size_bytes, rel, beat.grew, stopped)
        now_have = path.stat().st_size if path.exists() else 0
        gained = now_have - have  # < 0: a server that ignored Range
        # progress: a MiB (or the rest), or the minimum rate over the attempt (a link that drops every
        # 40 s at 20 kB/s never got a MiB in one attempt, yet carries the download)
        enough = gained >= min(CHUNK_BYTES, entry.size_bytes - have)
        fast = gained >= MIN_DOWNLOAD_BYTES_PER_S * (time.monotonic() - started)
        stalled = 0 if gained > 0 and (enough or fast) else stalled + 1
        if not stalled:
            progressed = time.monotonic()
        if why is None:
            continue
        retrying = f"retrying: {why} (no progress for {time.monotonic() - progressed:.0f} of {DOWNLOAD_STALL_S:.0f} s)"
        beat.when_due(now_have, retrying)
        if stalled:  # not past the give-up: a job that cannot download must not hold those behind it longer
            delay_s = min(0.2 * 2 ** min(stalled, 16), DOWNLOAD_BACKOFF_MAX_S,
                          progressed + DOWNLOAD_STALL_S - time.monotonic())
            _back_off(delay_s, stopping, beat, now_have, retrying)
    raise JobFailed(JobState.FAILED, f"download of {rel} incomplete: no progress for {DOWNLOAD_STALL_S:.0f} s",
                    keep_download=True)


def _attempt(url: str, path: Path, have: int, size: int, rel: str, progress: Callable[[int], None],
             stopped: Callable[[], None]) -> str | None:
    """One fetch_attempt: None if it ended with the file whole, else why it is worth another; JobFailed for
    what another attempt cannot change (a 4xx, a full or failed disk)."""
    try:
        fetch_attempt(url, path, have, size, progress, stopped)
        return None
    except urllib.error.HTTPError as e:
        if e.code == 416:  # the server's file ends before what we have: not the signed one
            raise JobFailed(JobState.FAILED, f"download of {rel}: the server's file ends at or before the "
                                             f"{have} bytes already fetched (the manifest lists {size})") from e
        if 400 <= e.code < 500:  # not there or not ours: retrying will not help
            raise JobFailed(JobState.FAILED, f"download of {rel} refused: HTTP {e.code} {e.reason}") from e
        log.info("download of %s: HTTP %s, retrying", rel, e.code)
        return f"HTTP {e.code} {e.reason}"
    except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
        # HTTPException: a body cut off mid-chunk (IncompleteRead) or a garbled status line
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # the disk, not the network
            raise JobFailed(JobState.FAILED, f"no space left for {rel} on the device: {e}") from e
        if getattr(e, "errno", None) in STORAGE_ERRNOS:  # the card failed: retrying cannot help
            raise JobFailed(JobState.FAILED, f"cannot write {rel} on the device: {e}") from e
        log.info("download of %s interrupted (%s), resuming", rel, e)
        return _cause(e)


def _cause(e: Exception) -> str:
    """What went wrong, as an operator reads it: "Connection refused", not "<urlopen error [Errno 111] ...>"."""
    cause = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
    if isinstance(cause, http.client.HTTPException):
        return f"{type(cause).__name__}: {cause}"[:200]
    return (getattr(cause, "strerror", None) or str(cause) or type(cause).__name__)[:200]


class _Beat:
    """The download's statuses, at least one every PROGRESS_EVERY_S: those fetch_attempt sends as bytes arrive
    (a MiB or PROGRESS_EVERY_S), and between them, while attempts fail, why it is retrying: the fleet must
    tell a download that retries (up to DOWNLOAD_STALL_S) from a device gone quiet."""

    def __init__(self, progress: Callable[[int, str | None], None]):
        self.progress = progress
        self.last = time.monotonic()  # the job reported just before the download (0%) or the file before

    def grew(self, n_bytes: int) -> None:
        self.last = time.monotonic()
        self.progress(n_bytes, None)

    def due_in_s(self) -> float:
        return self.last + PROGRESS_EVERY_S - time.monotonic()

    def when_due(self, n_bytes: int, retrying: str) -> None:
        if self.due_in_s() <= 0:
            self.last = time.monotonic()
            self.progress(n_bytes, retrying)


def _back_off(delay_s: float, stopping: threading.Event | None, beat: _Beat, n_bytes: int, retrying: str) -> None:
    """Wait delay_s before the next attempt, reporting `retrying` as statuses fall due; a stop cuts the wait
    short (JobPaused)."""
    end = time.monotonic() + delay_s
    while (left_s := end - time.monotonic()) > 0:
        beat.when_due(n_bytes, retrying)
        wait_s = min(left_s, max(beat.due_in_s(), 0.0))
        if stopping is None:
            time.sleep(wait_s)
        elif stopping.wait(wait_s):
            raise JobPaused()


def fetch_attempt(url: str, path: Path, have: int, size: int, progress: Callable[[int], None],
                  stopped: Callable[[], None] = lambda: None) -> None:
    """One HTTP request for url from byte `have` on, appended to path (rewritten if the server ignores Range);
    raises on a cut, a crawl or a body that does not fit the signed size."""
    # the socket timeout bounds one read; the low-speed check bounds a crawl (a server trickling a byte every
    # few seconds held the update thread, and every job queued behind it, for days)
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(req, timeout=ATTEMPT_TIMEOUT_S) as resp:
        mode = "ab" if have and resp.status == 206 else "wb"  # a 200 means the server ignored Range
        written = reported = window_bytes = have if mode == "ab" else 0
        declared_end = written + resp.length if resp.length is not None else None  # Content-Length
        reported_at = window_start = time.monotonic()
        with open(path, mode) as f:
            while chunk := resp.read1(CHUNK_BYTES):  # what has arrived: read() waits for a whole chunk
                if written + len(chunk) > size:  # a wrong or endless body must not fill the disk
                    raise JobFailed(JobState.FAILED, f"{url} sent more than the {size} bytes the signed "
                                                     f"manifest lists")
                f.write(chunk)
                written += len(chunk)
                stopped()  # raises JobPaused: what arrived is kept
                now = time.monotonic()
                # a status a MiB or every PROGRESS_EVERY_S, not a read: at 200 B/s the fleet saw 0% for an hour
                if written - reported >= CHUNK_BYTES or written == size or now - reported_at >= PROGRESS_EVERY_S:
                    progress(reported := written)
                    reported_at = now
                if now - window_start >= LOW_SPEED_WINDOW_S:  # what arrived is kept: the next attempt resumes
                    if written - window_bytes < MIN_DOWNLOAD_BYTES_PER_S * (now - window_start):
                        raise TimeoutError(f"slower than {MIN_DOWNLOAD_BYTES_PER_S >> 10} kB/s over "
                                           f"{now - window_start:.0f} s")
                    window_start, window_bytes = now, written
        if written < size and declared_end is not None and written < declared_end:  # read1 does not raise
            raise ConnectionError(f"the connection closed after {written} of {declared_end} bytes")  # a cut
        if written < size:  # the body ended where the server said it would: its file is shorter than the
            # signed one, and asking again gets the same (it was retried, then for minutes)
            raise JobFailed(JobState.FAILED, f"{url} ended after {written} bytes; the signed manifest lists {size}")

def check_stopping(stopping: threading.Event | None) -> None:
    """JobPaused if the agent is stopping (stopping set); None: the job cannot be taken up after a restart."""
    if stopping is not None and stopping.is_set():
        raise JobPaused()
