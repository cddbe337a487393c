"""A logging handler that keeps the messages of WARNING and above, for tests that count what was logged
from other threads (pytest's caplog only sees the test's own thread reliably)."""
from __future__ import annotations

import logging


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def count(self, text: str) -> int:
        return sum(text in line for line in list(self.lines))
