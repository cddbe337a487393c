"""What each quantization costs in quality, ours against llama.cpp's, from the same fp32 weights.

A benchmark model's GGUF (bench/benchmodels.py: the bundled SmolLM2-135M-Instruct by default, or
`--model qwen2.5-0.5b` / `qwen2.5-1.5b` / `gemma3-270m`) is read into a Checkpoint; its dequantized weights are "the fp32
weights". Our side builds an ONNX bundle per entry of the model's configs (cached per model and spec in
~/.cache/edge-llm/bench); llama.cpp's side gets an F32 GGUF of the same weights (written here with gguf's
GGUFWriter, tensor names and Q/K row order by the architecture's row of quantize.architectures) and
quantizes it with llama_model_quantize to each of LLAMACPP_FTYPES. Every model then runs over the evaluation text (the same token ids, 256-token chunks
through one KV cache) and is scored against our fp32 graph's logits with quantize.evaluate's
definitions: mean and p99 of KL(fp32 || model) per position, top-1 agreement, and perplexity. The F32
GGUF row is the floor: how far llama.cpp and our fp32 graph differ with no quantization at all; the source
file's row (llama.cpp on the GGUF we read) is the proof that our graph computes that architecture.
Token ids are llama.cpp's tokenization of the text (bench/benchmodels.token_ids), BOS first when the GGUF
asks for it.

llama.cpp runs in the peer venv (bench/setup_peers) through bench/_peers_llamacpp.py, so this process
never imports llama_cpp; logits come back as .npy files. Keeping the GGUF's own blocks (ours and
llama.cpp's) is reported apart: it is not quantization from fp32, and the fp32 weights are those blocks.

Run: .venv/bin/python bench/quality.py [--model smollm2-135m] [--text FILE] [--threads 2] [--write-docs]
     # SmolLM2 ~3 min on 2 cores; the 0.5B-class models take longer (GPTQ builds, a larger vocabulary)
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import inspect
import json
import platform
import shlex
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere: import the repo's packages
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: benchdocs, benchmodels
from benchdocs import replace_section  # noqa: E402
from benchmodels import DEFAULT, MODELS, PEER_PYTHON, BenchModel, peer, token_ids  # noqa: E402

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType  # noqa: E402

from agent import wire  # noqa: E402
from agent.wire import Geometry  # noqa: E402
from agent.engine.bundle import open_bundle  # noqa: E402
from agent.engine.runner import open_runner  # noqa: E402
from quantize.architectures import GLOBAL_NAMES, Architecture, by_name  # noqa: E402
from quantize.checkpoint import Checkpoint, load_checkpoint  # noqa: E402
from quantize.evaluate import CHUNK_TOKENS, chunked_logits, log_softmax  # noqa: E402
from quantize.gguf_reader import unpermute_rows  # noqa: E402
from quantize.package import build_bundle  # noqa: E402
from quantize.precision import QuantSpec  # noqa: E402
from quantize.recipes import build_spec  # noqa: E402

DATA = REPO / "quantize" / "data"
DOCS = REPO / "docs" / "benchmarks.md"

FROM_FP32 = "from fp32"
FROM_SOURCE = "kept source quant"


@dataclass(frozen=True)
class OnnxConfig:
    label: str
    spec: QuantSpec
    calibrated: bool = False  # pass calib_en.txt to build_bundle(calibration_text=...)
    group: str = FROM_FP32
    int8_kv: bool = False  # also a row for the same bundle with its int8 KV cache graph
    goal: str | None = None  # "int4" / "int8": the row the goal for that precision is about
    # spec holds only the precision: the bundle is `edge-quantize build`'s default for the model, its recipe
    # (quantize.recipes) when it has one
    default: bool = False

    def resolved(self, g: Geometry) -> "OnnxConfig":
        return dataclasses.replace(self, spec=build_spec(g, self.spec.precision, {})) if self.default else self


PLAIN = {"int4_int8_layers": {}}  # every projection at 4 bits, as the row's label says

# Our bundles, in table order; the fp32 bundle is always built first (it is the reference).
CONFIGS = [
    OnnxConfig("int8 default: GPTQ (b32, head b32)", QuantSpec(precision="int8", block_size=32, block_sizes={}),
               calibrated=True, goal="int8"),
    OnnxConfig("int8 (search, b32, head b64)", QuantSpec(precision="int8", method="search", block_size=32,
                                                         block_sizes={}, head_block_size=64)),
    OnnxConfig("int8 (rtn, b16)", QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={})),
    # RTN as the peers do it: symmetric blocks of 32 everywhere
    OnnxConfig("int4 RTN (sym, block 32)", QuantSpec(precision="int4", method="rtn", symmetric=True, block_size=32,
                                                    block_sizes={}, **PLAIN)),
    OnnxConfig("int4 search + importance (sym, b64)", QuantSpec(precision="int4", method="search", symmetric=True,
                                                                block_sizes={}, **PLAIN), calibrated=True),
    OnnxConfig("int4 GPTQ (sym, b64)", QuantSpec(precision="int4", symmetric=True, block_sizes={}, **PLAIN), calibrated=True),
    OnnxConfig("int4 GPTQ (asym b64, down b128)", QuantSpec(precision="int4", int4_symmetric_kinds=frozenset(),
                                                           **PLAIN), calibrated=True),
    OnnxConfig("int4 default: GPTQ (b64, down b128, o+gate_up sym, L18 qkv int8)", QuantSpec(precision="int4"),
               calibrated=True, int8_kv=True, goal="int4", default=True),
    # the lm_head at 4 bits as well (untied from the 8-bit embedding), GPTQ'd like the layers
    OnnxConfig("int4 default + int4 lm_head (GPTQ)", QuantSpec(precision="int4", lm_head="int4"), calibrated=True),
    OnnxConfig("int4 keep-source-quant", QuantSpec(precision="int4", keep_source_quant=True), group=FROM_SOURCE),
]
# The 0.5B-class models get the rows the goals are about and the peers' recipe (a GPTQ build of one takes
# minutes on 2 cores). The defaults are `edge-quantize build --precision int8 / int4`'s.
LARGE_CONFIGS = [
    OnnxConfig("int8 default (edge-quantize build --precision int8)", QuantSpec(precision="int8", block_size=32,
                                                                               block_sizes={}),
               calibrated=True, goal="int8"),
    CONFIGS[3],  # int4 RTN, symmetric blocks of 32, as Q4_0 does it
    OnnxConfig("int4 default (edge-quantize build --precision int4)", QuantSpec(precision="int4"), calibrated=True,
               int8_kv=True, goal="int4", default=True),
]
# What a model without a recipe gets (QuantSpec's defaults, measured on SmolLM2): the row the recipe is against
NO_RECIPE = OnnxConfig("int4 without the model's recipe (blocks of 64, down 128, L18 qkv int8)",
                       QuantSpec(precision="int4"), calibrated=True)
CONFIGS_BY_MODEL = {DEFAULT: CONFIGS, "qwen2.5-0.5b": LARGE_CONFIGS, "qwen2.5-1.5b": LARGE_CONFIGS,
                    "gemma3-270m": [*LARGE_CONFIGS, NO_RECIPE]}
# llama.cpp's quantizations of the F32 GGUF, by llama_cpp.LLAMA_FTYPE_MOSTLY_* suffix, with its default mixes.
LLAMACPP_FTYPES = ["Q8_0", "Q4_0", "Q4_K_M"]


@dataclass(frozen=True)
class Figures:
    mean_kl: float
    p99_kl: float
    top1: float  # fraction of positions whose argmax equals the fp32 graph's
    perplexity: float


@dataclass(frozen=True)
class Row:
    engine: str  # "ORT" or "llama.cpp"
    label: str
    group: str
    size_bytes: int
    figures: Figures
    note: str = ""
    goal: str | None = None  # OnnxConfig.goal


def figures(chunks, ref_lp: np.ndarray, ids: list[int]) -> Figures:
    """The same definitions as quantize.evaluate.compare, for log-probs [n, V] per chunk against ref_lp [T, V]."""
    kls, agree, nll = [], 0, 0.0
    for start, lp in chunks:
        ref = ref_lp[start:start + len(lp)]
        kls.append((np.exp(ref) * (ref - lp)).sum(-1))  # KL(fp32 || model), per position
        agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
        nxt = np.array(ids[start + 1:start + 1 + len(lp)])  # the last position has no next token
        nll -= lp[np.arange(len(nxt)), nxt].sum()
    kl = np.concatenate(kls)
    assert len(kl) == len(ids), (len(kl), len(ids))
    perplexity = float(np.exp(nll / (len(ids) - 1)))
    return Figures(float(kl.mean()), float(np.percentile(kl, 99)), agree / len(ids), perplexity)


def logit_chunks(logits: np.ndarray):
    """(start, log-probs) per CHUNK_TOKENS rows of a [T, V] logits array, as chunked_logits yields them."""
    for start in range(0, len(logits), CHUNK_TOKENS):
        yield start, log_softmax(np.asarray(logits[start:start + CHUNK_TOKENS]))


def dir_bytes(path: Path) -> int:
    """What a device needs to run the bundle: every file but the optional int8 KV cache graph (an
    alternative to the main graph, not an addition). Every row's size counts the model's tokenizer: ours
    tokenizer.json, a GGUF its vocabulary (and merges) in its metadata, GenAI's folder its tokenizer files."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.name != wire.GRAPH_INT8_KV)


