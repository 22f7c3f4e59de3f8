"""Capacity planning: a Hydra multirun over engine and parallel settings, one CSV row per configuration,
then a Pareto plot of output tokens/s per GPU against median TPOT, one marker shape per topology.

    python jobs/sweep.py --multirun engine.max_num_seqs=8,32 engine.max_num_batched_tokens=256,1024 \\
        engine.block_size=16,32 parallel.dp=1,2
    python jobs/sweep.py --multirun parallel=colocated,1p1d,2p1d,2p2d parallel.dp=1,2   # which split serves best
    python jobs/sweep.py plot=benchmarks/results/sweep-20260101-120000/sweep.csv     # re-plot a CSV

Each run starts the fleet of its ``parallel`` config (colocated replicas, prefill/decode replicas, or an
expert-parallel group; one GPU per replica on CUDA) and pushes the same seeded offline workload (random
token ids, ignore_eos, all requests at time 0) through the client the batch job and Serve use, streamed:
TTFT is the time its first token reached this process, TPOT the mean gap of its later tokens. Rows go to
``<hydra.sweep.dir>/sweep.csv``; when the multirun ends, :class:`ParetoPlotCallback` writes ``pareto.png``
beside it (throughput per GPU, or per replica on CPU). A config the fleet refuses (PD with ``dp`` > 1,
more GPUs than the cluster has) prints its error and writes no row; the sweep goes on.
"""

from __future__ import annotations

import csv
import logging
import math
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.jobs import benchlib as bl
from rayinfer.placement.parallel_config import ParallelConfig

X_KEY, Y_KEY = "median_tpot_ms", "output_tok_s_per_unit"
TOPOLOGY_MARKERS = {"colocated": "o", "pd": "s", "ep": "^"}


@dataclass
class SweepWorkload:
    """The offline workload of every run (fixed lengths, or seeded random lengths with ``mixed``)."""

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    mixed: bool = False
    input_range: list[int] = field(default_factory=lambda: [32, 512])  # inclusive, uniform (mixed only)
    output_range: list[int] = field(default_factory=lambda: [16, 256])
    seed: int = 0


@dataclass
class SweepConfig:
    """Schema of ``conf/sweep.yaml``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # any topology (conf/parallel/*.yaml)
    workload: SweepWorkload = field(default_factory=SweepWorkload)
    csv: str = "benchmarks/results/sweep.csv"  # conf/sweep.yaml: <hydra.sweep.dir>/sweep.csv
    label: str | None = None  # a run's name in the CSV and plot; None: its command-line overrides
    plot: str | None = None  # a sweep CSV: only write its Pareto plot (no measuring)
    png: str | None = None  # where the plot goes; None: pareto.png beside the CSV
    cpu_threads: int | None = None  # CPUs per replica (parallel.num_cpus_per_replica); None: split evenly
    git_rev: str | None = None


# -- measuring one configuration ---------------------------------------------------------------------
def make_items(w: SweepWorkload, vocab_size: int) -> list[bl.WorkItem]:
    """The run's workload (the same for every configuration of a sweep)."""
    if w.mixed:
        return bl.mixed_workload(w.num_prompts, tuple(w.input_range), tuple(w.output_range), vocab_size, w.seed)
    return bl.fixed_workload(w.num_prompts, w.input_len, w.output_len, vocab_size, w.seed)


def num_replicas(parallel: ParallelConfig) -> int:
    """Engine replicas (or EP ranks) a topology runs: what one row's throughput is divided over."""
    if parallel.topology == "pd":
        return parallel.num_prefill + parallel.num_decode
    return parallel.ep if parallel.topology == "ep" else parallel.dp


