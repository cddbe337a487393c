"""Serving many requests through the engine: batching equals sequential, prefix-cache hits are exact, chunked
prefill, the memory budget under load, cancel and preemption."""
from __future__ import annotations

import numpy as np
import pytest

from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.request import RequestError
from agent.engine.kv_cache import KVPool
from agent.engine.memory import SizeClass
from agent.engine.sampling_params import SamplingParams
from agent.engine.sequence import Status
from batching import GREEDY, run_together
from quantize.package import build_bundle
from quantize.precision import QuantSpec


@pytest.fixture(scope="module")
def tiny_bundle(tiny_varied_checkpoint, tmp_path_factory):
    return build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path_factory.mktemp("sched") / "fp32", name="tiny",
                        progress=lambda s: None)


def count_prefilled(engine: Engine) -> list[int]:
    """Wrap the runner so the test sees how many new tokens each call computed."""
    counts, forward = [], engine.runner.forward

    def counting(input_ids, seqlens_k, query_seqlens, *a, **kw):
        counts.append(int(np.asarray(query_seqlens).sum()))
        return forward(input_ids, seqlens_k, query_seqlens, *a, **kw)

    engine.runner.forward = counting
    return counts


def test_prefix_cache_hit_is_exact_and_computes_only_the_suffix(tiny_bundle):
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=32))
    rng = np.random.default_rng(0)
    system = rng.integers(3, 260, 100).tolist()  # a shared "system prompt" of 100 tokens
    a, b = system + [11, 12, 13], system + [21, 22, 23, 24, 25]
    cold = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=32,
                                            prefix_cache_fraction=0.0))
    expected = cold.generate(b, SamplingParams(max_tokens=12, **GREEDY)).token_ids
    engine.generate(a, SamplingParams(max_tokens=4, **GREEDY))  # warms the cache with `system`'s blocks
    counts = count_prefilled(engine)
    out = engine.generate(b, SamplingParams(max_tokens=12, **GREEDY))
    assert out.token_ids == expected
    cached = out.figures.cached_prompt_tokens
    assert cached == 96  # six full 16-token blocks of the shared 100 tokens
    prefill_tokens = sum(counts) - 11  # the 11 decode steps compute one token each
    assert prefill_tokens == len(b) - cached
    assert engine.prefix_cache_hit_ratio() > 0


def record_logits(monkeypatch) -> list[tuple[object, np.ndarray]]:
    """(the request's generator, the logits row) of every token the engine samples, in order."""
    import agent.engine.step

    seen, sample = [], agent.engine.step.sample_with_logprobs

    def recording(logits, params, prompt_ids, output_ids, rng, constraint=None):
        seen.append((rng, np.array(logits, copy=True)))
        return sample(logits, params, prompt_ids, output_ids, rng, constraint)

    monkeypatch.setattr(agent.engine.step, "sample_with_logprobs", recording)
    return seen


@pytest.mark.parametrize("length,chunk", [(81, 32), (33, 32), (33, 64), (49, 64), (65, 64), (70, 32)])
def test_a_prefix_hit_gives_the_cold_runs_logits_bit_for_bit(tiny_bundle, monkeypatch, length, chunk):
    """ONNX Runtime rounds a step's last row apart when the step's width leaves it alone in a tile (one token,
    or 33 and 65 on this model), so no prefix hit and no chunk leaves such a step: a hit gives the cold run's
    logits to the last bit, and greedy text cannot flip at near-ties."""
    config = dict(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=chunk)
    prompt = np.random.default_rng(length).integers(3, 260, length).tolist()
    seen = record_logits(monkeypatch)
    cold = Engine(tiny_bundle, EngineConfig(**config, prefix_cache_fraction=0.0))
    expected = cold.generate(prompt, SamplingParams(max_tokens=3, **GREEDY)).token_ids
    cold_logits = seen[:]
    warm = Engine(tiny_bundle, EngineConfig(**config))
    warm.generate(prompt[:-1] + [1, 2], SamplingParams(max_tokens=1, **GREEDY))  # caches the blocks before the end
    del seen[:]
    hit = warm.generate(prompt, SamplingParams(max_tokens=3, **GREEDY))
    assert hit.figures.cached_prompt_tokens > 0 and hit.token_ids == expected
    assert len(seen) == len(cold_logits) == 3
    for (_, got), (_, want) in zip(seen, cold_logits):
        np.testing.assert_array_equal(got, want)


