"""Config files: the shipped sample validates; unknown keys and bad values are errors that name the key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).parent.parent.parent / "systemd" / "agent.toml"


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent.cli", "check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)


def test_shipped_sample_is_valid():
    r = check(SAMPLE)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_unknown_key_lists_the_allowed_ones_and_bad_value_its_range(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text('[engine]\nmemory_budget_mb = 10\nmax_queu = 3\n[api]\nsocket_mode = "0999"\n')
    r = check(bad)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "engine.max_queu: unknown key (allowed here: threads, memory_budget_mb" in r.stderr
    assert "engine.memory_budget_mb: Input should be greater than or equal to 64" in r.stderr
    assert "api.socket_mode" in r.stderr


def test_toml_syntax_error_names_the_line(tmp_path):
    bad = tmp_path / "agent.toml"
    bad.write_text("model = 1\n[engine\n")
    r = check(bad)
    assert r.returncode != 0 and "line 2" in r.stderr and "Traceback" not in r.stderr
