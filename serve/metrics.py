"""Prometheus metrics of the OpenAI app, in a registry of its own (no global state shared with Ray).

Request-level metrics (TTFT, TPOT, inter-token latency, queue time, end-to-end latency, prompt and
generation lengths, finished sequences by reason) are observed by the ingress as it streams; engine
gauges and counters (running / waiting requests, KV-cache usage, prefix-cache hits, preemptions, token
counts) are read from ``EngineClient.stats()`` at scrape time and exposed per replica.

Names: ``rayinfer_*`` by default; ``names="vllm"`` exports vLLM's names instead (``vllm:*``, labels
``model_name`` and, per replica, ``engine``) so dashboards built for vLLM work, and ``names="both"``
exports both. The table below each section lists the pairs.
"""

from __future__ import annotations

import dataclasses
import threading

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NAME_SCHEMES = ("rayinfer", "vllm", "both")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5)) + (1e6,)  # 1, 2, 5, ... 1e6 (vLLM's 1-2-5)

# request level, observed by the ingress: (key, rayinfer name, vLLM names, help, buckets or None for a counter)
_REQUEST_METRICS = (
    ("ttft", "rayinfer_time_to_first_token_seconds", ("vllm:time_to_first_token_seconds",),
     "Time to first token (TTFT).", _TTFT_BUCKETS),
    ("tpot", "rayinfer_time_per_output_token_seconds", ("vllm:request_time_per_output_token_seconds",),
     "Time per output token after the first, per request (TPOT).", _TPOT_BUCKETS),
    ("itl", "rayinfer_inter_token_latency_seconds",
     ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
     "Time between consecutive output tokens (ITL), one sample per token after the first.", _TPOT_BUCKETS),
    ("e2e", "rayinfer_e2e_request_latency_seconds", ("vllm:e2e_request_latency_seconds",),
     "End-to-end request latency.", _E2E_BUCKETS),
    ("queue", "rayinfer_request_queue_time_seconds", ("vllm:request_queue_time_seconds",),
     "Time a request waited in its engine before it was first scheduled.", _QUEUE_BUCKETS),
    ("prompt_len", "rayinfer_request_prompt_tokens", ("vllm:request_prompt_tokens",),
     "Prompt length of each request, in tokens.", _TOKEN_BUCKETS),
    ("gen_len", "rayinfer_request_generation_tokens", ("vllm:request_generation_tokens",),
     "Tokens generated for each request.", _TOKEN_BUCKETS),
    ("finished", "rayinfer_request_success", ("vllm:request_success",),
     "Finished engine sequences by finish reason (stop, length, abort, error).", None),
)

