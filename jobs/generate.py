"""Batch generation job: prompts from JSONL in, one output line per prompt, on Ray.

    python jobs/generate.py                                  # built-in prompts, printed
    python jobs/generate.py input=prompts.jsonl output=out.jsonl model.dtype=float32
    python jobs/generate.py parallel=1p1d                    # prefill/decode disaggregation (conf/parallel/)
    ray job submit --working-dir . -- python jobs/generate.py input=prompts.jsonl

Input lines: ``{"id"?, "messages": [...]}`` (chat, rendered with the model's chat template) or
``{"id"?, "prompt": "..."}`` (raw text), each optionally with sampling fields (max_tokens, temperature,
top_p, top_k, min_p, seed, stop, ...). Output lines, in input order: id, prompt_token_ids,
output_token_ids, text, finish_reason, usage, error. A rerun skips ids already done.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

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


@dataclass
class LineJob:
    """One input line, parsed."""

    index: int
    id: str
    prompt_token_ids: list[int] | None = None
    params: Any = None
    error: str | None = None


def parse_lines(lines: list[str], tokenizer, defaults: dict[str, Any]) -> list[LineJob]:
    """Parse JSONL lines into jobs; a bad line gets ``error`` set and never raises."""
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
            job.params = SamplingParams.from_dict({**defaults, **rec})
        except (ValueError, TypeError) as e:
            job.error = str(e)
    return jobs


def output_record(job: LineJob, completion=None) -> dict[str, Any]:
    """The output line of one job (a completion, or the job's own error)."""
    prompt = job.prompt_token_ids or []
    out_ids = completion.output_token_ids if completion else []
    error = job.error or (completion.error if completion else None)
    return {
        "id": job.id,
        "prompt_token_ids": prompt,
        "output_token_ids": out_ids,
        "text": completion.text if completion else "",
        "finish_reason": "error" if error else completion.finish_reason,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out_ids),
                  "total_tokens": len(prompt) + len(out_ids),
                  "cached_tokens": completion.num_cached_tokens if completion else 0},
        "error": error,
    }


def _read_done(*paths: Path) -> dict[str, dict]:
    done = {}
    for path in paths:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                if rec.get("error") is None:
                    done[rec["id"]] = rec
    return done


def run(cfg: GenerateConfig) -> int:
    """Run the job; returns the process exit code (0 even when some lines failed)."""
    import asyncio

    import ray
    from tqdm import tqdm

    from rayinfer.model.loader import load_tokenizer, resolve_model

    resolve_model(cfg.model.model)  # unknown model: ValueError before any work; converts once
    tokenizer = load_tokenizer(cfg.model.model)
    if cfg.input:
        lines = [ln for ln in Path(cfg.input).read_text().splitlines() if ln.strip()]
    else:
        lines = [json.dumps(p) for p in BUILTIN_PROMPTS]
    defaults = {"max_tokens": 256, "temperature": 0.0, **cfg.sampling}
    jobs = parse_lines(lines, tokenizer, defaults)
    out_path = Path(cfg.output) if cfg.output else (
        Path(cfg.input).with_suffix(".out.jsonl") if cfg.input else Path("outputs/generate.out.jsonl"))
    partial = out_path.with_name(out_path.name + ".partial")
    done = _read_done(out_path, partial)
    todo = [j for j in jobs if j.error is None and j.id not in done]
    if done:
        print(f"skipping {sum(j.id in done for j in jobs)} lines already done in {out_path}")
    results: dict[str, dict] = {j.id: output_record(j) for j in jobs if j.error is not None}

    if todo:
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     logging_config=ray.LoggingConfig(encoding="TEXT", log_level="INFO"), log_to_driver=True,
                     logging_level=logging.WARNING)
        from rayinfer.actors.client import make_client

        client = make_client(cfg.model, cfg.engine, cfg.parallel)  # a fleet by parallel.topology
        partial.parent.mkdir(parents=True, exist_ok=True)
        start, num_out = time.perf_counter(), 0

        async def one(job: LineJob):
            return job, await client.complete(job.prompt_token_ids, job.params, request_id=job.id)

        async def drive(sink, bar) -> int:
            num_out = 0
            for next_done in asyncio.as_completed([one(j) for j in todo]):
                job, completion = await next_done
                rec = output_record(job, completion)
                num_out += len(rec["output_token_ids"])
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                done[job.id] = rec
                bar.update(1)
            return num_out

        try:
            with partial.open("a") as sink, tqdm(total=len(todo), desc="generate", unit="req") as bar:
                num_out = asyncio.run(drive(sink, bar))
        finally:
            client.shutdown()
        elapsed = time.perf_counter() - start
        print(f"generated {num_out} tokens for {len(todo)} requests in {elapsed:.1f} s "
              f"({num_out / max(elapsed, 1e-9):.1f} output tokens/s)")

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
    sys.exit(code)


if __name__ == "__main__":
    register_configs()
    main()
