"""What the edge-fleet commands share: the --db, --json, --mqtt and --since options, the errors a user can cause
turned into one line, and the tables query rows print as. fleet.cli and fleet.rollout_cli build on it.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import click

from agent.mqtt_link import LinkError
from fleet.commands import CommandError
from fleet.db import database_errors, has_password
from fleet.queries import QueryError

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
