"""LoRA adapters served by the engine: loaded only when verified and fitting the base (and the budget), chosen per
request, and batched: a step mixing the base and two adapters gives each request the logits it gets alone."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from agent import wire
from agent.config import EngineConfig
from agent.engine.adapters import AdapterError, check_adapter
from agent.engine.engine import Engine
from agent.engine.memory import MB, MemoryBudgetError, plan_with_adapters
from agent.engine.request import RequestError
from agent.engine.sampling_params import SamplingParams
from agent.engine.step import Stepper
from batching import GREEDY
from lora_support import bundle_with_adapters
from quantize.package import build_bundle
from quantize.precision import QuantSpec

CONFIG = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=16)


@pytest.fixture(scope="module")
def served(tiny_varied_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return (root, *bundle_with_adapters(tiny_varied_checkpoint, root))


@pytest.fixture(scope="module")
def engine(served):
    _, bundle, folders = served
    return Engine(bundle, CONFIG, adapters=folders)


def recording(monkeypatch) -> dict[int, list[np.ndarray]]:
    """Every logits row the engine samples from, by sequence id."""
    seen: dict[int, list[np.ndarray]] = {}
    sample = Stepper._sample

    def record(self, seq, logits):
        seen.setdefault(seq.seq_id, []).append(logits.copy())
        return sample(self, seq, logits)
    monkeypatch.setattr(Stepper, "_sample", record)
    return seen


def run(engine: Engine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> list:
    handles = [engine.submit(p, SamplingParams(max_tokens=max_tokens, **GREEDY), adapter=a)
               for p, a in zip(prompts, adapters)]
    while any(not h.seq.is_finished for h in handles):
        engine.step()
    return handles


def logits_of(engine, monkeypatch, prompts, adapters, max_tokens=12) -> list[np.ndarray]:
    """Run the prompts together, each with its adapter: each one's sampled logits rows [max_tokens, V]."""
    seen = recording(monkeypatch)
    return [np.array(seen[h.seq.seq_id]) for h in run(engine, prompts, adapters, max_tokens)]


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


