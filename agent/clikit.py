"""What the three command lines (edge-quantize, edge-agent, edge-fleet) share: how a CLI is run."""
from __future__ import annotations

import math
import sys

import click

from agent.wire import MAX_EXPIRY_S


class Seconds(click.FloatRange):
    """A number of seconds from `min` up to the longest MQTT message expiry (a timeout becomes one).

    click's FloatRange lets NaN through (every comparison with it is false), and a NaN deadline never
    passes; a timeout past MQTT's four-byte limit failed only when the message went out."""

    name = "seconds"

    def __init__(self, min: float):
        super().__init__(min=min, max=MAX_EXPIRY_S)

    def convert(self, value, param, ctx):
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


def run(group: click.Group, prog_name: str, env_prefix: str | None = None) -> None:
    """Run a click group; a bug of ours becomes one line for the user (exit 2), never a traceback.

    env_prefix: options may also come from the environment, as PREFIX_COMMAND_OPTION (click's
    auto_envvar_prefix), which is how a systemd unit's EnvironmentFile configures a command."""
    try:
        code = group.main(prog_name=prog_name, auto_envvar_prefix=env_prefix, standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C (KeyboardInterrupt; SIGTERM where a command maps it to one)
        click.echo("Aborted!", err=True)
        sys.exit(130)  # 128 + SIGINT, as shells report an interrupted command (click says 1)
    except click.ClickException as e:  # the user's error: usage, a bad value, a refused input
        e.show()
        sys.exit(e.exit_code)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"Error: internal error ({type(e).__name__}): {first}", err=True)
        sys.exit(2)
    sys.exit(code if type(code) is int else 0)  # an int only from --help and the like (click's Exit)