# ---- our bundles -------------------------------------------------------------------------------------

def build_kwargs(cfg: OnnxConfig, calib_text: str) -> tuple[dict, str]:
    """Extra build_bundle arguments for cfg, and a note when the calibration text cannot be passed."""
    if not cfg.calibrated:
        return {}, ""
    if "calibration_text" in inspect.signature(build_bundle).parameters:
        return {"calibration_text": calib_text}, ""
    return {}, "built WITHOUT calibration: build_bundle has no calibration_text parameter yet"


def bundle_dir(ckpt: Checkpoint, cfg: OnnxConfig, root: Path) -> Path:
    """Where cfg's bundle of ckpt is cached: the label for reading, a digest of what makes the bundle for
    validity (the source file, the spec, whether calibrated), so a changed spec is built afresh."""
    what = json.dumps([ckpt.source_sha256, cfg.spec.model_dump(mode="json"), cfg.calibrated], sort_keys=True)
    slug = "".join(c if c.isalnum() or c in "._-" else "_" for c in cfg.label)[:60]
    return root / f"{slug}-{hashlib.sha256(what.encode()).hexdigest()[:10]}"


def build(ckpt: Checkpoint, cfg: OnnxConfig, root: Path, calib_text: str, threads: int, name: str):
    """cfg's bundle (from the cache when built before) and a note; the build time is kept beside it."""
    out = bundle_dir(ckpt, cfg, root)
    seconds = out.with_name(out.name + ".build_s")
    kwargs, note = build_kwargs(cfg, calib_text)
    if note:
        print(f"  note: {cfg.label}: {note}")
    if not (out / wire.MANIFEST).exists():
        t0 = time.monotonic()
        build_bundle(ckpt, cfg.spec, out, name=name, threads=threads, force=True,
                     progress=lambda s: print(f"  [{cfg.label}] {s}", flush=True), **kwargs)
        seconds.write_text(f"{time.monotonic() - t0:.0f}\n")
    built = f"built in {seconds.read_text().strip()} s" if seconds.exists() else ""
    return open_bundle(out), "; ".join(x for x in (note, built) if x)


