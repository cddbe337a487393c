"""Commands over the MQTT link against a real Mosquitto: round trips with correlation data, expiry, retained
requests, floods, oversized job documents, dispatch without an engine, and fuzzed malformed requests."""
from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import time

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from pydantic import ValidationError

from agent.link.commands import CommandError, Commands, Device, LiveSettings
from agent.config import AgentConfig
from agent.link.mqtt import MqttLink
from agent.link.store import TelemetryStore
from agent.wire import COMMANDS, MAX_PAYLOAD_BYTES, CommandRequest, CommandResponse, EventRecord, topic
from mqtt_support import TIMEOUT_S, Fleet, commands_for, fast_config, wait_until


def test_a_command_that_expires_behind_a_slow_one_is_not_run(broker, links):
    """The desk ran commands in turn whatever their age, so a set_config queued behind a
    benchmark was applied after `edge-fleet cmd` had told the operator "no response" and exited 1."""
    ran = []

    def handler(name: str, request: CommandRequest) -> CommandResponse:
        ran.append(name)
        if name == "benchmark":
            time.sleep(2.0)
        return CommandResponse(command=name, ok=True, result={})

    link = links(broker.url, "dev-e", handler=handler)
    fleet = Fleet(broker, subscribe=["edge/v1/dev-e/cmd/res/#"])
    assert wait_until(lambda: link.is_connected)
    fleet.request("dev-e", "benchmark", b"{}", correlation=b"slow")
    fleet.request("dev-e", "set_config", b"{}", correlation=b"late", expiry_s=1)
    fleet.request("dev-e", "ping", b"{}", correlation=b"patient", expiry_s=30)
    assert fleet.wait(lambda f: b"patient" in f.responses, 10)
    assert ran == ["benchmark", "ping"] and b"late" not in fleet.responses
    fleet.close()


def test_commands_round_trip_with_correlation_data(broker, links):
    config = fast_config(broker.url, username="dev-c", password="hunter2")
    made = []
    handler = commands_for(config, flush=lambda: made[0].flush(1.0))
    link = links(broker.url, "dev-c", handler=handler, username="dev-c", password="hunter2")
    made.append(link)
    # telemetry too: a batch nobody subscribes to is kept (PUBACK "no matching subscribers")
    fleet = Fleet(broker, subscribe=["edge/v1/dev-c/cmd/res/#", "edge/v1/dev-c/tele", "edge/v1/dev-c/state"])
    # "online" follows the command subscription on the same connection, so the broker has it: a request sent
    # on is_connected alone could reach the broker first and be lost (seen under load)
    assert fleet.wait(lambda f: (s := f.last_state("dev-c")) is not None and s.status == "online")

    fleet.request("dev-c", "ping", b"{}", correlation=b"\x00\xffcorr")
    assert fleet.wait(lambda f: b"\x00\xffcorr" in f.responses)
    msg = fleet.responses[b"\x00\xffcorr"]
    assert msg.topic == "edge/v1/dev-c/cmd/res" and msg.properties.MessageExpiryInterval > 0
    pong = CommandResponse.model_validate_json(msg.payload)
    assert pong.ok and pong.command == "ping" and pong.result["pong"] is True

    got = fleet.call("dev-c", "get_config")
    assert got.ok and got.result["config"]["telemetry"]["mqtt"]["password"] == "**********"
    changed = fleet.call("dev-c", "set_config", {"threads": 3, "sampling": {"temperature": 0.2}})
    assert not changed.ok and "threads" in changed.result["refused"]
    assert changed.result["applied"]["sampling"] == {"temperature": 0.2}
    bad_range = fleet.call("dev-c", "set_config", {"sampling": {"top_p": 0}})
    assert not bad_range.ok and "top_p" in bad_range.error and "Value error" not in bad_range.error
    unknown = fleet.call("dev-c", "reboot")
    assert not unknown.ok and "unknown command 'reboot'" in unknown.error
    assert "not available" in fleet.call("dev-c", "rollback").error
    link.store.append(EventRecord(kind="tick"))
    flushed = fleet.call("dev-c", "telemetry_flush")
    assert flushed.ok and flushed.result == {"unsent": 0, "connected": True}

    fleet.request("dev-c", "ping", b"{}", correlation=b"elsewhere", response_topic="edge/v1/dev-x/cmd/res")
    assert not fleet.wait(lambda f: b"elsewhere" in f.responses, 0.5)  # never answered outside our topics

    link.stop()  # commands sent while the device is away wait in its persistent session
    fleet.request("dev-c", "ping", b"", correlation=b"queued")
    links(broker.url, "dev-c", handler=commands_for(config), username="dev-c", password="hunter2", db=link.store.path)
    assert fleet.wait(lambda f: b"queued" in f.responses)
    fleet.close()


