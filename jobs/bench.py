"""Benchmark one model on this machine against its roofline, and against Hugging Face transformers.

    python jobs/bench.py                                   # scenario=llama-3-8b (GPU)
    python jobs/bench.py --multirun scenario=llama-3-8b,smollm2
    python jobs/bench.py scenario=llama-3-8b offline.num_prompts=1000     # the full offline workload
    python jobs/bench.py engine.kv_cache_dtype=fp8 sections=[offline]     # with an fp8 KV cache
    python jobs/bench.py scenario=tiny                     # llama-tiny on CPU in seconds (every code path)
    python jobs/bench.py compare_batch_invariant=true sections=[offline,decode]  # the mode's cost, same run
    python jobs/bench.py scenario=smollm2-spec             # speculative decoding against plain (GPU)

The MoE shapes (jobs/moe_cost.py registers their cost models and scenarios on import), the issue's
1000 x 1000/1000 workload and HF at its best batch size, in one run (about 10-20 minutes on one H200)::

    python jobs/bench.py scenario=qwen3-30b-a3b offline.num_prompts=1000 'offline.workloads=[fixed]' \
        'hf.batch_sizes=[32,64,128,256]' hf.num_prompts=null
    python jobs/bench.py scenario=deepseek-v2-lite offline.num_prompts=1000 'offline.workloads=[fixed]' \
        'hf.batch_sizes=[32,64,128,256]' hf.num_prompts=null

or split for 10-minute device calls: ``sections=[offline,decode,prefill]`` first, then HF alone at two
sizes a call (``sections=[hf] 'hf.batch_sizes=[32,64]' hf.num_prompts=null hf.engine_result=<the first
run's JSON>``); benchmarks/README.md ("MoE benchmarks") has the commands and time estimates.

Sections (``sections=[offline,decode,prefill,hf]``, the default; ``spec`` on request, see
jobs/bench_spec.py): offline throughput of a seeded random workload
(fixed 1000 in / 1000 out, and seeded random lengths) through the engine's step loop; decode step time
at each batch x context, driving the model directly over the engine's KV cache; prefill of one sequence,
chunked by ``engine.max_num_batched_tokens``; the offline workload (the first ``hf.num_prompts`` prompts,
or one full batch per size) through HF ``generate`` on the same weights at each of ``hf.batch_sizes``
(a size that runs out of device memory is recorded as ``"oom"``; ``engine_over_hf`` is against the best
size). Each value is printed beside its roofline (bandwidth and matmul rate measured in the
same run) and written to ``benchmarks/results/bench-<scenario>-<device>-<time>.json``.
``compare_batch_invariant=true`` runs the offline and decode sections a second time on a new engine with
``engine.batch_invariant`` flipped, and records both and their ratios under ``"batch_invariant"``.
Scenarios are presets (jobs/benchlib.py ``register_scenario``); command-line overrides win over them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.jobs import benchlib as bl
from rayinfer.jobs import roofline as rl
from rayinfer.jobs.bench_spec import SpecBenchSpec, check_spec, run_spec_section, spec_model_kwargs
from rayinfer.jobs.moe_cost import register_bench_plugins

register_bench_plugins()  # the MoE cost models and scenarios (deepseek-v2-lite, qwen3-30b-a3b); in memory only

SECTIONS = ("offline", "decode", "prefill", "hf", "spec")
WORKLOADS = ("fixed", "mixed")
_MAX_CPU_WEIGHT_BYTES = 8 << 30


@dataclass
class OfflineSpec:
    """The offline workload: random token ids, ignore_eos, greedy; all requests submitted at once."""

    num_prompts: int = 1000
    input_len: int = 1000  # fixed workload
    output_len: int = 1000
    mixed_input_range: list[int] = field(default_factory=lambda: [50, 2000])  # inclusive, uniform
    mixed_output_range: list[int] = field(default_factory=lambda: [50, 1000])
    workloads: list[str] = field(default_factory=lambda: ["fixed", "mixed"])
    seed: int = 0


@dataclass
class DecodeSpec:
    """Decode step time at every (batch, context): context is tokens per request after the step."""

    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 128, 256])
    contexts: list[int] = field(default_factory=lambda: [1024, 4096])
    warmup: int = 3
    iters: int = 10


@dataclass
class PrefillSpec:
    """Prefill time of one sequence of each length, chunked by ``engine.max_num_batched_tokens``."""

    lengths: list[int] = field(default_factory=lambda: [1024, 4096, 16384])
    warmup: int = 1
    iters: int = 3


@dataclass
class HFSpec:
    """The offline workloads through HF ``generate`` on the same weights, at each of ``batch_sizes``.

    Each size runs the workload's first ``num_prompts`` prompts, ``size`` at a time (None: ``size`` prompts,
    one full batch at each size, the least work that measures every size at its own batch). A size that
    runs out of device memory is recorded as ``"oom"`` and the next one runs; ``engine_over_hf`` is taken
    against the best size. ``engine_result``: a result JSON of an earlier run (same scenario) whose
    offline figures ``engine_over_hf`` uses when this run has no offline section (HF in a call of its own).
    """

    num_prompts: int | None = 32
    batch_sizes: list[int] = field(default_factory=lambda: [32])
    batch_size: int | None = None  # the former single size; when set it replaces batch_sizes
    workloads: list[str] = field(default_factory=lambda: ["fixed"])
    engine_result: str | None = None

    def __post_init__(self):
        if self.batch_size is not None:
            self.batch_sizes = [self.batch_size]
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"hf.batch_sizes must be a non-empty list of positive sizes, got "
                             f"{list(self.batch_sizes)}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"hf.num_prompts must be positive or null (one batch per size), got {self.num_prompts}")


@dataclass
class CeilingSpec:
    """Sizes of the bandwidth (copy) and matmul measurements; None: 2 GiB / 8192 on CUDA, 64 MiB / 512 on CPU."""

    copy_mib: int | None = None
    gemm_n: int | None = None
    iters: int = 10


@dataclass
class BenchConfig:
    """Schema of ``conf/bench.yaml`` (a scenario, then command-line overrides, on top)."""

    scenario: str = "custom"
    scenario_description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sections: list[str] = field(default_factory=lambda: ["offline", "decode", "prefill", "hf"])
    offline: OfflineSpec = field(default_factory=OfflineSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)
    prefill: PrefillSpec = field(default_factory=PrefillSpec)
    hf: HFSpec = field(default_factory=HFSpec)
    spec: SpecBenchSpec = field(default_factory=SpecBenchSpec)
    ceilings: CeilingSpec = field(default_factory=CeilingSpec)
    out_dir: str = "benchmarks/results"
    cpu_threads: int | None = None  # torch intra-op threads on CPU during the run; None: torch's default
    git_rev: str | None = None  # recorded instead of asking git (a checkout copied without .git)
    compare_batch_invariant: bool = False  # offline + decode again with engine.batch_invariant flipped

    def __post_init__(self):
        for name, values, known in (("sections", self.sections, SECTIONS),
                                    ("offline.workloads", self.offline.workloads, WORKLOADS),
                                    ("hf.workloads", self.hf.workloads, WORKLOADS)):
            bad = [v for v in values if v not in known]
            if bad:
                raise ValueError(f"{name} has unknown entries {bad}; choose from {list(known)}")
        for name, rng in (("mixed_input_range", self.offline.mixed_input_range),
                          ("mixed_output_range", self.offline.mixed_output_range)):
            if len(rng) != 2 or not 1 <= rng[0] <= rng[1]:
                raise ValueError(f"offline.{name} must be [min, max] with 1 <= min <= max, got {list(rng)}")
        if self.git_rev is not None and not re.fullmatch(r"[0-9a-fA-F]{4,40}", str(self.git_rev)):
            # Hydra reads an unquoted revision of digits and one "e" (19688e1) as a number (196880.0)
            raise ValueError(f"git_rev={self.git_rev!r} is not a git revision (4-40 hex digits); a revision such "
                             f"as 19688e1 must be quoted, git_rev=\"'19688e1'\", or Hydra reads it as a number")


def _ms(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} ms"


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms" if seconds < 10 else f"{seconds:9.2f} s "


def _line(name: str, measured: str, roof: dict | None, fraction: float | None) -> None:
    extra = f"   roofline {_fmt_s(roof['roofline_s'])} ({roof['bound']})  {100 * fraction:5.1f}% of roofline" \
        if roof else ""
    print(f"  {name:<34} {measured}{extra}", flush=True)


def _workload(cfg: BenchConfig, name: str, vocab_size: int) -> list[bl.WorkItem]:
    o = cfg.offline
    if name == "fixed":
        return bl.fixed_workload(o.num_prompts, o.input_len, o.output_len, vocab_size, o.seed)
    return bl.mixed_workload(o.num_prompts, tuple(o.mixed_input_range), tuple(o.mixed_output_range), vocab_size,
                             o.seed + 1)


def _offline(cfg, engine, cost, ceilings) -> dict[str, Any]:
    results = {}
    for name in cfg.offline.workloads:
        items = _workload(cfg, name, engine.vocab_size)
        summary = bl.run_offline(engine, items, request_prefix=name).summary()
        roof = rl.offline_roofline(cost, [len(i.prompt_token_ids) for i in items], [i.max_tokens for i in items],
                                   cfg.engine.max_num_seqs, ceilings)
        fraction = roof["roofline_s"] / summary["elapsed_s"]
        results[name] = {**summary, "roofline": roof, "roofline_fraction": fraction}
        _line(f"offline {name} ({len(items)} requests)", f"{summary['output_tok_s']:10.1f} out tok/s "
              f"(TTFT p50 {_ms(summary['median_ttft_ms'], 0)}, TPOT p50 {_ms(summary['median_tpot_ms'], 2)})",
              roof, fraction)
    return results


def _decode(cfg, model, kv_cache, graphs, cost, ceilings, notes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for context in cfg.decode.contexts:
        for batch in cfg.decode.batches:
            r = bl.time_decode_step(model, kv_cache, cfg.engine.block_size, batch, context, cfg.decode.warmup,
                                    cfg.decode.iters, seed=batch * 7919 + context, graphs=graphs)
            roof = rl.roofline(*rl.decode_step_cost(cost, batch, context), ceilings)
            fraction = roof["roofline_s"] / r["step_s"]
            rows.append({"batch": batch, "context": context, **r, "tok_s": batch / r["step_s"],
                         "roofline": roof, "roofline_fraction": fraction})
            tag = "  [KV aliased]" if r["kv_aliased"] else ""
            eager = f" (eager {_fmt_s(r['eager_step_s']).strip()})" if r["path"] != "eager" else ""
            _line(f"decode B={batch} ctx={context}{tag}", f"{_fmt_s(r['step_s'])}/step [{r['path']}]{eager}",
                  roof, fraction)
            if "graph_error" in r:
                notes.append(f"decode B={batch} ctx={context}: CUDA graph replay failed ({r['graph_error']}); "
                             "eager time reported")
            if r["kv_aliased"]:
                notes.append(f"decode B={batch} ctx={context}: {batch * context} KV tokens exceed the cache "
                             f"({r['num_blocks']} blocks of {cfg.engine.block_size}); block tables wrap around "
                             "onto the available blocks (same bytes read, shared physical blocks)")
    return rows


def _prefill(cfg, model, kv_cache, cost, ceilings, notes: list[str]) -> list[dict[str, Any]]:
    rows = []
    chunk = cfg.engine.max_num_batched_tokens
    for n in cfg.prefill.lengths:
        r = bl.time_prefill(model, kv_cache, cfg.engine.block_size, n, chunk, cfg.prefill.warmup,
                            cfg.prefill.iters, seed=n)
        roof = rl.roofline(*rl.prefill_cost(cost, n), ceilings)
        fraction = roof["roofline_s"] / r["prefill_s"]
        rows.append({"num_tokens": n, "chunk_size": chunk, **r, "tok_s": n / r["prefill_s"], "roofline": roof,
                     "roofline_fraction": fraction})
        _line(f"prefill {n} tokens ({r['num_chunks']} chunks)", f"{n / r['prefill_s']:10.1f} tok/s", roof, fraction)
        if n > model.config.max_position_embeddings:
            notes.append(f"prefill {n}: longer than max_position_embeddings "
                         f"({model.config.max_position_embeddings}); timed all the same")
        if r["kv_aliased"]:
            notes.append(f"prefill {n}: more KV blocks than the cache holds; block ids wrap around")
    return rows


def _hf(cfg, model, cost, ceilings, offline: dict, save=None, notes: list[str] | None = None) -> dict[str, Any]:
    """Each HF workload at every ``hf.batch_sizes`` (see :class:`HFSpec`); ``save(partial)`` after each size.

    Returns:
        ``{workload: {"by_batch_size": {"32": row or "oom", ...}, "best_batch_size", the best row's fields
        (``output_tok_s``, ...), "engine_over_hf": engine / best HF output tok/s}}``; ``{"error": ...}``
        when no HF twin could be built. A row is :func:`benchlib.hf_generate_throughput`'s with its
        roofline (``max_num_seqs`` = the size) and its own ``engine_over_hf``.
    """
    results: dict[str, Any] = {}
    try:
        hf = bl.hf_twin(model)
    except Exception as e:  # another architecture without a mapping: the rest of the run still counts
        print(f"  hf: skipped ({e!r})", flush=True)
        return {"error": repr(e)}
    for name in cfg.hf.workloads:
        workload = _workload(cfg, name, model.config.vocab_size)
        ours = offline.get(name, {}).get("output_tok_s")
        by_size: dict[str, Any] = {}
        results[name] = {"by_batch_size": by_size}
        for size in cfg.hf.batch_sizes:
            items = workload[: cfg.hf.num_prompts or size]
            if len(items) < size and notes is not None:
                notes.append(f"hf {name} batch {size}: only {len(items)} prompts (hf.num_prompts, the workload), "
                             f"so its batches hold {len(items)}; hf.num_prompts=null runs one full batch per size")
            r = bl.hf_generate_or_oom(hf, items, size)
            if r == "oom":
                by_size[str(size)] = "oom"
                print(f"  hf {name} batch {size}: out of device memory (recorded as \"oom\")", flush=True)
            else:
                roof = rl.offline_roofline(cost, [len(i.prompt_token_ids) for i in items],
                                           [i.max_tokens for i in items], size, ceilings)
                fraction = roof["roofline_s"] / r["elapsed_s"]
                by_size[str(size)] = {**r, "roofline": roof, "roofline_fraction": fraction,
                                      "engine_over_hf": ours / r["output_tok_s"] if ours else None}
                vs = f"; engine {ours / r['output_tok_s']:.2f}x" if ours else ""
                _line(f"hf {name} ({len(items)} req, batch {size})", f"{r['output_tok_s']:10.1f} out tok/s{vs}",
                      roof, fraction)
            results[name].update(_best_hf(by_size))
            if save:
                save(results)
        best = results[name]["best_batch_size"]
        if best is not None and len(by_size) > 1:
            vs = f", engine {results[name]['engine_over_hf']:.2f}x" if ours else ""
            print(f"  hf {name}: best at batch {best}, {results[name]['output_tok_s']:.1f} out tok/s{vs}", flush=True)
    del hf
    return results


def _best_hf(by_size: dict[str, Any]) -> dict[str, Any]:
    """The fastest measured row of ``by_size`` ("oom" entries skipped), its fields at the top level, with
    ``best_batch_size`` and ``engine_over_hf`` against it; all None when every size ran out of memory."""
    measured = {int(k): v for k, v in by_size.items() if isinstance(v, dict)}
    if not measured:
        return {"best_batch_size": None, "output_tok_s": None, "engine_over_hf": None}
    size = max(measured, key=lambda k: measured[k]["output_tok_s"])
    return {**measured[size], "best_batch_size": size}


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Run the configured sections, print each against its roofline, and write the result JSON.

    A section that fails records ``{"error": ...}`` and the run goes on; the JSON is rewritten after each
    section, so a run cut short keeps what it measured.

    Returns:
        the result dict (also written to ``cfg.out_dir``; its path under ``"path"``).
    Raises:
        ValueError: for a bad config, an unknown model or architecture, or a model too large for CPU.
    """
    from rayinfer.engine.llm_engine import resolve_device

    on_cpu = resolve_device(cfg.engine.device).type == "cpu"
    try:
        with bl.torch_threads(cfg.cpu_threads if on_cpu else None):
            return _run(cfg)
    finally:
        bl.release_device_memory()  # the next scenario of a multirun sizes its KV cache from free memory