def test_a_prompt_sharing_the_prefill_budget_gets_the_logits_it_gets_alone(tiny_bundle, monkeypatch):
    """Two prompts sharing a step's prefill budget (40 and 25 tokens, 32 a step) never leave the second one
    token for a step of its own (whose logits would differ from the request alone in the last bits)."""
    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=32,
                          prefix_cache_fraction=0.0)
    rng = np.random.default_rng(7)
    a, b = rng.integers(3, 260, 40).tolist(), rng.integers(3, 260, 25).tolist()
    seen = record_logits(monkeypatch)
    alone = Engine(tiny_bundle, config).generate(b, SamplingParams(max_tokens=3, **GREEDY)).token_ids
    alone_logits = seen[:]
    del seen[:]
    engine = Engine(tiny_bundle, config)
    ha = engine.submit(a, SamplingParams(max_tokens=3, **GREEDY))
    hb = engine.submit(b, SamplingParams(max_tokens=3, **GREEDY))
    while not (ha.seq.is_finished and hb.seq.is_finished):
        engine.step()
    assert hb.result().token_ids == alone
    b_logits = [row for rng, row in seen if rng is hb.seq.rng]
    for (_, want), got in zip(alone_logits, b_logits, strict=True):
        np.testing.assert_array_equal(got, want)


def test_chunks_deep_into_a_long_prompt_shrink_while_others_decode(tiny_bundle):
    """While others decode, a chunk's width falls as its attention's share of the step grows (on one core a
    full chunk 7,800 tokens into a prompt takes 0.75 s, which every running stream would wait for each
    token); alone, a prompt takes whole chunks. Either way the text is what the request gets alone."""
    from agent.engine.scheduler import attention_tokens

    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=64,
                          prefix_cache_fraction=0.0)
    k = attention_tokens(tiny_bundle.config)
    assert k < 250  # this tiny model's context (256) reaches past it
    prompt = np.random.default_rng(5).integers(3, 260, 240).tolist()
    widths, alone = [], Engine(tiny_bundle, config)
    forward = alone.runner.forward
    alone.runner.forward = lambda ids, sk, qs, *a, **kw: (widths.append(int(max(qs))),
                                                          forward(ids, sk, qs, *a, **kw))[1]
    expected = alone.generate(prompt, SamplingParams(max_tokens=4, **GREEDY)).token_ids
    assert widths[:3] == [64] * 3  # whole chunks (240 = 3 x 64 + 48)
    engine = Engine(tiny_bundle, config)
    other = engine.submit([5, 6, 7], SamplingParams(max_tokens=400, **GREEDY))
    while other.seq.status is not Status.DECODING:
        engine.step()
    chunks, forward = [], engine.runner.forward

    def recording(ids, sk, qs, *a, **kw):
        i = int(np.argmax(qs))
        if qs[i] > 1:  # a prefill call (the decoding request runs in a call of its own): the chunk's position
            chunks.append((int(sk[i]) + 1 - int(qs[i]), int(qs[i])))  # and width
        return forward(ids, sk, qs, *a, **kw)

    engine.runner.forward = recording
    long = engine.submit(prompt, SamplingParams(max_tokens=4, **GREEDY))
    while not long.seq.is_finished:
        engine.step()
    assert long.result().token_ids == expected
    assert chunks[0] == (0, 64) and sum(w for _, w in chunks) == 240
    for position, width in chunks[:-1]:  # the last one is what was left
        assert width <= max(16, 64 / (1 + position / k)) and width >= min(16, 240 - position) - 1, chunks
    widths = [w for _, w in chunks[:-1]]
    assert widths == sorted(widths, reverse=True) and widths[-1] <= 64 // 2  # 64, 48, 41, 36, 32 here
    other.cancel()


