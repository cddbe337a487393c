"""Write a self-describing model bundle: graph, tokenizer, model config and a manifest of hashes.

Everything is written into a temporary sibling directory and renamed into place at the end, so an
interrupted build never leaves a half-written bundle; an existing output is refused unless `force`.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import onnx

from agent import durable, wire
from agent.engine.bundle import Bundle, BundleError, file_sha256, open_bundle
from agent.engine.draft import same_tokenizer
from agent.engine.runner import open_runner
from agent.engine.tokenizer import TextTokenizer
from quantize.calibrate import HESSIAN_BUDGET_MB, Calibration, calibration
from quantize.checkpoint import Checkpoint, file_kind, parameter_counts
from quantize.evaluate import compare, greedy
from quantize.graph import build_graph
from quantize.kv_int8 import int8_kv_graph, kv_absmax
from quantize.lora import LoraSpec
from quantize.precision import QuantSpec

GOLDEN_TOKENS = 32
MIN_GOLDEN_TOKENS = 16  # an update's health check generates at least this many (agent.updates.jobs)


class PackageError(ValueError):
    """The bundle cannot be written as asked (for example the output exists)."""


def model_config(ckpt: Checkpoint, spec: QuantSpec, name: str) -> wire.ModelConfig:
    t = ckpt.tokenizer
    return wire.ModelConfig(name=name, **ckpt.geometry.model_dump(), bos_token_id=t.bos_token_id,
                            eos_token_ids=list(t.eos_token_ids), add_bos_token=t.add_bos_token,
                            chat_template=t.chat_template, precision=spec.precision, quant=spec.model_dump())


def write_graph(ckpt: Checkpoint, spec: QuantSpec, out: Path, calib: Calibration | None = None,
                show_progress: bool = False, lora: LoraSpec | None = None) -> list[str]:
    model, report = build_graph(ckpt, spec, calib.importance if calib else None, calib.hessians if calib else None,
                                show_progress=show_progress, lora=lora)
    onnx.save_model(model, str(out / wire.GRAPH), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=wire.GRAPH_DATA, size_threshold=1024)
    return report


def encode(tokenizer_json: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json).encode(text, add_special_tokens=False).ids


def _files(root: Path) -> dict[str, wire.FileEntry]:
    """Every file but the bundle's own manifest (a carried draft's manifest is one of its files)."""
    return {p.relative_to(root).as_posix(): wire.FileEntry(sha256=file_sha256(p), size_bytes=p.stat().st_size)
            for p in sorted(root.rglob("*")) if p.is_file() and p.relative_to(root).as_posix() != wire.MANIFEST}


def _version(spec: QuantSpec, files: dict[str, wire.FileEntry]) -> str:
    digest = hashlib.sha256(json.dumps({k: v.sha256 for k, v in files.items()}, sort_keys=True).encode()).hexdigest()
    settings = "" if spec.precision == "fp32" else f"-b{spec.block_size}{'' if spec.symmetric else 'a'}"
    return f"{spec.precision}{settings}{'-src' if spec.keep_source_quant else ''}-{digest[:8]}"


MIN_TEXT_TOKENS = 2  # what a calibration or evaluation text needs at least (a next-token prediction)


STALE = re.compile(r"\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)(?:-ref)?")  # what builds leave beside out


def _remove_stale(out: Path) -> None:
    """Delete the temporary folders of earlier builds in out's folder whose process is gone (SIGKILLed, the
    power cut): each holds up to a whole bundle (514 MB for SmolLM2 during GPTQ), and nothing else would ever
    remove them. Any output's, not only out's: those of builds killed with other --out names would pile up."""
    for p in out.parent.glob(".*.*-*"):
        m = STALE.fullmatch(p.name)
        if m is None or not p.is_dir() or _alive(int(m["pid"])):
            continue
        their_out = p.with_name(m["name"])
        if m["kind"] == "old" and not their_out.exists():
            continue  # a build stopped between its two renames: this is the only copy of the bundle
        if _held(p.with_name(f".{m['name']}.partial-{m['pid']}")):
            continue  # a build that runs in another PID namespace (a container sharing the folder)
        shutil.rmtree(p, ignore_errors=True)


def _hold(directory: Path) -> int:
    """Mark a build's folder as in use for as long as the returned descriptor is open (see _held)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _held(directory: Path) -> bool:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _check_replaceable(out: Path, force: bool) -> None:
    """An existing output may be replaced only with force, and only if it is a bundle or an empty folder:
    `--out bundles --force` (the sub-folder forgotten) deleted every bundle and file in bundles/."""
    if not force:
        raise PackageError(f"{out} already exists (use --force to replace it)")
    if os.path.ismount(out):  # refused up front: renaming it aside fails (EBUSY), after the whole build ran
        raise PackageError(f"{out} is a mount point, which cannot be replaced: use a folder inside it as --out")
    if out.is_symlink() or not out.is_dir() or not ((out / wire.MANIFEST).is_file() or not any(out.iterdir())):
        raise PackageError(f"{out} exists and is not a model bundle: --force replaces only a bundle (or an empty "
                           f"folder); choose another --out")


