"""LoRA adapters, quantize side: adapter-ready graphs compute the plain model bit for bit without an adapter, and a
PEFT adapter converted for one computes the model with W + (alpha/r) B A merged, to fp32 precision; adapters
that do not fit are refused naming what differs. Tiny random models and random PEFT folders made in the test,
run by the real ONNX Runtime."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import reference
from safetensors.numpy import save_file

from agent import wire
from agent.engine.bundle import open_bundle
from agent.engine.runner import ModelRunner
from quantize.adapter import AdapterRunner, convert, merged
from quantize.checkpoint import Checkpoint, expected_weight_shapes, load_checkpoint
from quantize.graph import build_graph
from quantize.lora import LoraSpec
from quantize.package import build_bundle, encode, write_graph
from quantize.peft import AdapterError, read_peft
from quantize.precision import QuantSpec
from lora_support import ALL, write_peft
from tiny import write_tiny_llama

INT4 = QuantSpec(precision="int4", method="rtn", block_size=16, block_sizes={"down": 16})
TEXT = "the quick brown fox jumps over the lazy dog, then the dog answers in kind. " * 4


BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
            head_dim=16, context_length=128, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
VARIANTS = {  # block variants whose graphs differ around the projections (as tests/quantize/test_variants.py's)
    "llama": dict(architecture="llama", tie_word_embeddings=True),
    "qwen2": dict(architecture="qwen2", attention_bias=True),
    "gemma3": dict(architecture="gemma3", head_dim=32, num_kv_heads=1, tie_word_embeddings=True, sliding_window=8,
                   window_layers=(0, 1), rope_local_theta=1e4, embedding_multiplier=8.0),
}


def random_checkpoint(name: str) -> Checkpoint:
    rng = np.random.default_rng(0)
    g = wire.Geometry(**(BASE | VARIANTS[name]))
    weights = {key: ((1 + 0.1 * rng.standard_normal(shape)) if key.endswith("norm.weight")
                     else rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
               for key, shape in expected_weight_shapes(g).items()}
    return Checkpoint(g, weights, tokenizer=None, source_sha256="0" * 64, source_name=name)


def save(model, path: Path) -> None:
    import onnx

    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data")


def logits(runner: ModelRunner, ids: list[int]) -> np.ndarray:
    """A 12-token prefill then one-token decode steps through the cache: [len(ids), V]."""
    cache, n = runner.new_cache(1, 64), 12
    out = [runner.forward(np.array([ids[:n]]), np.array([n - 1]), np.array([n]), np.arange(n)[None], cache)[0]]
    for t in range(n, len(ids)):
        out.append(runner.forward(np.array([[ids[t]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64),
                                  cache)[0])
    return np.concatenate(out)


def graph_runner(model, path: Path, g: wire.Geometry) -> ModelRunner:
    save(model, path)
    return ModelRunner(path, g.num_layers, g.num_kv_heads, g.head_dim, threads=2)


@pytest.mark.parametrize("spec", [QuantSpec(), INT4], ids=["fp32", "int4"])
@pytest.mark.parametrize("name", VARIANTS)
def test_without_an_adapter_the_logits_are_the_plain_graphs_bit_for_bit(name, spec, tmp_path):
    """qwen2 has q/k/v biases (the branch is added after them), gemma3 a QK-norm and norms after each block."""
    ckpt = random_checkpoint(name)
    g = ckpt.geometry
    ids = np.random.default_rng(1).integers(0, g.vocab_size, 24).tolist()
    plain_model = build_graph(ckpt, spec)[0]
    ready_model = build_graph(ckpt, spec, lora=LoraSpec(targets=ALL, max_rank=8))[0]
    assert not [i for i in plain_model.graph.input if "lora" in i.name]  # no targets: no branch at all
    assert len([i for i in ready_model.graph.input if "lora" in i.name]) == 2 * 4 * g.num_layers
    assert "/model/layers.0/attn/qkv_proj/lora/MatMul_A" in {n.name for n in ready_model.graph.node}
    plain = logits(graph_runner(plain_model, tmp_path / "plain.onnx", g), ids)
    ready = logits(graph_runner(ready_model, tmp_path / "ready.onnx", g), ids)
    assert np.array_equal(plain.view(np.uint32), ready.view(np.uint32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model (untied head, context-dependent text), its fp32 bundle adapter-ready on every projection at rank
    8, and its plain int4 bundle."""
    root = tmp_path_factory.mktemp("lora")
    source = write_tiny_llama(root / "tiny.gguf", seed=1, layers=3, tied=False, weight_scale=0.25)
    ckpt = load_checkpoint(source)
    quiet = dict(progress=lambda s: None)
    ready = build_bundle(ckpt, QuantSpec(), root / "fp32-lora", name="tiny", lora=LoraSpec(targets=ALL, max_rank=8),
                         **quiet)
    plain4 = build_bundle(ckpt, INT4, root / "int4", name="tiny", **quiet)
    return root, source, ckpt, ready, plain4


