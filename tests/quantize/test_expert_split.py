"""SmolLM2-135M with each MLP split into 8 experts, all 8 routed with weight 1 (tests/expert_split.py): the MoE
graph must compute the dense model. fp32 to fp32 precision; INT4 round to nearest within the dense INT4's
distance of the fp32 model, and INT4 GPTQ (the bundled calibration text) the dense INT4 GPTQ's less only the
cross-expert terms per-expert GPTQ cannot see: what packing, routing, the experts' calibration and the QMoE path
being right on real weights looks like."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from agent.engine.runner import ModelRunner
from expert_split import split_experts
from quantize.calibrate import calibration
from quantize.checkpoint import load_checkpoint
from quantize.cli import default_calibration_text, default_eval_text
from quantize.graph import build_graph
from quantize.package import encode
from quantize.precision import QuantSpec

pytestmark = pytest.mark.real_model
TEXT = ("The quick brown fox jumps over the lazy dog. Mixture of experts models route each token to a few of "
        "their feed-forward networks, so that a token reads a fraction of the weights. ")
EVAL_CHARS = 1300  # of the bundled evaluation text (never calibration's): 278 SmolLM2 tokens


def logits(ckpt, spec: QuantSpec, ids: list[int], path, model: onnx.ModelProto | None = None) -> np.ndarray:
    g = ckpt.geometry
    model = model or build_graph(ckpt, spec)[0]
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    n = len(ids)
    return runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None],
                          runner.new_cache(1, n))[0]


def token_kl(ref: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """KL(ref || ours) at each position [T]."""
    p, q = (np.exp(a - a.max(-1, keepdims=True)) for a in (ref, ours))
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    return (p * (np.log(p) - np.log(q))).sum(-1)


def mean_kl(ref: np.ndarray, ours: np.ndarray) -> float:
    return float(token_kl(ref, ours).mean())


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


def hessians_of(ckpt, calib_ids: list[int], tmp) -> tuple[dict, dict]:
    """(importance, every Hessian by key) over the calibration ids."""
    with calibration(ckpt, calib_ids, with_hessians=True, threads=2, work_dir=tmp) as calib:
        return calib.importance, {k: calib.hessians.pop(k) for k in list(calib.hessians.keys)}


def block_diagonal_down(hessians: dict, experts: int) -> dict:
    """A copy of the Hessians (GPTQ overwrites those it is given) with each dense down_proj's [I, I] cut to the
    experts' diagonal blocks: what per-expert GPTQ sees of it."""
    out = {}
    for k, h in hessians.items():
        if k.endswith("down_proj.weight"):
            block = h.shape[0] // experts
            out[k] = h * np.kron(np.eye(experts), np.ones((block, block)))
        else:
            out[k] = h.copy()
    return out


def test_the_int4_gptq_split_is_the_dense_int4_gptq_without_the_cross_expert_terms(models, figures):
    """Every expert sees every calibration token here, so each gets GPTQ from the dense gate_up's Hessian and the
    diagonal block of the dense down's that covers its neurons: the split's INT4 GPTQ must be the dense INT4 GPTQ
    with each down Hessian cut to those blocks, within noise. What the cut costs against the full dense GPTQ is
    the price of quantizing experts apart (recorded; a real MoE routes each token to k experts, so there are no
    fixed cross-expert terms to keep). Blocks of 64 on both sides (QMoE's one block size for fc1 and fc2); KL
    over a held-out excerpt of the evaluation text."""
    dense, split, _, _, tmp = models
    calib_ids = encode(dense.tokenizer.tokenizer_json, default_calibration_text())
    ids = encode(dense.tokenizer.tokenizer_json, default_eval_text()[:EVAL_CHARS])
    reference = logits(dense, QuantSpec(), ids, tmp / "dense_eval.onnx")
    spec = QuantSpec(precision="int4", method="gptq", block_size=64, block_sizes={})
    importance, hessians = hessians_of(dense, calib_ids, tmp)
    cut = block_diagonal_down(hessians, 8)
    dense4 = logits(dense, spec, ids, tmp / "dense4_gptq.onnx", build_graph(dense, spec, importance, hessians)[0])
    dense4_cut = logits(dense, spec, ids, tmp / "dense4_cut.onnx", build_graph(dense, spec, importance, cut)[0])
    importance, hessians = hessians_of(split, calib_ids, tmp)
    split_model, report = build_graph(split, spec, importance, hessians)
    split4 = logits(split, spec, ids, tmp / "split4_gptq.onnx", split_model)
    rtn = logits(split, spec.model_copy(update={"method": "rtn"}), ids, tmp / "split4_rtn.onnx")
    moe = [line for line in report if "/moe:" in line]
    assert len(moe) == dense.geometry.num_layers
    assert all("GPTQ for gate_up of 8/8 experts, down of 8/8" in line for line in moe), moe[0]
    kl = {name: token_kl(reference, ours) for name, ours in
          (("dense", dense4), ("cut", dense4_cut), ("split", split4), ("rtn", rtn))}
    # the noise: the standard error of the mean per-token difference over these tokens
    diff = kl["split"] - kl["cut"]
    noise = float(diff.std(ddof=1) / np.sqrt(len(diff)))
    figures.append(f"SmolLM2 INT4 GPTQ b64 mean KL vs fp32 over {len(ids)} held-out tokens: 8-expert split "
                   f"{kl['split'].mean():.4f}, dense with block-diagonal down Hessians {kl['cut'].mean():.4f} "
                   f"(split - that {diff.mean():+.4f} +- {noise:.4f} standard error), dense {kl['dense'].mean():.4f}, "
                   f"split RTN {kl['rtn'].mean():.4f}")
    assert abs(diff.mean()) < max(2 * noise, 0.02 * kl["cut"].mean())
    assert kl["split"].mean() < 1.25 * kl["dense"].mean()
    assert kl["split"].mean() < 0.8 * kl["rtn"].mean()  # GPTQ reached the experts
