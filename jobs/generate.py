"""Batch generation job: prompts from JSONL in, one output line per prompt, on Ray.

    python jobs/generate.py                                  # built-in prompts, printed
    python jobs/generate.py input=prompts.jsonl output=out.jsonl model.dtype=float32
    python jobs/generate.py input=batch.jsonl                # an OpenAI Batch file (detected)
    python jobs/generate.py parallel=1p1d                    # prefill/decode disaggregation (conf/parallel/)
    python jobs/generate.py parallel=ep2 model=qwen3-moe-tiny   # expert parallel, a tiny MoE on CPU
    ray job submit --working-dir . -- python jobs/generate.py input=prompts.jsonl base_dir=$PWD
    python jobs/generate.py ray.address=local                # an embedded Ray even if one runs here
    rayinfer generate --model smollm2 --input prompts.jsonl  # the same through the console script

The first line printed names the Ray cluster: ``$RAY_ADDRESS``, else one ``ray start`` left on this
machine (joined), else an embedded one listening on 127.0.0.1 (``rayinfer.actors.cluster``).

Input lines are OpenAI Batch lines (``custom_id``, ``method``, ``url``, ``body``) or this job's own
(``{"id"?, "messages" | "prompt", sampling fields...}``); both run through the service's request path, so
a body gets the answer ``/v1/chat/completions`` or ``/v1/completions`` would give (``jobs/batch_io.py``
has the formats). One output line per input line, in input order. Relative paths resolve against
``base_dir`` (default: the current directory), and the job prints the absolute path it wrote. A rerun
onto the same output reuses a finished line only when its request is the same (a content hash: prompt
tokens, sampling parameters, model). Ctrl-C (SIGINT) or SIGTERM stops the job at once, keeping the
finished lines for the rerun.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from rayinfer import envs
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
MAX_FAILURES_SHOWN = 20


@dataclass
class GenerateConfig:
    """Schema of ``conf/generate.yaml``.

    Attributes:
        input: the JSONL file (a path, or a ``file://`` URI); None: the built-in prompts.
        output: where the output goes; None: ``<input>.out.jsonl`` beside the input, or
            ``outputs/generate.out.jsonl`` without one.
        input_format: "auto" (per file), "openai" (Batch API lines) or "rayinfer".
        base_dir: the directory relative ``input`` / ``output`` paths resolve against; None: the current
            directory. Under ``ray job submit`` the job runs in Ray's copy of the working directory, so
            pass ``base_dir=$PWD`` (the shell expands it where you submit) to write where you are.
        served_model_name: the name a body's ``model`` must match and responses carry; None: model.model.
        sampling: defaults of every ``rayinfer`` line (a line's own fields win); OpenAI Batch bodies are
            taken as the service takes them.
        print_outputs: print each answer; None: when there is no input file.
        ray: which Ray cluster (``ray.address=local``: an embedded one).
        engine_mode: "client" (one driver drives one fleet) or "ray_data" (a Ray Data pipeline over
            ``data.concurrency`` engine actors, streamed, output part files in a directory;
            ``rayinfer.data.job``).
        data: the Ray Data mode's engine actor pool.
    """

    input: str | None = None
    output: str | None = None
    input_format: str = "auto"
    base_dir: str | None = None
    served_model_name: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sampling: dict[str, Any] = field(default_factory=dict)
    print_outputs: bool | None = None
    ray: RayConfig = field(default_factory=RayConfig)
    engine_mode: str = "client"
    data: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self):
        from rayinfer.jobs.batch_io import INPUT_FORMATS

        if self.input_format not in INPUT_FORMATS:
            raise ValueError(f"input_format must be one of {INPUT_FORMATS}, got {self.input_format!r}")


def resolve_path(path: str, base: Path) -> Path:
    """An absolute path for ``path``: a ``file://`` URI's path, ``~`` expanded, a relative path joined to
    ``base``.

    Raises:
        ValueError: for a URI of another scheme (``s3://``, ...): this job reads and writes local files.
    """
    if "://" in path:
        scheme, _, rest = path.partition("://")
        if scheme != "file":
            raise ValueError(f"{path}: only local paths and file:// URIs are supported, not {scheme}://")
        path = rest
    p = Path(path).expanduser()
    return p if p.is_absolute() else base / p


def job_paths(cfg: GenerateConfig) -> tuple[Path | None, Path]:
    """(input file or None, output file), both absolute (see :class:`GenerateConfig`).

    Raises:
        FileNotFoundError: when ``input`` names no file (checked before anything loads).
        ValueError: for an unsupported URI.
    """
    base = (resolve_path(cfg.base_dir, Path.cwd()) if cfg.base_dir else Path.cwd()).resolve()
    in_path = resolve_path(cfg.input, base) if cfg.input else None
    if in_path is not None and not in_path.is_file():
        raise FileNotFoundError(f"input file not found: {in_path}" + _ray_copy_hint(cfg))
    if cfg.output:
        out_path = resolve_path(cfg.output, base)
    else:
        out_path = in_path.with_suffix(".out.jsonl") if in_path else base / "outputs" / "generate.out.jsonl"
    return in_path, out_path


def _ray_copy_hint(cfg: GenerateConfig) -> str:
    from rayinfer import envs

    if cfg.base_dir or not envs.ray_job_working_dir():
        return ""
    return (f" (this job runs in Ray's copy of the submitted directory, {Path.cwd()}; add base_dir=$PWD to the "
            "submitted command so that relative paths mean the directory you submit from)")


def _image_loader(model: str):
    """A vision-language model's ImageLoader (chat lines may carry ``data:`` image parts); None otherwise."""
    from rayinfer.model.mm_processor import ImageInputProcessor
    from rayinfer.serve.images import ImageLoader

    processor = ImageInputProcessor.for_model(model)
    return ImageLoader(processor) if processor is not None else None


def cp_summary(stats) -> str:
    """One line on what context parallelism did in a fleet (``FleetStats``): prompts and tokens its rank 0s
    prefilled over their CP groups, those prefilled alone after a lost peer."""
    rank0s = [r.context_parallel for r in stats.replicas if "num_cp_prefills" in r.context_parallel]
    prefills = sum(c["num_cp_prefills"] for c in rank0s)
    tokens = sum(c["num_cp_prefill_tokens"] for c in rank0s)
    solo = sum(c.get("num_cp_solo_prefills", 0) for c in rank0s)
    lost = sum(1 for c in rank0s if not c.get("cp_active", True))
    cp = max((c["cp"] for c in rank0s), default=0)
    line = (f"context parallelism: {prefills} prompts ({tokens} tokens) prefilled over cp={cp} ranks; "
            "shorter prompts ran on one rank")
    if solo or lost:
        line += f"; {solo} prefilled alone after {lost} replica(s) lost a CP peer"
    return line


def fault_summary(stats) -> str:
    """One line on the failures a run rode out (``FleetStats``): PD legs re-run after a replica failed,
    colocated requests sent again after theirs died, replicas dead for good that the router replaced with new
    actors, and PD device KV transfers that failed (the object store stood in)."""
    parts = []
    if stats.num_retries:
        parts.append(f"{stats.num_retries} PD leg(s) re-run after a replica failed")
    if stats.num_resent:
        parts.append(f"{stats.num_resent} request(s) sent again after their replica died")
    if stats.num_replacements:
        parts.append(f"{stats.num_replacements} dead replica(s) replaced by new actors "
                     "(parallel.max_replacements)")
    if stats.num_kv_device_failures:
        now = {True: "back on the device now", False: "the object store carries KV now"}.get(
            stats.kv_device_transfers, "")
        parts.append(f"{stats.num_kv_device_failures} KV transfer(s) failed on the device" + (f" ({now})" if now else ""))
    return "failures ridden out: " + "; ".join(parts)


def spec_summary(stats) -> str:
    """One line on what speculative decoding did in a fleet (``FleetStats``): drafts proposed, verified and
    accepted over all replicas, the mean tokens a verification step emitted, the verification steps
    chained (pipelined) behind the one in flight, and (the confidence schedule) the decode steps its gate
    kept plain and its re-measurements when n-gram drafts turned up in plain steps."""
    from rayinfer.engine.spec_decode import SpecStats

    total = SpecStats(0)  # the replicas' counters summed; rates as each engine derives its own
    for name in ("num_drafts_proposed", "num_drafts_verified", "num_drafts_accepted", "num_verify_steps"):
        setattr(total, name, sum(r.spec_decode.get(f"spec_{name}", 0) for r in stats.replicas))
    d = total.to_dict()
    chained = sum(r.spec_decode.get("spec_chained_steps", 0) for r in stats.replicas)
    gated = sum(r.spec_decode.get("spec_gate_plain_steps", 0) for r in stats.replicas)
    triggers = sum(r.spec_decode.get("spec_gate_draft_triggers", 0) for r in stats.replicas)
    return (f"speculative decoding: {total.num_drafts_proposed} drafts proposed, {total.num_drafts_verified} verified, "
            f"{total.num_drafts_accepted} accepted ({d['spec_acceptance_rate']:.0%} of those verified); "
            f"{d['spec_mean_accepted_length']:.2f} tokens per verification step; "
            f"{chained} verification steps chained behind the one in flight"
            + (f"; {gated} decode steps kept plain by the confidence schedule's gate" if gated else "")
            + (f", which re-measured drafting {'once' if triggers == 1 else f'{triggers} times'} when drafts turned up"
               if triggers else ""))


def _lines(n: int) -> str:
    return f"{n} line{'' if n == 1 else 's'}"


def run(cfg: GenerateConfig, client=None) -> int:
    """Run the job; returns the process exit code (0 even when some lines failed).

    Args:
        cfg: the job's config.
        client: an ``EngineClient`` to run the lines on instead of starting the fleet of ``cfg.parallel``
            (tests share one fleet); left running.

    Raises:
        FileNotFoundError: for a missing input file, before the model or tokenizer loads.
        ValueError: for an unknown model or a bad config value, before any work.
        RayStartError: when Ray cannot be joined or started.
        TimeoutError: when the cluster cannot place the fleet.
    """
    if cfg.engine_mode != "client":  # the Ray Data mode lives in rayinfer.data.job
        from rayinfer.data.job import ENGINE_MODES, run_data_job

        if cfg.engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {', '.join(ENGINE_MODES)}, got {cfg.engine_mode!r}")
        if client is not None:
            raise ValueError("engine_mode=ray_data starts its own engine actors; it takes no client")
        return run_data_job(cfg)
    import asyncio

    from tqdm import tqdm

    from rayinfer.actors.cluster import init_ray
    from rayinfer.jobs.batch_io import (
        LineParser,
        append_record,
        drop_cut_line,
        error_text,
        is_error,
        match_done,
        output_record,
        read_done,
        read_lines,
        record_text,
        run_error,
    )
    from rayinfer.jobs.progress import ProgressClient, TokenProgress
    from rayinfer.model.loader import check_deployment, load_config, load_tokenizer, resolve_model

    in_path, out_path = job_paths(cfg)  # a missing input file: reported before anything loads
    hint = _ray_copy_hint(cfg)
    if hint and out_path.resolve().is_relative_to(Path.cwd().resolve()):  # would vanish with Ray's copy
        print(f"warning: writing {out_path}{hint}", file=sys.stderr, flush=True)
    envs.check()  # a bad RAYINFER_* value: before any work (its getter may run only in an actor, or on CUDA)
    resolve_model(cfg.model.model)  # unknown model: ValueError before any work; converts once
    tokenizer = load_tokenizer(cfg.model.model)
    lines = read_lines(in_path) if in_path else [(i + 1, json.dumps(p)) for i, p in enumerate(BUILTIN_PROMPTS)]
    hf_config = load_config(cfg.model.model)
    # fp8 on a model without fp8 layers, expert parallelism without routed experts: before any work
    check_deployment(hf_config, cfg.model.quantization, cfg.parallel.ep)
    spec = cfg.engine.speculative  # a drafter the model cannot have, an unknown draft model: before any work
    if spec.method == "mtp":
        from rayinfer.engine.llm_engine import check_supports_mtp

        check_supports_mtp(cfg.model.model)
    if spec.draft_model is not None:
        try:
            resolve_model(spec.draft_model)
        except ValueError as e:
            raise ValueError(f"engine.speculative.draft_model: {e}") from None
    max_model_len = cfg.model.max_model_len or getattr(hf_config, "text_config", hf_config).max_position_embeddings
    parser = LineParser(tokenizer, cfg.served_model_name or cfg.model.model, max_model_len,
                        {"max_tokens": 256, "temperature": 0.0, **cfg.sampling}, key_model=cfg.model.model,
                        images=_image_loader(cfg.model.model))
    if cfg.sampling:  # a bad default would fail every line: refuse it before any work
        probe = parser.parse([(0, json.dumps({"prompt": "probe"}))], "rayinfer")[0]
        if probe.error is not None:
            raise ValueError(f"sampling ({', '.join(f'{k}={v}' for k, v in cfg.sampling.items())}): {probe.error}")
    jobs = parser.parse(lines, cfg.input_format)
    if jobs:
        print(f"read {_lines(len(jobs))} ({jobs[0].format} format) from {in_path or 'the built-in prompts'}")
    partial = out_path.with_name(out_path.name + ".partial")
    if drop_cut_line(partial):
        print(f"dropped a cut last line of {partial}")
    done = match_done(jobs, read_done(out_path, partial))
    todo = [j for j in jobs if j.error is None and j.id not in done]
    if done:
        print(f"skipping {len(done)} lines already done in {out_path} (same request)")
    interrupted = False

    if todo:
        owned = client is None
        if owned:
            print(init_ray(cfg.ray, log_to_driver=True, logging_level=logging.WARNING), flush=True)
            from rayinfer.actors.client import make_client

            client = make_client(cfg.model, cfg.engine, cfg.parallel)  # a fleet by parallel.topology
        partial.parent.mkdir(parents=True, exist_ok=True)

        async def one(job):
            assert job.prepared is not None
            try:
                # the response's id names the engine requests too (<id>-<choice>), as in the service
                states = await parser.serving.collect(job.prepared.request_id, job.prepared.jobs,
                                                      time.perf_counter(), job.prepared.mm_inputs)
                return job, states, None
            except Exception as e:  # noqa: BLE001 - this line fails alone, as its request would in the service
                err = run_error(e, job.prepared.request_id)
                if err.status >= 500:
                    logger.error("line %d (%s) failed (request id %s)", job.line_no, job.id,
                                 job.prepared.request_id, exc_info=e)
                return job, None, (err, e)

        async def drive(sink, progress) -> bool:
            """Run the lines, appending each finished one; SIGINT/SIGTERM stop it (returns interrupted)."""
            loop, stop = asyncio.get_running_loop(), asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)  # also when the shell started us with SIGINT ignored
            pending: set[asyncio.Future] = {asyncio.ensure_future(one(j)) for j in todo}
            stopped: asyncio.Future = asyncio.ensure_future(stop.wait())
            try:
                while pending and not stop.is_set():
                    finished, _ = await asyncio.wait(pending | {stopped}, return_when=asyncio.FIRST_COMPLETED)
                    for task in finished - {stopped}:
                        pending.discard(task)
                        job, states, error = task.result()
                        rec = output_record(job, states, error)
                        append_record(sink, rec)
                        done[job.id] = rec
                        progress.done()
            finally:
                for task in (*pending, stopped):
                    task.cancel()
                await asyncio.gather(*pending, stopped, return_exceptions=True)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)
            return stop.is_set()

        try:
            with partial.open("ab", buffering=0) as sink, tqdm(total=len(todo), desc="generate", unit="line") as bar:
                progress = TokenProgress(bar)
                parser.serving.client = ProgressClient(client, progress)
                interrupted = asyncio.run(drive(sink, progress))
            try:
                stats = asyncio.run(client.stats())
            except Exception as e:  # noqa: BLE001 - the answers are in; a summary lost is not a failed run
                print(f"(no fleet summary: {type(e).__name__}: {e})", file=sys.stderr)
            else:
                if cfg.parallel.cp > 1:
                    print(cp_summary(stats))
                if cfg.engine.speculative.enabled:
                    print(spec_summary(stats))
                if stats.num_replacements or stats.num_retries or stats.num_resent or stats.num_kv_device_failures:
                    print(fault_summary(stats))
        finally:
            if owned:
                client.shutdown()
        print(progress.summary() + f" for {_lines(len(todo))}")
    if interrupted:
        print(f"\ninterrupted: {len(done)} of {len(jobs)} lines done, kept in {partial}; "
              f"rerun the same command to finish the rest", file=sys.stderr)
        return 130

    records = [output_record(j) if j.error else done.get(j.id) or output_record(j) for j in jobs]
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for rec in records))
    tmp.replace(out_path)
    partial.unlink(missing_ok=True)

    failed = [(j, rec) for j, rec in zip(jobs, records) if is_error(rec)]
    printed = cfg.print_outputs if cfg.print_outputs is not None else not cfg.input
    if printed:
        for j, rec in zip(jobs, records):
            print(f"\n[{j.id}] {'ERROR: ' + error_text(rec) if is_error(rec) else record_text(rec)}")
    hint = "" if printed or len(failed) == len(records) else " (the answers are there; print_outputs=true also prints them)"
    print(f"\n{len(records) - len(failed)} ok, {len(failed)} failed; wrote {out_path}{hint}")
    for j, rec in failed[:MAX_FAILURES_SHOWN]:
        print(f"  line {j.line_no}{f' ({j.id})' if j.has_own_id else ''}: {error_text(rec)}")
    if len(failed) > MAX_FAILURES_SHOWN:
        print(f"  ... and {len(failed) - MAX_FAILURES_SHOWN} more (see {out_path})")
    return 0


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="generate_schema", node=GenerateConfig)


