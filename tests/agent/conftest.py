"""Fixtures shared by several agent test modules: the telemetry database path."""
from __future__ import annotations

from pathlib import Path

import pytest

from agent.link.telemetry import DB_NAME


@pytest.fixture
def db_path(tmp_path) -> Path:
    return tmp_path / DB_NAME