def _run(cfg: BenchConfig) -> dict[str, Any]:
    from rayinfer.engine.llm_engine import LLMEngine, resolve_device
    from rayinfer.model.loader import check_quantization, load_config, parse_dtype

    from rayinfer import envs

    t_start = time.perf_counter()
    envs.check()  # a bad RAYINFER_* value: before any model loads
    hf_config = load_config(cfg.model.model)
    check_quantization(hf_config, cfg.model.quantization)  # before any engine starts
    if "spec" in cfg.sections:
        check_spec(cfg.spec)
    device = resolve_device(cfg.engine.device)
    dtype = parse_dtype(cfg.model.dtype, device)
    kv_bytes = 1 if cfg.engine.kv_cache_dtype == "fp8" else None
    # the spec section compares engines with each other and needs no roofline (no cost model for every architecture)
    cost = (rl.cost_model_for(hf_config, dtype.itemsize, kv_bytes)
            if set(cfg.sections) - {"spec"} else None)
    weight_bytes = getattr(cost, "num_params", 0) * dtype.itemsize
    if device.type == "cpu" and weight_bytes > _MAX_CPU_WEIGHT_BYTES:
        raise ValueError(f"model {cfg.model.model!r} has {weight_bytes / 2**30:.1f} GiB of weights; on CPU use "
                         "scenario=tiny (or engine.device=cuda on a GPU machine)")
    result: dict[str, Any] = {"scenario": cfg.scenario, "description": cfg.scenario_description,
                              **bl.run_metadata(device, cfg.git_rev), "dtype": str(dtype).removeprefix("torch."),
                              "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
                              "num_params": getattr(cost, "num_params", None), "notes": []}
    print(f"bench {cfg.scenario}: {cfg.model.model} ({result['dtype']}) on {result['device']}, "
          f"git {result['git_rev']}{'+dirty' if result['git_dirty'] else ''}", flush=True)
    # a reference for engine_over_hf when HF runs without the offline section (checked before the long load)
    engine_reference = (_engine_offline(cfg.hf.engine_result, cfg, result["notes"])
                        if "hf" in cfg.sections and "offline" not in cfg.sections and cfg.hf.engine_result else None)
    cuda = device.type == "cuda"
    path = result["path"] = str(result_path(Path(cfg.out_dir), cfg.scenario, result["device"]))
    seconds = result["section_seconds"] = {}

    def save(name: str | None = None, value: Any = None) -> None:
        """Write the result so far (with ``result[name] = value`` first, a section's partial result)."""
        if name is not None:
            result[name] = value
        result["seconds"] = time.perf_counter() - t_start
        Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")

    def timed(name: str, fn) -> None:
        """Run one section; a failure is recorded (and printed) and the run goes on; save after each."""
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # one broken section (an OOM, a kernel error) must not lose the others
            traceback.print_exc()
            partial = result.get(name)  # what the section saved before it failed
            result[name] = {"error": repr(e), **({"partial": partial} if partial else {})}
            bl.release_device_memory()
        seconds[name] = time.perf_counter() - t0
        save()

    c = cfg.ceilings
    timed("ceilings", lambda: rl.measure_ceilings(device, dtype, (c.copy_mib or (2048 if cuda else 64)) << 20,
                                                  c.gemm_n or (8192 if cuda else 512), c.iters))
    ceilings = result["ceilings"]
    if "error" in ceilings:
        raise RuntimeError(f"could not measure the ceilings: {ceilings['error']}")
    print(f"  ceilings: {ceilings['bandwidth_Bps'] / 1e9:.1f} GB/s copy, {ceilings['matmul_flops'] / 1e12:.2f} "
          f"TFLOP/s matmul ({ceilings['dtype']})", flush=True)
    t0 = time.perf_counter()
    engine = LLMEngine(cfg.model, cfg.engine, model_kwargs=spec_model_kwargs(cfg.spec, cfg.model, cfg.sections))
    cfg.engine = engine.engine_config  # max_num_seqs / max_num_batched_tokens as chosen for the device
    bl.warm_up(engine, cfg.engine.block_size)
    result["num_kv_blocks"] = engine.scheduler.config.num_blocks
    seconds["load"] = time.perf_counter() - t0
    if "offline" in cfg.sections:
        timed("offline", lambda: _offline(cfg, engine, cost, ceilings))
    graphs = getattr(engine.runner, "graphs", None)  # decode CUDA graphs, when the engine captured them
    if "decode" in cfg.sections:
        timed("decode", lambda: _decode(cfg, engine.model, engine.kv_cache, graphs, cost, ceilings,
                                        result["notes"]))
    if "prefill" in cfg.sections:
        timed("prefill", lambda: _prefill(cfg, engine.model, engine.kv_cache, cost, ceilings, result["notes"]))
    model, tokenizer = engine.model, engine.tokenizer
    del engine, graphs  # the HF run needs the KV cache's memory
    bl.release_device_memory()
    offline = result.get("offline", {})
    if "hf" in cfg.sections:
        offline = engine_reference or offline
        timed("hf", lambda: _hf(cfg, model, cost, ceilings, offline if "error" not in offline else {},
                                save=lambda partial: save("hf", partial), notes=result["notes"]))
    if "spec" in cfg.sections:
        timed("spec", lambda: run_spec_section(cfg.spec, cfg.model, cfg.engine, model, tokenizer,
                                               line=lambda text: print(text, flush=True)))
    del model
    if cfg.compare_batch_invariant:
        bl.release_device_memory()
        timed("batch_invariant", lambda: _batch_invariant_compare(cfg, result, cost, ceilings))
    print(f"wrote {path} ({result['seconds']:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
          + ")", flush=True)
    for note in result["notes"]:
        print(f"  note: {note}")
    return result


