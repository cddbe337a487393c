"""Preflight: what `serve` checks before it starts, and what `check-config` reports without starting anything.

One agent per state directory (an flock on the directory), a memory budget fitted under what this process may
use, and the environment problems (model, socket group, keys, writable directories) serve would refuse.

Example:
    problems = environment_problems(config)   # [] when serve would start
    fd = lock_state_dir(config.telemetry.state_dir)
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path

from agent.api.http_server import ServeError, group_id
from agent.config import AgentConfig
from agent.engine.bundle import open_bundle
from agent.engine.memory import MB, describe_parameters, kv_bytes_per_token
from agent.process import memory_limit_bytes
from agent.updates.trust import load_trusted_keys
from agent.wire import Manifest, ModelConfig

log = logging.getLogger(__name__)


def lock_state_dir(state_dir: Path) -> int:
    """Hold the state directory for this agent (an open descriptor: close it to let go).

    Two agents on one state directory (another socket, the same --state-dir) shared its telemetry
    database, models, links and update journal, and took the device's MQTT session from each other.
    An flock, so the kernel lets go when the process ends however it ends: no stale lock after a SIGKILL.
    It is taken on the directory itself, which a read-only file system (an SD card ext4 remounted after an
    I/O error) lets us open too, where creating a lock file fails, and a lock on a file that may or may not
    exist would let two agents in. agent.lock names the holder, when it can.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _lock_holder(state_dir / "agent.lock")
        raise ServeError(f"another edge-agent{f' (pid {holder})' if holder else ''} is using the state "
                         f"directory {state_dir}") from None
    try:
        (state_dir / "agent.lock").write_text(f"{os.getpid()}\n")
    except OSError as e:
        if e.errno != errno.EROFS:
            os.close(fd)
            raise
        log.error("the state directory %s is on a read-only file system: serving, with telemetry kept in "
                  "memory, and updates fail, until the agent starts on it writable again", state_dir)
    return fd


def _lock_holder(pid_file: Path) -> int | None:
    """The pid agent.lock names, if that process is alive (on a read-only disk the file can be a dead run's)."""
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def names_store_current(model: Path, state_dir: Path) -> bool:
    """Whether `model` is the store's own `current` link (as the shipped agent.toml names it), whose
    fall-back to `previous` the store decides."""
    return Path(model).absolute() == (Path(state_dir) / "current").absolute()


def environment_problems(config: AgentConfig) -> list[str]:
    """What `serve` would refuse at start on this machine, found without starting anything (check-config):
    every refusal serve makes before it loads the model has its check here, so check-config's "ok" holds."""
    problems = []
    state = config.telemetry.state_dir
    if config.model is not None:
        candidates = [Path(config.model)]
        if names_store_current(config.model, state):  # serve falls back to previous
            candidates.append(state / "previous")
        errors, readable, manifest = [], None, None
        for path in candidates:
            try:
                manifest = Manifest.read(path)
                readable = path
                break
            except (OSError, ValueError) as e:
                errors.append(f"{path}: {str(e).splitlines()[0]}")
        else:
            problems.append(f"model: not a readable bundle ({'; '.join(errors)})")
        if config.engine.kv_dtype == "int8" and readable:
            try:  # serve would refuse to start, leaving the device off the network
                open_bundle(readable, verify_files=False).graph("int8")
            except (OSError, ValueError) as e:
                problems.append(f"engine.kv_dtype: \"int8\" needs the bundle's int8 KV cache graph: {e}")
        if readable and (problem := _budget_below_weights(config, readable, manifest)):
            problems.append(problem)
    elif not ((state / "current").exists() or (state / "previous").exists()):
        problems.append(f"model: none set and no installed model in {state}")
    if config.engine.speculative == "draft" and (config.model is None or (manifest and manifest.draft is None)):
        problems.append(_no_draft(config.model if config.model is not None and readable else None))
    if config.api.socket_group is not None:
        try:
            group_id(config.api.socket_group)
        except ServeError as e:
            problems.append(f"api.{e}")
    loaded = {}
    for key in ("trusted_keys", "job_keys"):
        try:
            loaded[key] = load_trusted_keys(list(getattr(config.updates, key)))
        except (OSError, ValueError) as e:
            problems.append(f"updates.{key}: {str(e).splitlines()[0]}")
    if both := set(loaded.get("trusted_keys", {})) & set(loaded.get("job_keys", {})):
        problems.append(f"updates.job_keys: key {sorted(both)[0]} is also a manifest key (trusted_keys): the job key "
                        "lives on the fleet server, so the manifest key would no longer be offline; use two keys")
    for key, directory in (("telemetry.state_dir", state), ("api.socket", Path(config.api.socket).parent)):
        if problem := _not_writable(directory):  # serve would fail "Read-only file system", for the
            problems.append(f"{key}: {problem}")  # socket without naming a path
    return problems


