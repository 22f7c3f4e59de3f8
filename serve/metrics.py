"""Prometheus metrics of the OpenAI app, in a registry of its own (no global state shared with Ray).

Request-level latencies (TTFT, TPOT, end-to-end) are observed by the ingress as it streams; engine
gauges and counters (running / waiting requests, KV-cache usage, prefix-cache hits, preemptions, token
counts) are read from ``EngineClient.stats()`` at scrape time and exposed per replica.
"""

from __future__ import annotations

import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# (stats key, metric name, help, kind)
_ENGINE_METRICS = (
    ("num_running", "rayinfer_num_requests_running", "Requests in the engine's running batch.", "gauge"),
    ("num_waiting", "rayinfer_num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("kv_cache_usage", "rayinfer_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", "gauge"),
    ("num_free_blocks", "rayinfer_kv_cache_free_blocks", "Free KV-cache blocks.", "gauge"),
    ("num_blocks", "rayinfer_kv_cache_blocks", "KV-cache blocks in the pool.", "gauge"),
    ("prefix_cache_hit_rate", "rayinfer_prefix_cache_hit_rate", "Prefix-cache hits / queries (0..1).", "gauge"),
    ("prefix_cache_queries", "rayinfer_prefix_cache_queries", "Prefix-cache block queries.", "counter"),
    ("prefix_cache_hits", "rayinfer_prefix_cache_hits", "Prefix-cache block hits.", "counter"),
    ("num_preemptions", "rayinfer_num_preemptions", "Requests preempted (KV freed, recomputed later).", "counter"),
    ("num_prompt_tokens", "rayinfer_prompt_tokens", "Prompt tokens of requests that started decoding.", "counter"),
    ("num_generation_tokens", "rayinfer_generation_tokens", "Generated tokens.", "counter"),
    ("kv_store_blocks", "rayinfer_kv_store_blocks", "Blocks held by the KV store (PD).", "gauge"),
    ("kv_store_hit_rate", "rayinfer_kv_store_hit_rate", "KV store lookups that hit (0..1).", "gauge"),
    ("moe_lb", "rayinfer_moe_lb", "Expert-parallel balance: max rank load / mean (1 is even).", "gauge"),
    ("num_parked_kv", "rayinfer_pd_parked_kv_requests", "Prefilled requests whose KV waits in the prefill pool "
     "for its transfer (PD).", "gauge"),
    ("kv_transfer_batches", "rayinfer_pd_kv_transfer_batches", "KV transfer batches sent or received (PD, "
     "nccl/gloo).", "counter"),
    ("kv_transfer_bytes_sent", "rayinfer_pd_kv_transfer_sent_bytes", "KV bytes sent (PD prefill replica).",
     "counter"),
    ("kv_transfer_bytes_received", "rayinfer_pd_kv_transfer_received_bytes", "KV bytes received (PD decode "
     "replica).", "counter"),
    ("kv_transfer_budget_used", "rayinfer_pd_kv_transfer_budget_used_bytes", "Received KV bytes not yet "
     "imported, out of pd.transfer_buffer_gib (PD decode replica).", "gauge"),
)


class _EngineStatsCollector:
    """Exposes the last snapshot of engine stats (a custom collector: the engine owns the counts)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: list[dict] = []
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            snapshot = list(self.snapshot)
        labels = ["model_name", "replica"]
        for key, name, help_text, kind in _ENGINE_METRICS:
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_cls(name, help_text, labels=labels)
            for stats in snapshot:
                if key in stats:
                    family.add_metric([self.model_name, str(stats.get("replica_id", 0))], float(stats[key]))
            yield family


class ServeMetrics:
    """The app's metrics.

    Args:
        model_name: the served model name (a label on every metric).
    """

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.requests = Counter("rayinfer_requests", "Finished HTTP requests by endpoint, outcome and finish "
                                "reason.", ["model_name", "endpoint", "outcome", "finish_reason"],
                                registry=self.registry)
        self.ttft = Histogram("rayinfer_time_to_first_token_seconds", "Time to first token (TTFT).", labels,
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("rayinfer_time_per_output_token_seconds",
                              "Time per output token after the first (TPOT).", labels, buckets=_TPOT_BUCKETS,
                              registry=self.registry)
        self.e2e = Histogram("rayinfer_e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.request_prompt_tokens = Counter("rayinfer_request_prompt_tokens",
                                             "Prompt tokens of requests served through HTTP.", labels,
                                             registry=self.registry)
        self.request_generation_tokens = Counter("rayinfer_request_generation_tokens",
                                                 "Tokens generated for requests served through HTTP.", labels,
                                                 registry=self.registry)
        self._engine = _EngineStatsCollector(model_name)
        self.registry.register(self._engine)

    def observe_sequence(self, ttft_s: float | None, e2e_s: float, num_prompt_tokens: int,
                         num_output_tokens: int) -> None:
        """Record one engine sequence (one of a request's n choices).

        Args:
            ttft_s: seconds from arrival to its first token (None if it produced none).
            e2e_s: seconds from arrival to its last output.
            num_prompt_tokens, num_output_tokens: its token counts.
        """
        m = self.model_name
        if ttft_s is not None:
            self.ttft.labels(m).observe(ttft_s)
            if num_output_tokens > 1:
                self.tpot.labels(m).observe((e2e_s - ttft_s) / (num_output_tokens - 1))
        self.e2e.labels(m).observe(e2e_s)
        self.request_prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.request_generation_tokens.labels(m).inc(num_output_tokens)

    def count_request(self, endpoint: str, outcome: str, finish_reason: str | None) -> None:
        """Count a finished HTTP request.

        Args:
            endpoint: "chat" or "completions".
            outcome: "ok", "error_<status>", or "abort" (the client disconnected first).
            finish_reason: the first choice's OpenAI finish reason ("stop", "length", "tool_calls"),
                "abort" for a disconnect (vLLM's label for it), "error" for an error.
        """
        self.requests.labels(self.model_name, endpoint, outcome, finish_reason or "none").inc()

    def set_engine_stats(self, stats) -> None:
        """Replace the engine snapshot exposed at the next scrape.

        Args:
            stats: the fleet's :class:`~rayinfer.engine.protocol.FleetStats`, or None when the fleet could
                not be asked (every engine gauge vanishes); replicas that could not answer are left out
                (their gauges vanish rather than freeze), the KV store's counters are exposed as a
                replica named "kv_store", the EP balance as replica "ep".
        """
        if stats is None:
            with self._engine.lock:
                self._engine.snapshot = []
            return
        rows = [{**r.to_dict(), **r.kv_transfer} for r in stats.replicas if r.error is None]
        if stats.kv_store is not None and stats.kv_store.error is None:
            rows.append({"replica_id": "kv_store", **dataclasses.asdict(stats.kv_store)})
        if stats.ep is not None:
            rows.append({"replica_id": "ep", "moe_lb": stats.ep.moe_lb, "num_rebalances": stats.ep.num_rebalances})
        with self._engine.lock:
            self._engine.snapshot = rows

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
