"""Model fingerprints, tenant salts and namespaces.

A page's bytes are meaningful only for the exact engine configuration that wrote them; the
fingerprint covers all of it. The tenant part keeps users apart: it is an HMAC of the
authenticated user id under a server secret, derived on the server, never taken from a client.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from dataclasses import asdict, dataclass

from dss.derive import blake2b, hmac_sha256
from dss.types import PUBLIC_TENANT, FingerprintId, Namespace, NamespaceId, TenantId, UserId

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}

# `kv_layout` of an MLA (latent) cache: one latent vector per token (the compressed KV plus the
# rotary key part), no separate K and V, one "KV head". Other layouts hold K and V per KV head.
LATENT_KV_LAYOUT = "MLA"
# `isa` (the packing inside a block) of vLLM's reference CPU MLA cache: one plain row per token.
LATENT_ROWS_ISA = "cpu-mla"
# Fields added to `ModelFingerprint` later, with the default that leaves the id unchanged.
_ADDED_FIELDS: dict[str, object] = {"tp_size": 1, "pp_size": 1, "kv_groups": "", "kv_cache_dtype": "auto"}
# The quantized KV caches whose pages DSS stores (`ModelFingerprint.kv_cache_dtype`): vLLM's fp8
# formats with one scale per layer for K and one for V, kept as raw bytes (`dtype` "uint8").
FP8_KV_CACHE_DTYPES = ("fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Everything that makes a page's bytes meaningful."""

    model_id: str
    revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    kv_layout: str = "LBHNC"
    isa: str = "generic"
    # The engine's parallel layout. `num_layers` counts the whole model; `num_kv_heads` is what
    # one tensor-parallel rank holds. A page holds every rank's shard: for each layer, one
    # segment per tensor-parallel rank (`layer_block_nbytes` each, rank order); a pipeline stage
    # writes the layers it runs. Pages are per layout: an engine never reads another's.
    tp_size: int = 1
    pp_size: int = 1
    # The engine's KV cache groups when it has more than one (hybrid models: full attention
    # beside sliding-window layers), as `engine_patch.connector.groups` writes them; "" for one group.
    # Part of the id, so pages move only between engines with the same grouping.
    kv_groups: str = ""
    # vLLM's `kv_cache_dtype`: "auto" (the KV is stored in `dtype`, the model's) or an fp8 format
    # of `FP8_KV_CACHE_DTYPES` (`dtype` is then "uint8": one byte per value). What the bytes also
    # depend on, the per-layer K and V scales, comes with the weights (`revision`); engines that
    # compute their scales at run time are refused (engine_patch.connector.fingerprint).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and (
            self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES or self.dtype != "uint8"
        ):
            raise ValueError(f"KV cache dtype {self.kv_cache_dtype!r} with {self.dtype!r} values")
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size", "pp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.pp_size > self.num_layers:
            raise ValueError(f"{self.pp_size} pipeline stages for {self.num_layers} layers")

    @property
    def id(self) -> FingerprintId:
        return _fingerprint_id(self)  # asked on every save plan and turn report: computed once

    def _canonical(self) -> dict[str, object]:
        """The fields the id covers. Fields added after the first release are left out while they
        hold their default, so an engine that does not use them keeps the id (and the pages) it
        had before they existed."""
        fields = asdict(self)
        for name in _ADDED_FIELDS:
            if fields[name] == _ADDED_FIELDS[name]:
                del fields[name]
        return fields

    @property
    def shards(self) -> int:
        """Engine ranks that each copy their part of every page (and must all commit it)."""
        return self.tp_size * self.pp_size

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def layer_block_nbytes(self) -> int:
        """Bytes of one engine block in one layer on one tensor-parallel rank (K and V together,
        or the latent vectors)."""
        per_token = 1 if self.kv_layout == LATENT_KV_LAYOUT else 2
        return per_token * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def layer_row_nbytes(self) -> int:
        """Bytes of one layer in a page: every tensor-parallel rank's block, in rank order."""
        return self.tp_size * self.layer_block_nbytes

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: one engine block across all layers (and ranks), layer-major."""
        return self.num_layers * self.layer_row_nbytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelFingerprint:
        return cls(**json.loads(text))


@functools.lru_cache(maxsize=64)
def _fingerprint_id(fp: ModelFingerprint) -> FingerprintId:
    canon = json.dumps(fp._canonical(), sort_keys=True, separators=(",", ":"))
    return FingerprintId(hashlib.blake2b(canon.encode(), digest_size=16).hexdigest())


def tenant_for_user(server_secret: bytes, user: UserId, epoch: int = 0) -> TenantId:
    """The per-user cache salt: an HMAC under the server secret, so it cannot be guessed or chosen.
    `epoch` counts the user's erasures: a re-created user gets a tenant nothing was ever stored
    under. Fields are length-prefixed (`dss.derive`), so no user id names another's tenant."""
    if not user:
        raise ValueError("user id must not be empty")
    return TenantId(hmac_sha256(server_secret, "dss/tenant/v2", str(user), epoch).hex()[:32])


def legacy_tenant_for_user(server_secret: bytes, user: UserId, epoch: int = 0) -> TenantId:
    """The first derivation (`"dss-tenant\\0" + user + "\\0epoch\\0" + n`): ambiguous, never used
    for new data. Only to recognise what a store upgraded from it recorded: its receipts name
    tenants of this form (`dss.ops.key_changes.derivation_upgrade`)."""
    msg = b"dss-tenant\x00" + str(user).encode()
    if epoch:
        msg += b"\x00epoch\x00" + str(epoch).encode()
    return TenantId(hmac.new(server_secret, msg, hashlib.sha256).hexdigest()[:32])


def namespace_id(fingerprint: FingerprintId, tenant: TenantId) -> NamespaceId:
    return NamespaceId(blake2b("dss/namespace/v2", fingerprint, tenant, digest_size=16))


@functools.lru_cache(maxsize=4096)  # a few per store call, for the same few tenants at a time
def make_namespace(fingerprint: FingerprintId, tenant: TenantId) -> Namespace:
    return Namespace(fingerprint=fingerprint, tenant=tenant, id=namespace_id(fingerprint, tenant))


def public_namespace(fingerprint: FingerprintId) -> Namespace:
    return make_namespace(fingerprint, PUBLIC_TENANT)
