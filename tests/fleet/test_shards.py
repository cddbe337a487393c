"""Devices spread over several brokers: the hash both sides agree on, the agent's and the CLI's broker lists, the
registry's broker column, and three real Mosquitto shards under two fleet replicas."""
from __future__ import annotations

import itertools
from collections import Counter

import pytest

from agent.wire import DeviceState, shard_of
from devicepool import DevicePool
from fleet_support import wait_until

SHARDS = ["mqtt://shard-a:1883", "mqtt://shard-b:1883", "mqtt://shard-c:1883"]


# ---- shard_of ---------------------------------------------------------------------------------------------------
def test_shard_of_is_pinned():
    """Agents and fleets of different releases must agree: the hash is part of the wire contract."""
    assert [shard_of(d, SHARDS) for d in ("dev-000", "dev-001", "box-0042")] == [SHARDS[2]] * 3
    assert shard_of("dev-003", SHARDS) != SHARDS[2] or shard_of("dev-004", SHARDS) != SHARDS[2]


def test_shard_of_does_not_depend_on_the_list_order():
    ids = [f"dev-{i:03d}" for i in range(300)]
    expected = [shard_of(d, SHARDS) for d in ids]
    for order in itertools.permutations(SHARDS):
        assert [shard_of(d, list(order)) for d in ids] == expected


def test_shard_of_balances_the_devices():
    few = Counter(shard_of(f"dev-{i:03d}", SHARDS) for i in range(300))
    assert set(few) == set(SHARDS) and all(abs(n - 100) <= 15 for n in few.values()), few  # within 5% of 300
    many = Counter(shard_of(f"dev-{i:05d}", SHARDS) for i in range(30_000))
    assert all(abs(n - 10_000) <= 300 for n in many.values()), many  # within 1%


def test_adding_a_shard_moves_only_the_devices_it_takes():
    ids = [f"dev-{i:05d}" for i in range(30_000)]
    grown = [*SHARDS, "mqtt://shard-d:1883"]
    moved = [d for d in ids if shard_of(d, SHARDS) != shard_of(d, grown)]
    assert all(shard_of(d, grown) == grown[-1] for d in moved)  # nobody moves between the old shards
    assert 0.23 < len(moved) / len(ids) < 0.27  # ~1/4


def test_shard_of_needs_a_broker():
    with pytest.raises(ValueError):
        shard_of("dev-1", [])


# ---- configuration ----------------------------------------------------------------------------------------------
def test_the_agent_connects_to_its_shard_or_its_one_url():
    from agent.config import MqttConfig

    assert MqttConfig(url="mqtt://one:1883").broker_url("dev-000") == "mqtt://one:1883"
    assert MqttConfig(shards=SHARDS).broker_url("dev-000") == shard_of("dev-000", SHARDS)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of url"),
    ({"url": SHARDS[0], "shards": SHARDS}, "exactly one of url"),
    ({"shards": []}, "at least 1 item"),
    ({"shards": [SHARDS[0], SHARDS[0]]}, "twice"),
    ({"shards": [SHARDS[0], "mqtts://shard-b"]}, "must all be mqtt:// or all mqtts://"),
    ({"shards": ["http://shard-a"]}, "bad broker URL"),
])
def test_a_bad_shard_list_is_refused(kwargs, message):
    from pydantic import ValidationError

    from agent.config import MqttConfig

    with pytest.raises(ValidationError) as e:
        MqttConfig(**kwargs)
    assert message in str(e.value)


def test_the_agents_mqtt_flag_replaces_the_shard_list(tmp_path):
    from agent.service.serve import load_agent_config

    toml = tmp_path / "agent.toml"
    toml.write_text(f"[telemetry.mqtt]\nshards = {SHARDS!r}\nkeepalive_s = 30\n".replace("'", '"'))
    assert load_agent_config(toml).telemetry.mqtt.shards == SHARDS
    flagged = load_agent_config(toml, mqtt="mqtt://one:1883").telemetry.mqtt
    assert (flagged.url, flagged.shards, flagged.keepalive_s) == ("mqtt://one:1883", None, 30)


def test_the_cli_takes_brokers_repeated_or_joined_with_commas():
    from fleet.shards import parse_brokers

    assert parse_brokers([f"{SHARDS[0]}, {SHARDS[1]}", SHARDS[2]]) == tuple(SHARDS)
    for bad, message in (([SHARDS[0], SHARDS[0]], "twice"), (["http://x"], "bad broker URL"), ([","], "at least one")):
        with pytest.raises(ValueError, match=message):
            parse_brokers(bad)