@pytest.mark.parametrize("config", [{}, {"use_rslora": True}, {"rank_pattern": {"layers.1.self_attn.v_proj": 2},
                                                               "alpha_pattern": {"down_proj": 3.0}}],
                         ids=["alpha/r", "rslora", "patterns"])
def test_an_adapter_computes_the_merged_weights_to_fp32_precision(config, tiny, tmp_path):
    root, _, ckpt, ready, _ = tiny
    g = ckpt.geometry
    peft = read_peft(write_peft(tmp_path / "peft", g, targets=ALL, r=4, alpha=16, **config))
    ids = encode(ckpt.tokenizer.tokenizer_json, TEXT)
    m = convert(peft, ready, tmp_path / "adapter", name="a1", source=ckpt, eval_ids=ids, eval_text=TEXT,
                threads=2, progress=lambda s: None)
    model = merged(ckpt, peft)  # W + s B A
    exact = reference.forward(model, ids[:30])  # float64 numpy
    write_graph(model, QuantSpec(), tmp_path)  # and a plain fp32 graph of it: ONNX Runtime's own fp32 error
    plain = logits(ModelRunner(tmp_path / wire.GRAPH, g.num_layers, g.num_kv_heads, g.head_dim, 2), ids[:30])
    adapted = logits(AdapterRunner(ready, tmp_path / "adapter" / wire.ADAPTER_FILE, 2), ids[:30])
    base = logits(ModelRunner(ready.graph(), g.num_layers, g.num_kv_heads, g.head_dim, 2), ids[:30])
    err = lambda x: float(np.abs(x - exact).max() / np.abs(exact).max())  # noqa: E731
    # measured: adapted 3.4e-6, the merged plain graph 8.8e-6 (alpha/r)
    assert err(adapted) < max(2 * err(plain), 1e-5)
    assert err(base) > 1e-2  # the adapter changes the model: this test can fail
    assert m.quality.mean_kl < 1e-7 and m.quality.top1_agreement == 1.0  # fp32 noise only (measured <= 3e-9)
    assert m.ranks == dict.fromkeys(ALL, 4) and m.rank == 4 and m.layers == [0, 1, 2]  # the largest per target
    assert m.base_name == "tiny" and m.base_version == ready.manifest.version
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert files == {wire.ADAPTER_FILE, wire.ADAPTER_MANIFEST} and set(m.files) == {wire.ADAPTER_FILE}
    assert wire.AdapterManifest.read(tmp_path / "adapter") == m


def test_the_golden_continuation_is_the_adapters(tiny, tmp_path):
    """Measured with the adapter active: a strong adapter changes the base's greedy text, and the manifest has the
    adapted one (the install's health check compares against it)."""
    _, _, ckpt, ready, _ = tiny
    peft = read_peft(write_peft(tmp_path / "peft", ckpt.geometry, targets=ALL, r=8, alpha=64, seed=3))
    m = convert(peft, ready, tmp_path / "adapter", name="a2", progress=lambda s: None)
    assert m.quality is None  # no --source: nothing to measure against
    assert m.golden.prompt_ids == ready.manifest.golden.prompt_ids
    assert len(m.golden.continuation_ids) == len(ready.manifest.golden.continuation_ids)
    assert m.golden.continuation_ids != ready.manifest.golden.continuation_ids
    from quantize.evaluate import greedy

    again = greedy(AdapterRunner(ready, tmp_path / "adapter" / wire.ADAPTER_FILE, 2), m.golden.prompt_ids,
                   len(m.golden.continuation_ids))
    assert again == m.golden.continuation_ids


def test_a_plain_bundles_manifest_has_no_lora_key(tiny):
    """So its bytes and signature are those it had before adapters existed, and older agents still read it."""
    _, _, _, ready, plain4 = tiny
    assert "lora" not in json.loads((plain4.path / wire.MANIFEST).read_text())
    assert b"lora" not in plain4.manifest.canonical_bytes()
    assert json.loads((ready.path / wire.MANIFEST).read_text())["lora"] == {"targets": list(ALL), "max_rank": 8}


def refusal(tiny, tmp_path, base=None, **peft_options) -> str:
    _, _, ckpt, ready, _ = tiny
    geometry = peft_options.pop("geometry", ckpt.geometry)
    peft_dir = write_peft(tmp_path / "peft", geometry, **peft_options)
    with pytest.raises(AdapterError) as e:
        convert(read_peft(peft_dir), base or ready, tmp_path / "out", name="x", progress=lambda s: None)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    return str(e.value)