def _temporary_names(out: Path) -> list[str]:
    """The folders a build of out makes beside it (see STALE): their names must fit in the file system."""
    pid = os.getpid()
    return [f".{out.name}.partial-{pid}-ref", f".{out.name}.old-{pid}"]


def check_destination(out: Path, force: bool) -> None:
    """Refuse an output the build could not write, before any work is done: an existing out must be replaceable
    (_check_replaceable), the nearest folder on its path that exists must be a directory this process may write
    (the build creates the rest), and the temporary names beside out must fit. Errors name --out, never the
    hidden temporary folder the build would have failed on, after converting the whole source."""
    if out.exists() or out.is_symlink():
        _check_replaceable(out, force)
    existing = out.parent
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PackageError(f"--out {out}: {existing} is {file_kind(existing) or 'a link to nothing'}, "
                           "not a directory")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise PackageError(f"--out {out}: {existing} is on a read-only file system")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PackageError(f"--out {out}: {existing} is not writable by this user")
    name_max = os.pathconf(existing, "PC_NAME_MAX")
    longest = max(len(os.fsencode(n)) for n in _temporary_names(out))
    if longest > name_max:
        raise PackageError(f"--out {out}: the name is too long: the build's temporary folders beside it add "
                           f"{longest - len(os.fsencode(out.name))} bytes to it, and the file system allows {name_max}")


@contextlib.contextmanager
def _errors_name_out(out: Path, tmp: Path):
    """An OSError about the build's hidden folders (a full disk, say) becomes a PackageError naming --out."""
    try:
        yield
    except OSError as e:
        where = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else ""
        if not where.startswith(str(tmp)):
            raise
        raise PackageError(f"--out {out}: the bundle could not be written ({e.strerror or e})") from e


def _replace_dir(tmp: Path, out: Path, force: bool) -> None:
    """Rename tmp onto out; an existing out (force) is moved aside first and removed after. Checked again
    here: an output that appeared while the build ran (another build, a user) is not ours to replace."""
    if out.exists() or out.is_symlink():
        if not force:
            raise PackageError(f"{out} appeared while the bundle was being built (use --force to replace it)")
        _check_replaceable(out, force)
    # synced (a power cut after the build leaves no empty weight file); a replaced bundle goes aside first
    durable.replace_tree(tmp, out, out.with_name(f".{out.name}.old-{os.getpid()}"))


