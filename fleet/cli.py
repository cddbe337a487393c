"""edge-fleet: run the telemetry consumer, ask the fleet database questions, send devices commands.

Run: edge-fleet serve --mqtt mqtt://HOST:PORT --db fleet.db [--client-id ID] [--shared-group G]
     edge-fleet devices | tps --since 24h --by model | events DEVICE | compare --model A --model B
     edge-fleet report --out report.html
     edge-fleet cmd DEVICE ping --mqtt mqtt://HOST:PORT     (or: cmd --all ping, cmd --group 'store-*' ping)
Query commands take --db PATH and --json (a list of row objects instead of a table).
"""
from __future__ import annotations

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
from agent.wire import is_device_id
from fleet import queries, rollout_cli
from fleet.cli_options import broker_options, credentials, db_option, echo_rows, json_option, since_option, user_errors
from fleet.rollups import ROLLUP_REFRESH_EVERY_S


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


for _command in rollout_cli.COMMANDS:  # keygen, publish, deploy, jobs, job, cancel, rollback
    cli.add_command(_command)


def main() -> None:
    run(cli, "edge-fleet", env_prefix="EDGE_FLEET")  # e.g. EDGE_FLEET_SERVE_CLIENT_ID (systemd/fleet.env)


if __name__ == "__main__":
    main()
