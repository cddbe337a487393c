"""Log filters shared by the agent's services: warnings that a peer can trigger at will (a bad HTTP
connection, a flood of MQTT commands) go to the journal once a window, with a count of those held back.

Example:
    logging.getLogger("uvicorn.error").addFilter(Repeats())  # each warning text once a minute
    logging.getLogger("agent.link.mqtt.commands").addFilter(Repeats(key=by_format))  # each kind once a minute
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


def by_format(record: logging.LogRecord) -> str:
    """A warning's kind: its format string, whatever its arguments (a command's name, its error)."""
    return str(record.msg)


class Repeats(logging.Filter):
    """Lets each warning through once a window (a minute), with the count of those held back since. uvicorn logs
    one per bad connection ("Invalid HTTP request received.", "Exceeded concurrency limit."): a local client
    sending garbage can write 4,200 lines a second to the journal. Errors and tracebacks always go through.

    Repeats are told apart by key(record): the text by default; by_format counts the warnings of one kind as
    one, so that varying what a flood carries (a command's name) does not make each message new.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 key: Callable[[logging.LogRecord], str] = logging.LogRecord.getMessage):
        super().__init__()
        self.window_s, self.clock, self.key = window_s, clock, key
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (when last let through, held back since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.exc_info:  # errors and tracebacks: each is news
            return True
        key, now = self.key(record), self.clock()
        with self._lock:
            if len(self._seen) > 1000:  # messages with varying text: forget, rather than grow
                self._seen.clear()
            last, held = self._seen.get(key, (-float("inf"), 0))
            if now - last < self.window_s:
                self._seen[key] = (last, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            record.msg, record.args = f"{record.getMessage()} ({held} more in the last {self.window_s:.0f} s)", ()
        return True
