"""The batch job: one ordered output line per input line, per-line errors, resume, clean exits, paths."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.jobs.batch_io import LineParser, append_record, drop_cut_line, match_done, output_record
from rayinfer.jobs.generate import GenerateConfig, run
from rayinfer.placement.parallel_config import EPLBSection, ParallelConfig

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"


def parse_lines(lines: list[str], tokenizer, defaults: dict, model: str = MODEL):
    """``rayinfer`` lines (numbered from 1) parsed as the job parses them."""
    return LineParser(tokenizer, MODEL, 8192, defaults, key_model=model).parse(
        [(i + 1, ln) for i, ln in enumerate(lines)], "rayinfer")


def params(job):
    """The SamplingParams of a parsed line's first choice."""
    return job.prepared.jobs[0][1]


def message(job) -> str | None:
    return job.error.message if job.error else None


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
    errors = {j.id: message(j) for j in jobs[:7]} | {"line-9": message(jobs[8])}
    assert errors["ok"] is None and errors["chat"] is None and errors["line-9"] is None
    assert jobs[2].id == "line-3" and "malformed JSON on line 3" in message(jobs[2])
    assert "empty" in errors["empty"]
    assert "temprature (did you mean temperature?)" in errors["unknown"]
    assert "temperature" in errors["neg"]
    assert "exactly one" in errors["both"]
    assert "duplicate" in message(jobs[7]) and jobs[0].error is None  # the first "ok" still runs
    assert params(jobs[0]).max_tokens == 3 and params(jobs[1]).max_tokens == 8


def test_line_numbers_are_the_files_and_agree_with_the_message(tmp_path, tokenizer):
    """Blank lines count: a malformed line's id and its message name the same 1-based line."""
    from rayinfer.jobs.batch_io import read_lines

    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{oops\n')
    jobs = LineParser(tokenizer, MODEL, 8192).parse(read_lines(path))
    assert [(j.line_no, j.id) for j in jobs] == [(1, "line-1"), (3, "line-3"), (4, "line-4")]
    # the file's line and the column within it, not json's "line 1 column 2"
    assert message(jobs[2]) == "malformed JSON on line 4, column 2: Expecting property name enclosed in double quotes"


def test_special_token_text_in_user_content_stays_plain(tokenizer):
    jobs = parse_lines(['{"messages": [{"role": "user", "content": "a <|im_start|> b"}]}'], tokenizer, {})
    assert jobs[0].error is None
    ids = jobs[0].prompt_token_ids
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    # the template's two turn headers (system default + user + assistant) use the control token;
    # the user's literal text must not add one more
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=True,
                                             add_generation_prompt=True)
    rendered = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert ids.count(im_start) == list(rendered).count(im_start)
    assert "<|im_start|>" in tokenizer.decode(ids)


def test_job_end_to_end_with_errors_and_resume(tmp_path, fleet, capsys):
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
                         sampling={"max_tokens": 8, "temperature": 0.0})
    assert run(cfg, client=fleet) == 0
    printed = capsys.readouterr().out
    assert f"2 ok, 3 failed; wrote {out} (the answers are there; print_outputs=true also prints them)" \
        in printed  # an input file: the answers are not printed
    assert "  line 4 (bad): " in printed and "  line 5: malformed JSON on line 5" in printed  # no "(line-5)"
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["a", "b", "too-long", "bad", "line-5"]
    assert recs[0]["error"] is None and "Paris" in recs[0]["text"]
    assert recs[1]["error"] is None and len(recs[1]["output_token_ids"]) <= 5
    assert "maximum context length" in recs[2]["error"] and "top_p" in recs[3]["error"]
    assert "malformed JSON on line 5" in recs[4]["error"]
    assert recs[0]["usage"]["completion_tokens"] == len(recs[0]["output_token_ids"])

    # a rerun keeps finished lines as they are (marked here) and redoes only failed ones
    recs[0]["text"] = "MARK"
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert run(cfg, client=fleet) == 0
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again[0]["text"] == "MARK" and len(again) == 5