def _engine_offline(path: str, cfg: BenchConfig, notes: list[str]) -> dict[str, Any]:
    """The offline section of the earlier result at ``path`` (``hf.engine_result``), with a note saying so.

    Raises:
        ValueError: if the file cannot be read, has no offline figures, or is of another model.
    """
    try:
        earlier = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"hf.engine_result={path!r} is not a readable bench result ({e})") from e
    offline = earlier.get("offline")
    if not isinstance(offline, dict) or not any("output_tok_s" in v for v in offline.values() if isinstance(v, dict)):
        raise ValueError(f"hf.engine_result={path!r} has no offline figures to compare with")
    model = (earlier.get("config") or {}).get("model", {}).get("model")
    if model != cfg.model.model:
        raise ValueError(f"hf.engine_result={path!r} is of model {model!r}, this run's is {cfg.model.model!r}")
    notes.append(f"engine_over_hf uses the engine's offline figures of {path} (git {earlier.get('git_rev')}, "
                 f"{earlier.get('timestamp')}), not of this run")
    return offline


def _batch_invariant_compare(cfg, result, cost, ceilings) -> dict[str, Any]:
    """The offline and decode sections again on a new engine with ``engine.batch_invariant`` flipped
    (decode steps driven inside the mode), beside the first run's figures.

    Returns:
        ``{"batch_invariant": the flipped value, "offline", "decode", "offline_slowdown": {workload:
        tok/s with the mode off / on}, "decode_slowdown": [{batch, context, ratio: step time on / off}]}``.
    """
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.kernels.batch_invariant import batch_invariant_mode

    on = not cfg.engine.batch_invariant
    print(f"  -- again with engine.batch_invariant={on} --", flush=True)
    engine = LLMEngine(cfg.model, dataclasses.replace(cfg.engine, batch_invariant=on))
    bl.warm_up(engine, cfg.engine.block_size)
    out: dict[str, Any] = {"batch_invariant": on}
    try:
        if "offline" in cfg.sections:
            out["offline"] = _offline(cfg, engine, cost, ceilings)
        if "decode" in cfg.sections:
            with batch_invariant_mode(on):
                out["decode"] = _decode(cfg, engine.model, engine.kv_cache, engine.runner.graphs, cost, ceilings,
                                        result["notes"])
    finally:
        del engine
        bl.release_device_memory()
    first_offline, first_decode = result.get("offline") or {}, result.get("decode") or []
    slow: dict[str, float] = {}  # offline time in the batch-invariant mode / in the default mode
    for name, r in out.get("offline", {}).items():
        if isinstance(first_offline, dict) and "output_tok_s" in first_offline.get(name, {}):
            first, second = first_offline[name]["output_tok_s"], r["output_tok_s"]
            slow[name] = first / second if on else second / first
    out["offline_slowdown"] = slow
    rows = []
    if isinstance(first_decode, list):
        for r0, r1 in zip(first_decode, out.get("decode", [])):
            on_s, off_s = (r1["step_s"], r0["step_s"]) if on else (r0["step_s"], r1["step_s"])
            rows.append({"batch": r0["batch"], "context": r0["context"], "ratio": on_s / off_s})
    out["decode_slowdown"] = rows  # step time in the batch-invariant mode / in the default mode
    for name, ratio in out["offline_slowdown"].items():
        print(f"  batch-invariant offline {name}: {ratio:.3f}x the default mode's time "
              f"({(ratio - 1) * 100:+.1f}%; target <= +25%)", flush=True)
    for row in rows:
        print(f"  batch-invariant decode B={row['batch']} ctx={row['context']}: {row['ratio']:.3f}x", flush=True)
    return out


def result_path(out_dir: Path, scenario: str, device: str) -> Path:
    """A new file ``<out_dir>/bench-<scenario>-<device>-<YYYYmmdd-HHMMSS>.json`` (created empty)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower() or "cpu"
    stem = f"bench-{scenario}-{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out_dir / f"{stem}.json", 1
    while path.exists():
        path, n = out_dir / f"{stem}-{n}.json", n + 1
    path.touch()
    return path


def register_configs() -> None:
    """Store the schema (``bench_schema``); scenarios were stored when benchlib registered them (the MoE ones
    are stored again here, in case a caller re-registered them elsewhere)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="bench_schema", node=BenchConfig)
    register_bench_plugins()


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
def main(dcfg: DictConfig) -> None:
    try:
        run(OmegaConf.to_object(dcfg))
    except ValueError as e:  # bad config or model: clear message, non-zero exit, no result written
        print(f"error: {e}", file=sys.stderr)
        if HydraConfig.get().mode != RunMode.MULTIRUN:  # in a multirun, the next scenario still runs
            sys.exit(2)


if __name__ == "__main__":
    register_configs()
    main()
