"""edge-fleet serve against the shipped broker setup: TLS, passwords, systemd/mosquitto/acl and user name =
client id. The fleet user reads every device's topics, shared subscriptions included."""
from __future__ import annotations

import subprocess

import pytest

from fleet_support import REPO, wait_until
from fleet.db import open_database
from simdevice import SimDevice
from tls_files import write_tls_files

PASSWORDS = {"_fleet": "pw-fleet", "_fleet-jobs": "pw-jobs", "_fleet-cmd": "pw-cmd", "dev-a": "pw-a"}


@pytest.fixture
def secure_broker(tmp_path):
    from broker import Broker

    ca, crt, key = write_tls_files(tmp_path)
    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, password],
                       check=True, capture_output=True)
    # the shipped config's limits too (its listener, paths and save interval are the test broker's own)
    shipped = (REPO / "systemd" / "mosquitto" / "mosquitto.conf").read_text().splitlines()
    limits = [line for line in shipped if line.split(" ")[0] in ("max_queued_messages", "message_size_limit",
                                                                "max_packet_size")]
    assert len(limits) == 3, limits
    b = Broker(tmp_path / "broker", extra_config=(
        f"certfile {crt}\nkeyfile {key}\nallow_anonymous false\npassword_file {passwd}\n"
        f"acl_file {REPO / 'systemd' / 'mosquitto' / 'acl'}\nuse_username_as_clientid true\n"
        + "\n".join(limits) + "\n")).start()
    b.ca = ca
    yield b
    b.stop()


def test_serve_over_tls_with_the_shipped_acl(secure_broker, serve_processes, fleet_db, tmp_path):
    (tmp_path / "fleet.pw").write_text(PASSWORDS["_fleet"] + "\n")
    url = f"mqtts://127.0.0.1:{secure_broker.port}"
    serve = serve_processes(url, fleet_db, "_fleet", shared_group="fleet", extra_args=(
        "--username", "_fleet", "--password-file", tmp_path / "fleet.pw", "--ca-file", secure_broker.ca))
    device = SimDevice(secure_broker.port, "dev-a", password=PASSWORDS["dev-a"], ca_file=secure_broker.ca).start()
    try:
        device.wait_connected()
        device.emit(5)
        wait_until(lambda: open_database(fleet_db).execute("select count(*) from requests").fetchone()[0] == 5,
                   message="telemetry through TLS, the ACL and the shared subscription")
        assert open_database(fleet_db)["devices"].get("dev-a")["status"] == "online"
    finally:
        device.client.disconnect()
        device.client.loop_stop()
    assert "stored 5 records" in serve.stop()
    assert "refused" not in serve.log.read_text()


def test_rollouts_connect_as_their_own_user(secure_broker, serve_processes, fleet_db, tmp_path):
    """Found in review: with --artifacts-http, serve opened two connections as one user; the broker (user name =
    client id) closed each for the other, about twice a second."""
    import time

    from broker import free_port

    for user in ("_fleet", "_fleet-jobs"):
        (tmp_path / f"{user}.pw").write_text(PASSWORDS[user] + "\n")
    serve = serve_processes(f"mqtts://127.0.0.1:{secure_broker.port}", fleet_db, "_fleet", extra_args=(
        "--username", "_fleet", "--password-file", tmp_path / "_fleet.pw", "--ca-file", secure_broker.ca,
        "--artifacts-http", f"127.0.0.1:{free_port()}", "--artifacts-dir", tmp_path / "art",
        "--jobs-username", "_fleet-jobs", "--jobs-password-file", tmp_path / "_fleet-jobs.pw"))
    wait_until(lambda: "rollouts running" in serve.log.read_text(), message="the rollout link to start")
    time.sleep(3)  # the clash showed within a second
    serve.stop()
    fleet_log = serve.log.read_text()
    broker_log = (tmp_path / "broker" / "mosquitto.log").read_text()
    assert fleet_log.count("connected to") == 2 and "disconnected" not in fleet_log, fleet_log
    assert "already connected" not in broker_log


def test_each_fleet_user_may_do_only_what_its_connection_does(secure_broker, tmp_path):
    """Found in review: _fleet (the consumer, whose password every replica holds) and _fleet-jobs could write
    every device topic, so either could send a device any command or job notice, or forge its state."""
    device = SimDevice(secure_broker.port, "dev-a", password=PASSWORDS["dev-a"], ca_file=secure_broker.ca).start()
    try:
        device.wait_connected()
        answers = {}
        for user in ("_fleet-cmd", "_fleet", "_fleet-jobs"):
            (tmp_path / f"{user}.pw").write_text(PASSWORDS[user] + "\n")
            r = subprocess.run([REPO / ".venv" / "bin" / "edge-fleet", "cmd", "dev-a", "ping", "--timeout", "3",
                                "--mqtt", f"mqtts://127.0.0.1:{secure_broker.port}", "--username", user,
                                "--password-file", tmp_path / f"{user}.pw", "--ca-file", secure_broker.ca],
                               capture_output=True, text=True, timeout=60)
            answers[user] = (r.returncode, r.stdout + r.stderr)
    finally:
        device.client.disconnect()
        device.client.loop_stop()
    assert answers["_fleet-cmd"][0] == 0 and '"pong": true' in answers["_fleet-cmd"][1], answers
    for user in ("_fleet", "_fleet-jobs"):
        assert answers[user][0] != 0 and "not authorized" in answers[user][1].lower(), answers
