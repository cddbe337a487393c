"""edge-quantize: build, evaluate and inspect model bundles.

Run: edge-quantize build SOURCE --precision int4 --out DIR
     edge-quantize eval BUNDLE --reference FP32_BUNDLE --text FILE [--json]
     edge-quantize inspect BUNDLE
     edge-quantize adapter PEFT_DIR --base BUNDLE --out DIR [--source CHECKPOINT]
     edge-quantize fetch NAME | --list
"""
from __future__ import annotations

import dataclasses
import json
import re
import signal
from importlib import resources
from pathlib import Path

import click

from agent import wire
from agent.clikit import run
from agent.config import MAX_THREADS
from agent.engine.bundle import BundleError, open_bundle
from quantize.calibrate import HESSIAN_BUDGET_MB
from quantize.checkpoint import CheckpointError, file_kind
from quantize.package import PackageError, check_destination
from quantize.peft import AdapterError

USER_ERRORS = (CheckpointError, PackageError, BundleError, AdapterError, OSError, ValueError)


def default_eval_text() -> str:
    return resources.files("quantize").joinpath("data/eval_en.txt").read_text()


def default_calibration_text() -> str:
    """Importance statistics come from this text, never from the evaluation text."""
    return resources.files("quantize").joinpath("data/calib_en.txt").read_text()


def _fail(e: Exception) -> None:
    raise click.ClickException(str(e).splitlines()[0] if str(e) else type(e).__name__) from e


def _open_bundle(path: Path):
    """open_bundle, with a path that is not a folder named for what it is (the manifest's read said only
    "Not a directory")."""
    kind = file_kind(path)
    if kind is None:
        raise BundleError(f"{path}: no such file or directory")
    if kind != "a directory":
        raise BundleError(f"{path}: not a model bundle (it is {kind}; a bundle is a directory)")
    return open_bundle(path)


@click.group(context_settings={"show_default": True})
def cli() -> None:
    """Build ONNX Runtime model bundles from GGUF or Hugging Face checkpoints."""


@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Bundle directory to write.")
@click.option("--precision", type=click.Choice(["fp32", "int8", "int4"]), default="int4", show_default=True,
              help="Weights: fp32 (the quality reference for eval), int8 or int4.")
@click.option("--block-size", type=click.Choice(["16", "32", "64", "128"]), default=None,
              help="Quantization block size [default: int4: the model's recipe (quantize/recipes.py), else 64; "
                   "int8: 32].")
@click.option("--down-block-size", type=click.Choice(["16", "32", "64", "128"]), default=None,
              help="Block size of the MLP down projection [default: int4: the model's recipe, else 128; int8: "
                   "the block size].")
@click.option("--symmetric/--asymmetric", default=None,
              help="No per-block zero points, or zero points everywhere [default: int4: symmetric o and gate_up "
                   "projections, asymmetric qkv and down; int8: asymmetric].")
@click.option("--int8-layers", default=None, metavar="KIND:LAYER,...|none",
              help="INT4 only: projections kept at 8 bits, e.g. qkv:18,down:28 (kinds: qkv, o, gate_up, down), "
                   "or none [default: the model's recipe, else qkv:18, measured on SmolLM2].")
@click.option("--method", type=click.Choice(["rtn", "search", "gptq"]), default="gptq", show_default=True,
              help="rtn: round to nearest; search: per-block error-minimizing scales, importance-weighted; "
                   "gptq: search plus GPTQ error compensation.")
@click.option("--calib-text", type=click.Path(exists=True, path_type=Path), default=None,
              help="Calibration text for importance and GPTQ (default: the bundled one; never the eval text).")
@click.option("--accuracy-level", type=click.Choice(["0", "1", "4"]), default="4", show_default=True,
              help="MatMulNBits activation compute: 4 = int8 per block, 0/1 = fp32.")
@click.option("--embedding", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="The embedding table's precision (default: the model's recipe for int4, else --precision, but never "
                   "below int8).")
