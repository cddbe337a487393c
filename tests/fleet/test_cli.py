"""edge-fleet commands: tables and --json, one-line user errors, the HTML report in headless Chromium, and
command round trips with simulated devices."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from agent.wire import DeviceState
from fleet_support import REPO, wait_until
from fleet.cli import cli
from fleet.signing import load_private_key
from fleet.db import open_database
from fleet.store import FleetStore, Ingest
from simdevice import event_record, request_record


@pytest.fixture
def filled_db(fleet_target):
    """Four devices over the last 6 hours: two ran both smollm2 versions, one ran one, one is offline. On each
    backend."""
    path = fleet_target
    store = FleetStore(path)
    rng, now = random.Random(7), time.time()
    ingest = Ingest()
    for n, device_id in enumerate(["dev-1", "dev-2", "dev-3", "dev-4"]):
        versions = ["int4-a1", "int8-b2"] if n < 2 else ["int4-a1"]
        records = [request_record("boot", seq, now - 6 * 3600 + seq * 60, rng, "smollm2", versions[seq % len(versions)])
                   for seq in range(1, 360)]
        records.append(event_record("boot", 1000, now - 60, "model_change", to="int8-b2"))
        ingest.add_records(device_id, records, now)
        ingest.add_state(DeviceState(device_id=device_id, status="offline" if n == 3 else "online", connection=1,
                                     boot_id="boot", ts=now, model="smollm2", version=versions[-1],
                                     precision="int4"), now)
    ingest.reject("dev-9", "schema")
    store.commit(ingest)
    store.close()
    return path


def run(*args, ok: bool = True):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert (result.exit_code == 0) is ok, result.output
    return result


def run_main(*args) -> subprocess.CompletedProcess:
    """The real entry point, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "fleet.cli", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_devices_table_and_json(filled_db):
    table = run("devices", "--db", filled_db).output
    assert re.search(r"dev-1\s+yes\s+online", table) and re.search(r"dev-4\s+no\s+offline", table)
    rows = json.loads(run("devices", "--db", filled_db, "--json").output)
    assert [r["id"] for r in rows] == ["dev-1", "dev-2", "dev-3", "dev-4"]
    assert rows[0]["model"] == "smollm2@int8-b2" and rows[0]["decode_tps_p50_1h"] > 0


def test_tps_compare_events_rejected(filled_db):
    by_version = json.loads(run("tps", "--since", "24h", "--by", "version", "--db", filled_db, "--json").output)
    assert {r["version"] for r in by_version} == {"smollm2@int4-a1", "smollm2@int8-b2"}
    assert sum(r["requests"] for r in by_version) == 4 * 359
    assert "ttft_p95_ms" in run("tps", "--by", "hour", "--db", filled_db).output
    compared = json.loads(run("compare", "--model", "smollm2@int4-a1", "--model", "smollm2@int8-b2",
                              "--db", filled_db, "--json").output)
    assert [r["device"] for r in compared] == ["dev-1", "dev-2"]
    assert "smollm2@int8-b2 decode_tps_p50" in compared[0]
    events = json.loads(run("events", "dev-1", "--db", filled_db, "--json").output)
    assert events[0]["kind"] == "model_change" and events[0]["detail"] == {"to": "int8-b2"}
    assert "dev-9" in run("rejected", "--db", filled_db).output