def run_fleet(cfg: SweepConfig, items: list[bl.WorkItem], device_type: str,
              label: str = "") -> tuple[bl.OfflineRun, int]:
    """Run ``items`` through the fleet of ``cfg.parallel`` (any topology), asked through the client the
    batch job and Serve use (``make_client``): every request at once, streamed, timed as its deltas
    reach this process. The fleet is started, and warmed up with one request, before the clock starts.
    A progress bar (stderr, named ``label``) shows requests done, tokens and tok/s as they stream.

    Returns:
        the run and the replicas' preemptions.
    Raises:
        ValueError: for a config the fleet refuses (e.g. more GPUs than the cluster has, after
            ``parallel.placement_timeout_s``).
    """
    import asyncio
    import dataclasses

    import ray

    from rayinfer.actors.client import make_client
    from rayinfer.jobs.bench_client import run_client

    parallel = cfg.parallel
    if device_type == "cuda" and not parallel.num_gpus_per_replica:
        parallel = dataclasses.replace(parallel, num_gpus_per_replica=1.0)
    if cfg.cpu_threads and parallel.num_cpus_per_replica is None:
        parallel = dataclasses.replace(parallel, num_cpus_per_replica=float(cfg.cpu_threads))
    if not ray.is_initialized():
        from rayinfer.actors.cluster import init_ray

        print(init_ray(log_to_driver=False, logging_level=logging.WARNING), flush=True)
    from tqdm import tqdm

    from rayinfer.jobs.progress import ProgressClient, TokenProgress

    print(f"[{label}] starting the {parallel.topology} fleet ({num_replicas(parallel)} replicas or ranks)",
          flush=True)
    client = make_client(cfg.model, cfg.engine, parallel)
    try:
        asyncio.run(run_client(client, items[:1]))  # warm-up: first-call paths, CUDA graphs
        with tqdm(total=len(items), desc=f"[{label}]", unit="req", file=sys.stderr) as bar:
            counted = ProgressClient(client, TokenProgress(bar), count_requests=True)
            result = asyncio.run(run_client(counted, items, "stream"))
        preemptions = sum(r.num_preemptions for r in asyncio.run(client.stats()).replicas)
    finally:
        client.shutdown()
        bl.release_device_memory()
    return result, preemptions


def measure(cfg: SweepConfig, label: str) -> dict[str, Any]:
    """Measure one configuration and return its CSV row.

    Returns:
        the row: the settings, ``output_tok_s`` (all replicas), ``output_tok_s_per_unit`` (per GPU on
        CUDA, per replica on CPU; ``unit`` says which), TTFT / TPOT median and p90 (ms), and counts.
    """
    from rayinfer.engine.llm_engine import resolve_device
    from rayinfer.model.loader import load_config

    device = resolve_device(cfg.engine.device)
    items = make_items(cfg.workload, load_config(cfg.model.model).vocab_size)
    result, preemptions = run_fleet(cfg, items, device.type, label)
    summary = result.summary()
    p = cfg.parallel
    replicas = num_replicas(p)
    units = max(1, math.ceil(replicas * (p.num_gpus_per_replica or 1.0))) if device.type == "cuda" else replicas
    e, w = cfg.engine, cfg.workload
    rev, dirty = (cfg.git_rev, None) if cfg.git_rev else bl.git_revision()
    return {
        "label": label, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": cfg.model.model,
        "dtype": cfg.model.dtype, "device": device.type, "device_name": device_name(device),
        "topology": p.topology, "dp": p.dp,
        "num_prefill": p.num_prefill, "num_decode": p.num_decode, "ep": p.ep,
        "unit": "gpu" if device.type == "cuda" else "replica", "num_units": units,
        "max_num_seqs": e.max_num_seqs, "max_num_batched_tokens": e.max_num_batched_tokens,
        "block_size": e.block_size, "num_kv_blocks": e.num_kv_blocks,
        "enable_chunked_prefill": e.enable_chunked_prefill, "enable_prefix_caching": e.enable_prefix_caching,
        "num_prompts": w.num_prompts, "workload": "mixed" if w.mixed else f"{w.input_len}/{w.output_len}",
        "num_output_tokens": summary["num_output_tokens"], "elapsed_s": summary["elapsed_s"],
        "output_tok_s": summary["output_tok_s"], "output_tok_s_per_unit": summary["output_tok_s"] / units,
        "median_ttft_ms": summary["median_ttft_ms"], "p90_ttft_ms": summary["p90_ttft_ms"],
        "median_tpot_ms": summary["median_tpot_ms"], "p90_tpot_ms": summary["p90_tpot_ms"],
        "num_preemptions": preemptions, "git_rev": rev, "git_dirty": dirty,
        "command": " ".join(["python", *sys.argv]),
    }


