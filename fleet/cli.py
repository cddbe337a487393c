"""edge-fleet: run the telemetry consumer, ask the fleet database questions, send devices commands.

Run: edge-fleet serve --mqtt mqtt://HOST:PORT --db fleet.db [--client-id ID] [--shared-group G]
     edge-fleet devices | tps --since 24h --by model | events DEVICE | compare --model A --model B
     edge-fleet report --out report.html
     edge-fleet cmd DEVICE ping --mqtt mqtt://HOST:PORT     (or: cmd --all ping, cmd --group 'store-*' ping)
Query commands take --db PATH and --json (a list of row objects instead of a table).
"""
from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import click

from agent import durable
from agent.clikit import Seconds, run, setup_logging
from agent.mqtt_link import LinkError
from agent.wire import is_device_id
from fleet import queries
from fleet.commands import CommandError
from fleet.db import database_errors, has_password, is_url
from fleet.queries import QueryError
from fleet.rollups import ROLLUP_REFRESH_EVERY_S

USER_ERRORS = (QueryError, CommandError, LinkError, OSError, ValueError)  # BundleError, StoreError: ValueErrors
DEFAULT_DB = "fleet.db"


def user_errors(command):
    """Turn the errors a user can cause into one line and a non-zero exit."""
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except USER_ERRORS + database_errors() as e:
            raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    return wrapper


def db_option(command):
    # a str: click's Path would fold a URL's '//'
    return click.option("--db", "db_path", default=DEFAULT_DB, show_default=True, envvar="EDGE_FLEET_DB",
                        show_envvar=True, callback=_no_password_in_argv,
                        help="Fleet database: a SQLite file, or postgresql://USER@HOST[:PORT]/DB "
                        "(the password from ~/.pgpass or PGPASSFILE, never the command line).")(command)


def _no_password_in_argv(ctx, param, value):
    if has_password(value) and ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE:
        raise click.ClickException("--db: a password in the URL is visible to every user of this machine (ps): "
                                   "put it in ~/.pgpass, a file named by PGPASSFILE, or passfile=PATH in the URL")
    return value


def json_option(command):
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON list of row objects.")(command)


def broker_options(command):
    """--mqtt and the credentials for it (the shipped broker config wants TLS, a user and a password)."""
    options = [
        click.option("--mqtt", "url", required=True, multiple=True, envvar="EDGE_FLEET_MQTT",
                     show_envvar=True, help="Broker URL: mqtt://HOST[:PORT] or mqtts://HOST[:PORT]; devices spread "
                     "over several brokers (docs/scaling.md): repeat it, or join the URLs with commas."),
        click.option("--username", default=None, envvar="EDGE_FLEET_USERNAME", show_envvar=True,
                     help="Broker user (default: none, anonymous; with use_username_as_clientid it is also the "
                          "client id: one user per concurrent connection)."),
        click.option("--password-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                     envvar="EDGE_FLEET_PASSWORD_FILE", show_envvar=True,
                     help="File holding the broker password (default: none)."),
        click.option("--ca-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                     envvar="EDGE_FLEET_CA_FILE", show_envvar=True,
                     help="mqtts: CA certificate of the broker (default: the system's trust store)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def credentials(username, password_file, ca_file):
    from agent.mqtt_link import Credentials

    return Credentials.from_files(username, password_file, ca_file)


def since_option(default: str):
    return click.option("--since", default=default, show_default=True, help="Window: 30m, 24h, 7d, ...")


# ---- output -----------------------------------------------------------------------------------------------
def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.1f}"
    if isinstance(v, (dict, list)):
        text = json.dumps(v, separators=(",", ":"))
        return text if len(text) <= 60 else text[:57] + "..."
    return str(v)


def format_table(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    numeric = [all(r.get(c) is None or isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                   for r in rows) for c in columns]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(row) for row in cells)])


def echo_rows(rows: list[dict], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(rows, indent=2))
    elif rows:
        click.echo(format_table(rows))
    else:
        click.echo("(no rows)")


# ---- commands ---------------------------------------------------------------------------------------------
@click.group(context_settings={"show_default": True})
def cli() -> None:
    """Fleet server: device telemetry over MQTT into SQLite, queries, reports and remote commands."""


