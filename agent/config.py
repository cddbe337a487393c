"""Agent configuration: one pydantic model, validated once at start, never mutated afterwards.

Values come from the TOML config file and command-line flags (flags win); an unknown key or a bad value
is an error that names the key and what is allowed.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    threads: int | None = Field(None, ge=1, le=256, description="intra-op threads; None: the cores this process may use")
    memory_budget_mb: int = Field(1024, ge=64, description="the whole process: weights, KV cache, activations, runtime")
    max_context: int | None = Field(None, ge=16, description="tokens per sequence; None: the model's context length")
    min_context: int = Field(512, ge=16, description="the budget must hold at least one sequence this long")
    kv_smallest_class: int = Field(256, ge=16, description="capacity of the smallest KV slot class, in tokens")
    prefill_chunk_tokens: int = Field(256, ge=16, le=8192, description="prompt tokens computed per engine step")
    max_queue: int = Field(64, ge=0, description="requests that may wait for a slot before 'overloaded'")
    max_queue_wait_s: float = Field(60.0, gt=0, description="a request waiting longer ends as 'overloaded'")
    prefix_cache_fraction: float = Field(0.2, ge=0, lt=1, description="share of the KV budget kept for prefix blocks")
    prefix_block_tokens: int = Field(16, ge=1, le=1024, description="prefix-cache granularity, in tokens")
    kv_dtype: Literal["fp32"] = "fp32"
    speculative: Literal["off", "ngram", "draft"] = Field("off", description="default speculative decoding mode")
    speculative_max_batch: int = Field(2, ge=1, description="no drafts when more sequences than this decode at once")


def _octal(value: object) -> object:
    # TOML writes modes as 0o660; a string "0660" or "660" is read as octal too, as chmod reads it.
    return int(value, 8) if isinstance(value, str) else value


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:8080' or '[::1]:8080' -> (host, port); ValueError naming the expected form."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"tcp must be HOST:PORT with a port in 1-65535, e.g. 127.0.0.1:8080; got {address!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


class ApiConfig(BaseModel):
    """The local HTTP API: where it listens and what it accepts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    socket: Path = Field(Path("/run/edge-agent/api.sock"), description="Unix socket the API listens on")
    socket_mode: Annotated[int, BeforeValidator(_octal)] = Field(0o660, ge=0, le=0o777,
                                                                 description="permission bits of the socket file")
    socket_group: str | None = Field(None, description="group owning the socket: its members may connect")
    tcp: str | None = Field(None, description="also listen on HOST:PORT; loopback only unless tcp_any_host")
    tcp_any_host: bool = Field(False, description="allow a tcp host other than loopback (the API has no auth)")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies are refused (413)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429 'overloaded' answer")
    drain_timeout_s: float = Field(30.0, ge=0, description="on shutdown, time in-flight requests get to finish")

    @model_validator(mode="after")
    def _check_tcp(self):
        if self.tcp is not None:
            host, _ = split_host_port(self.tcp)
            if not self.tcp_any_host and not _is_loopback(host):
                raise ValueError(f"tcp host {host!r} is not loopback; set tcp_any_host = true to listen on it")
        return self

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return split_host_port(self.tcp) if self.tcp else None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path | None = None
    engine: EngineConfig = EngineConfig()
    api: ApiConfig = ApiConfig()
