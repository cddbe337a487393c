"""The MQTT link riding out failures of its own: database errors while connecting, a full disk, rows that cannot be
marked sent, a broker that drops the connection or refuses the subscription. Each of these once left a device
offline or its telemetry stuck."""
from __future__ import annotations

import sqlite3
import time

import agent.link.outbox
from agent.link.mqtt import MqttLink
from agent.link.store import TelemetryStore
from agent.wire import EventRecord
from mqtt_support import Fleet, fast_config, wait_until


def fail_once(obj, name: str, error: Exception) -> list[int]:
    """Make obj.name raise `error` on its first call; returns the list its calls are counted in."""
    real, calls = getattr(obj, name), []

    def once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kw)

    setattr(obj, name, once)
    return calls


def test_a_database_error_while_connecting_is_a_failed_attempt_not_the_end_of_the_link(broker, tmp_path):
    """SQLite locked (a backup, the CLI) while counting the connection ended the link thread for good."""
    store = TelemetryStore(tmp_path / "dev-l.db", "dev-l")
    calls = fail_once(store, "next_connection", sqlite3.OperationalError("database is locked"))
    link = MqttLink(fast_config(broker.url), "dev-l", store)
    link.start()
    try:
        assert wait_until(lambda: link.is_connected), link.state
        assert len(calls) == 2
    finally:
        link.stop()
        store.close()


def test_a_device_whose_disk_is_full_still_connects(broker, tmp_path):
    store = TelemetryStore(tmp_path / "dev-f.db", "dev-f")
    store.db.execute("PRAGMA query_only = 1")  # every write fails, as on a full disk
    link = MqttLink(fast_config(broker.url), "dev-f", store)
    link.start()
    try:
        assert wait_until(lambda: link.is_connected), link.state
    finally:
        link.stop()
        store.close()


def test_a_failed_mark_sent_sends_the_rows_again_on_the_same_connection(broker, links, monkeypatch):
    """The rows stayed unsent until the next reconnect, weeks away on a steady link."""
    monkeypatch.setattr(agent.link.outbox, "REFUSED_PAUSE_S", 0.2)
    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"], client_id="fleet-marksent")
    link = links(broker.url, "dev-m")
    assert wait_until(lambda: link.is_connected)
    calls = fail_once(link.store, "mark_sent", sqlite3.OperationalError("database is locked"))
    for i in range(3):
        link.store.append(EventRecord(kind="tick", detail={"i": i}))
    link.notify()
    assert wait_until(lambda: link.store.count_unsent() == 0), link.store.count_unsent()
    assert len(calls) >= 2 and link.store.connections == 1
    fleet.close()


def test_rows_that_cannot_be_marked_sent_go_again_after_a_pause_said_once(broker, links, caplog):
    """On a card remounted read-only: mark_sent failed after every PUBACK and the same batch
    went again every second, for good, with a traceback each time (a cellular link pays for each copy)."""
    fleet = Fleet(broker, subscribe=["edge/v1/+/tele"], client_id="fleet-readonly")
    link = links(broker.url, "dev-ro")
    assert wait_until(lambda: link.is_connected)

    def read_only(rows):
        raise sqlite3.OperationalError("attempt to write a readonly database")

    link.store.mark_sent = read_only
    link.store.append(EventRecord(kind="tick"))
    link.notify()
    batches = lambda: [m for m in fleet.messages if m.topic.endswith("/tele")]  # noqa: E731
    assert fleet.wait(lambda f: len(batches()) >= 1)
    time.sleep(4.0)  # four outbox passes at least
    assert len(batches()) == 1 and link.store.count_unsent() >= 1
    said = [r for r in caplog.records if "cannot mark them sent" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None and "outbox pass failed" not in caplog.text
    fleet.close()


def test_a_connection_the_broker_drops_at_once_backs_off(broker, links):
    """A second device with the same id (a cloned image) takes the session over at each connect: both
    reconnected twice a second for good, since every CONNACK reset the backoff."""
    a = links(broker.url, "dev-clone", backoff_max_s=1.0)
    b = links(broker.url, "dev-clone", backoff_max_s=1.0)
    time.sleep(5.0)
    attempts = a.store.connections + b.store.connections
    assert attempts <= 20, f"{attempts} connections in 5 s"


def test_a_refused_subscription_takes_the_device_offline_and_is_retried(tmp_path, links, caplog):
    """With its command subscription refused the link stayed connected and 'online', deaf to
    commands and updates, and never subscribed again."""
    from broker import acl_denying_broker

    b = acl_denying_broker(tmp_path / "dynsec", {"dev-s": "pw"}, {"dev-s": ["edge/v1/dev-s/#"]}, {})
    try:
        link = links(b.url, "dev-s", username="dev-s", password="pw")
        assert wait_until(lambda: "refused our subscription to edge/v1/dev-s/cmd/req/+" in caplog.text)
        assert wait_until(lambda: not link.is_connected)
        assert wait_until(lambda: caplog.text.count("refused our subscription") >= 2)  # it asks again
    finally:
        b.stop()
