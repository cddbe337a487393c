"""What the three command lines (edge-quantize, edge-agent, edge-fleet) share: how a CLI is run."""
from __future__ import annotations

import sys

import click


def run(group: click.Group, prog_name: str) -> None:
    """Run a click group; a bug of ours becomes one line for the user (exit 2), never a traceback."""
    try:
        group(prog_name=prog_name)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        click.echo(f"Error: internal error ({type(e).__name__}): {first}", err=True)
        sys.exit(2)