def test_an_adapter_that_does_not_fit_is_refused_naming_what_differs(tiny, tmp_path):
    root, _, ckpt, ready, plain4 = tiny
    g = ckpt.geometry
    assert "takes no adapters" in refusal(tiny, tmp_path / "1", base=plain4)
    assert "rank 16 is over" in refusal(tiny, tmp_path / "2", r=16)
    bigger = g.model_copy(update={"hidden_size": 128})
    message = refusal(tiny, tmp_path / "3", geometry=bigger)
    assert "layer 0 self_attn.q_proj" in message and "in 64" in message and "another model" in message
    deeper = g.model_copy(update={"num_layers": 5})
    assert "layers 0-2" in refusal(tiny, tmp_path / "4", geometry=deeper, layers=[4])
    qv_only = build_bundle(ckpt, QuantSpec(), root / "fp32-qv", name="tiny", progress=lambda s: None,
                           lora=LoraSpec(targets=("q", "v"), max_rank=8))
    assert "down, which" in refusal(tiny, tmp_path / "5", base=qv_only, targets=("q", "down"))


@pytest.mark.parametrize("change, words", [
    (lambda d: _config(d, target_modules=["q_proj", "lm_head"]), "target_modules lm_head"),
    (lambda d: _config(d, use_dora=True), "use_dora"),
    (lambda d: _config(d, modules_to_save=["lm_head"]), "modules_to_save"),
    (lambda d: _config(d, r=2), "rank 4 but adapter_config.json gives it r=2"),
    (lambda d: _tensor(d, "base_model.model.model.embed_tokens.lora_embedding_A", np.ones((4, 8), np.float32)),
     "model.embed_tokens.lora_embedding_A is not a LoRA A or B"),
    (lambda d: _tensor(d, "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight", np.ones((4, 64), np.float32)),
     "qkv_proj.lora_A.weight is not a LoRA A or B"),
    (lambda d: (d / "adapter_config.json").unlink(), "no adapter_config.json"),
])
def test_a_peft_folder_we_cannot_read_as_plain_lora_is_refused_by_name(change, words, tiny, tmp_path):
    folder = write_peft(tmp_path / "peft", tiny[2].geometry)
    change(folder)
    with pytest.raises(AdapterError) as e:
        read_peft(folder)
    assert words in str(e.value)


def _config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _tensor(folder: Path, name: str, value: np.ndarray) -> None:
    from safetensors.numpy import load_file

    path = folder / "adapter_model.safetensors"
    save_file(load_file(str(path)) | {name: value}, str(path))


# ---- the command line -------------------------------------------------------------------------------------------

def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantize.cli", *args], capture_output=True, text=True, timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0], lines[0]


def test_build_and_adapter_commands(tiny, tmp_path):
    root, source, ckpt, _, plain4 = tiny
    text = tmp_path / "eval.txt"
    text.write_text(TEXT)
    bundle = tmp_path / "int4-lora"
    r = run("build", str(source), "--precision", "int4", "--block-size", "16", "--method", "rtn", "--no-eval",
            "--lora-targets", "q,v,o", "--max-lora-rank", "8", "--name", "tiny", "--out", str(bundle))
    assert r.returncode == 0, r.stderr
    assert open_bundle(bundle).manifest.lora == wire.LoraCapacity(targets=["q", "v", "o"], max_rank=8)
    r = run("inspect", str(bundle))
    assert r.returncode == 0 and "lora       q,v,o up to rank 8" in r.stdout
    peft_dir = write_peft(tmp_path / "support-bot", ckpt.geometry, targets=("q", "v"), r=4)
    out = tmp_path / "adapters" / "support-bot"
    r = run("adapter", str(peft_dir), "--base", str(bundle), "--source", str(source), "--eval-text", str(text),
            "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "support-bot@r4-" in r.stdout and "mean KL" in r.stdout
    # it names every LoRA input of its base (o's at rank 0): binding it leaves nothing of another adapter bound
    import onnx
    from agent.engine.runner import read_adapter

    inputs = {i.name for i in onnx.load(str(bundle / wire.GRAPH), load_external_data=False).graph.input
              if "lora" in i.name}
    tensors = read_adapter(out / wire.ADAPTER_FILE)
    assert set(tensors) == inputs and tensors[wire.lora_b(1, "o")].shape() == [0, 64]
    m = wire.AdapterManifest.read(out)
    assert m.name == "support-bot" and m.ranks == {"q": 4, "v": 4} and m.quality.tokens > 0
    assert m.quality.mean_kl > 0  # the QLoRA cost: our int4 base + the adapter against fp32 with it merged
    assert_one_line_error(run("adapter", str(peft_dir), "--base", str(bundle), "--out", str(out)), "exists")
    assert_one_line_error(run("adapter", str(peft_dir), "--base", str(plain4.path), "--out", str(tmp_path / "n1")),
                          "takes no adapters")
    other = write_tiny_llama(tmp_path / "other.gguf", seed=7, layers=3, tied=False)
    assert_one_line_error(run("adapter", str(peft_dir), "--base", str(bundle), "--source", str(other),
                              "--out", str(tmp_path / "n2")), "is not the checkpoint", "other.gguf")
    assert_one_line_error(run("adapter", str(tmp_path / "nowhere"), "--base", str(bundle), "--out",
                              str(tmp_path / "n3")), "no adapter_config.json")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".", "n"))]


