"""Prometheus metrics of one app instance (its own registry: two apps never share counters)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ragsnap.engine.stats import AnswerStats

_SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class ServiceMetrics:
    """Requests, queue depth, prefill/decode time, cache results and bytes, kept-token ratio."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ragsnap_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.answers = Counter(
            "ragsnap_answers",
            "jobs by outcome (ok, cancelled, error; skipped: its client left while it waited)",
            ["outcome"],
            registry=r,
        )
        self.rejected = Counter("ragsnap_queue_rejections", "requests refused with 429", registry=r)
        self.queue_depth = Gauge(
            "ragsnap_queue_depth", "requests waiting for the worker", registry=r
        )
        self.worker_busy = Gauge(
            "ragsnap_worker_busy", "requests the scheduler is prefilling or decoding", registry=r
        )
        self.kv_in_use = Gauge(
            "ragsnap_kv_bytes_in_use",
            "KV memory held by running requests (compressed caches with room for their new "
            "tokens, full KV of prefilling prompts)",
            registry=r,
        )
        self.kv_limit = Gauge(
            "ragsnap_kv_memory_bytes", "the KV memory bound (0: none)", registry=r
        )
        self.tier_memory = Gauge(
            "ragsnap_tier_memory_bytes",
            "KV held by this process's in-memory cache tiers (document prefixes, unwritten "
            "and loaded entries; inside the KV memory bound when there is one)",
            registry=r,
        )
        self.store_writes = Gauge(
            "ragsnap_store_writes_pending",
            "answered requests whose cache entries are not yet written to the store",
            registry=r,
        )
        self.queue_wait = Histogram(
            "ragsnap_queue_wait_seconds",
            "time from accepted to started",
            buckets=_SECONDS,
            registry=r,
        )
        self.prefill = Histogram(
            "ragsnap_prefill_seconds",
            "prefill (and compression) time",
            buckets=_SECONDS,
            registry=r,
        )
        self.decode = Histogram(
            "ragsnap_decode_seconds", "decode time per answer", buckets=_SECONDS, registry=r
        )
        self.ttft = Histogram(
            "ragsnap_time_to_first_token_seconds",
            "engine time to first token",
            buckets=_SECONDS,
            registry=r,
        )
        self.cache_lookups = Counter(
            "ragsnap_cache_lookups",
            "KV cache results (hit, prefix-hit, document-hit, miss, off, unavailable)",
            ["result"],
            registry=r,
        )
        self.cache_tiers = Counter(
            "ragsnap_cache_tier",
            "answers by the tier that served their prefill (exact, prefix, documents, cold, off)",
            ["tier"],
            registry=r,
        )
        self.reused_documents = Counter(
            "ragsnap_reused_documents",
            "documents whose KV came from the per-document tier",
            registry=r,
        )
        self.recomputed_tokens = Counter(
            "ragsnap_recomputed_tokens",
            "tokens of assembled document prefixes recomputed with the full context",
            registry=r,
        )
        self.prefill_paths = Counter(
            "ragsnap_prefill_paths",
            "computed prompts by prefill path (full, propagate: query-aware prefill)",
            ["path"],
            registry=r,
        )
        self.propagated_tokens = Counter(
            "ragsnap_propagated_tokens",
            "prompt tokens that query-aware prefills ran past their split layer",
            registry=r,
        )
        self.decode_drafts = Counter(
            "ragsnap_decode_draft_tokens",
            "drafted tokens decode steps fed (proposed) and the model confirmed (kept)",
            ["outcome"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "ragsnap_kv_bytes",
            "KV cache bytes of answered prompts (full vs kept)",
            ["kind"],
            registry=r,
        )
        self.cache_bytes = Counter(
            "ragsnap_cache_bytes",
            "bytes read from and written to the KV store",
            ["direction"],
            registry=r,
        )
        self.kept_ratio = Histogram(
            "ragsnap_kept_token_ratio",
            "kept tokens per KV head / prompt tokens",
            buckets=(0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=r,
        )

        self.batch_size = Histogram(
            "ragsnap_decode_batch_size",
            "requests decoded together in one scheduler step",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=r,
        )
        self.group_size = Histogram(
            "ragsnap_prefix_hit_group_size",
            "prefix hits (new questions over stored documents) finished in one shared pass",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=r,
        )
        self.group_wait = Histogram(
            "ragsnap_prefix_hit_gather_seconds",
            "seconds the first prefix hit of a group waited for the others",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0),
            registry=r,
        )
        self.step_seconds = Histogram(
            "ragsnap_decode_step_seconds",
            "seconds of one batched decode step (a token, or a token and its draft, per request)",
            buckets=(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0),
            registry=r,
        )

    def observe_step(self, batch_size: int, seconds: float) -> None:
        self.batch_size.observe(batch_size)
        self.step_seconds.observe(seconds)

    def observe_group(self, size: int, waited_s: float) -> None:
        self.group_size.observe(size)
        self.group_wait.observe(waited_s)

    def track_rejections(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export the KV store's count of rejected entries (damaged, tampered, unreadable:
        each deleted and recomputed) as ``ragsnap_cache_rejected_entries_total{reason}``."""
        self.registry.register(_RejectionCollector(counts))

    def track_queue(
        self,
        depth: Callable[[], float],
        busy: Callable[[], float],
        writes: Callable[[], float] | None = None,
        kv_in_use: Callable[[], float] | None = None,
        kv_limit: int | None = None,
        tier_memory: Callable[[], float] | None = None,
    ) -> None:
        self.queue_depth.set_function(depth)
        self.worker_busy.set_function(busy)
        if kv_in_use is not None:
            self.kv_in_use.set_function(kv_in_use)
        if tier_memory is not None:
            self.tier_memory.set_function(tier_memory)
        self.kv_limit.set(kv_limit or 0)
        if writes is not None:
            self.store_writes.set_function(writes)

    def observe_answer(self, stats: AnswerStats) -> None:
        """Record the engine statistics of one finished answer (the ``done`` event's stats)."""
        self.prefill.observe(stats.prefill_s + stats.compress_s)
        if stats.decode_ms_per_token is not None:
            self.decode.observe(stats.decode_ms_per_token * stats.new_tokens / 1000)
        self.ttft.observe(stats.ttft_s)
        self.cache_lookups.labels(stats.cache).inc()
        self.cache_tiers.labels(stats.cache_tier).inc()
        if stats.reused_documents:
            self.reused_documents.inc(stats.reused_documents)
        if stats.recomputed_tokens:
            self.recomputed_tokens.inc(stats.recomputed_tokens)
        if stats.prefill_tokens:
            self.prefill_paths.labels(stats.prefill_path).inc()
        if stats.propagated_tokens:
            self.propagated_tokens.inc(stats.propagated_tokens)
        if stats.drafts_proposed:
            self.decode_drafts.labels("proposed").inc(stats.drafts_proposed)
            self.decode_drafts.labels("kept").inc(stats.drafts_kept)
        if stats.cache_bytes_read:
            self.cache_bytes.labels("read").inc(stats.cache_bytes_read)
        if stats.cache_bytes_written:
            self.cache_bytes.labels("written").inc(stats.cache_bytes_written)
        self.kv_bytes.labels("full").inc(stats.kv_bytes_full)
        self.kv_bytes.labels("kept").inc(stats.kv_bytes_kept)
        if stats.prompt_tokens:
            self.kept_ratio.observe(min(1.0, stats.kept_tokens / stats.prompt_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RejectionCollector(Collector):
    """Reads the store's own counters at scrape time (the store knows nothing of Prometheus)."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "ragsnap_cache_rejected_entries",
            "KV cache entries found unusable (checksum, unauthenticated, stale, unreadable), "
            "deleted and recomputed",
            labels=["reason"],
        )
        for reason, count in sorted(self.counts().items()):
            family.add_metric([reason], count)
        yield family
