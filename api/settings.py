"""Server settings: pydantic-settings with the `DSS_` prefix and nested groups.

Every field can come from the environment (`DSS_SERVER__PORT=9000`,
`DSS_STORE__HOST_CAPACITY_BYTES=4294967296`, `DSS_ENGINE__MODEL=/models/x`, ...) or from the
`dss serve` flags, which override the environment. Nothing is read at import time: call
`Settings()` (or `load_settings`) where the values are needed.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from dss.config import (
    DEFAULT_CACHE_ENTRIES,
    FleetConfig,
    GiB,
    Quotas,
    RemoteConfig,
    RetentionConfig,
    StoreConfig,
)
from dss.jsonlimits import MAX_SERVABLE_DEPTH, JsonLimits

if TYPE_CHECKING:
    from engine_patch.setup.factory import EngineSettings

MiB = 1 << 20
DEFAULT_DATA_DIR = Path("~/.local/share/dss")


class ServerSettings(BaseModel):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: str = "info"
    # Whole request bodies; a chat request with a long history is still far below this.
    max_body_bytes: int = Field(default=8 * MiB, ge=1024)
    # Seconds a stopping server waits for streams in flight before it cuts them.
    graceful_shutdown_s: float = Field(default=10.0, ge=0)
    # Seconds a connection has to send a whole request head (request line and headers), from its
    # first byte or from the connection's start; slower ones are closed (`api.connections`).
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600)
    # Seconds a response may stay unable to write, its client not reading (the socket's buffers
    # full); then the connection is aborted, which stops a stream like a client that left.
    send_timeout_s: float = Field(default=30.0, gt=0, le=3600)

    @property
    def is_loopback(self) -> bool:
        return is_loopback_host(self.host)


class QuotaSettings(BaseModel):
    """Per-user limits on the dialogue state (0 turns one off); over them a request gets 429."""

    max_sessions: int = Field(default=10_000, ge=0)
    max_versions: int = Field(default=100_000, ge=0)
    max_stored_bytes: int = Field(default=4 * GiB, ge=0)
    retry_after_s: int = Field(default=3600, ge=1)

    def to_quotas(self) -> Quotas:
        return Quotas(self.max_sessions, self.max_versions, self.max_stored_bytes, self.retry_after_s)


class RetentionSettings(BaseModel):
    """Session retention hints and warm-up (`DSS_STORE__RETENTION__SWEEP_INTERVAL_S=...`)."""

    sweep_interval_s: float = Field(default=5.0, ge=0)
    pinned_fraction: float = Field(default=0.5, ge=0, le=0.9)
    pinned_user_fraction: float = Field(default=0.25, ge=0, le=0.9)
    warm_threads: int = Field(default=2, ge=1, le=16)
    max_warm_pages: int = Field(default=4096, ge=1)

    def to_config(self) -> RetentionConfig:
        return RetentionConfig(
            sweep_interval_s=self.sweep_interval_s,
            pinned_fraction=self.pinned_fraction,
            pinned_user_fraction=self.pinned_user_fraction,
            warm_threads=self.warm_threads,
            max_warm_pages=self.max_warm_pages,
        )


class FleetSettings(BaseModel):
    """Several servers on one PostgreSQL (`dss.fleet`): `DSS_STORE__FLEET__ACK_TIMEOUT_S=...`."""

    heartbeat_s: float = Field(default=2.0, gt=0, le=60)
    alive_s: float = Field(default=10.0, gt=0, le=600)
    poll_s: float = Field(default=3.0, gt=0, le=600)
    ack_timeout_s: float = Field(default=5.0, ge=0, le=300)
    reconnect_max_s: float = Field(default=5.0, gt=0, le=300)

    def to_config(self) -> FleetConfig:
        return FleetConfig(**self.model_dump())


# Settings that were removed, and why: refused when set (see `StoreSettings`).
REMOVED_STORE_FIELDS = {
    "device_capacity_bytes": "the device (GPU) page tier was removed; nothing on the serving path filled it",
    "device": "the device (GPU) page tier was removed; nothing on the serving path filled it",
}


class StoreSettings(BaseModel):
    data_dir: Path = DEFAULT_DATA_DIR
    db_url: SecretStr | None = None  # default: SQLite in data_dir; may hold a password
    master_key_file: Path | None = None
    host_capacity_bytes: int = Field(default=2 * GiB, ge=MiB)
    disk_capacity_bytes: int = Field(default=20 * GiB, ge=0)
    codec: str = "zstd-byteplane"
    eviction_policy: str = "cost"
    write_through: bool = True
    fsync: bool = True
    loader_threads: int = Field(default=2, ge=1, le=64)
    # Bounds of the in-memory key caches (`StoreConfig.identity_cache_entries`, `data_key_cache_entries`).
    identity_cache_entries: int = Field(default=DEFAULT_CACHE_ENTRIES, ge=1)
    data_key_cache_entries: int = Field(default=DEFAULT_CACHE_ENTRIES, ge=1)
    # The remote page tier shared by a fleet: redis://host:port/db (may hold a password); None: off.
    remote_url: SecretStr | None = None
    remote_key_prefix: str = Field(default="dss:", pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    remote_capacity_bytes: int = Field(default=8 * GiB, ge=MiB)
    remote_ttl_s: int = Field(default=7 * 24 * 3600, ge=1)
    remote_timeout_s: float = Field(default=0.5, gt=0, le=30)
    # How long a turn's commit waits for its pages to reach the remote tier (0: not at all).
    remote_durable_wait_s: float = Field(default=5.0, ge=0, le=60)
    remote_codec: str = Field(default="none", pattern=r"^(none|zstd-byteplane(:-?[0-9]{1,2})?)$")
    remote_read_batch: int = Field(default=16, ge=1, le=1024)  # pages per pipelined round trip
    remote_read_batch_bytes: int = Field(default=1 << 20, ge=1)  # fewer pages per round trip when large
    remote_read_streams: int = Field(default=2, ge=1, le=64)  # such round trips in flight
    remote_cluster: bool = False  # the URL names a node of a Redis or Valkey Cluster
    remote_buckets: int = Field(default=16, ge=1, le=16384)  # hash-tagged bookkeeping buckets
    # This server's name in a fleet; None: the one kept in the data directory (random at first start).
    server_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    fleet: FleetSettings = FleetSettings()
    quotas: QuotaSettings = QuotaSettings()  # DSS_STORE__QUOTAS__MAX_SESSIONS=...
    retention: RetentionSettings = RetentionSettings()

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_fields(cls, data: Any) -> Any:
        """A removed setting that is still set would otherwise be ignored without a word (the
        group ignores unknown fields); the server refuses to start instead, naming it."""
        if isinstance(data, dict):
            for name, why in REMOVED_STORE_FIELDS.items():
                if name in data:
                    raise ValueError(f"DSS_STORE__{name.upper()} is no longer a setting: {why}; unset it")
        return data

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

    def to_config(self) -> StoreConfig:
        return StoreConfig(
            data_dir=self.resolved_data_dir,
            db_url=self.db_url.get_secret_value() if self.db_url is not None else None,
            master_key_file=self.master_key_file.expanduser() if self.master_key_file else None,
            host_capacity_bytes=self.host_capacity_bytes,
            disk_capacity_bytes=self.disk_capacity_bytes,
            codec=self.codec,
            eviction_policy=self.eviction_policy,
            write_through=self.write_through,
            fsync=self.fsync,
            loader_threads=self.loader_threads,
            identity_cache_entries=self.identity_cache_entries,
            data_key_cache_entries=self.data_key_cache_entries,
            quotas=self.quotas.to_quotas(),
            retention=self.retention.to_config(),
            remote=RemoteConfig(
                url=self.remote_url.get_secret_value() if self.remote_url is not None else None,
                key_prefix=self.remote_key_prefix,
                capacity_bytes=self.remote_capacity_bytes,
                ttl_s=self.remote_ttl_s,
                timeout_s=self.remote_timeout_s,
                durable_wait_s=self.remote_durable_wait_s,
                codec=self.remote_codec,
                read_batch=self.remote_read_batch,
                read_batch_bytes=self.remote_read_batch_bytes,
                read_streams=self.remote_read_streams,
                cluster=self.remote_cluster,
                buckets=self.remote_buckets,
            ),
            server_id=self.server_id,
            fleet=self.fleet.to_config(),
        )


class EngineGroup(BaseModel):
    """The embedded vLLM engine (`enabled=False` serves the store API alone: no chat)."""

    enabled: bool = True
    model: Path | None = None  # an HF folder; default: `engine_patch.setup.model.find_model(data_dir)`
    served_model_name: str | None = None  # default: the model folder's name
    # vLLM's tool-call parser for `tool_choice: "auto"` (e.g. `hermes`); None: tools are refused
    # as vLLM's own server refuses them without `--tool-call-parser`.
    tool_call_parser: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    max_model_len: int | None = Field(default=None, ge=16)  # None: the factory's (4096)
    kv_cache_space_gib: int = Field(default=1, ge=1)  # VLLM_CPU_KVCACHE_SPACE on CPU
    # None: the factory's default (bfloat16; docs/operations.md "Served dtype").
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    enforce_eager: bool = True
    max_num_seqs: int | None = Field(default=None, ge=1)
    seed: int = 0
    # The parallel layout and KV cache under vLLM's names (`dss serve --tensor-parallel-size`, ...).
    tensor_parallel_size: int = Field(default=1, ge=1)
    pipeline_parallel_size: int = Field(default=1, ge=1)
    kv_cache_dtype: str = Field(default="auto", pattern=r"^[A-Za-z0-9_]{1,32}$")  # vLLM checks the name
    block_size: int | None = Field(default=None, ge=1)  # None: the platform's (128 on CPU)
    # Any other vLLM engine argument, by its `AsyncEngineArgs` name: DSS_ENGINE__EXTRA_ARGS is a
    # JSON object, `dss serve --engine-arg NAME=VALUE` adds to it. Unknown names refuse to start.
    extra_args: dict[str, Any] = Field(default_factory=dict)
    # Generations admitted at once; more answer 503 with Retry-After instead of queueing forever.
    max_inflight: int = Field(default=64, ge=1)
    # Of those, how many one user (an end user of a frontend key) may hold at once; more answer
    # 429 `too_many_user_generations`. None: half of `max_inflight` (at least 1).
    max_slots_per_user: int | None = Field(default=None, ge=1)
    retry_after_s: int = Field(default=1, ge=1)
    # How the engine's processes yield the CPU to the API's (api/llm/engine_priority.py): "idle",
    # Linux's SCHED_IDLE class (an API thread that wakes preempts them at once), or "nice", the
    # nice value below (0: unchanged). Keeps API latency low while the engine computes.
    cpu_priority: Literal["idle", "nice"] = "idle"
    nice: int = Field(default=10, ge=0, le=19)
    startup_timeout_s: float = Field(default=600.0, gt=0)
    # A model or parallel layout DSS cannot cache refuses to start (one line, the reason); True
    # serves it as plain vLLM, with `/readyz` `kv_caching: false` and `dss_kv_caching_enabled 0`.
    allow_uncached: bool = False
    # False: the engine runs without DSS's connector (vLLM's own prefix cache only), announced as
    # an uncached model is (`/readyz` `kv_caching: false`, the reason logged); sessions, versions
    # and the rest work as ever. For A/B measurements (bench/cold_concurrent.py) and for taking
    # the store off the engine's path without another deployment.
    kv_caching: bool = True
    # vLLM's KV events, with the store's host and disk pages (docs/operations.md, "KV events"):
    # the ZMQ endpoint vLLM's publisher binds (`tcp://*:5557`) or connects to; None: off.
    kv_events_endpoint: str | None = Field(default=None, max_length=256)
    kv_events_topic: str = Field(default="", max_length=256)  # llm-d: `kv@<pod-ip:port>@<model>`

    @property
    def slots_per_user(self) -> int:
        """The generation slots one user may hold: `max_slots_per_user`, else half the slots."""
        share = self.max_slots_per_user if self.max_slots_per_user is not None else self.max_inflight // 2
        return max(1, min(share, self.max_inflight))

    def engine_settings(self, model_path: Path) -> EngineSettings:
        """The engine factory's settings for `model_path`: these values where given, the
        factory's defaults elsewhere. Builds nothing (imports the factory, hence vLLM)."""
        from engine_patch.setup.factory import EngineSettings

        given: dict[str, Any] = {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "dtype": self.dtype,
            "served_model_name": self.served_model_name,
            "block_size": self.block_size,
        }
        return EngineSettings(
            model=Path(model_path),
            kv_cache_space_gib=self.kv_cache_space_gib,
            enforce_eager=self.enforce_eager,
            seed=self.seed,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            kv_cache_dtype=self.kv_cache_dtype,
            allow_uncached=self.allow_uncached,
            connector=self.kv_caching,
            kv_events_endpoint=self.kv_events_endpoint,
            kv_events_topic=self.kv_events_topic,
            extra_engine_args=dict(self.extra_args),
            **{k: v for k, v in given.items() if v is not None},
        )