def _no_draft(model: Path | None) -> str:
    """serve loads the draft model its bundle carries: one without (or an unknown one, when no model is set and
    the store's may change with every update) would stop serve at start."""
    which = f"{model} carries none" if model is not None else "set `model` to a bundle that carries one"
    return (f'engine.speculative: "draft" needs a bundle that carries a draft model (edge-quantize build --draft): '
            f'{which}; "ngram" (prompt lookup) or "off" need none')


def _budget_below_weights(config: AgentConfig, bundle: Path, manifest: Manifest) -> str | None:
    """A budget that cannot hold even the weights' file and one min_context sequence of KV. Serve measures
    the exact need when it loads the model (the weights as ONNX Runtime holds them plus the runtime, ~200 MB
    more for SmolLM2); this is only a floor that needs no loading (a 64 MB budget fails it)."""
    try:
        model = ModelConfig.read(bundle)
    except (OSError, ValueError):  # serve's own load names what is wrong with the bundle
        return None
    weights = sum(f.size_bytes for name, f in manifest.files.items() if name.endswith(".data"))
    per_token = kv_bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim,
                                   1 if config.engine.kv_dtype == "int8" else 4)
    tokens = config.engine.min_kv_tokens(model.context_length)
    floor = weights + tokens * per_token
    if config.engine.memory_budget_mb * MB >= floor:
        return None
    moe = f", {describe_parameters(manifest.parameters)}" if manifest.parameters is not None else ""
    return (f"engine.memory_budget_mb: {config.engine.memory_budget_mb} MB cannot hold the model's weights "
            f"({weights / MB:.0f} MB{moe}) and one {tokens}-token sequence, let alone the runtime; "
            "serve names the exact need when it starts")


def parameters_note(config: AgentConfig) -> str:
    """What check-config's "ok" adds for a Mixture of Experts bundle (total and active parameters); "" for a dense
    model, no model, or a bundle whose manifest serve will read again and judge."""
    if config.model is None:
        return ""
    try:
        manifest = Manifest.read(config.model)
    except (OSError, ValueError):
        return ""
    return "" if manifest.parameters is None else f", {describe_parameters(manifest.parameters)}"


# Of the memory a process may have (the RAM, or its cgroup's memory.max) the budget may take at most this: the
# rest is for the page cache of the model files and the kernel, which the cgroup counts too (the shipped unit:
# a 1024 MB budget under MemoryMax=1280M)
BUDGET_OF_LIMIT = 0.8


def fitted_budget(config: AgentConfig) -> AgentConfig:
    """config with memory_budget_mb lowered to fit what this process may use, said at ERROR: above the
    service's MemoryMax= (or the RAM) the kernel would kill the agent under load where the budget would have
    refused requests. Lowered rather than refused: an agent that does not
    start is off the network too, with nobody there to edit its config."""
    limit = memory_limit_bytes()
    if limit is None or config.engine.memory_budget_mb * MB <= limit * BUDGET_OF_LIMIT:
        return config
    fitted = int(limit * BUDGET_OF_LIMIT) // MB
    log.error("engine.memory_budget_mb = %d is above %.0f%% of the %d MB this process may use (the machine's "
              "memory, or its cgroup's memory limit: systemd's MemoryMax=): using %d MB; set it so in the config",
              config.engine.memory_budget_mb, BUDGET_OF_LIMIT * 100, limit // MB, fitted)
    return config.model_copy(update={"engine": config.engine.model_copy(update={"memory_budget_mb": fitted})})


def _not_writable(directory: Path) -> str | None:
    """Why this process could not create files in directory (creating it and its parents first), if so."""
    existing = Path(directory).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):  # a read-only mount too, even for root
        return f"{existing} is not writable by this user"
    return None

