"""edge-quantize as a user runs it: build, inspect and eval on the tiny model, and one-line errors for bad input."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import write_tiny_llama

EVAL = "the quick brown fox jumps over the lazy dog, then the dog answers in kind. " * 6


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quantize.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_gguf):
    root = tmp_path_factory.mktemp("cli")
    text = root / "eval.txt"
    text.write_text(EVAL)
    for precision in ("fp32", "int4"):
        r = run("build", str(tiny_gguf), "--precision", precision, "--block-size", "16", "--eval-text", str(text),
                "--out", str(root / precision))
        assert r.returncode == 0, r.stderr
    return root, text


def test_build_writes_a_complete_bundle(built):
    root, _ = built
    names = {p.name for p in (root / "int4").iterdir()}
    assert {"manifest.json", "model.onnx", "model.onnx.data", "tokenizer.json", "model_config.json"} <= names
    assert not [p for p in root.iterdir() if p.name.startswith(".")], "temporary directories left behind"
    # every file readable by the agent and the artifact server, whoever built it (onnx wrote the weights 0600)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in (root / "int4").iterdir()} == {n: "0o644" for n in names}
    # what agents from before these fields read: found in review, "rope_freq_factors": null in every bundle made
    # them refuse it (their schema forbids unknown keys)
    assert not {"attention_bias", "sliding_window", "rope_freq_factors"} & json.loads(
        (root / "int4" / "model_config.json").read_text()).keys()


def test_inspect_and_eval_json(built):
    root, text = built
    r = run("inspect", str(root / "int4"), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["precision"] == "int4"
    r = run("eval", str(root / "int4"), "--reference", str(root / "fp32"), "--text", str(text), "--json")
    assert r.returncode == 0, r.stderr
    q = json.loads(r.stdout)
    assert {"mean_kl", "p99_kl", "top1_agreement", "perplexity", "reference_perplexity", "tokens"} <= q.keys()
    assert 0 <= q["top1_agreement"] <= 1 and q["mean_kl"] >= 0


def assert_one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for w in words:
        assert w in lines[0]


def test_eval_refuses_a_reference_that_is_not_the_same_models_fp32(built, tmp_path):
    """Found in review: any bundle was taken as the reference, and figures against another model printed."""
    root, text = built
    r = run("eval", str(root / "fp32"), "--reference", str(root / "int4"), "--text", str(text))
    assert_one_line_error(r, "--reference must be an fp32 bundle")
    other = tmp_path / "other"
    r = run("build", str(write_tiny_llama(tmp_path / "other.gguf", seed=9)), "--precision", "fp32", "--no-eval",
            "--out", str(other))
    assert r.returncode == 0, r.stderr
    r = run("eval", str(root / "int4"), "--reference", str(other), "--text", str(text))
    assert_one_line_error(r, "another checkpoint", "other.gguf")


def test_existing_output_is_refused_and_left_alone(built, tiny_gguf):
    root, _ = built
    before = (root / "fp32" / "manifest.json").read_bytes()
    assert_one_line_error(run("build", str(tiny_gguf), "--precision", "fp32", "--out", str(root / "fp32")), "exists")
    assert (root / "fp32" / "manifest.json").read_bytes() == before


def test_int8_layers_option(tmp_path, tiny_gguf):
    out = tmp_path / "int4"
    r = run("build", str(tiny_gguf), "--precision", "int4", "--block-size", "16", "--no-eval", "--int8-layers",
            "qkv:1,down:0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    report = (out / "quant_report.txt").read_text()
    assert "layers.1/attn/qkv_proj: int8" in report and "layers.0/mlp/down_proj: int8" in report
    assert "layers.0/attn/qkv_proj: int4" in report
    assert json.loads((out / "model_config.json").read_text())["quant"]["int4_int8_layers"] == {"qkv": [1], "down": [0]}
    assert_one_line_error(run("build", str(tiny_gguf), "--int8-layers", "mlp:3", "--out", str(tmp_path / "bad")),
                          "mlp:3")
    assert not (tmp_path / "bad").exists()


def test_truncated_gguf(tmp_path, tiny_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:3000])
    assert_one_line_error(run("build", str(cut), "--out", str(tmp_path / "out")), "cut.gguf")
    assert list(tmp_path.iterdir()) == [cut]


def test_unknown_architecture(tmp_path):
    path = write_tiny_llama(tmp_path / "neox.gguf", architecture="gptneox")
    assert_one_line_error(run("build", str(path), "--out", str(tmp_path / "out")), "gptneox")
    assert not (tmp_path / "out").exists()


def test_missing_source_and_bad_bundle(tmp_path):
    assert_one_line_error(run("build", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")), "nope.gguf")
    assert_one_line_error(run("inspect", str(tmp_path)), "not a model bundle")


def test_tampered_bundle_is_refused(built, tmp_path):

    root, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(root / "int4", copy)
    with open(copy / "model.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    assert_one_line_error(run("inspect", str(copy)), "sha256")


def test_calibration_writes_its_fp32_graph_inside_the_builds_folder(tiny_checkpoint, tmp_path, monkeypatch):
    """Found in review: a SIGKILLed build (the OOM killer) left the calibration's whole fp32 graph in $TMPDIR
    for good; inside the build's folder, the next build removes it with the folder."""
    import tempfile

    import quantize.calibrate
    from quantize.package import build_bundle
    from quantize.precision import QuantSpec

    made = []

    class Recorded(tempfile.TemporaryDirectory):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(Path(self.name))

    monkeypatch.setattr(quantize.calibrate.tempfile, "TemporaryDirectory", Recorded)
    build_bundle(tiny_checkpoint, QuantSpec(precision="int4", method="gptq"), tmp_path / "b", name="tiny",
                 calibration_text="the cat sat on the mat " * 20, progress=lambda s: None)
    assert made and all(p.parent.name.startswith(".b.partial-") for p in made), made
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_an_output_that_appears_during_the_build_is_not_replaced_without_force(tiny_checkpoint, tmp_path):
    """Found in review: the final rename replaced whatever had appeared at the output meanwhile (another build,
    a user's folder), --force or not; with --force, a file or link there left a .NAME.old-PID behind."""
    from quantize.package import PackageError, build_bundle
    from quantize.precision import QuantSpec

    out = tmp_path / "bundle"

    def someone_else_writes(_message: str) -> None:
        if not out.exists():
            out.mkdir()
            (out / "precious.txt").write_text("mine")

    with pytest.raises(PackageError, match="appeared while the bundle was being built"):
        build_bundle(tiny_checkpoint, QuantSpec(), out, name="tiny", progress=someone_else_writes)
    assert (out / "precious.txt").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["bundle"]
    build_bundle(tiny_checkpoint, QuantSpec(), out / "b", name="tiny", progress=lambda s: None)
    build_bundle(tiny_checkpoint, QuantSpec(), out / "b", name="tiny", force=True, progress=lambda s: None)
    assert sorted(p.name for p in out.iterdir()) == ["b", "precious.txt"]  # no .b.old-PID left