# ---- the registry's broker --------------------------------------------------------------------------------------
def _state(connection: int, status: str = "online") -> DeviceState:
    return DeviceState(device_id="d1", status=status, connection=connection, boot_id="b", ts=1000.0 + connection)


def test_the_registry_keeps_the_broker_of_the_newest_state(fleet_target):
    """A device moved to a new shard: the retained state its old broker still holds (an older connection)
    arrives after the new birth, and must not take the device back there."""
    from fleet.store import FleetStore, Ingest
    from fleet.shards import Routes

    store = FleetStore(fleet_target)

    def commit(state: DeviceState, broker: str | None) -> None:
        ingest = Ingest()
        ingest.add_state(state, state.ts, broker=broker)
        store.commit(ingest)

    commit(_state(1), SHARDS[0])
    commit(_state(2), SHARDS[1])  # the birth on its new shard
    commit(_state(1, "offline"), SHARDS[0])  # the old shard's Will, late
    commit(_state(1), SHARDS[0])  # ... and its retained birth, replayed
    assert store.db["devices"].get("d1")["broker"] == SHARDS[1]
    commit(_state(2, "offline"), None)  # a state from nowhere known keeps the broker
    assert store.db["devices"].get("d1")["broker"] == SHARDS[1]
    routes = Routes(SHARDS, fleet_target)
    assert routes.broker_of("d1") == SHARDS[1]  # the registry, whatever the hash says
    assert routes.broker_of("never-seen") == shard_of("never-seen", SHARDS)
    assert Routes(SHARDS[:1] + SHARDS[2:], fleet_target).broker_of("d1") == shard_of("d1", [SHARDS[0], SHARDS[2]])
    store.close()


def test_the_registry_is_read_in_chunks(tmp_path, monkeypatch):
    """`cmd --all` over a fleet larger than a query's bound-parameter limit."""
    import fleet.shards
    from fleet.store import FleetStore, Ingest

    monkeypatch.setattr(fleet.shards, "LOOKUP_CHUNK", 2)
    store = FleetStore(tmp_path / "fleet.db")
    ingest = Ingest()
    for i in range(5):
        ingest.add_state(DeviceState(device_id=f"d{i}", status="online", connection=1, boot_id="b", ts=1000.0),
                         1000.0, broker=SHARDS[i % 3])
    store.commit(ingest)
    ids = [f"d{i}" for i in range(5)]
    assert fleet.shards.Routes(SHARDS, tmp_path / "fleet.db").brokers_of(ids) == {d: SHARDS[i % 3]
                                                                                 for i, d in enumerate(ids)}


def stored_keys(db) -> set[tuple]:
    return {tuple(r) for t in ("requests", "samples", "events")
            for r in db.execute(f"select device_id, boot_id, seq from {t}").fetchall()}


# ---- three Mosquitto shards, 300 devices, two replicas ------------------------------------------------------------
@pytest.fixture
def shards(tmp_path):
    from broker import Broker

    started = [Broker(tmp_path / f"shard-{k}").start() for k in range(3)]
    yield {b.url: b for b in started}
    for b in started:
        b.stop()


@pytest.fixture
def sharded_devices(shards):
    from simdevice import SimDevice

    made = []

    def make(device_id: str, url: str | None = None, **kwargs) -> SimDevice:
        """A started device on its shard (or on `url`: one configured with a single broker)."""
        device = SimDevice(shards[url or shard_of(device_id, list(shards))].port, device_id, **kwargs).start()
        made.append(device)
        return device

    yield make
    for device in made:
        device.client.disconnect()
        device.client.loop_stop()