class LimitsSettings(BaseModel):
    max_messages: int = Field(default=512, ge=1)
    max_message_chars: int = Field(default=1 << 20, ge=1)
    max_output_tokens: int = Field(default=4096, ge=1)
    default_max_tokens: int = Field(default=512, ge=1)
    max_stop_sequences: int = Field(default=4, ge=0)
    max_n: int = Field(default=8, ge=1, le=128)  # alternatives one request may ask for
    max_list_limit: int = Field(default=100, ge=1, le=1000)
    # Every free-form JSON value the server stores (session metadata, a message's tool calls, a
    # response's items and `text.format.schema`) or passes to vLLM (`response_format`, `tools`):
    # nesting depth and compact size of each. Checked before anything is written or generated.
    max_json_depth: int = Field(default=64, ge=1, le=MAX_SERVABLE_DEPTH)
    max_json_bytes: int = Field(default=1 << 20, ge=1024)
    # Per-request lists and maps that vLLM applies at every decoding step (logit masks, penalties,
    # stop and bad-word checks): each entry adds to the step time of the whole batch.
    max_logit_bias: int = Field(default=300, ge=0)
    max_allowed_token_ids: int = Field(default=1024, ge=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    max_bad_words: int = Field(default=64, ge=0)
    max_tools: int = Field(default=128, ge=0)
    # Erasure checks (a self-erasure, `GET /v1/erasures/{id}`: each verifies a receipt) per user:
    # a bucket of `burst`, refilled at `per_minute` (0: unlimited). Admin keys are not limited.
    erasure_checks_per_minute: float = Field(default=12.0, ge=0)
    erasure_checks_burst: int = Field(default=5, ge=1)
    # Erasures (`DELETE /v1/users/{id}`) per key, on top of the per-user bucket above: a frontend
    # key names any end-user id, so a bucket per end user alone does not bound what one key may
    # do. Admin keys are not limited.
    erasures_per_key_per_minute: float = Field(default=60.0, ge=0)
    erasures_per_key_burst: int = Field(default=20, ge=1)

    # Both read once (every turn checks them; the settings do not change once loaded).
    @cached_property
    def json_limits(self) -> JsonLimits:
        return JsonLimits(max_depth=self.max_json_depth, max_bytes=self.max_json_bytes)

    @cached_property
    def entry_limits(self) -> Mapping[str, tuple[str, int]]:
        """Request field -> (its setting, the most entries it may have)."""
        return {
            "logit_bias": ("max_logit_bias", self.max_logit_bias),
            "allowed_token_ids": ("max_allowed_token_ids", self.max_allowed_token_ids),
            "stop_token_ids": ("max_stop_token_ids", self.max_stop_token_ids),
            "bad_words": ("max_bad_words", self.max_bad_words),
            "tools": ("max_tools", self.max_tools),
        }


class AuthSettings(BaseModel):
    # Development mode (`dss serve --dev`): no key needed, the user comes from the request and every
    # caller is an admin. Only ever entered because it was asked for, never because no key exists,
    # and only on a loopback bind.
    dev_mode: bool = False
    dev_default_user: str = "local"
    # Host headers accepted in development mode besides localhost, 127.0.0.1 and ::1 (any port):
    # a browser page on a rebound DNS name must not reach an unauthenticated admin API.
    dev_allowed_hosts: list[str] = Field(default_factory=list)
    # Seconds a validated key stays cached; a revoked key stops working within this delay.
    key_cache_ttl_s: float = Field(default=10.0, ge=0)
    # Seconds an unknown `dss-` token is remembered, so that repeating it costs no database query
    # (0: off), and how many are remembered (the oldest forgotten first). A key created by this
    # server works at once; one created elsewhere in a fleet, within this delay (its token cannot
    # have been tried before it existed unless it was chosen, not drawn: keys are 256 random bits).
    unknown_key_cache_ttl_s: float = Field(default=5.0, ge=0, le=300)
    unknown_key_cache_size: int = Field(default=10_000, ge=1, le=1_000_000)


class LeadSettings(BaseModel):
    """Lead updates (docs/frontends.md, "Volatile system prompts"): `DSS_LEAD__UPDATES=volatile`.

    `updates` holds for development mode and user keys; a frontend's own setting holds for its
    keys; a request's `lead_updates` (or `X-DSS-Lead-Updates`) overrides both. The quality gate
    shadow-checks `gate_sample` of the turns served this way (when a generation slot is free),
    and turns the feature off for a frontend whose first-token agreement with the exact prompt
    falls below `gate_min_agreement`, or whose mean first-token distance (total variation) rises
    above `gate_max_distance`, over its last `gate_window` checks (at least `gate_min_checks`)."""

    updates: Literal["off", "volatile", "any"] = "off"
    volatile_patterns: list[str] = Field(default_factory=list, max_length=16)
    placement: Literal["system", "note"] = "note"
    gate_sample: float = Field(default=0.1, ge=0.0, le=1.0)
    gate_tokens: int = Field(default=4, ge=1, le=32)
    gate_window: int = Field(default=50, ge=1, le=10_000)
    gate_min_checks: int = Field(default=8, ge=1, le=10_000)
    gate_min_agreement: float = Field(default=0.5, ge=0.0, le=1.0)
    gate_max_distance: float = Field(default=0.6, ge=0.0, le=1.0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="DSS_",
        env_nested_delimiter="__",
        extra="ignore",
        validate_default=True,
    )

    server: ServerSettings = ServerSettings()
    store: StoreSettings = StoreSettings()
    engine: EngineGroup = EngineGroup()
    limits: LimitsSettings = LimitsSettings()
    auth: AuthSettings = AuthSettings()
    lead: LeadSettings = LeadSettings()

    def store_config(self) -> StoreConfig:
        """The store's configuration: the store group, with the JSON limits of the limits table
        (the store enforces them on every write)."""
        return replace(self.store.to_config(), json_limits=self.limits.json_limits)


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with `group={field: value}` overrides (None values skipped).

    `load_settings(server={"port": 9000})` keeps every other server field from the environment.
    """
    base = Settings()
    updates: dict[str, Any] = {}
    for group, values in overrides.items():
        current = getattr(base, group)
        given = {k: v for k, v in dict(values).items() if v is not None}
        if given:
            updates[group] = current.model_validate({**current.model_dump(), **given})
    return base.model_copy(update=updates)


def is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
