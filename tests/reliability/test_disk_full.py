"""Disk full, over a real agent process: its telemetry cap reached (no broker, so nothing is ever delivered),
and its state directory on a filesystem that really runs out of space. Both times every request is still
answered, and the agent reports that it dropped telemetry records and how many (`edge-agent telemetry`,
/metrics, the log)."""
from __future__ import annotations

import json
import os
import subprocess
import threading

import pytest

from agent.link.store import max_file_bytes
from processes import BIN, Agent, client, integrity, rows

REQUESTS = 400
CAP = 1 << 16  # telemetry's smallest allowed max_bytes: about 60 request records



def serve_requests(agent: Agent, n: int, clients: int = 4) -> list[int]:
    statuses: list[int] = []

    def run(k: int) -> None:
        with client(agent.sock) as c:
            for i in range(k, n, clients):
                statuses.append(c.post("/v1/completions", json={"model": "tiny", "prompt": f"request {i}",
                                                                 "max_tokens": 4}).status_code)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return statuses


def dropped_metric(agent: Agent) -> float:
    with client(agent.sock) as c:
        text = c.get("/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("edge:telemetry_dropped_records ")]
    return float(line.split()[1])


def test_the_telemetry_cap_reached_drops_oldest_rows_counts_them_and_serving_goes_on(tiny_fp32_bundle, tmp_path,
                                                                                     figures):
    config = tmp_path / "agent.toml"
    config.write_text(f"[telemetry]\nmax_bytes = {CAP}\nretention_interval_s = 1\nsample_interval_s = 0.5\n")
    agent = Agent(tmp_path, "--model", tiny_fp32_bundle.path, "--config", config, "--memory-budget-mb", 2048)
    agent.start()
    statuses = serve_requests(agent, REQUESTS)
    assert statuses.count(200) == REQUESTS
    metric = dropped_metric(agent)
    assert agent.stop() == 0
    report = json.loads(subprocess.run([BIN / "edge-agent", "telemetry", "--state-dir", agent.state_dir, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    dropped = report["store"]["dropped_undelivered"]
    db = agent.telemetry_db
    kept, last_seq = rows(db, "SELECT count(*), max(seq) FROM records")[0]
    # seq counts every record this boot appended: each is still there or counted as dropped
    assert dropped > 0 and kept + dropped == last_seq + 1
    assert metric > 0 and "dropped" in agent.log.read_text()
    assert db.stat().st_size <= max_file_bytes(CAP) and integrity(db) == "ok"
    figures.append(f"disk cap ({CAP} bytes, nothing delivered): {REQUESTS}/{REQUESTS} requests answered; "
                   f"{dropped} oldest records dropped and reported, {kept} kept ({kept + dropped} = every record)")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_really_full_disk_drops_records_counts_them_and_serving_goes_on(tiny_fp32_bundle, tmp_path, figures):
    state = tmp_path / "dev-1"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", state], check=True)
    try:
        config = tmp_path / "agent.toml"
        config.write_text("[telemetry]\nretention_interval_s = 1\nsample_interval_s = 0.2\n")
        agent = Agent(tmp_path, "--model", tiny_fp32_bundle.path, "--config", config, "--memory-budget-mb", 2048)
        agent.start()
        statuses = serve_requests(agent, REQUESTS)
        assert statuses.count(200) == REQUESTS  # answered although their records could not all be stored
        metric = dropped_metric(agent)
        log = agent.log.read_text()
        assert agent.stop() == 0, log[-3000:]
        df = os.statvfs(state)
        assert df.f_bavail * df.f_frsize < 64 << 10  # the filesystem really was full
        kept = rows(agent.telemetry_db, "SELECT count(*) FROM requests")[0][0]
        assert kept < REQUESTS and metric >= REQUESTS - kept  # every request record not kept is counted
        assert "the disk is full" in log and "Traceback" not in log
        figures.append(f"full disk (640 kB tmpfs): {REQUESTS}/{REQUESTS} requests answered; {kept} request "
                       f"records stored, {metric:.0f} records counted as dropped")
    finally:
        subprocess.run(["umount", "-l", state], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_an_agent_stopped_cleanly_starts_and_serves_on_a_disk_that_filled_meanwhile(tiny_fp32_bundle, tmp_path,
                                                                                      figures):
    """Found in review: a clean stop removes SQLite's WAL index (-shm), which a full disk then cannot recreate,
    and the agent exited 'disk I/O error' at every start: no API, and no MQTT to fix the box remotely."""
    state = tmp_path / "dev-1"
    state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", state], check=True)
    try:
        agent = Agent(tmp_path, "--model", tiny_fp32_bundle.path, "--memory-budget-mb", 2048)
        agent.start()
        assert serve_requests(agent, 4, clients=1).count(200) == 4
        assert agent.stop() == 0
        assert not (state / "telemetry.db-shm").exists()
        with open(state / "filler", "wb", buffering=0) as f:  # something else fills the disk meanwhile
            while True:
                try:
                    f.write(b"\0" * 4096)
                except OSError:
                    break
        before = agent.log.read_text()
        agent.start()
        assert serve_requests(agent, 8, clients=2).count(200) == 8
        log = agent.log.read_text()[len(before):]
        assert "telemetry is kept in memory" in log and "Traceback" not in log
        assert agent.stop() == 0, log[-3000:]
        (state / "filler").unlink()  # room again: the next start uses the file, and it is intact
        agent.start()
        assert agent.stop() == 0
        assert integrity(agent.telemetry_db) == "ok" and rows(agent.telemetry_db, "SELECT count(*) FROM requests")[0][0] == 4
        figures.append("full disk at start (a clean stop, then the disk filled): the agent served with "
                       "telemetry in memory, and used its intact file again once there was room")
    finally:
        subprocess.run(["umount", "-l", state], check=False)
