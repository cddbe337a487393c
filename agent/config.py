"""Agent configuration: one pydantic model, validated once at start, never mutated afterwards.

Values come from the TOML config file and command-line flags (flags win); an unknown key or a bad value
is an error that names the key and what is allowed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path | None = None
    engine: EngineConfig = EngineConfig()
