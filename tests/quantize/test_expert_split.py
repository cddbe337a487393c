"""SmolLM2-135M with each MLP split into 8 experts, all 8 routed with weight 1 (tests/expert_split.py): the MoE
graph must compute the dense model. fp32 to fp32 precision; INT4 within the dense INT4's distance of the fp32
model, which is what packing, routing and the QMoE path being right on real weights looks like."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from agent.engine.runner import ModelRunner
from expert_split import split_experts
from quantize.checkpoint import load_checkpoint
from quantize.graph import build_graph
from quantize.package import encode
from quantize.precision import QuantSpec

pytestmark = pytest.mark.real_model
TEXT = ("The quick brown fox jumps over the lazy dog. Mixture of experts models route each token to a few of "
        "their feed-forward networks, so that a token reads a fraction of the weights. ")


def logits(ckpt, spec: QuantSpec, ids: list[int], path) -> np.ndarray:
    g = ckpt.geometry
    onnx.save_model(build_graph(ckpt, spec)[0], str(path), save_as_external_data=True, location=path.name + ".data")
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    n = len(ids)
    return runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None],
                          runner.new_cache(1, n))[0]


def mean_kl(ref: np.ndarray, ours: np.ndarray) -> float:
    p, q = (np.exp(a - a.max(-1, keepdims=True)) for a in (ref, ours))
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    return float((p * (np.log(p) - np.log(q))).sum(-1).mean())


@pytest.fixture(scope="module")
def models(real_gguf, tmp_path_factory):
    dense = load_checkpoint(real_gguf)
    ids = encode(dense.tokenizer.tokenizer_json, TEXT)
    tmp = tmp_path_factory.mktemp("split")
    reference = logits(dense, QuantSpec(), ids, tmp / "dense.onnx")
    return dense, split_experts(dense, 8), ids, reference, tmp


def test_the_fp32_split_reproduces_the_dense_model(models, figures):
    dense, split, ids, reference, tmp = models
    ours = logits(split, QuantSpec(), ids, tmp / "split.onnx")
    err = float(np.abs(ours - reference).max() / np.abs(reference).max())
    figures.append(f"SmolLM2 split 8 experts x top 8, fp32: max |split - dense| / max |logit| = {err:.1e} "
                   f"over {len(ids)} tokens")
    assert err < 1e-4


def test_the_int4_split_is_as_close_to_the_model_as_the_dense_int4(models, figures):
    """RTN at the same block size on both sides, so each expert's rows are the dense rows' own blocks and codes
    (QMoE's one block size for fc1 and fc2 is 64 here: it must divide 576 and the experts' 192, which the
    dense down_proj's 1536 splits into at block boundaries)."""
    dense, split, ids, reference, tmp = models
    spec = QuantSpec(precision="int4", method="rtn", block_size=64, block_sizes={})
    dense4, split4 = logits(dense, spec, ids, tmp / "dense4.onnx"), logits(split, spec, ids, tmp / "split4.onnx")
    kl_dense, kl_split, kl_between = mean_kl(reference, dense4), mean_kl(reference, split4), mean_kl(dense4, split4)
    figures.append(f"SmolLM2 INT4 RTN b64 mean KL vs fp32 over {len(ids)} tokens: dense {kl_dense:.4f}, "
                   f"8-expert split {kl_split:.4f}, split vs dense INT4 {kl_between:.5f}")
    assert kl_split < 1.5 * kl_dense + 0.01
    assert kl_between < 0.1 * kl_dense


def test_a_split_routing_fewer_than_all_experts_is_another_model(models):
    dense, _, ids, reference, tmp = models
    proxy = split_experts(dense, 8, per_token=2)
    assert proxy.geometry.num_experts_per_tok == 2
    assert float(np.abs(logits(proxy, QuantSpec(), ids[:8], tmp / "proxy.onnx") - reference[:8]).max()) > 1.0
