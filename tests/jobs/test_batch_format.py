"""OpenAI Batch files in the batch job: lines built as OpenAI's batch docs show them, output lines the
``openai`` package's types parse, the service's answer for the same body, n and logprobs, per-line errors,
and resume."""

import asyncio
import json
import time

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from rayinfer.jobs.batch_io import LineParser, detect_format, match_done, output_record, read_done
from rayinfer.jobs.generate import GenerateConfig, run
from rayinfer.engine.config import ModelConfig

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello world!"}]


def batch_line(custom_id: str, url: str, body: dict) -> str:
    """One input line as OpenAI's Batch API docs write it."""
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


class NoFleet:
    """A client that fails the test if any line runs."""

    max_model_len = 8192

    def generate(self, *args, **kwargs):
        raise AssertionError("a line ran although every line was already answered")


def test_batch_file_round_trip_with_n_logprobs_and_errors(tmp_path, tokenizer, fleet):
    from rayinfer.serve.serving import OpenAIServing
    from rayinfer.serve.serving_chat import ChatServing
    from rayinfer.serve.serving_completion import CompletionServing

    chat, comp = "/v1/chat/completions", "/v1/completions"
    greedy_chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
                   "max_completion_tokens": 8, "temperature": 0}
    completion = {"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "logprobs": 2}
    lines = [
        batch_line("chat-n", chat, {"model": MODEL, "messages": HELLO, "max_tokens": 6, "n": 2, "temperature": 0.8,
                                    "seed": 7, "logprobs": True, "top_logprobs": 2}),
        batch_line("seed-8", chat, {"model": MODEL, "messages": HELLO, "max_tokens": 6, "temperature": 0.8,
                                    "seed": 8}),
        batch_line("greedy-chat", chat, greedy_chat),
        batch_line("completion", comp, completion),
        batch_line("bad-temperature", chat, {"model": MODEL, "messages": HELLO, "temperature": -1}),
        batch_line("other-model", chat, {"model": "gpt-4o-mini", "messages": HELLO}),
        batch_line("embedding", "/v1/embeddings", {"model": MODEL, "input": "Hello"}),
        "{not json",
        batch_line("chat-n", chat, {"model": MODEL, "messages": HELLO}),
    ]
    inp, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    cfg = GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"))
    assert run(cfg, client=fleet) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in recs] == ["chat-n", "seed-8", "greedy-chat", "completion", "bad-temperature",
                                              "other-model", "embedding", None, "chat-n"]
    assert all(set(r) == {"id", "custom_id", "response", "error"} for r in recs)
    ok = recs[:4]
    for r in ok:
        assert r["error"] is None and r["response"]["status_code"] == 200 and r["id"].startswith("batch_req_")
        assert r["response"]["request_id"] == r["response"]["body"]["id"]

    # n = 2 with logprobs: two choices, each with its top-2 alternatives per token; choice 1 is seed + 1
    n = ChatCompletion.model_validate(ok[0]["response"]["body"])
    assert [c.index for c in n.choices] == [0, 1] and n.model == MODEL
    for c in n.choices:
        assert c.logprobs is not None and c.logprobs.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in c.logprobs.content)
    assert n.usage is not None
    assert n.usage.completion_tokens == sum(len(c.logprobs.content or []) for c in n.choices if c.logprobs)
    seed8 = ChatCompletion.model_validate(ok[1]["response"]["body"])
    assert n.choices[1].message.content == seed8.choices[0].message.content

    # the service's own path (same client) answers the same bodies with the same text and logprobs
    serving = OpenAIServing(fleet, tokenizer, MODEL, fleet.max_model_len)
    want_chat = asyncio.run(ChatServing(serving).create(dict(greedy_chat), time.perf_counter()))
    want_comp = asyncio.run(CompletionServing(serving).create(dict(completion), time.perf_counter()))
    got_chat = ChatCompletion.model_validate(ok[2]["response"]["body"])
    assert isinstance(want_chat, dict) and isinstance(want_comp, dict)
    assert got_chat.choices[0].message.content == want_chat["choices"][0]["message"]["content"]
    assert "Paris" in (got_chat.choices[0].message.content or "")
    got_comp = Completion.model_validate(ok[3]["response"]["body"])
    assert got_comp.choices[0].text == want_comp["choices"][0]["text"]
    assert got_comp.choices[0].logprobs is not None
    got_lp, want_lp = got_comp.choices[0].logprobs, want_comp["choices"][0]["logprobs"]
    assert got_lp.tokens == want_lp["tokens"] and got_lp.text_offset == want_lp["text_offset"]
    # the same tokens; their logprobs within float32 noise (batched with other lines, or alone)
    assert got_lp.token_logprobs == pytest.approx(want_lp["token_logprobs"], abs=1e-3)
    assert [sorted(t) for t in got_lp.top_logprobs or []] == [sorted(t) for t in want_lp["top_logprobs"]]
    assert got_comp.usage is not None and len(got_comp.choices[0].logprobs.tokens or []) == got_comp.usage.completion_tokens

    # a request the service refuses is answered as the service answers it; a line that is no request has
    # no response and an error
    bad = recs[4]["response"]
    assert bad["status_code"] == 400 and recs[4]["error"] is None
    assert ErrorObject.model_validate(bad["body"]["error"]).param == "temperature"
    assert recs[5]["response"]["status_code"] == 404
    assert recs[5]["response"]["body"]["error"]["code"] == "model_not_found"
    assert recs[6]["response"] is None and recs[6]["error"]["code"] == "invalid_url"
    assert "/v1/embeddings" in recs[6]["error"]["message"]
    assert recs[7]["id"] == "batch_req_line-8" and recs[7]["error"]["message"].startswith("malformed JSON on line 8")
    assert recs[8]["error"]["code"] == "duplicate_custom_id"

    # a rerun reuses every answered line (marked) and runs nothing
    recs[2]["response"]["body"]["choices"][0]["message"]["content"] = "MARK"
    out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert run(cfg, client=NoFleet()) == 0
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again[2]["response"]["body"]["choices"][0]["message"]["content"] == "MARK"
    assert again[:4] == recs[:4]


