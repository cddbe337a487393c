"""Every format that crosses a boundary, defined once: the ONNX graph's I/O names; the model bundle (its file
names, manifest, geometry and model_config.json); the per-request figures and which requests their
percentiles count; the MQTT topics under edge/v1 and the messages on them (device state, telemetry
batches, commands and their responses); and the model update jobs (job documents, states, status reports).

The quantizer writes bundles and the agent reads them; the agent and the fleet talk over the topics; the
fleet signs and ships bundles as jobs. All three import this module, so that a name or a field can never
drift between writer and reader.
"""
from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

# ---- ONNX decoder graph I/O (defined in agent.graph_io, re-exported: wire is where importers look) ---------
from agent.graph_io import (INPUT_IDS, LOGITS, LOGITS_INDICES, LORA_PROJECTION_OF, LORA_PROJECTIONS,  # noqa: F401, E402
                            LORA_TARGETS, QUERY_SEQLENS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, LoraTarget, lora_a, lora_b,
                            past_key, past_value, present_key, present_value)


# ---- Bundle -----------------------------------------------------------------------------------------
MANIFEST = "manifest.json"
MODEL_CONFIG = "model_config.json"
GRAPH = "model.onnx"
GRAPH_DATA = "model.onnx.data"
GRAPH_INT8_KV = "model.int8kv.onnx"  # the same graph (and GRAPH_DATA) with an int8 KV cache; optional
TOKENIZER = "tokenizer.json"
# The graph's RoPE tables are Cos / Sin of Range(0, limit) x inverse frequencies, folded to constants when a session
# loads; these scalar float32 initializers are each table's limit (the global base's, the windowed layers' own).
# A runner may lower them to the positions it will use (agent.engine.runner.graph_for_positions).
ROPE_TABLE_LIMITS = ("/model/rotary.limit", "/model/rotary_local.limit")
DRAFT_DIR = "draft"  # a bundle's draft model for speculative decoding: a whole bundle in this folder
MANIFEST_SCHEMA_VERSION = 1
# A converted LoRA adapter (edge-quantize adapter): a folder of these two files
ADAPTER_FILE = "adapter.onnx_adapter"  # ONNX Runtime's adapter format: the graph's LoRA inputs, by name
ADAPTER_MANIFEST = "adapter_manifest.json"
ADAPTER_SCHEMA_VERSION = 1
SMOKE_PROMPT = "The capital of France is"  # the golden continuation's prompt, as plain text (no template)


class _Frozen(BaseModel):
    # no NaN or Infinity: JSON allows neither, and one in a stored figure broke the fleet's queries for all
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ints_fit_sqlite(self):
        # the fleet binds these to 64-bit INTEGER columns: one device's 2**63 stopped its database writer
        for name, value in self:
            if type(value) is int and not -(2**63) <= value < 2**63:
                raise ValueError(f"{name} does not fit a 64-bit integer")
        return self


EPOCH_SECONDS = Field(ge=0, lt=2**33)  # a time the fleet stores and shows as a date: before the year 2242


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


# What a new model's name must be: one path segment (models/NAME@VERSION on a device, the fleet's artifacts
# directory) and one URL segment, without the '@' that joins name and version. A name '../../x' was
# published outside the artifacts directory, and 'a@b' could never be deployed. Checked where names are
# made (build) and accepted (publish), not when a manifest is read: bundles built before must still load.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$"
# A model's name or version (and the agent's version) in telemetry and device state: the fleet groups its
# tables and report by them and names a model NAME@VERSION. Versions have always fit ("int4-b64a-3f2a9c1d").
ModelName = Annotated[str, Field(pattern=MODEL_NAME_PATTERN)]
Precision = Literal["fp32", "int8", "int4"]  # quantize.precision.Precision's values (tests/test_wire.py pins them)


def canonical_json(model: BaseModel, exclude: frozenset[str] = frozenset()) -> bytes:
    """What a signature covers: every field (None ones too) but `exclude`, sorted keys, no whitespace, UTF-8.
    A receiver computes it from the model it parsed, so the sender's own JSON layout does not matter."""
    return json.dumps(model.model_dump(mode="json", exclude=set(exclude)), sort_keys=True,
                      separators=(",", ":")).encode()


