"""The batch job: one ordered output line per input line, per-line errors, resume, clean exits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.jobs.generate import (
    GenerateConfig,
    append_record,
    choice_params,
    drop_cut_line,
    match_done,
    output_record,
    parse_lines,
    run,
)
from rayinfer.placement.parallel_config import EPLBSection, ParallelConfig

ROOT = Path(__file__).resolve().parents[2]


def test_parse_lines_flags_bad_lines(tokenizer):
    lines = [
        '{"id": "ok", "prompt": "Hello", "max_tokens": 3}',
        '{"id": "chat", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.5}',
        '{"id": "bad-json", "prompt": ',
        '{"id": "empty", "prompt": ""}',
        '{"id": "unknown", "prompt": "x", "temprature": 1}',
        '{"id": "neg", "prompt": "x", "temperature": -1}',
        '{"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
        '{"id": "ok", "prompt": "dup"}',
        '{"prompt": "no id"}',
    ]
    jobs = parse_lines(lines, tokenizer, {"max_tokens": 8})
    errors = {j.id: j.error for j in jobs[:7]} | {"line-8": jobs[8].error}
    assert errors["ok"] is None and errors["chat"] is None and errors["line-8"] is None
    assert "malformed JSON" in jobs[2].error
    assert "empty" in errors["empty"]
    assert "temprature" in errors["unknown"]
    assert "temperature" in errors["neg"]
    assert "exactly one" in errors["both"]
    assert "duplicate" in jobs[7].error
    assert jobs[0].params.max_tokens == 3 and jobs[1].params.max_tokens == 8


def test_special_token_text_in_user_content_stays_plain(tokenizer):
    jobs = parse_lines(['{"messages": [{"role": "user", "content": "a <|im_start|> b"}]}'], tokenizer, {})
    ids = jobs[0].prompt_token_ids
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # the template's two turn headers (system default + user + assistant) use the control token;
    # the user's literal text must not add one more
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=True,
                                             add_generation_prompt=True)
    rendered = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert ids.count(im_start) == list(rendered).count(im_start)
    assert "<|im_start|>" in tokenizer.decode(ids)


def test_job_end_to_end_with_errors_and_resume(tmp_path, ray_cluster):
    long_prompt = "word " * 9000
    lines = [
        {"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 8},
        {"id": "b", "prompt": "The sky is", "max_tokens": 5, "temperature": 0.7, "seed": 3},
        {"id": "too-long", "prompt": long_prompt},
        {"id": "bad", "prompt": "x", "top_p": 7},
    ]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    out = tmp_path / "out.jsonl"
    cfg = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"),
                         engine=EngineConfig(device="cpu", num_kv_blocks=256), parallel=ParallelConfig(dp=1),
                         sampling={"max_tokens": 8, "temperature": 0.0})
    assert run(cfg) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b", "too-long", "bad", "line-4"]
    assert recs[0]["error"] is None and "Paris" in recs[0]["text"]
    assert recs[1]["error"] is None and len(recs[1]["output_token_ids"]) <= 5
    assert "context limit" in recs[2]["error"] and "top_p" in recs[3]["error"]
    assert "malformed JSON" in recs[4]["error"]
    assert recs[0]["usage"]["completion_tokens"] == len(recs[0]["output_token_ids"])

    # a rerun keeps finished lines as they are (marked here) and redoes only failed ones
    recs[0]["text"] = "MARK"
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert run(cfg) == 0
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again[0]["text"] == "MARK" and len(again) == 5


@pytest.mark.parametrize("override, message", [
    ("model.model=no-such-model", "unknown model"),
    ("model.dtype=float64", "dtype"),
    ("engine.max_num_seqs=0", "max_num_seqs"),
])
def test_bad_config_exits_nonzero_before_work(override, message):
    proc = subprocess.run([sys.executable, str(ROOT / "jobs/generate.py"), override], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout


def test_job_with_expert_parallel_topology_equals_colocated(tmp_path, ray_cluster):
    """parallel.ep=2 (2 EP ranks, redundant experts) answers like one colocated replica."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "moe")
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                           for i, p in enumerate(["Hello there", "One two three four", "x"])))

    def job(out, parallel):
        c = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(str(tmp_path / "moe"), dtype="float32"),
                           engine=EngineConfig(device="cpu", num_kv_blocks=64), parallel=parallel,
                           sampling={"max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        assert run(c) == 0
        return [json.loads(x) for x in out.read_text().splitlines()]

    ref = job(tmp_path / "ref.jsonl", ParallelConfig(dp=1, num_cpus_per_replica=1))
    ep = job(tmp_path / "ep.jsonl", ParallelConfig(
        ep=2, eplb=EPLBSection(num_redundant_experts=2, interval=2, window=4)))
    assert [r["output_token_ids"] for r in ep] == [r["output_token_ids"] for r in ref]
    assert all(r["error"] is None and len(r["output_token_ids"]) == 6 for r in ep)


def _fake_output(path: Path, jobs, texts) -> list[dict]:
    """Write the output file an earlier run would have written, each job answered with its text."""
    from rayinfer.engine.types import Completion

    recs = []
    for job, text in zip(jobs, texts):
        c = Completion(job.id, job.prompt_token_ids, output_token_ids=[1, 2], text=text, finish_reason="length")
        recs.append(output_record(job, c))
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_resume_reuses_a_result_only_for_the_same_prompt_and_params(tokenizer):
    lines = [json.dumps({"prompt": f"prompt number {i}", "max_tokens": 4}) for i in range(4)]
    old = parse_lines(lines, tokenizer, {}, "m")
    # line 1 removed, line 3 changed (another max_tokens), a new line appended; no ids anywhere
    new_lines = [lines[0], lines[2], json.dumps({"prompt": "prompt number 3", "max_tokens": 5}),
                 json.dumps({"prompt": "prompt number 1", "max_tokens": 4})]
    new = parse_lines(new_lines, tokenizer, {}, "m")
    stored = {r["key"]: [r] for r in (output_record(j) | {"text": f"answer {i}"} for i, j in enumerate(old))}
    done = match_done(new, stored)
    assert {k: v["text"] for k, v in done.items()} == {"line-0": "answer 0", "line-1": "answer 2",
                                                       "line-3": "answer 1"}
    assert all(done[j.id]["id"] == j.id and done[j.id]["prompt_token_ids"] == j.prompt_token_ids
               for j in new if j.id in done)
    # the same prompt under another model is another request
    assert parse_lines(lines[:1], tokenizer, {}, "other")[0].key != old[0].key


def test_rerun_after_a_line_is_removed_keeps_each_answer_with_its_prompt(tmp_path, tokenizer):
    lines = [json.dumps({"prompt": f"Tell me about topic {i}"}) for i in range(4)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    cfg = GenerateConfig(input=str(inp), output=str(out), sampling={"max_tokens": 4, "temperature": 0.0})
    _fake_output(out, parse_lines(lines, tokenizer, {"max_tokens": 4, "temperature": 0.0}, cfg.model.model),
                 [f"about topic {i}" for i in range(4)])
    del lines[1]
    inp.write_text("\n".join(lines) + "\n")
    assert run(cfg) == 0  # every line is reused: no fleet starts
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["line-0", "line-1", "line-2"]
    assert [r["text"] for r in recs] == ["about topic 0", "about topic 2", "about topic 3"]
    assert [tokenizer.decode(r["prompt_token_ids"]) for r in recs] == [
        f"Tell me about topic {i}" for i in (0, 2, 3)]


def test_cut_last_line_is_dropped_and_records_are_whole(tmp_path):
    p = tmp_path / "x.partial"
    assert drop_cut_line(p) == 0
    with p.open("ab", buffering=0) as f:
        append_record(f, {"id": "a", "n": 1})
        append_record(f, {"id": "b", "text": "x" * 100_000})
    whole = p.read_bytes()
    p.write_bytes(whole + b'{"id": "c", "te')  # the job died while writing c
    assert drop_cut_line(p) == len(b'{"id": "c", "te')
    assert p.read_bytes() == whole
    with p.open("ab", buffering=0) as f:
        append_record(f, {"id": "d"})
    assert [json.loads(x)["id"] for x in p.read_text().splitlines()] == ["a", "b", "d"]


def test_rerun_after_a_crash_mid_write_recomputes_the_cut_line(tmp_path, tokenizer, ray_cluster):
    lines = [json.dumps({"id": i, "prompt": p}) for i, p in (("a", "The sky is"), ("b", "Water is"))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    cfg = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"),
                         engine=EngineConfig(device="cpu", num_kv_blocks=64), parallel=ParallelConfig(dp=1),
                         sampling={"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    partial = tmp_path / "out.jsonl.partial"
    jobs = parse_lines(lines, tokenizer, dict(cfg.sampling), cfg.model.model)
    rec_a, rec_b = _fake_output(partial, jobs, ["MARK-a", "MARK-b"])
    partial.write_text(json.dumps(rec_a) + "\n" + json.dumps(rec_b)[:40])  # died while writing b
    assert run(cfg) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b"]
    assert recs[0]["text"] == "MARK-a"  # kept
    assert recs[1]["text"] != "MARK-b" and recs[1]["error"] is None and len(recs[1]["output_token_ids"]) == 3
    assert not partial.exists()


def test_sigint_stops_the_job_and_keeps_finished_lines(tmp_path):
    import os
    import signal
    import time

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Count from {i} to {i + 500}:",
                                       "max_tokens": 8 + 40 * (i % 2), "ignore_eos": True}) + "\n"
                           for i in range(40)))
    partial = tmp_path / "out.jsonl.partial"
    proc = subprocess.Popen([sys.executable, str(ROOT / "jobs/generate.py"), f"input={inp}", f"output={out}",
                             "ray.address=local", "engine.device=cpu", "engine.num_kv_blocks=512",
                             "engine.max_num_seqs=4"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        while not (partial.exists() and partial.read_text().count("\n") >= 2):  # some lines finished
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            subprocess.run(["sleep", "0.5"])
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        log, _ = proc.communicate(timeout=120)  # a hang guard, not a measurement
        print(f"stopped {time.monotonic() - sent:.1f} s after SIGINT")
    finally:
        proc.kill()
    assert proc.returncode == 130, log[-3000:]
    assert "interrupted:" in log and "started an embedded Ray cluster at 127.0.0.1" in log
    assert not out.exists()
    kept = [json.loads(x) for x in partial.read_text().splitlines()]
    assert 2 <= len(kept) < 40
    assert all(r["error"] is None and r["key"] and r["finish_reason"] == "length" for r in kept)


def test_lines_take_the_services_sampling_names(tokenizer):
    lines = [
        '{"id": "mct", "prompt": "x", "max_completion_tokens": 5}',
        '{"id": "chat-lp", "prompt": "x", "logprobs": true, "top_logprobs": 3}',
        '{"id": "no-lp", "prompt": "x", "logprobs": false}',
        '{"id": "choice", "prompt": "x", "guided_choice": ["yes", "no"]}',
        '{"id": "text", "prompt": "x", "response_format": {"type": "text"}}',
        '{"id": "n", "prompt": "x", "n": 3, "seed": 5}',
        '{"id": "bad-regex", "prompt": "x", "guided_regex": "(unclosed"}',
        '{"id": "two", "prompt": "x", "guided_regex": "a", "response_format": {"type": "json_object"}}',
        '{"id": "both-max", "prompt": "x", "max_tokens": 4, "max_completion_tokens": 5}',
        '{"id": "big-n", "prompt": "x", "n": 129}',
        '{"id": "top-alone", "prompt": "x", "top_logprobs": 2}',
    ]
    jobs = {j.id: j for j in parse_lines(lines, tokenizer, {"max_tokens": 8})}
    assert jobs["mct"].params.max_tokens == 5
    assert jobs["chat-lp"].params.logprobs == 3 and jobs["no-lp"].params.logprobs is None
    assert jobs["choice"].params.response_format == {"type": "regex", "regex": "(yes|no)"}
    assert jobs["text"].error is None and jobs["text"].params.response_format is None
    assert [(p.n, p.seed) for p in choice_params(jobs["n"].params)] == [(1, 5), (1, 6), (1, 7)]
    assert "regex" in (jobs["bad-regex"].error or "")
    assert "at most one" in (jobs["two"].error or "")
    assert "max_completion_tokens" in (jobs["both-max"].error or "")
    assert "n must be between 1 and 128" in (jobs["big-n"].error or "")
    assert "top_logprobs" in (jobs["top-alone"].error or "")


def test_logprobs_n_and_guided_choice_take_effect_in_the_job(tmp_path, ray_cluster):
    lines = [
        {"id": "lp", "prompt": "The sky is", "max_tokens": 4, "logprobs": 2},
        {"id": "n", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.9, "seed": 11, "n": 2},
        {"id": "seed12", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.9, "seed": 12},
        {"id": "yn", "messages": [{"role": "user", "content": "Is water wet?"}], "guided_choice": ["yes", "no"]},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"),
                         engine=EngineConfig(device="cpu", num_kv_blocks=128), parallel=ParallelConfig(dp=1),
                         sampling={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    assert run(cfg) == 0
    recs = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert all(r["error"] is None for r in recs.values()), recs
    lp = recs["lp"]
    assert len(lp["logprobs"]) == len(lp["output_token_ids"]) == 4
    for token, entry in zip(lp["output_token_ids"], lp["logprobs"]):
        assert entry["token_id"] == token and entry["logprob"] <= 0.0
        assert len(entry["top_logprobs"]) == 2 and str(token) in entry["top_logprobs"]  # greedy: the top one
    n = recs["n"]
    assert [c["index"] for c in n["choices"]] == [0, 1]
    assert n["output_token_ids"] == n["choices"][0]["output_token_ids"]
    assert n["choices"][1]["output_token_ids"] == recs["seed12"]["output_token_ids"]  # choice i: seed + i
    assert n["usage"]["completion_tokens"] == sum(len(c["output_token_ids"]) for c in n["choices"])
    assert recs["yn"]["text"] in ("yes", "no")
