"""Wiring for `edge-agent serve`: config, sockets, the model lifecycle, telemetry and updates, run in the foreground.

The Unix socket is bound first (agent.api.http_server), then the model loads in a thread while /health
answers 503 "loading"; the model lifecycle (agent.service.lifecycle) owns loading, swapping and SIGHUP
reloads, preflight (agent.service.preflight) the state-directory lock and the fitted budget. SIGTERM or
Ctrl-C drains: /health turns 503, the listeners close, in-flight requests get `drain_timeout_s` to finish,
then the engine stops, telemetry is flushed and the socket file is removed.

Run: edge-agent serve --model BUNDLE --socket /run/edge-agent/agent.sock [--config agent.toml] [--tcp 127.0.0.1:8080]
"""
from __future__ import annotations

import logging
import os
import secrets
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from agent.api.backend import Backend
from agent.api.http_server import ApiServer, ServeError, bind_tcp, bind_unix, unlink_if_socket
from agent.config import AgentConfig
from agent.engine.bundle import open_bundle
from agent.engine.golden import continue_greedy, measure_golden
from agent.link.commands import CommandError
from agent.link.telemetry import Telemetry
from agent.service.lifecycle import ModelLifecycle
from agent.service.preflight import fitted_budget, lock_state_dir, names_store_current
from agent.service.sdnotify import Notifier
from agent.updates.jobs import UpdateContext
from agent.updates.model_store import ModelStore
from agent.updates.service import UpdateService
from agent.updates.trust import load_trusted_keys
from agent.wire import JobDocument, Manifest

AGENT_VERSION = "0.1.0"

log = logging.getLogger(__name__)

# at shutdown, after the engine stops: how long requests it cut off get to write their telemetry (an fsync
# each, up to a second on a slow SD card, several at once)
REQUEST_HOOKS_WAIT_S = 10.0


