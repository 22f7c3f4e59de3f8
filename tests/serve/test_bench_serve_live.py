"""bench_serve.py against the live server: a ShareGPT file, lengths from the server's /tokenize, goodput
and the progress bar."""

from __future__ import annotations

import json


def test_bench_serve_sharegpt_with_goodput(live_server, tmp_path, capsys):
    from rayinfer.jobs import bench_serve

    data = [{"conversations": [{"from": "human", "value": f"Question {i}: tell me something about the number {i}."},
                               {"from": "gpt", "value": "Here are a few words for you " + "and more " * i}]}
            for i in range(5)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "bench.json"
    code = bench_serve.main(["--base-url", live_server.base_url, "--api-key", live_server.api_key,
                             "--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4",
                             "--goodput", "ttft:60000", "e2el:120000", "--json", str(out),
                             "--metadata", "topology=colocated", "git_rev=abc=1"])
    assert code == 0
    captured = capsys.readouterr()
    assert "4/4" in captured.err  # the progress bar reached the end
    assert "Request goodput (req/s):" in captured.out
    summary = json.loads(out.read_text())
    assert summary["completed"] == 4 and summary["num_good"] == 4  # generous SLOs: every request is good
    assert summary["request_goodput"] > 0
    assert summary["topology"] == "colocated" and summary["git_rev"] == "abc=1"  # --metadata, split at the first =
    assert summary["command"].startswith("python jobs/bench_serve.py --base-url ") and "--metadata" in summary["command"]
    # ignore_eos: each request generates exactly its answer's length, counted by the server's tokenizer
    tokenizer = bench_serve.RemoteTokenizer(live_server.base_url, live_server.api_key)
    sampled = bench_serve.load_sharegpt(str(path), 4, seed=0, tokenizer=tokenizer)
    assert summary["total_output_tokens"] == sum(r.output_len for r in sampled) > 4 * 4
