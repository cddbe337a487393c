"""edge-fleet's rollout commands: signing keys, publishing bundles, deploying them in waves, and following,
canceling and rolling back the jobs (fleet.updates carries them out; edge-fleet serve drives them).

Run: edge-fleet keygen --out keys/fleet.key
     edge-fleet publish BUNDLE --key keys/fleet.key     edge-fleet deploy MODEL@VERSION --all --wait
     edge-fleet publish ADAPTER_DIR --key keys/fleet.key
     edge-fleet deploy MODEL@VERSION:ADAPTER@VERSION --all --wait [--remove]
     edge-fleet jobs | job JOB_ID | cancel JOB_ID | rollback DEVICE
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from agent.clikit import Seconds
from fleet import queries
from fleet.cli_options import db_option, echo_rows, json_option, user_errors
from fleet.db import is_url

@click.command()
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


@click.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--key", "key_path", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The private signing key (edge-fleet keygen); devices trust its .pub ([updates] trusted_keys).")
@click.option("--artifacts-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("artifacts"),
              show_default=True, help="Where the bundle is copied: `edge-fleet serve --artifacts-dir` serves it.")
@db_option
@user_errors
def publish(bundle, key_path, artifacts_dir, db_path):
    """Verify and sign a bundle's manifest and register it; prints MODEL@VERSION. A LoRA adapter's folder
    (edge-quantize adapter) is signed and registered alike; prints MODEL@VERSION:ADAPTER@VERSION.

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


@click.command()
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
@click.option("--remove", is_flag=True,
              help="With MODEL@VERSION:ADAPTER@VERSION: remove that adapter from the devices (default: install it).")
@wait_options
@click.option("--mqtt", "url", default=None, multiple=True,
              help="Accepted for symmetry (default: none); the serving fleet process publishes.")
@db_option
@user_errors
def deploy(target, devices, group, to_all, include_offline, wave_size, max_failure_rate, allow_downgrade,
           min_tokens_per_s, device_timeout_s, remove, wait, timeout_s, url, db_path):
    """Roll MODEL@VERSION out to devices in waves (edge-fleet serve --artifacts-http must be running). A bare
    MODEL lists its published versions. MODEL@VERSION:ADAPTER@VERSION rolls out a LoRA adapter published for
    that build (only its files travel); devices running another build refuse it. --remove takes it away.

    Example: edge-fleet deploy smollm2-135m-instruct@int4-b64a-1a2b3c4d --all --wave-size 2 --wait
    """
    from fleet import deployment
    from fleet.updates import create_job

    operation = _operation(target, remove)
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
    manifest = deployment.published_manifest(store.db, target) if operation == "install" else None
    if manifest is not None and (problems := deployment.refusals(store.db, manifest, plan.devices, allow_downgrade,
                                                                min_tokens_per_s)):
        raise click.ClickException(f"{target} would be refused: " + "\n".join(problems) + "\n(no job was created)")
    job_id = create_job(store.db, target, plan.devices, wave_size, max_failure_rate, allow_downgrade,
                        min_tokens_per_s, operation=operation, device_timeout_s=device_timeout_s)
    click.echo(f"job {job_id}: {target} to {len(plan.devices)} device(s) in waves of "
               f"{min(wave_size, len(plan.devices))}")
    if wait:
        _wait_for(store.db, db_path, job_id, timeout_s)


def _operation(target: str, remove: bool) -> str:
    """What deploy's TARGET asks of the devices: install a model, or install or remove an adapter."""
    if ":" in target:
        return "remove_adapter" if remove else "install_adapter"
    if remove:
        raise click.UsageError("--remove takes an adapter: MODEL@VERSION:ADAPTER@VERSION")
    return "install"


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


@click.command()
@db_option
@json_option
@user_errors
def jobs(db_path, as_json):
    """List rollout jobs, newest first.

    Example: edge-fleet jobs --db fleet.db
    """
    from fleet.updates import list_jobs

    echo_rows(list_jobs(queries.open_readonly(db_path)), as_json)  # a mistyped --db is an error, not a new file


@click.command()
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


@click.command()
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


@click.command()
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


COMMANDS = (keygen, publish, deploy, jobs, job, cancel, rollback)