@click.option("--lm-head", type=click.Choice(["fp32", "int8", "int4"]), default=None,
              help="The lm_head's precision (default: the model's recipe for int4, else int8 for int4 bundles). A "
                   "head apart from the embedding's precision is stored apart from it, and GPTQ'd like the layers; "
                   "a tied model's table with both at int4 is stored once, symmetric, GPTQ'd as the head (blocks: "
                   "the recipe's, else the largest of 128 / 64 / 32 / 16 dividing the hidden size).")
@click.option("--keep-source-quant", is_flag=True, help="Keep a GGUF's own Q4_0/Q4_1/Q8_0 blocks.")
@click.option("--head-vocab", type=click.IntRange(min=256), default=None,
              help="Draft models only: the lm_head over the first N token ids (byte-level BPE numbers tokens in "
                   "merge order, frequent ones first): a cheaper draft for speculative decoding; such a bundle "
                   "cannot serve requests itself [default: the whole vocabulary].")
@click.option("--draft", type=click.Path(path_type=Path), default=None,
              help="A bundle of the same tokenizer for the new one to carry as its draft model (speculative "
                   "decoding: the agent drafts with it when its speculative setting is \"draft\") [default: none].")
@click.option("--eval-text", type=click.Path(exists=True, path_type=Path), default=None,
              help="Text for the quality figures (default: the bundled English passage).")
@click.option("--no-eval", is_flag=True, help="Skip the quality evaluation.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A Jinja chat template file for the bundle (default: the checkpoint's own; a base model has "
                   "none, and without one the agent serves completions and refuses chat).")
@click.option("--name", default=None, help="Model name (default: from the source file name).")
@click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
              help="Threads for calibration and evaluation (default: the cores this process may use).")
@click.option("--force", is_flag=True, help="Replace an existing bundle (or empty folder) at --out; anything "
                                            "else there is refused.")
@click.option("--hessian-memory-mb", type=click.IntRange(min=1), default=HESSIAN_BUDGET_MB, show_default=True,
              help="GPTQ: memory for the layers' Hessians at once; less takes more passes over the calibration "
                   "text, with the same result (a 1B Llama's are ~10 GB in all).")
@click.option("--lora-targets", default=None, metavar="q,k,v,o,gate,up,down",
              help="Make the bundle adapter-ready: a LoRA branch beside these projections (without an adapter its "
                   "logits are the plain bundle's, bit for bit) [default: none, a plain bundle].")
@click.option("--max-lora-rank", type=click.IntRange(1, 1024), default=16, show_default=True,
              help="The largest adapter rank per projection the bundle accepts (with --lora-targets).")
