"""The Ray Data processor (rayinfer.data): rows of the batch job's format through prepare (CPU tasks),
a pool of engine actors and finish; the job's ``engine_mode=ray_data`` with resume by content hash."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rayinfer.data import PoolConfig, ProcessorConfig, build_processor, engine_actor_resources
from rayinfer.data.io import output_files
from rayinfer.data.stages import (
    OUTPUT_SCHEMA,
    RECORD_COLUMN,
    RESULT_COLUMN,
    RESUME_COLUMN,
    finish_batch,
    job_digest,
    prepare_batch,
    record_digest,
    records_batch,
    resume_digest,
    skip_done,
)
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.types import SampledToken
from rayinfer.jobs.batch_io import LineParser, output_record
from rayinfer.jobs.generate import GenerateConfig, run
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.serve.serving import ChoiceState

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 8192  # SmolLM2's max_position_embeddings: what prepare uses when model.max_model_len is unset

LINES = [
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 6},
    {"prompt": "The three primary colors are"},  # no id: "line-2", as the plain job numbers it
    {"id": "lp", "prompt": "The sky is", "max_tokens": 4, "logprobs": 2},
    {"id": "n2", "prompt": "Once upon a time", "n": 2, "max_tokens": 3},
    {"id": "bad", "prompt": "x", "top_p": 7},
]
RAW_LINES = [json.dumps(x) for x in LINES] + ["{not json"]


def _job_config(inp: Path, out: Path, **kw) -> GenerateConfig:
    return GenerateConfig(input=str(inp), output=str(out), model=ModelConfig(dtype="float32"),
                          engine=EngineConfig(device="cpu", num_kv_blocks=256),
                          parallel=ParallelConfig(dp=1, num_cpus_per_replica=1),
                          sampling={"max_tokens": 8, "temperature": 0.0}, **kw)


def _rounded(x):
    """Logprobs computed in differently shaped batches agree to float32 noise, not bit for bit."""
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _batch_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _records(paths) -> dict[str, dict]:
    recs = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines()]
    by_id = {r.get("custom_id") or r["id"]: r for r in recs}
    assert len(by_id) == len(recs), "one record per line"
    return by_id


@pytest.fixture(scope="module")
def plain(tmp_path_factory, fleet):
    """The plain job's answers to LINES (one fleet, one driver): (input path, records by id). The fleet is
    the session's (tests/conftest.py), of the replica config _job_config names."""
    root = tmp_path_factory.mktemp("plain")
    inp = root / "in.jsonl"
    inp.write_text("\n".join(RAW_LINES) + "\n\n")  # a blank line is not a line
    assert run(_job_config(inp, root / "out.jsonl"), client=fleet) == 0
    return inp, _records([root / "out.jsonl"])


# -- without Ray -----------------------------------------------------------------------------------
def test_prepare_reads_rows_as_the_job_parses_lines(tokenizer):
    rows = [{"id": "c", "messages": [{"role": "user", "content": "Hi", "name": None}], "topic": "greet",
             "sampling_params": {"max_tokens": 5, "temperature": None}, "prompt": None},
            {"prompt": "Hello", "topic": "t", "id": None, "messages": None, "sampling_params": None}]
    out = prepare_batch(pa.Table.from_pylist(rows), model=MODEL, defaults={"max_tokens": 8})
    ref = LineParser(tokenizer, MODEL, MAX_LEN, {"max_tokens": 8}).parse(
        [(1, json.dumps({"id": "c", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})),
         (2, json.dumps({"prompt": "Hello"}))], "rayinfer")
    assert out.column("id").to_pylist() == ["c", "line-2"]
    assert out.column("prompt_token_ids").to_pylist() == [j.prompt_token_ids for j in ref]
    assert out.column("key").to_pylist() == [j.key for j in ref]  # the job's resume keys
    assert out.column("topic").to_pylist() == ["greet", "t"]  # other columns pass through
    assert out.column("error").to_pylist() == [None, None]
    assert out.column(RESUME_COLUMN).to_pylist() == [job_digest(j) for j in ref]