@pytest.mark.parametrize("args, message", [
    (["devices", "--db", "missing.db"], "no fleet database at missing.db"),
    (["tps", "--since", "1y"], "bad duration '1y'"),
    (["events", "dev-404"], "unknown device 'dev-404'"),
    (["compare", "--model", "smollm2"], "at least two"),
    (["serve", "--mqtt", "http://localhost"], "bad broker URL"),
    (["cmd", "dev-1", "reboot", "--mqtt", "mqtt://127.0.0.1:1"], "unknown command 'reboot'"),
    # found in review: each of these was a traceback, an internal error or a silent success
    (["cmd", "a#", "ping", "--mqtt", "mqtt://127.0.0.1:1"], "'a#' is not a device id"),
    (["tps", "--since", "999999999999999999d"], "at most 100 years"),
    (["jobs", "--db", "typo.db"], "no fleet database at typo.db"),
    (["rollback", "dev-404"], "unknown device 'dev-404'"),
    (["deploy", "smollm2@int4-a1", "--to", "dev-404"], "unknown device 'dev-404'"),
    (["devices", "--db", "postgresql://fleet:secret@127.0.0.1:1/fleet"], "a password in the URL is visible"),
    (["devices", "--db", "postgresql://fleet@127.0.0.1:1/fleet"], "fleet database postgresql://fleet@127.0.0.1:1/fleet"),
])
def test_user_errors_are_one_line(filled_db, args, message):
    if "--db" not in args and args[0] != "serve":
        args = [*args, "--db", filled_db]
    result = run_main(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.parametrize("args, option", [
    (["cmd", "dev-1", "ping", "--timeout", "nan"], "--timeout"),
    (["cmd", "dev-1", "ping", "--timeout", "1e10"], "--timeout"),
    (["deploy", "smollm2@int4-a1", "--to", "dev-1", "--device-timeout", "1e10"], "--device-timeout"),
    (["deploy", "smollm2@int4-a1", "--to", "dev-1", "--wait", "--timeout", "nan"], "--timeout"),
])
def test_a_timeout_mqtt_cannot_carry_is_a_usage_error(filled_db, args, option):
    """Found in review: --timeout inf / 1e10 was an internal error (MQTT's message expiry is a four-byte
    integer), --device-timeout 1e10 failed the job when its notice went out, and NaN never timed out."""
    result = run_main(*args, "--mqtt", "mqtt://127.0.0.1:1", "--db", filled_db)
    assert result.returncode == 2 and f"Invalid value for '{option}'" in result.stderr, result.stderr
    assert "internal error" not in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("option", ["--keep", "--keep-samples"])
@pytest.mark.parametrize("keep, message", [("0d", "at least 1h"), ("30m", "at least 1h"), ("1y", "bad duration")])
def test_a_retention_that_would_delete_everything_or_is_not_a_duration_is_refused(filled_db, option, keep, message):
    result = run_main("serve", "--mqtt", "mqtt://127.0.0.1:1", option, keep, "--db", filled_db)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_report_renders_in_headless_chromium(filled_db, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed (apt-get install chromium)"
    out = tmp_path / "report.html"
    assert "2 models, 4 devices" in run("report", "--out", out, "--since", "24h", "--db", filled_db).output
    html = out.read_text()
    assert not re.search(r"(src|href)\s*=", html), "the report must not load anything"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'chromium'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", out.as_uri()], capture_output=True, text=True,
                         timeout=120).stdout
    assert dom.count("<svg") == 4  # tokens/s and TTFT for each of the two versions
    # int4-a1: dev-1..dev-4 and the all-devices median on each chart; int8-b2: dev-1, dev-2 and the median
    assert dom.count("<polyline") == 2 * 5 + 2 * 3
    assert "smollm2@int8-b2: Decode tokens/s (median)" in dom and "Time to first token" in dom
    screenshot = tmp_path / "report.png"
    subprocess.run([chromium, *flags, f"--screenshot={screenshot}", "--window-size=1000,1400", out.as_uri()],
                   capture_output=True, timeout=120)
    assert screenshot.stat().st_size > 20_000  # rendered charts, not a blank page


def test_cmd_round_trips(broker, consumers, devices, fleet_db):
    consumers()
    answering = devices("dev-a")
    devices("dev-mute", answer_commands=False)
    gone = devices("dev-gone")
    gone.stop()
    wait_until(lambda: open_database(fleet_db).execute("select count(*) from devices where status is not null")
               .fetchone()[0] == 3 and open_database(fleet_db)["devices"].get("dev-gone")["status"] == "stopped")
    mqtt = ["--mqtt", broker.url]

    pong = json.loads(run("cmd", "dev-a", "ping", *mqtt).output)
    assert pong == {"pong": True, "boot_id": answering.boot_id}
    assert json.loads(run("cmd", "dev-a", "set-config", "max_batch=8", "label=lab", *mqtt).output)["max_batch"] == 8
    assert json.loads(run("cmd", "dev-a", "get-config", *mqtt).output) == {"max_batch": 8, "label": "lab"}
    assert answering.config == {"max_batch": 8, "label": "lab"}

    fan_out = run("cmd", "--all", "ping", "--timeout", "1", "--db", fleet_db, "--json", *mqtt, ok=False)
    assert fan_out.exit_code == 3  # nobody said no: one did not answer, one was offline (found in review: 1)
    rows = {r["device"]: r for r in json.loads(fan_out.output)}
    assert rows["dev-a"]["ok"] and rows["dev-a"]["latency_ms"] < 1000
    assert rows["dev-mute"]["error"].startswith("no response within 1 s (a device that received it may still")
    assert rows["dev-gone"]["error"] == "offline (not sent)" and rows["dev-gone"]["result"] is None
    table = run("cmd", "--group", "dev-a*", "ping", "--db", fleet_db, *mqtt).output
    assert re.search(r"dev-a\s+yes", table) and "dev-mute" not in table
    failed = run("cmd", "dev-a", "benchmark", *mqtt, ok=False)  # the simulator does not implement it
    assert "unknown command 'benchmark'" in failed.output and failed.exit_code == 1  # the device said no
    # found in review: a mistyped id waited out the whole --timeout, and an oversized request was dropped by
    # the broker (or cut the connection) and reported as "no response"
    began = time.monotonic()
    typo = run("cmd", "dev-aa", "ping", "--timeout", "60", *mqtt, ok=False)
    assert "no device session subscribes to it" in typo.output and time.monotonic() - began < 20
    assert typo.exit_code == 3
    assert "the limit is 262144" in run("cmd", "dev-a", "set-config", "label=" + "x" * 300_000, *mqtt, ok=False).output


def test_deploy_skips_devices_already_on_the_target_and_offline_ones(filled_db):
    """Found in review: re-running a rollout sent the target to devices already on it (each answered REJECTED)
    and --all included offline devices (each timed out): either halted the rollout at its first wave."""
    store = FleetStore(filled_db)
    store.db["models"].insert({"name": "smollm2", "version": "int8-b2", "manifest": "{}", "signature": "",
                               "key_id": "", "published_at": 0.0})
    store.close()
    out = run("deploy", "smollm2@int8-b2", "--all", "--db", filled_db).output
    assert "skipped 2 device(s) already on smollm2@int8-b2: dev-1, dev-2" in out
    assert "skipped 1 device(s) offline" in out and "dev-4" in out
    assert "to 1 device(s)" in out  # dev-3 alone
    out = run("deploy", "smollm2@int8-b2", "--all", "--include-offline", "--db", filled_db).output
    assert "to 2 device(s)" in out  # dev-3 and dev-4
    out = run("deploy", "smollm2@int8-b2", "--to", "dev-4", "--db", filled_db).output
    assert "to 1 device(s)" in out  # named: deployed to although offline
    result = run_main("deploy", "smollm2@int8-b2", "--to", "dev-1", "--db", filled_db)
    assert result.returncode != 0 and "no device needs this deployment" in result.stderr


@pytest.mark.parametrize("args", [["job", "job-nope"], ["deploy", "smollm2@int4-a1", "--all"], ["rollback", "dev-1"]])
def test_a_mistyped_db_or_job_is_an_error_and_creates_nothing(filled_db, tmp_path, args):
    """Found in review: deploy, rollback and job created an empty database at a mistyped --db (job printed
    "(no rows)" and exit 0, as it did for an unknown job id)."""
    result = run_main(*args, "--db", tmp_path / "typo.db")
    assert result.returncode != 0 and "no fleet database at" in result.stderr and not (tmp_path / "typo.db").exists()
    result = run_main("job", "job-nope", "--db", filled_db)
    assert result.returncode != 0 and "unknown job 'job-nope'" in result.stderr


def test_artifacts_on_every_interface_need_the_url_devices_reach(filled_db, tmp_path):
    """Found in review: bound to 0.0.0.0 (as fleet.env suggested), the server told devices to fetch from
    http://0.0.0.0:PORT, i.e. from themselves, and every rollout failed."""
    from fleet.artifacts import ArtifactServer

    result = run_main("serve", "--mqtt", "mqtt://127.0.0.1:1", "--artifacts-http", "0.0.0.0:0", "--db", filled_db)
    assert result.returncode == 2 and "--artifacts-url" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(ValueError, match="devices need the URL"):
        ArtifactServer(tmp_path / "a", "0.0.0.0", 0)
    server = ArtifactServer(tmp_path / "a", "0.0.0.0", 0, public_url="http://fleet.example:8080/")
    try:
        assert server.base_url == "http://fleet.example:8080"
    finally:
        server.httpd.server_close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_keygen_on_a_full_disk_leaves_no_key_behind_and_can_run_again(tmp_path):
    """Found in review: a full disk left a 0-byte private key, which every later keygen refused to replace."""
    keys = tmp_path / "keys"
    keys.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", keys], check=True)
    try:
        with open(keys / "filler", "wb", buffering=0) as f:
            while True:
                try:
                    f.write(b"\0" * 1024)
                except OSError:
                    break
        r = CliRunner().invoke(cli, ["keygen", "--out", str(keys / "fleet.key")])
        assert r.exit_code != 0 and "No space left" in r.output and "Traceback" not in r.output, r.output
        assert str(keys / "fleet.key") in r.output and ".tmp" not in r.output  # the user's path, not ours
        assert sorted(p.name for p in keys.iterdir()) == ["filler"]
        (keys / "filler").unlink()
        r = CliRunner().invoke(cli, ["keygen", "--out", str(keys / "fleet.key")])
        assert r.exit_code == 0, r.output
        assert sorted(p.name for p in keys.iterdir()) == ["fleet.key", "fleet.key.pub"]
        assert (keys / "fleet.key").stat().st_mode & 0o777 == 0o600
        load_private_key(keys / "fleet.key")
        r = CliRunner().invoke(cli, ["keygen", "--out", str(keys / "new" / "fleet.key")])  # the README's form
        assert r.exit_code == 0 and (keys / "new" / "fleet.key.pub").is_file(), r.output
    finally:
        subprocess.run(["umount", "-l", keys], check=False)


def test_set_config_values_that_are_not_json_numbers_are_refused():
    """Found in review: 'sampling={"temperature":NaN}' went out as null ("not given"): 'applied', nothing changed."""
    from fleet.commands import CommandError, parse_assignments

    assert parse_assignments(['sampling={"temperature": 0.5}', "label=lab"]) == {
        "sampling": {"temperature": 0.5}, "label": "lab"}
    for bad in ('sampling={"temperature": NaN}', "threads=Infinity", "x=-Infinity"):
        with pytest.raises(CommandError, match="is not a JSON number"):
            parse_assignments([bad])


def test_an_artifacts_port_out_of_range_is_a_usage_error(tmp_path):
    """Found in review: --artifacts-http 127.0.0.1:99999 was 'internal error (OverflowError)', exit 2."""
    r = CliRunner().invoke(cli, ["serve", "--mqtt", "mqtt://127.0.0.1:1", "--db", str(tmp_path / "f.db"),
                                 "--artifacts-http", "127.0.0.1:99999",
                                 "--artifacts-dir", str(tmp_path / "a")])
    assert r.exit_code == 2 and "PORT 0-65535" in r.output and "internal error" not in r.output, r.output


def test_a_database_that_is_not_a_fleet_database_is_named(tmp_path):
    """Found in review: 'file is not a database', 'no such table: requests', 'unable to open database file':
    none said which file; `--db .` suggested a command that then failed."""
    garbage, other = tmp_path / "g.db", tmp_path / "o.db"
    garbage.write_text("garbage")
    open_database(other).execute("create table x (a)")
    for args, words in ((["devices", "--db", str(garbage)], f"{garbage} is not a fleet database"),
                        (["tps", "--db", str(other)], f"{other} is not a fleet database"),
                        (["devices", "--db", str(tmp_path)], "is a directory"),
                        (["deploy", "m@v", "--to", "a", "--db", str(garbage)], f"fleet database {garbage}:")):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 1 and words in r.output and "Traceback" not in r.output, (args, r.output)


def test_a_bundle_named_before_names_were_checked_still_loads_but_is_not_published(tiny_fp32_bundle, tmp_path):
    """A name that is not one path and URL segment ('../../x' was published outside the artifacts directory)
    is refused at publish; bundles built before the rule existed must still load on devices."""
    from agent.engine.bundle import open_bundle

    old = tmp_path / "old"
    shutil.copytree(tiny_fp32_bundle.path, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "name": "llama 3.2 1b"}))
    assert open_bundle(old).manifest.name == "llama 3.2 1b"
    assert CliRunner().invoke(cli, ["keygen", "--out", str(tmp_path / "k" / "fleet.key")]).exit_code == 0
    FleetStore(tmp_path / "f.db").close()
    r = CliRunner().invoke(cli, ["publish", str(old), "--key", str(tmp_path / "k" / "fleet.key"),
                                 "--db", str(tmp_path / "f.db"), "--artifacts-dir", str(tmp_path / "art")])
    assert r.exit_code == 1 and "rebuild it with edge-quantize build --name" in r.output, r.output
    assert not (tmp_path / "art").exists() or not any((tmp_path / "art").iterdir())