def test_a_batch_mixing_adapters_gives_each_request_its_logits_alone(engine, monkeypatch):
    """Bit for bit against the request run alone for the base's rows; an adapter's rows equal a batch of the same
    size in which every row uses that adapter bit for bit, and the request alone to ~1e-5. Measured: alone and in
    a batch the base's rows are equal, the adapters' differ by up to 7.5e-5 (logits ~5) whether the batch mixes
    adapters or not: the LoRA branch's MatMuls take A and B as inputs, not constants, and ONNX Runtime (1.32, CPU)
    rounds such a product's one-row form differently from a several-row one (a lone MatMul, B an input: row 0 of
    [1, 64] x [64, 4] and of [4, 64] x [64, 4] differ by 9.5e-7, by 0.0 with B a constant)."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 260, n).tolist() for n in (9, 20, 14, 11)]
    adapters = [None, "a1", "a2", "a1"]
    mixed = logits_of(engine, monkeypatch, prompts, adapters)
    alone = [logits_of(engine, monkeypatch, [p], [a])[0] for p, a in zip(prompts, adapters)]
    same = {a: logits_of(engine, monkeypatch, prompts, [a] * 4) for a in ("a1", "a2")}
    assert np.array_equal(bits(mixed[0]), bits(alone[0]))
    for i, a in enumerate(adapters[1:], 1):
        assert np.array_equal(bits(mixed[i]), bits(same[a][i]))
        assert np.array_equal(bits(mixed[i][0]), bits(alone[i][0]))  # the prompt's own step: one row either way
        assert np.abs(mixed[i] - alone[i]).max() < 3e-4
    # the adapters change the model, so the comparisons above can fail: the same prompt under each gives other logits
    base, a1, a2 = (logits_of(engine, monkeypatch, [prompts[1]], [a], 1)[0][0] for a in (None, "a1", "a2"))
    assert np.abs(base - a1).max() > 0.1 and np.abs(base - a2).max() > 0.1 and np.abs(a1 - a2).max() > 0.1


def test_the_prefix_cache_keeps_each_adapters_kv_apart(engine, monkeypatch):
    """A prompt cached under the base is not reused for an adapter's request (its KV differs): each gets the logits
    of a cold run."""
    prompt = np.random.default_rng(8).integers(3, 260, 3 * CONFIG.prefix_block_tokens + 5).tolist()
    seen = recording(monkeypatch)
    first = [seen[run(engine, [prompt], [a], 2)[0].seq.seq_id] for a in (None, "a1")]
    again = [run(engine, [prompt], [a], 2)[0] for a in (None, "a1")]
    assert all(h.seq.cached_prompt_tokens > 0 for h in again)  # each hit its own adapter's blocks
    for f, h in zip(first, again):
        assert np.array_equal(np.array(f), np.array(seen[h.seq.seq_id]))


def test_an_unknown_adapter_is_refused_naming_those_served(engine):
    with pytest.raises(RequestError, match="no adapter 'nope'.*a1, a2") as e:
        engine.submit([5, 6, 7], SamplingParams(max_tokens=2), adapter="nope")
    assert e.value.code == "model_not_found"


def _copy(folder, to, **manifest):
    shutil.copytree(folder, to)
    path = to / wire.ADAPTER_MANIFEST
    path.write_text(json.dumps(json.loads(path.read_text()) | manifest))
    return to


@pytest.mark.parametrize("change, words", [
    (dict(base_version="int4-other"), ["is for tiny@int4-other", "not tiny@"]),
    (dict(base_name="other"), ["is for other@"]),
    (dict(rank=9), ["rank 9", "maximum of 8"]),
    (dict(ranks={"q": 4, "k": 4}, rank=4), []),  # a manifest may name fewer targets: the tensors decide
])
def test_an_adapter_that_does_not_fit_the_base_is_refused_naming_what_differs(served, tmp_path, change, words):
    _, bundle, folders = served
    folder = _copy(folders["a1"], tmp_path / "a", **change)
    if not words:
        assert check_adapter("x", folder, bundle).manifest.rank == 4
        return
    with pytest.raises(AdapterError) as e:
        check_adapter("x", folder, bundle)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_tampered_or_missing_adapter_is_refused_before_it_is_read(served, tmp_path):
    _, bundle, folders = served
    folder = _copy(folders["a1"], tmp_path / "a")
    data = bytearray((folder / wire.ADAPTER_FILE).read_bytes())
    data[-1] ^= 1
    (folder / wire.ADAPTER_FILE).write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="does not match its sha256"):
        check_adapter("x", folder, bundle)
    with pytest.raises(AdapterError, match="not an adapter"):
        check_adapter("x", tmp_path, bundle)
    with pytest.raises(AdapterError, match="adapter name 'a:b'"):
        check_adapter("a:b", folders["a1"], bundle)


def test_a_plain_bundle_takes_no_adapter(served, tiny_varied_checkpoint, tmp_path):
    _, ready, folders = served
    plain = build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path / "plain", name="tiny", progress=lambda s: None)
    folder = _copy(folders["a1"], tmp_path / "a", base_version=plain.manifest.version)
    with pytest.raises(AdapterError, match="takes no adapters"):
        Engine(plain, CONFIG, adapters={"a1": folder})


def test_an_adapter_past_the_budget_is_refused_at_load_by_name():
    config = EngineConfig(memory_budget_mb=100, min_context=64, prefix_cache_fraction=0.0)
    per_token = 1000
    plan_with_adapters(config, 64, 90 * MB, per_token, per_token, "m", {"a": 4 * MB})  # fits
    with pytest.raises(MemoryBudgetError, match=r"adapter 'b' \(8.0 MB\) does not fit memory_budget_mb=100.*"
                                                r"before it \(4.0 MB\)"):
        plan_with_adapters(config, 64, 90 * MB, per_token, per_token, "m", {"a": 4 * MB, "b": 8 * MB})
    with pytest.raises(MemoryBudgetError, match="too small for m"):  # the model alone does not fit: its own error
        plan_with_adapters(config, 64, 101 * MB, per_token, per_token, "m", {"a": 4 * MB})


def test_adapters_take_their_bytes_from_the_kv_budget(engine):
    held = sum(a.tensors.nbytes for a in engine.adapters.values())
    assert 0 < held <= sum(a.nbytes for a in engine.adapters.values())  # what was counted: the file, tensors + header
    kv = engine.kv.nbytes + (engine.prefix.nbytes if engine.prefix else 0)
    assert kv <= CONFIG.memory_budget_mb * MB - engine.baseline_bytes - held


def test_on_the_real_model_mixing_adapters_in_a_batch_changes_no_row(real_checkpoint, tmp_path, monkeypatch):
    """SmolLM2 INT4 (the GGUF's own blocks) adapter-ready on all seven projections, two random rank-8 adapters: in
    a batch of base, a1, a2 and a1 requests each row's logits equal, bit for bit, those of a batch of the same size
    whose every row uses that row's adapter, and the base row those of its request alone. An adapter row alone
    decodes one row, which the LoRA MatMuls round apart from several (the tiny model's test), and here the INT4
    MatMulNBits quantize their input rows to int8, so that a 1e-5 difference can flip a rounding: only its prompt
    row is bit for bit (measured with bench/lora.py's rank-8 adapter: decode logits alone and in a batch of 2
    apart by up to 1.04 on logits up to 38; the base's 0.0)."""
    from lora_support import ALL, write_peft
    from quantize.adapter import convert
    from quantize.lora import LoraSpec
    from quantize.package import build_bundle
    from quantize.peft import read_peft
    from quantize.precision import QuantSpec

    bundle = build_bundle(real_checkpoint, QuantSpec(precision="int4", keep_source_quant=True), tmp_path / "q4",
                          name="smollm2", lora=LoraSpec(targets=ALL, max_rank=8), progress=lambda s: None)
    g, folders = real_checkpoint.geometry, {}
    for name, seed in (("a1", 1), ("a2", 2)):
        peft = read_peft(write_peft(tmp_path / f"peft-{name}", g, targets=ALL, r=8, alpha=16, seed=seed))
        convert(peft, bundle, tmp_path / name, name=name, progress=lambda s: None)
        folders[name] = tmp_path / name
    engine = Engine(bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=256, prefill_chunk_tokens=64),
                    adapters=folders)
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "Write a haiku about the sea:",
                                                     "def fibonacci(n):", "Three rivers of Europe are")]
    adapters = [None, "a1", "a2", "a1"]
    mixed = logits_of(engine, monkeypatch, prompts, adapters, 8)
    same = {a: logits_of(engine, monkeypatch, prompts, [a] * 4, 8) for a in (None, "a1", "a2")}
    alone = [logits_of(engine, monkeypatch, [p], [a], 8)[0] for p, a in zip(prompts, adapters)]
    for i, a in enumerate(adapters):
        assert np.array_equal(bits(mixed[i]), bits(same[a][i])), (i, a, float(np.abs(mixed[i] - same[a][i]).max()))
        if a is None:
            assert np.array_equal(bits(mixed[i]), bits(alone[i])), float(np.abs(mixed[i] - alone[i]).max())
        assert np.array_equal(bits(mixed[i][0]), bits(alone[i][0]))
    assert np.abs(same[None][1] - same["a1"][1]).max() > 0.1  # the adapters change the model: this test can fail