def test_prepare_numbers_lines_by_line_no(tokenizer):
    batch = pa.table({"line": ['{"prompt": "a"}', "{oops", '{"prompt": "b", "top_p": 7}'], "line_no": [7, 9, 10]})
    out = prepare_batch(batch, model=MODEL, defaults={})
    assert "line" not in out.column_names and "line_no" not in out.column_names  # not carried on
    assert out.column("id").to_pylist() == ["line-7", "line-9", "line-10"]
    errors = out.column("error").to_pylist()
    assert errors[0] is None and "malformed JSON on line 9" in errors[1] and "top_p" in errors[2]
    assert out.column("key").to_pylist()[1:] == [None, None]


def test_openai_lines_prepare_and_get_the_jobs_records(tokenizer):
    """OpenAI Batch lines: prepared as the job parses them, their records built after the engine (states
    faked here) as the job builds them, the response prepared again in the records stage."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 4}
    lines = [_batch_line("a", "/v1/chat/completions", chat),
             _batch_line("b", "/v1/embeddings", {"model": MODEL, "input": "x"})]
    kw = {"model": MODEL, "defaults": {"max_tokens": 8}}
    out = prepare_batch(pa.table({"line": lines, "line_no": [1, 2]}), input_format="auto", **kw)
    ref = LineParser(tokenizer, MODEL, MAX_LEN, {"max_tokens": 8}).parse(list(enumerate(lines, 1)), "openai")
    assert out.column("id").to_pylist() == ["a", "b"] and out.column("key").to_pylist() == [ref[0].key, None]
    states = [ChoiceState(0, len(ref[0].prompt_token_ids), "Hello", [19556], [], "stop")]
    results = [pickle.dumps((states, None)), pickle.dumps((None, None))]
    done = records_batch(out.append_column(RESULT_COLUMN, pa.array(results, pa.binary())), **kw)
    assert done.column_names == ["id", "prompt_token_ids", "key", "error", RECORD_COLUMN]
    a, b = (json.loads(r) for r in done.column(RECORD_COLUMN).to_pylist())
    want = output_record(ref[0], states)
    assert a["id"] == want["id"] and a["custom_id"] == "a" and a["error"] is None
    body = a["response"]["body"]
    assert a["response"]["status_code"] == 200 and body["id"] == a["response"]["request_id"]
    assert body["choices"][0]["message"]["content"] == "Hello" and body["usage"]["completion_tokens"] == 1
    assert b == output_record(ref[1]) and b["error"]["code"] == "invalid_url"
    # resume: the digests prepare computed are those of the records written
    assert out.column(RESUME_COLUMN).to_pylist() == [record_digest(a), record_digest(b)]


def test_finish_gives_the_job_record_as_columns(tokenizer):
    job = LineParser(tokenizer, MODEL, MAX_LEN).parse([(1, '{"id": "x", "prompt": "Hi", "logprobs": 1}')])[0]
    state = ChoiceState(0, len(job.prompt_token_ids), "ab", [5, 6],
                        [SampledToken(5, -0.5, {5: -0.5}), SampledToken(6, -1.0, {6: -1.0})], "length")
    rec = output_record(job, [state])
    out = finish_batch(pa.table({RECORD_COLUMN: [json.dumps(rec)], "keep": [1]}))
    assert out.schema.names == ["keep", *OUTPUT_SCHEMA.names]
    row = out.to_pylist()[0]
    assert (row["id"], row["text"], row["output_token_ids"], row["finish_reason"]) == ("x", "ab", [5, 6], "length")
    assert (row["num_prompt_tokens"], row["num_output_tokens"]) == (len(job.prompt_token_ids), 2)
    assert json.loads(row["logprobs"]) == json.loads(json.dumps(rec["logprobs"])) and row["choices"] is None


def test_resume_digest_marks_answered_and_unparsable_rows_only():
    assert resume_digest("a", "k", None) == resume_digest("a", "k", None) != resume_digest("b", "k", None)
    assert resume_digest("a", None, "bad line") is not None  # fails the same way again: not rerun
    assert resume_digest("a", "k", "replica died") is None  # failed in the engine: rerun
    ok = {"id": "batch_req_0f", "custom_id": "a", "response": {"status_code": 200, "body": {}}, "error": None}
    assert record_digest(ok) is not None
    assert record_digest({**ok, "response": {"status_code": 500, "body": {}}}) is None  # rerun
    bad = {"id": "batch_req_line-3", "custom_id": None, "response": None, "error": {"code": "x", "message": "m"}}
    assert record_digest(bad) is not None  # fails the same way again


@pytest.mark.parametrize("parallel, pool, cpus, expect", [
    (ParallelConfig(), PoolConfig(concurrency=2), 8, (3.0, 0.0, 3.0)),  # (8 - 1 for tasks) / 2 actors
    (ParallelConfig(), PoolConfig(concurrency=2), 2, (0.5, 0.0, 0.5)),  # never all CPUs: tasks would starve
    (ParallelConfig(num_gpus_per_replica=1, num_cpus_per_replica=4), PoolConfig(concurrency=4), 64, (4.0, 1.0, 4.0)),
    (ParallelConfig(dp=2), PoolConfig(concurrency=3, min_concurrency=1), 13, (0.0, 0.0, 2.0)),  # fleets: 3 x 2 ranks
    (ParallelConfig(num_prefill=1, num_decode=1), PoolConfig(), None, (0.0, 0.0, 1.0)),
])
def test_engine_actor_resources(parallel, pool, cpus, expect):
    cfg = ProcessorConfig(parallel=parallel, **{k: getattr(pool, k) for k in ("concurrency", "min_concurrency")})
    num_cpus, num_gpus, deployed = engine_actor_resources(cfg, cpus)
    assert (num_cpus, num_gpus, deployed.num_cpus_per_replica) == expect


@pytest.mark.parametrize("kw", [{"concurrency": 0}, {"batch_size": 0}, {"concurrency": 2, "min_concurrency": 3},
                                {"max_concurrent_batches": 1.5}])
def test_pool_config_rejects_bad_sizes(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        PoolConfig(**kw)


def test_build_processor_wants_its_config():
    with pytest.raises(TypeError, match="ProcessorConfig"):
        build_processor({"concurrency": 2})  # type: ignore[arg-type]


# -- on the session's Ray cluster ------------------------------------------------------------------
def test_skip_done_drops_rows_whose_digest_is_stored(ray_cluster):
    done = np.unique(np.array([resume_digest("a", "k1", None), resume_digest("c", None, "bad")], dtype="S16"))
    mine = [resume_digest("a", "k1", None), resume_digest("b", "k2", None), resume_digest("c", None, "bad"),
            resume_digest("a", "k9", None), None]
    batch = pa.table({"id": ["a", "b", "c", "a", "d"], RESUME_COLUMN: pa.array(mine, pa.binary(16))})
    out = skip_done(batch, done=[ray_cluster.put(done)])
    assert out.column("id").to_pylist() == ["b", "a", "d"]


@pytest.mark.slow
def test_ray_data_job_equals_the_plain_job_and_resumes(plain, tmp_path, capsys):
    inp, ref = plain
    out = tmp_path / "out"
    cfg = _job_config(inp, out, engine_mode="ray_data", data=PoolConfig(concurrency=2, batch_size=2))
    assert run(cfg) == 0
    first = output_files(str(out))
    got = _records(first)
    assert set(got) == set(ref) == {"capital", "line-2", "lp", "n2", "bad", "line-6"}
    assert all(_rounded(got[k]) == _rounded(ref[k]) for k in ref), [(got[k], ref[k]) for k in ref if got[k] != ref[k]]
    assert "Paris" in got["capital"]["text"] and len(got["n2"]["choices"]) == 2
    assert "top_p" in got["bad"]["error"] and "malformed JSON on line 6" in got["line-6"]["error"]

    # a new line: the rerun answers it alone (the rest is found by content hash) and adds one part file;
    # this time the actor drives a fleet (1 prefill + 1 decode replica) through a client
    with inp.open("a") as f:
        f.write(json.dumps({"id": "new", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}) + "\n")
    capsys.readouterr()
    rerun = _job_config(inp, out, engine_mode="ray_data", data=PoolConfig(concurrency=1))
    rerun.parallel = ParallelConfig(num_prefill=1, num_decode=1, num_cpus_per_replica=1)
    assert run(rerun) == 0
    assert "6 lines already answered" in capsys.readouterr().out
    added = _records(sorted(set(output_files(str(out))) - set(first)))
    assert list(added) == ["new"] and added["new"]["error"] is None and len(added["new"]["output_token_ids"]) == 3


@pytest.mark.slow
def test_ray_data_job_takes_openai_batch_files(plain, tmp_path):
    """An OpenAI Batch file in engine_mode=ray_data: detected, answered with the service's response bodies
    (the same text as the plain job's answer to the same chat), per-line errors as the plain job has them."""
    _, ref = plain
    chat = {"model": MODEL, "messages": LINES[0]["messages"], "max_completion_tokens": 6, "temperature": 0}
    inp, out = tmp_path / "batch.jsonl", tmp_path / "results"
    inp.write_text("\n".join([_batch_line("capital", "/v1/chat/completions", chat),
                              _batch_line("other-model", "/v1/chat/completions", {**chat, "model": "gpt-4o"}),
                              _batch_line("embedding", "/v1/embeddings", {"model": MODEL, "input": "x"})]) + "\n")
    assert run(_job_config(inp, out, engine_mode="ray_data", data=PoolConfig(concurrency=1))) == 0
    got = _records(output_files(str(out)))
    assert set(got) == {"capital", "other-model", "embedding"}
    ok = got["capital"]["response"]
    assert got["capital"]["error"] is None and ok["status_code"] == 200 and ok["request_id"] == ok["body"]["id"]
    assert ok["body"]["choices"][0]["message"]["content"] == ref["capital"]["text"]
    assert got["other-model"]["response"]["status_code"] == 404
    assert got["embedding"]["response"] is None and got["embedding"]["error"]["code"] == "invalid_url"


@pytest.mark.slow
def test_processor_on_a_dataset_gives_the_plain_jobs_answers(plain, ray_cluster):
    import ray.data

    _, ref = plain
    rows = [{"topic": "geo", "messages": LINES[0]["messages"]}, {"topic": "art", "prompt": LINES[1]["prompt"]}]
    config = ProcessorConfig(model=ModelConfig(dtype="float32"), engine=EngineConfig(device="cpu", num_kv_blocks=128),
                             parallel=ParallelConfig(dp=1, num_cpus_per_replica=1), sampling={"max_tokens": 8},
                             batch_size=1)
    processor = build_processor(
        config,
        preprocess=lambda row: {**row, "sampling_params": {"max_tokens": 6} if row["topic"] == "geo" else {}},
        postprocess=lambda row: {"topic": row["topic"], "text": row["text"], "n": row["num_output_tokens"],
                                 "reason": row["finish_reason"], "error": row["error"]})
    got = sorted(processor(ray.data.from_items(rows)).take_all(), key=lambda r: r["topic"])
    want = [ref["line-2"], ref["capital"]]  # art, geo
    assert [r["text"] for r in got] == [w["text"] for w in want]
    assert [r["n"] for r in got] == [w["usage"]["completion_tokens"] for w in want]
    assert [r["reason"] for r in got] == [w["finish_reason"] for w in want] and not any(r["error"] for r in got)


def test_unknown_engine_mode_is_refused_before_work():
    with pytest.raises(ValueError, match="engine_mode must be one of client, ray_data"):
        run(GenerateConfig(engine_mode="ray-data"))