OPTIONAL_MANIFEST_FIELDS = ("draft", "lora", "parameters")  # Manifest fields left out of its JSON while None


class Parameters(_Frozen):
    """A model's parameter counts: every weight (what memory holds: a Mixture of Experts keeps all its experts
    resident) and those one token's forward pass reads (what decode speed follows)."""

    total: int = Field(ge=0)
    active: int = Field(ge=0)


class DraftRef(_Frozen):
    """The draft model a bundle carries in DRAFT_DIR (edge-quantize build --draft): its own manifest's name and
    version. Its files are the bundle's files too, so the one signature and the one download cover both."""

    name: str
    version: str


class LoraCapacity(_Frozen):
    """Which projections of an adapter-ready bundle take an adapter, and up to which rank each."""

    targets: list[LoraTarget] = Field(min_length=1)  # in LORA_TARGETS' order
    max_rank: int = Field(ge=1, le=1024)


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
    draft: DraftRef | None = None
    lora: LoraCapacity | None = None  # set for an adapter-ready bundle (edge-quantize build --lora-targets)
    parameters: Parameters | None = None  # set for a Mixture of Experts (None: dense, every parameter active)

    @model_serializer(mode="wrap")
    def _optional_fields_only_when_set(self, handler):
        # fields added after the first agents are left out while unset: a bundle without them keeps its bytes
        # (and so its signature), and agents from before them, whose schema forbids unknown keys, still read it
        data = handler(self)
        for key in OPTIONAL_MANIFEST_FIELDS:
            if isinstance(data, dict) and data.get(key, ...) is None:
                del data[key]
        return data

    def canonical_bytes(self) -> bytes:
        """The bytes a signature covers: sorted keys, no whitespace, UTF-8."""
        return canonical_json(self)

    @classmethod
    def read(cls, bundle: Path) -> "Manifest":
        return cls.model_validate_json((Path(bundle) / MANIFEST).read_bytes())


class AdapterManifest(_Frozen):
    """adapter_manifest.json: a converted LoRA adapter, the one base bundle it fits, and what it was measured to do
    there. Its tensors are never merged into the base's quantized weights: they run beside them."""

    schema_version: int = ADAPTER_SCHEMA_VERSION
    name: ModelName  # e.g. "support-bot"
    version: ModelName  # "r8-3f2a9c1d": the largest rank + a short hash of the files
    base_name: str  # the bundle it fits: Manifest.name ...
    base_version: str  # ... and Manifest.version (another build of the same model has other weights)
    rank: int = Field(ge=1)  # the largest of ranks
    ranks: dict[LoraTarget, int]  # target -> its rank (the largest over layers); only the adapted targets
    layers: list[int]  # the layers it adapts
    source_sha256: str  # of the PEFT adapter_model.safetensors
    source_name: str
    created_at: str  # ISO 8601 UTC
    files: dict[str, FileEntry]  # every file but this manifest
    # measured on the base bundle with the adapter active: its greedy continuation (the install's health check)
    # and its quality against the fp32 model with W + scale * B A merged (None: no fp32 source was given)
    golden: Golden
    quality: Quality | None = None

    @property
    def targets(self) -> list[LoraTarget]:
        return list(self.ranks)

    def canonical_bytes(self) -> bytes:
        return canonical_json(self)

    @classmethod
    def read(cls, folder: Path) -> "AdapterManifest":
        return cls.model_validate_json((Path(folder) / ADAPTER_MANIFEST).read_bytes())