# overrides whose error the job's run raises, checked through `rayinfer generate` in this process; the
# others (and ray.address, which needs a process without Ray) through jobs/generate.py in a subprocess
IN_PROCESS = {"model.model", "model", "input", "sampling.temperature", "parallel.ep", "engine.speculative.method"}


@pytest.mark.parametrize("override, message", [
    ("model.model=no-such-model", "unknown model 'no-such-model'"),
    ("model=no-such-model", "unknown model 'no-such-model'"),  # a config-group name Hydra does not know
    ("model=deepseek-v3-tny", "unknown model 'deepseek-v3-tny' (did you mean 'deepseek-v3-tiny'?)"),
    ("parallel.ep=2", "is not a MoE model: expert parallelism needs routed experts"),  # before Ray starts
    # drafters the job can refuse before Ray starts: MTP on a model without MTP modules, an unknown draft model
    ("engine.speculative.method=mtp", "speculative.method=mtp needs a model with multi-token-prediction modules"),
    ("engine.speculative.method=draft_model engine.speculative.draft_model=no-such-drafter",
     "engine.speculative.draft_model: unknown model 'no-such-drafter'"),
    ("model.dtype=float64", "dtype"),
    ("engine.max_num_seqs=0", "max_num_seqs"),
    ("input=/no/such/file.jsonl", "input file not found: /no/such/file.jsonl"),
    ("ray.address=127.0.0.1:1", "no Ray cluster answers at 127.0.0.1:1 (ray.address)"),
    # a misspelt key: refused by the schema, not Hydra's exit 1, with the declared key it is closest to
    ("engine.max_num_seq=4", "engine.max_num_seq': the config has no such key (did you mean engine.max_num_seqs?)"),
    # Hydra would add it, and nothing read it
    ("+engine.max_num_seq=4", "unknown key(s) engine.max_num_seq (did you mean engine.max_num_seqs?)"),
    ("parallel=3p1d", "Available options in 'parallel': 1p1d"),  # an unknown preset: its group's options
    ("sampling.temperature=-1", "temperature must be >= 0.0"),  # a default every line would fail on
    # a sampling field the defaults leave out: how to add it
    ("sampling.top_p=0.9", "'sampling.top_p': the config has no such key (to add it, write +sampling.top_p=...)"),
])
def test_bad_config_exits_2_with_one_line_before_work(override, message, tmp_path, capsys):
    # an output of its own: a finished default output in the checkout would be resumed without Ray
    argv = [*override.split(" "), f"output={tmp_path / 'out.jsonl'}"]  # one override, or several
    if override.split("=")[0] in IN_PROCESS:
        # the error comes from the job's run, which `rayinfer generate` runs too: asked in this process (a
        # subprocess spends seconds importing torch and loading the tokenizer to reach it)
        from rayinfer.cli import main

        returncode = main(["generate", *argv])
        stdout, stderr = capsys.readouterr()
    else:  # refused before the run (the entry point's own checks), or Ray: this process has joined one already
        proc = subprocess.run([sys.executable, str(ROOT / "jobs/generate.py"), *argv], capture_output=True,
                              text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    assert returncode == 2, stderr[-2000:]
    assert message in stderr
    assert "Traceback" not in stderr + stdout
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, stderr
    assert "Config search path" not in stderr  # Hydra's own search path is noise to a user
    if override.startswith(("model=", "model.model=")):  # the known models are listed, tiny MoE shapes too
        assert "qwen3-moe-tiny" in errors[0] and "SmolLM2-135M-Instruct" in errors[0]


def test_bad_environment_variable_exits_2_with_one_line_before_work(tmp_path, monkeypatch, capsys):
    """An engine variable read only on CUDA or inside an actor (RAYINFER_DRAFT_CATCH_UP_LEN) is checked by the job
    itself, on any device, before any work."""
    from rayinfer.cli import main

    import rayinfer.model.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was resolved before the environment was checked")

    monkeypatch.setattr(loader, "resolve_model", no_load)
    for value in ("abc", "-3"):
        monkeypatch.setenv("RAYINFER_DRAFT_CATCH_UP_LEN", value)
        assert main(["generate", f"output={tmp_path / 'out.jsonl'}"]) == 2
        stderr = capsys.readouterr().err
        assert f"error: RAYINFER_DRAFT_CATCH_UP_LEN must be a non-negative integer, got '{value}'" in stderr
        assert "Traceback" not in stderr


def test_missing_input_is_reported_before_the_tokenizer_loads(tmp_path, monkeypatch):
    import rayinfer.model.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was resolved or the tokenizer loaded before the input was checked")

    monkeypatch.setattr(loader, "load_tokenizer", no_load)
    monkeypatch.setattr(loader, "resolve_model", no_load)
    with pytest.raises(FileNotFoundError, match=f"input file not found: {tmp_path / 'missing.jsonl'}"):
        run(GenerateConfig(input=str(tmp_path / "missing.jsonl")))


def test_job_with_expert_parallel_topology_equals_colocated(tmp_path, ray_cluster):
    """parallel.ep=2 (2 EP ranks, redundant experts, a saved checkpoint) answers like one engine."""
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

    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    out = tmp_path / "ep.jsonl"
    model = ModelConfig(str(tmp_path / "moe"), dtype="float32")
    c = GenerateConfig(input=str(inp), output=str(out), model=model, engine=EngineConfig(device="cpu", num_kv_blocks=64),
                       parallel=ParallelConfig(ep=2, eplb=EPLBSection(num_redundant_experts=2, interval=2, window=4)),
                       sampling={"max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
    assert run(c) == 0
    ep = [json.loads(x) for x in out.read_text().splitlines()]
    # the reference: the engine a colocated replica runs, in this process (no second fleet to start)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = LLMEngine(model, EngineConfig(device="cpu", num_kv_blocks=64)).generate(
        [r["prompt_token_ids"] for r in ep], [greedy] * len(ep), [r["id"] for r in ep])
    assert [r["output_token_ids"] for r in ep] == [c.output_token_ids for c in ref]
    assert all(r["error"] is None and len(r["output_token_ids"]) == 6 for r in ep)


def _fake_output(path: Path, jobs, texts) -> list[dict]:
    """Write the output file an earlier run would have written, each job answered with its text."""
    from rayinfer.serve.serving import ChoiceState

    recs = [output_record(job, [ChoiceState(0, len(job.prompt_token_ids), text, [1, 2], finish_reason="length")])
            for job, text in zip(jobs, texts)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def test_resume_reuses_a_result_only_for_the_same_prompt_and_params(tokenizer):
    lines = [json.dumps({"prompt": f"prompt number {i}", "max_tokens": 4}) for i in range(4)]
    old = parse_lines(lines, tokenizer, {}, "m")
    # line 2 removed, line 4 changed (another max_tokens), a new line appended; no ids anywhere
    new_lines = [lines[0], lines[2], json.dumps({"prompt": "prompt number 3", "max_tokens": 5}),
                 json.dumps({"prompt": "prompt number 1", "max_tokens": 4})]
    new = parse_lines(new_lines, tokenizer, {}, "m")
    stored = {r["key"]: [r] for r in (output_record(j) | {"error": None, "text": f"answer {i}"}
                                      for i, j in enumerate(old))}
    done = match_done(new, stored)
    assert {k: v["text"] for k, v in done.items()} == {"line-1": "answer 0", "line-2": "answer 2",
                                                       "line-4": "answer 1"}
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
    assert [r["id"] for r in recs] == ["line-1", "line-2", "line-3"]
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


def test_rerun_after_a_crash_mid_write_recomputes_the_cut_line(tmp_path, tokenizer, fleet):
    lines = [json.dumps({"id": i, "prompt": p}) for i, p in (("a", "The sky is"), ("b", "Water is"))]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    cfg = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"),
                         sampling={"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
    partial = tmp_path / "out.jsonl.partial"
    jobs = parse_lines(lines, tokenizer, dict(cfg.sampling), cfg.model.model)
    rec_a, rec_b = _fake_output(partial, jobs, ["MARK-a", "MARK-b"])
    partial.write_text(json.dumps(rec_a) + "\n" + json.dumps(rec_b)[:40])  # died while writing b
    assert run(cfg, client=fleet) == 0
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
        '{"id": "chat-int-lp", "messages": [{"role": "user", "content": "x"}], "logprobs": 2}',
        '{"id": "chat-mct", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 6}',
    ]
    jobs = {j.id: j for j in parse_lines(lines, tokenizer, {"max_tokens": 8})}
    assert params(jobs["mct"]).max_tokens == 5 and params(jobs["chat-mct"]).max_tokens == 6
    assert params(jobs["chat-lp"]).logprobs == 3 and params(jobs["no-lp"]).logprobs is None
    assert params(jobs["chat-int-lp"]).logprobs == 2
    assert params(jobs["choice"]).response_format == {"type": "regex", "regex": "(yes|no)"}
    assert jobs["text"].error is None and params(jobs["text"]).response_format is None
    # n: one engine request per choice, choice i seeded seed + i (the service's own fan-out)
    assert [(p.n, p.seed) for _, p in jobs["n"].prepared.jobs] == [(1, 5), (1, 6), (1, 7)]
    assert "regex" in (message(jobs["bad-regex"]) or "")
    assert "at most one" in (message(jobs["two"]) or "")
    assert "max_completion_tokens" in (message(jobs["both-max"]) or "")
    assert "n must be between 1 and 128" in (message(jobs["big-n"]) or "")
    assert "top_logprobs" in (message(jobs["top-alone"]) or "")


def test_logprobs_n_and_guided_choice_take_effect_in_the_job(tmp_path, fleet):
    lines = [
        {"id": "lp", "prompt": "The sky is", "max_tokens": 4, "logprobs": 2},
        {"id": "n", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.9, "seed": 11, "n": 2},
        {"id": "seed12", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.9, "seed": 12},
        {"id": "yn", "messages": [{"role": "user", "content": "Is water wet?"}], "guided_choice": ["yes", "no"]},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"),
                         sampling={"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
    assert run(cfg, client=fleet) == 0
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


def test_relative_paths_resolve_against_base_dir_not_the_ray_copy(tmp_path, monkeypatch, capsys):
    """``ray job submit`` runs the job in Ray's copy of the working directory: with ``base_dir=$PWD`` (the
    README's command) relative paths are the submitting directory's; without, a warning says how to fix it."""
    user, copy = tmp_path / "user", tmp_path / "_ray_pkg_copy"
    for d in (user, copy):
        d.mkdir()
        (d / "p.jsonl").write_text('{"id": "x", "prompt": ""}\n')  # an error line: nothing runs, no fleet
    monkeypatch.chdir(copy)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}, "metadata": {}}))
    assert run(GenerateConfig(input="p.jsonl", output="out/res.jsonl", base_dir=str(user))) == 0
    assert (user / "out" / "res.jsonl").is_file() and not (copy / "out").exists()
    captured = capsys.readouterr()
    assert f"wrote {user / 'out' / 'res.jsonl'}" in captured.out and "warning" not in captured.err
    assert "print_outputs=true" not in captured.out  # every line failed: no answers to point to
    assert captured.out.startswith("read 1 line (rayinfer format)")

    assert run(GenerateConfig(input="p.jsonl")) == 0  # no base_dir: written inside the copy, with a warning
    captured = capsys.readouterr()
    assert (copy / "p.out.jsonl").is_file()
    assert f"warning: writing {copy / 'p.out.jsonl'}" in captured.err and "base_dir=$PWD" in captured.err


def test_resolve_path():
    from rayinfer.jobs.generate import resolve_path

    base = Path("/base")
    assert resolve_path("out.jsonl", base) == Path("/base/out.jsonl")
    assert resolve_path("/abs/out.jsonl", base) == Path("/abs/out.jsonl")
    assert resolve_path("file:///abs/out.jsonl", base) == Path("/abs/out.jsonl")
    assert resolve_path("~/o.jsonl", base) == Path.home() / "o.jsonl"
    with pytest.raises(ValueError, match="s3://"):
        resolve_path("s3://bucket/o.jsonl", base)


def test_cp_summary_line():
    """The batch job's closing line for parallel.cp > 1: what the rank 0s prefilled with their peers."""
    from rayinfer.engine.protocol import FleetStats, ReplicaStats
    from rayinfer.jobs.generate import cp_summary

    rank0 = ReplicaStats.from_dict({"cp": 2, "cp_active": True, "num_cp_prefills": 3, "num_cp_prefill_tokens": 900,
                                    "num_cp_solo_prefills": 0}, replica_id=0)
    peer = ReplicaStats.from_dict({"cp_rank": 1, "num_cp_peer_prefills": 3}, replica_id=1)
    line = cp_summary(FleetStats("colocated", [rank0, peer]))
    assert line.startswith("context parallelism: 3 prompts (900 tokens) prefilled over cp=2 ranks") and "alone" not in line
    lost = ReplicaStats.from_dict({"cp": 2, "cp_active": False, "num_cp_prefills": 1, "num_cp_prefill_tokens": 100,
                                   "num_cp_solo_prefills": 2}, replica_id=0)
    assert cp_summary(FleetStats("colocated", [lost, peer])).endswith("2 prefilled alone after 1 replica(s) lost a CP peer")


def test_fault_summary_line():
    from rayinfer.engine.protocol import FleetStats
    from rayinfer.jobs.generate import fault_summary

    assert fault_summary(FleetStats("pd", num_retries=7, num_replacements=1)) == (
        "failures ridden out: 7 PD leg(s) re-run after a replica failed; 1 dead replica(s) replaced by new actors "
        "(parallel.max_replacements)")
    assert fault_summary(FleetStats("colocated", num_replacements=2)).startswith("failures ridden out: 2 dead")
    assert fault_summary(FleetStats("colocated", num_replacements=1, num_resent=33)) == (
        "failures ridden out: 33 request(s) sent again after their replica died; 1 dead replica(s) replaced by new "
        "actors (parallel.max_replacements)")
    assert fault_summary(FleetStats("pd", num_retries=2, kv_device_transfers=True, num_kv_device_failures=1)) == (
        "failures ridden out: 2 PD leg(s) re-run after a replica failed; 1 KV transfer(s) failed on the device "
        "(back on the device now)")


def test_spec_summary_line():
    """The batch job's closing line with speculative decoding on: drafts over all replicas and the tokens a
    verification step emitted on average (accepted drafts plus the target's own token)."""
    from rayinfer.engine.protocol import FleetStats, ReplicaStats
    from rayinfer.jobs.generate import spec_summary

    a = ReplicaStats.from_dict({"spec_num_drafts_proposed": 40, "spec_num_drafts_verified": 36,
                                "spec_num_drafts_accepted": 18, "spec_num_verify_steps": 10,
                                "spec_chained_steps": 7}, replica_id=0)
    b = ReplicaStats.from_dict({"spec_num_drafts_proposed": 8, "spec_num_drafts_verified": 4,
                                "spec_num_drafts_accepted": 2, "spec_num_verify_steps": 2}, replica_id=1)
    line = spec_summary(FleetStats("colocated", [a, b, ReplicaStats(replica_id=2)]))
    assert line == ("speculative decoding: 48 drafts proposed, 40 verified, 20 accepted (50% of those verified); "
                    "2.67 tokens per verification step; 7 verification steps chained behind the one in flight")
    b = ReplicaStats.from_dict({"spec_num_drafts_proposed": 8, "spec_gate_plain_steps": 5}, replica_id=1)
    line = spec_summary(FleetStats("colocated", [a, b]))  # the confidence schedule: the steps its gate kept plain
    assert line.endswith("7 verification steps chained behind the one in flight; 5 decode steps kept plain by the "
                         "confidence schedule's gate"), line
    b = ReplicaStats.from_dict({"spec_num_drafts_proposed": 8, "spec_gate_plain_steps": 5,
                                "spec_gate_draft_triggers": 2}, replica_id=1)
    line = spec_summary(FleetStats("colocated", [a, b]))  # n-gram drafts that turned up in plain steps
    assert line.endswith("5 decode steps kept plain by the confidence schedule's gate, which re-measured drafting "
                         "2 times when drafts turned up"), line
    b.spec_decode["spec_gate_draft_triggers"] = 1
    assert spec_summary(FleetStats("colocated", [a, b])).endswith("re-measured drafting once when drafts turned up")