def retention(keep: str, keep_samples: str) -> dict[str, float]:
    """--keep and --keep-samples -> table: seconds its rows are kept (a table kept for good is absent)."""
    def seconds(option: str, value: str) -> float | None:
        s = None if value == "forever" else queries.parse_duration_s(value)
        if s is not None and s < 3600:  # a typo like 0d would delete every record as it arrives
            raise click.BadParameter(f"{option} {value!r}: keep telemetry at least 1h (or 'forever')")
        return s
    keep_s, samples_s = seconds("--keep", keep), seconds("--keep-samples", keep_samples)
    tables = {"requests": keep_s, "events": keep_s,
              "samples": min((s for s in (keep_s, samples_s) if s is not None), default=None)}
    return {table: s for table, s in tables.items() if s is not None}


@cli.command()
@broker_options
@db_option
@click.option("--client-id", default="edge-fleet", show_default=True,
              help="MQTT client id; the broker keeps this id's session (and queues for it) between runs. "
                   "Every replica needs its own.")
@click.option("--shared-group", default=None, help="Split telemetry with the other replicas of this group "
                                                   "($share/GROUP/...); state still reaches every replica "
                                                   "(default: none, one consumer takes it all).")
@click.option("--artifacts-http", default=None,
              help="Serve published bundles on HOST:PORT and drive rollouts (default: off).")
@click.option("--artifacts-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("artifacts"),
              show_default=True, help="Where `edge-fleet publish` puts bundles (the HTTP root).")
@click.option("--artifacts-url", default=None, help="The URL devices fetch bundles from (default: "
              "http://HOST:PORT of --artifacts-http; required when HOST is 0.0.0.0 or ::).")
@click.option("--jobs-username", default=None, help="Broker user of the rollouts' own connection (with "
              "--artifacts-http; default --username). A broker that makes the user the client id needs another.")