def reference(source: Path, ids: list[int], calib_text: str, root: Path, threads: int,
              name: str) -> tuple[Row, np.ndarray]:
    """The fp32 row and its log-probs float32 [T, V], the reference for every row, memory-mapped from a file
    cached beside the fp32 bundle (keyed by the ids). The checkpoint is let go before ONNX Runtime loads the
    fp32 graph: together they hold the fp32 weights twice (~13 GB for a 1.5B model)."""
    ckpt = load_checkpoint(source)
    fp32, _ = build(ckpt, OnnxConfig("fp32", QuantSpec()), root, calib_text, threads, name)
    del ckpt
    digest = hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()[:10]
    path = fp32.path.with_name(f"{fp32.path.name}.logprobs-{digest}.npy")
    if not path.exists():
        partial = path.with_name(path.name + ".partial")
        out = None
        for start, lp in chunked_logits(open_runner(fp32, threads), ids):
            if out is None:  # written chunk by chunk: [T, V] is ~1.1 GB at a 152k vocabulary
                out = np.lib.format.open_memmap(partial, "w+", np.float32, (len(ids), lp.shape[-1]))
            out[start:start + len(lp)] = lp
        out.flush()
        del out
        partial.rename(path)
    ref_lp = np.load(path, mmap_mode="r")
    own = ((s, ref_lp[s:s + CHUNK_TOKENS]) for s in range(0, len(ids), CHUNK_TOKENS))
    return Row("ORT", "fp32", FROM_FP32, dir_bytes(fp32.path), figures(own, ref_lp, ids)), ref_lp