def build(source, out, precision, block_size, down_block_size, symmetric, int8_layers, method, calib_text, accuracy_level,
          embedding, lm_head, keep_source_quant, head_vocab, draft, eval_text, no_eval, chat_template, name,
          threads, force, hessian_memory_mb, lora_targets, max_lora_rank):
    """Convert a checkpoint, quantize it, evaluate it and write a bundle.

    Example: edge-quantize build SmolLM2.gguf --precision int4 --out bundles/smollm2-int4
    """
    from quantize.checkpoint import load_checkpoint
    from quantize.lora import LoraSpec, check_architecture, parse_targets
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec
    from quantize.recipes import build_spec

    try:
        check_destination(out, force)  # before reading the source: converting a 1B model takes minutes
        explicit = spec_options(precision, block_size, down_block_size, symmetric, int8_layers) | {
            k: v for k, v in {"method": method, "accuracy_level": int(accuracy_level), "embedding": embedding,
                              "lm_head": lm_head, "keep_source_quant": keep_source_quant,
                              "head_vocab": head_vocab}.items() if v is not None}
        QuantSpec(precision=precision, **explicit)  # the options' errors before the source is read
        lora = LoraSpec(targets=parse_targets(lora_targets), max_rank=max_lora_rank) if lora_targets else None
        template = read_text(chat_template) if chat_template else None
        click.echo(f"reading {source}")
        ckpt = load_checkpoint(source)
        if template is not None:
            ckpt.tokenizer = dataclasses.replace(ckpt.tokenizer, chat_template=template)
        if lora:
            check_architecture(ckpt.geometry.architecture)
        spec = build_spec(ckpt.geometry, precision, explicit)  # the model's recipe (quantize/recipes.py) under them
        if beyond := [f"{k}:{i}" for k, ids in explicit.get("int4_int8_layers", {}).items()
                      for i in ids if i >= ckpt.geometry.num_layers]:
            raise ValueError(f"--int8-layers {', '.join(beyond)}: the model has layers 0-{ckpt.geometry.num_layers - 1}")
        text = None if no_eval else (read_text(eval_text) if eval_text else default_eval_text())
        calib = read_text(calib_text) if calib_text else default_calibration_text()
        bundle = build_bundle(ckpt, spec, out, name=_name_of(source) if name is None else name, force=force, eval_text=text,
                              calibration_text=calib,
                              threads=threads, progress=lambda s: click.echo(f"  {s}"), show_progress=True,
                              hessian_budget_mb=hessian_memory_mb, draft=draft, lora=lora)
    except USER_ERRORS as e:
        _fail(e)
    _print_summary(bundle)


def spec_options(precision: str, block_size: str | None, down_block_size: str | None, symmetric: bool | None,
                 int8_layers: str | None) -> dict:
    """The QuantSpec fields the layer options give; for INT4 only those given, so that the model's recipe
    (quantize/recipes.py) or QuantSpec's defaults (int4 GPTQ b64 with down b128, measured) fill the rest.
    INT8 is GPTQ in blocks of 32 everywhere unless told otherwise."""
    options: dict = {}
    if precision != "int4":
        block = int(block_size or 32)
        options |= {"block_size": block, "block_sizes": {"down": int(down_block_size or block)}}
    else:
        options |= {"block_size": int(block_size)} if block_size else {}
        options |= {"block_sizes": {"down": int(down_block_size)}} if down_block_size else {}
    if symmetric is not None:  # a flag applies to all kinds
        options |= {"symmetric": symmetric, "int4_symmetric_kinds": frozenset()}
    if int8_layers is not None:
        if precision != "int4":
            raise ValueError("--int8-layers applies to --precision int4 only")
        options["int4_int8_layers"] = parse_int8_layers(int8_layers)
    return options


def read_text(path: Path) -> str:
    """A text file's content; one that is not UTF-8 is named (the codec's message named no file)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def parse_int8_layers(text: str) -> dict[str, list[int]]:
    """"qkv:18,down:28" -> {"qkv": [18], "down": [28]}; "none" -> {}."""
    if text.strip().lower() == "none":
        return {}
    layers: dict[str, list[int]] = {}
    for item in text.split(","):
        kind, _, layer = item.strip().partition(":")
        if kind not in ("qkv", "o", "gate_up", "down") or not layer.isdigit():
            raise ValueError(f"--int8-layers: {item.strip()!r} is not KIND:LAYER with KIND one of qkv, o, gate_up, down")
        layers.setdefault(kind, []).append(int(layer))
    return layers


def _name_of(source: Path) -> str:
    """The default model name: the source's file or folder name, made a valid one (spaces and the like -> '-')."""
    stem = source.name.split(".")[0] if source.is_file() else source.name
    return re.sub(r"[^a-z0-9_.+-]+", "-", stem.lower()).strip("-._+")[:64] or "model"


def _print_summary(bundle) -> None:
    m = bundle.manifest
    size_mb = sum(f.size_bytes for f in m.files.values()) / 1e6
    click.echo(f"wrote {bundle.path}: {m.name}@{m.version} ({m.precision}, {size_mb:.1f} MB)")
    if m.draft:
        click.echo(f"  draft model: {m.draft.name}@{m.draft.version} (in {wire.DRAFT_DIR}/)")
    if m.quality:
        q = m.quality
        click.echo(f"  quality over {q.tokens} tokens: perplexity {q.perplexity:.3f} (fp32 {q.reference_perplexity:.3f}), "
                   f"mean KL {q.mean_kl:.4f}, p99 KL {q.p99_kl:.4f}, top-1 {q.top1_agreement:.1%}")


