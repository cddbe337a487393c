"""The models bench/quality.py and bench/tps.py run (`--model NAME`), one row each, and where their token ids
come from.

A row names the source GGUF (quantize.fetch's known model, looked up only when it is benchmarked), the
quantization llama.cpp's file of it holds (its "source file" rows), the cache folder of its built artifacts
and the docs section titles. SmolLM2 keeps the cache root and the section titles it had before there were
other models, so its cached artifacts and docs sections stay valid.

Token ids come from one place for every engine and every benchmark: llama.cpp's tokenizer of the source GGUF
(in the peer venv, `Llama(path, vocab_only=True).tokenize(text, add_bos=True)`: BOS only when the GGUF asks
for it, as Gemma's does). For SmolLM2 and Qwen2.5 these are the ids quantize.package.encode gives.

Run: .venv/bin/python bench/benchmodels.py   # list the models and whether their GGUFs are present
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BENCH_CACHE = Path.home() / ".cache" / "edge-llm" / "bench"
PEER_PYTHON = REPO / ".venv-peers" / "bin" / "python"
PEER_SCRIPT = Path(__file__).resolve().parent / "_peers_llamacpp.py"


def fetched(name: str) -> Callable[[], Path]:
    """The GGUF of a quantize.fetch known model (a stat once it is cached)."""
    def path() -> Path:
        sys.path.insert(0, str(REPO))
        from quantize.fetch import fetch

        return fetch(name)
    return path


@dataclass(frozen=True)
class BenchModel:
    name: str  # --model
    title: str  # as the docs name it
    source: Callable[[], Path]  # the GGUF every artifact is made from
    source_quant: str  # llama.cpp's type mix of the source file, e.g. "Q4_K_M"
    cache_subdir: str  # under ~/.cache/edge-llm/bench ("" for SmolLM2, whose artifacts predate the others)
    genai_args: tuple[str, ...] = ("-p", "int4", "-e", "cpu")  # onnxruntime_genai.models.builder precision
    # bench/tps.py runs ours with this EngineConfig.memory_budget_mb (None: its default, 1024 MB, too little
    # for the 1.5B's weights); the KV pool's pages come on use, so a larger budget does not add to peak RSS
    memory_budget_mb: int | None = None

    @property
    def cache(self) -> Path:
        return BENCH_CACHE / self.cache_subdir if self.cache_subdir else BENCH_CACHE

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT

    def docs_title(self, kind: str, script: str) -> str:
        """"## Quality (bench/quality.py)" for SmolLM2; "## Quality: TITLE (bench/quality.py --model NAME)" else."""
        if self.is_default:
            return f"## {kind} ({script})"
        return f"## {kind}: {self.title} ({script} --model {self.name})"


DEFAULT = "smollm2-135m"
MODELS = {m.name: m for m in (
    BenchModel(DEFAULT, "SmolLM2-135M-Instruct", fetched("smollm2-135m-instruct"), "Q4_1", ""),
    BenchModel("qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct", fetched("qwen2.5-coder-0.5b-instruct"), "Q4_K_M",
               "qwen2.5-0.5b"),
    BenchModel("qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct", fetched("qwen2.5-coder-1.5b-instruct"), "Q4_K_M",
               "qwen2.5-1.5b", memory_budget_mb=3072),
    BenchModel("gemma3-270m", "Gemma 3 270M", fetched("gemma3-270m"), "Q4_K_M", "gemma3-270m"),
)}


def peer(*args: str, threads: int = 2) -> dict:
    """Run bench/_peers_llamacpp.py in the peer venv; its last stdout line is a JSON result."""
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run `bash bench/setup_peers` first")
    cmd = [str(PEER_PYTHON), str(PEER_SCRIPT), *args, "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"peer command failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def token_ids(source: Path, text_path: Path, out: Path) -> list[int]:
    """The ids of the text as llama.cpp tokenizes it for the source GGUF (BOS when the GGUF asks), saved to
    out (int32 .npy) for the workers."""
    peer("tokenize", str(source), str(text_path), str(out))
    return np.load(out).tolist()


if __name__ == "__main__":
    for m in MODELS.values():
        try:
            where = str(m.source())
        except Exception as e:  # noqa: BLE001 -- a listing: say what is missing and go on
            where = str(e)
        print(f"{m.name:14} {m.title:30} {m.source_quant:7} {where}")
