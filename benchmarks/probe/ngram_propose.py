"""Probe: host milliseconds of one n-gram drafting call (``NgramProposer.propose``) for a batch of requests
with long contexts, when the context's last tokens recur ("hit": the text repeats, where prompt lookup
pays) and when they do not ("miss"), beside the plain search (``ngram_lookup`` over the whole context).

Each request's prompt repeats a 50-token phrase (1000 tokens); every call first appends one token to each
request, the phrase's next (hit) or a random one (miss). Prints the best of ``--repeats`` runs' mean ms per
call:

    PYTHONPATH=. python benchmarks/probe/ngram_propose.py [--batch 32] [--calls 100]
"""
import argparse
import random
import time

import numpy as np

from rayinfer.engine.spec_decode import NgramProposer, ngram_lookup
from rayinfer.engine.types import Request, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    rng = random.Random(0)
    for hit in (True, False):
        best = {"propose": float("inf"), "plain search": float("inf")}
        for _ in range(args.repeats):
            phrases = [[rng.randrange(3, 512) for _ in range(50)] for _ in range(args.batch)]
            reqs = [Request(f"r{i}", (p * 21)[:1000], SamplingParams(max_tokens=args.calls + 1))
                    for i, p in enumerate(phrases)]
            proposer = NgramProposer(1, 4)
            proposer.propose(reqs, [args.k] * len(reqs))  # the prompts' first conversion, not timed
            took = {"propose": 0.0, "plain search": 0.0}
            for _ in range(args.calls):
                for r, p in zip(reqs, phrases):
                    n = len(r.prompt_token_ids) + len(r.output_token_ids)
                    r.output_token_ids.append(p[n % 50] if hit else rng.randrange(3, 50000))
                t0 = time.perf_counter()
                proposer.propose(reqs, [args.k] * len(reqs))
                t1 = time.perf_counter()
                for r in reqs:
                    ngram_lookup(np.array(r.prompt_token_ids + r.output_token_ids), args.k, 1, 4)
                took["propose"] += t1 - t0
                took["plain search"] += time.perf_counter() - t1
            for key in best:
                best[key] = min(best[key], took[key] / args.calls * 1e3)
        print(f"{'hit ' if hit else 'miss'} batch {args.batch}: propose {best['propose']:.3f} ms per call, "
              f"plain search (with the list conversion) {best['plain search']:.3f} ms")


if __name__ == "__main__":
    main()
