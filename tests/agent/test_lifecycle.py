"""The model's lifecycle (agent.service.lifecycle): a switch drains the old model and frees its memory before
the new one loads, an update's health check runs alone in the budget, a switch waits for the first load, and
SIGHUP's live settings reach the engine and survive a switch."""
from __future__ import annotations

import time

import numpy as np
import pytest

import agent.service.lifecycle as lifecycle
from agent.api.backend import Backend
from agent.config import EngineConfig
from agent.engine.engine import Engine
from agent.engine.sampling_params import SamplingParams
from agent.service.lifecycle import ModelLifecycle
from batching import GREEDY
from quantize.package import build_bundle
from quantize.precision import QuantSpec


@pytest.fixture(scope="module")
def tiny_bundle(tiny_varied_checkpoint, tmp_path_factory):
    return build_bundle(tiny_varied_checkpoint, QuantSpec(), tmp_path_factory.mktemp("life") / "fp32", name="tiny",
                        progress=lambda s: None)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 260, int(rng.integers(5, 40))).tolist() for _ in range(n)]


def test_a_switch_lets_the_old_model_finish_and_free_its_memory_before_loading_the_new(tiny_bundle, monkeypatch):
    """A switch never loads beside a busy old model (whose requests would go on filling its KV cache past
    memory_budget_mb, 1,162 MB against 1,024 measured, while the new model's cache was sized around it): the
    old model's request finishes, its session is gone and then the new model loads; a request sent during
    the switch waits for the new model instead of failing."""
    import weakref


    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64)
    old = lifecycle.load_engine(tiny_bundle.path, config)
    backend = Backend(old.bundle.manifest)
    backend.mark_ready(old)
    in_flight = old.submit(prompts(1)[0], SamplingParams(max_tokens=40, **GREEDY))
    session = weakref.ref(old.runner.session)
    load, seen = lifecycle.load_engine, []

    def loading(path, config, notifier=None, adapters=lifecycle.no_adapters):
        seen.append((in_flight.seq.is_finished, session() is None, backend.switching.is_set()))
        return load(path, config, notifier, adapters)

    monkeypatch.setattr(lifecycle, "load_engine", loading)
    del old
    ModelLifecycle(backend, config).swap(tiny_bundle)
    assert seen == [(True, True, True)] and not backend.switching.is_set()
    assert in_flight.result().figures.finish_reason == "length"
    assert backend.engine.generate(prompts(1)[0], SamplingParams(max_tokens=3, **GREEDY)).figures.completion_tokens == 3
    backend.engine.stop()


def test_an_updates_health_check_runs_once_the_old_model_has_let_go_of_its_memory(tiny_bundle):
    """An update's health check runs inside the switch, after the old engine has stopped and freed its session
    (beside the serving one it took the process ~210 MB past memory_budget_mb: 526 MB at 420, SmolLM2 INT4 ->
    INT8); if it fails, the old model serves again."""
    import weakref


    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64)
    old = lifecycle.load_engine(tiny_bundle.path, config)
    backend = Backend(old.bundle.manifest)
    backend.mark_ready(old)
    session = weakref.ref(old.runner.session)
    seen = []

    def failing_check(bundle):
        seen.append((session() is None, backend.switching.is_set()))
        raise RuntimeError("golden output mismatch")

    del old
    with pytest.raises(RuntimeError, match="golden"):
        ModelLifecycle(backend, config).swap(tiny_bundle, failing_check)
    assert seen == [(True, True)] and not backend.switching.is_set()
    assert backend.engine.is_running and backend.engine.runner.session is not None  # the old model, again
    assert backend.engine.generate(prompts(1)[0], SamplingParams(max_tokens=3, **GREEDY)).figures.completion_tokens == 3
    serving = backend.engine
    ModelLifecycle(backend, config).swap(tiny_bundle, lambda bundle: seen.append("checked"))
    assert seen[-1] == "checked" and backend.engine is not serving and backend.engine.is_running
    # the old model failing to load again keeps the check's reason, not the reload's error; nothing serves
    # then, and the watchdog restarts the agent
    load = lifecycle.load_engine

    def broken_load(path, config, notifier=None):
        raise MemoryError("cannot load old")
    lifecycle.load_engine = broken_load
    try:
        with pytest.raises(RuntimeError, match="golden"):
            ModelLifecycle(backend, config).swap(tiny_bundle, failing_check)
    finally:
        lifecycle.load_engine = load
    assert not backend.engine.is_running


