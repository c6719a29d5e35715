"""Prometheus metrics of one server: `dss_` prefix, base units (seconds, bytes), `_total` counters.

The registry belongs to the app (not prometheus_client's global one), so several apps can live in
one process (tests). Store-side numbers (pages, bytes, evictions, promotions, corrupt pages) are
read from `store.stats()` at scrape time by a collector; request-side numbers are counted here.
No label ever carries a user, a session or a key: only routes, tiers and outcomes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from api.keys.api_keys import LOOKUP_OUTCOMES
from dss.types import Tier

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Where a prompt token's KV came from: the engine's own prefix cache, or a DSS tier.
HIT_SOURCES = ("engine", *(t.value for t in Tier))
CUT_REASONS = ("header_timeout", "send_timeout")  # `api.connections`
# How a turn's wait for its pages in the remote tier ended (`api.turn.pipeline.commit`).
SHARED_TIER_OUTCOMES = ("durable", "timeout")
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    def __init__(self) -> None:
        # `_created` series double the output and no dashboard of ours reads them (process-wide).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "dss_http_requests_total", "HTTP requests answered", ["route", "method", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "dss_request_duration_seconds",
            "Time to answer a request (streams: until the last byte)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "dss_ttft_seconds",
            "Time from a chat request's arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.loop_lag_seconds = Histogram(
            "dss_event_loop_lag_seconds",
            "How late the event loop woke a timer (api.loop_lag): the wait of every ready request",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.short_writes = Counter(
            "dss_short_writes_total",
            "Short metadata writes (rollbacks, new branches) by where they ran: on the event loop, "
            "or on a thread when the loop would have waited (api.state.AppState.short_db_op)",
            ["ran_on"],
            registry=r,
        )
        self.prompt_tokens = Counter("dss_prompt_tokens_total", "Prompt tokens of chat requests", registry=r)
        self.completion_tokens = Counter("dss_completion_tokens_total", "Generated tokens", registry=r)
        self.tokens_looked_up = Counter(
            "dss_tokens_looked_up_total", "Prompt tokens looked up in the caches", registry=r
        )
        self.tokens_hit = Counter(
            "dss_tokens_hit_total", "Prompt tokens served from a cache, by source", ["tier"], registry=r
        )
        self.loads_planned_ahead = Counter(
            "dss_kv_loads_planned_ahead_total",
            "Session turns whose KV load was planned before the request went to the engine "
            "(the engine asked the store nothing for it)",
            registry=r,
        )
        self.commits = Counter("dss_versions_committed_total", "Versions committed by chat turns", registry=r)
        self.aborted = Counter(
            "dss_generations_aborted_total", "Generations cancelled before their commit", registry=r
        )
        self.rejected = Counter(
            "dss_generations_rejected_total", "Generations refused with 503 (overload)", registry=r
        )
        self.rejected_user_share = Counter(
            "dss_generations_rejected_user_share_total",
            "Generations refused with 429: their user held max_slots_per_user already",
            registry=r,
        )
        # Connections the server closed on a slow client (`api.connections`): a request head not
        # complete within header_timeout_s, a response not written for send_timeout_s.
        self.connections_cut = Counter(
            "dss_connections_cut_total",
            "Connections closed on a slow client, by reason",
            ["reason"],
            registry=r,
        )
        self.key_lookups = Counter(
            "dss_api_key_lookups_total",
            "API key look-ups past the cache of valid keys, by outcome (found and unknown: one "
            "database query each; remembered_unknown and not_a_key: none)",
            ["outcome"],
            registry=r,
        )
        self.inflight = Gauge("dss_generations_inflight", "Generations running now", registry=r)
        # 0 until an engine whose KV DSS caches is running: also 0 without an engine, and for an
        # engine served uncached (DSS_ENGINE__ALLOW_UNCACHED), which would otherwise look healthy.
        self.kv_caching = Gauge(
            "dss_kv_caching_enabled", "1 when the engine's KV cache is stored by DSS, else 0", registry=r
        )
        self.erasures = Counter("dss_erasures_total", "Users erased", registry=r)
        # Lead updates (docs/frontends.md, "Volatile system prompts"): turns whose system prompt
        # changed, served from the stored version or not (and why), and the update's tokens.
        self.lead_turns = Counter(
            "dss_lead_update_turns_total",
            "Turns whose lead (system prompt, instructions) changed, by outcome",
            ["outcome"],
            registry=r,
        )
        self.lead_update_tokens = Counter(
            "dss_lead_update_tokens_total", "Tokens of the updates stated after stored histories", registry=r
        )
        self.lead_gate_checks = Counter(
            "dss_lead_gate_checks_total",
            "Quality-gate shadow checks of lead updates, by first-token agreement",
            ["agrees"],
            registry=r,
        )
        self.lead_gate_tripped = Gauge(
            "dss_lead_gate_tripped",
            "Frontends whose lead updates the quality gate turned off",
            registry=r,
        )
        self.shared_tier_waits = Counter(
            "dss_shared_tier_waits_total",
            "Turn commits that waited for their pages to reach the remote tier, by how it ended",
            ["outcome"],
            registry=r,
        )
        self.shared_tier_wait_seconds = Counter(
            "dss_shared_tier_wait_seconds_total",
            "Seconds turn commits waited for their pages to reach the remote tier",
            registry=r,
        )
        self.store_errors = Counter(
            "dss_connector_store_errors_total",
            "Connector store calls that failed or missed their deadline (each a cache miss)",
            registry=r,
        )
        for source in HIT_SOURCES:
            self.tokens_hit.labels(source)
        for reason in CUT_REASONS:
            self.connections_cut.labels(reason)
        for outcome in LOOKUP_OUTCOMES:
            self.key_lookups.labels(outcome)
        for ended in SHARED_TIER_OUTCOMES:
            self.shared_tier_waits.labels(ended)
        for ran_on in ("loop", "thread"):
            self.short_writes.labels(ran_on)

    def observe_key_lookup(self, outcome: str) -> None:
        self.key_lookups.labels(outcome).inc()

    def observe_cut(self, reason: str) -> None:
        self.connections_cut.labels(reason).inc()

    def observe_prompt(
        self, prompt_tokens: int, engine_cached: int, loaded_from: dict[str, int], planned_ahead: bool = False
    ) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        if planned_ahead:
            self.loads_planned_ahead.inc()
        self.tokens_looked_up.inc(prompt_tokens)
        if engine_cached > 0:
            self.tokens_hit.labels("engine").inc(engine_cached)
        for tier, n in loaded_from.items():
            if n > 0 and tier in HIT_SOURCES:
                self.tokens_hit.labels(tier).inc(n)

    def observe_lead(self, served: bool, reason: str | None, update_tokens: int) -> None:
        self.lead_turns.labels("served" if served else (reason or "not_served")).inc()
        if served:
            self.lead_update_tokens.inc(update_tokens)

    def watch_store(self, stats: Callable[[], dict[str, Any]]) -> Collector:
        collector = _StoreCollector(stats)
        self.registry.register(collector)
        return collector

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StoreCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # computed at scrape time; nothing to describe up front

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        pages = GaugeMetricFamily("dss_pages", "Pages resident in each tier", labels=["tier"])
        used = GaugeMetricFamily("dss_tier_used_bytes", "Bytes used in each tier", labels=["tier"])
        cap = GaugeMetricFamily("dss_tier_capacity_bytes", "Capacity of each tier", labels=["tier"])
        hits = CounterMetricFamily("dss_page_hits", "Pages served from each tier", labels=["tier"])
        promos = CounterMetricFamily("dss_promotions", "Pages promoted into each tier", labels=["tier"])
        evictions = CounterMetricFamily("dss_evictions", "Pages evicted from each tier", labels=["tier"])
        for tier in Tier:
            t = tier.value
            pages.add_metric([t], s["pages"].get(t, 0))
            used.add_metric([t], s["bytes"].get(t, 0))
            cap.add_metric([t], s["capacity_bytes"].get(t, 0))
            hits.add_metric([t], s["hits_pages"].get(t, 0))
            promos.add_metric([t], s["promotions"].get(t, 0))
            evictions.add_metric([t], s["evictions"].get(t, 0))
        yield from (pages, used, cap, hits, promos, evictions)
        yield CounterMetricFamily(
            "dss_corrupt_pages",
            "Pages that failed their checksum or authentication",
            value=s["corrupt_pages"],
        )
        yield CounterMetricFamily(
            "dss_disk_write_errors", "Failed writes to the disk tier", value=s["disk_write_errors"]
        )
        yield GaugeMetricFamily(
            "dss_disk_available",
            "1 while the disk tier accepts writes",
            value=1 if s["disk_available"] else 0,
        )
        yield GaugeMetricFamily(
            "dss_indexed_tokens", "Tokens indexed in all tries", value=s["indexed_tokens"]
        )
        yield GaugeMetricFamily("dss_load_leases", "Page loads in progress", value=s["leases"])
        yield GaugeMetricFamily(
            "dss_pending_saves",
            "Page saves planned and waiting for the engine's copy",
            value=s["pending_saves"],
        )
        yield GaugeMetricFamily(
            "dss_disk_write_backlog", "Pages waiting for write-through to disk", value=s["disk_backlog"]
        )
        if s.get("remote_available") is not None:  # a remote tier is configured
            yield GaugeMetricFamily(
                "dss_remote_available",
                "1 while the remote tier (Redis) answers; 0: serving from local tiers only",
                value=1 if s["remote_available"] else 0,
            )
            yield CounterMetricFamily(
                "dss_remote_writes", "Pages copied to the remote tier", value=s["remote_writes"]
            )
            yield CounterMetricFamily(
                "dss_remote_errors",
                "Remote-tier writes that failed (Redis unavailable, or a page refused)",
                value=s["remote_write_errors"],
            )
            yield CounterMetricFamily(
                "dss_remote_misses",
                "Pages a lookup found in the remote tier that could not be read then",
                value=s["remote_misses"],
            )
            yield CounterMetricFamily(
                "dss_remote_read_bytes", "Bytes read from the remote tier", value=s["remote_read_bytes"]
            )
            phases = CounterMetricFamily(
                "dss_remote_read_seconds",
                "Seconds reading the remote tier, by phase: network (pipelined round trips), "
                "decode (checksums, AES-GCM, zstd; summed over reader threads), promote (into the host tier)",
                labels=["phase"],
            )
            for phase, secs in s["remote_read_seconds"].items():
                phases.add_metric([phase], secs)
            yield phases
            yield CounterMetricFamily(
                "dss_remote_read_wall_seconds",
                "Wall-clock seconds of remote reads, from the first round trip sent until the last page "
                "was decoded (concurrent reads add up; the network and decode phases overlap in it)",
                value=s["remote_read_wall_seconds"],
            )
            yield CounterMetricFamily(
                "dss_remote_read_pages", "Pages read from the remote tier", value=s["remote_read_pages"]
            )
            yield CounterMetricFamily(
                "dss_remote_read_batches",
                "Pipelined round trips reading the remote tier",
                value=s["remote_read_batches"],
            )
            prefetch = CounterMetricFamily(
                "dss_remote_prefetch",
                "Prefetches from the remote tier when a turn's target is resolved: started, "
                "skipped (over the byte budget, or one in flight), pages brought into the host tier",
                labels=["outcome"],
            )
            prefetch.add_metric(["started"], s["prefetch_started"])
            prefetch.add_metric(["skipped"], s["prefetch_skipped"])
            prefetch.add_metric(["pages"], s["prefetch_pages"])
            yield prefetch
