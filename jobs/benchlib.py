"""Measurement primitives of jobs/bench.py and jobs/sweep.py: workloads, timed offline runs, direct
decode and prefill steps, the Hugging Face comparison, run metadata and the scenario registry.

Everything here is a plain function or small class (no Hydra, no Ray) so tests drive it on CPU with the
``llama-tiny`` shape; the roofline arithmetic lives in :mod:`rayinfer.jobs.roofline`. Glossary: TTFT time
to first token; TPOT time per output token after the first; roofline fraction ``roofline time / measured
time`` (1.0 is the ceiling). The Hugging Face twin and its ``generate`` timing live in
:mod:`rayinfer.jobs.hf_baseline` (re-exported here).

Plug-ins (jobs/moe_cost.py ``register_bench_plugins``, which jobs/bench.py calls on import)::

    from rayinfer.jobs import benchlib, roofline
    roofline.register_cost_model("DeepseekV3ForCausalLM", MoECost.from_config)   # bytes and FLOPs
    benchlib.register_scenario(benchlib.Scenario("deepseek-v2-lite", "DeepSeek-V2-Lite shape, dummy bf16",
                                                 {"model": {...}, "engine": {...}, "offline": {...}}))
    benchlib.HF_TWIN_BUILDERS["SomeArchForCausalLM"] = build_hf_twin   # only where hf_twin's mapping falls short
"""

from __future__ import annotations

import json

import contextlib
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rayinfer.jobs.hf_baseline import (  # noqa: F401 (the HF comparison, re-exported for bench.py and tests)
    HF_TWIN_BUILDERS, hf_generate_or_oom, hf_generate_throughput, hf_twin, is_out_of_memory)
from rayinfer.jobs.roofline import time_fn

REPO_ROOT = Path(__file__).resolve().parents[1]


# -- run metadata --------------------------------------------------------------------------------
def git_revision(root: Path = REPO_ROOT) -> tuple[str, bool | None]:
    """(short commit, dirty flag) of the checkout at ``root``; ("unknown", None) without git.

    Read-only: ``--no-optional-locks`` keeps ``git status`` from refreshing the index.
    """
    def git(*args: str) -> str:
        out = subprocess.run(["git", "--no-optional-locks", *args], cwd=root, capture_output=True, text=True,
                             timeout=20)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return out.stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return rev, dirty
    except (OSError, RuntimeError, subprocess.TimeoutExpired):
        return "unknown", None


def emit_json(result: dict[str, Any], path: str | None, echo: bool = True) -> None:
    """Print ``result`` as indented JSON (unless not ``echo``), and write it to ``path`` too when given (a bench
    script's output)."""
    text = json.dumps(result, indent=2)
    if echo:
        print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def env_settings() -> list[str]:
    """``NAME=value`` of each RAYINFER_* setting of this process but the cache directory: what a result's
    ``command`` prefixes, as the A/B switches live in the environment."""
    return [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("RAYINFER_") and k != "RAYINFER_CACHE_DIR"]


