"""What the device does when the fleet asks: one function per command of wire.COMMANDS, dispatched by name.

Pure dispatch over a small interface (`Device`: the running config, the live settings and two injected
actions), so it runs without an engine or a broker in tests; agent.link.telemetry wires the real one. Every
command's args are validated with pydantic and an error names what was wrong. set_config applies what
can change while the agent runs (sampling defaults) and refuses the rest with the reason (the memory
budget sizes the KV cache at load; onnxruntime fixes its threads when the session is created).

Example:
    commands = Commands(Device(config=AgentConfig(), settings=LiveSettings()))
    commands("ping", CommandRequest())  # -> CommandResponse(command="ping", ok=True, result={...})
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agent.config import MAX_THREADS, AgentConfig
from agent.engine.sampling_params import SamplingParams
from agent.wire import SMOKE_PROMPT, CommandRequest, CommandResponse, RequestFigures


# ---- arguments, validated at the boundary ---------------------------------------------------------------
class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingDefaults(_Args):
    """Defaults for what an API request leaves out; None: the OpenAI default applies."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @model_validator(mode="after")
    def _in_range(self):
        try:  # the ranges are SamplingParams' own, so the two can never disagree
            SamplingParams(**self.given())
        except ValidationError as e:
            raise ValueError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
        return self

    def given(self) -> dict:
        return self.model_dump(exclude_none=True)


class ConfigChange(_Args):
    memory_budget_mb: int | None = Field(None, ge=64)
    threads: int | None = Field(None, ge=1, le=MAX_THREADS)
    sampling: SamplingDefaults | None = None

    @model_validator(mode="after")
    def _not_empty(self):
        if not self.model_dump(exclude_none=True):
            raise ValueError("set_config needs at least one of: memory_budget_mb, threads, sampling")
        return self


class BenchmarkArgs(_Args):
    prompt: str = Field(SMOKE_PROMPT, min_length=1, max_length=4096)
    max_tokens: int = Field(32, ge=1, le=512)


class _NoArgs(_Args):
    pass


# ---- what the commands act on ----------------------------------------------------------------------------
class LiveSettings:
    """The settings the fleet may change while the agent runs. Readers take the current frozen value;
    set_config swaps it whole, so a request never sees half an update. (AgentConfig itself never changes.)"""

    def __init__(self, sampling: SamplingDefaults = SamplingDefaults()):
        self._sampling = sampling
        self._lock = threading.Lock()

    @property
    def sampling(self) -> SamplingDefaults:
        return self._sampling

    def update_sampling(self, change: SamplingDefaults) -> SamplingDefaults:
        """Merge change into the defaults; a field it sets to null is cleared, a field it leaves out is kept:
        null is how a default, once set, is removed without a restart."""
        cleared = {k for k in change.model_fields_set if getattr(change, k) is None}
        with self._lock:
            merged = {**self._sampling.given(), **change.given()}
            self._sampling = SamplingDefaults(**{k: v for k, v in merged.items() if k not in cleared})
            return self._sampling


class CommandError(Exception):
    """A command that cannot be carried out; the message is the answer's error."""


@dataclass(frozen=True)
class Device:
    config: AgentConfig  # the running config (never changed)
    settings: LiveSettings
    benchmark: Callable[[BenchmarkArgs], RequestFigures] | None = None  # None: no model loaded
    flush: Callable[[], dict] | None = None  # None: no broker configured
    # queues a rollback job (agent.updates.service), raising CommandError if it cannot be queued; None: not wired
    rollback: Callable[[], dict] | None = None
    clock: Callable[[], float] = field(default=time.time)