def test_a_key_file_that_is_not_a_pem_key_is_named(tmp_path):
    """Found in review: cryptography's 'Unable to load PEM file ... MalformedFraming' named no file."""
    from agent.updates.trust import TrustError, load_trusted_keys

    junk = tmp_path / "fleet.key"
    junk.write_text("junk\n")
    with pytest.raises(TrustError, match=f"{junk}: not a PEM public key"):
        load_trusted_keys([junk])
    with pytest.raises(ValueError, match=f"{junk}: not a PEM private key"):
        load_private_key(junk)


def test_cmd_to_an_unreachable_broker_says_why_at_once():
    """Found in review: against a broker that refused or was not there, `cmd --timeout 2` retried for 10 s and
    then said only 'cannot reach'. It now ends at the first failed attempt, with its reason."""
    from broker import free_port

    r = CliRunner().invoke(cli, ["cmd", "dev-a", "ping", "--timeout", "2", "--mqtt", f"mqtt://127.0.0.1:{free_port()}"])
    assert r.exit_code == 1 and "cannot reach the MQTT broker" in r.output and "Connection refused" in r.output, r.output


def test_cancel_stops_a_rollout_and_names_the_devices_it_already_reached(filled_db):
    """Found in review: a job could stay IN_PROGRESS for good (no driver running, a wave never notified) and
    only an edit of the database ended it."""
    store = FleetStore(filled_db)
    store.db["models"].insert({"name": "smollm2", "version": "int8-b2", "manifest": "{}", "signature": "",
                               "key_id": "", "published_at": 0.0})
    store.close()
    out = run("deploy", "smollm2@int8-b2", "--to", "dev-3", "--to", "dev-4", "--wave-size", "1", "--db", filled_db).output
    job_id = out.split()[1].rstrip(":")
    store = FleetStore(filled_db)
    store.db.execute("update job_devices set notified = 1 where device_id = 'dev-3'")  # the first wave went out
    store.db.conn.commit()
    out = run("cancel", job_id, "--db", filled_db).output
    assert f"job {job_id}: CANCELED" in out and "1 device(s) already sent it may still install it: dev-3" in out
    states = {r["device_id"]: r["state"] for r in store.db.query("select * from job_devices")}
    assert states == {"dev-3": "QUEUED", "dev-4": "CANCELED"}
    assert store.db["jobs"].get(job_id)["state"] == "CANCELED"
    result = run_main("cancel", job_id, "--db", filled_db)
    assert result.returncode != 0 and "has already ended: CANCELED" in result.stderr
    result = run_main("cancel", "job-nope", "--db", filled_db)
    assert result.returncode != 0 and "unknown job 'job-nope'" in result.stderr
    store.close()