class Geometry(_Frozen):
    """A decoder's shape (dense, or a Mixture of Experts): what the quantizer reads from a checkpoint and builds the
    graph by, and what the agent sizes its KV cache by (a bundle's model_config.json holds it, in ModelConfig)."""

    architecture: str  # a row of quantize.architectures.ARCHITECTURES
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
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    sliding_window: int | None = None  # Mistral-style local attention, None when unused
    # RoPE scaling: divisors of its frequencies (quantize.rope), already in the graph's cos/sin tables
    rope_freq_factors: tuple[float, ...] | None = None
    # The per-model numbers of the block variants quantize.architectures names; the defaults are Llama's, so a
    # model_config.json that leaves them out describes the same model. The agent reads none of them.
    window_layers: tuple[int, ...] | None = None  # the layers sliding_window applies to; None: every layer
    rope_local_theta: float | None = None  # RoPE base of the window_layers (Gemma 3), None: rope_theta
    nope_layers: tuple[int, ...] = ()  # layers without RoPE (SmolLM3)
    rotary_dim: int | None = None  # the leading channels of each head that RoPE turns (Phi-4-mini), None: all
    rope_attention_factor: float = 1.0  # LongRoPE's scale on cos and sin
    embedding_multiplier: float = 1.0  # Gemma's sqrt(hidden), Granite's embedding_multiplier
    attention_scale: float | None = None  # softmax scale, None: 1/sqrt(head_dim)
    residual_multiplier: float = 1.0  # on each block's output before the residual add (Granite)
    logit_multiplier: float = 1.0  # on the logits (Granite's 1/logits_scaling)
    # Mixture of Experts (quantize.architectures' MoE rows): each layer's MLP is num_experts experts of
    # intermediate_size, num_experts_per_tok of them run per token, their weights renormalised to sum to 1 when
    # moe_renormalize. 0 experts: a dense model.
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_renormalize: bool = False

    @model_validator(mode="after")
    def _experts_per_token_fit(self):
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is not in 1..num_experts "
                             f"({self.num_experts})")
        return self


class ModelConfig(Geometry):
    """model_config.json: the model's geometry, and what the agent needs to talk to users."""

    name: str
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    precision: str
    quant: dict

    @model_serializer(mode="wrap")
    def _name_first(self, handler):
        # the key order model_config.json has always had (name, the geometry, the rest): a bundle's version
        # ends in a hash of its files' bytes, so the same build must write the same bytes
        data = handler(self)
        return {"name": data.pop("name"), **data} if "name" in data else data

    @classmethod
    def read(cls, bundle: Path) -> "ModelConfig":
        return cls.model_validate_json((Path(bundle) / MODEL_CONFIG).read_bytes())


# ---- Per-request figures (the engine computes them; the API, telemetry and the fleet carry them) --------
# Why a request ended: the values of the engine's FinishReason (agent/engine/sequence.py; tests/test_wire.py
# pins the two), a closed set that the fleet's tables and report group by
FinishReason = Literal["stop", "length", "cancelled", "error"]
FINISH_REASONS = get_args(FinishReason)
# Counts, times and rates are never negative: a negative count made the fleet's "tokens served" go down.
Count = Annotated[int, Field(ge=0)]
Amount = Annotated[float, Field(ge=0)]


class RequestFigures(_Frozen):
    """What one request cost and how fast it ran. Times are wall-clock, monotonic, in milliseconds."""

    prompt_tokens: Count
    completion_tokens: Count
    cached_prompt_tokens: Count = 0  # prompt tokens whose KV came from the prefix cache
    queue_ms: Amount  # submission -> first admitted into the batch (a preempted request's later wait is not in it;
    # one never admitted: submission -> shed, cancelled or refused)
    # submission -> first token generated (includes queue_ms). Text that might begin a stop string is held back
    # from the stream until it is known not to be one, so a client may see its first text later
    ttft_ms: Amount
    prefill_tokens_per_s: Amount  # prompt tokens computed / prefill time
    decode_tokens_per_s: Amount  # (completion_tokens - 1) / (last token - first token); 0 if < 2 tokens
    # inter-token latency percentiles over the decode: the gaps between the steps that delivered tokens (a
    # speculative step's accepted tokens arrive at once: one gap). Like decode_tokens_per_s they include any
    # time the request spent preempted, since its client waited through it too
    itl_p50_ms: Amount
    itl_p95_ms: Amount
    e2e_ms: Amount  # submission -> finished
    kv_bytes: Count  # KV-cache bytes of the largest slot the request held
    finish_reason: FinishReason
    preemptions: Count = 0
    # speculative decoding: tokens proposed, and those verification accepted (the drafter's acceptance, so
    # including any a stop string then cut off)
    drafted_tokens: Count = 0
    accepted_tokens: Count = 0
    # structured output and tool calls: whether the output was held to a grammar, and the time its matcher took
    # (legality checks, masks, advances): what structure cost this request
    constrained: bool = False
    constraint_ms: Amount = 0.0


