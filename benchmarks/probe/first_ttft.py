"""Probe: how long the first prompts of a fresh engine take (TTFT), with and without the start-up prefill
(``LLMEngine._warm_up_prefill``).

Builds the engine on dummy weights, then times ``--prompts`` prompts of ``--input-len`` random tokens one after
another (each asking 1 token, so its wall time is its TTFT). ``--no-warm-up`` skips the start-up prefill. Run
each setting in its own process with its own ``TRITON_CACHE_DIR``, so that no compiled kernel carries over:

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python benchmarks/probe/first_ttft.py --no-warm-up --out /tmp/a.json
    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python benchmarks/probe/first_ttft.py --out /tmp/b.json
"""
import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rayinfer.engine.config import EngineConfig, ModelConfig  # noqa: E402
from rayinfer.engine.llm_engine import LLMEngine  # noqa: E402
from rayinfer.engine.types import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite-v3arch")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--log-compiles", action="store_true",
                    help="record the Triton kernels each prompt compiles (triton.knobs.runtime.jit_post_compile_hook)")
    ap.add_argument("--git-rev", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.no_warm_up:
        LLMEngine._warm_up_prefill = lambda self, on_cuda: None
    started = time.perf_counter()
    engine = LLMEngine(ModelConfig(args.model, "bfloat16", "dummy", max_model_len=args.max_model_len),
                       EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens))
    build_s = time.perf_counter() - started
    rng = random.Random(0)
    ttft, compiled = [], []
    if args.log_compiles:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled[-1].append(str(kw.get("repr"))[:600])
    for i in range(args.prompts):
        prompt = [rng.randrange(engine.vocab_size) for _ in range(args.input_len)]
        compiled.append([])
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), request_ids=[f"p{i}"])
        ttft.append(1e3 * (time.perf_counter() - t0))
    rev = args.git_rev or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip() or None
    result = {"command": " ".join(["python", *sys.argv]), "git_rev": rev, "model": args.model,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "warm_up": not args.no_warm_up, "engine_build_s": build_s, "input_len": args.input_len,
              "ttft_ms": ttft, **({"compiled_per_prompt": compiled} if args.log_compiles else {})}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
