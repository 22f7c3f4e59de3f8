"""bench_serve.py without a server: token lengths, ShareGPT sampling, goodput, the options."""

from __future__ import annotations

import json
import math

import pytest

from rayinfer.jobs.bench_serve import (
    LocalTokenizer,
    RequestResult,
    load_sharegpt,
    meets_slos,
    parse_args,
    parse_goodput,
    random_requests,
    spec_requests,
    summarize,
)


@pytest.fixture(scope="module")
def tok():
    return LocalTokenizer("SmolLM2-135M-Instruct")


def test_random_prompts_have_input_len_tokens(tok):
    reqs = random_requests(5, input_len=37, output_len=9, seed=3, tokenizer=tok)
    assert [len(tok.encode(r.prompt)) for r in reqs] == [r.prompt_len for r in reqs] == [37] * 5
    assert all(r.output_len == 9 for r in reqs)
    assert [r.prompt for r in random_requests(5, 37, 9, 3, tok)] == [r.prompt for r in reqs]  # seeded
    assert random_requests(1, 37, 9, 4, tok)[0].prompt != reqs[0].prompt


def test_spec_prompts_cycle_over_texts_to_repeat_or_continue(tok):
    """--dataset-name spec: the speculative bench's workload (texts x instructions), as chat messages."""
    from rayinfer.jobs.bench_spec import INSTRUCTIONS, TEXTS

    reqs = spec_requests(20, output_len=64, tokenizer=tok)
    n = len(TEXTS) * len(INSTRUCTIONS)
    assert len(reqs) == 20 and len({r.prompt for r in reqs}) == min(20, n)
    assert all(r.output_len == 64 and r.prompt_len == len(tok.encode(r.prompt)) > 30 for r in reqs)
    assert reqs[0].prompt.startswith("Repeat the following text") and TEXTS[0] in reqs[0].prompt
    assert TEXTS[1] in reqs[1].prompt and [r.prompt for r in spec_requests(20, 64, tok)] == [r.prompt for r in reqs]
    assert parse_args(["--dataset-name", "spec"]).dataset_name == "spec"


def _conv(*turns):
    return {"conversations": [{"from": who, "value": text} for who, text in zip(("human", "gpt") * 4, turns)]}


def test_sharegpt_sampling_follows_vllms_filters(tok, tmp_path):
    long_prompt = "word " * 1100  # over 1024 tokens
    data = [
        _conv("What is the capital of France? Tell me briefly.", "The capital of France is Paris, a large city."),
        _conv("only one turn here, no answer"),
        _conv("Name three primary colors for me please.", "Red."),  # answer under 4 tokens
        _conv(long_prompt, "A long prompt gets a long answer, of course."),
        _conv("Write a haiku about the sea and the sky.", "Waves fold into light, the horizon breathes slowly, salt "
              "wind carries gulls.", "Thanks!", "You're welcome."),
        {"id": "no conversations key"},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = load_sharegpt(str(path), 2, seed=0, tokenizer=tok)
    by_prompt = {r.prompt: r for r in reqs}
    assert set(by_prompt) == {data[0]["conversations"][0]["value"], data[4]["conversations"][0]["value"]}
    for conv in (data[0], data[4]):
        r = by_prompt[conv["conversations"][0]["value"]]
        assert r.prompt_len == len(tok.encode(r.prompt))
        assert r.output_len == len(tok.encode(conv["conversations"][1]["value"]))  # the answer's length
    assert {r.output_len for r in load_sharegpt(str(path), 2, 0, tok, output_len=7)} == {7}
    with pytest.raises(ValueError, match="only 2 usable conversations"):
        load_sharegpt(str(path), 3, 0, tok)
    path.write_text(json.dumps({"conversations": []}))
    with pytest.raises(ValueError, match="JSON list"):
        load_sharegpt(str(path), 1, 0, tok)


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1500.5"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1500.5}
    assert parse_goodput(None) == {}
    for bad, match in (["itl:5"], "KEY one of"), (["ttft=5"], "KEY one of"), (["ttft:-1"], "positive"), \
                      (["tpot:abc"], "positive"):
        with pytest.raises(ValueError, match=match):
            parse_goodput(bad)


def test_goodput_counts_requests_that_meet_every_slo():
    def req(ttft, latency, n):
        return RequestResult(True, ttft=ttft, latency=latency, num_prompt_tokens=4, num_output_tokens=n)

    results = [req(0.1, 0.5, 5),    # TTFT 100 ms, TPOT 100 ms: good
               req(0.3, 0.7, 5),    # TTFT 300 ms: misses ttft
               req(0.1, 1.3, 5),    # TPOT 300 ms: misses tpot
               req(0.15, 0.15, 1),  # one token: TPOT 0, good
               RequestResult(False, ttft=0.01, latency=0.02, error="boom")]  # failed: never good
    slos = {"ttft": 200.0, "tpot": 150.0}
    assert [meets_slos(r, slos) for r in results] == [True, False, False, True, False]
    s = summarize(results, duration=4.0, goodput_ms=slos)
    assert s["num_good"] == 2 and math.isclose(s["request_goodput"], 0.5) and s["goodput_slos_ms"] == slos
    assert "request_goodput" not in summarize(results, duration=4.0)
    assert math.isclose(s["tpot_ms"]["mean"], (100 + 100 + 300) / 3)  # one-token requests have no TPOT sample


@pytest.mark.parametrize("argv, message", [
    (["--dataset-name", "sharegpt"], "needs --dataset-path"),
    (["--goodput", "ttft:0"], "positive"),
    (["--goodput", "p99:5"], "KEY one of"),
    (["--input-len", "0"], "must be positive"),
    (["--metadata", "device"], "KEY=VALUE"),
])
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_vllm_option_names_are_accepted():
    args = parse_args(["--random-input-len", "12", "--random-output-len", "3", "--goodput", "ttft:100",
                       "--disable-tqdm"])
    assert (args.input_len, args.output_len, args.goodput_ms, args.disable_tqdm) == (12, 3, {"ttft": 100.0}, True)