def mapped(ckpt: Checkpoint, root: Path) -> Checkpoint:
    """ckpt with its fp32 weights memory-mapped (copy on write) from .npy files under root, written once per
    source file. Mapped pages are the file's, which the kernel drops under memory pressure and reads again;
    load_checkpoint's arrays are anonymous memory. A calibrated build holds the checkpoint beside a whole fp32
    capture graph and its ORT session: at 1.5B that is ~13 GB of anonymous memory otherwise."""
    folder = root / f"weights-{ckpt.source_sha256[:10]}"
    if not folder.exists():
        partial = folder.with_name(folder.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        for name, w in ckpt.weights.items():
            np.save(partial / f"{name}.npy", w)
        partial.rename(folder)
    return dataclasses.replace(ckpt, weights={n: np.load(folder / f"{n}.npy", mmap_mode="c") for n in ckpt.weights})


def onnx_rows(ckpt: Checkpoint, configs: list[OnnxConfig], ids: list[int], ref_lp: np.ndarray, calib_text: str,
              root: Path, threads: int, name: str) -> list[Row]:
    """One row per configs entry (two with its int8 KV cache graph), scored against ref_lp [T, V]."""
    rows = []
    for cfg in (c.resolved(ckpt.geometry) for c in configs):
        t0 = time.monotonic()
        bundle, note = build(ckpt, cfg, root, calib_text, threads, name)
        fig = figures(chunked_logits(open_runner(bundle, threads), ids), ref_lp, ids)
        rows.append(Row("ORT", cfg.label, cfg.group, dir_bytes(bundle.path), fig, note, cfg.goal))
        print(f"  {cfg.label}: mean KL {fig.mean_kl:.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
        if cfg.int8_kv:
            fig = figures(chunked_logits(open_runner(bundle, threads, kv_dtype="int8"), ids), ref_lp, ids)
            rows.append(Row("ORT", cfg.label + " + int8 KV cache", cfg.group, dir_bytes(bundle.path), fig, note))
            print(f"  {cfg.label} + int8 KV cache: mean KL {fig.mean_kl:.4f}", flush=True)
    return rows


# ---- llama.cpp ---------------------------------------------------------------------------------------

def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation (HF half-split rotary rows -> interleaved pairs); inverse of
    quantize.gguf_reader.unpermute_rows, as tests/tiny.py writes it."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(arch: Architecture, num_layers: int) -> dict[str, str]:
    """Internal tensor name -> GGUF name: the architecture row's tables, reversed."""
    if arch.fused:  # one GGUF tensor holds several internal ones: they would have to be concatenated again
        raise SystemExit(f"writing a {arch.name} F32 GGUF (fused qkv / gate_up tensors) is not supported")
    block = {hf: gg for gg, hf in arch.block_names.items()}
    assert len(block) == len(arch.block_names), f"{arch.name}: two GGUF names map to one internal name"
    to_gguf = {hf: gg for gg, hf in GLOBAL_NAMES.items()}
    for i in range(num_layers):
        to_gguf |= {f"model.layers.{i}.{hf}": f"blk.{i}.{gg}" for hf, gg in block.items()}
    return to_gguf


def gguf_tensors(ckpt: Checkpoint):
    """(GGUF name, float32 array in GGUF row order) for every checkpoint weight. Norm weights go as they are:
    the internal form holds the factor the model multiplies by, which is what llama.cpp's converter stores
    (for Gemma too: it adds transformers' 1)."""
    g = ckpt.geometry
    arch = by_name(g.architecture)
    to_gguf = gguf_names(arch, g.num_layers)
    for hf, w in ckpt.weights.items():
        name = to_gguf[hf]
        heads = {"attn_q.weight": g.num_heads, "attn_k.weight": g.num_kv_heads}.get(name.split(".", 2)[-1])
        if heads and arch.permuted_qk:
            w = permute_rows(w, heads)
            assert np.array_equal(unpermute_rows(w, heads), ckpt.weights[hf])
        yield name, np.ascontiguousarray(w, dtype=np.float32)


def copy_fields(reader: GGUFReader, writer: GGUFWriter, arch: Architecture) -> None:
    """The source GGUF's architecture keys ({arch}.*: sizes, RoPE, windows, norms' epsilon) and every
    tokenizer.* key (tokens, merges, types, pre, bos/eos, chat template) as they are: the F32 file describes
    the same model, only its tensors' type differs."""
    for key, f in reader.fields.items():
        if key.startswith(("tokenizer.", arch.key_prefix)):
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            writer.add_key_value(key, f.contents(), f.types[0], sub)


def write_f32_gguf(ckpt: Checkpoint, source: Path, path: Path) -> Path:
    reader = GGUFReader(source)
    arch = by_name(ckpt.geometry.architecture)
    writer = GGUFWriter(str(path.with_suffix(".partial")), reader.fields["general.architecture"].contents())
    writer.add_name(f"{source.stem} F32 (dequantized)")
    writer.add_file_type(LlamaFileType.ALL_F32)
    copy_fields(reader, writer, arch)
    for name, w in gguf_tensors(ckpt):
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".partial").rename(path)
    return path


def tensor_types(path: Path) -> str:
    """The GGML types of a GGUF's 2-D tensors with their counts, most common first: "Q4_0 x210, Q8_0 x1"."""
    counts = Counter(GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{k} x{n}" for k, n in counts.most_common())


def llamacpp_figures(model: Path, ids_path: Path, ids: list[int], ref_lp: np.ndarray,
                     threads: int) -> tuple[Figures, dict]:
    """Figures of a GGUF run by llama.cpp in the peer venv, and the peer's info (llama_cpp version)."""
    out = model.with_suffix(".logits.npy")
    info = peer("logits", str(model), str(ids_path), str(out), threads=threads)
    logits = np.load(out, mmap_mode="r")  # float32 [T, V]
    assert logits.shape == ref_lp.shape, (logits.shape, ref_lp.shape)
    fig = figures(logit_chunks(logits), ref_lp, ids)
    del logits
    out.unlink()  # ~350 MB each
    return fig, info


def llamacpp_rows(model: BenchModel, f32: Path, source: Path, ids_path: Path, ids: list[int], ref_lp: np.ndarray,
                  work: Path, threads: int):
    """llama.cpp on the F32 GGUF, on its quantizations of it (LLAMACPP_FTYPES) and on the source file."""
    models = [("F32 GGUF (no quantization)", f32, FROM_FP32)]
    for ftype in LLAMACPP_FTYPES:
        dst = work / f"{ftype}.gguf"
        peer("quantize", str(f32), str(dst), ftype, threads=threads)
        models.append((ftype, dst, FROM_FP32))
    models.append((f"{model.source_quant} (source file)", source, FROM_SOURCE))
    rows, version = [], ""
    for label, path, group in models:
        t0 = time.monotonic()
        fig, info = llamacpp_figures(path, ids_path, ids, ref_lp, threads)
        version = info["llama_cpp"]
        rows.append(Row("llama.cpp", label, group, path.stat().st_size, fig, "tensor types " + tensor_types(path)))
        print(f"  llama.cpp {label}: mean KL {fig.mean_kl:.4f} ({time.monotonic() - t0:.0f} s)", flush=True)
    return rows, version


# ---- onnxruntime-genai -------------------------------------------------------------------------------

def genai_row(model: BenchModel, source: Path, ids_path: Path, ids: list[int], ref_lp: np.ndarray, work: Path,
              threads: int) -> Row:
    """GenAI's int4 (its builder from save_hf's folder of the same weights; bench/tps.py's cached artifact)."""
    from tps import build_genai

    path = model.cache / "genai-int4"
    if not path.exists():
        t0 = time.monotonic()
        build_genai(model, source, path)
        print(f"  genai-int4 built in {time.monotonic() - t0:.0f} s", flush=True)
    out = work / "genai.logits.npy"
    info = peer("genai-logits", str(path), str(ids_path), str(out), threads=threads)
    logits = np.load(out, mmap_mode="r")
    assert logits.shape == ref_lp.shape, (logits.shape, ref_lp.shape)
    fig = figures(logit_chunks(logits), ref_lp, ids)
    del logits
    out.unlink()
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())  # its tokenizer too, as dir_bytes counts ours
    args = " ".join(model.genai_args)
    print(f"  GenAI int4: mean KL {fig.mean_kl:.4f}", flush=True)
    return Row("GenAI", "int4 (its builder)", FROM_FP32, size, fig,
               f"onnxruntime-genai {info['onnxruntime_genai']} builder `{args}`; size is its whole folder "
               "(graph, weights, genai_config.json, tokenizer files)")


# ---- report ------------------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    lines = ["| config | size MB | mean KL | p99 KL | top-1 % | perplexity |", "|---|--:|--:|--:|--:|--:|"]
    for group in (FROM_FP32, FROM_SOURCE):
        lines.append(f"| **{group}** | | | | | |")
        for r in (r for r in rows if r.group == group):
            f = r.figures
            lines.append(f"| {r.engine} {r.label} | {r.size_bytes / 1e6:.1f} | {f.mean_kl:.4f} | {f.p99_kl:.4f} | "
                         f"{100 * f.top1:.1f} | {f.perplexity:.3f} |")
    return "\n".join(lines)


def notes(rows: list[Row]) -> str:
    lines = [f"- {r.engine} {r.label}: {r.note}" for r in rows if r.note]
    return "\n".join(["Notes:", *lines]) if lines else ""


def goals(rows: list[Row]) -> str:
    """The issue's goals: our INT4, at no more than Q4_0's size, at most half Q4_0's mean KL; our INT8 at most
    Q8_0's mean KL."""
    ours = {r.goal: r for r in rows if r.goal}
    peers = {r.label: r for r in rows if r.engine == "llama.cpp"}
    lines = []
    for precision, ftype, factor in (("int4", "Q4_0", 0.5), ("int8", "Q8_0", 1.0)):
        r, p = ours.get(precision), peers.get(ftype)
        if r is None or p is None:
            continue
        kl_ok = r.figures.mean_kl <= factor * p.figures.mean_kl
        size_ok = r.size_bytes <= p.size_bytes
        bound = f"{factor:g}x " if factor != 1 else ""
        lines.append(f"- {precision.upper()} mean KL <= {bound}llama.cpp {ftype}'s: {r.figures.mean_kl:.4f} vs "
                     f"{p.figures.mean_kl:.4f} ({'met' if kl_ok else 'NOT met'}); size {r.size_bytes / 1e6:.1f} "
                     f"vs {p.size_bytes / 1e6:.1f} MB ({'within' if size_ok else 'OVER'})")
    return "\n".join(["Goals:", *lines]) if lines else ""


def machine_note(threads: int, llama_cpp_version: str) -> str:
    import onnxruntime

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return (f"{cpu}, {threads} threads, shared machine; Python {platform.python_version()}, onnxruntime "
            f"{onnxruntime.__version__}, llama-cpp-python {llama_cpp_version} (built by bench/setup_peers)")


def docs_section(model: BenchModel, source: Path, report: str, command: str, when: str, machine: str,
                 minutes: float, n_tokens: int, text: str) -> str:
    what = f"the bundled {model.title} {model.source_quant} GGUF" if model.is_default \
        else f"{model.title}, `{source.name}`"
    genai = "" if model.is_default else (" GenAI's row is onnxruntime-genai's own builder (int4, cpu) run on the HF "
                                         "folder quantize.hf.save_hf writes of the same weights.")
    return f"""{model.docs_title("Quality", "bench/quality.py")}

Quality of each quantization against our fp32 graph of the same weights ({what}, dequantized), over
`{text}` ({n_tokens} tokens, 256-token chunks through the KV cache). KL is KL(fp32 || model) per position in
nats; top-1 is agreement with the fp32 graph's argmax; perplexity is of the text itself. llama.cpp's rows
quantize an F32 GGUF of the same weights with `llama_model_quantize` (its default tensor mixes); its F32 row is
the noise floor between the two runtimes. Both quantize activations too: our int rows run MatMulNBits with the
spec's accuracy_level (4 by default: int8 per block), llama.cpp's quantized types take Q8 activations.
"Kept source quant" rows keep the GGUF's own {model.source_quant} blocks, whose dequantized values *are* the
fp32 weights here, so they are not comparable with quantizing from fp32. llama.cpp on the F32 file against our
fp32 graph is the check that our graph computes the architecture as llama.cpp does (the same weights, no
quantization); on the source file it adds llama.cpp's Q8 rounding of activations.{genai}

Command: `{command}`
Date: {when}. Machine: {machine}. The run took {minutes:.1f} min.

{report}
"""


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(MODELS), default=DEFAULT, help="The benchmark model (bench/benchmodels.py).")
    p.add_argument("--text", type=Path, default=DATA / "eval_en.txt",
                   help="Evaluation text (not the calibration text).")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-docs", action="store_true", help=f"Write the table into {DOCS.relative_to(REPO)}.")
    a = p.parse_args(argv)
    t0 = time.monotonic()
    model = MODELS[a.model]
    text, calib_text = a.text.read_text(), (DATA / "calib_en.txt").read_text()
    if text.strip() == calib_text.strip():
        raise SystemExit(f"{a.text} is the calibration text: evaluate on text the quantizer has not seen")
    if not PEER_PYTHON.exists():
        raise SystemExit(f"{PEER_PYTHON} is missing: run `bash bench/setup_peers` first")
    source = model.source()
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        ids_path = Path(tmp) / "ids.npy"
        ids = token_ids(source, a.text, ids_path)
        print(f"{source.name}: {len(ids)} tokens of {a.text.name}", flush=True)
        root, name = model.cache / "quality", f"{model.name}-bench"
        fp32_row, ref_lp = reference(source, ids, calib_text, root, a.threads, name)
        ckpt = mapped(load_checkpoint(source), root)
        rows = [fp32_row, *onnx_rows(ckpt, CONFIGS_BY_MODEL[model.name], ids, ref_lp, calib_text, root, a.threads,
                                     name)]
        f32 = write_f32_gguf(ckpt, source, Path(tmp) / "f32.gguf")
        del ckpt  # llama.cpp and GenAI's builder run in their own processes
        peer_rows, version = llamacpp_rows(model, f32, source, ids_path, ids, ref_lp, Path(tmp), a.threads)
        if not model.is_default:  # SmolLM2's table predates the GenAI row; tps.py has its speed
            peer_rows.append(genai_row(model, source, ids_path, ids, ref_lp, Path(tmp), a.threads))
    rows += peer_rows
    report = "\n\n".join(x for x in (table(rows), goals(rows), notes(rows)) if x)
    minutes = (time.monotonic() - t0) / 60
    print("\n" + report + f"\n\ntook {minutes:.1f} min")
    if a.write_docs:
        command = ".venv/bin/python bench/quality.py " + shlex.join(argv)
        when = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        shown = a.text.resolve().relative_to(REPO) if a.text.resolve().is_relative_to(REPO) else a.text
        machine = machine_note(a.threads, version)
        replace_section(model.docs_title("Quality", "bench/quality.py"), docs_section(
            model, source, report, command.strip(), when, machine, minutes, len(ids), str(shown)))
        print(f"wrote {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])