# engine level, read at scrape time: (stats key, rayinfer name, vLLM names, help, kind)
_ENGINE_METRICS = (
    ("num_running", "rayinfer_num_requests_running", ("vllm:num_requests_running",),
     "Requests in the engine's running batch.", "gauge"),
    ("num_waiting", "rayinfer_num_requests_waiting", ("vllm:num_requests_waiting",),
     "Requests waiting to be scheduled.", "gauge"),
    ("kv_cache_usage", "rayinfer_kv_cache_usage_perc", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
     "Fraction of KV-cache blocks in use (0..1).", "gauge"),
    ("num_free_blocks", "rayinfer_kv_cache_free_blocks", (), "Free KV-cache blocks.", "gauge"),
    ("num_blocks", "rayinfer_kv_cache_blocks", (), "KV-cache blocks in the pool.", "gauge"),
    ("prefix_cache_hit_rate", "rayinfer_prefix_cache_hit_rate", (), "Prefix-cache hits / queries (0..1).", "gauge"),
    ("prefix_cache_queries", "rayinfer_prefix_cache_queries", ("vllm:prefix_cache_queries",),
     "Prefix-cache queries (tokens).", "counter"),
    ("prefix_cache_hits", "rayinfer_prefix_cache_hits", ("vllm:prefix_cache_hits",), "Prefix-cache hits (tokens).",
     "counter"),
    ("num_preemptions", "rayinfer_num_preemptions", ("vllm:num_preemptions",),
     "Requests preempted (KV freed, recomputed later).", "counter"),
    ("num_prompt_tokens", "rayinfer_prompt_tokens", ("vllm:prompt_tokens",),
     "Prompt tokens of requests that started decoding.", "counter"),
    ("num_generation_tokens", "rayinfer_generation_tokens", ("vllm:generation_tokens",), "Generated tokens.",
     "counter"),
    ("spec_num_drafts_proposed", "rayinfer_spec_decode_num_draft_tokens_proposed", (),
     "Speculative decoding: draft tokens proposed.", "counter"),
    ("spec_num_drafts_verified", "rayinfer_spec_decode_num_draft_tokens", ("vllm:spec_decode_num_draft_tokens",),
     "Speculative decoding: draft tokens verified by the target.", "counter"),
    ("spec_num_drafts_accepted", "rayinfer_spec_decode_num_accepted_tokens",
     ("vllm:spec_decode_num_accepted_tokens",), "Speculative decoding: draft tokens accepted.", "counter"),
    ("spec_num_verify_steps", "rayinfer_spec_decode_num_drafts", ("vllm:spec_decode_num_drafts",),
     "Speculative decoding: request-steps that verified drafts.", "counter"),
    ("spec_mean_accepted_length", "rayinfer_spec_decode_mean_accepted_length", (),
     "Speculative decoding: tokens emitted per verifying request-step (accepted drafts + 1).", "gauge"),
    ("spec_device_drafted_steps", "rayinfer_spec_decode_device_drafted_steps", (),
     "Speculative decoding: steps whose drafts were made on the device behind the step before.", "counter"),
    ("spec_chained_steps", "rayinfer_spec_decode_chained_steps", (),
     "Speculative decoding: verification steps launched behind the one in flight (pipelined).", "counter"),
    ("spec_gate_plain_steps", "rayinfer_spec_decode_gate_plain_steps", (),
     "Speculative decoding, confidence schedule: decode steps its gate kept plain.", "counter"),
    ("spec_gate_draft_triggers", "rayinfer_spec_decode_gate_draft_triggers", (),
     "Speculative decoding, confidence schedule: re-measurements of drafting when drafts turned up in plain steps.",
     "counter"),
    ("host_kv_blocks", "rayinfer_host_kv_cache_blocks", (), "Blocks held by the host-memory KV tier.", "gauge"),
    ("host_kv_queries", "rayinfer_host_kv_cache_queries", (), "Blocks looked up in the host KV tier after a "
     "device-pool miss.", "counter"),
    ("host_kv_hits", "rayinfer_host_kv_cache_hits", (), "Blocks found in the host KV tier (loaded back).", "counter"),
    ("host_kv_offloaded_blocks", "rayinfer_host_kv_cache_offloaded_blocks", (), "Evicted device blocks copied "
     "to the host KV tier.", "counter"),
    ("host_kv_bytes_moved", "rayinfer_host_kv_cache_moved_bytes", (), "Bytes copied between the device pool and "
     "the host KV tier.", "counter"),
    ("kv_store_lookups", "rayinfer_kv_store_replica_lookups", (), "KV store lookups for prompts a replica's own "
     "tiers missed.", "counter"),
    ("kv_store_hit_blocks", "rayinfer_kv_store_replica_hit_blocks", (), "Blocks a replica loaded from the KV "
     "store.", "counter"),
    ("kv_store_skipped_blocks", "rayinfer_kv_store_replica_skipped_blocks", (), "Leading blocks of a KV store hit "
     "that a replica took from its own device pool and host tier instead of fetching them.", "counter"),
    ("kv_store_queries", "rayinfer_kv_store_queries", (), "Blocks asked of the KV store.", "counter"),
    ("kv_store_hits", "rayinfer_kv_store_hits", (), "Blocks the KV store held when asked.", "counter"),
    ("kv_store_corrupt", "rayinfer_kv_store_corrupt_blocks", (), "KV store blocks dropped for a missing or "
     "damaged file.", "counter"),
    ("kv_store_blocks", "rayinfer_kv_store_blocks", (), "Blocks held by the KV store.", "gauge"),
    ("kv_store_hit_rate", "rayinfer_kv_store_hit_rate", (), "KV store lookups that hit (0..1).", "gauge"),
    ("num_encoder_runs", "rayinfer_encoder_runs", (), "Images run through a vision encoder (an encoder replica's, "
     "or a replica's own).", "counter"),
    ("encoder_cache_hits", "rayinfer_encoder_cache_hits", (), "Images served from an encoder cache (by content "
     "hash).", "counter"),
    ("encoder_cache_tokens", "rayinfer_encoder_cache_tokens", (), "Embedding rows held by an encoder cache.", "gauge"),
    ("num_images", "rayinfer_encoder_images", (), "Images asked of an encoder replica.", "counter"),
    ("num_batches", "rayinfer_encoder_batches", (), "Batched encoder calls of an encoder replica.", "counter"),
    ("moe_lb", "rayinfer_moe_lb", (), "Expert-parallel balance: max rank load / mean (1 is even).", "gauge"),
    ("num_rebalances", "rayinfer_eplb_rebalances", (), "Expert maps changed by EPLB while serving.", "counter"),
    ("rebalance_stall_s", "rayinfer_eplb_rebalance_stall_seconds", (), "Time the EP ranks' steps waited at map "
     "switches for expert weights still moving, plus their copy into place (slowest rank, summed).", "counter"),
    ("cp_active", "rayinfer_cp_active", (), "Context parallelism: 1 while a CP replica's rank 0 prefills long "
     "prompts with its peers, 0 once a peer was lost (it then prefills alone).", "gauge"),
    ("num_cp_prefills", "rayinfer_cp_prefills", (), "Context parallelism: prompts prefilled by the CP group (rank 0).",
     "counter"),
    ("num_cp_prefill_tokens", "rayinfer_cp_prefill_tokens", (), "Context parallelism: prompt tokens the CP group "
     "computed (prefix-cache hits excluded; rank 0).", "counter"),
    ("num_cp_solo_prefills", "rayinfer_cp_solo_prefills", (), "Context parallelism: CP prompts rank 0 prefilled "
     "alone after losing a peer.", "counter"),
    ("num_cp_peer_prefills", "rayinfer_cp_peer_prefills", (), "Context parallelism: rank 0's prefills a CP peer "
     "ran its share of.", "counter"),
    ("num_parked_kv", "rayinfer_pd_parked_kv_requests", (), "Prefilled requests whose KV waits in the prefill "
     "pool for its transfer (PD).", "gauge"),
    ("kv_transfer_batches", "rayinfer_pd_kv_transfer_batches", (), "KV transfer batches sent or received (PD, "
     "nccl/gloo).", "counter"),
    ("kv_transfer_bytes_sent", "rayinfer_pd_kv_transfer_sent_bytes", (), "KV bytes sent (PD prefill replica).",
     "counter"),
    ("kv_transfer_bytes_received", "rayinfer_pd_kv_transfer_received_bytes", (), "KV bytes received (PD decode "
     "replica).", "counter"),
    ("kv_transfer_budget_used", "rayinfer_pd_kv_transfer_budget_used_bytes", (), "Received KV bytes not yet "
     "imported, out of pd.transfer_buffer_gib (PD decode replica).", "gauge"),
    # the fleet's own counts (replica "fleet")
    ("num_replacements", "rayinfer_replica_replacements", (), "New replica actors the router started in place of "
     "replicas dead for good (parallel.max_replacements).", "counter"),
    ("num_resent", "rayinfer_requests_resent", (), "Colocated requests sent to another replica after theirs died "
     "(a stream cut mid-way resumes from its tokens).", "counter"),
    ("num_retries", "rayinfer_pd_leg_retries", (), "PD prefill or decode legs re-run after a replica failed.",
     "counter"),
    ("num_handbacks", "rayinfer_pd_leg_handbacks", (), "PD legs re-run after a decode replica preempted a request.",
     "counter"),
    ("kv_device_transfers", "rayinfer_pd_kv_device_transfers", (), "PD over nccl, gloo or cuda_ipc: 1 while the "
     "router lets KV move by device, 0 while the object store stands in after a failed transfer.", "gauge"),
    ("num_kv_device_failures", "rayinfer_pd_kv_device_transfer_failures", (), "PD device KV transfers the router saw "
     "fail (over cuda_ipc a replica's death is not counted).", "counter"),
)