def execute(cfg: DictConfig | GenerateConfig) -> int:
    """Build the config and run the job, turning the errors a user can fix into one line on stderr.

    Returns:
        the exit code: 0 done (some lines may have failed), 2 a bad config, unknown model, missing input,
        Ray that cannot be joined or started, or a fleet that cannot be placed (nothing ran), 130
        interrupted.
    """
    from rayinfer.actors.cluster import RayStartError

    try:
        return run(cfg if isinstance(cfg, GenerateConfig) else OmegaConf.to_object(cfg))  # pyright: ignore[reportArgumentType]
    except (ValueError, FileNotFoundError, TimeoutError, RayStartError) as e:  # nothing ran: one clear line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the lines started (loading, starting the fleet)
        print("interrupted before any line ran; nothing written", file=sys.stderr)
        return 130


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
def main(dcfg: DictConfig) -> None:
    sys.exit(execute(dcfg))


if __name__ == "__main__":
    from rayinfer.cli import normalize_overrides

    sys.argv[1:] = normalize_overrides(sys.argv[1:])  # model=<shape, path or unknown name> -> model.model=...
    register_configs()
    # an override the schema refuses (a misspelt key, a value of the wrong type, an unknown preset): one
    # line and exit 2, as the job's own config errors, instead of Hydra's multi-line message and exit 1
    from rayinfer.cli import compose

    try:
        compose("generate", [a for a in sys.argv[1:] if not a.startswith(("-", "hydra.", "+hydra.", "~hydra."))])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    main()