def publish_row(db_path, version: str, precision: str, built: str) -> str:
    """A published smollm2 version as `edge-fleet publish` records it (its manifest, unsigned here)."""
    from agent.wire import Golden, Manifest

    manifest = Manifest(name="smollm2", version=version, precision=precision, quant={}, source_sha256="0" * 64,
                        source_name="smollm2.gguf", created_at=built, files={},
                        golden=Golden(prompt="hi", prompt_ids=[1], continuation_ids=[2]))
    store = FleetStore(db_path)
    store.db["models"].upsert({"name": "smollm2", "version": version, "manifest": manifest.model_dump_json(),
                               "signature": "", "key_id": "", "published_at": time.time()}, pk=("name", "version"))
    store.close()
    return f"smollm2@{version}"


def job_count(db_path) -> int:
    return open_database(db_path).execute("select count(*) from jobs").fetchone()[0]


def test_deploy_of_a_model_name_without_a_version_lists_its_published_versions(filled_db):
    """Found by a new user: `deploy smollm2` said "say which devices", then "smollm2 is not published"."""
    publish_row(filled_db, "int8-b2", "int8", "2026-12-01T10:00:00+00:00")
    publish_row(filled_db, "int4-c3", "int4", "2026-12-02T10:00:00+00:00")
    result = run_main("deploy", "smollm2", "--db", filled_db)
    assert result.returncode == 1 and job_count(filled_db) == 0, result.stderr
    table = result.stdout.splitlines()
    assert table[0].split() == ["target", "precision", "built", "published"]
    assert [line.split()[:2] for line in table[2:]] == [["smollm2@int8-b2", "int8"], ["smollm2@int4-c3", "int4"]]
    assert "say which version: deploy smollm2@int4-c3 (the last built)" in result.stderr
    result = run_main("deploy", "llama", "--all", "--db", filled_db)
    assert result.returncode == 1 and "no published model named 'llama'" in result.stderr, result.stderr


