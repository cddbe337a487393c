"""A model update's download over a real HTTP Range server: resumed after drops, outages, stops and restarts; slow,
crawling and trickling servers cut off by their recent rate; refusals retried until the job fails."""
from __future__ import annotations

import time

import pytest

from agent import wire
from agent.updates import download
from agent.updates.jobs import UpdateJob
from agent.updates.service import UpdateService, recover
from agent.wire import JobState
from fleet.artifacts import ArtifactServer, RangeHandler
from updates_support import Device, job


class DroppingHandler(RangeHandler):
    """Drops the connection part-way through the first three responses; counts the bytes it sent."""

    drops_left = 3
    sent = 0

    def copyfile(self, source, outputfile):
        if DroppingHandler.drops_left > 0 and self._remaining > 4096:
            DroppingHandler.drops_left -= 1
            chunk = source.read(self._remaining // 3)
            outputfile.write(chunk)
            DroppingHandler.sent += len(chunk)
            self.close_connection = True
            self.connection.shutdown(2)  # the socket dies mid-body
            return
        DroppingHandler.sent += self._remaining
        super().copyfile(source, outputfile)


def test_download_resumes_after_three_drops_without_refetching(tmp_path, bundles, keys):
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    server = ArtifactServer(tmp_path / "artifacts", handler=DroppingHandler).start()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    finally:
        server.stop()
    total = sum(f.size_bytes for f in v2.manifest.files.values())
    print(f"bundle {total} bytes, served {DroppingHandler.sent} bytes over 3 dropped connections")
    assert state is JobState.SUCCEEDED and DroppingHandler.drops_left == 0
    assert DroppingHandler.sent <= total  # each drop resumed where it stopped: nothing fetched twice


class OutageHandler(RangeHandler):
    """Sends half of the first file it is asked for and drops the connection, then answers 503 while `down`;
    records each request's Range header."""

    down = True
    ranges: list = []

    def send_head(self):
        OutageHandler.ranges.append(self.headers.get("Range"))
        if OutageHandler.down and len(OutageHandler.ranges) > 1:
            self.send_error(503, "down")
            return None
        return super().send_head()

    def copyfile(self, source, outputfile):
        if OutageHandler.down:
            outputfile.write(source.read(self._remaining // 2))
            self.close_connection = True
            self.connection.shutdown(2)
            return
        super().copyfile(source, outputfile)


@pytest.fixture
def outage(tmp_path, bundles):
    """v2 published by a server in an outage (OutageHandler: half a file, then 503s): its URL."""
    OutageHandler.down, OutageHandler.ranges = True, []
    server = ArtifactServer(tmp_path / "artifacts", handler=OutageHandler).start()
    try:
        yield server.publish_dir(bundles[1].path, "tiny-v2")
    finally:
        server.stop()


def test_a_download_the_network_cut_short_is_resumed_by_the_next_job_even_after_a_restart(tmp_path, bundles, keys,
                                                                                           outage, monkeypatch):
    """What a job got before the network failed, or a restart cut it off, is kept: the next job for the same
    model resumes it rather than fetching it all again (as Ollama and Mender do)."""
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 1.0)
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    first = job(v2.manifest, keys / "fleet.key", outage, job_id="first", min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, first).run() is JobState.FAILED and "no progress" in dev.reports[-1].reason
    assert not dev.staging_empty()
    recover(dev.ctx)  # a restart keeps it too
    recover(dev.ctx)
    assert not dev.staging_empty()
    OutageHandler.down, OutageHandler.ranges = False, []
    again = job(v2.manifest, keys / "fleet.key", outage, job_id="again", min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, again).run() is JobState.SUCCEEDED
    assert OutageHandler.ranges[0] is not None and OutageHandler.ranges[0].startswith("bytes=")  # resumed
    assert dev.serving.manifest.version == v2.manifest.version and dev.staging_empty()


def test_a_stop_during_a_download_pauses_the_job_and_the_restart_resumes_it(tmp_path, bundles, keys, outage):
    """A stop during a download (which may retry for minutes) pauses the job: the restart resumes it, and it is
    not reported FAILED ('interrupted by an agent restart'), a failure for its rollout."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    svc = UpdateService(dev.ctx)
    svc.start()
    svc.offer(job(v2.manifest, keys / "fleet.key", outage, job_id="j", min_tokens_per_s=0).wire_bytes())
    deadline = time.monotonic() + 20
    while len(OutageHandler.ranges) < 3 and time.monotonic() < deadline:  # cut, then 503s
        time.sleep(0.05)
    t0 = time.monotonic()
    svc.stop()
    assert time.monotonic() - t0 < 3 and not svc._thread.is_alive()
    assert not [r for r in dev.reports if r.state in wire.TERMINAL_JOB_STATES]
    assert dev.store.read_journal().paused
    OutageHandler.down, OutageHandler.ranges = False, []
    restarted = UpdateService(dev.ctx)
    restarted.start()
    try:
        final = dev.wait_report(lambda r: r.state in wire.TERMINAL_JOB_STATES, 30)
    finally:
        restarted.stop()
    assert final.state is JobState.SUCCEEDED and OutageHandler.ranges[0].startswith("bytes=")  # resumed
    assert [r.state for r in dev.reports if r.state in wire.TERMINAL_JOB_STATES] == [JobState.SUCCEEDED]


def test_another_models_download_replaces_a_kept_one(tmp_path, bundles, keys, server):
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    stale = dev.store.staging_root / ("0" * 32)
    stale.mkdir()
    (stale / wire.GRAPH_DATA).write_bytes(b"x" * 1000)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    assert dev.staging_empty()


def test_the_download_step_is_journaled_before_its_first_byte(tmp_path, bundles, keys, server):
    """The downloading step is journalled before the first byte (the first progress report comes after a MiB
    or a whole file), so a restart during the first MiB is not reported as 'interrupted ... before it started'."""
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    journaled = []
    write = dev.store.write_journal
    dev.store.write_journal = lambda entry: (journaled.append(entry.step), write(entry))
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    downloading = [r for r in dev.reports if r.step is wire.JobStep.DOWNLOADING]
    assert downloading[0].percent == 0.0 and journaled[:2] == [None, "downloading"]


def send_slowly(source, outputfile, block: int, pause_s: float) -> None:
    """Copy source in blocks of `block` bytes, `pause_s` apart, until it ends or the device gives up."""
    try:
        while data := source.read(block):
            outputfile.write(data)
            outputfile.flush()
            time.sleep(pause_s)
    except OSError:
        pass  # the device gave up on us


class TricklingHandler(RangeHandler):
    """Sends 4 kB, then a byte every 0.3 s: never a socket timeout, never the end. `forever=False`: only the
    first response trickles."""

    forever = True
    requests = 0

    def copyfile(self, source, outputfile):
        TricklingHandler.requests += 1
        if not TricklingHandler.forever and TricklingHandler.requests > 1:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(4096))
        send_slowly(source, outputfile, 1, 0.3)


@pytest.mark.parametrize("forever", [False, True])
def test_a_trickling_server_is_cut_off_and_resumed_or_given_up_on(forever, tmp_path, bundles, keys, monkeypatch):
    """A server sending a byte every few seconds held the update thread (and every job behind it) for days."""
    monkeypatch.setattr(download, "LOW_SPEED_WINDOW_S", 1.0)
    monkeypatch.setattr(download, "MIN_DOWNLOAD_BYTES_PER_S", 1 << 30)  # every attempt is cut after its window
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 5.0)
    TricklingHandler.forever, TricklingHandler.requests = forever, 0
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    server = ArtifactServer(tmp_path / "artifacts", handler=TricklingHandler).start()
    t0 = time.monotonic()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    finally:
        server.stop()
    if forever:
        assert state is JobState.FAILED and "no progress for 5 s" in dev.reports[-1].reason
        assert time.monotonic() - t0 < 30 and dev.serving.manifest.version == v1.manifest.version
    else:
        assert state is JobState.SUCCEEDED and TricklingHandler.requests >= 2


class CrawlingHandler(RangeHandler):
    """Sends 8 kB every 0.1 s (80 kB/s), whatever the file's size."""

    def copyfile(self, source, outputfile):
        send_slowly(source, outputfile, 8192, 0.1)


def test_a_crawling_download_is_cut_off_by_its_recent_rate_not_the_files_size(tmp_path, monkeypatch):
    """An attempt is cut by its rate over the last window, not on average over the whole file, which lets a
    51 MB download crawling at 200 B/s hold the updater (and every job behind it) for ~52 minutes, reporting 0%
    all along. Scaled down here: a 1 MB/s floor over 1 s windows, a 40 MB file at 80 kB/s. A whole-file average
    allows this attempt 40 s; it ends within its first window, with progress reported by time."""
    monkeypatch.setattr(download, "LOW_SPEED_WINDOW_S", 1.0)
    monkeypatch.setattr(download, "MIN_DOWNLOAD_BYTES_PER_S", 1 << 20)
    monkeypatch.setattr(download, "PROGRESS_EVERY_S", 0.3)
    size = 40 << 20
    (tmp_path / "files").mkdir()
    with open(tmp_path / "files" / "big.bin", "wb") as f:
        f.truncate(size)
    server = ArtifactServer(tmp_path / "files", handler=CrawlingHandler).start()
    reports = []
    try:
        with pytest.raises(TimeoutError, match="slower than 1024 kB/s"):
            download.fetch_attempt(f"{server.base_url}/big.bin", tmp_path / "big.part", 0, size, reports.append)
    finally:
        server.stop()
    got = (tmp_path / "big.part").stat().st_size
    assert 0 < got < 1 << 20  # cut in its first window: ~80 kB of the 40 MB arrived
    assert len(reports) >= 2 and reports == sorted(reports) and reports[-1] <= got


def test_a_body_cut_off_mid_chunk_is_resumed(tmp_path, bundles, keys, server, monkeypatch):
    """http.client.IncompleteRead (a chunked body cut off) and BadStatusLine escaped as "internal error"."""
    import http.client

    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    get = download.fetch_attempt
    failures = [http.client.IncompleteRead(b"x" * 10), http.client.BadStatusLine("garbage")]

    def flaky(url, path, have, size, progress, stopped):
        if failures:
            raise failures.pop()
        return get(url, path, have, size, progress, stopped)

    monkeypatch.setattr(download, "fetch_attempt", flaky)
    url = server.publish_dir(v2.path, "tiny-v2")
    assert UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run() is JobState.SUCCEEDED
    assert not failures


class OftenDroppingHandler(RangeHandler):
    """Drops the connection after 2 kB of the weights file, eight times over."""

    drops_left = 8

    def copyfile(self, source, outputfile):
        if self.path.endswith(wire.GRAPH_DATA) and OftenDroppingHandler.drops_left > 0 and self._remaining > 2048:
            OftenDroppingHandler.drops_left -= 1
            outputfile.write(source.read(2048))
            self.close_connection = True
            self.connection.shutdown(2)
            return
        super().copyfile(source, outputfile)


def test_a_download_that_keeps_progressing_is_not_cut_at_five_attempts(tmp_path, bundles, keys, monkeypatch):
    """Five attempts a file were allowed even when each got further than the last: a flaky link failed."""
    monkeypatch.setattr(download, "CHUNK_BYTES", 1024)  # so that an attempt adding 2 kB made progress
    v1, v2 = bundles
    assert v2.manifest.files[wire.GRAPH_DATA].size_bytes > 9 * 2048
    dev = Device(tmp_path, v1, keys)
    OftenDroppingHandler.drops_left = 8
    server = ArtifactServer(tmp_path / "artifacts", handler=OftenDroppingHandler).start()
    try:
        url = server.publish_dir(v2.path, "tiny-v2")
        state = UpdateJob(dev.ctx, job(v2.manifest, keys / "fleet.key", url, min_tokens_per_s=0)).run()
    finally:
        server.stop()
    assert state is JobState.SUCCEEDED and OftenDroppingHandler.drops_left == 0, dev.reports[-1]


def test_a_download_the_server_refuses_reports_retrying_with_the_reason_until_it_fails(tmp_path, bundles, keys,
                                                                                       monkeypatch):
    """With the artifact server refusing connections, a device sent no status between its first 0% and the
    failure DOWNLOAD_STALL_S (five minutes) later: the fleet could not tell a download that retries from a device
    gone quiet, while the jobs behind it waited. Scaled down: a status every 0.2 s, a give-up after 3 s."""
    from broker import free_port

    monkeypatch.setattr(download, "PROGRESS_EVERY_S", 0.2)
    monkeypatch.setattr(download, "DOWNLOAD_STALL_S", 3.0)
    v1, v2 = bundles
    dev = Device(tmp_path, v1, keys)
    refusing = f"http://127.0.0.1:{free_port()}/tiny-v2"  # nothing listens there: every connection is refused
    refused = job(v2.manifest, keys / "fleet.key", refusing, min_tokens_per_s=0)
    assert UpdateJob(dev.ctx, refused).run() is JobState.FAILED
    downloading = [r for r in dev.reports if r.step is wire.JobStep.DOWNLOADING]
    first, retrying = downloading[0], downloading[1:]
    assert first.percent == 0.0 and first.reason is None
    assert len(retrying) >= 5, [r.reason for r in retrying]  # ~15 in 3 s at one per 0.2 s
    for r in retrying:
        assert r.state is JobState.IN_PROGRESS and r.percent == 0.0
        assert r.reason.startswith("retrying: Connection refused (no progress for "), r.reason
    end = dev.reports[-1]
    assert end.state is JobState.FAILED and "no progress for 3 s" in end.reason
    gaps_s = [b.ts - a.ts for a, b in zip(downloading, downloading[1:] + [end])]
    assert max(gaps_s) < 1.0, gaps_s  # every 0.2 s, whatever the backoff between attempts (up to 1.6 s here)
