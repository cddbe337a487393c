"""Serving many requests: batching equals sequential, prefix-cache reuse, admission control, fairness."""
from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.request import RequestError
from agent.engine.kv_cache import KVPool
from agent.api.openai_models import PRIORITY_RANGE
from agent.engine.memory import SizeClass
from agent.engine.prefix_cache import PrefixCache
from agent.engine.sampling_params import SamplingParams
from agent.engine.scheduler import AGING_S, Scheduler
from agent.engine.sequence import FinishReason, Sequence, Status
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


def test_prompts_deep_in_share_a_steps_budget_by_cost():
    """The 16-token floor goes to the first prefilling sequence only: given to every one, a fresh prompt's 100
    tokens plus 16 more of a prompt 7,800 tokens deep would cost 174 of a 128 budget."""
    from types import SimpleNamespace

    def seq(status: Status, prompt: int, computed: int) -> SimpleNamespace:
        return SimpleNamespace(status=status, num_computed=computed, num_uncomputed=prompt - computed,
                               seq_id=len(scheduler.running))

    pool = object()
    scheduler = Scheduler(SimpleNamespace(classes=[pool], where={}), 128, attention_tokens=2150)
    scheduler.running.append(seq(Status.DECODING, 10, 10))
    scheduler.kv.where[0] = pool

    def plan(*prefilling: tuple[int, int]) -> list[tuple[int, int]]:
        del scheduler.running[1:]
        scheduler.running.extend(seq(Status.PREFILLING, p, c) for p, c in prefilling)
        return [(s.num_computed, n) for s, n in scheduler.plan().prefills]

    def cost(chunks) -> float:
        return sum(n * (1 + at / 2150) for at, n in chunks)

    chunks = plan((100, 0), (8000, 7800))
    assert chunks[0] == (0, 100) and cost(chunks) <= 128, chunks  # the deep one: 28 left is worth 7 tokens
    chunks = plan((8000, 7800), (8000, 7800))
    # the floor goes to the first only
    assert chunks[0][1] >= 16 and cost(chunks) <= max(128, 16 * (1 + 7800 / 2150)) + 1, chunks
    assert plan((8000, 7800)) == [(7800, 27)]  # 128 / (1 + 7800 / 2150)
    scheduler.running[:] = [seq(Status.PREFILLING, 8000, 7800)]  # nothing decodes: whole chunks
    assert [n for _, n in scheduler.plan().prefills] == [128]


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


def make_seq(tokens: int, priority: int = 0, t_submit: float | None = None, prompt: int = 4) -> Sequence:
    """A sequence of `prompt` tokens that may reach `tokens` in all."""
    s = Sequence([1] * prompt, SamplingParams(max_tokens=tokens - prompt), np.random.default_rng(0), tokens,
                 priority=priority)
    if t_submit is not None:
        s.t_submit = t_submit
    return s


def test_fcfs_within_priority_and_aging():
    kv = KVPool([SizeClass(64, 1)], num_layers=1, kv_heads=1, head_dim=4)
    sched = Scheduler(kv, 16)
    now = time.perf_counter()
    old_low = make_seq(32, priority=1, t_submit=now - 2 * AGING_S - 1)  # aged two levels: effectively -1
    new_high = make_seq(32, priority=0, t_submit=now)
    sched.add(new_high)
    sched.add(old_low)
    assert sched.admit() == [old_low]


