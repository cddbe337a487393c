"""The engine on real bundles: greedy output equals the numpy reference, batching changes nothing,
seeds reproduce, stop strings are honoured, and bad budgets / prompts get clear errors."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import reference
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.request import Finished, RequestError, TextDelta
from agent.engine.kv_cache import KVPool
from agent.engine.memory import MemoryBudgetError, SizeClass
from agent.engine.runner import open_runner
from agent.engine.sampling_params import SamplingParams
from batching import GREEDY, run_together
from quantize.package import build_bundle
from quantize.precision import QuantSpec


@pytest.fixture(scope="module")
def tiny_bundle(tiny_varied_checkpoint, tmp_path_factory):
    return build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path_factory.mktemp("eng") / "fp32", name="tiny",
                        progress=lambda s: None)


@pytest.fixture(scope="module")
def engine(tiny_bundle):
    return Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, prefill_chunk_tokens=16))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 260, int(rng.integers(5, 40))).tolist() for _ in range(n)]


def test_greedy_equals_numpy_reference_for_32_tokens(engine, tiny_varied_checkpoint):
    ids = prompts(1)[0]
    out = engine.generate(ids, SamplingParams(max_tokens=32, **GREEDY))
    assert out.token_ids == reference.greedy(tiny_varied_checkpoint, ids, 32)
    assert out.figures.completion_tokens == 32 and out.figures.finish_reason == "length"


def test_concurrent_requests_equal_one_at_a_time(engine):
    ps = prompts(6, seed=1)
    alone = [engine.generate(p, SamplingParams(max_tokens=20, **GREEDY)).token_ids for p in ps]
    results = run_together(engine, ps, 20)
    assert [r.token_ids for r in results] == alone


def test_in_place_cache_decode_equals_recompute(tiny_bundle):
    runner = open_runner(tiny_bundle, 2)
    ids = prompts(1, seed=2)[0] + [7, 8, 9, 10]
    n = len(ids)
    full = runner.forward(np.array([ids]), np.array([n - 1]), np.array([n]), np.arange(n)[None], runner.new_cache(1, 64))
    cache = runner.new_cache(1, 64)
    runner.forward(np.array([ids[:-4]]), np.array([n - 5]), np.array([n - 4]), np.array([[0]]), cache)
    for t in range(n - 4, n):
        step = runner.forward(np.array([[ids[t]]]), np.array([t]), np.array([1]), np.zeros((1, 1), np.int64), cache)
        np.testing.assert_allclose(step[0, 0], full[0, t], rtol=1e-4, atol=1e-4 * np.abs(full).max())


@pytest.fixture(scope="module")
def real_engine(real_fp32_bundle):
    return Engine(real_fp32_bundle, EngineConfig(threads=2, memory_budget_mb=16000, max_context=1024))


def chat(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.render_chat([{"role": "user", "content": text}]))


@pytest.mark.real_model
def test_real_model_greedy_equals_numpy_reference_for_16_tokens(real_engine, real_checkpoint):
    ids = chat(real_engine, "Name a large river in Europe.")
    out = real_engine.generate(ids, SamplingParams(max_tokens=16, **GREEDY))
    assert out.token_ids == reference.greedy(real_checkpoint, ids, 16)


@pytest.mark.real_model
def test_same_seed_same_text_and_different_seed_differs(real_engine):
    p = chat(real_engine, "Write a short poem about the sea.")
    params = dict(max_tokens=24, temperature=1.0, top_p=0.95, ignore_eos=True)
    a = real_engine.generate(p, SamplingParams(seed=7, **params)).text
    b = real_engine.generate(p, SamplingParams(seed=7, **params)).text
    c = real_engine.generate(p, SamplingParams(seed=8, **params)).text
    assert a == b and a != c


@pytest.mark.real_model
def test_stop_string_across_tokens_is_honoured_and_never_streamed(real_engine):
    p = chat(real_engine, "Explain in two sentences why the sky is blue.")
    free = real_engine.generate(p, SamplingParams(max_tokens=40, **GREEDY)).text
    assert len(free) > 30
    # a stop string that starts and ends inside tokens: "Rayleigh" -> "ayleig" style cut of the output
    stop = free[11:19]
    handle = real_engine.submit(p, SamplingParams(max_tokens=40, stop=[stop], **GREEDY))
    while not handle.seq.is_finished:
        real_engine.step()
    events = list(handle)
    streamed = "".join(e.text for e in events if isinstance(e, TextDelta))
    final = events[-1]
    assert isinstance(final, Finished) and final.figures.finish_reason == "stop"
    assert streamed == final.text == free[:free.index(stop)]
    assert stop not in streamed


def test_prompt_longer_than_context_is_refused_and_engine_keeps_serving(engine):
    with pytest.raises(RequestError, match="context") as e:
        engine.submit(list(range(3, 3 + 300)) * 2, SamplingParams(max_tokens=4))
    assert e.value.code == "context_length_exceeded"
    assert engine.generate(prompts(1)[0], SamplingParams(max_tokens=4, **GREEDY)).figures.completion_tokens == 4


def test_live_settings_reach_the_scheduler_through_the_engine_thread(tiny_bundle):
    """update_settings replaces the config at once; the scheduler's share is written by the engine thread while
    it runs (by the caller when it does not), and a request then waits no longer than the new limit."""
    from agent.engine.scheduler import Scheduler

    writers: list[threading.Thread] = []

    class Recording(Scheduler):
        def __setattr__(self, name, value):
            if name == "max_queue_wait_s":
                writers.append(threading.current_thread())
            super().__setattr__(name, value)

    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64), idle_wait_s=0.05)
    g = tiny_bundle.config  # one slot: a second request waits while the first runs
    engine.kv = engine.scheduler.kv = engine.prefix.kv = KVPool([SizeClass(256, 1)], g.num_layers, g.num_kv_heads,
                                                                g.head_dim)
    engine.scheduler.__class__ = Recording
    engine.update_settings({"max_queue_wait_s": 30.0})  # not running: applied by this call
    assert writers == [threading.current_thread()] and engine.scheduler.max_queue_wait_s == 30.0
    engine.start()
    try:
        running = engine.submit(prompts(1)[0], SamplingParams(max_tokens=200, **GREEDY))
        deadline = time.monotonic() + 10
        while engine.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        engine.update_settings({"max_queue_wait_s": 0.001})
        assert engine.config.max_queue_wait_s == 0.001  # the config at once
        while engine.scheduler.max_queue_wait_s != 0.001 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert engine.scheduler.max_queue_wait_s == 0.001 and writers[1:] == [engine._thread]
        shed = engine.submit(prompts(1, seed=3)[0], SamplingParams(max_tokens=5, **GREEDY))
        assert shed.result().error_code == "overloaded"  # it waited past the new limit behind the running one
        assert running.result().figures.finish_reason == "length"
    finally:
        engine.stop()


def test_stop_ends_every_request_it_holds_and_refuses_new_ones(tiny_bundle):
    """Running, admitted-but-waiting and not-yet-seen requests all get an 'unavailable' Finished: none hangs."""
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    g = tiny_bundle.config  # one slot: the second request waits in the scheduler's queue
    engine.kv = engine.scheduler.kv = engine.prefix.kv = KVPool([SizeClass(256, 1)], g.num_layers, g.num_kv_heads,
                                                                g.head_dim)
    running, waiting = (engine.submit(p, SamplingParams(max_tokens=50, **GREEDY)) for p in prompts(2))
    engine.step()
    inbox = engine.submit(prompts(1, seed=3)[0], SamplingParams(max_tokens=5, **GREEDY))
    assert engine.num_running == 1 and engine.num_waiting == 2  # one in the scheduler, one in the inbox
    engine.stop()
    for handle in (running, waiting, inbox):
        fin = next(ev for ev in iter(lambda: handle.events.get(timeout=10), None) if isinstance(ev, Finished))
        assert fin.figures.finish_reason == "error" and fin.error_code == "unavailable", fin
    assert engine.num_running == 0 and engine.num_waiting == 0 and engine.kv.utilization() == 0.0
    with pytest.raises(RequestError) as e:
        engine.submit(prompts(1)[0], SamplingParams(max_tokens=4))
    assert e.value.code == "engine_stopped"


def test_a_failed_step_ends_the_request_it_was_taking_in(tiny_bundle, monkeypatch):
    """A step that fails between taking a request from the inbox and queueing it must not orphan its stream."""
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    add, calls = engine.scheduler.add, []

    def add_fails_once(seq):
        calls.append(seq)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        add(seq)

    monkeypatch.setattr(engine.scheduler, "add", add_fails_once)
    engine.start()
    try:
        first = engine.submit(prompts(1)[0], SamplingParams(max_tokens=3, **GREEDY))
        fin = next(ev for ev in iter(lambda: first.events.get(timeout=10), None) if isinstance(ev, Finished))
        assert fin.figures.finish_reason == "error" and fin.error_code == "internal"
        assert engine.generate(prompts(1)[0], SamplingParams(max_tokens=3, **GREEDY)).figures.completion_tokens == 3
    finally:
        engine.stop()


def test_a_request_whose_sampling_fails_ends_alone(tiny_bundle, monkeypatch):
    """One request's sampling error (a repetition penalty of 1e-40 overflowing its logits) ends that request
    alone; the others in the step finish normally."""
    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    sample = engine.steps._sample

    def failing_for_seed_13(seq, logits):
        if seq.params.seed == 13 and len(seq.output_ids) == 3:
            raise IndexError("a bug in one request's sampling")
        return sample(seq, logits)

    monkeypatch.setattr(engine.steps, "_sample", failing_for_seed_13)
    ps = prompts(4, seed=7)
    handles = [engine.submit(p, SamplingParams(max_tokens=12, seed=13 if i == 1 else None, **GREEDY))
               for i, p in enumerate(ps)]
    engine.start()
    try:
        results = [h.result() for h in handles]
    finally:
        engine.stop()
    assert [r.figures.finish_reason for r in results] == ["length", "error", "length", "length"]
    assert results[1].error_code == "internal" and len(results[1].token_ids) == 3


def test_a_repetition_penalty_near_zero_is_served():
    """What made the sampling above fail: v / 1e-40 is +inf in float32, and softmax turned the row to NaN."""
    from agent.engine.sampler import sample

    logits = np.random.default_rng(0).normal(size=300).astype(np.float32) * 5
    params = SamplingParams(repetition_penalty=1e-40, temperature=1.0, min_p=0.1, seed=1)
    token = sample(logits, params, [1, 2, 3], [4], np.random.default_rng(1))
    assert token in (1, 2, 3, 4)  # the penalty made the seen tokens by far the most likely


def test_an_engine_that_lost_its_model_session_stops_instead_of_failing_every_request(tiny_bundle, monkeypatch):
    """When rebuilding the session fails and so does restoring the old one, the loop stops (no more heartbeats,
    so the watchdog restarts the service) instead of failing every request."""
    import agent.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SPIN_RECHECK_S", 0.0)
    e = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, spin_wait="auto"),
               idle_wait_s=0.05)
    beats = []
    e.heartbeat = lambda: beats.append(time.monotonic())

    def no_memory(spin):
        raise MemoryError("out of memory building the session")

    monkeypatch.setattr(e.runner, "_load", no_memory)
    e.runner.spinning = not e.runner.spinning  # the next idle check rebuilds, and both builds fail
    e.start()
    deadline = time.monotonic() + 10
    while e.is_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not e.is_running and e.runner.session is None
    stopped_beating = len(beats)
    time.sleep(0.3)
    assert len(beats) == stopped_beating  # no heartbeat: systemd's watchdog restarts the service
    with pytest.raises(RequestError, match="engine has stopped"):
        e.submit(prompts(1)[0], SamplingParams(max_tokens=2, **GREEDY))
    e.stop()


def test_simultaneous_submits_never_queue_past_max_queue(tiny_bundle):
    """The queue's depth is checked under the lock that queues, so submits arriving together cannot each pass
    it."""
    import threading

    engine = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, max_queue=4))
    accepted, refused, start = [], [], threading.Barrier(32)

    def submit():
        start.wait()
        try:
            accepted.append(engine.submit(prompts(1)[0], SamplingParams(max_tokens=2, **GREEDY)))
        except RequestError as e:
            refused.append(e)

    threads = [threading.Thread(target=submit) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) == 4 and len(refused) == 28  # the engine is not running: nothing left the queue
    engine.stop()


def test_an_engine_whose_every_step_fails_stops_so_the_watchdog_restarts_it(tiny_bundle):
    """With the model failing on every call, the loop stops after MAX_FAILED_STEPS and stops feeding the
    watchdog, so systemd restarts the service instead of /health saying ready while every request fails."""
    from agent.engine.engine import MAX_FAILED_STEPS

    e = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64), idle_wait_s=0.05)
    beats = []
    e.heartbeat = lambda: beats.append(1)

    def broken(*args, **kwargs):
        raise RuntimeError("the model session is broken")

    e.runner.forward = broken
    e.start()
    results = []
    for _ in range(MAX_FAILED_STEPS):
        results.append(e.submit(prompts(1)[0], SamplingParams(max_tokens=2, **GREEDY)).result())
    deadline = time.monotonic() + 5
    while e.is_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [r.figures.finish_reason for r in results] == ["error"] * MAX_FAILED_STEPS and not e.is_running
    stopped_at = len(beats)
    time.sleep(0.3)
    assert len(beats) == stopped_at
    e.stop()


def test_budget_too_small_is_a_clear_error(tiny_bundle):
    with pytest.raises(MemoryBudgetError, match=r"needs at least \d+ MB"):
        Engine(tiny_bundle, EngineConfig(memory_budget_mb=64))


def test_figures_are_consistent(engine):
    f = engine.generate(prompts(1, seed=5)[0], SamplingParams(max_tokens=16, **GREEDY)).figures
    assert f.ttft_ms >= f.queue_ms >= 0 and f.e2e_ms >= f.ttft_ms
    assert f.decode_tokens_per_s > 0 and f.prefill_tokens_per_s > 0 and f.itl_p95_ms >= f.itl_p50_ms
    assert f.kv_bytes > 0


def test_idle_loop_remeasures_spinning_and_keeps_serving(tiny_bundle, monkeypatch):
    import agent.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SPIN_RECHECK_S", 0.0)  # re-measure at every idle moment
    e = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, spin_wait="auto"),
               idle_wait_s=0.05)
    checks, recheck = [], e.runner.recheck_spinning

    def counting() -> bool:
        checks.append(e.scheduler.has_work())
        return recheck()

    e.runner.recheck_spinning = counting
    expected = e.generate(prompts(1, seed=9)[0], SamplingParams(max_tokens=8, **GREEDY)).token_ids
    e.start()
    try:
        time.sleep(1.0)
        assert checks and not any(checks)  # measured while idle, never with work in hand
        e.runner.spinning = not e.runner.spinning  # whatever the box says now differs: the next check rebuilds
        time.sleep(1.0)
        out = e.submit(prompts(1, seed=9)[0], SamplingParams(max_tokens=8, **GREEDY)).result()
    finally:
        e.stop()
    assert out.token_ids == expected


def test_a_failing_remeasurement_does_not_stop_the_loop(tiny_bundle, monkeypatch):
    import agent.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "SPIN_RECHECK_S", 0.0)
    e = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64), idle_wait_s=0.05)
    failures = []

    def failing() -> bool:
        failures.append(1)
        raise OSError("no /proc/stat")

    e.runner.recheck_spinning = failing
    e.start()
    try:
        time.sleep(0.5)
        assert failures and e.is_running  # the loop thread survived the failures
        out = e.submit(prompts(1, seed=3)[0], SamplingParams(max_tokens=4, **GREEDY)).result()
    finally:
        e.stop()
    assert failures and out.figures.finish_reason == "length" and len(out.token_ids) == 4


def test_a_dropped_engine_is_freed_at_once_without_waiting_for_the_garbage_collector(tiny_bundle):
    """No reference cycle runs through an engine: the next engine in the process sizes its KV cache from the
    process's memory, which a stopped engine kept alive until a collection would still hold."""
    import gc
    import weakref

    e = Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64))
    e.start()
    e.generate(prompts(1)[0], SamplingParams(max_tokens=3, **GREEDY))
    e.stop()
    gone = weakref.ref(e)
    gc.disable()
    try:
        del e
        assert gone() is None
    finally:
        gc.enable()
