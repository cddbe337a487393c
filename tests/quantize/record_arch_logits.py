"""Record the reference logits of the tiny architecture fixtures from llama.cpp and transformers.

For each architecture of tests/archs.py it builds the tiny model (HF folder + GGUF, with the project's
Python, which has gguf), runs llama.cpp (llama-cpp-python) on the GGUF and transformers on the HF folder
over TOKEN_IDS, checks that the two agree, and stores under tests/quantize/data/arch_logits/<name>/:
model.gguf, hf/ (config.json, model.safetensors, tokenizer files) and logits.npz. The model files are
committed with the logits, so the recording stays valid whatever numpy's RNG later does.

logits.npz keys: token_ids, n_ctx, logits (llama.cpp, float32, every position), logits_transformers,
max_abs_diff, gguf_sha256, llama_cpp_version, transformers_version, torch_version; phi3 also holds the
long-factor run: n_ctx_long, logits_long, logits_long_transformers, max_abs_diff_long.

Run (the peers venv has llama_cpp, transformers and torch; the product and the tests never import them):
    /work/main/.venv-peers/bin/python tests/quantize/record_arch_logits.py [--project-python PY] [NAME ...]
"""
from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import llama_cpp
import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

TESTS = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data" / "arch_logits"
NAMES = ("qwen2", "qwen3", "gemma3", "smollm3", "granite", "llama3.2", "phi3", "qwen3moe", "olmoe", "granitemoe", "mixtral")
VOCAB = 269
# 48 ids: six of Gemma 3's 8-token windows. Specials (0-2) left out so that no tokenizer rule matters.
TOKEN_IDS = [int(i) for i in np.random.default_rng(20261206).integers(3, VOCAB, 48)]
N_CTX = 256  # llama.cpp's minimum (it pads a smaller n_ctx up to 256)
# Phi-3 LongRoPE (original context 256): llama.cpp takes the long factors when n_ctx > 256; transformers
# when the sequence is longer than 256, so its long run scores a 300-token sequence that starts with TOKEN_IDS.
PHI3_N_CTX_LONG, PHI3_LONG_TOKENS = 512, 300
# Agreement required between the peers, relative to the largest |logit| (llama.cpp computes GELU through
# an fp16 table: Gemma 3 differs by ~2e-4 of its scale, the SiLU models by ~1e-6).
MAX_REL_DIFF = 1e-3


def build(names: list[str], project_python: str) -> None:
    subprocess.run([project_python, str(TESTS / "archs.py"), str(DATA), *names], check=True)


def llama_cpp_logits(gguf: Path, ids: list[int], n_ctx: int) -> np.ndarray:
    """All positions' logits, with an F32 KV cache and no flash attention (F16 there costs ~1e-3)."""
    llm = llama_cpp.Llama(str(gguf), logits_all=True, n_ctx=n_ctx, n_threads=2, n_batch=n_ctx,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
                          verbose=False)
    assert llm.n_ctx() == n_ctx, f"llama.cpp runs n_ctx {llm.n_ctx()}, not {n_ctx}"
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], np.float32)
    llm.close()
    return logits


def transformers_logits(folder: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)


def agreement(name: str, a: np.ndarray, b: np.ndarray) -> float:
    diff, scale = float(np.abs(a - b).max()), float(np.abs(b).max())
    print(f"{name:14s} max |llama.cpp - transformers| = {diff:.2e}  (max |logit| {scale:.1f})")
    if diff > MAX_REL_DIFF * scale:
        raise SystemExit(f"{name}: llama.cpp and transformers disagree ({diff:.2e} > {MAX_REL_DIFF} x {scale:.1f});"
                         " one of the two writers in tests/archs*.py is wrong")
    return diff


def record(name: str) -> None:
    folder = DATA / name
    gguf = folder / "model.gguf"
    logits = llama_cpp_logits(gguf, TOKEN_IDS, N_CTX)
    reference = transformers_logits(folder / "hf", TOKEN_IDS)
    arrays = {
        "token_ids": np.asarray(TOKEN_IDS, np.int32), "n_ctx": np.int32(N_CTX), "logits": logits,
        "logits_transformers": reference, "max_abs_diff": np.float32(agreement(name, logits, reference)),
        "gguf_sha256": np.str_(hashlib.sha256(gguf.read_bytes()).hexdigest()),
        "llama_cpp_version": np.str_(llama_cpp.__version__),
        "transformers_version": np.str_(transformers.__version__), "torch_version": np.str_(torch.__version__),
    }
    if name == "phi3":
        arrays.update(phi3_long_run(folder))
    np.savez(folder / "logits.npz", **arrays)


def phi3_long_run(folder: Path) -> dict[str, np.ndarray]:
    long_ids = TOKEN_IDS + [int(i) for i in np.random.default_rng(7).integers(3, VOCAB, PHI3_LONG_TOKENS - 48)]
    logits = llama_cpp_logits(folder / "model.gguf", TOKEN_IDS, PHI3_N_CTX_LONG)
    reference = transformers_logits(folder / "hf", long_ids)[:len(TOKEN_IDS)]
    return {"n_ctx_long": np.int32(PHI3_N_CTX_LONG), "logits_long": logits, "logits_long_transformers": reference,
            "max_abs_diff_long": np.float32(agreement("phi3 (long)", logits, reference))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"some of {', '.join(NAMES)} (default: all)")
    parser.add_argument("--project-python", default="/work/main/.venv/bin/python",
                        help="a Python with gguf and safetensors, to build the fixtures")
    args = parser.parse_args()
    names = args.names or list(NAMES)
    if unknown := set(names) - set(NAMES):
        parser.error(f"unknown architecture(s) {sorted(unknown)}")
    build(names, args.project_python)
    for name in names:
        record(name)


if __name__ == "__main__":
    sys.exit(main())