def test_a_sighup_during_a_model_switch_reaches_the_model_served_after_it(tiny_bundle):
    """A SIGHUP during a switch (applied to the outgoing engine, logged as applied) holds for the new model,
    whose config is taken after the old one drained; so does one during a health check that fails and
    reloads the old model."""
    from agent.config import AgentConfig

    engine = {"threads": 2, "memory_budget_mb": 16000, "min_context": 64}
    config = EngineConfig(**engine)
    old = lifecycle.load_engine(tiny_bundle.path, config)
    backend = Backend(old.bundle.manifest)
    backend.mark_ready(old)
    del old

    def edit(**changes):
        new = AgentConfig.model_validate({"engine": {**engine, **changes}})
        return lambda bundle: ModelLifecycle(backend, config).reload(new)

    ModelLifecycle(backend, config).swap(tiny_bundle, edit(default_max_tokens=5, max_queue_wait_s=7))
    assert (backend.engine.config.default_max_tokens, backend.engine.scheduler.max_queue_wait_s) == (5, 7)

    def edit_then_fail(bundle):
        edit(default_max_tokens=9)(bundle)
        raise RuntimeError("golden output mismatch")

    with pytest.raises(RuntimeError, match="golden"):
        ModelLifecycle(backend, backend.engine.config).swap(tiny_bundle, edit_then_fail)
    assert backend.engine.config.default_max_tokens == 9 and backend.engine.is_running
    backend.engine.stop()


def test_a_switch_while_the_first_model_loads_waits_for_it(tiny_bundle):
    """A rollback job arriving while the first model loads is not swapped in only to be replaced by the
    loader's engine and run on unused beside it."""
    import threading


    config = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64)
    backend = Backend(tiny_bundle.manifest)  # LOADING
    switch = threading.Thread(target=ModelLifecycle(backend, config).swap, args=(tiny_bundle,))
    switch.start()
    time.sleep(0.5)
    assert switch.is_alive() and backend.engine is None  # it waits
    first = lifecycle.load_engine(tiny_bundle.path, config)
    backend.mark_ready(first)
    switch.join(30)
    assert not switch.is_alive() and backend.engine is not first and backend.engine.is_running
    deadline = time.monotonic() + 10
    while first.is_running and time.monotonic() < deadline:  # retired once it drained
        time.sleep(0.05)
    assert not first.is_running
    backend.engine.stop()


def test_a_model_switch_keeps_what_sighup_changed(tiny_bundle):
    """A switch loads the new model with the live settings SIGHUP applied since start (max_queue, the default
    max_tokens, speculation...), not the ones read at start."""

    started_with = EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, max_queue=64)
    old = lifecycle.load_engine(tiny_bundle.path, started_with)
    backend = Backend(old.bundle.manifest)
    backend.mark_ready(old)
    old.config = old.config.model_copy(update={"max_queue": 7, "default_max_tokens": 33})  # as reload does
    ModelLifecycle(backend, started_with).swap(tiny_bundle)
    assert backend.engine is not old
    assert (backend.engine.config.max_queue, backend.engine.config.default_max_tokens) == (7, 33)
    backend.engine.stop()
    old.stop()


def test_sighup_names_every_key_it_cannot_apply_and_never_fakes_a_draft_model(tiny_bundle, caplog):
    """SIGHUP names the changes outside [engine] that need a restart (a rotated trusted key, [api], `model`),
    and speculative = 'draft' without a draft model is refused at start and on reload rather than quietly
    running prompt lookup."""
    from agent.config import AgentConfig

    started = AgentConfig.model_validate({"engine": {"threads": 2, "memory_budget_mb": 16000, "min_context": 64}})
    edited = AgentConfig.model_validate({
        "model": "/elsewhere", "engine": {"threads": 2, "memory_budget_mb": 16000, "min_context": 64,
                                          "max_queue": 9, "speculative": "draft"},
        "api": {"max_connections": 17}, "updates": {"trusted_keys": ["/etc/edge-agent/new.pub"]}})
    assert lifecycle.restart_keys(started, edited) == ["api.max_connections", "model", "updates.trusted_keys"]
    engine = lifecycle.load_engine(tiny_bundle.path, started.engine)
    backend = Backend(engine.bundle.manifest)
    backend.mark_ready(engine)
    caplog.set_level("INFO", logger="agent.service.lifecycle")
    ModelLifecycle(backend, started.engine).reload(edited)
    assert engine.config.max_queue == 9 and engine.config.speculative != "draft"
    assert "speculative = 'draft' needs the draft model a bundle carries" in caplog.text
    engine.stop()
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(tiny_bundle, EngineConfig(threads=2, memory_budget_mb=16000, min_context=64, speculative="draft"))
