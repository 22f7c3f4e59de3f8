"""Probe: where a confidence-scheduled speculative engine's decode steps spend their time.

Runs the speculative bench's workload (``jobs/bench_spec.py``: prompts that ask to repeat, fix or continue a
text) through ``LLMEngine.step()`` and records per step: the gate's choice, the step's wall time; for the
draft model's own work the time of each ``propose`` (synchronized before and after, so these steps lose their
overlap), how many requests it caught up and on how many tokens, whether the catch-up forward replayed a graph
or ran eagerly; the host time of the plain steps' draft lookups (n-gram); ``chained_rows``, the requests whose
next drafts ``launch_drafts`` queued on the device behind the step (whether or not the next step then chained:
``spec_chained_steps`` of the engine's stats counts those), and what the gate was told (each ``record`` and
``charge``: mode, tokens, ms, and tokens and ms credited to the other mode). A step's ``gate`` is "draft" or
"plain" where the gate chose (pure decode steps), "other" where it was not asked (prefill and mixed steps), and
"plain-only" for every step with ``--method none``. ``--runs`` repeats the workload on fresh engines; the first
is the warm-up (compiles), marked ``"warm_up": true``. It prints a line a run; the per-step records go to
``--out`` (or to stdout without it).

    PYTHONPATH=. python benchmarks/probe/spec_gate_steps.py --batch 8 --out /tmp/steps.json
    PYTHONPATH=. python benchmarks/probe/spec_gate_steps.py --schedule fixed --batch 32
    PYTHONPATH=. python benchmarks/probe/spec_gate_steps.py --method ngram --model llama-3-8b --load-format dummy --batch 256
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from rayinfer.engine.config import EngineConfig, ModelConfig, SpeculativeConfig  # noqa: E402
from rayinfer.engine.llm_engine import LLMEngine  # noqa: E402
from rayinfer.jobs import benchlib as bl  # noqa: E402
from rayinfer.jobs.bench_spec import spec_workload  # noqa: E402


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def instrument(engine: LLMEngine, log: list[dict]) -> None:
    """Wrap the engine's gate, proposer and step so that each step appends one record to ``log`` (only the step
    without speculation: its steps are all "plain-only")."""
    prop, gate = engine.proposer, engine.gate
    if prop is None:
        _instrument_step(engine, log, {}, base={"gate": "plain-only"})
        return
    dev = engine.device
    drafter = hasattr(prop, "cache")  # a draft model (its own KV cache to catch up); n-gram has none
    cur: dict = {}

    orig_speculate = gate.speculate

    def speculate(batch_size):
        choice = orig_speculate(batch_size)
        cur["gate"] = "draft" if choice else "plain"
        cur["explore"] = bool(gate._explored.get(gate.bucket(batch_size)))
        return choice

    gate.speculate = speculate

    orig_record, orig_charge = gate.record, gate.charge

    def record(speculative, batch_size, num_output_tokens, seconds, other_tokens=0, other_seconds=0.0):
        cur.setdefault("gate_calls", []).append(["record", bool(speculative), int(num_output_tokens),
                                                 round(seconds * 1e3, 4), int(other_tokens),
                                                 round(other_seconds * 1e3, 4)])
        return orig_record(speculative, batch_size, num_output_tokens, seconds, other_tokens, other_seconds)

    def charge(speculative, batch_size, seconds):
        cur.setdefault("gate_calls", []).append(["charge", bool(speculative), 0, round(seconds * 1e3, 4), 0, 0.0])
        return orig_charge(speculative, batch_size, seconds)

    gate.record, gate.charge = record, charge

    orig_propose = prop.propose

    def propose(reqs, max_drafts):
        lags = []
        for r in reqs if drafter else ():
            seen = prop.cache.computed.get(r.request_id, [])
            tokens = r.all_token_ids
            same = 0
            for a, b in zip(seen, tokens):
                if a != b:
                    break
                same += 1
            lags.append(len(tokens) - min(same, len(tokens) - 1))
        graphs = getattr(prop, "graphs", None)
        rounds = graphs.catch_up_rounds(lags, [len(r.all_token_ids) for r in reqs]) if graphs is not None and lags else None
        _sync(dev)
        t0 = time.perf_counter()
        out = orig_propose(reqs, max_drafts)
        _sync(dev)
        cur.setdefault("propose", []).append({"ms": (time.perf_counter() - t0) * 1e3, "reqs": len(reqs),
                                              "catch_up_max": max(lags, default=0), "catch_up_sum": sum(lags),
                                              "graph": rounds is not None,
                                              "replays": None if rounds is None else len(rounds) + 1})
        return out

    prop.propose = propose

    orig_launch = prop.launch_drafts

    def launch_drafts(sched, step, num_drafts):
        orig_launch(sched, step, num_drafts)
        cur["chained_rows"] = cur.get("chained_rows", 0) + len(getattr(prop, "_launched", ()))

    prop.launch_drafts = launch_drafts

    orig_look = engine._look_for_drafts

    def look_for_drafts():  # the plain steps' draft lookups (n-gram), not synchronized: host time only
        t0 = time.perf_counter()
        orig_look()
        cur["lookup_ms"] = cur.get("lookup_ms", 0.0) + (time.perf_counter() - t0) * 1e3

    engine._look_for_drafts = look_for_drafts
    _instrument_step(engine, log, cur)


def _instrument_step(engine: LLMEngine, log: list[dict], cur: dict, base: dict | None = None) -> None:
    """Wrap ``engine.step`` so that each step appends ``base``, what the other wrappers put in ``cur`` during the
    step, its wall time and its tokens to ``log``."""
    orig_step = engine.step

    def step(*a, **kw):
        cur.clear()
        cur.update(base or {})
        t0 = time.perf_counter()
        out = orig_step(*a, **kw)
        rec = dict(cur, ms=(time.perf_counter() - t0) * 1e3, tokens=sum(len(o.new_token_ids) for o in out))
        log.append(rec)
        return out

    engine.step = step


def summarize(log: list[dict]) -> dict:
    by = collections.defaultdict(lambda: {"steps": 0, "ms": 0.0, "tokens": 0})
    for r in log:
        key = r.get("gate", "other") + ("-explore" if r.get("explore") else "")
        by[key]["steps"] += 1
        by[key]["ms"] += r["ms"]
        by[key]["tokens"] += r["tokens"]
    props = [p for r in log for p in r.get("propose", [])]
    return {"by_gate": dict(by), "total_ms": sum(r["ms"] for r in log),
            "propose": {"calls": len(props), "ms": sum(p["ms"] for p in props),
                        "eager_calls": sum(not p["graph"] for p in props),
                        "eager_ms": sum(p["ms"] for p in props if not p["graph"]),
                        "graph_ms": sum(p["ms"] for p in props if p["graph"])},
            "chained_rows": sum(r.get("chained_rows", 0) for r in log),
            "plain_lookup_ms": sum(r.get("lookup_ms", 0.0) for r in log),
            # what the gate was told, per mode: calls recorded (tokens, ms) and ms charged
            "gate_saw": {mode: {"records": sum(1 for c in calls if c[0] == "record" and c[1] == spec),
                                "tokens": sum(c[2] if c[1] == spec else c[4] for c in calls if c[0] == "record"),
                                "ms": sum(c[3] if c[1] == spec else c[5] for c in calls)}
                         for mode, spec in (("plain", False), ("draft", True))
                         for calls in [[c for r in log for c in r.get("gate_calls", [])]]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "ngram", "none"],
                    help="none: the same workload without speculation (its steps' times, the baseline)")
    ap.add_argument("--draft-model", default=None, help="default: the target drafts for itself")
    ap.add_argument("--num-kv-blocks", type=int, default=8192, help="as jobs/bench_spec.py")
    ap.add_argument("--schedule", default="confidence", choices=["fixed", "confidence"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--git-rev", default=None, help="the revision to record (default: this checkout's)")
    args = ap.parse_args()

    mc = ModelConfig(model=args.model, load_format=args.load_format, dtype=args.dtype)
    draft = dict(draft_model=args.draft_model, draft_load_format=args.load_format) if args.method == "draft_model" else {}
    if args.method == "none":
        args.schedule = None  # recorded as such: no speculation, no schedule
    sc = SpeculativeConfig(method=args.method, schedule=args.schedule or "fixed", **draft)
    ec = EngineConfig(device=args.device, max_num_seqs=args.batch, num_kv_blocks=args.num_kv_blocks, speculative=sc)
    runs = []
    for run in range(args.runs):
        engine = LLMEngine(mc, ec)
        items = spec_workload(engine.tokenizer, args.batch, args.output_len)
        log: list[dict] = []
        instrument(engine, log)
        res = bl.run_offline(engine, items, request_prefix=f"probe{run}")
        summary = summarize(log)
        summary["output_tok_s"] = sum(t.num_output_tokens for t in res.timings) / res.elapsed_s
        label = " (warm-up)" if run == 0 and args.runs > 1 else ""
        print(f"run {run}{label}: {summary['output_tok_s']:.0f} tok/s  {json.dumps(summary)}", flush=True)
        runs.append({"warm_up": bool(label), "summary": summary, "steps": log})
        del engine
        bl.release_device_memory()
    result = {**bl.run_metadata(torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.git_rev),
              "command": "python " + " ".join(sys.argv), "args": vars(args), "runs": runs}
    bl.emit_json(result, args.out, echo=not args.out)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
