"""KV tiers benchmark: TTFT and prefill tokens computed with and without the host tier and the KV store.

    python jobs/bench_kv_tiers.py                                    # SmolLM2 on CPU, multi-turn chat
    python jobs/bench_kv_tiers.py --workload doc                     # shared long documents
    python jobs/bench_kv_tiers.py --model llama-3-8b --load-format dummy --device cuda \\
        --num-kv-blocks 256 --conversations 16 --turns 6 --system-tokens 2000 --turn-tokens 400   # GPU

Workloads (seeded random token ids): ``chat``: conversations that each resend the whole conversation every
turn (a shared system prompt of ``--system-tokens``, then per turn ``--turn-tokens`` user tokens and the
model's ``--output-tokens`` answer), turns interleaved round-robin across conversations; ``doc``:
``--conversations`` documents of ``--system-tokens`` tokens, each asked ``--turns`` questions, interleaved.
The device pool (``--num-kv-blocks``) is meant to be too small for all of them, so it evicts.

Configs, each on a fresh engine: ``device`` (prefix cache only), ``host`` (+ host tier of ``--host-gib``),
``store`` (+ a KV store on disk, written at each request's end and read on a miss, with the rule the
colocated EngineActor uses), ``host+store``, and ``store-replica-b`` (a second engine reading the store the
``store`` run left: another replica, or the same one after a restart). Requests run one at a time; TTFT is
from add_request to the first token. Writes ``benchmarks/results/kv-tiers-<workload>-<device>-<time>.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rayinfer.actors.kv_disk_store import DiskKVStore
from rayinfer.actors.kv_transport import from_wire, to_wire
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.model_runner import kv_layout_tag
from rayinfer.engine.types import KVHandle, SamplingParams
from rayinfer.jobs import benchlib as bl
from rayinfer.policy.kv_store_index import block_hashes


def workload(args) -> list[list[tuple[str, list[int]]]]:
    """Rounds of (conversation id, new tokens of the turn), interleaved across conversations."""
    rng = random.Random(args.seed)

    def toks(n):
        return [rng.randrange(100, 20000) for _ in range(n)]

    if args.workload == "chat":
        system = toks(args.system_tokens)
        firsts = [("c%d" % c, system + toks(args.turn_tokens)) for c in range(args.conversations)]
        return [firsts] + [[("c%d" % c, toks(args.turn_tokens)) for c in range(args.conversations)]
                           for _ in range(args.turns - 1)]
    docs = [toks(args.system_tokens) for _ in range(args.conversations)]
    return [[(f"d{c}q{t}", docs[c] + toks(args.turn_tokens)) for c in range(args.conversations)]
            for t in range(args.turns)]


class StoreTier:
    """The KV store in this process (a DiskKVStore), wired to an engine as the colocated EngineActor does."""

    def __init__(self, store: DiskKVStore, engine: LLMEngine):
        self.store, self.engine = store, engine
        self.layout = kv_layout_tag(engine.kv_cache)
        self.hit_blocks = 0
        engine.store_writer = self.write

    def write(self, hashes, start, payload) -> bool:
        self.store.put(hashes, start, to_wire(payload.cpu()), self.layout)
        return True

    def handle(self, rid: str, prompt: list[int]) -> KVHandle | None:
        e, bs = self.engine, self.engine.engine_config.block_size
        hashes = block_hashes(prompt, bs)
        kv, local = e.scheduler.kv, 0
        while local < len(hashes) and (hashes[local] in kv.pool.hash_to_block
                                       or (kv.host is not None and hashes[local] in kv.host.hash_to_slot)):
            local += 1
        if local == len(hashes) or self.store.match(hashes) <= local:
            return None
        blocks = self.store.get(hashes[: self.store.match(hashes)])
        if len(blocks) <= local:
            return None
        self.hit_blocks += len(blocks)
        payload = from_wire(np.concatenate(blocks, axis=1), e.kv_cache.dtype)
        return KVHandle(rid, list(hashes[: len(blocks)]), len(blocks) * bs, self.layout, payload)


def run(engine: LLMEngine, rounds, params: SamplingParams, store: StoreTier | None) -> dict:
    history: dict[str, list[int]] = {}
    ttfts, prefill, outputs = [], 0, []
    for r, turns in enumerate(rounds):
        for conv, new in turns:
            prompt = history.get(conv, []) + new
            rid = f"{conv}-{r}"
            t0 = time.perf_counter()
            engine.add_request(rid, prompt, params, kv_handle=store.handle(rid, prompt) if store else None)
            first, out, cached = None, [], 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.new_token_ids and first is None:
                        first = time.perf_counter() - t0
                    out += o.new_token_ids
                    cached = o.num_cached_tokens
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            ttfts.append(first)
            prefill += len(prompt) - cached
            history[conv] = prompt + out
            outputs.append(out)
    stats = engine.stats()
    return {"ttft_mean_ms": 1e3 * float(np.mean(ttfts)), "ttft_p50_ms": 1e3 * float(np.median(ttfts)),
            "prefill_tokens_computed": prefill, "num_requests": len(ttfts),
            "prompt_tokens": sum(len(history[c]) for c in history),
            "host_kv_hits": stats.get("host_kv_hits", 0), "host_kv_bytes_moved": stats.get("host_kv_bytes_moved", 0),
            "store_hit_blocks": store.hit_blocks if store else 0, "device_prefix_hits": stats["prefix_cache_hits"],
            "outputs": outputs}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--workload", choices=("chat", "doc"), default="chat")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--turn-tokens", type=int, default=48)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=48)
    p.add_argument("--host-gib", type=float, default=1.0)
    p.add_argument("--configs", default="device,host,store,host+store,store-replica-b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="benchmarks/results")
    p.add_argument("--git-rev", default=None)
    args = p.parse_args(argv)
    rounds = workload(args)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    model = ModelConfig(args.model, dtype=args.dtype, load_format=args.load_format)
    base = dict(device=args.device, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                async_scheduling=False if args.device == "cpu" else None)
    shared = LLMEngine(model, EngineConfig(**base))  # loads the weights once; the others reuse the model
    results, store_dir = {}, tempfile.mkdtemp(prefix="kv-tiers-")
    for name in args.configs.split(","):
        host = args.host_gib if "host" in name else 0.0
        engine = LLMEngine(model, EngineConfig(**base, host_kv_cache_gib=host), model=shared.model,
                           tokenizer=shared.tokenizer)
        store = None
        if "store" in name:
            directory = store_dir if name == "store-replica-b" else tempfile.mkdtemp(prefix="kv-tiers-")
            if name == "store":
                store_dir = directory
            store = StoreTier(DiskKVStore(directory, args.model), engine)
        results[name] = run(engine, rounds, params, store)
        r = results[name]
        print(f"{name:16s} TTFT mean {r['ttft_mean_ms']:8.1f} ms  p50 {r['ttft_p50_ms']:8.1f} ms  prefill tokens "
              f"{r['prefill_tokens_computed']:6d}  host hits {r['host_kv_hits']:5d}  store hit blocks "
              f"{r['store_hit_blocks']:5d}", flush=True)
        del engine
    same = all(r["outputs"] == results[next(iter(results))]["outputs"] for r in results.values())
    print(f"greedy outputs equal across configs: {same}")
    for r in results.values():
        r.pop("outputs")
    out = {"workload": vars(args), "results": results, "outputs_equal": same,
           **bl.run_metadata(shared.device, args.git_rev)}
    out["command"] = " ".join(["python", "jobs/bench_kv_tiers.py", *(argv if argv is not None else sys.argv[1:])])
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    dev = "cpu" if shared.device.type == "cpu" else torch.cuda.get_device_name(shared.device).lower().replace(" ", "-")
    path = Path(args.out_dir) / f"kv-tiers-{args.workload}-{dev}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