def _check_reference(b, ref) -> None:
    """The reference must be the fp32 build of the same checkpoint: figures against another model mean nothing."""
    if ref.manifest.precision != "fp32":
        raise ValueError(f"--reference must be an fp32 bundle (it is {ref.manifest.precision})")
    if ref.manifest.source_sha256 != b.manifest.source_sha256:
        raise ValueError(f"--reference was built from another checkpoint ({ref.manifest.source_name}) "
                         f"than the bundle ({b.manifest.source_name})")


@cli.command("eval")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--reference", required=True, type=click.Path(path_type=Path),
              help="The fp32 bundle of the same checkpoint (edge-quantize build --precision fp32).")
@click.option("--text", "text_file", required=True, type=click.Path(exists=True, path_type=Path),
              help="UTF-8 text to measure over, e.g. quantize/data/eval_en.txt (what build measures by default).")
@click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
              help="Threads for calibration and evaluation (default: the cores this process may use).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_(bundle, reference, text_file, threads, as_json):
    """Perplexity, KL divergence and top-1 agreement of BUNDLE against the fp32 reference over a text.

    Example: edge-quantize eval bundles/int4 --reference bundles/fp32 --text quantize/data/eval_en.txt --json
    """
    from agent.engine.runner import open_runner
    from quantize.evaluate import compare
    from quantize.package import MIN_TEXT_TOKENS, encode

    try:
        b, ref = _open_bundle(bundle), _open_bundle(reference)
        _check_reference(b, ref)
        text = read_text(text_file)
        ids = encode(b.tokenizer_json(), text)
        if len(ids) < MIN_TEXT_TOKENS:
            raise ValueError(f"{text_file}: the text needs at least {MIN_TEXT_TOKENS} tokens")
        bos = b.config.bos_token_id if b.config.add_bos_token else None
        q = compare(open_runner(b, threads), open_runner(ref, threads), ids, text, b.config.context_length, bos)
    except USER_ERRORS as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(q.model_dump()))
    else:
        for k, v in q.model_dump().items():
            click.echo(f"{k:22} {v}")


@cli.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(bundle, as_json):
    """Print a bundle's geometry, sizes, precision and quality.

    Example: edge-quantize inspect bundles/smollm2-int4
    """
    try:
        b = _open_bundle(bundle)
    except USER_ERRORS as e:
        _fail(e)
    info = {"name": b.manifest.name, "version": b.manifest.version, "precision": b.manifest.precision,
            "quant": b.manifest.quant, "geometry": b.config.model_dump(exclude={"chat_template", "quant"}),
            "files": {k: v.size_bytes for k, v in b.manifest.files.items()},
            "quality": b.manifest.quality.model_dump() if b.manifest.quality else None,
            "lora": b.manifest.lora.model_dump() if b.manifest.lora else None}
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key in ("name", "version", "precision"):
        click.echo(f"{key:10} {info[key]}")
    click.echo("geometry   " + ", ".join(f"{k}={v}" for k, v in info["geometry"].items()))
    for k, v in info["files"].items():
        click.echo(f"file       {k} {v / 1e6:.1f} MB")
    if info["quality"]:
        click.echo("quality    " + ", ".join(f"{k}={v}" for k, v in info["quality"].items() if k != "text_sha256"))
    if info["lora"]:
        click.echo(f"lora       {','.join(info['lora']['targets'])} up to rank {info['lora']['max_rank']}")


@cli.command()
@click.argument("peft_dir", type=click.Path(path_type=Path))
@click.option("--base", required=True, type=click.Path(path_type=Path),
              help="The adapter-ready bundle it will run on (edge-quantize build --lora-targets).")
