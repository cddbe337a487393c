"""Mixture of Experts: what ONNX Runtime's MoE / QMoE kernels compute (one layer against numpy), whole tiny MoE
models quantized to INT8 / INT4, the routing and variants that are refused by name, and the parameter counts.

The fp32 graphs of the four tiny MoE fixtures against llama.cpp and transformers are in test_arch_logits.py.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import archs
import archs_gguf
import reference
from agent.engine.runner import ModelRunner
from agent.wire import Geometry
from quantize import nbits
from quantize.checkpoint import Checkpoint, CheckpointError, load_checkpoint, parameter_counts
from quantize.graph import build_graph
from quantize.linear import MS_DOMAIN, OPSET, GraphBuilder
from quantize.lora import LoraSpec
from quantize.moe import MoEBuildError, expert_block_size, interleave, moe_layer
from quantize.precision import QuantSpec

DATA = Path(__file__).parent / "data" / "arch_logits"
MOE = ["qwen3moe", "olmoe", "granitemoe", "mixtral"]
H, I, E, K, TOKENS = 64, 32, 8, 2, 7  # noqa: E741


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


# ---- one layer: the kernels against numpy --------------------------------------------------------------

def layer_checkpoint(architecture: str, renormalize: bool, seed: int = 0) -> Checkpoint:
    rng = np.random.default_rng(seed)
    g = Geometry(architecture=architecture, vocab_size=16, hidden_size=H, intermediate_size=I, num_layers=1,
                 num_heads=4, num_kv_heads=4, head_dim=16, context_length=32, rope_theta=1e4, rms_norm_eps=1e-6,
                 tie_word_embeddings=True, num_experts=E, num_experts_per_tok=K, moe_renormalize=renormalize)
    p = "model.layers.0.mlp."
    weights = {p + "gate.weight": rng.standard_normal((E, H)).astype(np.float32) * 0.5,
               p + "experts.gate_proj.weight": rng.standard_normal((E, I, H)).astype(np.float32) / 8,
               p + "experts.up_proj.weight": rng.standard_normal((E, I, H)).astype(np.float32) / 8,
               p + "experts.down_proj.weight": rng.standard_normal((E, H, I)).astype(np.float32) / 6}
    return Checkpoint(g, weights, tokenizer=None, source_sha256="0" * 64, source_name=architecture)


def run_layer(ckpt: Checkpoint, spec: QuantSpec, x: np.ndarray) -> tuple[np.ndarray, GraphBuilder]:
    b = GraphBuilder()
    y = moe_layer(b, ckpt, 0, "x", spec)
    graph = helper.make_graph(b.nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", H])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)], b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0], b


def numpy_layer(ckpt: Checkpoint, x: np.ndarray, weights: dict | None = None) -> np.ndarray:
    """tests/reference.py's MoE over x [B, S, H], with weights standing in for the checkpoint's if given."""
    if weights:
        ckpt = dataclasses.replace(ckpt, weights=ckpt.weights | weights)
    flat = x.reshape(-1, H).astype(np.float64)
    return reference.mlp(ckpt, 0, flat).reshape(x.shape)


@pytest.fixture
def x() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((2, TOKENS, H)).astype(np.float32)


@pytest.mark.parametrize("architecture, renormalize", [("qwen3moe", True), ("olmoe", False), ("mixtral", True)])
def test_the_fp32_moe_kernel_routes_as_the_architecture_does(architecture, renormalize, x):
    """softmax over all, top k, renormalised or not; Mixtral's top-k-then-softmax is the renormalised case."""
    ckpt = layer_checkpoint(architecture, renormalize)
    y, _ = run_layer(ckpt, QuantSpec(), x)
    assert rel_err(y, numpy_layer(ckpt, x)) < 1e-5


def test_tied_router_logits_pick_the_highest_numbered_experts(x):
    """Why tests/expert_split.py's speed proxy (k < E) routes by a random router: an all-zero one would send every
    token to the same k experts."""
    ckpt = layer_checkpoint("mixtral", True)
    ckpt.weights["model.layers.0.mlp.gate.weight"][:] = 0
    y, _ = run_layer(ckpt, QuantSpec(), x)
    gate, up, down = (ckpt.weights[f"model.layers.0.mlp.experts.{n}_proj.weight"] for n in ("gate", "up", "down"))
    flat = x.reshape(-1, H).astype(np.float64)
    last_two = sum(0.5 * reference.gated_mlp(flat, gate[e], up[e], down[e], "silu") for e in (E - 2, E - 1))
    assert rel_err(y.reshape(-1, H), last_two) < 1e-5


