"""Host (CPU, Python) milliseconds per engine step, with a model so small that host work dominates.

    python jobs/bench_host.py                          # batches 1, 64, 256; 1000 prompt / 128 output tokens
    python jobs/bench_host.py --batches 256 --profile  # and the top host functions under cProfile
    python jobs/bench_host.py --ngram 4 --batches 1 8 32  # speculative decoding: n-gram, 4 drafts, fixed k

For each batch size B, B requests of ``--input-len`` random prompt tokens run to exactly ``--output-len``
tokens (ignore_eos, seeded sampling) through ``LLMEngine.step`` with async scheduling, on CPU, with a
1-layer Llama of hidden size 64 and a 512-token vocab (dummy weights, the default model's tokenizer).
Only decode steps (every scheduled request computes one token, or with ``--ngram`` one plus its drafts)
are counted. With ``--ngram K`` each prompt repeats a 50-token phrase, so prompt lookup finds drafts; with
random weights they are rarely accepted, so the steps measure the drafting and verification host work. A step's host time is its
wall time minus the time inside the model's forward, its logits and the sampling kernel (the work a GPU
does): scheduling, input and metadata building, sampler bookkeeping, detokenization and outputs.
Prints per batch: decode steps, median (and mean) host ms per step, median model ms per step.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import rayinfer.engine.sampler as sampler_mod
from rayinfer.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import SamplingParams

TINY_LLAMA = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    rope_theta=10000.0, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


def tiny_model_dir(root: Path) -> Path:
    """Write the tiny Llama's config.json beside a copy of the default model's tokenizer files."""
    from rayinfer.model.default_model import ensure_default_model

    src = ensure_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, root / name)
    (root / "config.json").write_text(json.dumps(TINY_LLAMA))
    return root


class DeviceClock:
    """Accumulates seconds spent in wrapped callables (the model and the sampling kernel); a profiler, if
    given, is paused inside them so that it sees host work only."""

    def __init__(self, profile: cProfile.Profile | None = None):
        self.seconds = 0.0
        self.profile = profile

    def wrap(self, fn):
        def timed(*args, **kwargs):
            if self.profile is not None:
                self.profile.disable()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                if self.profile is not None:
                    self.profile.enable()

        return timed


def make_engine(model_dir: Path, batch: int, input_len: int, output_len: int, block_size: int,
                ngram: int = 0) -> LLMEngine:
    blocks = batch * -(-(input_len + output_len + ngram + 1) // block_size) + 16
    spec = SpeculativeConfig(method="ngram", num_draft_tokens=ngram) if ngram else SpeculativeConfig()
    return LLMEngine(
        ModelConfig(model=str(model_dir), dtype="float32", load_format="dummy"),
        EngineConfig(device="cpu", block_size=block_size, num_kv_blocks=blocks, max_num_seqs=batch,
                     max_num_batched_tokens=8192, async_scheduling=True, enforce_eager=True, speculative=spec),
    )


def run_batch(model_dir: Path, batch: int, input_len: int, output_len: int, block_size: int = 16,
              profile: cProfile.Profile | None = None, ngram: int = 0) -> dict:
    """Drive one batch to the end; returns decode-step counts and median / mean host and device ms."""
    engine = make_engine(model_dir, batch, input_len, output_len, block_size, ngram)
    clock = DeviceClock(profile)
    model = engine.runner.model
    model.forward = clock.wrap(model.forward)
    model.compute_logits = clock.wrap(model.compute_logits)
    last = {}
    schedule = engine.scheduler.schedule

    def schedule_and_keep():
        last["sched"] = schedule()
        return last["sched"]

    engine.scheduler.schedule = schedule_and_keep
    rng = random.Random(0)
    for i in range(batch):
        if ngram:  # a repeated phrase: prompt lookup finds it
            phrase = [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(50)]
            prompt = (phrase * (input_len // 50 + 1))[:input_len]
        else:
            prompt = [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(input_len)]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True, seed=i))
    host, device = [], []
    orig_sample = sampler_mod.sample
    sampler_mod.sample = clock.wrap(orig_sample)
    try:
        while engine.has_unfinished_requests():
            device0 = clock.seconds
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            engine.step()
            if profile is not None:
                profile.disable()
            wall = time.perf_counter() - t0
            sched = last["sched"]
            if sched.scheduled and all(s.num_new_tokens == 1 + s.num_draft_tokens for s in sched.scheduled):
                device.append(clock.seconds - device0)
                host.append(wall - device[-1])
    finally:
        sampler_mod.sample = orig_sample
    return {"batch": batch, "ngram": ngram, "steps": len(host), "host_ms": statistics.median(host) * 1e3,
            "host_ms_mean": statistics.mean(host) * 1e3, "model_ms": statistics.median(device) * 1e3}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--ngram", type=int, default=0, metavar="K",
                    help="speculative decoding by prompt lookup with K drafts (fixed k); 0: off")
    ap.add_argument("--profile", action="store_true", help="cProfile the steps; print the top functions")
    ap.add_argument("--top", type=int, default=25, help="functions to print with --profile")
    ap.add_argument("--sort", default="tottime", help="pstats sort key with --profile (tottime, cumulative)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_host-") as tmp:
        model_dir = tiny_model_dir(Path(tmp))
        print(f"{'batch':>6} {'steps':>6} {'host ms/step':>13} {'(mean)':>8} {'model ms/step':>14}")
        for batch in args.batches:
            prof = cProfile.Profile() if args.profile else None
            row = run_batch(model_dir, batch, args.input_len, args.output_len, profile=prof, ngram=args.ngram)
            rows.append(row)
            print(f"{row['batch']:>6} {row['steps']:>6} {row['host_ms']:>13.3f} {row['host_ms_mean']:>8.3f} "
                  f"{row['model_ms']:>14.3f}", flush=True)
            if prof is not None:
                print(f"-- batch {batch}: top {args.top} host functions by {args.sort} (all steps, prefill included)")
                pstats.Stats(prof).sort_stats(args.sort).print_stats(args.top)
    return rows


if __name__ == "__main__":
    main()