def test_a_preempted_request_goes_first_once_overdue_whatever_the_priorities():
    """Priorities span 2^32 levels, aging gains one level per AGING_S and a preempted request is never refused
    as overloaded, so a stream of higher-priority arrivals could keep it waiting for ever: once it was
    submitted more than max_queue_wait_s ago it goes first."""
    lowest, highest = PRIORITY_RANGE[1], PRIORITY_RANGE[0]
    kv = KVPool([SizeClass(32, 1)], num_layers=1, kv_heads=1, head_dim=2)
    sched = Scheduler(kv, 16, max_queue_wait_s=5.0)
    now = time.perf_counter()
    low = make_seq(30, priority=lowest, t_submit=now - 4.0, prompt=6)
    low.admit()
    low.preempt()  # as grow() leaves it: waiting again, admitted once
    sched.add(low)
    urgent = make_seq(30, priority=highest, t_submit=now)
    sched.add(urgent)
    assert sched.admit() == [urgent]  # within the maximum wait, priority decides
    sched.finish(urgent, FinishReason.STOP)
    low.t_submit = now - 6.0  # as if two more seconds had passed
    later = make_seq(30, priority=highest, t_submit=time.perf_counter())
    sched.add(later)
    assert sched.admit() == [low] and later in sched.waiting


def test_a_blocked_head_is_never_overtaken_for_its_slot():
    kv = KVPool([SizeClass(64, 2), SizeClass(512, 1)], num_layers=1, kv_heads=1, head_dim=4)
    sched = Scheduler(kv, 16)
    big_running = make_seq(450, prompt=400)
    sched.add(big_running)
    assert sched.admit() == [big_running]
    big_waiting, small, medium = make_seq(350, prompt=300), make_seq(50, prompt=40), make_seq(63, prompt=60)
    for s in (big_waiting, small, medium):
        sched.add(s)
    # the 512 slot is busy: the big head waits; small requests use the 64 class, which the head cannot use
    assert sched.admit() == [small, medium]
    sched.finish(big_running, FinishReason.STOP)
    assert sched.admit() == [big_waiting] and big_waiting.status is Status.PREFILLING


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