def test_detect_format_and_forced_format(tokenizer):
    batch = [(1, batch_line("a", "/v1/completions", {"prompt": "x"})), (2, '{"prompt": "y"}')]
    own = [(1, "{oops"), (2, '{"id": "a", "messages": []}')]
    assert detect_format(batch) == "openai" and detect_format(own) == "rayinfer" and detect_format([]) == "rayinfer"
    parser = LineParser(tokenizer, MODEL, 8192)
    jobs = parser.parse(batch)  # detected per file: the second line is no Batch line
    assert jobs[0].error is None and jobs[0].format == "openai"
    assert jobs[1].error is not None and jobs[1].error.code == "missing_custom_id"
    forced = parser.parse(batch, "rayinfer")  # forced: the Batch line is no rayinfer line
    assert forced[0].error is not None and "exactly one of 'messages' or 'prompt'" in forced[0].error.message
    assert forced[1].error is None


@pytest.mark.parametrize("line, code", [
    ('{"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}', "missing_custom_id"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}', "invalid_method"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/responses", "body": {"prompt": "x"}}', "invalid_url"),
    ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"}', "invalid_body"),
    ('["custom_id"]', "invalid_request"),
])
def test_a_line_that_is_no_request_gets_an_error_line(tokenizer, line, code):
    job = LineParser(tokenizer, MODEL, 8192).parse([(3, line)], "openai")[0]
    rec = output_record(job)
    assert rec["response"] is None and rec["error"]["code"] == code
    assert "line 3" in rec["error"]["message"] and rec["id"] == "batch_req_line-3"


def test_resume_matches_custom_id_and_request(tokenizer, tmp_path):
    from rayinfer.serve.serving import ChoiceState

    parser = LineParser(tokenizer, MODEL, 8192)
    body = {"prompt": "Hello", "max_tokens": 3}
    old = parser.parse([(1, batch_line("a", "/v1/completions", body))])
    stored = tmp_path / "out.jsonl"
    stored.write_text(json.dumps(output_record(old[0], [ChoiceState(0, 1, "hi", [5], finish_reason="length")])) + "\n")
    new = parser.parse([(1, batch_line("a", "/v1/completions", body)),
                        (2, batch_line("b", "/v1/completions", body)),  # same request, another custom_id
                        (3, batch_line("c", "/v1/completions", {**body, "max_tokens": 4}))])
    assert list(match_done(new, read_done(stored))) == ["a"]
    changed = parser.parse([(1, batch_line("a", "/v1/completions", {**body, "temperature": 0.5}))])
    assert match_done(changed, read_done(stored)) == {}