def test_a_retained_command_is_not_run_on_connect(broker, links):
    """A command published with retain (by mistake) would otherwise run again on every reconnect."""
    fleet = Fleet(broker, subscribe=["edge/v1/dev-r/cmd/res/#"], client_id="fleet-retain")
    props = Properties(PacketTypes.PUBLISH)
    props.ResponseTopic, props.CorrelationData = topic("dev-r", "cmd", "res"), b"retained"
    fleet.publish(topic("dev-r", "cmd", "req", "ping"), b'{"args": {}}', retain=True, properties=props)
    link = links(broker.url, "dev-r", handler=commands_for(fast_config(broker.url)))
    assert wait_until(lambda: link.is_connected)
    assert fleet.call("dev-r", "ping").ok  # live commands are answered...
    assert b"retained" not in fleet.responses  # ...the retained one never was
    fleet.publish(topic("dev-r", "cmd", "req", "ping"), b"", retain=True)  # clear it from the broker
    fleet.close()


def test_an_answer_goes_out_on_the_connection_up_when_the_command_ends(broker, links):
    """A command still running when the connection changed was answered on the dead one: lost."""
    entered, release = threading.Event(), threading.Event()

    def slow(name: str, request: CommandRequest) -> CommandResponse:
        entered.set()
        release.wait(TIMEOUT_S)
        return CommandResponse(command=name, ok=True, result={"done": True})

    fleet = Fleet(broker, subscribe=["edge/v1/dev-s/cmd/res/#"], client_id="fleet-slow")
    link = links(broker.url, "dev-s", handler=slow)
    assert wait_until(lambda: link.is_connected)
    fleet.request("dev-s", "ping", b"{}", correlation=b"slow")
    assert entered.wait(TIMEOUT_S)  # the device has the request (and acknowledged it)
    fleet.subscribed.clear()
    broker.restart()
    assert fleet.subscribed.wait(TIMEOUT_S)  # the broker may not have saved our session: subscribed again
    assert wait_until(lambda: link.is_connected and link.store.connections >= 2)
    release.set()
    assert fleet.wait(lambda f: b"slow" in f.responses), "the answer was lost with the old connection"
    fleet.close()


def test_a_command_flood_is_answered_ok_or_busy_and_logged_in_a_few_counted_lines(broker, links):
    """A burst on a device's command topic: each command dropped for a full queue went unanswered (`edge-fleet
    cmd` waited out its --timeout) and wrote a warning of its own. Now every one is answered, ok or busy, and
    the warnings go out once a window (shortened to 1 s here) with the count of those held back."""
    import agent.link.mqtt as mqtt_module
    from agent.logs import Repeats, by_format
    from loglines import LogLines  # here, not at the top: the SIGKILL child runs this file as a script

    flood, batch = 2000, 250  # in batches, so that the broker's queue for the device (1,000) never overflows
    held = threading.Event()

    def held_up(name: str, request: CommandRequest) -> CommandResponse:
        held.wait(TIMEOUT_S)  # the worker holds the first command until the flood is in: the queue stays full
        return CommandResponse(command=name, ok=True, result={})

    link = links(broker.url, "dev-flood", handler=held_up)
    fleet = Fleet(broker, subscribe=["edge/v1/dev-flood/cmd/res/#"], client_id="fleet-flood")
    assert wait_until(lambda: link.is_connected)
    repeats, logs = Repeats(1.0, key=by_format), LogLines()
    mqtt_module.each_command.removeFilter(mqtt_module.COMMAND_REPEATS)  # one without the other tests' history
    mqtt_module.each_command.addFilter(repeats)
    logging.getLogger("agent.link.mqtt").addHandler(logs)

    def send(first: int, last: int) -> None:
        for i in range(first, last):
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic, props.CorrelationData = topic("dev-flood", "cmd", "res"), b"flood-%d" % i
            fleet.client.publish(topic("dev-flood", "cmd", "req", "ping"), b"{}", qos=1, properties=props)
        waiting = mqtt_module.COMMAND_QUEUE_MAX + 1  # answered once released: the one held and its queue
        answered = fleet.wait(lambda f: len(f.responses) >= last - waiting, TIMEOUT_S)
        missing = [i for i in range(first, last - waiting) if b"flood-%d" % i not in fleet.responses]
        assert answered, (f"{len(missing)} commands of {first}..{last} unanswered (first {missing[:5]}); "
                          f"{len(fleet.responses)} answers in all, link connections {link.store.connections}, "
                          f"{len(logs.lines)} log lines")

    try:
        started = time.monotonic()
        for first in range(0, flood, batch):
            send(first, first + batch)
        elapsed_s = time.monotonic() - started
        time.sleep(1.1)  # past the window: the next drop's line says how many were held back
        send(flood, flood + 1)
        held.set()
        assert fleet.wait(lambda f: all(b"flood-%d" % i in f.responses for i in range(flood + 1)), TIMEOUT_S)
    finally:
        held.set()
        logging.getLogger("agent.link.mqtt").removeHandler(logs)
        mqtt_module.each_command.removeFilter(repeats)
        mqtt_module.each_command.addFilter(mqtt_module.COMMAND_REPEATS)
    answers = [CommandResponse.model_validate_json(fleet.responses[b"flood-%d" % i].payload)
               for i in range(flood + 1)]
    ok = [a for a in answers if a.ok]
    busy = [a for a in answers if not a.ok]
    assert len(ok) == mqtt_module.COMMAND_QUEUE_MAX + 1  # the one held, and those that queued behind it
    assert all(a.command == "ping" and a.error.startswith("busy: ") for a in busy), {a.error for a in busy}
    lines = [line for line in logs.lines if "was dropped" in line]
    assert len(lines) <= elapsed_s / 1.0 + 2, lines  # once a window, not once a command
    counted = sum(int(m.group(1)) for line in lines if (m := re.search(r"\((\d+) more in the last 1 s\)", line)))
    assert len(lines) + counted == len(busy), lines  # each drop in a line or in a count
    fleet.close()