def test_renormalising_the_top_k_weights_changes_the_layer(x):
    """The test above cannot pass with the flag ignored on both sides."""
    on, off = layer_checkpoint("qwen3moe", True), layer_checkpoint("qwen3moe", False)
    assert rel_err(numpy_layer(off, x), numpy_layer(on, x)) > 0.05
    assert rel_err(run_layer(off, QuantSpec(), x)[0], run_layer(on, QuantSpec(), x)[0]) > 0.05


def test_fc1_interleaves_gate_and_up_rows():
    gate, up = np.full((1, 2, 3), 1.0), np.full((1, 2, 3), 2.0)
    assert interleave(gate, up)[0, :, 0].tolist() == [1.0, 2.0, 1.0, 2.0]


def dequantized_experts(ckpt: Checkpoint, bits: int, block: int, method: str) -> dict:
    """The expert weights a QMoE of this spec holds, dequantized (the same per-expert quantizer, in numpy)."""
    p = "model.layers.0.mlp.experts."
    out = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        w = ckpt.weights[p + name + ".weight"]
        quantize = nbits.quantize_rtn if method == "rtn" else nbits.quantize_search
        symmetric = name != "down_proj"  # QuantSpec's INT4 default: gate_up symmetric, down asymmetric
        out[p + name + ".weight"] = np.stack([quantize(w[e], bits, block, symmetric).dequantize() for e in range(E)])
    return out


@pytest.mark.parametrize("architecture, renormalize", [("qwen3moe", True), ("olmoe", False)])
def test_int4_experts_at_accuracy_level_0_compute_exactly_the_dequantized_weights(architecture, renormalize, x):
    """Packing, scales, zero points, the interleave and the routing weights are right: only fp32 rounding is
    left. (QMoE renormalises the top k whatever normalize_routing_weights says unless router_weights are given:
    OLMoE's softmax weights go in as router_weights.)"""
    ckpt = layer_checkpoint(architecture, renormalize)
    spec = QuantSpec(precision="int4", method="rtn", accuracy_level=0, block_size=32, block_sizes={})
    y, b = run_layer(ckpt, spec, x)
    assert rel_err(y, numpy_layer(ckpt, x, dequantized_experts(ckpt, 4, 32, "rtn"))) < 1e-5
    assert rel_err(y, numpy_layer(ckpt, x)) > 1e-3  # and the weights are 4-bit
    assert "experts int4 rtn block 32 [8x64x64] (QMoE, top 2)" in b.report[0]


def test_qmoe_renormalises_unless_given_router_weights(x):
    """The kernel behaviour quantize.moe works around: without router_weights, QMoE's top k weights sum to 1 even
    with normalize_routing_weights=0 (onnxruntime 1.32, CPU); a layer built without the Softmax input computes
    the renormalised model."""
    ckpt = layer_checkpoint("olmoe", False)
    spec = QuantSpec(precision="int4", method="rtn", accuracy_level=0, block_size=32, block_sizes={})
    y, b = run_layer(ckpt, spec, x)
    qmoe = next(node for node in b.nodes if node.op_type == "QMoE")
    assert len(qmoe.input) == 15 and qmoe.input[14].endswith("router/Softmax/output_0")
    del qmoe.input[13:]
    graph = helper.make_graph(b.nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", H])],
                              [helper.make_tensor_value_info(qmoe.output[0], TensorProto.FLOAT, None)], b.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)])
    model.ir_version = 10
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    dequantized = dequantized_experts(ckpt, 4, 32, "rtn")
    renormalised = dataclasses.replace(ckpt, geometry=ckpt.geometry.model_copy(update={"moe_renormalize": True}))
    assert rel_err(plain, numpy_layer(renormalised, x, dequantized)) < 1e-5
    assert rel_err(y, numpy_layer(ckpt, x, dequantized)) < 1e-5


