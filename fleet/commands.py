"""Remote commands: one request per device on cmd/req/{name}, answers matched on cmd/res by correlation data.

MQTT v5 request/response (4.10): each request carries a Response Topic (the device's own cmd/res, which the
broker ACL lets it publish to) and unique Correlation Data that the device copies into its answer. A
Message Expiry Interval equal to the timeout means a device that was offline does not run a command
nobody is waiting for any more.

    outcomes = run_command("mqtt://broker:1883", ["dev-1", "dev-2"], "ping", {}, timeout_s=5)
    outcomes = run_command(Routes(("mqtt://b1:1883", "mqtt://b2:1883"), "fleet.db"), ["dev-1"], "ping", {}, 5)
"""
from __future__ import annotations

import fnmatch
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass

from pydantic import ValidationError

from agent.mqtt_link import Credentials
from agent.wire import COMMANDS, MAX_PAYLOAD_BYTES, CommandRequest, CommandResponse, device_of, topic
from fleet.mqtt import Inbound, Link, Session
from fleet.shards import Links, Routes

CONNECT_TIMEOUT_S = 10.0


class CommandError(ValueError):
    """A command that cannot be sent as asked (a user error)."""


def command_name(cli_name: str) -> str:
    """CLI spelling (get-config) -> wire name (get_config), checked against agent.wire.COMMANDS."""
    name = cli_name.replace("-", "_")
    if name not in COMMANDS:
        raise CommandError(f"unknown command {cli_name!r}: choose one of "
                           f"{', '.join(c.replace('_', '-') for c in COMMANDS)}")
    return name


def parse_assignments(pairs: list[str]) -> dict:
    """['threads=2', 'name=x'] -> {'threads': 2, 'name': 'x'}: values are JSON when they parse as JSON."""
    args = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CommandError(f"bad argument {pair!r}: expected KEY=VALUE")
        try:  # NaN and Infinity are not JSON: Python's parser takes them, and NaN would go out as null ("not given")
            args[key] = json.loads(value, parse_constant=_not_json)
        except json.JSONDecodeError:
            args[key] = value
    return args


def _not_json(name: str):
    raise CommandError(f"{name} is not a JSON number")


def select_targets(devices: list[dict], group: str | None) -> tuple[list[str], list[str]]:
    """Registry rows (fleet.queries.devices) -> (online ids to ask, offline ids skipped); `group` is a glob
    over device ids (e.g. 'store-12-*'), None for all devices."""
    chosen = [d for d in devices if group is None or fnmatch.fnmatchcase(d["id"], group)]
    if not chosen:
        raise CommandError(f"no known device matches {group!r}" if group else "no devices in the registry")
    return [d["id"] for d in chosen if d["online"]], [d["id"] for d in chosen if not d["online"]]


@dataclass(frozen=True)
class Outcome:
    device: str
    ok: bool
    latency_ms: float | None = None
    response: CommandResponse | None = None
    error: str | None = None  # ours (timeout, offline, malformed answer) or the device's

    def row(self) -> dict:
        result = self.response.result if self.response else None
        return {"device": self.device, "ok": self.ok, "latency_ms": self.latency_ms, "result": result,
                "error": self.error}


class _Waiter:
    """Pending requests by correlation data; filled from the network thread."""

    def __init__(self, sent_at: float):
        self.sent_at = sent_at
        self.pending: dict[bytes, str] = {}  # correlation data -> device id
        self.outcomes: dict[str, Outcome] = {}
        self.done = threading.Condition()

    def on_message(self, msg: Inbound) -> None:
        device_id = self.pending.get(msg.correlation_data or b"")
        if device_id is None or device_of(msg.topic) != device_id:
            return  # someone else's answer, or one on the wrong device's topic
        outcome = self._outcome(device_id, msg.payload)
        with self.done:
            self.outcomes.setdefault(device_id, outcome)
            self.done.notify_all()

    def fail(self, device_id: str, error: str) -> None:
        with self.done:
            self.outcomes.setdefault(device_id, Outcome(device_id, False, error=error))
            self.done.notify_all()

    def _outcome(self, device_id: str, payload: bytes) -> Outcome:
        latency_ms = round((time.monotonic() - self.sent_at) * 1000, 1)
        try:
            response = CommandResponse.model_validate_json(payload)
        except ValidationError as e:
            return Outcome(device_id, False, latency_ms, error=f"malformed response: {e.errors()[0]['msg']}")
        return Outcome(device_id, response.ok, latency_ms, response, response.error)

    def wait(self, count: int, deadline: float) -> None:
        with self.done:
            while len(self.outcomes) < count and time.monotonic() < deadline:
                self.done.wait(deadline - time.monotonic())


