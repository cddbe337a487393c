"""The fleet's MQTT link: its pure parts (credentials, backoff, subscriptions) and its reconnect loop against a
real broker. The parts it shares with the device's link are tested in tests/agent/test_mqtt_link.py."""
from __future__ import annotations

import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet_support import wait_until
from fleet.consumer import subscriptions
from agent.mqtt_link import Credentials, LinkError, LinkState, backoff_delay_s
from fleet.mqtt import BACKOFF_BASE_S, BACKOFF_CAP_S, Link, Session


def test_credentials(tmp_path):
    (tmp_path / "pw").write_text("s3cret\n")
    assert Credentials.from_files("_fleet", tmp_path / "pw", None) == Credentials("_fleet", "s3cret")
    assert "s3cret" not in repr(Credentials("_fleet", "s3cret"))
    with pytest.raises(LinkError, match="needs a user name"):
        Credentials.from_files(None, tmp_path / "pw", None)
    with pytest.raises(LinkError, match="needs an mqtts://"):
        Link("mqtt://h", Session("x"), [], print, Credentials(ca_file=tmp_path / "ca.crt"))


@given(st.integers(0, 1000), st.integers(0, 2**32))
def test_backoff_is_jittered_capped_and_never_zero(attempt, seed):
    delay = backoff_delay_s(attempt, BACKOFF_BASE_S, BACKOFF_CAP_S, random.Random(seed))
    ceiling = min(BACKOFF_CAP_S, 0.5 * 2 ** min(attempt, 30))
    assert ceiling / 2 <= delay <= ceiling


def test_backoff_spreads_replicas():
    delays = {round(backoff_delay_s(5, BACKOFF_BASE_S, BACKOFF_CAP_S, random.Random(seed)), 3) for seed in range(20)}
    assert len(delays) > 15


def test_subscriptions():
    assert subscriptions() == [("edge/v1/+/state", 1), ("edge/v1/+/tele", 1), ("edge/v1/+/evt/+", 1)]
    assert subscriptions("g") == [("edge/v1/+/state", 1), ("$share/g/edge/v1/+/tele", 1),
                                  ("$share/g/edge/v1/+/evt/+", 1)]


def test_link_reconnects_after_the_broker_comes_back(broker):
    received = []
    link = Link(broker.url, Session("link-test"), [("t/#", 1)], received.append).start()
    try:
        assert link.wait_ready(10)
        broker.stop()
        wait_until(lambda: link.state in (LinkState.BACKOFF, LinkState.CONNECTING), message="the drop")
        assert not link.wait_ready(1.0)
        broker.start()
        assert link.wait_ready(15) and link.generation == 2 and link.state is LinkState.CONNECTED
        assert link.publish("t/x", b"hello")
        wait_until(lambda: [m.payload for m in received] == [b"hello"])
        assert link.ack(received[0])
    finally:
        link.stop()
    assert link.state is LinkState.STOPPED


def test_a_publish_while_disconnected_is_refused_and_never_sent_later(broker):
    """paho queued what publish() reported as not sent and delivered it after the reconnect,
    while the rollout driver retried every pass: an outage's notices went out as a burst of copies."""
    import time

    received = []
    link = Link(broker.url, Session("pub-test"), [("t/#", 1)], received.append).start()
    try:
        assert link.wait_ready(10)
        broker.stop()
        wait_until(lambda: link.state in (LinkState.BACKOFF, LinkState.CONNECTING), message="the drop")
        assert [link.publish("t/x", b"while away") for _ in range(10)] == [False] * 10
        broker.start()
        assert link.wait_ready(15)
        assert link.publish("t/x", b"after")
        wait_until(lambda: b"after" in [m.payload for m in received])
        time.sleep(0.3)
        assert [m.payload for m in received] == [b"after"]
    finally:
        link.stop()


def test_refused_subscriptions_and_publishes_are_named(tmp_path):
    """A refused subscription counted as ready (the consumer then stored nothing devices sent)
    and a refused publish as sent (a command or a rollout notice the ACL dropped looked like a silent device)."""
    from broker import acl_denying_broker

    b = acl_denying_broker(tmp_path / "dynsec", {"fleet-a": "pw"}, {"fleet-a": ["edge/v1/dev-1/cmd/req/#"]},
                           {"fleet-a": ["edge/v1/+/cmd/res/#"]})
    try:
        deaf = Link(b.url, Session("fleet-a"), [("edge/v1/+/tele", 1)], lambda m: None,
                    Credentials("fleet-a", "pw")).start()
        assert not deaf.wait_ready(3)
        assert "refused the subscription to edge/v1/+/tele" in (deaf.refusal or "")
        deaf.stop()
        link = Link(b.url, Session("fleet-a"), [("edge/v1/dev-1/cmd/res/#", 1)], lambda m: None,
                    Credentials("fleet-a", "pw")).start()
        assert link.wait_ready(5) and link.refusal is None
        assert link.publish_confirmed("edge/v1/dev-1/cmd/req/ping", b"{}", 5) is True
        refused = link.publish_confirmed("edge/v1/dev-2/cmd/req/ping", b"{}", 5)
        assert isinstance(refused, str) and "Not authorized" in refused
        link.stop()
    finally:
        b.stop()


class Watcher:
    """A device's view of its job notices: every copy the broker delivers."""

    def __init__(self, broker, topic: str = "edge/v1/dev-1/jobs/notify"):
        import threading

        import paho.mqtt.client as paho

        self.got, subscribed = [], threading.Event()
        c = self.client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="watcher", protocol=paho.MQTTv5)
        c.on_connect = lambda c, *a: c.subscribe(topic, qos=1)
        c.on_subscribe = lambda *a: subscribed.set()
        c.on_message = lambda c, u, m: self.got.append(m.payload)
        c.connect("127.0.0.1", broker.port)
        c.loop_start()
        assert subscribed.wait(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("signed", [False, True])
def test_a_notice_unconfirmed_over_a_silent_link_is_waited_on_not_published_again(broker, tmp_path, signed):
    """Over a link gone silent without closing, each rollout pass published a new copy of a
    notice (each given up on after its wait) and all of them reached the device once the link came back; with
    a job key each pass also signed it anew, so no two copies were the same message."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agent.wire import JobDocument
    from fleet.updates import RolloutDriver
    from slowlink import SlowUplink

    watcher, uplink = Watcher(broker), SlowUplink(broker.port)
    link = Link(uplink.url, Session("fleet-silent"), [], lambda m: None).start()
    waits = iter([5.0] + [0.2] * 5 + [5.0])
    driver = RolloutDriver(tmp_path / "fleet.db", lambda t, p, e: link.publish_confirmed(t, p, next(waits),
                                                                                          expiry_s=e),
                           "http://unused", job_key=Ed25519PrivateKey.generate() if signed else None)
    try:
        assert link.wait_ready(10)
        assert driver._notify(JobDocument(job_id="j0", operation="rollback"), "dev-1", 1800.0) is True
        uplink.frozen.set()
        for _ in range(5):  # five passes of the rollout driver while the link is silent
            assert driver._notify(JobDocument(job_id="j1", operation="rollback"), "dev-1", 1800.0) is False
        uplink.frozen.clear()
        assert driver._notify(JobDocument(job_id="j1", operation="rollback"), "dev-1", 1800.0) is True
        assert wait_until(lambda: len(watcher.got) >= 2)
        time.sleep(0.5)  # any further copies would have arrived by now
        assert len(watcher.got) == 2 and b"j0" in watcher.got[0] and b"j1" in watcher.got[1], watcher.got
    finally:
        link.stop()
        uplink.close()
        watcher.close()