def test_three_shards_two_replicas_store_everything_once_and_reach_every_shard(tmp_path, shards, sharded_devices):
    from agent.mqtt_link import Credentials
    from fleet.commands import run_command
    from fleet.consumer import Artifacts, Consumer, _start_rollouts
    from fleet.db import open_database
    from fleet.shards import Routes
    from fleet.store import FleetStore
    from fleet.updates import create_job

    db_path, urls = tmp_path / "fleet.db", list(shards)
    ids = [f"dev-{i:03d}" for i in range(300)]
    wanted = {d: shard_of(d, urls) for d in ids}
    replicas = [Consumer(FleetStore(db_path), urls, client_id=f"fleet-{k}", shared_group="fleet").start()
                for k in range(2)]
    pools = []
    try:
        assert all(r.wait_ready(10) for r in replicas)
        pools = [DevicePool(shards[u].port, [d for d in ids if wanted[d] == u], records=12) for u in urls]
        # configured with one broker that is not its shard: the registry, not the hash, says where it is
        wanted["pinned"] = next(u for u in urls if u != shard_of("pinned", urls))
        pinned = sharded_devices("pinned", url=wanted["pinned"])
        pinned.wait_connected()
        wait_until(lambda: all(p.produced is not None for p in pools), 60, message="every device's records sent")
        assert [p.unacked for p in pools] == [0, 0, 0]
        expected = set().union(*(p.produced for p in pools))
        db = open_database(db_path)
        wait_until(lambda: stored_keys(db) == expected, 30, message="every record stored")
        wait_until(lambda: {r["id"]: r["broker"] for r in db.query("select id, broker from devices")} == wanted, 20,
                   message="the registry's broker of every device")
    finally:
        for r in replicas:
            r.stop()
    inserted = [r.stats.inserted for r in replicas]
    rows = sum(db.execute(f"select count(*) from {t}").fetchone()[0] for t in ("requests", "samples", "events"))
    assert sum(inserted) == len(expected) == rows == 3600 and all(inserted), inserted  # each stored once
    on_shard = Counter(wanted.values())
    assert all(on_shard[u] >= 60 for u in urls), on_shard  # every shard carried its share

    try:
        # a command to one device on each shard, and to the pinned one
        targets = [next(d for d in ids if wanted[d] == u) for u in urls] + ["pinned"]
        outcomes = run_command(Routes(urls, db_path), targets, "ping", {}, timeout_s=10)
        assert [o.ok for o in outcomes] == [True] * 4, outcomes

        # a rollout notice to one device on each shard, through serve's own rollout wiring
        job_id = create_job(FleetStore(db_path).db, None, targets[:3], 3, 0.0, operation="rollback")
        driver, links, server = _start_rollouts(db_path, urls, "fleet-0", Credentials(),
                                                Artifacts("127.0.0.1", 0, tmp_path / "artifacts"))
        try:
            wait_until(lambda: sum(len(p.notices) for p in pools) >= 3, 20, message="a notice on every shard")
        finally:
            for part in (links, driver, server):
                part.stop()
        assert [p.notices for p in pools] == [{t: [job_id]} for t in targets[:3]]  # those three, once each
    finally:
        for p in pools:
            p.stop()


def test_an_agent_given_the_shards_connects_to_its_own(tmp_path, shards):
    """The real agent link, configured with the list: a command routed by the hash alone reaches it."""
    from agent.config import MqttConfig
    from agent.link.mqtt import MqttLink
    from agent.link.store import TelemetryStore
    from agent.wire import CommandResponse
    from fleet.commands import run_command
    from fleet.shards import Routes

    urls = list(shards)
    config = MqttConfig(shards=urls, backoff_min_s=0.05, backoff_max_s=0.5, connect_timeout_s=2)
    link = MqttLink(config, "agent-7", TelemetryStore(tmp_path / "telemetry.db", "agent-7"),
                    handler=lambda name, request: CommandResponse(command=name, ok=True, result={"pong": True}))
    link.start()
    try:
        assert link.url == shard_of("agent-7", urls)
        wait_until(lambda: link.is_connected, 10, message="the agent to connect")
        [outcome] = run_command(Routes(urls), ["agent-7"], "ping", {}, timeout_s=10)
        assert outcome.ok and outcome.response.result == {"pong": True}, outcome
    finally:
        link.stop()
        link.store.close()


def test_the_cli_serves_and_commands_devices_on_every_shard(tmp_path, shards, sharded_devices, serve_processes):
    """`edge-fleet serve --mqtt A,B,C` fills the registry from all three; `edge-fleet cmd --all --mqtt A --mqtt B
    --mqtt C` reaches every device on its own shard."""
    import json
    import subprocess
    import sys

    from fleet.db import open_database
    from fleet_support import REPO

    urls, db_path = list(shards), tmp_path / "fleet.db"
    replica = serve_processes(",".join(urls), db_path, "fleet-cli")
    ids = [f"cli-{i:03d}" for i in range(100)]  # the first three on each shard (the ports, so the hash, vary)
    fleet = [sharded_devices(d) for u in urls for d in [d for d in ids if shard_of(d, urls) == u][:3]]
    wanted = {d.device_id: shard_of(d.device_id, urls) for d in fleet}
    wait_until(lambda: {r["id"]: r["broker"] for r in open_database(db_path).query("select id, broker from devices")}
               == wanted, 20, message="the registry's broker of every device")
    mqtt = [arg for url in urls for arg in ("--mqtt", url)]
    done = subprocess.run([sys.executable, "-m", "fleet.cli", "cmd", "--all", "ping", *mqtt, "--db", str(db_path),
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(r["device"] for r in json.loads(done.stdout) if r["ok"]) == sorted(wanted)
    replica.stop()
