"""Devices spread over several brokers (sharded Mosquitto, which does not cluster): the fleet's brokers as the
CLI names them, one MQTT link per broker, and which broker reaches a given device.

A device connects to `agent.wire.shard_of(its id, shards)`; the consumer subscribes on every broker (each
link with the same client id and shared group: they are different servers), and the registry records the
broker each device's newest state came through (`devices.broker`). Commands and rollout notices go to that
broker, and to the device's shard_of only when the registry has none of ours for it (a device not yet heard
from): the registry is where the device really connected, whatever its configuration says. With one broker
all of this is that broker.

    brokers = parse_brokers(["mqtt://a:1883,mqtt://b:1883"])
    routes = Routes(brokers, "fleet.db"); routes.broker_of("dev-0042")  # -> "mqtt://b:1883"
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from agent.mqtt_link import parse_url
from agent.wire import shard_of
from fleet.db import Database, database_errors, is_url, open_database
from fleet.mqtt import Link

log = logging.getLogger(__name__)

LOOKUP_CHUNK = 500  # device ids per registry query: `cmd --all` over a large fleet stays under the bound-parameter
# limits (SQLite's 32,766, PostgreSQL's 65,535)


def parse_brokers(values: Iterable[str]) -> tuple[str, ...]:
    """--mqtt values, each one broker URL or several joined by commas -> the URLs, each checked (LinkError, a
    ValueError, names a bad one). A URL given twice is refused: two links with one client id to one broker
    would take each other's session over."""
    urls = tuple(u.strip() for value in values for u in value.split(",") if u.strip())
    if not urls:
        raise ValueError("give at least one broker URL")
    for url in urls:
        parse_url(url)
    if len(set(urls)) != len(urls):
        raise ValueError(f"a broker URL is given twice in {', '.join(urls)}")
    return urls


class Routes:
    """Which of `brokers` reaches a device: the registry's broker for it when it is one of them, else its
    shard_of. target: the fleet database (None: shard_of alone). Thread-safe: each thread reads the registry
    through its own connection (the rollout driver's and the CLI's)."""

    def __init__(self, brokers: Sequence[str], target=None):
        self.brokers = tuple(brokers)
        self.target = target
        self._local = threading.local()

    def broker_of(self, device_id: str) -> str:
        return self.brokers_of([device_id])[device_id]

    def brokers_of(self, device_ids: Sequence[str]) -> dict[str, str]:
        if len(self.brokers) == 1:
            return {d: self.brokers[0] for d in device_ids}
        known = self._registry(device_ids)
        return {d: known[d] if known.get(d) in self.brokers else shard_of(d, self.brokers) for d in device_ids}

    def _registry(self, device_ids: Sequence[str]) -> dict[str, str | None]:
        if self.target is None or not device_ids:
            return {}
        ids = list(device_ids)
        try:
            db = self._db()
            return {r["id"]: r["broker"] for start in range(0, len(ids), LOOKUP_CHUNK)
                    for chunk in [ids[start:start + LOOKUP_CHUNK]]
                    for r in db.query(f"select id, broker from devices where id in ({', '.join('?' * len(chunk))})",
                                      chunk)}
        except database_errors() as e:  # the hash is right for every device that never moved: use it
            log.warning("cannot read the devices' brokers from %s (%s): routing by the hash of their ids",
                        self.target, e)
            self._local.db = None
            return {}

    def _db(self) -> Database:
        if getattr(self._local, "db", None) is None:
            self._local.db = open_database(self.target, readonly=True)
        return self._local.db


def cli_routes(values: Iterable[str], target) -> Routes:
    """`edge-fleet cmd`'s routes to the brokers its --mqtt values name: through the registry when there is one
    to read (a URL, or a SQLite file that exists: one device's command needs no database), else by the hash."""
    brokers = parse_brokers(values)
    readable = is_url(target) or Path(target).is_file()
    return Routes(brokers, target if len(brokers) > 1 and readable else None)


class Links(dict[str, Link]):
    """One Link per broker URL, started, waited on and stopped together."""

    def start(self) -> "Links":
        for link in self.values():
            link.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        """Whether every link is connected and subscribed (all waits share the timeout)."""
        deadline = time.monotonic() + timeout_s
        return all(link.wait_ready(max(0.0, deadline - time.monotonic())) for link in self.values())

    def stop(self) -> None:
        for link in self.values():
            link.stop()
