"""Every format that crosses a boundary, defined once: ONNX graph I/O names and the model bundle manifest.

The quantizer writes these, the agent reads them, the fleet signs and ships them; all three import this
module so that a name or a field can never drift between writer and reader. (MQTT topics and telemetry
messages join this module with the telemetry issue.)
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

# ---- ONNX decoder graph I/O -------------------------------------------------------------------------
INPUT_IDS = "input_ids"  # int64 [batch, seq]
SEQLENS_K = "seqlens_k"  # int32 [batch]: tokens in the cache after this step, minus one (GQA's definition)
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"  # int32 scalar: an upper bound of seqlens_k + 1
QUERY_SEQLENS = "query_seqlens"  # int32 [batch]: valid (non-padded) tokens of each row in this step
LOGITS_INDICES = "logits_indices"  # int64 [batch, n]: positions within seq whose logits are wanted
LOGITS = "logits"  # float32 [batch, n, vocab]


def past_key(i: int) -> str:
    return f"past_key_values.{i}.key"  # [batch, kv_heads, capacity, head_dim], shared with present


def past_value(i: int) -> str:
    return f"past_key_values.{i}.value"


def present_key(i: int) -> str:
    return f"present.{i}.key"


def present_value(i: int) -> str:
    return f"present.{i}.value"


# ---- Bundle -----------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
MODEL_CONFIG = "model_config.json"
GRAPH = "model.onnx"
GRAPH_DATA = "model.onnx.data"
TOKENIZER = "tokenizer.json"
MANIFEST_SCHEMA_VERSION = 1
SMOKE_PROMPT = "The capital of France is"  # the golden continuation's prompt, as plain text (no template)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileEntry(_Frozen):
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    size_bytes: int = Field(ge=0)


class Quality(_Frozen):
    """Next-token agreement with the fp32 reference graph over an evaluation text (see quantize.evaluate)."""

    tokens: int
    perplexity: float
    reference_perplexity: float
    mean_kl: float
    p99_kl: float
    top1_agreement: float  # 0-1
    text_sha256: str


class Golden(_Frozen):
    """A greedy continuation the bundle must reproduce on a device after install (its health check)."""

    prompt: str
    prompt_ids: list[int]
    continuation_ids: list[int]


class Manifest(_Frozen):
    schema_version: int = MANIFEST_SCHEMA_VERSION
    name: str  # model name, e.g. "smollm2-135m-instruct"
    version: str  # e.g. "int4-s32-3f2a9c1d": precision + settings + a short content hash
    precision: str
    quant: dict  # the QuantSpec that built it
    source_sha256: str
    source_name: str
    created_at: str  # ISO 8601 UTC
    files: dict[str, FileEntry]  # relative path -> hash and size, every file but the manifest itself
    quality: Quality | None = None
    golden: Golden

    def canonical_bytes(self) -> bytes:
        """The bytes a signature covers: sorted keys, no whitespace, UTF-8."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def read(cls, bundle: Path) -> "Manifest":
        return cls.model_validate_json((Path(bundle) / MANIFEST).read_bytes())


class ModelConfig(_Frozen):
    """model_config.json: what the agent needs to run the graph and talk to users."""

    name: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    precision: str
    quant: dict

    @classmethod
    def read(cls, bundle: Path) -> "ModelConfig":
        return cls.model_validate_json((Path(bundle) / MODEL_CONFIG).read_bytes())


# ---- Per-request figures (the engine computes them; the API, telemetry and the fleet carry them) --------
class RequestFigures(_Frozen):
    """What one request cost and how fast it ran. Times are wall-clock, monotonic, in milliseconds."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    queue_ms: float  # submission -> admitted into the batch
    ttft_ms: float  # submission -> first token (includes queue_ms)
    prefill_tokens_per_s: float  # prompt tokens computed / prefill time
    decode_tokens_per_s: float  # (completion_tokens - 1) / (last token - first token); 0 if < 2 tokens
    itl_p50_ms: float  # inter-token latency percentiles over the decode
    itl_p95_ms: float
    e2e_ms: float  # submission -> finished
    kv_bytes: int  # KV-cache bytes the request's slot reserved
    finish_reason: str  # stop | length | cancelled | error
    preemptions: int = 0