@pytest.mark.parametrize("what", ["a folder of bundles", "a file", "a link"])
def test_force_replaces_a_bundle_and_nothing_else(what, tiny_gguf, tmp_path):
    """Found in review: `build ... --out bundles --force`, the sub-folder forgotten, deleted every bundle and
    file in bundles/."""
    out = tmp_path / "out"
    if what == "a folder of bundles":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif what == "a file":
        out.write_text("mine")
    else:
        out.symlink_to(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    assert_one_line_error(run("build", str(tiny_gguf), "--out", str(out), "--force"),
                          "is not a model bundle")
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_a_model_name_that_is_not_one_path_and_url_segment_is_refused(tiny_gguf, tmp_path):
    """Found in review: --name '../../x' was published outside the fleet's artifacts directory, and 'a@b'
    could never be deployed (NAME@VERSION is split at its first '@'); --name '' silently meant the default."""
    for name in ("../../escaped", "we@ird", "", "a b"):
        assert_one_line_error(run("build", str(tiny_gguf), "--out", str(tmp_path / "o"), "--name", name),
                              "model name")
        assert not (tmp_path / "o").exists()


def test_a_chat_template_the_agent_cannot_compile_is_refused_at_build(tmp_path):
    """Found in review: the template was first compiled on the device, so such a bundle built and shipped
    and then could not load there."""
    path = write_tiny_llama(tmp_path / "t.gguf", extra=lambda w: w.add_chat_template("{% for m in messages %}"))
    assert_one_line_error(run("build", str(path), "--out", str(tmp_path / "out")), "chat template does not compile")
    assert not (tmp_path / "out").exists()


def test_a_context_too_small_for_the_smoke_test_is_refused_at_build(tmp_path):
    """Found in review: a 32-token context failed inside ONNX Runtime while recording the golden continuation."""
    path = write_tiny_llama(tmp_path / "t.gguf", context=32)
    assert_one_line_error(run("build", str(path), "--out", str(tmp_path / "out")), "context_length 32 is too small")
    assert not (tmp_path / "out").exists()


def test_a_build_removes_what_killed_builds_left_beside_its_output(tiny_gguf, tmp_path):
    """Found in review: a build SIGKILLed (or SIGTERMed, or cut by the power) left its .NAME.partial-PID folder,
    up to a whole bundle, for good."""
    import fcntl

    dead, alive, elsewhere = 999_999_999, os.getppid(), 999_999_998  # beyond any pid_max; surely running
    leftovers = [f".o.partial-{dead}", f".o.partial-{dead}-ref", f".o.old-{dead}", f".o.partial-{alive}",
                 f".o.partial-{elsewhere}", f".o.old-{elsewhere}"]
    for name in leftovers:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.onnx.data").write_bytes(b"\0" * 1024)
    (tmp_path / ".other.partial-999999999").mkdir()  # another output's killed build: found in review, they piled up
    (tmp_path / ".other.old-999999999").mkdir()  # with no "other": the only copy of that bundle
    (tmp_path / ".notes.partial-later").mkdir()  # not a build's name
    # a build in another PID namespace (its pid means nothing here) holds its folder, as every build does
    held = os.open(tmp_path / f".o.partial-{elsewhere}", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        r = run("build", str(tiny_gguf), "--out", str(tmp_path / "o"))
    finally:
        os.close(held)
    assert r.returncode == 0, r.stderr
    # .o.old-DEAD stays too: with no o, a build stopped between its two renames left the only copy there
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([
        f".o.old-{dead}", f".o.old-{elsewhere}", f".o.partial-{alive}", f".o.partial-{elsewhere}",
        ".other.old-999999999", ".notes.partial-later", "o"])
    r = run("build", str(tiny_gguf), "--out", str(tmp_path / "o"), "--force")  # now o exists: they go
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".o.partial-{alive}", ".other.old-999999999",
                                                                 ".notes.partial-later", "o"])