def _names(rayinfer: str, vllm: tuple[str, ...], scheme: str) -> list[tuple[str, bool]]:
    """The (name, is_vllm) pairs a metric is exported under in ``scheme``."""
    out = [(rayinfer, False)] if scheme in ("rayinfer", "both") else []
    return out + ([(name, True) for name in vllm] if scheme in ("vllm", "both") else [])


class _EngineStatsCollector:
    """Exposes the last snapshot of engine stats (a custom collector: the engine owns the counts)."""

    def __init__(self, model_name: str, scheme: str):
        self.model_name = model_name
        self.scheme = scheme
        self.snapshot: list[dict] = []
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            snapshot = list(self.snapshot)
        for key, rayinfer_name, vllm_names, help_text, kind in _ENGINE_METRICS:
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            for name, is_vllm in _names(rayinfer_name, vllm_names, self.scheme):
                family = family_cls(name, help_text, labels=["model_name", "engine" if is_vllm else "replica"])
                for stats in snapshot:
                    if key in stats:
                        family.add_metric([self.model_name, str(stats.get("replica_id", 0))], float(stats[key]))
                yield family
        if self.scheme in ("rayinfer", "both") and any("spec_acceptance_by_position" in s for s in snapshot):
            family = GaugeMetricFamily("rayinfer_spec_decode_acceptance_by_position", "Speculative decoding: "
                                       "fraction of verified drafts accepted at each draft position (0-based).",
                                       labels=["model_name", "replica", "position"])
            for stats in snapshot:
                for j, rate in enumerate(stats.get("spec_acceptance_by_position", ())):
                    family.add_metric([self.model_name, str(stats.get("replica_id", 0)), str(j)], float(rate))
            yield family


