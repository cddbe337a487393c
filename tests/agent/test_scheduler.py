"""The scheduler's policy, pure: admission order by priority and age, preemption, slot growth and the prefill budget
shared by cost; no engine."""
from __future__ import annotations

import time

import numpy as np
import pytest

from agent.engine.kv_cache import KVPool
from agent.api.openai_models import PRIORITY_RANGE
from agent.engine.memory import SizeClass
from agent.engine.sampling_params import SamplingParams
from agent.engine.scheduler import AGING_S, Scheduler
from agent.engine.sequence import FinishReason, Sequence, Status


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
