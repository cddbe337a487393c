"""A bundle that carries its draft model (edge-quantize build --draft): one manifest and one verification cover
both, the agent drafts with it when speculative is "draft", and a draft of another tokenizer is refused."""
from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from agent import wire
from agent.config import EngineConfig
from agent.engine.bundle import BundleError, open_bundle
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams
from agent.service import lifecycle
from batching import GREEDY
from quantize.package import PackageError, build_bundle
from quantize.precision import QuantSpec

CFG = dict(threads=2, memory_budget_mb=16000, min_context=64)


@pytest.fixture(scope="module")
def draft(tiny_varied_checkpoint, tmp_path_factory):
    spec = QuantSpec(precision="int8", method="rtn", block_size=16, block_sizes={})
    return build_bundle(tiny_varied_checkpoint, spec, tmp_path_factory.mktemp("pair") / "draft", name="tiny-draft",
                        progress=lambda s: None)


@pytest.fixture(scope="module")
def pair(tiny_varied_checkpoint, draft, tmp_path_factory):
    return build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path_factory.mktemp("pair") / "target", name="tiny",
                        progress=lambda s: None, draft=draft.path)


def test_the_pair_is_one_manifest_over_both_bundles(pair, draft):
    m = pair.manifest
    assert m.draft == wire.DraftRef(name="tiny-draft", version=draft.manifest.version)
    assert {f"{wire.DRAFT_DIR}/{rel}" for rel in [wire.MANIFEST, *draft.manifest.files]} <= set(m.files)
    assert json.loads((pair.path / wire.MANIFEST).read_text())["draft"]["version"] == draft.manifest.version
    assert "draft" not in json.loads((draft.path / wire.MANIFEST).read_text())  # unset: left out, as before
    carried = pair.draft()
    assert (carried.manifest.name, carried.manifest.version) == ("tiny-draft", draft.manifest.version)


def test_a_changed_draft_file_fails_the_pairs_verification(pair, tmp_path):
    copy_ = tmp_path / "pair"
    shutil.copytree(pair.path, copy_)
    weights = copy_ / wire.DRAFT_DIR / wire.GRAPH_DATA
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=f"{wire.DRAFT_DIR}/{wire.GRAPH_DATA} does not match its sha256"):
        open_bundle(copy_)


def test_the_agent_drafts_with_the_carried_model_and_keeps_the_targets_output(pair):
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 40, 41, 5, 17]
    plain = lifecycle.load_engine(pair.path, EngineConfig(**CFG))
    spec = lifecycle.load_engine(pair.path, EngineConfig(speculative="draft", **CFG))
    try:
        assert plain.draft is None  # loaded only for speculative = "draft": its weights and KV cost memory
        assert spec.draft is not None and spec.draft.bundle.manifest.name == "tiny-draft"
        want = plain.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))
        got = spec.generate(prompt, SamplingParams(max_tokens=30, **GREEDY))
        assert got.token_ids == want.token_ids and got.figures.drafted_tokens > 0
    finally:
        plain.stop(), spec.stop()


def test_a_bundle_without_a_draft_cannot_run_speculative_draft(draft):
    with pytest.raises(ValueError, match=r"needs a draft model: tiny-draft@\S+ carries none"):
        Engine(draft, EngineConfig(speculative="draft", **CFG))


def test_a_draft_of_another_tokenizer_is_refused_before_anything_is_built(tiny_varied_checkpoint, draft, tmp_path):
    document = json.loads(tiny_varied_checkpoint.tokenizer.tokenizer_json)
    vocab = document["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped: another tokenizer, as valid as the first
    other = copy.copy(tiny_varied_checkpoint)
    other.tokenizer = dataclasses.replace(other.tokenizer, tokenizer_json=json.dumps(document))
    with pytest.raises(PackageError, match="has another tokenizer than the model"):
        build_bundle(other, QuantSpec(), tmp_path / "out", name="tiny", progress=lambda s: None, draft=draft.path)
    assert not (tmp_path / "out").exists()


def test_a_draft_that_carries_a_draft_is_refused(tiny_varied_checkpoint, pair, tmp_path):
    with pytest.raises(PackageError, match="carries a draft model itself"):
        build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path / "out", name="tiny", progress=lambda s: None,
                     draft=pair.path)


def test_the_cli_builds_a_pair_and_refuses_a_missing_draft_in_one_line(tiny_gguf, draft, tmp_path):
    def build(*args):
        return subprocess.run([sys.executable, "-m", "quantize.cli", "build", str(tiny_gguf), "--precision",
                               "fp32", "--no-eval", *map(str, args)], capture_output=True, text=True, timeout=300)

    r = build("--out", tmp_path / "pair", "--draft", draft.path)
    assert r.returncode == 0 and f"draft model: tiny-draft@{draft.manifest.version} (in draft/)" in r.stdout, r.stderr
    r = build("--out", tmp_path / "none", "--draft", tmp_path / "missing")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "--draft" in r.stderr, r.stderr
    assert not (tmp_path / "none").exists()


def test_a_pair_over_the_budget_is_refused_naming_both_models(pair):
    from agent.engine.memory import MemoryBudgetError

    with pytest.raises(MemoryBudgetError, match=r"too small for tiny@\S+ with its draft tiny-draft@\S+ \(\d+ MB of it "
                                                r"loaded\): it needs at least \d+ MB"):
        lifecycle.load_engine(pair.path, EngineConfig(threads=2, memory_budget_mb=64, min_context=64,
                                                      speculative="draft"))
