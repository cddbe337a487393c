"""agent.logs: warnings a peer can trigger at will go out once a window, with counts.

Run: .venv/bin/pytest tests/agent/test_logs.py -q
"""
from __future__ import annotations

import logging

from agent.logs import Repeats, by_format


def warning(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("agent.link.mqtt.commands", logging.WARNING, "", 0, msg, args, None)


def test_warnings_of_one_kind_count_as_one_whatever_they_carry():
    """A flood of commands with a new name each must not make each warning new (the text alone would)."""
    now = [0.0]
    repeats = Repeats(60.0, clock=lambda: now[0], key=by_format)
    refused = [warning("mqtt: command %r refused: %s", f"cmd-{i}", "unknown command") for i in range(5)]
    assert [repeats.filter(r) for r in refused] == [True, False, False, False, False]
    assert repeats.filter(warning("mqtt: command %r expired while it waited for the one before; not run", "ping"))
    now[0] = 61.0
    later = warning("mqtt: command %r refused: %s", "cmd-5", "unknown command")
    assert repeats.filter(later)
    assert later.getMessage() == "mqtt: command 'cmd-5' refused: unknown command (4 more in the last 60 s)"
    by_text = Repeats(60.0, clock=lambda: now[0])  # the default: the text, as uvicorn's constant messages need
    assert all(by_text.filter(warning("mqtt: command %r refused: %s", f"cmd-{i}", "x")) for i in range(3))
