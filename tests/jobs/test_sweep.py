"""The sweep: Pareto frontier by hand, labels, CSV rows, and a 2-configuration multirun with the tiny model."""

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from rayinfer.jobs.sweep import append_row, pareto_frontier, plot_pareto, plot_title, summary_line, sweep_label

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_pareto_frontier_by_hand():
    # (median TPOT ms, tokens/s): lower x and higher y are better
    points = [(10, 100), (20, 150), (15, 90), (30, 150), (5, 50), (20, 140), (math.nan, 1000), (10, 100)]
    # (15, 90) loses to (10, 100); (30, 150) and (20, 140) lose to (20, 150); the NaN row is skipped;
    # the duplicate (10, 100) keeps its first copy
    assert pareto_frontier(points) == [4, 0, 1]
    assert pareto_frontier([]) == []
    assert pareto_frontier([(1, 1)]) == [0]
    assert pareto_frontier([(1, 5), (2, 6), (3, 7)]) == [0, 1, 2]  # a strict trade-off: all on the frontier


def test_plot_marks_the_frontier(tmp_path):
    rows = [{"label": "a", "median_tpot_ms": "10", "output_tok_s_per_unit": "100", "unit": "gpu"},
            {"label": "b", "median_tpot_ms": "15", "output_tok_s_per_unit": "90", "unit": "gpu"},
            {"label": "c", "median_tpot_ms": "20", "output_tok_s_per_unit": "150", "unit": "gpu"},
            {"label": "d", "median_tpot_ms": "", "output_tok_s_per_unit": "150", "unit": "gpu"}]
    png = tmp_path / "p.png"
    assert plot_pareto(rows, png) == [0, 2]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_sweep_label_names_the_swept_keys():
    argv = ["--multirun", "engine.max_num_seqs=8,32", "model.dtype=float32", "parallel.dp=range(1,3)",
            "offline.x=[1,2]"]
    task = ["engine.max_num_seqs=8", "model.dtype=float32", "parallel.dp=2", "offline.x=[1,2]", "hydra.a=b"]
    assert sweep_label(task, argv) == "max_num_seqs=8 dp=2"
    assert sweep_label(["model.dtype=float32"], ["model.dtype=float32"]) == "dtype=float32"
    assert sweep_label([], []) == "default"


def test_summary_line_rounds():
    row = {"label": "dp=2", "output_tok_s_per_unit": 1234.5678901, "unit": "gpu", "median_tpot_ms": 9.3612345678,
           "median_ttft_ms": 123.456789012}
    assert summary_line(row, "s.csv") == "[dp=2] 1234.6 out tok/s per gpu, TPOT p50 9.36 ms, TTFT p50 123.5 ms -> s.csv"
    assert "TPOT p50 n/a ms" in summary_line(row | {"median_tpot_ms": None}, "s.csv")


def test_plot_title_names_model_workload_and_device():
    rows = [{"model": "llama-3-8b", "num_prompts": "1000", "workload": "1000/1000", "device": "cuda",
             "device_name": "NVIDIA H200"}] * 2
    assert plot_title(rows) == "llama-3-8b, 1000 prompts x 1000/1000 tokens, NVIDIA H200 (2 configurations)"
    old_csv = [{"model": "m", "num_prompts": "8", "workload": "mixed", "device": "cpu"},
               {"model": "n", "num_prompts": "8", "workload": "mixed", "device": "cpu"}]  # no device_name column
    assert plot_title(old_csv) == "m / n, 8 prompts x mixed lengths, cpu (2 configurations)"


def test_append_row_writes_one_header(tmp_path):
    path = tmp_path / "s.csv"
    append_row(path, {"a": 1, "b": 2})
    append_row(path, {"b": 4, "a": 3, "c": 5})  # the first header's columns and order win
    assert path.read_text().splitlines() == ["a,b", "1,2", "3,4"]


def test_topology_sweep_writes_rows_and_a_pareto_png(tmp_path, ray_cluster):
    """colocated and 1P1D fleets through the batch job's client; PD with dp=2 is refused (no row). The
    sweep joins the session's Ray cluster (RAY_ADDRESS) rather than starting one of its own."""
    cmd = [sys.executable, str(ROOT / "jobs" / "sweep.py"), "--multirun", "model.model=llama-tiny",
           "model.load_format=dummy", "model.dtype=float32", "engine.device=cpu", "engine.num_kv_blocks=32",
           "workload.num_prompts=3", "workload.input_len=12", "workload.output_len=3", "engine.max_num_seqs=3",
           "parallel=colocated,1p1d", "parallel.dp=1,2", "cpu_threads=1", f"hydra.sweep.dir={tmp_path}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg",
           "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["parallel=colocated dp=1", "parallel=colocated dp=2",
                                          "parallel=1p1d dp=1"]
    assert [(r["topology"], r["num_units"]) for r in rows] == [("colocated", "1"), ("colocated", "2"), ("pd", "2")]
    assert "error [parallel=1p1d dp=2]: dp must be 1" in proc.stderr  # the refused config says which and why
    for r in rows:
        assert r["unit"] == "replica" and r["num_output_tokens"] == "9"
        assert float(r["output_tok_s_per_unit"]) > 0 and float(r["median_tpot_ms"]) > 0
        assert float(r["median_ttft_ms"]) > 0
    png = tmp_path / "pareto.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "frontier" in proc.stdout
    # progress per run: the fleet it starts, then a bar of requests, tokens and tok/s as they stream
    assert "[parallel=1p1d dp=1] starting the pd fleet" in proc.stdout
    assert "[parallel=colocated dp=2]" in proc.stderr and "est. speed input:" in proc.stderr
    summaries = [ln for ln in proc.stdout.splitlines() if "out tok/s per replica" in ln]
    assert len(summaries) == 3 and not any(re.search(r"\d\.\d{3}", ln) for ln in summaries), summaries
    assert rows[0]["device_name"].startswith("CPU (")