def test_prefix_hit_from_a_running_sequence_is_exact_and_never_held_twice(tiny_bundle):
    """Blocks are indexed in the slot that computed them, and move to the store only when it leaves."""
    config = dict(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=32)
    engine = Engine(tiny_bundle, EngineConfig(**config))
    cold = Engine(tiny_bundle, EngineConfig(**config, prefix_cache_fraction=0.0))
    system = np.random.default_rng(3).integers(3, 260, 100).tolist()
    a, b = system + [11, 12, 13], system + [21, 22, 23, 24, 25]
    expected = [cold.generate(p, SamplingParams(max_tokens=n, **GREEDY)).token_ids for p, n in ((a, 40), (b, 12))]
    first = engine.submit(a, SamplingParams(max_tokens=40, **GREEDY))
    while first.seq.status is not Status.DECODING:
        engine.step()
    store = engine.prefix
    assert len(store.index) == 6 and len(store.free) == store.num_blocks  # indexed where they are, not copied
    second = engine.submit(b, SamplingParams(max_tokens=12, **GREEDY))
    while engine.step():
        pass
    results = [first.result(), second.result()]
    assert [r.token_ids for r in results] == expected
    assert results[1].figures.cached_prompt_tokens == 96  # copied from the running sequence's slot
    assert all(isinstance(where, int) for where, _ in store.index.values())  # moved to the store on finish
    assert store.num_blocks - len(store.free) == 6
    assert not any(buf[:2].any() for p in engine.kv.classes for buf in p.keys + p.values)  # slots' pages released


def test_small_budget_sixteen_concurrent_requests(tiny_bundle):
    """Few slots, a short queue: the rest are refused as overloaded, every admitted request finishes."""
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, max_context=256, min_context=64,
                                              kv_smallest_class=256, max_queue=4, prefix_cache_fraction=0.0))
    slots = sum(p.num_slots for p in engine.kv.classes)
    handles, refused = [], 0  # the loop starts after the burst, so exactly max_queue requests wait
    rng = np.random.default_rng(1)
    for _ in range(16):
        try:
            handles.append(engine.submit(rng.integers(3, 260, 30).tolist(), SamplingParams(max_tokens=40, **GREEDY)))
        except RequestError as e:
            assert e.code == "overloaded"
            refused += 1
    engine.start()
    results = [h.result() for h in handles]
    engine.stop()
    assert all(r.figures.finish_reason == "length" and r.figures.completion_tokens == 40 for r in results)
    assert len(handles) == 4 and refused == 12
    assert engine.num_running == 0 and engine.kv.utilization() == 0.0
    print(f"slots {slots}, admitted {len(handles)}, refused {refused}")


LOAD_SCRIPT = """
import sys, numpy as np
from agent.engine.bundle import open_bundle
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.process import peak_rss_bytes
from agent.engine.sampling_params import SamplingParams
budget = int(sys.argv[2])
engine = Engine(open_bundle(sys.argv[1]), EngineConfig(threads=2, memory_budget_mb=budget, min_context=64))
engine.start()
rng = np.random.default_rng(2)
hs = [engine.submit(rng.integers(3, 260, 50).tolist(), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
      for _ in range(16)]
done = sum(h.result().figures.completion_tokens == 30 for h in hs)
engine.stop()
print(done, peak_rss_bytes())
"""


def test_peak_rss_stays_within_budget_under_16_requests(tiny_bundle):
    """In a fresh process (this one holds other tests' models), so the peak RSS is the engine's own."""
    import subprocess
    import sys

    budget_mb = 300
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tiny_bundle.path), str(budget_mb)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    done, peak = map(int, out.stdout.split())
    print(f"16 requests done: {done}, peak RSS {peak / 2**20:.0f} MB of a {budget_mb} MB budget")
    assert done == 16 and peak <= budget_mb << 20