# ---- dispatch -------------------------------------------------------------------------------------------
class Commands:
    """The command handler agent.link.mqtt calls: (name, request) -> response; never raises for a bad request."""

    def __init__(self, device: Device):
        self.device = device
        self.table: dict[str, Callable[[dict], CommandResponse]] = {
            "ping": self.ping, "get_config": self.get_config, "set_config": self.set_config,
            "benchmark": self.benchmark, "telemetry_flush": self.telemetry_flush, "rollback": self.rollback}

    def __call__(self, name: str, request: CommandRequest) -> CommandResponse:
        command = self.table.get(name)
        if command is None:
            return _error(name, f"{name!r} is not available on this device")
        try:
            return command(request.args)
        except ValidationError as e:
            return _error(name, "bad args: " + "; ".join(
                f"{'.'.join(map(str, err['loc'])) or 'args'}: {err['msg'].removeprefix('Value error, ')}"
                for err in e.errors()[:3]))
        except CommandError as e:
            return _error(name, str(e))

    def ping(self, args: dict) -> CommandResponse:
        _NoArgs.model_validate(args)
        return _ok("ping", {"pong": True, "ts": self.device.clock()})

    def get_config(self, args: dict) -> CommandResponse:
        _NoArgs.model_validate(args)
        config = self.device.config.model_dump(mode="json")  # secrets dump as "**********"
        # a mode reads as configured and as chmod takes it ("0660"), not as the integer it is (432)
        config["api"]["socket_mode"] = format(self.device.config.api.socket_mode, "04o")
        return _ok("get_config", {"config": config, "sampling_defaults": self.device.settings.sampling.given()})

    def set_config(self, args: dict) -> CommandResponse:
        if unknown := sorted(set(args) - set(ConfigChange.model_fields)):  # named, with what would be understood
            raise CommandError(f"unknown setting {', '.join(map(repr, unknown))}: set_config takes "
                               f"{', '.join(ConfigChange.model_fields)}")
        change = ConfigChange.model_validate(args)
        applied, refused = {}, {}
        engine = self.device.config.engine
        for key, why in (("memory_budget_mb", "the KV cache is sized from the memory budget when the model loads"),
                         ("threads", "onnxruntime fixes its intra-op threads when the session is created")):
            wanted = getattr(change, key)
            if wanted is None:
                continue
            if wanted == getattr(engine, key):
                applied[key] = wanted  # already so
            else:
                refused[key] = f"needs a restart: {why}; set engine.{key} in the config file"
        if change.sampling is not None:
            applied["sampling"] = self.device.settings.update_sampling(change.sampling).given()
        result = {"applied": applied, "refused": refused}
        if refused:
            return CommandResponse(command="set_config", ok=False, result=result,
                                   error="; ".join(f"{k}: {v}" for k, v in refused.items()))
        return _ok("set_config", result)

    def benchmark(self, args: dict) -> CommandResponse:
        spec = BenchmarkArgs.model_validate(args)
        if self.device.benchmark is None:
            raise CommandError("no model is loaded")
        return _ok("benchmark", {"figures": self.device.benchmark(spec).model_dump()})

    def telemetry_flush(self, args: dict) -> CommandResponse:
        _NoArgs.model_validate(args)
        if self.device.flush is None:
            raise CommandError("no broker is configured: telemetry is only recorded")
        return _ok("telemetry_flush", self.device.flush())


    def rollback(self, args: dict) -> CommandResponse:
        if self.device.rollback is None:
            raise CommandError("rollback is not available on this device (no model updates are wired)")
        _NoArgs.model_validate(args)
        return _ok("rollback", self.device.rollback())


def run_benchmark(engine, spec: BenchmarkArgs) -> RequestFigures:
    """A short greedy generation on a running engine (agent.engine.engine.Engine), EOS ignored so that every run
    produces spec.max_tokens tokens; its figures are the benchmark's result."""
    from agent.engine.request import RequestError

    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    try:
        finished = engine.generate(engine.tokenizer.encode(spec.prompt), params)
    except RequestError as e:
        raise CommandError(f"the engine refused the benchmark: {e}") from e
    if finished.error:
        raise CommandError(f"the benchmark failed: {finished.error}")
    return finished.figures


def _ok(name: str, result: dict) -> CommandResponse:
    return CommandResponse(command=name, ok=True, result=result)


def _error(name: str, error: str) -> CommandResponse:
    return CommandResponse(command=name, ok=False, error=error)