# ---- MQTT: topics and messages shared by the agent and the fleet (MQTT v5) ---------------------------------
# One versioned root; every device publishes only under its own id (the broker ACL enforces it).
#   edge/v1/{device}/state          retained DeviceState (birth; the Last Will sets status=offline)
#   edge/v1/{device}/tele           QoS 1 TelemetryBatch (records from the device's SQLite outbox)
#   edge/v1/{device}/evt/{kind}     QoS 1 Event
#   edge/v1/{device}/cmd/req/{name} CommandRequest, fleet -> device (v5 response topic + correlation data)
#   edge/v1/{device}/cmd/res        CommandResponse, device -> fleet
#   edge/v1/{device}/jobs/notify    JobDocument, fleet -> device (model updates)
#   edge/v1/{device}/jobs/update    JobStatusUpdate, device -> fleet
TOPIC_ROOT = "edge/v1"
MAX_PAYLOAD_BYTES = 256 * 1024  # larger messages are refused on both sides (models travel over HTTP)
# A PUBACK reason code (MQTT v5 3.4.2.1): the broker accepted the message and delivered it to no one
NO_MATCHING_SUBSCRIBERS = 0x10
MAX_EXPIRY_S = 2**32 - 1  # MQTT v5's Message Expiry Interval is a four-byte integer (3.3.2.3.3)


def topic(device_id: str, *parts: str) -> str:
    return "/".join((TOPIC_ROOT, device_id, *parts))


def device_of(mqtt_topic: str) -> str | None:
    """The device id a topic belongs to, or None if it is not under TOPIC_ROOT."""
    parts = mqtt_topic.split("/")
    return parts[2] if len(parts) > 3 and "/".join(parts[:2]) == TOPIC_ROOT else None


def shard_of(device_id: str, urls: Sequence[str]) -> str:
    """The broker of `urls` a device connects to when the fleet's devices are spread over several (rendezvous,
    or highest-random-weight, hashing: each URL scores sha256(url, device id) and the highest wins). The agent
    connects by it and the fleet routes a device it has not yet heard from by it, so both must list the brokers
    by the same URLs; the list's order never matters, and adding an nth broker moves only the ~1/n of the
    devices that now score highest on it."""
    if not urls:
        raise ValueError("shard_of needs at least one broker URL")
    return max(urls, key=lambda url: (hashlib.sha256(f"{url}\n{device_id}".encode()).digest(), url))


DEVICE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"  # no MQTT wildcards or separators
# A boot's id: the agent makes a uuid4 (36 characters) at every start. It is compared, never parsed, so any
# token of the device ids' alphabet is accepted, and nothing over 64 characters (every row stores it).
BOOT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
# One line of text as the fleet shows it (a CPU's name): no control characters (no terminal escapes), bounded
OneLine = Annotated[str, Field(max_length=128, pattern=r"^[^\x00-\x1f\x7f]*$")]


def is_device_id(text: str) -> bool:
    """Whether text can name a device (and so its topics): '#', '+' or '/' would break them."""
    return re.fullmatch(DEVICE_ID_PATTERN, text) is not None


class Hardware(_Frozen):
    cpu: OneLine  # platform.processor(), or the machine's name when it has none
    cores: Count
    memory_mb: Count
    arch: str = Field(pattern=r"^[A-Za-z0-9_.-]{0,32}$")  # platform.machine(): x86_64, aarch64, armv7l, ...


class DeviceState(_Frozen):
    """A device's retained state. The agent sends a bare one (no model, hardware or agent_version) when its
    description does not fit these fields (a bundle named before names were checked), rather than none."""

    device_id: str = Field(pattern=DEVICE_ID_PATTERN)
    status: str = Field(pattern=r"^(online|offline|stopped)$")
    # grows on every connect: a late Will from an older session is ignored. A JSON integer, as seq is
    connection: int = Field(ge=0, strict=True)
    boot_id: str = Field(pattern=BOOT_ID_PATTERN)
    ts: float = EPOCH_SECONDS
    model: ModelName | None = None
    version: ModelName | None = None
    precision: Precision | None = None
    hardware: Hardware | None = None
    agent_version: ModelName | None = None  # e.g. "0.1.0"


