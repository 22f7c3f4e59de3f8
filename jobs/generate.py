"""Batch generation job: prompts from JSONL in, one output line per prompt, on Ray.

    python jobs/generate.py                                  # built-in prompts, printed
    python jobs/generate.py input=prompts.jsonl output=out.jsonl model.dtype=float32
    python jobs/generate.py parallel=1p1d                    # prefill/decode disaggregation (conf/parallel/)
    ray job submit --working-dir . -- python jobs/generate.py input=prompts.jsonl
    python jobs/generate.py ray.address=local                # an embedded Ray even if one runs here

The first line printed names the Ray cluster: ``$RAY_ADDRESS``, else one ``ray start`` left on this
machine (joined), else an embedded one listening on 127.0.0.1 (``rayinfer.actors.cluster``).

Input lines: ``{"id"?, "messages": [...]}`` (chat, rendered with the model's chat template) or
``{"id"?, "prompt": "..."}`` (raw text), each optionally with the sampling fields the service takes
(max_tokens or max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop, stop_token_ids, n,
logprobs (+ top_logprobs), penalties, response_format or guided_*, ...; see :func:`api_fields`). Output
lines, in input order: id, prompt_token_ids, output_token_ids, text, finish_reason, usage, error, key, and
logprobs / choices when asked for (``n`` > 1). ``key`` is a hash of the line's prompt tokens,
sampling parameters and model: a rerun onto the same output reuses a finished line only when its key
matches (and recomputes every other line), whatever the ids or the order of the lines. Ctrl-C (SIGINT)
or SIGTERM stops the job at once, keeping the finished lines for the rerun.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import hydra
from omegaconf import DictConfig, OmegaConf

from rayinfer.actors.cluster import RayConfig
from rayinfer.data.config import PoolConfig
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import ParallelConfig

logger = logging.getLogger("rayinfer.generate")

BUILTIN_PROMPTS = [
    {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"id": "haiku", "messages": [{"role": "user", "content": "Write a haiku about the ocean."}]},
    {"id": "kv-cache", "messages": [{"role": "user", "content": "In one sentence, what is a cache in computing?"}]},
    {"id": "tips", "messages": [{"role": "user", "content": "Give me three tips for staying focused."}]},
    {"id": "raw", "prompt": "The three primary colors are"},
]


@dataclass
class GenerateConfig:
    """Schema of ``conf/generate.yaml``."""

    input: str | None = None
    output: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sampling: dict[str, Any] = field(default_factory=dict)  # defaults for every line
    print_outputs: bool | None = None  # None: print when there is no input file
    ray: RayConfig = field(default_factory=RayConfig)  # which cluster (ray.address=local: an embedded one)
    # "client": one driver drives one fleet; "ray_data": a Ray Data pipeline over data.concurrency engine
    # actors, streamed, output part files in a directory (rayinfer.data.job)
    engine_mode: str = "client"
    data: PoolConfig = field(default_factory=PoolConfig)


@dataclass
class LineJob:
    """One input line, parsed."""

    index: int
    id: str
    prompt_token_ids: list[int] | None = None
    params: Any = None
    error: str | None = None
    key: str | None = None  # line_key of a parsed line


def line_key(model: str, prompt_token_ids: list[int], params) -> str:
    """The resume key of a line: a SHA-256 (hex) of the model name, the prompt's token ids and every
    sampling parameter, so a stored result is reused only for the same request."""
    payload = json.dumps({"model": model, "prompt_token_ids": list(prompt_token_ids),
                          "params": dataclasses.asdict(params)}, sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()


MAX_N = 128  # choices per line, as the service allows


def api_fields(rec: dict[str, Any]) -> dict[str, Any]:
    """A line's sampling fields in ``SamplingParams``' names, taking the OpenAI API's names as the service
    does: ``max_completion_tokens`` for ``max_tokens``; ``logprobs`` as an integer (completions) or
    ``true``/``false`` with ``top_logprobs`` (chat); ``response_format`` (``{"type": "text"}``: none) or
    vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar`` / ``guided_choice``, checked here.

    Raises:
        ValueError: naming the field, for conflicting or malformed fields (an invalid schema, regex or
            grammar included).
    """
    from types import SimpleNamespace

    from rayinfer.engine.structured_output import check_response_format
    from rayinfer.serve.protocol import APIError, response_format_of

    rec = dict(rec)
    if "max_completion_tokens" in rec:
        value = rec.pop("max_completion_tokens")
        if rec.get("max_tokens") is not None and value is not None and rec["max_tokens"] != value:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if value is not None:
            rec["max_tokens"] = value
    top = rec.pop("top_logprobs", None)
    if isinstance(rec.get("logprobs"), bool):
        rec["logprobs"] = (0 if top is None else top) if rec["logprobs"] else None
    elif top is not None:
        raise ValueError("top_logprobs needs logprobs: true")
    names = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
    given = {name: rec.pop(name, None) for name in names}
    if any(v is not None for v in given.values()):
        if given["response_format"] is not None and not isinstance(given["response_format"], dict):
            raise ValueError("response_format must be an object with a 'type' field")
        try:
            response_format = response_format_of(SimpleNamespace(**given))  # pyright: ignore[reportArgumentType]
        except APIError as e:
            raise ValueError(e.message) from None
        check_response_format(response_format)
        rec["response_format"] = response_format
    return rec


def choice_params(params) -> list:
    """One engine SamplingParams per choice of a line (``n = 1`` each; with a seed, choice i gets
    seed + i, as the service does)."""
    return [dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def parse_lines(lines: list[str], tokenizer, defaults: dict[str, Any], model: str = "") -> list[LineJob]:
    """Parse JSONL lines into jobs; a bad line gets ``error`` set and never raises.

    Args:
        lines: the input's non-empty lines.
        tokenizer: the model's tokenizer (chat template, plain encoding).
        defaults: sampling fields of every line (a line's own fields win).
        model: the model name that goes into each line's resume ``key``.
    """
    from rayinfer.engine.types import SamplingParams
    from rayinfer.serve.chat import encode_plain, render_messages

    jobs, seen = [], set()
    for i, line in enumerate(lines):
        job = LineJob(i, f"line-{i}")
        jobs.append(job)
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            job.error = f"malformed JSON on line {i + 1}: {e}"
            continue
        if not isinstance(rec, dict):
            job.error = f"line {i + 1} must be a JSON object"
            continue
        if rec.get("id") is not None:
            job.id = str(rec.pop("id"))
        rec.pop("id", None)
        if job.id in seen:
            job.error = f"duplicate id {job.id!r}"
            continue
        seen.add(job.id)
        try:
            messages, prompt = rec.pop("messages", None), rec.pop("prompt", None)
            if (messages is None) == (prompt is None):
                raise ValueError("each line needs exactly one of 'messages' or 'prompt'")
            if messages is not None:
                job.prompt_token_ids = render_messages(tokenizer, messages)
            elif not isinstance(prompt, str):
                raise ValueError("'prompt' must be a string")
            elif not prompt:
                raise ValueError("prompt is empty")
            else:
                bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) else []
                job.prompt_token_ids = bos + encode_plain(tokenizer, prompt)
            job.params = SamplingParams.from_dict({**defaults, **api_fields(rec)})
            if job.params.n > MAX_N:
                raise ValueError(f"n must be between 1 and {MAX_N}, got {job.params.n}")
            job.key = line_key(model, job.prompt_token_ids, job.params)
        except (ValueError, TypeError) as e:
            job.error = str(e)
    return jobs


def output_record(job: LineJob, completion=None) -> dict[str, Any]:
    """The output line of one job: its completion (a ``Completion``, or a list of one per choice when
    ``n`` > 1), or the job's own error.

    The top-level fields are the first choice's; ``logprobs`` is there when the line asked for them, and
    ``choices`` (index, text, output_token_ids, finish_reason, error, logprobs) when ``n`` > 1. A line
    fails (``error`` set) when any of its choices failed.
    """
    completions = completion if isinstance(completion, list) else [] if completion is None else [completion]
    first = completions[0] if completions else None
    prompt = job.prompt_token_ids or []
    out_ids = first.output_token_ids if first else []
    error = job.error or next((c.error for c in completions if c.error), None)
    num_out = sum(len(c.output_token_ids) for c in completions)
    rec = {
        "id": job.id,
        "prompt_token_ids": prompt,
        "output_token_ids": out_ids,
        "text": first.text if first else "",
        "finish_reason": "error" if error else first.finish_reason if first else None,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": num_out, "total_tokens": len(prompt) + num_out,
                  "cached_tokens": first.num_cached_tokens if first else 0},
        "error": error,
        "key": job.key,
    }
    wants_logprobs = job.params is not None and job.params.logprobs is not None
    if wants_logprobs:
        rec["logprobs"] = _logprobs(first)
    if len(completions) > 1:
        rec["choices"] = [{"index": i, "text": c.text, "output_token_ids": c.output_token_ids,
                           "finish_reason": "error" if c.error else c.finish_reason, "error": c.error,
                           **({"logprobs": _logprobs(c)} if wants_logprobs else {})}
                          for i, c in enumerate(completions)]
    return rec


def _logprobs(completion) -> list[dict[str, Any]]:
    """Per output token: its id, logprob and the top-k ``{token id: logprob}`` (k = the line's logprobs)."""
    return [{"token_id": t, "logprob": s.logprob, "top_logprobs": s.top_logprobs or {}}
            for t, s in zip(completion.output_token_ids, completion.logprobs or [])] if completion else []


def drop_cut_line(path: Path) -> int:
    """Truncate a JSONL file after its last newline: a last line without one was cut by a crash while
    it was written, and the next record must not be appended to its fragment. Returns the bytes dropped."""
    if not path.exists():
        return 0
    with path.open("rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
        return len(data) - keep


def append_record(f, rec: dict) -> None:
    """Append one record as one line with a single write to an unbuffered binary file (``open(path,
    "ab", buffering=0)``): a crash leaves at most that line cut, never a line and a half."""
    data = (json.dumps(rec) + "\n").encode()
    view = memoryview(data)
    while view:  # a regular file takes it in one write; loop in case the OS returns a short count
        view = view[f.write(view):]


def read_done(*paths: Path) -> dict[str, list[dict]]:
    """Finished records (no error, with a key) of earlier runs, by key; a later file's record of the
    same id and key replaces an earlier one. Cut or malformed lines are skipped."""
    by_id_key: dict[tuple[str, str], dict] = {}
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                if isinstance(rec, dict) and rec.get("error") is None and rec.get("key") and "id" in rec:
                    by_id_key[(str(rec["id"]), rec["key"])] = rec
    done: dict[str, list[dict]] = {}
    for (_, key), rec in by_id_key.items():
        done.setdefault(key, []).append(rec)
    return done


def match_done(jobs: list[LineJob], stored: dict[str, list[dict]]) -> dict[str, dict]:
    """The jobs that an earlier run already answered: each stored record is used once, for a job of
    the same key (one of the same id first); it takes the job's id. Returns job id -> record."""
    done = {}
    for job in jobs:
        recs = stored.get(job.key or "")
        if job.error is None and recs:
            rec = next((r for r in recs if r["id"] == job.id), recs[0])
            recs.remove(rec)
            done[job.id] = {**rec, "id": job.id}
    return done


def run(cfg: GenerateConfig) -> int:
    """Run the job; returns the process exit code (0 even when some lines failed)."""
    if cfg.engine_mode != "client":  # the Ray Data mode lives in rayinfer.data.job
        from rayinfer.data.job import ENGINE_MODES, run_data_job

        if cfg.engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {', '.join(ENGINE_MODES)}, got {cfg.engine_mode!r}")
        return run_data_job(cfg)
    import asyncio

    import ray
    from tqdm import tqdm

    from rayinfer.actors.cluster import init_ray
    from rayinfer.model.loader import load_tokenizer, resolve_model

    resolve_model(cfg.model.model)  # unknown model: ValueError before any work; converts once
    tokenizer = load_tokenizer(cfg.model.model)
    if cfg.input:
        lines = [ln for ln in Path(cfg.input).read_text().splitlines() if ln.strip()]
    else:
        lines = [json.dumps(p) for p in BUILTIN_PROMPTS]
    defaults = {"max_tokens": 256, "temperature": 0.0, **cfg.sampling}
    jobs = parse_lines(lines, tokenizer, defaults, cfg.model.model)
    out_path = Path(cfg.output) if cfg.output else (
        Path(cfg.input).with_suffix(".out.jsonl") if cfg.input else Path("outputs/generate.out.jsonl"))
    partial = out_path.with_name(out_path.name + ".partial")
    if drop_cut_line(partial):
        print(f"dropped a cut last line of {partial}")
    done = match_done(jobs, read_done(out_path, partial))
    todo = [j for j in jobs if j.error is None and j.id not in done]
    if done:
        print(f"skipping {len(done)} lines already done in {out_path} (same prompt and parameters)")
    results: dict[str, dict] = {j.id: output_record(j) for j in jobs if j.error is not None}
    interrupted = False

    if todo:
        print(init_ray(cfg.ray, logging_config=ray.LoggingConfig(encoding="TEXT", log_level="INFO"),
                       log_to_driver=True, logging_level=logging.WARNING), flush=True)
        from rayinfer.actors.client import make_client

        client = make_client(cfg.model, cfg.engine, cfg.parallel)  # a fleet by parallel.topology
        partial.parent.mkdir(parents=True, exist_ok=True)
        start, num_out = time.perf_counter(), 0

        async def one(job: LineJob):
            prompt, choices = job.prompt_token_ids or [], choice_params(job.params)
            if len(choices) == 1:
                return job, await client.complete(prompt, choices[0], request_id=job.id)
            return job, list(await asyncio.gather(*[client.complete(prompt, p, request_id=f"{job.id}#{i}")
                                                    for i, p in enumerate(choices)]))

        async def drive(sink, bar) -> tuple[int, bool]:
            """Run the lines, appending each finished one; SIGINT/SIGTERM stop it (returns interrupted)."""
            loop, stop = asyncio.get_running_loop(), asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)  # also when the shell started us with SIGINT ignored
            pending: set[asyncio.Future] = {asyncio.ensure_future(one(j)) for j in todo}
            stopped: asyncio.Future = asyncio.ensure_future(stop.wait())
            num_out = 0
            try:
                while pending and not stop.is_set():
                    finished, _ = await asyncio.wait(pending | {stopped}, return_when=asyncio.FIRST_COMPLETED)
                    for task in finished - {stopped}:
                        pending.discard(task)
                        job, completion = cast("tuple[LineJob, Any]", task.result())
                        rec = output_record(job, completion)
                        num_out += len(rec["output_token_ids"])
                        append_record(sink, rec)
                        done[job.id] = rec
                        bar.update(1)
            finally:
                for task in (*pending, stopped):
                    task.cancel()
                await asyncio.gather(*pending, stopped, return_exceptions=True)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            return num_out, stop.is_set()

        try:
            with partial.open("ab", buffering=0) as sink, tqdm(total=len(todo), desc="generate", unit="req") as bar:
                num_out, interrupted = asyncio.run(drive(sink, bar))
        finally:
            client.shutdown()
        elapsed = time.perf_counter() - start
        print(f"generated {num_out} tokens for {len(todo)} requests in {elapsed:.1f} s "
              f"({num_out / max(elapsed, 1e-9):.1f} output tokens/s)")
    if interrupted:
        print(f"\ninterrupted: {len(done)} of {len(jobs)} lines done, kept in {partial}; "
              f"rerun the same command to finish the rest", file=sys.stderr)
        return 130

    records = [results.get(j.id) or done.get(j.id) or output_record(j) for j in jobs]
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    tmp.replace(out_path)
    partial.unlink(missing_ok=True)

    failed = [rec for rec in records if rec["error"]]
    if cfg.print_outputs if cfg.print_outputs is not None else not cfg.input:
        for rec in records:
            print(f"\n[{rec['id']}] {rec['text'] if not rec['error'] else 'ERROR: ' + rec['error']}")
    print(f"\n{len(records) - len(failed)} ok, {len(failed)} failed; wrote {out_path}")
    for rec in failed:
        print(f"  {rec['id']}: {rec['error']}")
    return 0


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(dcfg: DictConfig) -> None:
    try:
        cfg = OmegaConf.to_object(dcfg)
        code = run(cfg)
    except (ValueError, FileNotFoundError, TimeoutError) as e:  # bad config, unknown model, unplaceable: clear message, non-zero exit, no work done
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # Ctrl-C before the lines started (loading, starting the fleet)
        print("interrupted before any line ran; nothing written", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    register_configs()
    main()