def test_block_keys_are_sha256_chained_over_the_tokens():
    """Python's hash() is not seeded for ints, so keys chained with it would let a crafted prompt collide with
    another client's prefix and be served its KV. A key is SHA-256 over its parent's and its tokens."""
    kv = KVPool([SizeClass(64, 1)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(4, 16, kv, num_layers=1, kv_heads=1, head_dim=4)
    keys = [key for key, _ in cache._chain(list(range(40)), 2)]
    first = hashlib.sha256(np.arange(16, dtype=np.int64).tobytes()).digest()
    assert keys == [first, hashlib.sha256(first + np.arange(16, 32, dtype=np.int64).tobytes()).digest()]


def serve_through_cache(kv: KVPool, cache: PrefixCache, seq_id: int, prompt: list[int]) -> int:
    """One request as the engine runs it, as far as the prefix cache sees: load its cached prefix, "prefill"
    the rest (position p holds the token at p), index and retire its blocks, free its slot. Returns the hit."""
    pool = kv.allocate(seq_id, 128)
    slot = pool.slot_of(seq_id)
    hit = cache.load(prompt, pool, slot)
    for buf in pool.keys + pool.values:  # "prefill" the rest: position p holds the token at p
        buf[slot, 0, hit:len(prompt)] = np.array(prompt[hit:], np.float32)[:, None]
    cache.store(seq_id, prompt)
    cache.retire(seq_id, pool)
    kv.free(seq_id)
    return hit


def test_retiring_never_evicts_its_own_chain_to_store_its_tail():
    """A full store drops a prompt's last blocks rather than evicting its first ones (which would orphan all)."""
    kv = KVPool([SizeClass(128, 3)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(5, 16, kv, num_layers=1, kv_heads=1, head_dim=4)
    system = list(range(100, 164))  # 4 blocks
    b = system + list(range(200, 232)) + [2]  # 6 blocks and one token

    def run(seq_id: int, prompt: list[int]) -> int:
        return serve_through_cache(kv, cache, seq_id, prompt)

    assert run(1, system + [1]) == 0
    assert run(2, b) == 64  # the 4 system blocks; its 2 own blocks fit 1 free store block: the last is dropped
    pool = kv.allocate(3, 128)
    assert cache.load(b, pool, pool.slot_of(3)) == 80  # the whole stored chain is still reachable
    assert np.array_equal(pool.keys[0][pool.slot_of(3), 0, :80, 0], np.array(b[:80], np.float32))


def test_eviction_takes_a_chains_tail_before_its_head():
    """A chain's blocks are touched tail to head, so the tail of a stored chat is evicted first: evicting its
    head would leave the rest unreachable (a block matches only after its parents) while they held the
    store, and chats taking turns would get no hits at all."""
    kv = KVPool([SizeClass(128, 2)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(8, 4, kv, num_layers=1, kv_heads=1, head_dim=4)

    def run(seq_id: int, prompt: list[int]) -> int:
        return serve_through_cache(kv, cache, seq_id, prompt)

    chat_a, chat_b = list(range(100, 132)), list(range(500, 508))  # 8 blocks (the whole store), 2 blocks
    assert run(1, chat_a) == 0
    assert run(2, chat_b) == 0  # takes 2 store blocks: chat A's last two go
    assert run(3, chat_a + [1, 2, 3]) == 24  # A's first 6 blocks still hit
    pool = kv.allocate(4, 128)
    assert cache.load(chat_a + [9, 9], pool, pool.slot_of(4)) == 32  # and A's next turn stored its own again
    assert np.array_equal(pool.keys[0][pool.slot_of(4), 0, :32, 0], np.array(chat_a, np.float32))


def test_a_chain_cut_while_it_ran_stores_nothing_past_the_cut():
    """A request that hit a stored prefix runs on while other chats evict that prefix; when it retires, its own
    blocks after the gap (which nothing can reach) are not stored, so they evict no reachable block of
    another chat."""
    kv = KVPool([SizeClass(128, 4)], num_layers=1, kv_heads=1, head_dim=4)
    cache = PrefixCache(6, 4, kv, num_layers=1, kv_heads=1, head_dim=4)
    prefix = list(range(100, 108))  # 2 blocks
    assert serve_through_cache(kv, cache, 1, prefix + [1]) == 0
    running = prefix + list(range(300, 308)) + [2]  # hits the prefix, then 2 blocks of its own
    pool = kv.allocate(2, 128)
    slot = pool.slot_of(2)
    assert cache.load(running, pool, slot) == 8
    for buf in pool.keys + pool.values:
        buf[slot, 0, 8:len(running)] = np.array(running[8:], np.float32)[:, None]
    cache.store(2, running)
    chat_b, chat_c = list(range(500, 512)), list(range(600, 612))  # 3 blocks each: the prefix is evicted
    assert serve_through_cache(kv, cache, 3, chat_b + [3]) == 0
    assert serve_through_cache(kv, cache, 4, chat_c + [4]) == 0
    cache.retire(2, pool)
    kv.free(2)
    assert serve_through_cache(kv, cache, 5, chat_b + [5, 5]) == 12  # still whole
    assert serve_through_cache(kv, cache, 6, chat_c + [6, 6]) == 12


def test_retiring_lets_go_of_its_chains_stored_blocks_past_a_cut():
    """A chain's later block already stored (by another request sharing the prefix) is let go when its head
    finds no room: the store keeps no block nothing can reach."""
    kv = KVPool([SizeClass(64, 4)], num_layers=1, kv_heads=1, head_dim=2)
    cache = PrefixCache(1, 4, kv, num_layers=1, kv_heads=1, head_dim=2)  # a one-block store
    a, b, c = [1] * 4, [2] * 4, [3] * 4

    def start(seq_id: int, prompt: list[int]) -> int:
        pool = kv.allocate(seq_id, 64)
        hit = cache.load(prompt, pool, pool.slot_of(seq_id))
        pool.lengths[seq_id] = len(prompt)
        cache.store(seq_id, prompt)
        return hit

    def end(seq_id: int) -> None:
        cache.retire(seq_id, kv.where[seq_id])
        kv.free(seq_id)

    start(1, a + b + [9, 9])
    assert start(2, a + b + c + [9, 9]) == 8  # a and b from 1's slot; c in its own
    end(1)  # a to the store, b dropped: 2's chain is cut at b
    start(3, [5] * 4 + [9, 9])
    end(3)  # evicts a
    assert start(4, a + b + c + [9, 9]) == 0  # a and b computed again, c still in 2's slot
    end(2)  # c stored: its parents are in 4's slot
    end(4)  # a needs the block c holds: c goes (tail first), a is stored
    pool = kv.allocate(5, 64)
    assert cache.load(a + b + c + [9, 9], pool, pool.slot_of(5)) == 4


def decoding(sched: Scheduler, prompt: int, total: int, t_submit: float) -> Sequence:
    """Admit a sequence and mark its prompt computed, as the engine does before its first decode. t_submit:
    seconds from now (the queue order)."""
    seq = make_seq(total, prompt=prompt, t_submit=time.perf_counter() + t_submit)
    sched.add(seq)
    assert seq in sched.admit()
    seq.start_decoding()
    seq.num_computed = prompt
    sched.pool_of(seq).lengths[seq.seq_id] = prompt
    return seq


def fill_slot(sched: Scheduler, seq: Sequence) -> None:
    """Decode until the slot is full: position p of every layer holds p + seq_id / 10."""
    pool = sched.pool_of(seq)
    while seq.num_tokens <= pool.capacity:
        seq.append_token(1, 0.0)
    seq.num_computed = pool.capacity
    pool.lengths[seq.seq_id] = pool.capacity
    for buf in pool.keys + pool.values:
        buf[pool.slot_of(seq.seq_id), 0, :, 0] = np.arange(pool.capacity) + seq.seq_id / 10


def test_a_full_slot_moves_to_a_larger_class_with_its_kv():
    kv = KVPool([SizeClass(8, 2), SizeClass(32, 1)], num_layers=2, kv_heads=1, head_dim=2)
    sched = Scheduler(kv, 16)
    seq = decoding(sched, prompt=6, total=30, t_submit=0.0)
    assert sched.pool_of(seq).capacity == 8  # admitted by what it holds, not by what it may reach
    fill_slot(sched, seq)
    assert sched.grow() == []
    pool = sched.pool_of(seq)
    assert pool.capacity == 32 and kv.classes[0].num_free == 2
    for buf in pool.keys + pool.values:
        np.testing.assert_allclose(buf[pool.slot_of(seq.seq_id), 0, :8, 0], np.arange(8) + seq.seq_id / 10, rtol=1e-6)
    assert seq.kv_bytes == 32 * 2 * 2 * 2 * 4  # tokens x (keys, values) x layers x head_dim x float32


@pytest.mark.parametrize("older_grows", [True, False])
def test_no_larger_slot_free_preempts_the_last_come(older_grows):
    """The slot goes to the earlier request; the later one is preempted (requeued, its KV dropped), never failed."""
    kv = KVPool([SizeClass(8, 2), SizeClass(32, 1)], num_layers=1, kv_heads=1, head_dim=2)
    sched = Scheduler(kv, 16, max_queue_wait_s=0.001)
    old = decoding(sched, prompt=6, total=30, t_submit=1.0)
    new = decoding(sched, prompt=5, total=30, t_submit=2.0)
    first, second = (new, old) if older_grows else (old, new)
    fill_slot(sched, first)
    assert sched.grow() == [] and sched.pool_of(first).capacity == 32  # the large slot was free
    fill_slot(sched, second)
    assert sched.grow() == [new]
    assert new.status is Status.WAITING and new.preemptions == 1 and new.num_computed == 0 and new in sched.waiting
    assert sched.pool_of(old).capacity == 32 and new.seq_id not in kv.where and kv.classes[0].num_free == 2
    if older_grows:  # the old one took over the slot the new one held, with its own KV
        np.testing.assert_allclose(kv.classes[1].keys[0][0, 0, :8, 0], np.arange(8) + old.seq_id / 10, rtol=1e-6)
    time.sleep(0.01)  # past max_queue_wait_s: a preempted request still waits (it was admitted once)
    assert sched.admit() == []  # needs 14 tokens now: only the 32 class holds that, and it is busy
    assert new.status is Status.WAITING and new.finish_reason is None
    sched.finish(old, FinishReason.STOP)
    assert sched.admit() == [new] and sched.pool_of(new).capacity == 32 and new.output_ids


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


def test_growth_never_takes_the_slot_a_waiting_earlier_request_needs():
    """FCFS holds for moves too: a sequence that came after the queue's head gives way instead of taking its class."""
    kv = KVPool([SizeClass(8, 2), SizeClass(32, 1), SizeClass(128, 1)], num_layers=1, kv_heads=1, head_dim=2)
    sched = Scheduler(kv, 16)
    a = decoding(sched, prompt=20, total=120, t_submit=1.0)  # in the 32 slot
    d = decoding(sched, prompt=40, total=120, t_submit=2.0)  # in the 128 slot
    head = make_seq(120, prompt=20, t_submit=time.perf_counter() + 3.0)  # needs the 32 class: waits
    sched.add(head)
    assert sched.admit() == []
    b = decoding(sched, prompt=6, total=120, t_submit=4.0)  # an 8 slot (below the head's class)
    fill_slot(sched, a)
    fill_slot(sched, b)
    assert sched.grow() == [d, b]  # a takes d's 128 slot; b, behind the head, does not take the 32 one a left
    assert sched.pool_of(a).capacity == 128 and b.status is Status.WAITING
    assert sched.admit() == [head] and sched.pool_of(head).capacity == 32


def test_growth_preempts_the_holder_of_the_smallest_slot_that_fits():
    """Of the later holders of large-enough slots, the one with the least to recompute goes."""
    kv = KVPool([SizeClass(8, 1), SizeClass(32, 1), SizeClass(128, 1)], num_layers=1, kv_heads=1, head_dim=2)
    sched = Scheduler(kv, 16)
    g = decoding(sched, prompt=6, total=120, t_submit=1.0)
    v1 = decoding(sched, prompt=20, total=120, t_submit=2.0)
    v2 = decoding(sched, prompt=100, total=120, t_submit=3.0)  # later, but in the 128 class
    fill_slot(sched, g)
    assert sched.grow() == [v1] and sched.pool_of(g).capacity == 32 and sched.pool_of(v2).capacity == 128


def test_a_request_shed_or_cancelled_while_waiting_reports_its_whole_wait_as_queue_time():
    """A request never admitted counts its whole wait as queue_ms, so queue time reads highest, not lowest,
    when the device is saturated (a shed request that waited 1 s must not read queue_ms 0 and e2e_ms 1004)."""
    kv = KVPool([SizeClass(32, 1)], num_layers=1, kv_heads=1, head_dim=2)
    sched = Scheduler(kv, 16, max_queue_wait_s=0.5)
    now = time.perf_counter()
    holder = make_seq(30, t_submit=now)
    sched.add(holder)
    assert sched.admit() == [holder]  # the only slot is taken
    shed, gone = make_seq(30, t_submit=now - 1.0), make_seq(30, t_submit=now - 0.3)
    gone.cancelled = True
    sched.add(shed)
    sched.add(gone)
    assert sorted(s.seq_id for s in sched.admit()) == sorted([shed.seq_id, gone.seq_id])  # both leave the queue
    assert shed.finish_reason is FinishReason.ERROR and gone.finish_reason is FinishReason.CANCELLED
    assert 1000 <= shed.figures().queue_ms < 1500 and 300 <= gone.figures().queue_ms < 800
    assert holder.figures().queue_ms < 100  # admitted at once