# Mosquitto answers a publish no subscription matched with PUBACK 0x10 and drops it: a device that has never
# connected (a mistyped id) or whose session expired: said at once, rather than "no response" after the whole
# --timeout. An offline device's persistent session still matches, and its request waits there.
NO_SUCH_SESSION = "no device session subscribes to it (a mistyped device id, or a device whose session expired)"


def run_command(routes: str | Routes, devices: list[str], name: str, args: dict, timeout_s: float,
                credentials: Credentials = Credentials()) -> list[Outcome]:
    """Send `name` to every device at once, each on its broker (routes: a broker URL, or fleet.shards.Routes
    when devices are spread over several), and wait up to timeout_s for all answers. Answers come back on
    cmd/res/{this run's id}, so concurrent runs never see each other's."""
    routes = Routes((routes,)) if isinstance(routes, str) else routes
    run_id = f"edge-fleet-cmd-{uuid.uuid4().hex[:12]}"
    request = CommandRequest(args=args).model_dump_json().encode()
    if len(request) > MAX_PAYLOAD_BYTES:  # over it, the broker drops the request or cuts the connection
        raise CommandError(f"the request is {len(request)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    waiter = _Waiter(time.monotonic())
    broker_of = routes.brokers_of(devices)
    links = Links({url: Link(url, Session(run_id, persistent=False, manual_ack=False),
                             [(topic(d, "cmd", "res", run_id), 1) for d in devices if broker_of[d] == url],
                             waiter.on_message, credentials)
                   for url in dict.fromkeys(broker_of.values())}).start()
    try:
        _wait_connected(links)
        waiter.sent_at = time.monotonic()
        for device_id in devices:
            correlation = uuid.uuid4().bytes
            waiter.pending[correlation] = device_id
            sent = links[broker_of[device_id]].publish_confirmed(
                topic(device_id, "cmd", "req", name), request, CONNECT_TIMEOUT_S,
                response_topic=topic(device_id, "cmd", "res", run_id), correlation_data=correlation,
                expiry_s=math.ceil(timeout_s), unmatched=NO_SUCH_SESSION)
            if sent is not True:  # refused by the ACL: said as such, not as a device that never answered
                waiter.fail(device_id, f"request not sent: {sent or 'the connection to the broker was lost'}")
        waiter.wait(len(devices), waiter.sent_at + timeout_s)
    finally:
        links.stop()
    # A device that got the request before the deadline may still be carrying it out; one that gets it later
    # drops it (the request expires with the timeout), so a retry cannot run it twice after this
    return [waiter.outcomes.get(d) or Outcome(d, False, error=f"no response within {timeout_s:g} s (a device that "
                                                              f"received it may still be carrying it out)")
            for d in devices]


def _wait_connected(links: Links) -> None:
    """Every link connected and subscribed; a refusal or an unreachable broker ends it at once (as mosquitto_pub
    does), not at the deadline."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    for url, link in links.items():
        while not link.wait_ready(0.05):
            if link.refusal or link.connect_error or time.monotonic() > deadline:
                raise CommandError(link.refusal or f"cannot reach the MQTT broker at {url}"
                                   + (f": {link.connect_error}" if link.connect_error else ""))
