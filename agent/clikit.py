"""What the three command lines (edge-quantize, edge-agent, edge-fleet) share: how a CLI is run."""
from __future__ import annotations

import logging
import math
import os
import signal
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
    signal.signal(signal.SIGINT, signal.default_int_handler)  # loaded: Ctrl-C is click's Abort from here on
    try:
        code = group.main(prog_name=prog_name, auto_envvar_prefix=env_prefix, standalone_mode=False)
    except click.exceptions.Abort:  # Ctrl-C (KeyboardInterrupt; SIGTERM where a command maps it to one)
        click.echo("Aborted!", err=True)
        sys.exit(130)  # 128 + SIGINT, as shells report an interrupted command (click says 1)
    except click.ClickException as e:  # the user's error: usage, a bad value, a refused input
        e.show()
        sys.exit(e.exit_code)
    except MemoryError:  # str(MemoryError()) is empty: say what it means
        click.echo("Error: out of memory: this needs more memory than the process may use (free some, raise its "
                   "limit, or use a machine with more)", err=True)
        sys.exit(1)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"Error: internal error ({type(e).__name__}): {first}", err=True)
        sys.exit(2)
    sys.exit(code if type(code) is int else 0)  # an int only from --help and the like (click's Exit)


# sd-daemon(3)'s priority prefixes, which journald reads off each line of a service's stderr
_SYSLOG_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


class _JournalFormatter(logging.Formatter):
    """Each line prefixed with its priority, so that `journalctl -p warning` finds the warnings (every line was
    "info" to journald), and no time stamp: journald keeps its own."""

    def format(self, record: logging.LogRecord) -> str:
        priority = _SYSLOG_PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{priority}>{line}" for line in super().format(record).splitlines())


def _stderr_is_the_journal() -> bool:
    """$JOURNAL_STREAM names the device and inode of the stream systemd connected to journald."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(sys.stderr.fileno())
        return (st.st_dev, st.st_ino) == (int(device), int(inode))
    except (ValueError, OSError):
        return False


def setup_logging(level: int, timestamps: bool = False) -> None:
    """Log to stderr at `level`: for journald with priorities and without time stamps, otherwise as
    "[time ]LEVEL logger: message"."""
    handler = logging.StreamHandler(sys.stderr)
    text = "%(levelname)s %(name)s: %(message)s"
    if _stderr_is_the_journal():
        handler.setFormatter(_JournalFormatter(text))
    else:
        handler.setFormatter(logging.Formatter(("%(asctime)s " if timestamps else "") + text))
    logging.basicConfig(level=level, handlers=[handler])
