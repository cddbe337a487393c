"""The resumable downloader of a signed bundle's files: each file is fetched over HTTP with a Range
request from where the last attempt stopped, never past its signed size, with a low-speed cut-off per
attempt (curl's --speed-limit / --speed-time), a backoff between attempts that got nowhere, a give-up after
DOWNLOAD_STALL_S without progress, and a progress callback a MiB or every PROGRESS_EVERY_S. The file's
sha256 is checked afterwards, when the job opens the staged bundle (agent.engine.bundle).
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
PROGRESS_EVERY_S = 30.0  # a status at least this often while bytes arrive, besides one a MiB


def fetch_file(base_url: str, staging: Path, rel: str, entry: wire.FileEntry, progress: Callable[[int], None],
               stopping: threading.Event | None) -> None:
    """Fetch staging/rel from base_url/rel until it holds entry.size_bytes, resuming after each interruption.
    progress(bytes of this file) as it grows; stopping set: JobPaused, what arrived kept."""
    stopped = functools.partial(check_stopping, stopping)
    path = safe_member(staging, rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Quoted: a signed file name with a control character raised http.client.InvalidURL out of the job, and
    # a '#', '?' or '%' in a name would change what the URL points at.
    url = f"{base_url.rstrip('/')}/{urllib.parse.quote(rel)}"
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
        try:
            fetch_attempt(url, path, have, entry.size_bytes, progress, stopped)
        except urllib.error.HTTPError as e:
            if e.code == 416:  # the server's file ends before what we have: not the signed one
                raise JobFailed(JobState.FAILED, f"download of {rel}: the server's file ends at or before the "
                                                 f"{have} bytes already fetched (the manifest lists "
                                                 f"{entry.size_bytes})") from e
            if 400 <= e.code < 500:  # not there or not ours: retrying will not help
                raise JobFailed(JobState.FAILED, f"download of {rel} refused: HTTP {e.code} {e.reason}") from e
            log.info("download of %s: HTTP %s, retrying", rel, e.code)
        except (OSError, urllib.error.URLError, http.client.HTTPException) as e:
            # HTTPException: a body cut off mid-chunk (IncompleteRead) or a garbled status line
            if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):  # the disk, not the network
                raise JobFailed(JobState.FAILED, f"no space left for {rel} on the device: {e}") from e
            if getattr(e, "errno", None) in STORAGE_ERRNOS:  # the card failed: retrying cannot help
                raise JobFailed(JobState.FAILED, f"cannot write {rel} on the device: {e}") from e
            log.info("download of %s interrupted (%s), resuming", rel, e)
        gained = (path.stat().st_size if path.exists() else 0) - have  # < 0: a server that ignored Range
        # progress: a MiB (or the rest), or the minimum rate over the attempt (a link that drops every
        # 40 s at 20 kB/s never got a MiB in one attempt, yet carries the download)
        enough = gained >= min(CHUNK_BYTES, entry.size_bytes - have)
        fast = gained >= MIN_DOWNLOAD_BYTES_PER_S * (time.monotonic() - started)
        stalled = 0 if gained > 0 and (enough or fast) else stalled + 1
        if not stalled:
            progressed = time.monotonic()
        else:
            delay = min(0.2 * 2 ** min(stalled, 16), DOWNLOAD_BACKOFF_MAX_S)
            if stopping is None:
                time.sleep(delay)
            elif stopping.wait(delay):  # a stop cuts the wait short
                raise JobPaused()
    raise JobFailed(JobState.FAILED, f"download of {rel} incomplete: no progress for {DOWNLOAD_STALL_S:.0f} s",
                    keep_download=True)

def fetch_attempt(url: str, path: Path, have: int, size: int, progress: Callable[[int], None],
                  stopped: Callable[[], None] = lambda: None) -> None:
    """One HTTP request for url from byte `have` on, appended to path (rewritten if the server ignores Range);
    raises on a cut, a crawl or a body that does not fit the signed size."""
    # the socket timeout bounds one read; the low-speed check bounds a crawl (a server trickling a byte every
    # few seconds held the update thread, and every job queued behind it, for days)
    req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
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
