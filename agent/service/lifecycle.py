"""The served model's lifecycle, in one owner: loading, draining, swapping and live reloads (SIGHUP).

The API's Backend holds the engine that answers requests; only this module replaces it. A swap (a model
update, a rollback) drains the old engine, stops it and gives back its memory before the new one loads with
the whole budget; a live reload hands the settings that may change while serving to the engine, which
applies them on its own thread (Engine.update_settings); the rest need a restart and are named.

Example:
    models = ModelLifecycle(backend, config.engine, notifier)
    backend.mark_ready(models.load(bundle_path))
    models.swap(open_bundle(new_path), check=health_check)   # the updater's swap
    models.reload(new_config)                                # SIGHUP -> the keys that need a restart
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from agent.api.backend import Backend, ServerState
from agent.api.http_server import ServeError
from agent.config import AgentConfig, EngineConfig, describe_errors
from agent.engine.bundle import Bundle, open_bundle
from agent.engine.engine import Engine
from agent.process import trim_heap
from agent.service.sdnotify import Notifier

log = logging.getLogger(__name__)

LOADING_WAIT_S = 300.0  # a model switch waits this long for the first model to finish loading (TimeoutStartSec=)
DRAIN_BEFORE_SWITCH_S = 60.0  # a switch lets the old model's requests finish this long, then stops them
SWITCH_KEEPALIVE_S = 300.0  # a switch's health check and load may take this long before the watchdog restarts us
LIVE_ENGINE_FIELDS = ("max_queue", "max_queue_wait_s", "default_max_tokens", "speculative", "speculative_max_batch")


AdapterPicker = Callable[[Bundle], Mapping[str, Path]]  # the LoRA adapters to serve with a bundle: name -> folder


def no_adapters(bundle: Bundle) -> Mapping[str, Path]:
    return {}


def load_engine(model: Path, config: EngineConfig, notifier: Notifier | None = None,
                adapters: AdapterPicker = no_adapters) -> Engine:
    """Verify and load the bundle (and the draft model it carries, when speculative is "draft") with the adapters
    picked for it, start the engine loop; its heartbeat feeds the systemd watchdog."""
    ping_s = notifier.watchdog_interval_s if notifier and notifier.watchdog_interval_s else 0.5
    bundle = open_bundle(model)
    draft = bundle.draft() if config.speculative == "draft" else None  # the draft model the bundle carries
    engine = Engine(bundle, config, draft=draft, heartbeat=notifier.heartbeat if notifier else None,
                    idle_wait_s=min(0.5, ping_s / 2),  # an idle loop still beats often enough for the watchdog
                    adapters=adapters(bundle))
    engine.start()
    if notifier:  # READY only now: the model is verified and loaded and the socket already listens
        m = engine.bundle.manifest
        notifier.ready(f"serving {m.name}@{m.version} ({m.precision})")
    return engine


def restart_keys(started: AgentConfig, new: AgentConfig) -> list[str]:
    """Keys outside [engine] (which reload handles) that changed since the start: they need a restart, and a
    SIGHUP names them rather than staying silent as if they were applied."""
    old, now = started.model_dump(exclude={"engine"}), new.model_dump(exclude={"engine"})

    def walk(a, b, prefix: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [k for key in sorted(a.keys() | b.keys()) for k in walk(a.get(key), b.get(key), prefix + key + ".")]
        return [] if a == b else [prefix.rstrip(".")]
    return walk(old, now, "")


class ModelLifecycle:
    """The one owner of the served engine: backend.engine changes only here (load, swap), and live settings
    reach the engine only through reload(). `config` is the engine config a first load uses; once an engine
    runs, its config (with what SIGHUP changed since the start) is the one a swap keeps."""

    def __init__(self, backend: Backend, config: EngineConfig, notifier: Notifier | None = None,
                 adapters: AdapterPicker = no_adapters):
        self.backend, self.config, self.notifier, self.adapters = backend, config, notifier, adapters
        # a reload against a swap's handover; re-entrant: a second SIGHUP can run inside the first's handler
        self.lock = threading.RLock()

    def load(self, model: Path) -> Engine:
        return load_engine(model, self.config, self.notifier, self.adapters)

    def current_bundle(self) -> Bundle | None:
        return self.backend.engine.bundle if self.backend.engine else None

    # ---- live settings ------------------------------------------------------------------------------
    def reload(self, new: AgentConfig) -> list[str]:
        """SIGHUP: apply the settings that can change while serving; name the ones that need a restart."""
        with self.lock:  # a switch hands over between two SIGHUPs, never inside one
            engine = self.backend.engine
            if engine is None:
                return []
            changed = {f: getattr(new.engine, f) for f in LIVE_ENGINE_FIELDS
                       if getattr(new.engine, f) != getattr(engine.config, f)}
            if changed.get("speculative") == "draft" and engine.draft is None:  # it would quietly run prompt lookup
                log.error("SIGHUP: speculative = 'draft' needs the draft model a bundle carries, loaded at start or "
                          "at a model switch; this engine has none: not applied")
                del changed["speculative"]
            engine.update_settings(changed)
            restart = [f for f in type(new.engine).model_fields
                       if f not in LIVE_ENGINE_FIELDS and getattr(new.engine, f) != getattr(engine.config, f)]
        log.info("SIGHUP: applied %s%s", changed or "nothing new",
                 f"; needs a restart: {', '.join(restart)}" if restart else "")
        return restart

    def install_sighup(self, reload_config: Callable[[], AgentConfig] | None, started: AgentConfig,
                       fit: Callable[[AgentConfig], AgentConfig] = lambda c: c) -> None:
        """SIGHUP reads the config file again (fitted as at the start) and reloads what may change live."""
        if reload_config is None or threading.current_thread() is not threading.main_thread():
            return

        def on_hup(signum, frame) -> None:
            try:
                new = fit(reload_config())  # as at the start, or the lowered budget read as a change
            except ValidationError as e:  # a bad edit of the file must not take the service down
                log.error("SIGHUP: config not reloaded: %s", describe_errors(e).replace("\n", "; "))
                return
            except Exception as e:
                log.error("SIGHUP: config not reloaded: %s", str(e).splitlines()[0])
                return
            if self.backend.engine is None:
                log.warning("SIGHUP while the model loads: nothing applied; send it again once the agent is ready")
                return
            others = restart_keys(started, new)
            if others:
                log.warning("SIGHUP: needs a restart, not applied: %s", ", ".join(others))
            try:
                self.reload(new)
            except Exception as e:
                log.error("SIGHUP: config not applied: %s", str(e).splitlines()[0])

        signal.signal(signal.SIGHUP, on_hup)

    # ---- switching models ---------------------------------------------------------------------------
    def swap(self, bundle: Bundle, check: Callable[[Bundle], None] | None = None) -> None:
        """Activate a new model: the old one finishes what it holds, stops and lets go of its memory, then the
        new one is measured and loaded with the whole budget; requests arriving meanwhile wait for it (api
        SWITCH_WAIT_S). Loading beside a busy old model would size the new budget around what the old one held
        at that moment while its requests kept filling their KV cache past memory_budget_mb. check(bundle), an
        update's health check, runs between the two, alone in the budget; if it raises, the old model loads
        again and the exception propagates. If the new model fails to load, the caller rolls back the same way."""
        self._wait_first_load()
        config = self.backend.engine.config if self.backend.engine is not None else self.config  # SIGHUP's kept
        keepalive = self.notifier.keepalive(SWITCH_KEEPALIVE_S) if self.notifier else contextlib.nullcontext()
        self.backend.switching.set()
        try:
            old = self.backend.engine
            serving = old.bundle if old is not None else None
            if old is not None:
                _drain(old, timeout_s=DRAIN_BEFORE_SWITCH_S)
            with keepalive:  # from here no engine loop feeds the watchdog until the new one runs
                if old is not None:
                    old.stop()
                    old.close()  # stopped alone, it kept its session and KV cache (the API still references it)
                    del old
                    trim_heap()
                if check is not None:
                    self._check_or_restore(bundle, check, serving, config)
                self._hand_over(load_engine(bundle.path, config, self.notifier, self.adapters))
        finally:
            self.backend.switching.clear()

    def _wait_first_load(self) -> None:
        """A job can arrive while the first model still loads (a rollback queued for an offline device): swapped
        in then, the loader's mark_ready() would replace it, and it would run on unused beside the one served."""
        deadline = time.monotonic() + LOADING_WAIT_S
        while self.backend.state is ServerState.LOADING:
            if time.monotonic() > deadline:
                raise ServeError(f"the first model is still loading after {LOADING_WAIT_S:.0f} s: not switching now")
            time.sleep(0.1)

    def _check_or_restore(self, bundle: Bundle, check: Callable[[Bundle], None], serving: Bundle | None,
                          config: EngineConfig) -> None:
        try:
            check(bundle)
        except BaseException:
            trim_heap()
            if serving is not None:
                try:
                    self._hand_over(load_engine(serving.path, config, self.notifier, self.adapters))
                except Exception:  # the check's reason is the news; the watchdog restarts us
                    log.exception("the model that served before the check failed to load again: "
                                  "nothing is served until the agent restarts")
            raise
        trim_heap()  # the check's sessions, before the next load measures its baseline

    def _hand_over(self, engine: Engine) -> None:
        """Serve from engine, with the live settings the outgoing engine had by now: a SIGHUP during the switch
        (applied to the outgoing engine, and logged as applied) carries over rather than being undone."""
        with self.lock:
            outgoing = self.backend.engine
            if outgoing is not None:
                live = {f: getattr(outgoing.config, f) for f in LIVE_ENGINE_FIELDS}
                if live["speculative"] == "draft" and engine.draft is None:
                    del live["speculative"]
                engine.update_settings(live)
            self.backend.swap(engine)


def _drain(engine: Engine, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (engine.num_running or engine.num_waiting) and time.monotonic() < deadline:
        time.sleep(0.05)