def test_an_oversized_job_document_is_dropped_with_a_log_line(broker, tmp_path, caplog):
    """It was dropped without a word."""
    from agent.wire import MAX_PAYLOAD_BYTES

    got = []
    store = TelemetryStore(tmp_path / "dev-j.db", "dev-j")
    link = MqttLink(fast_config(broker.url), "dev-j", store,
                    on_job=lambda payload, expiry_s: got.append((payload, expiry_s)))
    link.start()
    fleet = Fleet(broker, subscribe=["edge/v1/dev-j/state"], client_id="fleet-jobs-test")
    try:
        assert wait_until(lambda: link.is_connected) and fleet.wait(lambda f: f.last_state("dev-j") is not None)
        fleet.publish(topic("dev-j", "jobs", "notify"), b"x" * (MAX_PAYLOAD_BYTES + 1))
        fleet.publish(topic("dev-j", "jobs", "notify"), b"{}")
        expiring = Properties(PacketTypes.PUBLISH)
        expiring.MessageExpiryInterval = 600
        fleet.publish(topic("dev-j", "jobs", "notify"), b"[]", properties=expiring)  # the updater gets what is left
        assert wait_until(lambda: len(got) == 2) and got[0] == (b"{}", None)
        assert got[1][0] == b"[]" and 595 <= got[1][1] <= 600
        assert f"a job document of {MAX_PAYLOAD_BYTES + 1} bytes" in caplog.text
    finally:
        fleet.close()
        link.stop()
        store.close()


def test_commands_dispatch_without_an_engine():
    """The handler is pure dispatch over Device: a fake benchmark stands in for the engine."""
    from agent.link.commands import BenchmarkArgs
    from agent.wire import RequestFigures

    seen: list[BenchmarkArgs] = []

    def benchmark(spec: BenchmarkArgs) -> RequestFigures:
        seen.append(spec)
        return RequestFigures(prompt_tokens=5, completion_tokens=spec.max_tokens, queue_ms=0, ttft_ms=12.5,
                              prefill_tokens_per_s=400, decode_tokens_per_s=25, itl_p50_ms=40, itl_p95_ms=45,
                              e2e_ms=300, kv_bytes=1024, finish_reason="length")

    settings_ = LiveSettings()
    commands = Commands(Device(AgentConfig(), settings_, benchmark=benchmark))
    done = commands("benchmark", CommandRequest(args={"max_tokens": 8}))
    assert done.ok and done.result["figures"]["completion_tokens"] == 8 and seen[0].max_tokens == 8
    assert "max_tokens" in commands("benchmark", CommandRequest(args={"max_tokens": 0})).error
    assert "extra" in commands("ping", CommandRequest(args={"x": 1})).error.lower()
    same = commands("set_config", CommandRequest(args={"threads": None, "memory_budget_mb": 1024}))
    assert same.ok and same.result["applied"] == {"memory_budget_mb": 1024}  # already so: nothing to refuse
    assert not commands("set_config", CommandRequest(args={})).ok
    unknown = commands("set_config", CommandRequest(args={"max_batch": 8})).error  # the
    assert "'max_batch'" in unknown and "memory_budget_mb, threads, sampling" in unknown  # help's own example
    commands("set_config", CommandRequest(args={"sampling": {"temperature": 0.5}}))
    commands("set_config", CommandRequest(args={"sampling": {"top_k": 40}}))
    assert settings_.sampling.given() == {"temperature": 0.5, "top_k": 40}  # updates merge
    cleared = commands("set_config", CommandRequest(args={"sampling": {"temperature": None}}))
    assert cleared.ok and settings_.sampling.given() == {"top_k": 40}  # null clears (not ignored)
    assert "no broker" in commands("telemetry_flush", CommandRequest()).error
    assert "no model" in Commands(Device(AgentConfig(), LiveSettings()))("benchmark", CommandRequest()).error
    wired = Commands(Device(AgentConfig(), LiveSettings(), rollback=lambda: {"queued": True}))
    assert wired("rollback", CommandRequest()).result == {"queued": True}
    assert "bad args" in wired("rollback", CommandRequest(args={"why": "test"})).error  # refused, not ignored

    def refuse():
        raise CommandError("no previous model to roll back to")

    refused = Commands(Device(AgentConfig(), LiveSettings(), rollback=refuse))("rollback", CommandRequest())
    assert not refused.ok and refused.error == "no previous model to roll back to"  # edge-fleet cmd exits 1