def build_bundle(ckpt: Checkpoint, spec: QuantSpec, out: Path, *, name: str, force: bool = False,
                 eval_text: str | None = None, calibration_text: str | None = None, threads: int | None = None,
                 progress: Callable[[str], None] = print, show_progress: bool = False,
                 hessian_budget_mb: float = HESSIAN_BUDGET_MB, draft: Path | None = None,
                 lora: LoraSpec | None = None) -> Bundle:
    """Build, evaluate and write a bundle. A calibration text (never the eval text) weights INT4
    block search by activation importance and sets the int8 KV cache graph's scales (without one, the
    bundle has no int8 KV cache graph). draft: a bundle of the same tokenizer that the new one carries in
    wire.DRAFT_DIR for speculative decoding. With lora, the bundle is adapter-ready (quantize.lora)."""
    out = Path(out)
    if not re.fullmatch(wire.MODEL_NAME_PATTERN, name):
        raise PackageError(f"model name {name!r}: use 1-64 letters, digits and . _ + - (starting with a letter "
                           f"or digit), since it names directories and URLs")
    check_destination(out, force)
    check_tokenizer(ckpt)
    draft_bundle = check_draft(ckpt, Path(draft)) if draft is not None else None
    golden_tokens(ckpt, len(encode(ckpt.tokenizer.tokenizer_json, wire.SMOKE_PROMPT)))
    for what, text in (("calibration", calibration_text), ("evaluation", eval_text)):
        # an empty file turned calibration (GPTQ, the int8 KV graph) or the quality figures off without a word
        if text is not None and len(encode(ckpt.tokenizer.tokenizer_json, text)) < MIN_TEXT_TOKENS:
            raise PackageError(f"the {what} text has fewer than {MIN_TEXT_TOKENS} tokens")
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    with _errors_name_out(out, tmp):
        _remove_stale(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        held = _hold(tmp)
        try:
            calib_ids = encode(ckpt.tokenizer.tokenizer_json, calibration_text) if calibration_text else None
            _write_contents(ckpt, spec, tmp, name, eval_text, calib_ids, threads, progress, show_progress,
                            hessian_budget_mb, draft_bundle, lora)
            for p in tmp.rglob("*"):  # onnx writes the weights 0600: an agent or artifact server running as
                if p.is_file():       # another user than the builder could not read them
                    p.chmod(0o644)
            _replace_dir(tmp, out, force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(tmp.with_name(tmp.name + "-ref"), ignore_errors=True)
            os.close(held)
    return open_bundle(out)


def check_draft(ckpt: Checkpoint, path: Path) -> Bundle:
    """The draft a new bundle will carry: verified, of the model's tokenizer (its guesses are token ids), and
    without a draft of its own."""
    try:
        draft = open_bundle(path)
    except BundleError as e:
        raise PackageError(f"--draft {path}: {e}") from None
    if draft.manifest.draft is not None:
        raise PackageError(f"--draft {path}: {draft.label} carries a draft model itself; give its own draft instead")
    if not same_tokenizer(draft.tokenizer_json(), ckpt.tokenizer.tokenizer_json):
        raise PackageError(f"--draft {path}: {draft.label} has another tokenizer than the model; speculative "
                           "decoding needs the same one")
    return draft


def _copy_bundle(bundle: Bundle, dest: Path) -> None:
    """The bundle's manifest and the files it lists (nothing else in its folder), into dest."""
    for rel in [wire.MANIFEST, *bundle.manifest.files]:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle.path / rel, target)


def check_tokenizer(ckpt: Checkpoint) -> None:
    """Load the tokenizer and chat template as the agent will, so that a bundle the device cannot load (a
    template that does not compile, BOS required but missing) is refused here rather than there."""
    try:
        TextTokenizer(ckpt.tokenizer.tokenizer_json, ckpt.tokenizer)
    except ValueError as e:
        raise PackageError(f"the checkpoint's tokenizer would not load on the device: {e}") from e


def golden_tokens(ckpt: Checkpoint, prompt_tokens: int) -> int:
    """Tokens of the golden continuation: GOLDEN_TOKENS, fewer when the context cannot hold them after the
    smoke prompt (generating past the context, as a 32-token one would, fails inside ONNX Runtime), never
    fewer than an update's health check reads (MIN_GOLDEN_TOKENS)."""
    n = min(GOLDEN_TOKENS, ckpt.geometry.context_length - prompt_tokens)
    if n < MIN_GOLDEN_TOKENS:
        raise PackageError(f"context_length {ckpt.geometry.context_length} is too small: the bundle's smoke test "
                           f"needs {prompt_tokens + MIN_GOLDEN_TOKENS} tokens ({prompt_tokens} of prompt, "
                           f"{MIN_GOLDEN_TOKENS} generated)")
    return n


def _write_contents(ckpt, spec, tmp, name, eval_text, calib_ids, threads, progress, show_progress,
                    hessian_budget_mb, draft: Bundle | None = None, lora: LoraSpec | None = None) -> None:
    # For INT8, importance-weighted search alone measured worse (mean KL 0.0059 vs 0.0040 without),
    # its error being dominated by the int8 activations; GPTQ still helped (0.0040 -> 0.0037)
    if calib_ids and (spec.method == "gptq" or (spec.precision == "int4" and spec.method == "search")):
        progress("measuring activation statistics over the calibration text")
        # its fp32 graph inside the build's folder, which the next build removes: in $TMPDIR, a SIGKILLed build
        # (the OOM killer) would leave it there for good (1.5 GB at SmolLM2-360M's size)
        with calibration(ckpt, calib_ids, with_hessians=spec.method == "gptq", threads=threads, work_dir=tmp,
                         hessian_budget_mb=hessian_budget_mb) as calib:
            progress(f"building {spec.precision} graph")
            report = write_graph(ckpt, spec, tmp, calib, show_progress, lora)
        if calib.hessians.passes > 1:
            progress(f"GPTQ's Hessians took {calib.hessians.passes} passes over the calibration text "
                     f"(--hessian-memory-mb {hessian_budget_mb})")
        # The Hessians (GBs past 1B parameters) end with the with block, not with this function: held any
        # longer, they would stay through the KV calibration, the fp32 reference graph and evaluation
    else:
        progress(f"building {spec.precision} graph")
        report = write_graph(ckpt, spec, tmp, None, show_progress, lora)
    (tmp / "quant_report.txt").write_text("\n".join(report) + "\n")
    (tmp / wire.TOKENIZER).write_text(ckpt.tokenizer.tokenizer_json)
    # Fields at their defaults are left out: those are the ones added after the first agents (attention_bias,
    # sliding_window, rope_freq_factors), whose schema forbids unknown keys: written as null, they would fail
    # every bundle's verification after the download.
    config = model_config(ckpt, spec, name)
    (tmp / wire.MODEL_CONFIG).write_text(config.model_dump_json(indent=2, exclude_defaults=True))
    unverified = Bundle(tmp, None, wire.ModelConfig.read(tmp))  # type: ignore[arg-type]
    runner = open_runner(unverified, threads)
    if calib_ids:
        progress("calibrating the int8 KV cache's scales")
        absmax = kv_absmax(runner, calib_ids, ckpt.geometry.context_length, ckpt.tokenizer.prompt_bos)
        onnx.save_model(int8_kv_graph(tmp / wire.GRAPH, absmax), str(tmp / wire.GRAPH_INT8_KV))
    progress("recording the golden greedy continuation")
    prompt_ids = encode(ckpt.tokenizer.tokenizer_json, wire.SMOKE_PROMPT)
    golden = wire.Golden(prompt=wire.SMOKE_PROMPT, prompt_ids=prompt_ids,
                         continuation_ids=greedy(runner, prompt_ids, golden_tokens(ckpt, len(prompt_ids))))
    quality = None
    if eval_text and spec.head_vocab:
        progress(f"no quality figures: a draft head's logits cover {spec.head_vocab} of {ckpt.geometry.vocab_size} "
                 "tokens, and the comparison is over all of them")
    elif eval_text:
        quality = _evaluate(ckpt, spec, runner, tmp, eval_text, threads, progress)
    del runner
    if draft is not None:
        progress(f"adding the draft model {draft.label}")
        _copy_bundle(draft, tmp / wire.DRAFT_DIR)
    files = _files(tmp)
    manifest = wire.Manifest(
        name=name, version=_version(spec, files), precision=spec.precision, quant=spec.model_dump(),
        source_sha256=ckpt.source_sha256, source_name=ckpt.source_name,
        created_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        files=files, quality=quality, golden=golden,
        draft=None if draft is None else wire.DraftRef(name=draft.manifest.name, version=draft.manifest.version),
        lora=lora.capacity() if lora else None, parameters=parameters(ckpt))
    (tmp / wire.MANIFEST).write_text(manifest.model_dump_json(indent=2))


def parameters(ckpt: Checkpoint) -> wire.Parameters | None:
    """A Mixture of Experts' total and active parameter counts for its manifest; None for a dense model (left
    out of the manifest, whose bytes stay what they were)."""
    if not ckpt.geometry.num_experts:
        return None
    total, active = parameter_counts(ckpt.geometry)
    return wire.Parameters(total=total, active=active)


def _evaluate(ckpt, spec, runner, tmp, eval_text, threads, progress) -> wire.Quality:
    """Quality against an fp32 graph of the same checkpoint, built beside the bundle and removed after."""
    ids = encode(ckpt.tokenizer.tokenizer_json, eval_text)
    if spec.precision == "fp32":
        progress(f"evaluating perplexity over {len(ids)} tokens")
        return compare(runner, runner, ids, eval_text, ckpt.geometry.context_length, ckpt.tokenizer.prompt_bos)
    ref_dir = tmp.with_name(tmp.name + "-ref")
    ref_dir.mkdir()
    progress("building the fp32 reference graph for evaluation")
    write_graph(ckpt, QuantSpec(), ref_dir)
    c = wire.ModelConfig.read(tmp)
    from agent.engine.runner import ModelRunner

    reference = ModelRunner(ref_dir / wire.GRAPH, c.num_layers, c.num_kv_heads, c.head_dim, threads)
    progress(f"evaluating against fp32 over {len(ids)} tokens")
    return compare(runner, reference, ids, eval_text, ckpt.geometry.context_length, ckpt.tokenizer.prompt_bos)