def device_name(device) -> str:
    """What the plot's title calls the device: the GPU's name, or the CPU and its core count."""
    import os

    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"CPU ({os.cpu_count()} cores)"


def _ms(value: Any) -> str:
    """Milliseconds for a line of text: two decimals below 10 ms, one below 1000, none above; "n/a"."""
    x = _num(value)
    if math.isnan(x):
        return "n/a"
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}" if abs(x) < 1000 else f"{x:.0f}"


def summary_line(row: dict[str, Any], csv_path: str) -> str:
    """The line a run prints when it ends, numbers rounded."""
    return (f"[{row['label']}] {_num(row['output_tok_s_per_unit']):.1f} out tok/s per {row['unit']}, "
            f"TPOT p50 {_ms(row['median_tpot_ms'])} ms, TTFT p50 {_ms(row['median_ttft_ms'])} ms -> {csv_path}")


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` to the CSV at ``path`` (header written when the file is new; an existing header's
    column order is kept, unknown keys dropped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(row)
    if path.exists() and path.stat().st_size:
        with path.open(newline="") as f:
            fields = next(csv.reader(f), fields)
    new = not path.exists() or not path.stat().st_size
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


# -- Pareto frontier and plot ----------------------------------------------------------------------
def pareto_frontier(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats, ordered by x.

    A point is (x, y) = (median TPOT, lower is better; throughput, higher is better). Point j dominates i
    when x_j <= x_i and y_j >= y_i with one of them strict; of exact duplicates the first is kept.
    Points with a NaN are never on the frontier.
    """
    valid = [i for i, (x, y) in enumerate(points) if not (math.isnan(x) or math.isnan(y))]
    frontier, best = [], -math.inf
    for i in sorted(valid, key=lambda i: (points[i][0], -points[i][1], i)):
        if points[i][1] > best:
            frontier.append(i)
            best = points[i][1]
    return frontier


def read_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a sweep CSV, as strings keyed by column."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def plot_pareto(rows: list[dict[str, Any]], png: Path, title: str = "") -> list[int]:
    """Scatter every row's (median TPOT, output tokens/s per unit), mark and join the Pareto frontier.

    Returns:
        the frontier's row indices (see :func:`pareto_frontier`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(_num(r.get(X_KEY)), _num(r.get(Y_KEY))) for r in rows]
    frontier = pareto_frontier(points)
    unit = rows[0].get("unit", "gpu") if rows else "gpu"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for topology in sorted({r.get("topology") or "colocated" for r in rows}):  # one marker shape each
        idx = [i for i, r in enumerate(rows) if (r.get("topology") or "colocated") == topology]
        ax.scatter([points[i][0] for i in idx], [points[i][1] for i in idx], color="tab:gray",
                   marker=TOPOLOGY_MARKERS.get(topology, "D"), label=topology, zorder=2)
    ax.plot([points[i][0] for i in frontier], [points[i][1] for i in frontier], "o-", color="tab:red",
            label="Pareto frontier", zorder=3)
    for i, r in enumerate(rows):
        if not math.isnan(points[i][0]) and not math.isnan(points[i][1]):
            ax.annotate(r.get("label", str(i)), points[i], fontsize=7, xytext=(4, 4), textcoords="offset points",
                        color="tab:red" if i in frontier else "black")
    ax.set_xlabel("median TPOT (ms)")
    ax.set_ylabel(f"output tokens/s per {unit}")
    ax.set_title(title or "throughput vs latency")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return frontier


def plot_title(rows: list[dict[str, Any]]) -> str:
    """The plot's title: the model(s), the workload(s) and the device(s) the rows measured, e.g.
    ``"llama-3-8b, 1000 prompts x 1000/1000 tokens, NVIDIA H200 (4 configurations)"``."""
    def distinct(values) -> str:
        seen = [v for v in dict.fromkeys(values) if v]
        return " / ".join(seen) if seen else "?"

    def workload(r) -> str:
        w = r.get("workload") or "?"
        return f"{r.get('num_prompts') or '?'} prompts x " + ("mixed lengths" if w == "mixed" else f"{w} tokens")

    return (f"{distinct(r.get('model') for r in rows)}, {distinct(workload(r) for r in rows)}, "
            f"{distinct(r.get('device_name') or r.get('device') for r in rows)} ({len(rows)} configurations)")


def write_pareto_png(csv_path: Path, png: Path | None = None) -> Path:
    """Plot a sweep CSV (see :func:`plot_pareto`) to ``png`` (default: pareto.png beside it); returns it."""
    png = png or csv_path.with_name("pareto.png")
    rows = read_rows(csv_path)
    frontier = plot_pareto(rows, png, title=plot_title(rows))
    print(f"wrote {png}: frontier " + ", ".join(rows[i].get("label", str(i)) for i in frontier))
    return png


class ParetoPlotCallback(Callback):
    """Hydra callback: when a multirun (or a single run) ends, plot the sweep's CSV (``cfg.csv``) to
    ``pareto.png`` beside it."""

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not config.get("plot"):
            self.on_multirun_end(config)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            path = Path(str(config.csv))
        except Exception:  # the csv key's interpolation could not be resolved here
            path = Path(str(config.hydra.sweep.dir)) / "sweep.csv"
        if path.exists():
            write_pareto_png(path, Path(config.png) if config.get("png") else None)
        else:
            print(f"no sweep CSV at {path}; nothing to plot", file=sys.stderr)


# -- entry point ---------------------------------------------------------------------------------------
def sweep_label(task_overrides: list[str], argv: list[str]) -> str:
    """A short name of one job of a sweep: its values of the keys the command line sweeps.

    Args:
        task_overrides: the job's own overrides (``engine.max_num_seqs=8``, ...).
        argv: the command line (``engine.max_num_seqs=8,32`` marks that key as swept).
    Returns:
        e.g. ``"max_num_seqs=8 dp=1"``; all the job's overrides when none is swept; "default" when none.
    """
    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")

    def is_sweep(value: str) -> bool:
        return ("," in value and not value.startswith(("[", "{"))) or value.startswith(
            ("range(", "choice(", "interval(", "glob("))

    swept = {key(a) for a in argv if "=" in a and is_sweep(a.split("=", 1)[1])}
    own = [o for o in task_overrides if "=" in o and not key(o).startswith(("hydra.", "csv", "label"))]
    chosen = [o for o in own if key(o) in swept] or own
    return " ".join(f"{key(o).rsplit('.', 1)[-1]}={o.split('=', 1)[1]}" for o in chosen) or "default"


def _job_label() -> str:
    try:
        from hydra.core.hydra_config import HydraConfig

        task = list(HydraConfig.get().overrides.task)
    except Exception:  # not under Hydra (tests call run() directly)
        task = []
    return sweep_label(task, sys.argv[1:])


def run(cfg: SweepConfig) -> dict[str, Any] | None:
    """Measure one configuration and append its row to ``cfg.csv``; with ``cfg.plot``, only plot that CSV.

    Returns:
        the row written (None in plot mode).
    """
    if cfg.plot:
        write_pareto_png(Path(cfg.plot), Path(cfg.png) if cfg.png else None)
        return None
    row = measure(cfg, cfg.label or _job_label())
    append_row(Path(cfg.csv), row)
    print(summary_line(row, cfg.csv), flush=True)
    return row


def register_configs() -> None:
    """Store the schema (``sweep_schema``) that conf/sweep.yaml extends."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="sweep_schema", node=SweepConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="sweep")
def main(dcfg: DictConfig) -> None:
    try:
        run(OmegaConf.to_object(dcfg))
    except ValueError as e:  # a bad configuration (dp beyond the GPUs, a prompt too long): no row
        print(f"error [{_job_label()}]: {e}", file=sys.stderr)
    except Exception:  # one configuration that breaks (an OOM) must not end the sweep: no row
        traceback.print_exc()
        bl.release_device_memory()


if __name__ == "__main__":
    from rayinfer.cli import normalize_overrides

    sys.argv[1:] = normalize_overrides(sys.argv[1:])  # model=llama3-8b is model=llama-3-8b
    register_configs()
    main()