def test_int8_experts_quantize_activations_per_block(x):
    """Block-wise 8-bit experts have no fp32 kernel: activations go to int8 per block, as MatMulNBits' do at
    accuracy_level 4 (~1% of the output's scale here), at any accuracy_level."""
    ckpt = layer_checkpoint("mixtral", True)
    spec = QuantSpec(precision="int8", method="search", accuracy_level=0, block_size=32, block_sizes={})
    y, b = run_layer(ckpt, spec, x)
    assert rel_err(y, numpy_layer(ckpt, x, dequantized_experts(ckpt, 8, 32, "search"))) < 3e-2
    assert "GPTQ" not in b.report[0]
    _, b = run_layer(ckpt, spec.model_copy(update={"method": "gptq"}), x)
    assert "experts int8 search block 32" in b.report[0]
    assert "(GPTQ needs calibration: experts keep error-searched scales)" in b.report[0]


def test_keep_source_quant_says_the_experts_are_requantized(x):
    ckpt = layer_checkpoint("olmoe", False)
    _, b = run_layer(ckpt, QuantSpec(precision="int4", keep_source_quant=True, block_size=32), x)
    assert "(the source's blocks are not kept for experts)" in b.report[0]


def test_one_block_size_divides_hidden_and_expert_sizes():
    assert expert_block_size(QuantSpec(block_size=64, block_sizes={}), 64, 32) == 32
    assert expert_block_size(QuantSpec(block_size=128, block_sizes={"gate_up": 64}), 256, 768) == 64
    with pytest.raises(MoEBuildError, match="divides both hidden size 64 and expert intermediate size 24"):
        expert_block_size(QuantSpec(block_size=64), 64, 24)


# ---- whole tiny models --------------------------------------------------------------------------------

def logits(ckpt: Checkpoint, spec: QuantSpec, ids: list[int], tmp_path: Path) -> np.ndarray:
    g = ckpt.geometry
    path = tmp_path / f"{spec.precision}.onnx"
    onnx.save_model(build_graph(ckpt, spec)[0], str(path), save_as_external_data=True, location=path.name + ".data")
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    cache = runner.new_cache(1, len(ids))
    return runner.forward(np.array([ids]), np.array([len(ids) - 1]), np.array([len(ids)]),
                          np.arange(len(ids))[None], cache)[0]


def mean_kl(ref: np.ndarray, ours: np.ndarray) -> float:
    p, q = (np.exp(a - a.max(-1, keepdims=True)) for a in (ref, ours))
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    return float((p * (np.log(p) - np.log(q))).sum(-1).mean())


@pytest.mark.parametrize("name", MOE)
def test_quantized_builds_of_each_moe_fixture_agree_with_the_reference(name, tmp_path):
    """INT8 and INT4 from the GGUF against the numpy reference. Random tiny weights are hard on 4 bits: the dense
    fixtures' INT4 builds are as far off (tiny qwen3: mean KL 0.42, top-1 0.69; qwen3moe: 0.27, 0.52)."""
    ckpt = load_checkpoint(DATA / name / "model.gguf")
    ids = np.load(DATA / name / "logits.npz")["token_ids"].tolist()[:24]
    ref = reference.forward(ckpt, ids)
    int8 = logits(ckpt, QuantSpec(precision="int8", method="search"), ids, tmp_path)
    int4 = logits(ckpt, QuantSpec(precision="int4", method="search"), ids, tmp_path)
    assert mean_kl(ref, int8) < 0.02
    assert np.corrcoef(int4.ravel(), ref.ravel())[0, 1] > 0.8
    assert mean_kl(ref, int8) < mean_kl(ref, int4)