def test_a_slower_precision_that_the_default_speed_floor_would_fail_is_refused_before_the_job(filled_db):
    """Found by a new user: INT8 over INT4 failed on every device (decode under 70% of INT4's) after the
    rollout had started; the flag that sets the floor was named nowhere."""
    target = publish_row(filled_db, "int8-c3", "int8", "2026-12-06T10:00:00+00:00")  # the devices run int4
    result = run_main("deploy", target, "--to", "dev-3", "--to", "dev-4", "--db", filled_db)
    assert result.returncode == 1 and job_count(filled_db) == 0, result.stderr
    assert ("int8 decodes slower than the int4 that 2 device(s) run (dev-3, dev-4): the health check's default "
            "floor, 70% of the current model's tokens/s, would fail it; set the floor with --min-tokens-per-s N"
            in result.stderr), result.stderr
    assert "no job was created" in result.stderr and "Traceback" not in result.stderr
    assert "to 2 device(s)" in run("deploy", target, "--to", "dev-3", "--to", "dev-4", "--min-tokens-per-s", "0",
                                   "--db", filled_db).output
    faster = publish_row(filled_db, "int4-d4", "int4", "2026-12-06T11:00:00+00:00")
    assert "to 1 device(s)" in run("deploy", faster, "--to", "dev-3", "--db", filled_db).output