def test_speculative_steps_verify_with_each_requests_adapter(served):
    """Prompt lookup proposes tokens without the adapter; verification runs each row with its own: greedy output
    is the plain decode's, in a mixed batch too."""
    _, bundle, folders = served
    spec = Engine(bundle, CONFIG.model_copy(update={"speculative": "ngram", "speculative_max_batch": 4}), adapters=folders)
    rng = np.random.default_rng(9)
    prompts = [(rng.integers(3, 260, 6).tolist() * 4)[:n] for n in (20, 17, 23)]  # repeats: lookup finds drafts
    adapters = [None, "a1", "a2"]
    plain = [h.result().token_ids for h in run(Engine(bundle, CONFIG, adapters=folders), prompts, adapters, 16)]
    results = [h.result() for h in run(spec, prompts, adapters, 16)]
    assert [r.token_ids for r in results] == plain
    assert sum(r.figures.drafted_tokens for r in results) > 0  # drafts were verified: the test can fail


def test_an_adapter_is_bound_again_on_the_bindings_of_a_rebuilt_session(engine, monkeypatch):
    """spin_wait "auto" rebuilds the session, and with it every cache's binding: the adapter is bound on the new
    one. (Its record of what a binding holds is by address, and a new binding can reuse a freed one's: the runner
    forgets the record of every new binding, a case this test does not force.)"""
    import agent.engine.runner as runner_module

    prompt = [5, 17, 33, 60, 7, 99, 120, 8, 4]
    before = logits_of(engine, monkeypatch, [prompt], ["a1"], 4)[0]
    runner = engine.runner
    monkeypatch.setattr(runner, "spin_wait", "auto")
    monkeypatch.setattr(runner_module, "choose_spinning", lambda spin_wait, threads: not runner.spinning)
    assert runner.recheck_spinning()
    after = logits_of(engine, monkeypatch, [prompt], ["a1"], 4)[0]
    base = logits_of(engine, monkeypatch, [prompt], [None], 4)[0]
    assert np.array_equal(bits(before), bits(after)) and np.abs(after - base).max() > 0.1
