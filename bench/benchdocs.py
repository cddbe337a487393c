"""docs/benchmarks.md, written by every benchmark: each replaces its own "## ..." section and no other."""
from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nFigures measured by the scripts in `bench/`; each section says how it was run and on what machine.\n"


def replace_section(title: str, section: str) -> None:
    """Put `section` (which starts with `title`) in place of the old one, or append it; atomic rename."""
    text = DOCS.read_text() if DOCS.exists() else HEADER
    start = text.find(title)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(title))
        text = text[:start] + section.rstrip("\n") + "\n" + ("" if nxt < 0 else "\n" + text[nxt + 1:])
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    tmp = DOCS.with_suffix(".md.partial")
    tmp.write_text(text)
    tmp.rename(DOCS)


def machine() -> str:
    """The CPU, its cores and the versions a figure depends on, for a section's "Machine:" line."""
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores; Python {platform.python_version()}, onnxruntime {onnxruntime.__version__}"


def stamp() -> str:
    """"2026-12-07 12:00 UTC, commit abc1234, load 1.20": when, on what code and how busy the machine was."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=DOCS.parent.parent, capture_output=True,
                          text=True).stdout.strip() or "unknown"
    return f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {head}, load {os.getloadavg()[0]:.2f}"