def test_a_downgrade_by_build_time_is_refused_before_the_job_unless_allowed(filled_db):
    """Devices refuse a model built before the one they run (manifests' created_at); when the fleet knows what
    they run, deploy says so first, with the flag."""
    publish_row(filled_db, "int4-a1", "int4", "2026-12-05T10:00:00+00:00")  # what dev-3 runs
    older = publish_row(filled_db, "int4-z0", "int4", "2026-12-04T10:00:00+00:00")
    result = run_main("deploy", older, "--to", "dev-3", "--db", filled_db)
    assert result.returncode == 1 and job_count(filled_db) == 0, result.stderr
    assert ("built 2026-12-04T10:00:00+00:00, before what 1 device(s) run (dev-3; dev-3: smollm2@int4-a1, built "
            "2026-12-05T10:00:00+00:00): devices refuse a downgrade unless --allow-downgrade") in result.stderr
    assert "to 1 device(s)" in run("deploy", older, "--to", "dev-3", "--allow-downgrade", "--db", filled_db).output


def settle_job(db_path, state: str, figures: dict | None) -> str:
    """What the rollout driver records when the device reports the job's end."""
    db = open_database(db_path)
    job_id = wait_until(lambda: db.execute("select id from jobs").fetchone(), message="the job")[0]
    db.execute("update job_devices set state = ?, figures = ? where job_id = ?",
               [state, json.dumps(figures) if figures else None, job_id])
    db.execute("update jobs set state = ? where id = ?", [state, job_id])
    db.conn.commit()
    return job_id


@pytest.mark.parametrize("state, code", [("SUCCEEDED", 0), ("FAILED", 1)])
def test_rollback_waits_like_deploy_and_names_the_model_the_device_serves(filled_db, state, code):
    """Found by a new user: rollback had no --wait, and the job named the folder the model had come from."""
    waiting = subprocess.Popen([sys.executable, "-m", "fleet.cli", "rollback", "dev-3", "--wait", "--timeout", "60",
                                "--db", str(filled_db)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    job_id = settle_job(filled_db, state, {"rolled_back_to": "smollm2@int4-a1"} if state == "SUCCEEDED" else None)
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == code, out + err
    assert f"job {job_id}: rollback of dev-3" in out and f"job {job_id}: {state}" in out
    assert ("dev-3 serves smollm2@int4-a1" in out) is (state == "SUCCEEDED"), out
