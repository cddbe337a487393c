"""The real SmolLM2-135M-Instruct: fp32 bundle against the numpy reference, INT8 and INT4 quality bounds.

Quality is measured from the fp32 weights (the GGUF dequantized), over quantize/data/eval_en.txt (~1,800
tokens), with importance statistics from the separate calibration text, as `edge-quantize build` does.
"""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer

import reference
from agent.engine.runner import open_runner
from quantize.cli import default_calibration_text, default_eval_text
from quantize.evaluate import greedy
from quantize.package import build_bundle, encode
from quantize.precision import QuantSpec

pytestmark = pytest.mark.real_model

CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def q4_0_size_bytes(ckpt) -> int:
    """What llama.cpp's Q4_0 file of this model holds: 4.5 bits a weight for every projection, and the tied
    token embedding as Q8_0 (8.5 bits; llama.cpp's Q6_K choice falls back to Q8_0 because 576 is not a
    multiple of 256), norms in F32. The GGUF's tokenizer metadata is left out, as is our tokenizer.json."""
    total = 0
    for name, w in ckpt.weights.items():
        bits = 32 if w.ndim == 1 else (8.5 if "embed_tokens" in name else 4.5)
        total += w.size * bits / 8
    return int(total)


def weight_bytes(bundle) -> int:
    """The weights' file (the graph's structure, like a GGUF's header, is left out on both sides)."""
    return bundle.manifest.files["model.onnx.data"].size_bytes


def test_fp32_greedy_chat_matches_numpy_reference_for_32_tokens(real_checkpoint, real_fp32_bundle):
    ids = encode(real_checkpoint.tokenizer.tokenizer_json, CHAT)
    ours = greedy(open_runner(real_fp32_bundle), ids, 32)
    assert ours == reference.greedy(real_checkpoint, ids, 32)
    text = Tokenizer.from_str(real_checkpoint.tokenizer.tokenizer_json).decode(ours)
    assert "Paris" in text


def test_int8_quality(real_checkpoint, tmp_path):
    b = build_bundle(real_checkpoint, QuantSpec(precision="int8", block_size=32, block_sizes={}),
                     tmp_path / "int8", name="smollm2",
                     eval_text=default_eval_text(), calibration_text=default_calibration_text())
    q = b.manifest.quality
    print(f"int8: {weight_bytes(b) / 1e6:.1f} MB, mean KL {q.mean_kl:.4f}, top-1 {q.top1_agreement:.3f}")
    assert q.tokens >= 1500
    assert q.mean_kl < 0.01 and q.top1_agreement >= 0.93


def test_int4_improved_quality_within_q4_0_size(real_checkpoint, tmp_path):
    b = build_bundle(real_checkpoint, QuantSpec(precision="int4"), tmp_path / "int4", name="smollm2",
                     eval_text=default_eval_text(), calibration_text=default_calibration_text())
    q = b.manifest.quality
    size, budget = weight_bytes(b), q4_0_size_bytes(real_checkpoint)
    print(f"int4: {size / 1e6:.1f} MB (Q4_0 {budget / 1e6:.1f} MB), mean KL {q.mean_kl:.4f}, top-1 {q.top1_agreement:.3f}")
    assert size <= budget
    assert q.mean_kl < 0.22 and q.top1_agreement >= 0.72
