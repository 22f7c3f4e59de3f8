"""Diagnose the GPU engine test: which trial/engine gives a new distinct output, preemptions per trial."""
import json, random, sys, torch
sys.path.insert(0, "tests/engine")
from test_batch_invariant import run_trial
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
engines = []
for chunk, blocks in ((None, 20000), (512, 20000), (128, 300)):
    engines.append(LLMEngine(ModelConfig(dtype="bfloat16", max_model_len=2048, load_format="dummy"),
                             EngineConfig(device="cuda", max_num_batched_tokens=chunk, num_kv_blocks=blocks, batch_invariant=True)))
tok = engines[0].tokenizer
target = tok.encode("Explain, step by step, why the sky is blue and sunsets are red. " * 6)
rng = random.Random(0)
seen, rows = [], []
for i in range(int(sys.argv[2])):
    e = engines[i % 3]
    p0 = e.scheduler.num_preemptions
    out, n = run_trial(e, target, rng, f"trial{i}", max_companions=255, max_len=256, max_new=32, vocab=e.vocab_size)
    if out not in seen:
        seen.append(out)
    k = seen.index(out)
    first_diff = None
    if k:
        first_diff = next(j for j, (a, b) in enumerate(zip(seen[0], out)) if a != b)
        a, b = seen[0][first_diff], out[first_diff]
        first_diff = dict(pos=first_diff, tok=[a[0], b[0]], lp=[a[1], b[1]])
    r = dict(trial=i, engine=i % 3, companions=n, preempted=e.scheduler.num_preemptions - p0, output=k, diff=first_diff)
    rows.append(r)
    if k or i % 10 == 0:
        print(r, flush=True)
json.dump(dict(rows=rows, distinct=len(seen)), open(sys.argv[1], "w"))
print("distinct", len(seen))
