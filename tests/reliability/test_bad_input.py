"""Bad input everywhere (part of the reliability suite): mutated GGUF files and mutated bundle manifests.
Each case must end in the one clear error type of its boundary (CheckpointError / BundleError), never
another exception, a crash or a hang. The figures (cases run) are printed."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.engine.bundle import BundleError, open_bundle
from quantize.checkpoint import CheckpointError, load_checkpoint
from quantize.package import build_bundle
from quantize.precision import QuantSpec
from tiny import write_tiny_llama

CASES = 1000
COUNT = {"gguf": 0, "manifest": 0}


ORIGINAL: dict[str, bytes] = {}  # not a fixture argument: hypothesis would print 100 kB with every failure


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    path = write_tiny_llama(tmp_path_factory.mktemp("fz") / "t.gguf", hidden=32, heads=2, kv_heads=1,
                            intermediate=64, layers=1)
    ORIGINAL["gguf"] = path.read_bytes()
    return path.name


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 4095), st.integers(1, 255)),  # header and metadata area
    st.tuples(st.just("cut"), st.integers(0, 100_000), st.just(0)),
    st.tuples(st.just("zero"), st.integers(0, 4095), st.integers(1, 64)),
)


def mutate(data: bytes, op) -> bytes:
    kind, at, arg = op
    b = bytearray(data)
    if not b:
        return data
    at = at % len(b)
    if kind == "flip":
        b[at] ^= arg
    elif kind == "cut":
        del b[at:]
    else:
        b[at:at + arg] = bytes(min(arg, len(b) - at))
    return bytes(b)


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_gguf_is_a_clear_error_or_a_valid_model(gguf_file, tmp_path, ops):
    data = ORIGINAL["gguf"]
    for op in ops:
        data = mutate(data, op)
    path = tmp_path / "m.gguf"
    path.write_bytes(data)
    COUNT["gguf"] += 1
    try:
        load_checkpoint(path)  # some mutations leave a valid file (e.g. a flipped weight byte)
    except CheckpointError:
        pass


@pytest.fixture(scope="module")
def bundle_dir(tiny_checkpoint, tmp_path_factory) -> Path:
    return build_bundle(tiny_checkpoint, QuantSpec(), tmp_path_factory.mktemp("fzb") / "b", name="tiny",
                        progress=lambda s: None).path


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                           max_leaves=8)


@settings(max_examples=CASES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.lists(st.sampled_from(["files", "golden", "quality", "name", "version", "model.onnx",
                                      "sha256", "size_bytes", "schema_version", "../x", "/etc/passwd"]),
                     min_size=1, max_size=3), value=json_values, raw=st.booleans(), cut=st.integers(0, 5000))
def test_mutated_manifest_is_a_clear_error(bundle_dir, tmp_path, path, value, raw, cut):
    copy = tmp_path / "b"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(bundle_dir, copy, symlinks=True)
    manifest = copy / "manifest.json"
    if raw:
        manifest.write_bytes(manifest.read_bytes()[:cut])
    else:
        doc = json.loads(manifest.read_text())
        node = doc
        for key in path[:-1]:
            node = node.setdefault(key, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[path[-1]] = value
        manifest.write_text(json.dumps(doc))
    COUNT["manifest"] += 1
    try:
        open_bundle(copy)
    except BundleError:
        pass


def test_report_case_counts(figures):
    figures.append(f"bad input: {COUNT['gguf']} mutated GGUF files, {COUNT['manifest']} mutated manifests, "
                   "each a CheckpointError/BundleError, no crash")
    assert COUNT["gguf"] >= CASES and COUNT["manifest"] >= CASES