def is_valid_request(payload: bytes) -> bool:
    if len(payload) > MAX_PAYLOAD_BYTES:
        return False
    try:
        CommandRequest.model_validate_json(payload or b"{}")
        return True
    except ValidationError:
        return False


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


_dumps = lambda v: json.dumps(v).encode()  # noqa: E731


PAYLOADS = st.one_of(
    st.binary(min_size=1, max_size=300),  # mostly not JSON, often not UTF-8
    _json.map(_dumps),  # JSON, mostly not an object
    st.dictionaries(st.text(max_size=10).filter(lambda k: k != "args"), _json, min_size=1, max_size=4).map(_dumps),
    _json.filter(lambda v: not isinstance(v, dict)).map(lambda v: _dumps({"args": v})),  # args not an object
    st.integers(MAX_PAYLOAD_BYTES - 16, MAX_PAYLOAD_BYTES + 4096).map(  # over the limit (else well formed)
        lambda n: b'{"args": {"x": "' + b"a" * n + b'"}}'),
)


NAMES = st.one_of(st.sampled_from(COMMANDS), st.text(
    st.characters(exclude_categories=("Cc", "Cs", "Cn", "Co"), exclude_characters="/+#"), min_size=1, max_size=40))


COMMAND_CASES = 1000


def test_malformed_and_oversized_commands_are_refused_and_the_link_keeps_serving(broker, links, figures):
    """(e) >= 1,000 bad requests: each is answered with an error, or (no response topic) dropped with a logged
    reason; a ping afterwards still works."""
    config = fast_config(broker.url)
    link = links(broker.url, "dev-f", handler=commands_for(config))
    fleet = Fleet(broker, subscribe=["edge/v1/dev-f/cmd/res/#"])
    assert wait_until(lambda: link.is_connected)
    from loglines import LogLines  # here, not at the top: the SIGKILL child runs this file as a script

    logs = LogLines()
    logging.getLogger("agent.link.mqtt").addHandler(logs)
    n = itertools.count()

    @settings(max_examples=COMMAND_CASES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(name=NAMES, payload=PAYLOADS, answer=st.integers(0, 3))
    def bad_request_is_refused(name, payload, answer):
        assume(name not in COMMANDS or not is_valid_request(payload))
        i = next(n)
        if answer:  # 3 in 4 carry a response topic
            correlation = f"fuzz-{i}".encode()
            fleet.request("dev-f", name, payload, correlation)
            assert fleet.wait(lambda f: correlation in f.responses, 5), (name, payload[:80])
            response = CommandResponse.model_validate_json(fleet.responses[correlation].payload)
            assert not response.ok and response.error
        else:
            before = logs.count("has no response topic")
            fleet.request("dev-f", name, payload, response_topic=None)
            assert wait_until(lambda: logs.count("has no response topic") > before, 5), (name, payload[:80])

    started = time.monotonic()
    try:
        bad_request_is_refused()
    finally:
        logging.getLogger("agent.link.mqtt").removeHandler(logs)
    cases = next(n)
    assert cases >= COMMAND_CASES
    assert link.is_connected and fleet.call("dev-f", "ping").ok
    fleet.close()
    figures.append(f"command payloads: {cases} fuzzed MQTT requests through Mosquitto in "
                   f"{time.monotonic() - started:.0f} s, each refused with a reason, no crash; ping still answered")
