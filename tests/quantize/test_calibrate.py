"""Calibration: GPTQ's Hessians a group at a time, within a memory budget, with the same result."""
from __future__ import annotations

import json

import numpy as np

from quantize.calibrate import calibration, hessian_bytes

TEXT = "the cat sat on the mat and then the dog ran in the rain " * 12


def _ids(ckpt) -> list[int]:
    from quantize.package import encode

    return encode(ckpt.tokenizer.tokenizer_json, TEXT)


def test_hessians_in_groups_equal_all_at_once_bit_for_bit(tiny_checkpoint):
    """Found in review: every layer's Hessian was held at once (~10 GB for a 1B Llama). A budget that holds
    a few of them at a time takes more passes over the text and must give exactly the same sums."""
    ids = _ids(tiny_checkpoint)
    with calibration(tiny_checkpoint, ids, with_hessians=True) as whole:
        keys = list(whole.hessians.keys)
        everything = {k: whole.hessians.pop(k) for k in keys}
        assert whole.hessians.passes == 1
    sizes = [hessian_bytes(tiny_checkpoint.geometry, k) for k in keys]
    budget = max(sizes) + min(sizes)  # a down_proj's (the widest) and one more, less than a layer's
    assert sum(sizes[:4]) > budget
    with calibration(tiny_checkpoint, ids, with_hessians=True, hessian_budget_mb=budget / 2**20) as grouped:
        assert set(grouped.importance) == set(whole.importance)
        for k in keys:
            np.testing.assert_array_equal(grouped.importance[k], whole.importance[k])
        for k in keys:
            h = grouped.hessians.pop(k)
            assert h is not None and h.dtype == np.float64 and np.array_equal(h, everything[k]), k
            assert grouped.hessians.pop(k) is None  # each is handed out once
        assert grouped.hessians.passes >= 4 and grouped.hessians.most_held_bytes <= budget


def test_a_projection_passed_over_is_dropped_and_a_hessian_wider_than_the_budget_still_comes(tiny_checkpoint):
    ids = _ids(tiny_checkpoint)
    with calibration(tiny_checkpoint, ids, with_hessians=True) as whole:
        keys = list(whole.hessians.keys)
        reference = {k: whole.hessians.pop(k) for k in keys}
    with calibration(tiny_checkpoint, ids, with_hessians=True, hessian_budget_mb=1e-6) as grouped:
        h = grouped.hessians
        assert h.passes == 1 and list(h.ready) == [keys[0]]  # one at a time, even past the budget
        np.testing.assert_array_equal(h.pop(keys[3]), reference[keys[3]])  # 1 and 2 passed over (kept fp32)
        assert h.pop(keys[1]) is None and not h.ready
        np.testing.assert_array_equal(h.pop(keys[-1]), reference[keys[-1]])
        assert h.passes == 3


def test_a_build_with_a_small_hessian_budget_writes_the_same_bundle(tiny_checkpoint, tmp_path):
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    said: list[str] = []
    built = {}
    for label, budget in (("default", None), ("small", 0.05)):
        extra = {} if budget is None else {"hessian_budget_mb": budget}
        build_bundle(tiny_checkpoint, QuantSpec(precision="int4", method="gptq"), tmp_path / label, name="tiny",
                     calibration_text=TEXT, progress=said.append, **extra)
        built[label] = json.loads((tmp_path / label / "manifest.json").read_text())["files"]
    assert built["small"] == built["default"]  # every file's sha256: the weights bit for bit
    assert any("passes over the calibration text" in s for s in said), said


def test_an_untied_lm_head_is_calibrated_at_every_position_and_gets_gptq(tiny_varied_checkpoint):
    """The lm_head was quantized by a plain block search even in GPTQ builds: with a 4-bit head that made
    SmolLM2's mean KL 0.232, GPTQ's 0.158 (docs/benchmarks.md). Its input is captured before the graph
    picks the positions it computes logits for, so the statistics cover every calibration token."""
    from quantize.graph import LM_HEAD, build_graph
    from quantize.precision import QuantSpec

    ckpt = tiny_varied_checkpoint
    ids = _ids(ckpt)
    with calibration(ckpt, ids, with_hessians=True) as calib:
        h = calib.hessians.pop(LM_HEAD)
        assert h is not None and h.shape == (ckpt.geometry.hidden_size,) * 2
        # importance is the mean square per channel over the same rows: every position, not one per chunk
        np.testing.assert_allclose(np.diag(h) / len(ids), calib.importance[LM_HEAD], rtol=1e-5)
    with calibration(ckpt, ids, with_hessians=True) as calib:
        _, report = build_graph(ckpt, QuantSpec(precision="int4", lm_head="int4"), calib.importance, calib.hessians)
    assert "/lm_head: int4 gptq block 64 asym imatrix" in report, report


def test_a_bundle_with_a_4bit_head_apart_from_the_embedding_serves(tiny_varied_checkpoint, tmp_path):
    from agent.engine.bundle import open_bundle
    from agent.config import EngineConfig
    from agent.engine.engine import Engine
    from agent.engine.sampling_params import SamplingParams
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    spec = QuantSpec(precision="int4", lm_head="int4", embedding="int8")
    build_bundle(tiny_varied_checkpoint, spec, tmp_path / "b", name="tiny", calibration_text=TEXT, eval_text=TEXT,
                 progress=lambda _: None)
    bundle = open_bundle(tmp_path / "b")  # every file verified against the manifest
    report = (tmp_path / "b" / "quant_report.txt").read_text()
    assert "embed_tokens: int8" in report and "/lm_head: int4 gptq" in report, report
    engine = Engine(bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    try:
        out = engine.generate(_ids(tiny_varied_checkpoint)[:20], SamplingParams(max_tokens=8, temperature=0.0,
                                                                                  ignore_eos=True))
    finally:
        engine.close()
    assert out.figures.completion_tokens == 8 and out.figures.finish_reason == "length", out