@click.option("--out", "out", required=True, type=click.Path(path_type=Path), help="Adapter folder to write.")
@click.option("--source", type=click.Path(path_type=Path), default=None,
              help="The checkpoint the base was built from: quality is measured against it in fp32 with the "
                   "adapter merged [default: none, and the manifest has no quality figures].")
@click.option("--eval-text", type=click.Path(exists=True, path_type=Path), default=None,
              help="Text for the quality figures (default: the bundled English passage).")
@click.option("--name", default=None, help="Adapter name (default: from PEFT_DIR's name).")
@click.option("--threads", type=click.IntRange(1, MAX_THREADS), default=None,
              help="Threads for measuring (default: the cores this process may use).")
@click.option("--force", is_flag=True, help="Replace an existing adapter folder (or empty folder) at --out.")
def adapter(peft_dir, base, out, source, eval_text, name, threads, force):
    """Convert a PEFT LoRA adapter for an adapter-ready bundle, and measure it there.

    Example: edge-quantize adapter ./my-lora --base bundles/smollm2-lora --out adapters/support-bot
    """
    from quantize.adapter import check_destination as check_adapter_out
    from quantize.adapter import convert
    from quantize.checkpoint import load_checkpoint
    from quantize.package import MIN_TEXT_TOKENS, encode
    from quantize.peft import read_peft

    try:
        check_adapter_out(out, force)
        adapter_name = _name_of(peft_dir) if name is None else name
        if not re.fullmatch(wire.MODEL_NAME_PATTERN, adapter_name):
            raise ValueError(f"adapter name {adapter_name!r}: use 1-64 letters, digits and . _ + - (starting "
                             "with a letter or digit)")
        b = _open_bundle(base)
        peft = read_peft(peft_dir)
        ckpt = load_checkpoint(source) if source else None
        text = read_text(eval_text) if eval_text else default_eval_text()
        ids = encode(b.tokenizer_json(), text)
        if ckpt is not None and len(ids) < MIN_TEXT_TOKENS:
            raise ValueError(f"the evaluation text needs at least {MIN_TEXT_TOKENS} tokens")
        m = convert(peft, b, out, name=adapter_name, source=ckpt, eval_ids=ids, eval_text=text, threads=threads,
                    force=force, progress=lambda s: click.echo(f"  {s}"))
    except USER_ERRORS as e:
        _fail(e)
    size_mb = sum(f.size_bytes for f in m.files.values()) / 1e6
    click.echo(f"wrote {out}: {m.name}@{m.version} for {m.base_name}@{m.base_version} (rank {m.rank}, "
               f"{', '.join(m.ranks)}, {size_mb:.2f} MB)")
    if m.quality:
        q = m.quality
        click.echo(f"  against fp32 with the adapter merged, over {q.tokens} tokens: mean KL {q.mean_kl:.4f}, "
                   f"p99 KL {q.p99_kl:.4f}, top-1 {q.top1_agreement:.1%}")


@cli.command("fetch")
@click.argument("name", required=False)
@click.option("--list", "as_list", is_flag=True, help="List the known models (also what no NAME does).")
def fetch_(name, as_list):
    """Print the cached path of a known model's GGUF, downloading and verifying it first if needed.

    Example: edge-quantize build "$(edge-quantize fetch smollm2-135m-instruct)" --out bundles/smollm2-int4
    """
    from quantize.fetch import KNOWN_MODELS, describe, fetch

    if as_list or name is None:
        for known in KNOWN_MODELS:
            click.echo(describe(known))
        return
    try:
        path = fetch(name, progress=lambda s: click.echo(s, err=True))
    except USER_ERRORS as e:
        _fail(e)
    click.echo(path)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM (systemd, `timeout`) cleans up as Ctrl-C does: no partial bundle left


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupted)
    run(cli, "edge-quantize")


if __name__ == "__main__":
    main()