class RequestRecord(_Frozen):
    """One served request, as telemetry."""

    model: ModelName
    version: ModelName
    figures: RequestFigures
    adapter: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}@[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")

    @model_serializer(mode="wrap")
    def _adapter_only_when_set(self, handler):
        # the LoRA adapter it ran with, NAME@VERSION; left out while None: fleets from before adapters forbid
        # unknown keys, and would refuse the whole batch holding it
        data = handler(self)
        if isinstance(data, dict) and data.get("adapter", ...) is None:
            del data["adapter"]
        return data


class SampleRecord(_Frozen):
    """A periodic engine / system sample over an interval."""

    interval_s: Amount
    rss_mb: Amount
    cpu_percent: Amount
    kv_utilization: Amount
    queue_depth: Count
    running: Count
    tokens_per_s: Amount  # tokens generated over the interval / interval


class EventRecord(_Frozen):
    kind: str = Field(pattern=r"^[a-z_]{1,32}$")  # start, model_change, error, dropped_rows, ...
    detail: dict = {}

    @field_validator("detail")
    @classmethod
    def _strict_json(cls, detail: dict) -> dict:
        # NaN and Infinity parse, but are not JSON: stored, one device's NaN broke json_extract() over every
        # device's events, and `--json` output printed NaN
        try:
            json.dumps(detail, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"detail must be plain JSON: {e}") from None
        return detail


class TelemetryRecord(_Frozen):
    """The unit of delivery: (device_id, boot_id, seq) is unique, so the fleet drops replays."""

    boot_id: str = Field(pattern=BOOT_ID_PATTERN)
    seq: int = Field(ge=0, strict=True)  # a JSON integer: "7" is refused, not read as 7
    ts: float = EPOCH_SECONDS
    kind: str = Field(pattern=r"^(request|sample|event)$")
    request: RequestRecord | None = None
    sample: SampleRecord | None = None
    event: EventRecord | None = None


class TelemetryBatch(_Frozen):
    device_id: str = Field(pattern=DEVICE_ID_PATTERN)
    records: list[TelemetryRecord] = Field(min_length=1, max_length=1000)


class CommandRequest(_Frozen):
    """Body of cmd/req/{name}; the name is in the topic. Correlation data and response topic are MQTT v5
    properties, not body fields."""

    args: dict = {}


COMMANDS = ("ping", "get_config", "set_config", "benchmark", "telemetry_flush", "rollback")


class CommandResponse(_Frozen):
    command: str
    ok: bool
    result: dict = {}
    error: str | None = None


# ---- Model update jobs (AWS IoT Jobs' state names) -------------------------------------------------------
class JobState(str, enum.Enum):
    QUEUED = "QUEUED"
    IN_PROGRESS = "IN_PROGRESS"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    REJECTED = "REJECTED"  # refused before download: signature, key, budget, compatibility, downgrade
    TIMED_OUT = "TIMED_OUT"
    CANCELED = "CANCELED"


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.REJECTED, JobState.TIMED_OUT,
                                 JobState.CANCELED})


class JobStep(str, enum.Enum):
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    LOADING = "loading"
    HEALTH_CHECK = "health_check"
    ACTIVATING = "activating"


# install / rollback: a model bundle; install_adapter / remove_adapter: a LoRA adapter beside the base it fits
JobOperation = Literal["install", "rollback", "install_adapter", "remove_adapter"]
ADAPTER_OPERATIONS = frozenset({"install_adapter", "remove_adapter"})
OPTIONAL_JOB_FIELDS = frozenset({"adapter"})  # JobDocument fields added after the first agents


