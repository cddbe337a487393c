"""The int8 KV cache: edge-quantize calibrates a second graph with an int8 cache, the engine runs it when
config asks (kv_dtype = "int8"), it stays close to the fp32 cache and holds 4x the tokens per budget."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from agent import wire
from agent.engine.bundle import BundleError
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.runner import open_runner
from agent.engine.sampling_params import SamplingParams
from batching import GREEDY, run_together
from quantize.cli import default_calibration_text
from quantize.evaluate import log_softmax, windows
from quantize.kv_int8 import MARGIN, kv_absmax
from quantize.package import build_bundle, encode
from quantize.precision import QuantSpec


@pytest.fixture(scope="module")
def bundle(tiny_checkpoint, tmp_path_factory):
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("kv8") / "fp32", name="tiny",
                        calibration_text=default_calibration_text(), progress=lambda s: None)


def engine(bundle, kv_dtype: str) -> Engine:
    return Engine(bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=16,
                                       kv_dtype=kv_dtype))


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 260, int(rng.integers(20, 60))).tolist() for _ in range(n)]


def graph_scales(bundle) -> dict[str, np.ndarray]:
    graph = onnx.load(str(bundle.path / wire.GRAPH_INT8_KV), load_external_data=False)
    return {t.name: numpy_helper.to_array(t) for t in graph.graph.initializer if t.name.endswith("_scale")}


def test_an_int8_graph_the_manifest_does_not_list_is_not_loaded(bundle, tmp_path):
    """A model.int8kv.onnx dropped into a bundle built without one is not loaded: only verified graphs are."""
    import shutil

    from agent.engine.bundle import open_bundle

    copy = shutil.copytree(bundle.path, tmp_path / "b")
    manifest = bundle.manifest.model_copy(update={"files": {k: v for k, v in bundle.manifest.files.items()
                                                            if k != wire.GRAPH_INT8_KV}})
    (copy / wire.MANIFEST).write_text(manifest.model_dump_json())
    unlisted = open_bundle(copy)
    with pytest.raises(BundleError, match="has no int8 KV cache graph"):
        unlisted.graph("int8")
    assert unlisted.graph() == copy / wire.GRAPH


def test_bundle_carries_a_hashed_int8_kv_graph_scaled_from_the_calibration_text(bundle):
    assert wire.GRAPH_INT8_KV in bundle.manifest.files
    assert open_runner(bundle, 2, kv_dtype="int8").kv_dtype == np.int8
    fp32 = open_runner(bundle, 2)
    assert fp32.kv_dtype == np.float32
    ids = encode(bundle.tokenizer_json(), default_calibration_text())
    absmax = {}  # largest |value| and key rotary-pair norm per layer and channel, each window in one prefill
    half = fp32.head_dim // 2
    for window in windows(ids, bundle.config.context_length):
        n, cache = len(window), fp32.new_cache(1, len(window))
        fp32.forward(np.array([window]), np.array([n - 1]), np.array([n]), np.array([[n - 1]]), cache)
        for i in range(fp32.num_layers):
            k = cache.keys[i][0]
            pair = np.abs(k[..., :half] + 1j * k[..., half:]).max(axis=1)  # [kv_heads, half]
            seen = {"k": np.concatenate([pair, pair], axis=-1).reshape(-1),
                    "v": np.abs(cache.values[i][0]).max(axis=1).reshape(-1)}
            for kind in ("k", "v"):
                absmax[i, kind] = np.maximum(absmax.get((i, kind), 0), seen[kind])
    scales = graph_scales(bundle)
    for (i, kind), amax in absmax.items():
        expected = np.maximum(amax, 1e-4) * MARGIN / 127
        np.testing.assert_allclose(scales[f"/model/layers.{i}/attn/{kind}_scale"], expected, rtol=1e-4)


def test_key_scales_hold_every_position_not_only_the_calibrated_ones(bundle):
    """Rotary turns each key pair further as the position grows; scales from the largest |key| over the
    calibration's positions would clip later ones (KL against the fp32 cache 0.59 at 7,000 tokens on
    SmolLM2, whose calibration text is 937 tokens). In the first layer a token's key before
    rotary does not depend on its context, so one token repeated gives the same key at every position,
    turned: calibrated on 16 positions, the bound must hold over the whole context."""
    fp32 = open_runner(bundle, 2)
    n = bundle.config.context_length
    bound = kv_absmax(fp32, [42] * 16, n)[0, 0].reshape(fp32.kv_heads, 1, fp32.head_dim)
    cache = fp32.new_cache(1, n)
    fp32.forward(np.array([[42] * n]), np.array([n - 1]), np.array([n]), np.array([[n - 1]]), cache)
    keys = np.abs(cache.keys[0][0])  # [kv_heads, n, head_dim]
    assert keys[:, 16:].max() > keys[:, :16].max()  # later positions do reach further in some channel
    assert (keys <= bound * (1 + 1e-5) + 1e-7).all()


def test_int8_cache_holds_the_fp32_cache_to_half_a_step(bundle):
    """Each cached int8 value times its channel's scale is the fp32 cache's value within half a step
    (first layer, where both see the same input), and on held-out prompts almost nothing falls outside
    the calibrated range."""
    scales = graph_scales(bundle)
    fp32, int8 = open_runner(bundle, 2), open_runner(bundle, 2, kv_dtype="int8")
    ids = prompts(1, seed=9)[0]
    n = len(ids)
    caches = fp32.new_cache(1, 64), int8.new_cache(1, 64)
    for runner, cache in zip((fp32, int8), caches):
        runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.array([[n - 1]]), cache)
    clipped = 0
    for i in range(fp32.num_layers):
        for kind, ref, got in (("k", caches[0].keys[i], caches[1].keys[i]), ("v", caches[0].values[i], caches[1].values[i])):
            scale = scales[f"/model/layers.{i}/attn/{kind}_scale"].reshape(1, -1, 1, fp32.head_dim)
            ref, got = ref[:, :, :n], got[:, :, :n].astype(np.float32)
            inside = np.abs(ref) <= 127 * scale
            err = np.abs(got * scale - ref)
            if i == 0:  # deeper layers' inputs already differ by the int8 cache of the layers before
                assert (err <= 0.5 * scale * 1.001 + 1e-7)[inside].all(), kind
            clipped += int((~inside).sum())
    assert clipped <= 0.001 * n * fp32.num_layers * 2 * fp32.kv_heads * fp32.head_dim


def test_int8_cache_stays_close_to_fp32(bundle):
    """Over held-out prompts (not the calibration text), next-token distributions with the int8 cache
    agree with the fp32 cache's."""
    fp32, int8 = open_runner(bundle, 2), open_runner(bundle, 2, kv_dtype="int8")
    kls, agree, total = [], 0, 0
    for ids in prompts(4, seed=7):
        n = len(ids)
        args = (np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None])
        ref = log_softmax(fp32.forward(*args, fp32.new_cache(1, 64))[0])
        got = log_softmax(int8.forward(*args, int8.new_cache(1, 64))[0])
        kls.append((np.exp(ref) * (ref - got)).sum(-1))
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += n
    kl = float(np.concatenate(kls).mean())
    assert 0 < kl < 0.01, kl  # not bit-identical (it is int8), but close
    assert agree / total >= 0.95, agree / total


def test_engine_with_int8_cache_batches_exactly_and_holds_4x_the_tokens(bundle):
    eng, ref = engine(bundle, "int8"), engine(bundle, "fp32")
    tokens = lambda e: sum(p.capacity * p.num_slots for p in e.kv.classes)  # noqa: E731
    assert tokens(eng) >= 3.5 * tokens(ref)
    assert eng.kv.classes[0].keys[0].dtype == np.int8
    ps = prompts(4, seed=8)
    alone = [eng.generate(p, SamplingParams(max_tokens=24, **GREEDY)).token_ids for p in ps]
    results = run_together(eng, ps, 24)
    assert [r.token_ids for r in results] == alone
    assert all(len(t) == 24 for t in alone)


def test_bundle_without_int8_graph_is_a_clear_error(tiny_fp32_bundle):
    with pytest.raises(BundleError, match="no int8 KV cache graph"):
        engine(tiny_fp32_bundle, "int8")
