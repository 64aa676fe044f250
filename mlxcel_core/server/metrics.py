"""Prometheus metrics of one server: llama.cpp-compatible names plus mlxcel's own.

The engine thread updates plain counters and gauges once per step (a few integer stores); a scrape
only renders them, so scraping stays cheap however often it happens. Each server has its own
registry (tests run several servers in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        disable_created_metrics()  # no *_created series: smaller, cheaper scrapes
        r = self.registry = CollectorRegistry(auto_describe=False)
        self.prompt_tokens = Counter(
            "llamacpp:prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)", registry=r
        )
        self.tokens_predicted = Counter("llamacpp:tokens_predicted", "Tokens generated", registry=r)
        self.requests_processing = Gauge("llamacpp:requests_processing", "Sequences in the running batch", registry=r)
        self.requests_deferred = Gauge("llamacpp:requests_deferred", "Sequences waiting for a batch slot", registry=r)
        self.queue_depth = Gauge("mlxcel_queue_depth", "Sequences waiting for a batch slot", registry=r)
        self.batch_size = Gauge("mlxcel_batch_size", "Rows in the batch at the last engine step", registry=r)
        self.kv_blocks_used = Gauge("mlxcel_kv_blocks_used", "Paged KV blocks held by sequences", registry=r)
        self.kv_blocks_free = Gauge("mlxcel_kv_blocks_free", "Paged KV blocks free or reclaimable", registry=r)
        self.prefix_hits = Counter(
            "mlxcel_prefix_cache_hits", "Requests that reused prefix-cached KV blocks", registry=r
        )
        self.prefix_tokens = Counter(
            "mlxcel_prefix_cache_tokens", "Prompt tokens served by the prefix cache instead of computed", registry=r
        )
        self.state_snapshots = Gauge(
            "mlxcel_state_snapshots", "Recurrent-state snapshots held for the prefix cache", registry=r
        )
        self.state_snapshot_bytes = Gauge(
            "mlxcel_state_snapshot_bytes", "Bytes of the recurrent-state snapshots the prefix cache holds", registry=r
        )
        self.requests = Counter("mlxcel_requests", "Finished sequences by finish reason", ["finish_reason"], registry=r)
        self.rejected = Counter("mlxcel_requests_rejected", "Requests refused because the queue was full", registry=r)
        self.ttft = Histogram(
            "mlxcel_request_ttft_seconds", "Time from request to first token", registry=r, buckets=TTFT_BUCKETS
        )
        self.decode_tps = Histogram(
            "mlxcel_request_decode_tokens_per_second",
            "Decode speed of each finished sequence",
            registry=r,
            buckets=TPS_BUCKETS,
        )
        self.spec_rounds = Counter("mlxcel_spec_rounds", "Speculative decoding rounds (verify forwards)", registry=r)
        self.spec_proposed = Counter("mlxcel_spec_draft_tokens", "Draft tokens proposed for verification", registry=r)
        self.spec_accepted = Counter(
            "mlxcel_spec_accepted_tokens", "Draft tokens accepted by the target model", registry=r
        )
        self._seen_prefill = 0
        self._seen_hits = 0
        self._seen_cached = 0
        self._seen_spec = (0, 0, 0)

    def record_step(
        self, *, running: int, waiting: int, prefill_tokens: int, storage_stats: dict, speculative=None
    ) -> None:
        """Called by the engine thread after each step with the engine's cumulative counters."""
        if speculative is not None:
            now = (speculative.rounds, speculative.proposed, speculative.accepted)
            for counter, new, seen in zip(
                (self.spec_rounds, self.spec_proposed, self.spec_accepted), now, self._seen_spec
            ):
                if new > seen:
                    counter.inc(new - seen)
            self._seen_spec = now
        self.requests_processing.set(running)
        self.batch_size.set(running)
        self.requests_deferred.set(waiting)
        self.queue_depth.set(waiting)
        if prefill_tokens > self._seen_prefill:
            self.prompt_tokens.inc(prefill_tokens - self._seen_prefill)
        self._seen_prefill = prefill_tokens
        if "blocks_total" in storage_stats:
            self.kv_blocks_free.set(storage_stats["blocks_free"])
            self.kv_blocks_used.set(storage_stats["blocks_total"] - storage_stats["blocks_free"])
            hits = storage_stats.get("prefix_hits", 0)
            if hits > self._seen_hits:
                self.prefix_hits.inc(hits - self._seen_hits)
            self._seen_hits = hits
            cached = storage_stats.get("cached_tokens", 0)
            if cached > self._seen_cached:
                self.prefix_tokens.inc(cached - self._seen_cached)
            self._seen_cached = cached
        if "state_snapshots" in storage_stats:  # a model with recurrent layers (engine/state_snapshots.py)
            self.state_snapshots.set(storage_stats["state_snapshots"])
            self.state_snapshot_bytes.set(storage_stats["state_snapshot_bytes"])

    def reset_engine_counters(self) -> None:
        """A new Engine starts its cumulative counters from zero."""
        self._seen_prefill = self._seen_hits = self._seen_cached = 0
        self._seen_spec = (0, 0, 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