class JobDocument(_Frozen):
    """fleet -> device on jobs/notify: what to install and how to check it. Large files go over HTTP."""

    job_id: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    operation: JobOperation = "install"
    manifest: Manifest | None = None  # the signed manifest of an install (None for the other operations)
    # the signed manifest of an adapter job: the adapter to install, or the one to remove (by its name) from
    # the base build it names; left out of the JSON while None (OPTIONAL_JOB_FIELDS)
    adapter: AdapterManifest | None = None
    signature: str | None = None  # base64 Ed25519 signature over the canonical bytes of manifest or adapter
    key_id: str | None = None  # which trusted key signed it
    base_url: str | None = None  # files are fetched from base_url + "/" + path, with HTTP Range
    min_tokens_per_s: float | None = Field(None, ge=0)  # health-check floor; None: 70% of the current model's
    golden_tokens: int = Field(16, ge=1, le=64)  # golden continuation tokens that must match exactly
    allow_downgrade: bool = False
    # Set by a fleet that signs its jobs (edge-fleet serve --job-key) and required by a device that trusts
    # job keys ([updates] job_keys): the job is for this one device, not before issued_at (a device refuses
    # one issued before the last it ran) and not after expires_at, and the signature covers all of it.
    device_id: str | None = Field(None, pattern=DEVICE_ID_PATTERN)
    issued_at: float | None = None
    expires_at: float | None = None
    job_signature: str | None = None  # base64 Ed25519 over signed_bytes(), by the fleet's job key
    job_key_id: str | None = None

    @property
    def signed_manifest(self) -> Manifest | AdapterManifest | None:
        """What the manifest key's signature covers: the adapter of an adapter job, else the model's manifest."""
        return self.adapter if self.operation in ADAPTER_OPERATIONS else self.manifest

    def signed_bytes(self) -> bytes:
        return canonical_json(self, JOB_SIGNATURE_FIELDS | self._unset_optional())

    def wire_bytes(self) -> bytes:
        """The JSON sent on jobs/notify. The job-signing fields are left out when unset, so that agents from
        before them (whose schema forbids unknown fields) still take the jobs of a fleet that does not sign."""
        unset = {name for name in JOB_SIGNING_FIELDS if getattr(self, name) is None}
        return self.model_dump_json(exclude=unset | self._unset_optional()).encode()

    def _unset_optional(self) -> set[str]:
        # out of the JSON and the job signature while None: a job signed before the field existed keeps its bytes
        return {name for name in OPTIONAL_JOB_FIELDS if getattr(self, name) is None}

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        """Only what urllib can fetch over HTTP: anything else ('0', 'http://h:abc', a space) raised ValueError
        or http.client.InvalidURL out of the download, after the signature had been checked."""
        if url is None:
            return url
        parts = urlsplit(url)  # ValueError for an unclosed '[' (an IPv6 host): reported like the rest
        if (parts.scheme not in ("http", "https") or not parts.hostname or not url.isascii()
                or any(c.isspace() or not c.isprintable() for c in url)):
            raise ValueError("base_url must be an http:// or https:// URL with a host, in printable ASCII without "
                             "spaces (percent-encode the rest)")
        _ = parts.port  # ValueError for a port that is not a number in 0-65535
        return url


JOB_SIGNATURE_FIELDS = frozenset({"job_signature", "job_key_id"})
# JobStatusUpdate.figures key: the bytes an install fetched over HTTP (a resumed download counts what it fetched
# after the restart too): an adapter rollout's are the adapter's, not its base model's
DOWNLOADED_BYTES = "downloaded_bytes"
JOB_SIGNING_FIELDS = JOB_SIGNATURE_FIELDS | {"device_id", "issued_at", "expires_at"}


class JobStatusUpdate(_Frozen):
    """device -> fleet on jobs/update: where a job stands on this device."""

    job_id: str
    device_id: str = Field(pattern=DEVICE_ID_PATTERN)
    state: JobState
    step: JobStep | None = None
    percent: float | None = None  # download progress
    reason: str | None = None  # why FAILED / REJECTED; IN_PROGRESS downloading: "retrying: <why>"
    figures: dict = {}  # measured health-check figures on SUCCEEDED, and DOWNLOADED_BYTES
    ts: float = EPOCH_SECONDS
