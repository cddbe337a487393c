"""The README's set-up step (.ci/setup): a Python too old for our dependencies, and the models it fetches."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_setup_names_a_python_too_old_instead_of_failing_inside_pip(tmp_path):
    """Found in review: on Ubuntu 22.04 (Python 3.10) the venv was made and pip found no onnxruntime >= 1.32
    for it, so an older one came in (before the floor was declared) and every model failed to load."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "setup", tmp_path / ".ci" / "setup")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    old = bin_dir / "python3"  # answers the version check as 3.10 does
    old.write_text('#!/bin/sh\nif [ "$1" = --version ]; then echo "Python 3.10.12"; exit 0; fi\nexit 1\n')
    old.chmod(0o755)
    for tool in ("dirname", "sha256sum", "cut"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    r = subprocess.run(["/bin/bash", str(tmp_path / ".ci" / "setup")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": str(bin_dir)})
    assert r.returncode == 1, r
    assert "needs Python 3.11 or newer (python3 is Python 3.10.12)" in r.stderr, r.stderr
    assert not (tmp_path / ".venv").exists()


def test_setup_fetches_every_known_model():
    """The real-model tests (tests/quantize/test_fetch.py) take them from the cache .ci/setup fills."""
    from quantize.fetch import KNOWN_MODELS

    setup = (REPO / ".ci" / "setup").read_text()
    line = next(line for line in setup.splitlines() if line.startswith("for model in "))
    assert line.removeprefix("for model in ").removesuffix("; do").split() == list(KNOWN_MODELS)
    assert ".venv/bin/python -m quantize.fetch \"$model\"" in setup
