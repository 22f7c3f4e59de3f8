"""jobs/bench_host.py: a tiny run measures decode steps only and splits host from model time."""

from rayinfer.jobs import bench_host


def test_bench_host_tiny_run(capsys):
    rows = bench_host.main(["--batches", "1", "3", "--input-len", "40", "--output-len", "5"])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["steps"] >= 3 and r["host_ms"] > 0 and r["model_ms"] > 0
    assert "host ms/step" in capsys.readouterr().out