def test_a_mount_point_as_output_is_refused_before_the_build(tiny_gguf, tmp_path, monkeypatch):
    """Found in review: --out on a mount point (with --force) ran the whole build, then failed to rename it."""
    from quantize.package import PackageError, _check_replaceable

    (tmp_path / "mnt").mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(tmp_path / "mnt"))
    with pytest.raises(PackageError, match="is a mount point"):
        _check_replaceable(tmp_path / "mnt", force=True)


def test_thread_counts_out_of_range_are_refused(tiny_gguf, tmp_path):
    """Found in review: --threads 100000 grew to 17 GB within seconds; -3 was accepted silently."""
    for n in ("100000", "0", "-3"):
        r = run("build", str(tiny_gguf), "--out", str(tmp_path / "o"), "--threads", n)
        assert r.returncode == 2 and "--threads" in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("option", ["--calib-text", "--eval-text"])
def test_an_empty_calibration_or_evaluation_text_is_refused(option, tiny_gguf, tmp_path):
    """Found in review: an empty --calib-text quietly built without GPTQ and without the int8 KV cache graph
    (the manifest still said gptq), and an empty --eval-text quietly left out the quality figures."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_one_line_error(run("build", str(tiny_gguf), "--out", str(tmp_path / "o"), option, str(empty)),
                          "text has fewer than 2 tokens")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags, words", [
    (["--int8-layers", "qkv:999"], "the model has layers 0-1"),
    (["--int8-layers", "qkv:1", "--precision", "int8"], "applies to --precision int4 only"),
])
def test_int8_layers_that_cannot_apply_are_refused(flags, words, tiny_gguf, tmp_path):
    """Found in review: both were accepted and did nothing."""
    assert_one_line_error(run("build", str(tiny_gguf), "--out", str(tmp_path / "o"), *flags), words)


def test_a_text_file_that_is_not_utf8_is_named(tiny_gguf, tmp_path):
    """Found in review: "'utf-8' codec can't decode byte 0xff in position 4", naming no file."""
    bad = tmp_path / "calib.txt"
    bad.write_bytes(b"abc \xff def")
    assert_one_line_error(run("build", str(tiny_gguf), "--out", str(tmp_path / "o"), "--calib-text", str(bad)),
                          f"{bad}: not UTF-8 text")


def test_an_onnxruntime_too_old_for_the_graphs_is_named(tiny_gguf, tmp_path):
    """Found in review: the declared floor was 1.22, but every graph gives GroupQueryAttention query_seqlens,
    which 1.31 and older refuse with a schema error about input counts, printed as an internal error."""
    code = ("import sys, onnxruntime; onnxruntime.__version__ = '1.31.1'; import quantize.cli; "
            "sys.argv = ['edge-quantize', *sys.argv[1:]]; quantize.cli.main()")
    r = subprocess.run([sys.executable, "-c", code, "build", str(tiny_gguf), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=300)
    assert_one_line_error(r, "onnxruntime 1.31.1 is too old", "1.32 or newer")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("where", ["under a file", "deeper under a file", "a name too long"])
def test_an_output_that_cannot_be_written_is_refused_before_the_source_is_read(where, tiny_gguf, tmp_path):
    """Found by an outside probe: the whole source was converted first (minutes for a 1B model), then the build
    failed with a bare errno naming its hidden .NAME.partial-PID folder. (As root, a chmod 0o555 folder is
    writable; a file on the path is not, for anyone.)"""
    blocker = tmp_path / "file"
    blocker.write_text("mine")
    out, words = {
        "under a file": (blocker / "out", [f"{blocker} is a regular file, not a directory"]),
        "deeper under a file": (blocker / "a" / "out", [f"{blocker} is a regular file, not a directory"]),
        "a name too long": (tmp_path / ("x" * 240), ["the name is too long", "the file system allows 255"]),
    }[where]
    r = run("build", str(tiny_gguf), "--out", str(out))
    assert_one_line_error(r, f"--out {out}: ", *words)
    assert "reading" not in r.stdout and ".partial" not in r.stderr  # refused before the source was opened
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and blocker.read_text() == "mine"


def test_an_unwritable_or_read_only_destination_is_refused_by_name(tmp_path, monkeypatch):
    """What a non-root user's read-only folder and a read-only mount look like to check_destination (as root,
    neither can be made here)."""
    import types

    from quantize.package import PackageError, check_destination

    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(PackageError, match=f"^--out {tmp_path / 'a' / 'b'}: {tmp_path} is not writable by this user"):
        check_destination(tmp_path / "a" / "b", force=False)
    monkeypatch.setattr(os, "statvfs", lambda path: types.SimpleNamespace(f_flag=os.ST_RDONLY))
    with pytest.raises(PackageError, match=f"^--out {tmp_path / 'b'}: {tmp_path} is on a read-only file system"):
        check_destination(tmp_path / "b", force=False)


def test_a_write_that_fails_during_the_build_names_out_not_the_temporary_folder(tiny_checkpoint, tmp_path,
                                                                               monkeypatch):
    """Found by an outside probe: a full disk (or any failed write) was reported as a bare errno naming the
    hidden .NAME.partial-PID folder; the folder is removed, as after any failed build."""
    import errno

    import quantize.package
    from quantize.package import PackageError, build_bundle
    from quantize.precision import QuantSpec

    def disk_full(ckpt, spec, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder / "model.onnx.data"))

    monkeypatch.setattr(quantize.package, "write_graph", disk_full)
    out = tmp_path / "b"
    with pytest.raises(PackageError) as e:
        build_bundle(tiny_checkpoint, QuantSpec(), out, name="tiny", progress=lambda s: None)
    assert str(e.value) == f"--out {out}: the bundle could not be written (No space left on device)"
    assert list(tmp_path.iterdir()) == []


def test_build_of_a_device_or_pipe_says_what_it_is(tmp_path):
    """Found by an outside probe: `build /dev/zero` said "no such file or directory" of a file that exists."""
    assert_one_line_error(run("build", "/dev/zero", "--out", str(tmp_path / "o")),
                          "/dev/zero: not a regular file (a character device)")
    assert not (tmp_path / "o").exists()


def test_inspect_of_a_plain_file_is_one_clear_line(tmp_path):
    """Found by an outside probe: `inspect FILE` printed "[Errno 20] Not a directory: 'FILE/manifest.json'"."""
    plain = tmp_path / "model.gguf"
    plain.write_bytes(b"GGUF")
    r = run("inspect", str(plain))
    assert_one_line_error(r, f"{plain}: not a model bundle (it is a regular file; a bundle is a directory)")
    assert "Errno" not in r.stderr
    assert_one_line_error(run("inspect", str(tmp_path / "nope")), f"{tmp_path / 'nope'}: no such file or directory")


def test_a_chat_template_given_at_build_replaces_the_checkpoints(tiny_gguf, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<start_of_turn>{{ m['content'] }}<|im_end|>{% endfor %}")
    r = run("build", str(tiny_gguf), "--precision", "fp32", "--no-eval", "--chat-template", str(template),
            "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "out" / "model_config.json").read_text())["chat_template"] == template.read_text()
    template.write_text("{% for m in messages %}")
    assert_one_line_error(run("build", str(tiny_gguf), "--chat-template", str(template), "--out",
                              str(tmp_path / "bad")), "chat template does not compile")
