"""Golden outputs: the default model's greedy answers and per-sample log-perplexities on a fixed prompt
set (CPU, float32), checked in and compared by the test suite, so a change that moves a token or a
perplexity fails with a diff naming the sample (after DeepSeek's engine, which guards every change with
per-sample PPL baselines).

    python jobs/golden.py            # compare against the checked-in file; exit 1 with a diff if it moved
    python jobs/golden.py --write    # regenerate it on purpose (review the diff before committing)

A sample's log-perplexity is ``-mean(logprob of each generated token)`` under the model, from the
engine's own sampler logprobs. Tokens are compared up to the first position where the golden run's two
best logprobs are closer than ``TIE``: there a different CPU's float32 rounding may pick the other
token, which is not a regression; a token that moves where the gap is wider is one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "tests" / "golden" / "smollm2-135m-cpu-float32.json"
MAX_TOKENS = 32
TIE = 0.01  # logprob gap between the two best tokens under which a flip is not a regression
LOG_PPL_TOL = 2e-3  # absolute tolerance on a sample's log-perplexity when its tokens are unchanged

CHATS = {
    "capital": [{"role": "user", "content": "What is the capital of France?"}],
    "haiku": [{"role": "user", "content": "Write a haiku about the sea."}],
    "math": [{"role": "user", "content": "What is 17 times 3? Answer with the number."}],
    "list": [{"role": "system", "content": "You are a concise assistant."},
             {"role": "user", "content": "Name three primary colors."}],
    "code": [{"role": "user", "content": "Write a Python function that returns the square of x."}],
    "advice": [{"role": "user", "content": "Give one tip for sleeping better."}],
}
RAW = {
    "story": "Once upon a time, in a small village by the sea,",
    "facts": "The three states of matter are",
}


def build_prompts(tokenizer) -> dict[str, list[int]]:
    """Sample id -> prompt token ids (chat samples through the model's chat template)."""
    from rayinfer.serve.chat import encode_plain, render_messages

    prompts = {k: render_messages(tokenizer, v) for k, v in CHATS.items()}
    prompts.update({k: encode_plain(tokenizer, v) for k, v in RAW.items()})
    return prompts


def run(model=None, tokenizer=None) -> dict[str, dict]:
    """Greedy outputs of the default model (CPU, float32), per sample: tokens, text, per-token logprobs,
    the gap between the two best logprobs at each step, and the log-perplexity of the output.

    ``model`` / ``tokenizer``: the default model already loaded on the CPU in float32 (None loads it)."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    engine = LLMEngine(ModelConfig(dtype="float32"), EngineConfig(device="cpu", max_num_seqs=16,
                                                                   max_num_batched_tokens=2048),
                       model=model, tokenizer=tokenizer)
    prompts = build_prompts(engine.tokenizer)
    ids = list(prompts)
    outs = engine.generate([prompts[k] for k in ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                     logprobs=2), request_ids=ids)
    result = {}
    for rid, c in zip(ids, outs):
        if c.error:
            raise RuntimeError(f"golden sample {rid} failed: {c.error}")
        logprobs = [float(s.logprob if s.logprob is not None else 0.0) for s in c.logprobs or []]
        gaps = []
        for s in c.logprobs or []:
            top = sorted((s.top_logprobs or {}).values(), reverse=True)
            gaps.append(float(top[0] - top[1]) if len(top) > 1 else math.inf)
        result[rid] = {"output_token_ids": c.output_token_ids, "text": c.text,
                       "logprobs": [round(x, 6) for x in logprobs], "top2_gaps": [round(g, 6) for g in gaps],
                       "log_ppl": round(-sum(logprobs) / max(len(logprobs), 1), 6)}
    return result


def compare(golden: dict[str, dict], got: dict[str, dict]) -> list[str]:
    """What moved, one line per sample (empty: nothing did)."""
    problems = []
    for rid in sorted(set(golden) | set(got)):
        if rid not in got or rid not in golden:
            problems.append(f"{rid}: sample {'missing from this run' if rid not in got else 'not in the golden file'}")
            continue
        want, have = golden[rid], got[rid]
        a, b = want["output_token_ids"], have["output_token_ids"]
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is not None:
            gap = want["top2_gaps"][k]
            if gap >= TIE:
                problems.append(f"{rid}: token {k} moved from {a[k]} to {b[k]} where the golden run's top-2 "
                                f"logprob gap is {gap:.4f} (>= {TIE}); golden text {want['text']!r}, now "
                                f"{have['text']!r}")
            continue  # a flip at a near tie: what follows it is not comparable
        if len(a) != len(b):
            problems.append(f"{rid}: {len(b)} tokens instead of {len(a)} (golden text {want['text']!r}, now "
                            f"{have['text']!r})")
        elif abs(want["log_ppl"] - have["log_ppl"]) > LOG_PPL_TOL:
            problems.append(f"{rid}: log-perplexity {have['log_ppl']:.6f} instead of {want['log_ppl']:.6f} "
                            f"(tolerance {LOG_PPL_TOL})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="regenerate the golden file instead of comparing")
    args = p.parse_args(argv)
    got = run()
    if args.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "dtype": "float32", "device": "cpu",
                                      "max_tokens": MAX_TOKENS, "samples": got}, indent=1) + "\n")
        print(f"wrote {GOLDEN} ({len(got)} samples)")
        return 0
    problems = compare(json.loads(GOLDEN.read_text())["samples"], got)
    for line in problems:
        print(line)
    print(f"{len(got)} samples; {len(problems)} moved")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
