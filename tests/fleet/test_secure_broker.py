"""edge-fleet serve against the shipped broker setup: TLS, passwords, systemd/mosquitto/acl and user name =
client id. The fleet user reads every device's topics, shared subscriptions included."""
from __future__ import annotations

import subprocess

import pytest

from fleet_support import REPO, wait_until
from fleet.store import connect
from simdevice import SimDevice
from fleet_tls import write_tls_files

PASSWORDS = {"_fleet": "pw-fleet", "dev-a": "pw-a"}


@pytest.fixture
def secure_broker(tmp_path):
    from broker import Broker

    ca, crt, key = write_tls_files(tmp_path)
    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, password],
                       check=True, capture_output=True)
    b = Broker(tmp_path / "broker", extra_config=(
        f"certfile {crt}\nkeyfile {key}\nallow_anonymous false\npassword_file {passwd}\n"
        f"acl_file {REPO / 'systemd' / 'mosquitto' / 'acl'}\nuse_username_as_clientid true\n")).start()
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
        wait_until(lambda: connect(fleet_db).execute("select count(*) from requests").fetchone()[0] == 5,
                   message="telemetry through TLS, the ACL and the shared subscription")
        assert connect(fleet_db)["devices"].get("dev-a")["status"] == "online"
    finally:
        device.client.disconnect()
        device.client.loop_stop()
    assert "stored 5 records" in serve.stop()
    assert "refused" not in serve.log.read_text()
