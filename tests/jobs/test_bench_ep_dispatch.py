"""``jobs/bench_ep_dispatch.py`` on CPU (gloo, 2 ranks, the tiny shape): one row per token count, with the
rows each rank dispatched, bytes and times of every layout, in the JSON it writes."""

from __future__ import annotations

import json

from rayinfer.jobs import bench_ep_dispatch


def test_bench_ep_dispatch_on_gloo(tmp_path):
    out = tmp_path / "ep.json"
    bench_ep_dispatch.main(["--device", "cpu", "--ep", "2", "--shape", "tiny", "--tokens", "3", "16", "--repeats", "2",
                            "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["ep"] == 2 and result["backend"] == "gloo" and result["shape"]["top_k"] == 2
    assert [r["tokens_per_rank"] for r in result["rows"]] == [3, 16]
    for row in result["rows"]:
        tokens = row["tokens_per_rank"]
        # top-2 over 2 ranks: a token goes to one or both ranks, never more
        assert tokens <= row["rows_sent_per_rank"] <= 2 * tokens
        assert 0 < row["exact_bytes_per_rank"] <= row["fixed_bytes_per_rank"]
        assert all(row[k] > 0 for k in ("exact_us", "fixed_us", "all_gather_us", "link_us", "exact_torch_us",
                                        "fixed_torch_us"))