class ServeMetrics:
    """The app's metrics.

    Args:
        model_name: the served model name (a label on every metric).
        names: "rayinfer" (``rayinfer_*``), "vllm" (vLLM's ``vllm:*`` names and labels) or "both".
    Raises:
        ValueError: an unknown ``names``.
    """

    def __init__(self, model_name: str, names: str = "rayinfer"):
        if names not in NAME_SCHEMES:
            raise ValueError(f"metrics names must be one of {', '.join(NAME_SCHEMES)}, got {names!r}")
        self.model_name = model_name
        self.names = names
        self.registry = CollectorRegistry()
        self.requests = Counter("rayinfer_requests", "Finished HTTP requests by endpoint, outcome and finish "
                                "reason.", ["model_name", "endpoint", "outcome", "finish_reason"],
                                registry=self.registry)
        # key -> the metric under each enabled name (children for this model)
        self._request: dict[str, list] = {}
        for key, rayinfer_name, vllm_names, help_text, buckets in _REQUEST_METRICS:
            metrics = []
            for name, is_vllm in _names(rayinfer_name, vllm_names, names):
                if buckets is None:
                    metrics.append(Counter(name, help_text, ["model_name", "finished_reason"], registry=self.registry))
                else:
                    metrics.append(Histogram(name, help_text, ["model_name"], buckets=buckets,
                                             registry=self.registry).labels(model_name))
            self._request[key] = metrics
        self._engine = _EngineStatsCollector(model_name, names)
        self.registry.register(self._engine)

    def _observe(self, key: str, value: float) -> None:
        for metric in self._request[key]:
            metric.observe(value)

    def observe_sequence(self, ttft_s: float | None, e2e_s: float, num_prompt_tokens: int,
                         num_output_tokens: int, finish_reason: str | None = None,
                         queue_time_s: float | None = None, itl_s: list[float] | tuple[float, ...] = ()) -> None:
        """Record one finished engine sequence (one of a request's n choices).

        Args:
            ttft_s: seconds from arrival to its first token (None if it produced none).
            e2e_s: seconds from arrival to its last output.
            num_prompt_tokens, num_output_tokens: its token counts.
            finish_reason: the engine's ("stop", "length", "abort", "error"); counted when given.
            queue_time_s: seconds it waited in its engine before it was first scheduled (None: unknown).
            itl_s: seconds between consecutive output tokens, one per token after the first.
        """
        if ttft_s is not None:
            self._observe("ttft", ttft_s)
            if num_output_tokens > 1:
                self._observe("tpot", (e2e_s - ttft_s) / (num_output_tokens - 1))
        for gap in itl_s:
            self._observe("itl", gap)
        if queue_time_s is not None:
            self._observe("queue", queue_time_s)
        self._observe("e2e", e2e_s)
        self._observe("prompt_len", num_prompt_tokens)
        self._observe("gen_len", num_output_tokens)
        if finish_reason is not None:
            self.count_finished(finish_reason)

    def count_finished(self, finish_reason: str) -> None:
        """Count one finished engine sequence by its finish reason (an aborted one included)."""
        for counter in self._request["finished"]:
            counter.labels(self.model_name, finish_reason).inc()

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
                replica named "kv_store", the EP balance as replica "ep", encoder replica i as "encoder<i>",
                the router's replacement, PD retry and colocated re-send counts as replica "fleet".
        """
        if stats is None:
            with self._engine.lock:
                self._engine.snapshot = []
            return
        rows = [{**r.to_dict(), **r.kv_transfer, **r.spec_decode, **r.context_parallel}
                for r in stats.replicas if r.error is None]
        if stats.kv_store is not None and stats.kv_store.error is None:
            rows.append({"replica_id": "kv_store", **dataclasses.asdict(stats.kv_store)})
        rows += [{**dataclasses.asdict(e), "replica_id": f"encoder{e.replica_id}"}
                 for e in getattr(stats, "encoders", ()) if e.error is None]
        rows.append({"replica_id": "fleet", "num_replacements": stats.num_replacements,
                     **({"num_retries": stats.num_retries, "num_handbacks": stats.num_handbacks,
                         "num_kv_device_failures": stats.num_kv_device_failures}
                        if stats.topology == "pd" else {}),
                     **({"kv_device_transfers": int(stats.kv_device_transfers)}
                        if stats.kv_device_transfers is not None else {}),
                     **({"num_resent": stats.num_resent} if stats.topology == "colocated" else {})})
        if stats.ep is not None:
            rows.append({"replica_id": "ep", "moe_lb": stats.ep.moe_lb, "num_rebalances": stats.ep.num_rebalances,
                         "rebalance_stall_s": stats.ep.rebalance_stall_s})
        with self._engine.lock:
            self._engine.snapshot = rows

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
