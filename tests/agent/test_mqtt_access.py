"""Who may talk to the broker: mqtts verified against the given CA, and the shipped ACL keeping each device to its
own topics."""
from __future__ import annotations

import logging
import subprocess

import pytest

from agent.wire import EventRecord
from mqtt_support import REPO, Fleet, commands_for, fast_config, wait_until


def test_mqtts_verifies_the_broker_against_the_given_ca(tmp_path, links, caplog):
    from broker import Broker
    from tls_files import write_tls_files

    ca, crt, key = write_tls_files(tmp_path)
    b = Broker(tmp_path / "broker", extra_config=(f"certfile {crt}\nkeyfile {key}\nallow_anonymous true\n"
                                                 )).start()
    try:
        url = f"mqtts://127.0.0.1:{b.port}"
        link = links(url, "dev-tls", ca_file=ca)
        assert wait_until(lambda: link.is_connected)
        fleet = Fleet(b, subscribe=["edge/v1/dev-tls/tele"], ca_file=ca)
        link.store.append(EventRecord(kind="tick"))
        assert link.flush(5) == {"unsent": 0, "connected": True}
        fleet.close()
        untrusting = links(url, "dev-tls2")  # the system's CAs do not know the test CA: no connection
        assert wait_until(lambda: "certificate verify failed" in caplog.text, 5)
        assert not untrusting.is_connected
    finally:
        b.stop()


USERS = {"dev-a": "pw-a", "dev-b": "pw-b", "_fleet": "pw-fleet", "_fleet-cmd": "pw-cmd"}


@pytest.fixture
def acl_broker(tmp_path):
    from broker import Broker

    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(USERS.items()):
        subprocess.run(["mosquitto_passwd", *(["-c"] if i == 0 else []), "-b", str(passwd), user, password],
                       check=True, capture_output=True)
    b = Broker(tmp_path / "broker", extra_config=(
        f"allow_anonymous false\npassword_file {passwd}\nacl_file {REPO / 'systemd' / 'mosquitto' / 'acl'}\n"
        "use_username_as_clientid true\n")).start()
    yield b
    b.stop()


def as_user(broker, user: str, subscribe: list[str]) -> Fleet:
    return Fleet(broker, subscribe, client_id=user, username=user, password=USERS[user])


def test_the_acl_keeps_each_device_to_its_own_topics(acl_broker, links, caplog):
    fleet = as_user(acl_broker, "_fleet", ["edge/v1/#"])  # the consumer: reads everything, writes nothing
    operator = as_user(acl_broker, "_fleet-cmd", ["edge/v1/+/cmd/res/#"])  # edge-fleet cmd
    dev_b = as_user(acl_broker, "dev-b", ["edge/v1/dev-b/cmd/req/#"])
    dev_a = as_user(acl_broker, "dev-a", ["edge/v1/dev-b/cmd/req/#", "edge/v1/+/cmd/req/#", "edge/v1/#"])

    # A cannot read B's commands: B gets its command, A gets only its own marker published after it; the
    # consumer's user cannot command anyone
    fleet.publish("edge/v1/dev-b/cmd/req/ping", b"from-the-consumer")
    operator.publish("edge/v1/dev-b/cmd/req/ping", b"for-b")
    operator.publish("edge/v1/dev-a/cmd/req/ping", b"marker-a")
    assert dev_b.wait(lambda f: any(m.payload == b"for-b" for m in f.messages))
    assert dev_a.wait(lambda f: any(m.payload == b"marker-a" for m in f.messages))
    assert not any(m.payload == b"for-b" for m in dev_a.messages)
    assert not any(m.payload == b"from-the-consumer" for m in dev_b.messages)

    # A cannot publish as B, nor command anyone (itself included); its own telemetry goes through
    forged = ["edge/v1/dev-b/tele", "edge/v1/dev-b/state", "edge/v1/dev-b/cmd/res", "edge/v1/dev-b/cmd/req/ping",
              "edge/v1/dev-a/cmd/req/ping", "edge/v1/dev-a/jobs/notify"]
    for t in forged:
        dev_a.publish(t, b"forged")
    dev_a.publish("edge/v1/dev-a/tele", b"marker-tele")
    assert fleet.wait(lambda f: any(m.payload == b"marker-tele" for m in f.messages))
    assert not [m.topic for m in fleet.messages if m.payload == b"forged"]
    dev_a.close()

    # The real link, as A, works under the ACL: birth, telemetry, a command round trip
    config = fast_config(acl_broker.url, username="dev-a", password="pw-a")
    link = links(acl_broker.url, "dev-a", handler=commands_for(config), username="dev-a", password="pw-a")
    assert fleet.wait(lambda f: (s := f.last_state("dev-a")) is not None and s.status == "online")
    link.store.append(EventRecord(kind="tick"))
    link.notify()
    assert fleet.wait(lambda f: (link.store.boot_id, 0) in f.tele_keys)
    assert operator.call("dev-a", "ping").ok

    # A link posing as B with A's credentials: the broker refuses its batches, so they stay unsent
    caplog.set_level(logging.WARNING, logger="agent.link.outbox")
    link.stop()
    impostor = links(acl_broker.url, "dev-b", username="dev-a", password="pw-a")
    for _ in range(3):
        impostor.store.append(EventRecord(kind="tick"))
    impostor.notify()
    assert wait_until(lambda: "refused a batch" in caplog.text, 5)
    assert impostor.store.count_unsent() == 3
    assert not any(m.topic == "edge/v1/dev-b/tele" for m in fleet.messages)
    for c in (fleet, operator, dev_b):
        c.close()