@click.option("--jobs-password-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="File holding --jobs-username's password (default --password-file).")
@click.option("--job-key", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Sign every job document with this Ed25519 key (edge-fleet keygen), for devices whose "
                   "[updates] job_keys trust its .pub. Not the manifest key: this one stays on the server "
                   "(default: none, jobs go unsigned).")
@click.option("--keep", default="90d", show_default=True,
              help="Delete requests and events older than this, hourly; 'forever' keeps them all.")
# Samples are ~8 rows in 10 of a fleet's database (83 GB for 500 devices over 90 days at the agents' default
# interval) and no query reads them; 14 days, as Prometheus keeps its samples by default.
@click.option("--keep-samples", default="14d", show_default=True,
              help="Delete samples (RSS, CPU, KV use every few seconds) older than this, or than --keep if "
                   "sooner; 'forever' keeps them as long as --keep.")
@click.option("--rollup-refresh", "rollup_refresh_s", type=Seconds(min=0.1), default=ROLLUP_REFRESH_EVERY_S,
              help="Seconds between refreshes of ended hours' request rollups (queries read the rest raw).")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@user_errors
def serve(url, username, password_file, ca_file, db_path, client_id, shared_group, artifacts_http, artifacts_dir,
          artifacts_url, jobs_username, jobs_password_file, job_key, keep, keep_samples, rollup_refresh_s, verbose):
    """Consume device state and telemetry into the database until SIGINT/SIGTERM.

    Example: edge-fleet serve --mqtt mqtt://127.0.0.1:1883 --db fleet.db --client-id fleet-a --shared-group fleet
    """
    from fleet.artifacts import WILDCARD_HOSTS
    from fleet.consumer import Artifacts
    from fleet.consumer import serve as run
    from fleet.shards import parse_brokers
    from fleet.signing import load_private_key

    url = parse_brokers(url)
    keep_s = retention(keep, keep_samples)
    auth = credentials(username, password_file, ca_file)
    for label, value in (("client id", client_id), ("shared group", shared_group)):
        if value is not None and (not value or any(c in value for c in "/+#")):
            raise click.BadParameter(f"{label} {value!r} must be non-empty without '/', '+' or '#'")
    setup_logging(logging.DEBUG if verbose else logging.INFO, timestamps=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started = time.monotonic()
    artifacts = None
    if artifacts_http:
        host, _, port = artifacts_http.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise click.BadParameter(f"--artifacts-http {artifacts_http!r}: expected HOST:PORT, PORT 0-65535")
        if artifacts_url is None and host.strip("[]") in WILDCARD_HOSTS:  # devices told to fetch from
            # http://0.0.0.0:PORT would fetch from themselves, and every rollout would fail
            raise click.BadParameter(f"--artifacts-http {artifacts_http!r} listens on every interface: give "
                                     "--artifacts-url http://NAME:PORT, the address devices reach this server at")
        if artifacts_url is not None:
            parts = urllib.parse.urlsplit(artifacts_url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
                raise click.BadParameter(f"--artifacts-url {artifacts_url!r}: expected http(s)://HOST[:PORT][/PATH]")
        jobs_auth = None if jobs_username is None else credentials(jobs_username, jobs_password_file, ca_file)
        artifacts = Artifacts(host.strip("[]"), int(port), artifacts_dir, jobs_auth, artifacts_url,
                              load_private_key(job_key) if job_key else None)
    elif job_key is not None:
        raise click.BadParameter("--job-key signs rollout jobs: it needs --artifacts-http")
    stats = run(db_path, url, client_id, shared_group, stop, auth, artifacts, keep_s, rollup_refresh_s)
    click.echo(f"edge-fleet serve: stored {stats.inserted} records, dropped {stats.duplicates} duplicates, "
               f"rejected {stats.rejected} messages in {time.monotonic() - started:.1f} s")


@cli.command()
@db_option
@json_option
@user_errors
def devices(db_path, as_json):
    """Every known device: online, last seen, model@version, precision, median decode tokens/s over the last hour.

    Example: edge-fleet devices --db fleet.db
    """
    echo_rows(queries.devices(queries.open_readonly(db_path)), as_json)


@cli.command()
@since_option("24h")
@click.option("--by", type=click.Choice(queries.GROUPINGS), default="model", show_default=True,
              help="One row per device, model, version (MODEL@VERSION), hour or adapter (MODEL:ADAPTER@VERSION; "
                   "MODEL alone for requests without one; read from raw rows, whatever the window).")
@db_option
@json_option
@user_errors
def tps(since, by, db_path, as_json):
    """Requests, errors (shed or refused as overloaded, failed), TTFT and decode tokens/s percentiles and
    tokens served, grouped.

    Example: edge-fleet tps --since 24h --by device
    """
    echo_rows(queries.tps(queries.open_readonly(db_path), queries.parse_duration_s(since), by), as_json)


@cli.command()
@click.argument("device")
@since_option("7d")
@click.option("--limit", type=click.IntRange(1), default=100, show_default=True, help="Most events to print.")
@db_option
@json_option
@user_errors
def events(device, since, limit, db_path, as_json):
    """A device's events, newest first.

    Example: edge-fleet events dev-0042 --since 24h
    """
    db = queries.open_readonly(db_path)
    echo_rows(queries.events(db, device, queries.parse_duration_s(since), limit), as_json)


@cli.command()
@click.option("--model", "models", multiple=True, required=True, help="NAME or NAME@VERSION; give two or more.")
@since_option("7d")
@db_option
@json_option
@user_errors
def compare(models, since, db_path, as_json):
    """Median decode tokens/s and TTFT of models side by side on the devices that ran them all.

    Example: edge-fleet compare --model smollm2@int4-a1 --model smollm2@int8-b2
    """
    db = queries.open_readonly(db_path)
    echo_rows(queries.compare(db, list(models), queries.parse_duration_s(since)), as_json)


@cli.command()
@db_option
@json_option
@user_errors
def rejected(db_path, as_json):
    """Messages the consumer dropped, by device and reason.

    Example: edge-fleet rejected --db fleet.db
    """
    echo_rows(queries.rejected(queries.open_readonly(db_path)), as_json)


@cli.command()
@click.option("--out", type=click.Path(path_type=Path), required=True, help="HTML file to write.")
@since_option("24h")
@db_option
@user_errors
def report(out, since, db_path):
    """A self-contained HTML report with charts of tokens/s and TTFT over time per model and device, its table
    giving each version's total and active parameters where its published manifest records them (MoE).

    Example: edge-fleet report --out report.html --since 24h
    """
    from fleet.report import render_report

    db, since_s = queries.open_readonly(db_path), queries.parse_duration_s(since)
    series = queries.timeseries(db, since_s)
    html = render_report(queries.with_parameters(db, queries.tps(db, since_s, "version")), series,
                         title=f"Fleet report, last {since}", adapters=queries.tps(db, since_s, "adapter"))
    durable.write_text(out, html)  # a reader never sees half a report
    models, device_ids = {r["model"] for r in series}, {r["device"] for r in series}
    click.echo(f"wrote {out} ({len(models)} models, {len(device_ids)} devices)")


@cli.command()
@click.argument("words", nargs=-1, required=True)
@broker_options
@click.option("--all", "to_all", is_flag=True, help="Every online device in the registry (needs --db).")
@click.option("--group", default=None,
              help="Online devices whose id matches this glob, e.g. 'store-12-*' (default: none).")
@click.option("--timeout", "timeout_s", type=Seconds(min=0.1), default=10.0, show_default=True,
              help="Seconds to wait for answers.")
@db_option
@json_option
@user_errors
def cmd(words, url, username, password_file, ca_file, to_all, group, timeout_s, db_path, as_json):
    """Send DEVICE a command (ping, get-config, set-config KEY=VALUE..., benchmark, telemetry-flush, rollback)
    and print its answer. Exit status 1 if a device refused it or failed, else 3 if one was offline, could not be
    sent to or did not answer in time.

    With --all or --group, leave out DEVICE: the command goes to many devices and the answers are tabulated.

    Example: edge-fleet cmd dev-0042 set-config 'sampling={"temperature": 0.7}' --mqtt mqtt://127.0.0.1:1883
    """
    from fleet.commands import Outcome, command_name, parse_assignments, run_command, select_targets
    from fleet.shards import cli_routes

    fan_out = to_all or group is not None
    if len(words) < (1 if fan_out else 2):
        raise click.UsageError("give DEVICE COMMAND [KEY=VALUE...], or --all/--group with COMMAND [KEY=VALUE...]")
    targets, skipped = ([], [])
    if fan_out:
        targets, skipped = select_targets(queries.devices(queries.open_readonly(db_path)), group)
    else:
        targets, words = [words[0]], words[1:]
        if not is_device_id(targets[0]):
            raise click.ClickException(f"{targets[0]!r} is not a device id (letters, digits, '_', '.', '-')")
    name, args = command_name(words[0]), parse_assignments(list(words[1:]))
    auth = credentials(username, password_file, ca_file)
    outcomes = run_command(cli_routes(url, db_path), targets, name, args, timeout_s, auth) if targets else []
    rows = [o.row() for o in outcomes] + [Outcome(d, False, error="offline (not sent)").row() for d in skipped]
    _print_outcomes(rows, fan_out, as_json)
    # a script can tell "a device said no" (1) from "it never got there, or never answered" (3), after which
    # the request has expired unrun unless a device got it in time
    if any(o.response is not None and not o.ok for o in outcomes):
        sys.exit(1)
    if not all(r["ok"] for r in rows):
        sys.exit(NOT_ANSWERED_EXIT)


NOT_ANSWERED_EXIT = 3  # `cmd`: no device said no, but one or more never answered


def _print_outcomes(rows: list[dict], fan_out: bool, as_json: bool) -> None:
    if as_json or fan_out:
        echo_rows(rows, as_json)
    elif rows[0]["ok"]:
        click.echo(json.dumps(rows[0]["result"], indent=2))
    else:
        if rows[0]["result"]:  # partly done (set-config applies what it can): what was applied, then the error
            click.echo(json.dumps(rows[0]["result"], indent=2))
        click.echo(f"Error: {rows[0]['device']}: {rows[0]['error']}", err=True)


# ---- model rollouts ---------------------------------------------------------------------------------------
@cli.command()
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Private key file (mode 0600); the public key goes to OUT.pub.")
@user_errors
def keygen(out):
    """Make an Ed25519 signing key pair for model updates.

    Example: edge-fleet keygen --out keys/fleet.key
    """
    from fleet.signing import keygen as make

    click.echo(f"wrote {out} and {out}.pub (key id {make(out)})")


def _db(db_path: Path):
    from fleet.store import FleetStore

    # runs migrations; `serve` alone creates a SQLite file
    return FleetStore(db_path if is_url(db_path) else queries.existing_db(db_path))


@cli.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The private signing key (edge-fleet keygen); devices trust its .pub ([updates] trusted_keys).")
@click.option("--artifacts-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("artifacts"),
              show_default=True, help="Where the bundle is copied: `edge-fleet serve --artifacts-dir` serves it.")
@db_option
@user_errors
def publish(bundle, key_path, artifacts_dir, db_path):
    """Verify and sign a bundle's manifest and register it; prints MODEL@VERSION.

    Example: edge-fleet publish bundles/smollm2-int4 --key keys/fleet.key --db fleet.db
    """
    from fleet.updates import publish as register

    store = _db(db_path)
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    click.echo(register(store.db, bundle, key_path, artifacts_dir))


def wait_options(command):
    """--wait and --timeout, as deploy and rollback take them."""
    command = click.option("--timeout", "timeout_s", type=Seconds(min=0), default=600,
                           help="With --wait: seconds to wait for the job to end.")(command)
    return click.option("--wait", is_flag=True, help="Block until the job ends and print each device's state; "
                                                     "exit non-zero unless it SUCCEEDED.")(command)


@cli.command()
@click.argument("target")
@click.option("--to", "devices", multiple=True, help="Device id (repeatable).")
@click.option("--group", default=None, help="Devices whose id matches this glob (default: none).")
@click.option("--all", "to_all", is_flag=True, help="Every device in the registry.")
@click.option("--include-offline", is_flag=True,
              help="With --all/--group: offline devices too (each waits out --device-timeout if it stays away).")
@click.option("--wave-size", type=click.IntRange(1), default=1,
              help="Devices sent the job at once; the next wave starts when a wave has ended.")
@click.option("--max-failure-rate", type=click.FloatRange(0, 1), default=0.0,
              help="Share of the devices so far that may fail before the rollout halts (0: the first failure).")
@click.option("--allow-downgrade", is_flag=True,
              help="Let devices install a model built before the one they run (the manifests' build time).")
@click.option("--min-tokens-per-s", type=float, default=None,
              help="The health check's decode floor (default: 70% of the current model's tokens/s, which a "
                   "slower precision fails; 0: only the device's own [updates] min_tokens_per_s).")
@click.option("--device-timeout", "device_timeout_s", type=Seconds(min=1), default=1800,
              help="Seconds a notified device may take before it counts as TIMED_OUT.")
@wait_options
@click.option("--mqtt", "url", default=None, multiple=True,
              help="Accepted for symmetry (default: none); the serving fleet process publishes.")
@db_option
@user_errors
def deploy(target, devices, group, to_all, include_offline, wave_size, max_failure_rate, allow_downgrade,
           min_tokens_per_s, device_timeout_s, wait, timeout_s, url, db_path):
    """Roll MODEL@VERSION out to devices in waves (edge-fleet serve --artifacts-http must be running). A bare
    MODEL lists its published versions.

    Example: edge-fleet deploy smollm2-135m-instruct@int4-b64a-1a2b3c4d --all --wave-size 2 --wait
    """
    from fleet import deployment
    from fleet.updates import create_job

    store = _db(db_path)
    if "@" not in target:
        _list_versions(store.db, target)
    if not (devices or group or to_all):  # no target at all is a usage error, not "no device needs it"
        raise click.UsageError("say which devices: --to DEVICE (repeatable), --group GLOB or --all")
    chosen = deployment.choose_devices(store.db, list(devices), group, to_all)
    plan = deployment.needing(store.db, chosen, target, offline_too=include_offline or not (to_all or group))
    for why, ids in plan.skipped.items():
        click.echo(f"skipped {len(ids)} device(s) {why}: {deployment.named(ids)}")
    if not plan.devices:
        raise click.ClickException("no device needs this deployment")
    manifest = deployment.published_manifest(store.db, target)
    if manifest is not None and (problems := deployment.refusals(store.db, manifest, plan.devices, allow_downgrade,
                                                                min_tokens_per_s)):
        raise click.ClickException(f"{target} would be refused: " + "\n".join(problems) + "\n(no job was created)")
    job_id = create_job(store.db, target, plan.devices, wave_size, max_failure_rate, allow_downgrade,
                        min_tokens_per_s, device_timeout_s=device_timeout_s)
    click.echo(f"job {job_id}: {target} to {len(plan.devices)} device(s) in waves of "
               f"{min(wave_size, len(plan.devices))}")
    if wait:
        _wait_for(store.db, db_path, job_id, timeout_s)


def _list_versions(db, name: str) -> None:
    """`deploy NAME`: the versions it could mean, then an error (a deployment needs exactly one)."""
    from fleet.deployment import published_versions

    versions = published_versions(db, name)
    if not versions:
        raise click.ClickException(f"no published model named {name!r} (edge-fleet publish BUNDLE --key KEY)")
    echo_rows(versions, False)
    raise click.ClickException(f"{name}: say which version: deploy {versions[-1]['target']} (the last built) or "
                               f"another above")


def _wait_for(db, db_path: Path, job_id: str, timeout_s: float) -> list[dict]:
    """--wait: block until the job ends, print its devices' rows, exit 1 unless it SUCCEEDED."""
    from fleet.updates import job_rows, wait_for_job

    state = wait_for_job(db_path, job_id, timeout_s)
    rows = job_rows(db, job_id)
    echo_rows(rows, False)
    click.echo(f"job {job_id}: {state}")
    if state != "SUCCEEDED":
        sys.exit(1)
    return rows


@cli.command()
@db_option
@json_option
@user_errors
def jobs(db_path, as_json):
    """List rollout jobs, newest first.

    Example: edge-fleet jobs --db fleet.db
    """
    from fleet.updates import list_jobs

    echo_rows(list_jobs(queries.open_readonly(db_path)), as_json)  # a mistyped --db is an error, not a new file


@cli.command()
@click.argument("job_id")
@db_option
@json_option
@user_errors
def job(job_id, db_path, as_json):
    """Every device's state in one job.

    Example: edge-fleet job job-20261202-101500-ab12cd --json
    """
    from fleet.updates import job_rows

    rows = job_rows(_db(db_path).db, job_id)
    if not rows:  # a job always has devices: create_job refuses an empty one
        raise click.ClickException(f"unknown job {job_id!r} (edge-fleet jobs lists them)")
    echo_rows(rows, as_json)


@cli.command()
@click.argument("job_id")
@db_option
@user_errors
def cancel(job_id, db_path):
    """Stop a rollout: devices not yet sent the job never will be. Devices already sent it may still
    install it; the job's device timeout still applies to them.

    Example: edge-fleet cancel job-20261202-101500-ab12cd
    """
    from fleet.updates import cancel_job

    try:
        pending = cancel_job(_db(db_path).db, job_id)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"job {job_id}: CANCELED")
    if pending:
        click.echo(f"{len(pending)} device(s) already sent it may still install it: {', '.join(pending[:10])}"
                   f"{' ...' if len(pending) > 10 else ''}")


@cli.command()
@click.argument("device")
@wait_options
@db_option
@user_errors
def rollback(device, wait, timeout_s, db_path):
    """Send a device back to its previous model (a one-device job); with --wait, say which model it serves.

    Example: edge-fleet rollback box-0042 --wait
    """
    from fleet.deployment import choose_devices
    from fleet.updates import create_job

    db = _db(db_path).db
    choose_devices(db, [device], None, False)  # a known device
    job_id = create_job(db, None, [device], 1, 0.0, operation="rollback")
    click.echo(f"job {job_id}: rollback of {device}")
    if wait:
        figures = json.loads(_wait_for(db, db_path, job_id, timeout_s)[0]["figures"] or "{}")
        click.echo(f"{device} serves {figures.get('rolled_back_to') or '(unknown)'}"
                   + (" (it had been rolled back already)" if figures.get("already") else ""))


def main() -> None:
    run(cli, "edge-fleet", env_prefix="EDGE_FLEET")  # e.g. EDGE_FLEET_SERVE_CLIENT_ID (systemd/fleet.env)


if __name__ == "__main__":
    main()