def test_quantized_stacked_experts_in_a_gguf_are_read_expert_by_expert(tmp_path):
    """A real MoE GGUF's experts are quantized 3-D tensors [E, rows, blocks]: each expert's rows dequantized, in
    expert order."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize

    model = archs.tiny_qwen3moe()
    w = gguf.GGUFWriter(str(tmp_path / "q8.gguf"), "qwen3moe")
    archs_gguf.ARCH_KEYS["qwen3moe"](w, model.config)
    archs_gguf._tokenizer_keys(w, model)
    expected = {}
    for name, t in archs_gguf.gguf_tensors(model).items():
        if "_exps" in name:
            q = quantize(t, QT.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=QT.Q8_0)
            expected[name] = dequantize(q, QT.Q8_0).reshape(t.shape)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = load_checkpoint(tmp_path / "q8.gguf")
    down = ckpt.weights["model.layers.1.mlp.experts.down_proj.weight"]
    np.testing.assert_array_equal(down, expected["blk.1.ffn_down_exps.weight"])
    gate = ckpt.weights["model.layers.0.mlp.experts.gate_proj.weight"][2]
    assert 0 < np.abs(gate - model.weights["model.layers.0.mlp.experts.2.gate_proj.weight"]).max() < 0.01


# ---- what is refused, naming it -----------------------------------------------------------------------

def _gguf_with(monkeypatch, tmp_path: Path, name: str, keys=None, tensors=None) -> Path:
    model = archs.MOE_BUILDERS[name]()
    if keys:
        write_keys = archs_gguf.ARCH_KEYS[model.gguf_arch]
        monkeypatch.setitem(archs_gguf.ARCH_KEYS, model.gguf_arch, lambda w, c: (write_keys(w, c), keys(w)))
    if tensors:
        monkeypatch.setattr(archs_gguf, "extra_tensors", lambda m: tensors)
    return archs_gguf.write_gguf(model, tmp_path / f"{name}.gguf")


@pytest.mark.parametrize("keys, needle", [
    (lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID), r"qwen3moe.expert_gating_func=2"),
    (lambda w: w.add_expert_shared_count(1), r"qwen3moe.expert_shared_count=1"),
    (lambda w: w.add_expert_weights_scale(2.5), r"qwen3moe.expert_weights_scale=2.5"),
])
def test_gguf_routing_the_kernel_cannot_compute_is_refused_by_key(keys, needle, monkeypatch, tmp_path):
    with pytest.raises(CheckpointError, match=f"unsupported Mixture of Experts routing.*{needle}"):
        load_checkpoint(_gguf_with(monkeypatch, tmp_path, "qwen3moe", keys=keys))


def test_a_router_bias_is_refused_naming_the_tensor(monkeypatch, tmp_path):
    path = _gguf_with(monkeypatch, tmp_path, "mixtral", tensors={"blk.0.exp_probs_b.bias": np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match="blk.0.exp_probs_b.bias is not supported for architecture 'mixtral'"):
        load_checkpoint(path)


def test_an_old_converters_per_expert_tensors_are_refused_saying_so(monkeypatch, tmp_path):
    stacked = archs_gguf.moe_tensors

    def per_expert(model):
        tensors, used = stacked(model)
        out = {}
        for name, w in tensors.items():
            if "_exps" in name:
                out |= {name.replace("_exps.weight", f".{e}.weight"): w[e] for e in range(w.shape[0])}
            else:
                out[name] = w
        return out, used

    monkeypatch.setattr(archs_gguf, "moe_tensors", per_expert)
    path = archs_gguf.write_gguf(archs.tiny_mixtral(), tmp_path / "old.gguf")
    with pytest.raises(CheckpointError, match=r"tensor blk\.\d\.ffn_(gate|up|down)\.0\.weight is not supported for "
                                              r"architecture 'mixtral' \(one expert's tensor"):
        load_checkpoint(path)


def test_a_dense_architectures_gguf_with_experts_is_refused(monkeypatch, tmp_path):
    model = archs.tiny_qwen3()
    write_keys = archs_gguf.ARCH_KEYS["qwen3"]
    monkeypatch.setitem(archs_gguf.ARCH_KEYS, "qwen3", lambda w, c: (write_keys(w, c), w.add_expert_count(4)))
    with pytest.raises(CheckpointError, match="qwen3.expert_count is set, but qwen3 is not read as a Mixture"):
        load_checkpoint(archs_gguf.write_gguf(model, tmp_path / "q.gguf"))


def test_a_llama_gguf_with_experts_reads_as_mixtral():
    assert load_checkpoint(DATA / "mixtral" / "model.gguf").geometry.architecture == "mixtral"


@pytest.mark.parametrize("name, change, needle", [
    ("qwen3moe", {"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ("qwen3moe", {"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) <= num_experts \(4\)"),
])
def test_hf_moe_variants_the_graph_does_not_compute_are_named(name, change, needle, tmp_path):
    model = archs.MOE_BUILDERS[name]()
    folder = archs.write_hf_folder(dataclasses.replace(model, config=model.config | change), tmp_path / name)
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(folder)


def test_a_missing_expert_is_named(tmp_path):
    model = archs.tiny_mixtral()
    weights = {n: w for n, w in model.weights.items() if ".experts.3." not in n or "layers.1" not in n}
    folder = archs.write_hf_folder(dataclasses.replace(model, weights=weights), tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"model.layers.1.mlp.experts.gate_proj.weight needs experts 0..3"):
        load_checkpoint(folder)


def test_lora_on_the_experts_is_refused():
    ckpt = load_checkpoint(DATA / "olmoe" / "model.gguf")
    with pytest.raises(MoEBuildError, match="LoRA on gate, up or down of a Mixture of Experts"):
        build_graph(ckpt, QuantSpec(), lora=LoraSpec(targets=("q", "up"), max_rank=4))


def test_geometry_needs_experts_per_token_within_the_experts():
    fields = layer_checkpoint("mixtral", True).geometry.model_dump()
    with pytest.raises(ValueError, match=r"num_experts_per_tok 0 is not in 1..num_experts \(8\)"):
        Geometry(**(fields | {"num_experts_per_tok": 0}))


# ---- parameters ---------------------------------------------------------------------------------------

def test_total_and_active_parameters_count_every_expert_and_the_routed_ones():
    ckpt = load_checkpoint(DATA / "qwen3moe" / "model.gguf")
    total, active = parameter_counts(ckpt.geometry)
    assert total == sum(w.size for w in ckpt.weights.values())
    experts = sum(w.size for n, w in ckpt.weights.items() if ".experts." in n)
    assert active == total - experts // 2  # 2 of 4 experts idle per token
    dense = load_checkpoint(DATA / "qwen3" / "model.gguf")
    assert parameter_counts(dense.geometry) == (sum(w.size for w in dense.weights.values()),) * 2


CALIBRATION_TEXT = ("Experts are chosen per token by a router. " * 40)
SHORT_TEXT_CHARS = 140  # ~110 tokens: tiny OLMoE's 4 experts get 25..88 each, around gate_up's 64 for GPTQ


def test_a_moe_bundle_records_its_parameters_and_a_dense_one_keeps_its_manifest_keys(tmp_path):
    """The bundle's manifest carries total and active counts; model_config.json the routing; the agent's bundle
    reader opens it. A GPTQ build calibrates the dense projections and the experts. A dense
    bundle's manifest has no parameters key (old agents forbid unknown keys)."""
    import json

    from agent import wire
    from quantize.package import build_bundle

    ckpt = load_checkpoint(DATA / "granitemoe" / "model.gguf")
    bundle = build_bundle(ckpt, QuantSpec(precision="int4", method="rtn"), tmp_path / "moe", name="tiny-moe",
                          progress=lambda s: None)
    manifest = wire.Manifest.read(bundle.path)
    assert (manifest.parameters.total, manifest.parameters.active) == parameter_counts(ckpt.geometry)
    assert manifest.parameters.active < manifest.parameters.total
    config = json.loads((bundle.path / wire.MODEL_CONFIG).read_text())
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_renormalize"]) == (4, 2, True)
    calibrated = build_bundle(load_checkpoint(DATA / "olmoe" / "model.gguf"), QuantSpec(precision="int4"),
                              tmp_path / "gptq", name="tiny-olmoe", progress=lambda s: None,
                              calibration_text=CALIBRATION_TEXT)
    report = (calibrated.path / "quant_report.txt").read_text()
    assert "/model/layers.1/attn/qkv_proj: int4 gptq" in report  # calibration reached the dense projections
    assert ("/model/layers.1/moe: router fp32, experts int4 gptq block 32 [4x64x64] (QMoE, top 2) GPTQ for gate_up "
            "of 4/4 experts, down of 4/4; tokens per expert ") in report
    dense = build_bundle(load_checkpoint(DATA / "granite" / "model.gguf"), QuantSpec(), tmp_path / "dense",
                         name="tiny", progress=lambda s: None)
    assert "parameters" not in json.loads((dense.path / wire.MANIFEST).read_text())
    assert "num_experts" not in json.loads((dense.path / wire.MODEL_CONFIG).read_text())