def test_build_refuses_lora_options_it_cannot_honour(tiny, tmp_path):
    _, source, _, _, _ = tiny
    assert_one_line_error(run("build", str(source), "--lora-targets", "q,lm_head", "--out", str(tmp_path / "x")),
                          "lm_head", "choose from q,k,v,o,gate,up,down")
    assert not (tmp_path / "x").exists()


def test_an_architecture_with_fused_projections_is_refused_by_name(tmp_path):
    """Phi-3's checkpoints (and so its adapters) fuse q, k, v and gate, up: refused at build, naming it."""
    from archs import tiny_phi3, write_hf_folder

    folder = write_hf_folder(tiny_phi3(), tmp_path / "phi3")
    r = run("build", str(folder), "--precision", "fp32", "--no-eval", "--lora-targets", "q,v", "--out",
            str(tmp_path / "out"))
    assert_one_line_error(r, "phi3", "not supported")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config, scales", [
    ({}, {("q", 0): 4.0, ("v", 1): 4.0, ("down", 2): 4.0}),  # lora_alpha / r = 16 / 4
    ({"use_rslora": True}, {("q", 0): 8.0, ("v", 1): 8.0}),  # lora_alpha / sqrt(r)
    ({"rank_pattern": {"layers.1.self_attn.v_proj": 2}, "alpha_pattern": {"down_proj": 3.0}},
     {("q", 0): 4.0, ("v", 1): 8.0, ("v", 0): 4.0, ("down", 2): 0.75}),
])
def test_the_scale_is_peft_s(config, scales, tmp_path):
    """The exactness test merges with the same scales it converts with, so they are checked here on their own
    against PEFT's rules (r and alpha per module by rank_pattern / alpha_pattern, rsLoRA's sqrt(r))."""
    g = wire.Geometry(**(BASE | VARIANTS["llama"]))
    peft = read_peft(write_peft(tmp_path / "peft", g, targets=ALL, r=4, alpha=16, **config))
    found = {(p.target, p.layer): p.scale for p in peft.pairs}
    assert {k: found[k] for k in scales} == scales


def test_an_adapter_file_holds_the_arrays_it_was_given_whatever_their_memory_order(tmp_path):
    """ONNX Runtime borrows a numpy array's memory for the export: a transposed (Fortran-order) A was copied to a
    temporary that was freed before the export, and the file held garbage."""
    from agent.engine.runner import read_adapter, write_adapter

    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((12, 64)).astype(np.float32).T for i in range(24)}  # [64, 12], F-order
    write_adapter(tmp_path / "a.onnx_adapter", tensors)
    back = read_adapter(tmp_path / "a.onnx_adapter")
    assert all(np.array_equal(back[k].numpy(), v) for k, v in tensors.items())


@pytest.mark.real_model
def test_the_real_model_without_an_adapter_is_the_plain_graph_bit_for_bit(real_checkpoint, tmp_path):
    """SmolLM2 INT4 from the GGUF's own Q4_1 blocks (a MatMulNBits plus the blocks' minimums, then the branch),
    all seven targets, over a 64-token prompt."""
    g = real_checkpoint.geometry
    spec = QuantSpec(precision="int4", keep_source_quant=True)
    ids = np.random.default_rng(2).integers(0, g.vocab_size, 64).tolist()
    runs = []
    for name, lora in (("plain", None), ("ready", LoraSpec(targets=ALL, max_rank=16))):
        runner = graph_runner(build_graph(real_checkpoint, spec, lora=lora)[0], tmp_path / f"{name}.onnx", g)
        runs.append(runner.forward(np.array([ids]), np.array([63]), np.array([64]), np.arange(64)[None],
                                   runner.new_cache(1, 64)))
    assert np.array_equal(runs[0].view(np.uint32), runs[1].view(np.uint32))
