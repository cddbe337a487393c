"""docs/benchmarks.md, written by every benchmark: each replaces its own "## ..." section and no other."""
from __future__ import annotations

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