def run_metadata(device: torch.device, git_rev: str | None = None) -> dict[str, Any]:
    """What a result must say about how it was made: command, device, versions, git revision.

    Args:
        device: the device measured.
        git_rev: a revision to record instead of asking git (a checkout copied without .git).
    """
    import transformers

    rev, dirty = (git_rev, None) if git_rev else git_revision()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    return {
        "command": " ".join([*env_settings(), "python", *sys.argv]),
        "device": name,
        "device_type": device.type,
        "num_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_rev": rev,
        "git_dirty": dirty,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


@contextlib.contextmanager
def torch_threads(num_threads: int | None):
    """Run the block with ``torch.set_num_threads(num_threads)`` (None: unchanged), then restore.

    On a shared or small CPU, fewer intra-op threads than cores avoids spin-waiting on busy cores, which
    can slow small ops by 10-50x.
    """
    before = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def release_device_memory() -> None:
    """Collect garbage and return cached CUDA blocks to the driver, so that the next engine's KV-cache
    sizing (which reads free device memory) sees what the last one held."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- workloads -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkItem:
    """One offline request: random prompt token ids and exactly ``max_tokens`` output tokens (ignore_eos)."""

    prompt_token_ids: list[int]
    max_tokens: int


def fixed_workload(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list[WorkItem]:
    """``num_prompts`` seeded random prompts of ``input_len`` tokens, each asking ``output_len`` tokens."""
    rng = random.Random(seed)
    return [WorkItem([rng.randrange(vocab_size) for _ in range(input_len)], output_len) for _ in range(num_prompts)]


def mixed_workload(num_prompts: int, input_range: tuple[int, int], output_range: tuple[int, int],
                   vocab_size: int, seed: int) -> list[WorkItem]:
    """Seeded random lengths: input and output uniform integers in the inclusive ranges."""
    rng = random.Random(seed)
    items = []
    for _ in range(num_prompts):
        n_in, n_out = rng.randint(*input_range), rng.randint(*output_range)
        items.append(WorkItem([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return items


# -- offline runs with per-request timing ------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated ``q``-th percentile (0..100) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class RequestTiming:
    """One request's timing in an offline run, in seconds from the start of the run (all arrive at 0)."""

    num_prompt_tokens: int
    num_output_tokens: int = 0
    ttft_s: float | None = None  # first output token
    latency_s: float | None = None  # last output token
    token_ids: list[int] = field(default_factory=list)  # the output, to compare runs

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first; None with fewer than two or no TTFT."""
        if self.num_output_tokens < 2 or self.ttft_s is None or self.latency_s is None:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


@dataclass
class OfflineRun:
    """The outcome of an offline run: per-request timings, wall time, engine counters."""

    timings: list[RequestTiming]
    elapsed_s: float
    num_steps: int = 0
    stats: dict = field(default_factory=dict)

    @staticmethod
    def merge(runs: list["OfflineRun"]) -> "OfflineRun":
        """Replicas that ran side by side: timings joined, wall time the slowest replica's."""
        counters = {}
        for r in runs:
            for k, v in r.stats.items():
                if isinstance(v, (int, float)) and k.startswith("num_"):
                    counters[k] = counters.get(k, 0) + v
        return OfflineRun([t for r in runs for t in r.timings], max(r.elapsed_s for r in runs),
                          sum(r.num_steps for r in runs), counters)

    def summary(self) -> dict[str, Any]:
        """Token counts, throughput (tokens/s) and TTFT / TPOT medians and p90 (ms)."""
        out_tokens = sum(t.num_output_tokens for t in self.timings)
        in_tokens = sum(t.num_prompt_tokens for t in self.timings)
        ttft = [t.ttft_s * 1e3 for t in self.timings if t.ttft_s is not None]
        tpot = [t.tpot_s * 1e3 for t in self.timings if t.tpot_s is not None]
        return {
            "num_requests": len(self.timings),
            "num_prompt_tokens": in_tokens,
            "num_output_tokens": out_tokens,
            "elapsed_s": self.elapsed_s,
            "num_steps": self.num_steps,
            "output_tok_s": out_tokens / self.elapsed_s,
            "total_tok_s": (in_tokens + out_tokens) / self.elapsed_s,
            "median_ttft_ms": percentile(ttft, 50),
            "p90_ttft_ms": percentile(ttft, 90),
            "median_tpot_ms": percentile(tpot, 50),
            "p90_tpot_ms": percentile(tpot, 90),
            "num_preemptions": self.stats.get("num_preemptions"),
        }


def run_offline(engine, items: list[WorkItem], request_prefix: str = "bench") -> OfflineRun:
    """Submit every item at time 0, drive ``engine.step()`` to the end, and time each request's tokens.

    A token's time is when the step that produced it returned (the sampled ids are on the host by then).
    Greedy sampling, ``ignore_eos``: each request yields exactly ``max_tokens`` tokens.

    Args:
        engine: an idle :class:`~rayinfer.engine.llm_engine.LLMEngine`.
        items: the workload.
    Returns:
        the :class:`OfflineRun`; ``stats`` is ``engine.stats()`` at the end.
    Raises:
        ValueError: if the engine rejects an item (too long for its context or KV pool).
    """
    from rayinfer.engine.types import SamplingParams

    timings: dict[str, RequestTiming] = {}
    for i, item in enumerate(items):
        rid = f"{request_prefix}-{i}"
        engine.add_request(rid, list(item.prompt_token_ids),
                           SamplingParams(max_tokens=item.max_tokens, ignore_eos=True, temperature=0.0))
        timings[rid] = RequestTiming(len(item.prompt_token_ids))
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter() - start
        steps += 1
        for out in outputs:
            if out.request_id not in timings or not out.new_token_ids:
                continue
            t = timings[out.request_id]
            if t.ttft_s is None:
                t.ttft_s = now
            t.latency_s = now
            t.num_output_tokens += len(out.new_token_ids)
            t.token_ids.extend(out.new_token_ids)
    return OfflineRun(list(timings.values()), time.perf_counter() - start, steps, engine.stats())


def warm_up(engine, block_size: int) -> None:
    """Run two short requests through ``engine`` so kernels compile and caches fill before timing."""
    vocab = engine.vocab_size
    items = [WorkItem([(7 * i + j) % vocab for j in range(2 * block_size + 3)], 4) for i in range(2)]
    run_offline(engine, items, request_prefix="warmup")


class OfflineReplica:
    """One engine that runs timed offline workloads (a plain class; Ray wraps it for dp > 1).

    Args:
        model_config, engine_config: the engine's configs (``ModelConfig``, ``EngineConfig``).
        num_threads: torch intra-op threads of this process on CPU (None: unchanged). In an actor this
            sets the actor's process; in-process, wrap the replica's life in :func:`torch_threads`.
    """

    def __init__(self, model_config, engine_config, num_threads: int | None = None):
        from rayinfer.engine.llm_engine import LLMEngine, resolve_device

        if num_threads and resolve_device(engine_config.device).type == "cpu":
            torch.set_num_threads(num_threads)
        self.engine = LLMEngine(model_config, engine_config)
        warm_up(self.engine, engine_config.block_size)

    def run(self, items: list[WorkItem]) -> OfflineRun:
        """Run ``items`` through :func:`run_offline` on this replica's engine."""
        return run_offline(self.engine, items)

    def device(self) -> str:
        """The engine's device (also a readiness probe for an actor: the engine is built and warm)."""
        return str(self.engine.device)


# -- direct model steps: decode and prefill ------------------------------------------------------
def graph_time_us(fns, replays: int = 10, samples: int = 5) -> float:
    """Microseconds a call of ``fns`` (callables, e.g. one per distinct weight so that none stays in L2),
    captured once into a CUDA graph and replayed ``replays`` times per sample; the median of ``samples``.
    Raises: whatever capture or the calls raise."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * len(fns)))
    del graph
    return sorted(times)[samples // 2]


def decode_block_tables(batch: int, context: int, block_size: int, num_blocks: int) -> tuple[list[list[int]], bool]:
    """Block tables of ``batch`` requests of ``context`` tokens each, packed one after another.

    Returns:
        (tables, aliased): when the requests need more blocks than ``num_blocks``, the ids wrap around
        (several requests then read the same physical blocks, which costs the same bytes) and ``aliased``
        is True.
    """
    per = -(-context // block_size)
    tables = [[(i * per + j) % num_blocks for j in range(per)] for i in range(batch)]
    return tables, batch * per > num_blocks


def _step_inputs(query_lens, seq_lens, tables, block_size, vocab_size, device, gen):
    from rayinfer.kernels.attention_metadata import AttentionMetadata

    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device)
    n = sum(query_lens)
    ids = torch.randint(0, vocab_size, (n,), generator=gen).to(device)
    pos = torch.tensor([p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)], dtype=torch.long,
                       device=device)
    return ids, pos, meta


@torch.inference_mode()
def time_decode_step(model, kv_cache: torch.Tensor, block_size: int, batch: int, context: int,
                     warmup: int = 3, iters: int = 10, seed: int = 0, graphs=None) -> dict[str, Any]:
    """Time one decode step of ``batch`` requests whose context is ``context`` tokens after the step.

    Drives the model directly (no scheduler, no sampler): forward over ``batch`` new tokens with
    synthetic :class:`AttentionMetadata`, then the LM head over the ``batch`` rows. With the engine's
    captured decode CUDA graphs (``graphs``, engine/cuda_graph.py ``DecodeGraphs``) the same step is also
    timed as a graph replay, which is what the engine runs.

    Args:
        model: a rayinfer model; kv_cache: its whole paged cache (``[L, num_blocks, ...]``).
        graphs: the runner's ``DecodeGraphs`` or None.
    Returns:
        ``step_s`` (median seconds of the path the engine takes: the graph when it covers the batch, else
        eager), ``eager_step_s``, ``graph_step_s`` (None without a graph; ``graph_error`` if replay
        failed), ``path``, ``kv_aliased``, ``num_blocks`` (the cache's).
    """
    num_blocks = kv_cache.shape[1]
    tables, aliased = decode_block_tables(batch, context, block_size, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    ids, pos, meta = _step_inputs([1] * batch, [context] * batch, tables, block_size, model.config.vocab_size,
                                  kv_cache.device, gen)
    eager = time_fn(lambda: model.compute_logits(model(ids, pos, kv_cache, meta)), kv_cache.device, warmup, iters)
    out = {"eager_step_s": statistics.median(eager), "eager_step_s_all": eager, "graph_step_s": None,
           "kv_aliased": aliased, "num_blocks": num_blocks}
    if graphs is not None and graphs.padded_size(batch) is not None and context <= graphs.max_model_len:
        try:
            replay = time_fn(lambda: model.compute_logits(
                graphs.run(ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables)),
                kv_cache.device, warmup, iters)
            out.update(graph_step_s=statistics.median(replay), graph_step_s_all=replay)
        except Exception as e:  # the graph path is optional: keep the eager number
            out["graph_error"] = repr(e)
    out["path"] = "cuda_graph" if out["graph_step_s"] is not None else "eager"
    out["step_s"] = out["graph_step_s"] if out["graph_step_s"] is not None else out["eager_step_s"]
    return out


@torch.inference_mode()
def time_prefill(model, kv_cache: torch.Tensor, block_size: int, num_tokens: int, chunk_size: int,
                 warmup: int = 1, iters: int = 3, seed: int = 0) -> dict[str, Any]:
    """Time the prefill of one ``num_tokens``-token sequence in chunks of at most ``chunk_size`` tokens.

    Each chunk attends to the ones before it through the paged cache; the LM head runs on the last
    token only. Metadata is built before timing.

    Returns:
        ``prefill_s`` (median seconds for the whole sequence), ``prefill_s_all``, ``num_chunks``,
        ``kv_aliased`` (the sequence needed more blocks than the cache has; its ids wrap around).
    """
    num_blocks = kv_cache.shape[1]
    per = -(-num_tokens // block_size)
    table = [j % num_blocks for j in range(per)]
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for start in range(0, num_tokens, chunk_size):
        q = min(chunk_size, num_tokens - start)
        need = -(-(start + q) // block_size)
        steps.append(_step_inputs([q], [start + q], [table[:need]], block_size, model.config.vocab_size,
                                  kv_cache.device, gen))

    def run():
        hidden = None
        for ids, pos, meta in steps:
            hidden = model(ids, pos, kv_cache, meta)
        return model.compute_logits(hidden[-1:])

    times = time_fn(run, kv_cache.device, warmup, iters)
    return {"prefill_s": statistics.median(times), "prefill_s_all": times, "num_chunks": len(steps),
            "kv_aliased": per > num_blocks}


# -- scenarios ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """A preset of ``jobs/bench.py``: config values merged over the defaults (command-line overrides win).

    Attributes:
        name: what ``scenario=NAME`` selects.
        description: one line for ``--help`` and the result file.
        overrides: nested dict over the bench config (keys ``model``, ``engine``, ``offline``, ``decode``,
            ``prefill``, ``hf``, ``ceilings``, ``sections``).
    """

    name: str
    description: str
    overrides: dict = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {}


def register_scenario(scenario: Scenario) -> Scenario:
    """Add a scenario to the registry and to Hydra's ConfigStore (group ``scenario``, package _global_)."""
    SCENARIOS[scenario.name] = scenario
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError:  # pragma: no cover - hydra is a dependency; the registry still works without it
        return scenario
    node = {"scenario": scenario.name, "scenario_description": scenario.description, **scenario.overrides}
    ConfigStore.instance().store(group="scenario", name=scenario.name, node=node, package="_global_")
    return scenario


_GPU_ENGINE = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
register_scenario(Scenario(
    "llama-3-8b", "Llama-3-8B shape, dummy bf16 weights, on the GPU",
    {"model": {"model": "llama-3-8b", "dtype": "bfloat16", "load_format": "dummy", "max_model_len": 8192},
     "engine": dict(_GPU_ENGINE), "offline": {"num_prompts": 1000}},  # the headline workload: 1000 x 1000/1000
))
register_scenario(Scenario(
    "smollm2", "SmolLM2-135M-Instruct, real weights, on the GPU",
    {"model": {"model": "SmolLM2-135M-Instruct", "dtype": "auto", "load_format": "auto", "max_model_len": 8192},
     "engine": dict(_GPU_ENGINE), "offline": {"num_prompts": 200}},
))
register_scenario(Scenario(
    "smollm2-shape", "SmolLM2-135M shape, dummy bf16 weights, on the GPU (same speed as real weights; for "
    "machines without the converted model)",
    {"model": {"model": "smollm2-135m", "dtype": "bfloat16", "load_format": "dummy", "max_model_len": 8192},
     "engine": dict(_GPU_ENGINE), "offline": {"num_prompts": 200}},
))
register_scenario(Scenario(
    "smollm2-spec", "SmolLM2-135M-Instruct, real weights, on the GPU: speculative decoding (n-gram, self-draft; "
    "fixed and confidence-scheduled k) against plain decoding at batch 1, 8, 32, 128",
    {"model": {"model": "SmolLM2-135M-Instruct", "dtype": "auto", "load_format": "auto", "max_model_len": 2048},
     "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 8192, "num_kv_blocks": 2048},
     "sections": ["spec"]},
))
register_scenario(Scenario(
    "llama-3-8b-spec", "Llama-3-8B shape, dummy bf16 weights, on the GPU: speculative decoding at scale (n-gram, a "
    "Llama-3.2-1B-shape draft model; fixed and confidence-scheduled k) against plain decoding, up to 256 requests",
    {"model": {"model": "llama-3-8b", "dtype": "bfloat16", "load_format": "dummy", "max_model_len": 2048},
     "engine": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
     "sections": ["spec"],
     "spec": {"batches": [1, 32, 256], "draft_model": "llama-3.2-1b", "num_kv_blocks": 8192,
              "methods": ["plain", "ngram", "ngram-confidence", "draft", "draft-confidence"]}},
))
register_scenario(Scenario(
    "deepseek-v3-tiny-mtp", "deepseek-v3-tiny shape (MLA, MoE, one MTP module), dummy float32 weights, on CPU: "
    "the MTP proposer's overhead per step against plain decoding (dummy drafts are rejected)",
    {"model": {"model": "deepseek-v3-tiny", "dtype": "float32", "load_format": "dummy", "max_model_len": 2048},
     "engine": {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 512, "num_kv_blocks": 256},
     "sections": ["spec"],
     "spec": {"batches": [1, 4], "output_len": 16, "num_kv_blocks": 256, "methods": ["plain", "mtp", "mtp-confidence"]},
     "ceilings": {"copy_mib": 8, "gemm_n": 128, "iters": 3}, "cpu_threads": 1},
))
register_scenario(Scenario(
    "tiny", "llama-tiny shape, dummy float32 weights, on CPU in seconds (every code path, for tests)",
    {"model": {"model": "llama-tiny", "dtype": "float32", "load_format": "dummy", "max_model_len": 2048},
     "engine": {"device": "cpu", "max_num_seqs": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 32},
     "offline": {"num_prompts": 4, "input_len": 24, "output_len": 6, "mixed_input_range": [4, 40],
                 "mixed_output_range": [2, 8]},
     "decode": {"batches": [1, 4], "contexts": [32, 160], "warmup": 1, "iters": 2},
     "prefill": {"lengths": [48, 160], "warmup": 1, "iters": 2},
     "hf": {"num_prompts": 3, "batch_sizes": [2, 3], "workloads": ["fixed", "mixed"]},
     "ceilings": {"copy_mib": 8, "gemm_n": 128, "iters": 3}, "cpu_threads": 1},
))