# ---- configuration ----------------------------------------------------------------------------------
def load_agent_config(path: Path | None = None, **flags) -> AgentConfig:
    """The TOML config file (if any) with command-line flags laid over it (flags win), validated once.

    flags: model, socket, tcp (top level / [api]), threads, memory_budget_mb ([engine]), state_dir,
    device_id, mqtt ([telemetry]), trusted_keys ([updates]), adapters ([adapters], name -> folder, laid over the
    file's by name); None = not given.
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8")) if path else {}
    except UnicodeDecodeError as e:  # TOML is UTF-8; the codec's message named no file
        raise ServeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    tele = {k: flags.pop(k) for k in ("state_dir", "device_id") if flags.get(k) is not None}
    if flags.get("mqtt") is not None:
        mqtt = _table(_table(data, "telemetry"), "mqtt", "telemetry.")  # the flag's one broker replaces shards
        tele["mqtt"] = {**{k: v for k, v in mqtt.items() if k != "shards"}, "url": flags.pop("mqtt")}
    flags.pop("mqtt", None)
    if tele:
        data["telemetry"] = {**_table(data, "telemetry"), **tele}
    if flags.get("trusted_keys"):
        data["updates"] = {**_table(data, "updates"), "trusted_keys": [str(p) for p in flags.pop("trusted_keys")]}
    flags.pop("trusted_keys", None)
    if flags.get("adapters"):
        data["adapters"] = {**_table(data, "adapters"), **{k: str(p) for k, p in flags.pop("adapters").items()}}
    flags.pop("adapters", None)
    engine_flags = {k: flags.pop(k) for k in ("threads", "memory_budget_mb") if flags.get(k) is not None}
    api_flags = {k: flags.pop(k) for k in ("socket", "tcp") if flags.get(k) is not None}
    if flags.get("model") is not None:
        data["model"] = flags["model"]
    if engine_flags:
        data["engine"] = {**_table(data, "engine"), **engine_flags}
    if api_flags:
        data["api"] = {**_table(data, "api"), **api_flags}
    return AgentConfig.model_validate(data)


def _table(data: dict, key: str, within: str = "") -> dict:
    """data[key] as a table to lay flags over; `api = "x"` beside --socket was an internal TypeError."""
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ServeError(f"config: {within}{key} must be a table ([{within}{key}]), not {type(value).__name__}")
    return value



def serve_forever(config: AgentConfig, announce: Callable[[str], None] = log.info,
                  notifier: Notifier | None = None, reload_config: Callable[[], AgentConfig] | None = None) -> None:
    """Serve the current model on the configured socket(s) until SIGTERM / SIGINT, then drain and stop.

    Wiring, in order: the state directory is locked (one agent each); the model store picks a verified
    model; the sockets bind; the updater settles the last job; telemetry (SQLite, and MQTT when configured)
    starts; the engine loads in the background (READY after it);
    at shutdown in-flight requests drain, the engine stops, telemetry is flushed and MQTT says "stopped".
    """
    config = fitted_budget(config)
    lock = lock_state_dir(Path(config.telemetry.state_dir))
    try:
        _serve(config, announce, notifier, reload_config)
    finally:
        os.close(lock)  # however serve ended: a later serve in this process (tests) must get it


def _serve(config: AgentConfig, announce: Callable[[str], None], notifier: Notifier | None,
           reload_config: Callable[[], AgentConfig] | None) -> None:
    store = ModelStore(config.telemetry.state_dir)
    api = config.api
    # The socket first: a second agent started on a live one fails here, before it changes the store.
    sockets = [bind_unix(api.socket, api.socket_mode, api.socket_group)]
    server = telemetry = updates = None
    try:
        if api.tcp_address is not None:
            sockets.append(bind_tcp(*api.tcp_address))
        model_dir = boot_model(store, config.model)
        manifest = Manifest.read(model_dir)  # identity for /health and /v1/models while the bundle loads
        server = ApiServer(Backend(manifest), sockets, api)
        server.uvicorn.on_stopping = notifier.stopping if notifier else None
        models = ModelLifecycle(server.backend, config.engine, notifier,
                                adapters=lambda b: {**store.adapters_for(b.manifest), **config.adapters})
        telemetry, updates = _start_services(config, store, server, models, reload_config)
        models.install_sighup(reload_config, config, fit=fitted_budget)
        server.load_in_background(lambda: models.load(store.bootable().path))
        announce(f"serving {manifest.name}@{manifest.version} on unix:{api.socket}"
                 + (f" and http://{api.tcp}" if api.tcp else "") + " (loading the model)")
        server.run()
    finally:
        if server is None:  # failed before serving: the sockets are still only ours
            for sock in sockets:
                sock.close()
        unlink_if_socket(Path(api.socket))
        if server is not None and server.backend.engine is not None:
            server.backend.engine.stop()
            if not server.backend.join_requests(REQUEST_HOOKS_WAIT_S):
                log.warning("some requests' telemetry was still being written at shutdown; it may be lost")
        if updates is not None:
            updates.stop()
        if telemetry is not None:
            telemetry.stop()  # every finished request is already in SQLite; MQTT publishes "stopped" and leaves
    if server.load_error is not None:
        raise ServeError(f"the model failed to load: {server.load_error}") from server.load_error


def boot_model(store: ModelStore, model: Path | None) -> Path:
    """The bundle to serve. A model named on the command line or in the config becomes `current` (linked
    into the store, not copied); without one, or when it names the store's `current` itself (the shipped
    agent.toml does), the store's verified `current`, else `previous` (what updates installed): a damaged
    `current` falls back rather than stopping the agent in a restart loop."""
    if model is not None and names_store_current(model, store.root):
        model = None
    if model is not None:
        bundle = open_bundle(model)  # verified before anything points at it
        if store.link("current") != Path(model).resolve():
            seeded = store.models / f"{bundle.manifest.name}@{bundle.manifest.version}"
            if not seeded.exists():
                seeded.symlink_to(Path(model).resolve(), target_is_directory=True)
            if seeded.resolve() != store.link("current"):
                store.activate(seeded)
    elif store.link("current") is None:
        raise ServeError("no model: pass --model or set `model` in the config file")
    return store.bootable().path


def _start_services(config: AgentConfig, store: ModelStore, server: ApiServer, models: ModelLifecycle,
                    reload_config: Callable[[], AgentConfig] | None = None):
    """Telemetry for every finished request, and the updater when a broker is configured."""
    backend = server.backend
    updates: UpdateService | None = None

    def rollback() -> dict:
        # refusals are errors, so `edge-fleet cmd` exits non-zero at once rather than the job failing later
        if updates is None:
            raise CommandError("updates need a broker connection")
        if config.updates.job_keys:  # the command is not signed, and a rollback is a job like any other
            raise CommandError("this device takes rollbacks only as signed jobs ([updates] job_keys): "
                               "edge-fleet rollback DEVICE")
        if store.link("previous") is None:
            raise CommandError("no previous model to roll back to")
        job_id = f"rollback-{int(time.time())}-{secrets.token_hex(3)}"  # two in one second are two jobs
        updates.offer(JobDocument(job_id=job_id, operation="rollback").model_dump_json().encode())
        return {"queued": True, "job_id": job_id}

    telemetry = Telemetry.open(config, describe=lambda: describe_device(backend), rollback=rollback)
    if store.fallback is not None:  # a damaged current at boot: the fleet hears why it runs an older model
        telemetry.record_event("model_fallback", store.fallback)
    server.metrics.bind_telemetry(lambda: telemetry.store.dropped_total)
    backend.on_finished.append(lambda m, fin: telemetry.record_request(m.name, m.version, fin.figures, fin.adapter))
    backend.on_ready(telemetry.bind_engine)
    backend.sampling_defaults = lambda: telemetry.settings.sampling.given()  # set_config applies at once
    if telemetry.link is not None:
        ctx = UpdateContext(
            device_id=telemetry.link.device_id, store=store,
            trusted_keys=load_trusted_keys(list(config.updates.trusted_keys)),
            memory_budget_mb=config.engine.memory_budget_mb,
            current=lambda: models.current_bundle() or store.bootable(),
            report=lambda u: _report_job(telemetry, u),
            replay=lambda u: telemetry.link.publish_job_status(u.model_dump_json(), u.job_id),
            swap=models.swap,
            measure=lambda b, n: measure_golden(b, config.engine.threads, n),
            generate=lambda ids, n, adapter: continue_greedy(backend.engine, ids, n, adapter),
            kv_dtypes=lambda: _kv_dtypes(backend, config, reload_config),
            health_check_tokens=config.updates.health_check_tokens, allow_downgrade=config.updates.allow_downgrade,
            artifacts_url=config.updates.artifacts_url, min_tokens_per_s=config.updates.min_tokens_per_s,
            job_keys=load_trusted_keys(list(config.updates.job_keys)))
        updates = UpdateService(ctx)
        telemetry.link.on_job = updates.offer
        # settled before the link connects (statuses wait for it): a job the broker redelivers at once is
        # offered only after recover() has run, which would otherwise report it FAILED while it ran
        updates.start()
    telemetry.start()
    return telemetry, updates


def _kv_dtypes(backend: Backend, started: AgentConfig,
               reload_config: Callable[[], AgentConfig] | None) -> tuple[str, ...]:
    """The KV cache types a new model would run with: the engine's, and the config file's, which the next start
    applies."""
    running = (backend.engine.config if backend.engine else started.engine).kv_dtype
    try:
        configured = reload_config().engine.kv_dtype if reload_config else running
    except Exception:  # an edit that does not load: the next start refuses it, and says why
        configured = running
    return tuple(dict.fromkeys((running, configured)))


def _report_job(telemetry: Telemetry, update) -> None:
    if update.state.value in ("SUCCEEDED", "FAILED"):  # the model may have changed: the fleet's registry
        telemetry.link.publish_state()  # first, so that it names the new model by the time the job has ended
    telemetry.link.publish_job_status(update.model_dump_json(), update.job_id)
    if update.state.value in ("SUCCEEDED", "FAILED", "REJECTED"):
        telemetry.record_event("model_change" if update.state.value == "SUCCEEDED" else "error",
                               {"job_id": update.job_id, "state": update.state.value, "reason": update.reason})


def describe_device(backend: Backend) -> dict:
    """DeviceState's optional fields: what this device runs and on what."""
    import platform

    from agent.process import usable_cores

    m = backend.manifest
    mem_kb = next((int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal:")), 0)
    return {"model": m.name, "version": m.version, "precision": m.precision, "agent_version": AGENT_VERSION,
            "hardware": {"cpu": platform.processor() or platform.machine(), "cores": usable_cores(),
                         "memory_mb": mem_kb // 1024, "arch": platform.machine()}}

