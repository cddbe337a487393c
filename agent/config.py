"""Agent configuration: one pydantic model, validated once at start, never mutated afterwards.

Values come from the TOML config file and command-line flags (flags win); an unknown key or a bad value
is an error that names the key and what is allowed.
"""
from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, SecretStr, ValidationError,
                      field_validator, model_validator)

from agent.mqtt_link import KEEPALIVE_S, parse_url
from agent.wire import DEVICE_ID_PATTERN, ModelName, shard_of

MAX_THREADS = 256  # ONNX Runtime thread pools: 100,000 threads took 17 GB in seconds


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    threads: int | None = Field(None, ge=1, le=MAX_THREADS,
                                description="intra-op threads; None: the cores this process may use")
    memory_budget_mb: int = Field(1024, ge=64, description="the whole process: weights, KV cache, activations, runtime")
    max_context: int | None = Field(None, ge=16, description="tokens per sequence; None: the model's context length")
    min_context: int = Field(512, ge=16, description="the budget must hold at least one sequence this long")
    kv_smallest_class: int = Field(256, ge=16, description="capacity of the smallest KV slot class, in tokens")
    # 128 rather than 256: the same TTFT for 512- and 896-token prompts, ~8 MB less peak activation memory
    # and half the stall a long prompt puts between running streams' tokens (docs/benchmarks.md, what we tried)
    prefill_chunk_tokens: int = Field(128, ge=16, le=8192, description="prompt tokens computed per engine step "
                                      "(fewer deep into a long prompt while other requests decode)")
    # counted from submission to admission, so 0 refuses every request (tests use it to force 'overloaded')
    max_queue: int = Field(64, ge=0, description="requests that may wait for a slot before 'overloaded' "
                                                 "(0 refuses every request)")
    default_max_tokens: int = Field(1024, ge=1, description="completion limit of a chat request that sets none "
                                    "(OpenAI's is the whole context): where a runaway generation stops")
    max_queue_wait_s: float = Field(60.0, gt=0, description="a request waiting longer ends as 'overloaded'")
    prefix_cache_fraction: float = Field(0.2, ge=0, lt=1, description="share of the KV budget kept for prefix blocks")
    prefix_block_tokens: int = Field(16, ge=1, le=1024, description="prefix-cache granularity, in tokens")
    kv_dtype: Literal["fp32", "int8"] = Field("fp32", description="KV cache type: int8 holds 4x the tokens in a "
                                              "budget (static per-channel scales calibrated by edge-quantize; mean KL "
                                              "~0.01-0.02 against fp32 on SmolLM2 up to 8k tokens, in bundles built "
                                              "since 2026-12-05; quantize/kv_int8.py)")
    spin_wait: bool | Literal["auto"] = Field(
        "auto", description="ONNX Runtime threads spin between kernels and steps: ~1.3-1.5x faster decode on an "
                            "otherwise idle box, 0.6-0.7x when other processes compete for the cores "
                            "(docs/benchmarks.md). \"auto\" measures the cores' use by others at start and spins "
                            "only when they are idle, no cgroup CPU quota is set and there are 2 threads or more")
    speculative: Literal["off", "ngram", "draft"] = Field("off", description="default speculative decoding mode")
    speculative_max_batch: int = Field(2, ge=1, description="no drafts when more sequences than this decode at once")

    def sequence_limit(self, model_context: int) -> int:
        """Tokens a sequence may hold: max_context, at most the model's context."""
        return min(self.max_context or model_context, model_context)

    def min_kv_tokens(self, model_context: int) -> int:
        """The KV the budget must hold for one sequence: min_context, or less when a sequence may not be that long."""
        return min(self.min_context, self.sequence_limit(model_context))


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

    socket: Path = Field(Path("/run/edge-agent/agent.sock"), description="Unix socket the API listens on")
    socket_mode: Annotated[int, BeforeValidator(_octal)] = Field(0o660, ge=0, le=0o777,
                                                                 description="permission bits of the socket file")
    socket_group: str | None = Field(None, description="group owning the socket: its members may connect")
    tcp: str | None = Field(None, description="also listen on HOST:PORT; loopback only unless tcp_any_host")
    tcp_any_host: bool = Field(False, description="allow a tcp host other than loopback (the API has no auth)")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies are refused (413); bodies being "
                                "read or tokenized take at most four of these together (429 past that)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of a 429 'overloaded' answer")
    drain_timeout_s: float = Field(30.0, ge=0, le=50, description="on shutdown, time in-flight requests get to "
                                   "finish (under the unit's TimeoutStopSec=100, with the shutdown's other steps)")
    max_connections: int = Field(256, ge=1, description="connections served at once (waiting for a request or "
                                 "running one); a request past them gets 503 with Retry-After. As many again may "
                                 "wait for a place, so keep twice this under the process's file descriptor limit, "
                                 "LimitNOFILE=")
    max_connections_per_peer: int | None = Field(None, ge=1, description="of max_connections, the most one client "
                                                 "may hold (a Unix socket's peer uid, a TCP peer's address); None: "
                                                 "half of max_connections. Under the shipped unit (PrivateUsers=yes) "
                                                 "every user but root and the agent's own is seen as one: nobody")
    status_reserve: int = Field(4, ge=0, description="of max_connections, places only /health and /metrics may "
                                "take, so that they answer when requests fill the rest (at most half of them)")
    head_timeout_s: float = Field(5.0, gt=0, description="a connection must send its whole request head within "
                                  "this of opening or of its last response (and within request_timeout_s); idle or "
                                  "slow ones are closed, and under pressure one that takes over 1 s makes way")
    request_timeout_s: float = Field(30.0, gt=0, description="a connection must send a whole request head, and "
                                     "then its body, within this; idle or stalled ones are closed")

    @model_validator(mode="after")
    def _check_tcp(self):
        if self.tcp is not None:
            host, _ = split_host_port(self.tcp)
            if not self.tcp_any_host and not _is_loopback(host):
                raise ValueError(f"tcp host {host!r} is not loopback; set tcp_any_host = true to listen on it")
        return self

    @model_validator(mode="after")
    def _check_per_peer(self):
        if self.max_connections_per_peer is not None and self.max_connections_per_peer > self.max_connections:
            raise ValueError(f"max_connections_per_peer ({self.max_connections_per_peer}) must be at most "
                             f"max_connections ({self.max_connections})")
        return self

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        return split_host_port(self.tcp) if self.tcp else None

    @property
    def connections_per_peer(self) -> int:
        return self.max_connections_per_peer or max(1, self.max_connections // 2)

    @property
    def status_places(self) -> int:
        return min(self.status_reserve, self.max_connections // 2)

    @property
    def head_deadline_s(self) -> float:
        return min(self.head_timeout_s, self.request_timeout_s)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---- Telemetry and the MQTT link (telemetry issue) ------------------------------------------------------
def _check_mqtt_url(url: str) -> str:
    parse_url(url)  # LinkError, a ValueError, says what is wrong and the form expected
    return url


class MqttConfig(BaseModel):
    """Where the fleet's broker is and how the link behaves (agent.link.mqtt). Absent: the agent only keeps records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: Annotated[str, AfterValidator(_check_mqtt_url)] | None = Field(
        None, description="mqtt://HOST[:PORT] (1883) or mqtts://HOST[:PORT] (8883, TLS); or give shards")
    shards: list[Annotated[str, AfterValidator(_check_mqtt_url)]] | None = Field(
        None, min_length=1, description="brokers the fleet's devices are spread over, by the same URLs the fleet "
        "lists (edge-fleet serve --mqtt): this device connects to agent.wire.shard_of(device id, shards)")
    username: str | None = Field(None, description="broker user; the ACL expects the device id")
    password: SecretStr | None = Field(None, description="broker password (never printed)")
    ca_file: Path | None = Field(None, description="mqtts: CA bundle; None: the system's trust store")
    cert_file: Path | None = Field(None, description="mqtts: client certificate (mutual TLS), with key_file")
    key_file: Path | None = Field(None, description="mqtts: the client certificate's private key")
    keepalive_s: int = Field(KEEPALIVE_S, ge=5, le=65535, description="MQTT keep alive (a dead link is noticed in 1.5x this)")
    session_expiry_s: int = Field(7 * 24 * 3600, ge=0, le=2**32 - 1,
                                  description="how long the broker keeps our session (and queued commands) offline")
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP/TLS connect plus CONNACK")
    backoff_min_s: float = Field(1.0, gt=0, description="first reconnect delay (full jitter below it)")
    backoff_max_s: float = Field(120.0, gt=0, description="reconnect delays double up to this cap")
    batch_max_records: int = Field(200, ge=1, le=1000, description="telemetry records per TelemetryBatch")
    max_inflight_batches: int = Field(8, ge=1, le=64, description="batches awaiting PUBACK before the outbox waits")
    outbox_poll_s: float = Field(1.0, gt=0, description="the outbox looks for new rows at least this often")
    response_expiry_s: int = Field(60, ge=1, description="MessageExpiryInterval of command responses")

    @model_validator(mode="after")
    def _check_brokers(self):
        if (self.url is None) == (self.shards is None):
            raise ValueError("give exactly one of url (one broker) and shards (a list of broker URLs)")
        if self.shards is not None and len(set(self.shards)) != len(self.shards):
            raise ValueError("shards lists a broker URL twice")
        # one TLS setting (ca_file, cert_file) for every shard: a list that mixes mqtt:// and mqtts:// is a mistake
        if self.shards is not None and len({parse_url(u).tls for u in self.shards}) > 1:
            raise ValueError("shards must all be mqtt:// or all mqtts://")
        return self

    @model_validator(mode="after")
    def _check(self):
        if self.backoff_max_s < self.backoff_min_s:
            raise ValueError(f"backoff_max_s ({self.backoff_max_s}) must be >= backoff_min_s ({self.backoff_min_s})")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (mutual TLS)")
        if not self.uses_tls and (self.ca_file or self.cert_file):
            raise ValueError("ca_file / cert_file / key_file need an mqtts:// url")
        return self

    @property
    def uses_tls(self) -> bool:
        return parse_url(self.url or self.shards[0]).tls

    def broker_url(self, device_id: str) -> str:
        """The broker this device connects to: url, or its shard of shards."""
        return self.url or shard_of(device_id, self.shards)


def default_state_dir() -> Path:
    """systemd's StateDirectory= ($STATE_DIRECTORY), else /var/lib/edge-agent for root, else the user's data dir."""
    import os

    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0:
        return Path("/var/lib/edge-agent")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "edge-agent"


class TelemetryConfig(BaseModel):
    """The on-device telemetry store (agent.link.store), its sampler and retention (agent.link.telemetry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state_dir: Path = Field(default_factory=lambda: default_state_dir(), description="holds telemetry.db and models/")
    device_id: str | None = Field(None, pattern=DEVICE_ID_PATTERN, description="None: this host's name")
    sample_interval_s: float = Field(10.0, gt=0, description="a SampleRecord every this many seconds")
    retention_interval_s: float = Field(300.0, gt=0, description="how often retention runs")
    max_age_s: float = Field(30 * 24 * 3600, gt=0, description="delivered records older than this are deleted")
    max_bytes: int = Field(64 << 20, ge=1 << 16, description="stored records beyond this are deleted, "
                                                             "delivered ones first; the file itself never "
                                                             "grows past 2 x max_bytes + 1 MiB")
    mqtt: MqttConfig | None = None


class UpdatesConfig(BaseModel):
    """Signed model updates from the fleet (agent/updates/)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    trusted_keys: list[Path] = Field([], description="Ed25519 public keys (PEM) whose signatures are accepted; "
                                                     "two or more during a key rotation")
    job_keys: list[Path] = Field([], description="Ed25519 public keys (PEM) of the fleet's job signer (edge-fleet "
                                                 "serve --job-key); when set, every job must be signed by one, name "
                                                 "this device and be unexpired, and the rollback command is refused")
    health_check_tokens: int = Field(16, ge=1, le=64, description="golden tokens that must match after an update")
    # A job's allow_downgrade and base_url are not covered by the manifest's signature (docs/fleet.md, "Update
    # security"): these let a device refuse what only the signing key should be able to ask for.
    allow_downgrade: bool = Field(True, description="false: refuse a model older than the current one, whatever "
                                                    "the job says")
    min_tokens_per_s: float = Field(0.0, ge=0, allow_inf_nan=False,
                                    description="the least decode tokens/s a new model must reach, whatever the job says")
    artifacts_url: str | None = Field(None, description="download updates only from under this http(s) URL")

    @field_validator("artifacts_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and (urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname):
            raise ValueError("artifacts_url must be an http:// or https:// URL with a host")
        return url


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: Path | None = None
    # [adapters] NAME = "folder": a request's model "BASE:NAME" runs with it. Served with the model it was converted
    # for, beside the state directory's adapters/ for it (agent.updates.model_store); one that does not fit is
    # refused at load, so a model switch to another build fails (and rolls back) while one is configured
    adapters: dict[ModelName, Path] = Field({}, description="LoRA adapters served beside the model: name -> folder")
    engine: EngineConfig = EngineConfig()
    api: ApiConfig = ApiConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    updates: UpdatesConfig = UpdatesConfig()


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the (nested) model a validation error location points into."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = getattr(field, "annotation", None) if field else None
        candidates = [a for a in getattr(sub, "__args__", (sub,)) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not candidates:
            return []
        model = candidates[0]
    return list(model.model_fields)


def describe_errors(e: ValidationError, root: type[BaseModel] = None) -> str:
    """One line per problem: the key, what was wrong, and what is allowed."""
    root = root or AgentConfig
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (allowed here: {', '.join(_allowed_keys(root, err['loc']))})")
        else:
            got = f" (got {err['input']!r})" if not isinstance(err.get("input"), dict) else ""
            lines.append(f"{key}: {err['msg']}{got}")
    return "\n".join(lines)