# ---- GPTQ for experts: the calibration tokens routed as the router routes them --------------------------

def routed_inputs(ckpt: Checkpoint, ids: list[int], layer: int, tmp_path: Path) -> np.ndarray:
    """The MoE input x [T, H] of layer `layer` over the windows calibration reads, from the fp32 capture graph."""
    from quantize.evaluate import windows
    from quantize.expert_hessians import experts_key

    g = ckpt.geometry
    path = tmp_path / "capture.onnx"
    onnx.save_model(build_graph(ckpt, QuantSpec(), capture=True)[0], str(path), save_as_external_data=True,
                    location=path.name + ".data")
    runner = ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)
    xs = []
    for text in windows(ids, g.context_length, ckpt.tokenizer.prompt_bos):
        n = len(text)
        capture = {experts_key(layer): np.empty((1, n, g.hidden_size), np.float32)}
        runner.forward(np.array([text]), np.array([n - 1]), np.array([n]), np.array([[n - 1]]),
                       runner.new_cache(1, n), capture)
        xs.append(capture[experts_key(layer)][0])
    return np.concatenate(xs)


def test_each_experts_hessians_sum_exactly_the_tokens_routed_to_it(tmp_path):
    """Counted apart in numpy from the layer's captured input: a calibration that fed every expert every token
    (or routed by another rule) gives other counts and other Hessians."""
    from quantize.calibrate import calibration
    from quantize.expert_hessians import experts_key
    from quantize.package import encode

    ckpt = load_checkpoint(DATA / "olmoe" / "model.gguf")
    ids = encode(ckpt.tokenizer.tokenizer_json, CALIBRATION_TEXT[:400])
    with calibration(ckpt, ids, with_hessians=True) as calib:
        routed = calib.hessians.pop(experts_key(1))
    x = routed_inputs(ckpt, ids, 1, tmp_path)
    logits = x @ ckpt.weights["model.layers.1.mlp.gate.weight"].T
    chosen = np.argsort(logits, axis=1)[:, -ckpt.geometry.num_experts_per_tok:]  # [T, k]
    counts = np.bincount(chosen.ravel(), minlength=ckpt.geometry.num_experts)
    np.testing.assert_array_equal(routed.tokens, counts)
    assert counts.sum() == 2 * len(x) and counts.max() < len(x)  # every token reaches 2 of the 4, not all
    for e in range(ckpt.geometry.num_experts):
        xe = x[(chosen == e).any(axis=1)].astype(np.float64)
        np.testing.assert_allclose(routed.fc1[e], xe.T @ xe, rtol=1e-4, atol=1e-4 * np.abs(xe.T @ xe).max())


def test_experts_that_saw_too_few_calibration_tokens_keep_searched_scales_and_the_report_says_so():
    """A short text over a top-2 router: some experts reach their input width in tokens and get GPTQ, the rest
    fall back, and the report counts both per layer with why."""
    from quantize.calibrate import calibration
    from quantize.package import encode

    ckpt = load_checkpoint(DATA / "olmoe" / "model.gguf")
    ids = encode(ckpt.tokenizer.tokenizer_json, CALIBRATION_TEXT[:SHORT_TEXT_CHARS])
    with calibration(ckpt, ids, with_hessians=True) as calib:
        _, report = build_graph(ckpt, QuantSpec(precision="int4"), calib.importance, calib.hessians)
    lines = [line for line in report if "/moe:" in line]
    assert len(lines) == ckpt.geometry.num_layers
    gptq = [int(line.split("GPTQ for gate_up of ")[1].split("/")[0]) for line in lines]
    assert 0 < min(gptq) < 4 or 0 < max(gptq) < 4, lines
    fell_back = next(line for line, n in zip(lines, gptq) if n < 4)
    assert ("the rest saw fewer tokens than the input width (64 for gate_up, 32 for down) and keep "
            "error-searched scales") in fell_back