def test_cancel_frees_the_slot(tiny_bundle):
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    h = engine.submit(list(range(5, 25)), SamplingParams(max_tokens=200, **GREEDY))
    for _ in range(5):
        engine.step()
    assert engine.num_running == 1
    h.cancel()
    engine.step()
    assert engine.num_running == 0 and h.result().figures.finish_reason == "cancelled"


@pytest.mark.real_model
def test_real_model_concurrent_equals_sequential(real_fp32_bundle):
    engine = Engine(real_fp32_bundle, EngineConfig(threads=2, memory_budget_mb=16000, max_context=1024))
    tok = engine.tokenizer
    questions = ["What is 2 + 2?", "Name a color.", "Say hello in French.", "What is the largest ocean?"]
    ps = [tok.encode(tok.render_chat([{"role": "user", "content": q}])) for q in questions]
    alone = [engine.generate(p, SamplingParams(max_tokens=16, **GREEDY)).token_ids for p in ps]
    results = run_together(engine, ps, 16)
    assert [r.token_ids for r in results] == alone


def test_a_slot_moved_when_another_finishes_keeps_the_kv_of_this_step(tiny_bundle):
    """A finished sequence's slot is refilled by the last one, which must bring the token this step wrote."""
    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefix_cache_fraction=0.0)
    engine, alone = Engine(tiny_bundle, config), Engine(tiny_bundle, config)
    rng = np.random.default_rng(4)
    ps = [rng.integers(3, 260, 10).tolist() for _ in range(3)]
    hs = [engine.submit(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(ps, (5, 20, 20))]
    while not hs[0].seq.is_finished:
        engine.step()
    moved = hs[2].seq
    pool = engine.kv.where[moved.seq_id]
    assert pool.slot_of(moved.seq_id) == 0  # it took the finished one's slot
    ref = alone.submit(ps[2], SamplingParams(max_tokens=20, **GREEDY))
    while ref.seq.num_computed < moved.num_computed:
        alone.step()
    ref_pool, n = alone.kv.where[ref.seq.seq_id], moved.num_computed
    for buf, ref_buf in zip(pool.keys + pool.values, ref_pool.keys + ref_pool.values):
        np.testing.assert_allclose(buf[0, :, :n], ref_buf[ref_pool.slot_of(ref.seq.seq_id), :, :n], atol=1e-4)


def test_preempted_requests_recompute_and_equal_solo_runs(tiny_bundle):
    """Three requests that outgrow small slots share one large one: preemptions happen, outputs are unchanged."""
    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64)
    engine = Engine(tiny_bundle, config)
    g = tiny_bundle.config
    engine.kv = engine.scheduler.kv = engine.prefix.kv = KVPool([SizeClass(64, 3), SizeClass(256, 1)], g.num_layers,
                                                                g.num_kv_heads, g.head_dim)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 260, n).tolist() for n in (30, 20, 40)]  # no common prefix
    results = run_together(engine, prompts, max_tokens=90)
    assert engine.num_running == 0 and engine.kv.utilization() == 0.0
    assert sum(r.figures.preemptions for r in results) >= 1
    # a readmission reloads its own retired blocks: that is no prefix-cache hit in the figures
    assert all(r.figures.cached_prompt_tokens == 0 for r in results) and engine.prefix_cache_hit_ratio() == 0.0
    solo = Engine(tiny_bundle, config.model_copy(update={"prefix_cache_fraction": 0.0}))
    for p, r in zip(prompts, results):
        alone = solo.generate(p, SamplingParams(max_tokens=90, **GREEDY))
        assert r.token_ids == alone.token_ids and r.figures.finish_reason == "length"
    print("preemptions per request:", [r.figures.preemptions for r in results])
