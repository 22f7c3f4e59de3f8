"""Online serving benchmark: N streaming requests at a Poisson rate against a running server.

    python jobs/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
        --max-concurrency 64 --input-len 64 --output-len 32 --json bench.json

Reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p95, p99, in ms) and request / token
throughput, as vLLM's ``bench serve`` does. Prompts are synthetic (seeded random words) and each request
asks for exactly ``--output-len`` tokens (``ignore_eos``) so runs are comparable. A plain argparse client:
it needs no model config, only the server's address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government "
          "number night point home water room mother area money story fact month lot right study book "
          "eye job word business issue side kind head house service friend father power hour game line").split()


@dataclass
class RequestResult:
    """One request's timings (seconds, from its own start) and outcome."""

    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between content chunks after the first
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str = ""


def make_prompts(num: int, input_len: int, seed: int) -> list[str]:
    """``num`` prompts of about ``input_len`` words each (seeded, so runs repeat)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(input_len)) for _ in range(num)]


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (a Poisson process); 0 for rate = inf."""
    rng = random.Random(seed + 1)
    return [0.0 if math.isinf(rate) else rng.expovariate(rate) for _ in range(num)]


async def _one_request(client, url: str, headers: dict, body: dict, chat: bool) -> RequestResult:
    res = RequestResult()
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error event")
                    return res
                if chunk.get("usage"):
                    res.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.num_output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
        res.latency = time.perf_counter() - start
        res.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_benchmark(args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    """Send the requests; returns (per-request results, wall-clock duration in seconds)."""
    import httpx

    chat = args.endpoint == "chat"
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    delays = arrival_delays(args.num_prompts, args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
    base = {"max_tokens": args.output_len, "stream": True, "stream_options": {"include_usage": True},
            "temperature": args.temperature, "ignore_eos": True}
    if args.model:
        base["model"] = args.model

    async def limited(client, prompt: str) -> RequestResult:
        body = dict(base, **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}))
        async with limit:
            return await _one_request(client, url, headers, body, chat)

    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, delay in zip(prompts, delays):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(client, prompt)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats_ms(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return (xs[lo] + (xs[hi] - xs[lo]) * (k - lo)) * 1000

    return {"mean": sum(xs) / len(xs) * 1000, "median": pct(50), **{f"p{p:g}": pct(p) for p in percentiles}}


def summarize(results: list[RequestResult], duration: float, percentiles=(90, 95, 99)) -> dict:
    """Aggregate results into vLLM ``bench serve``-style metrics (latencies in ms)."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.num_prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.success})[:10],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _stats_ms([r.ttft for r in ok], list(percentiles)),
        "tpot_ms": _stats_ms(tpots, list(percentiles)),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl], list(percentiles)),
        "e2el_ms": _stats_ms([r.latency for r in ok], list(percentiles)),
    }


def format_report(summary: dict) -> str:
    """A human-readable table of the summary."""
    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':<40}{summary['completed']:>10}",
             f"{'Failed requests:':<40}{summary['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{summary['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{summary['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>10.2f}",
             f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>10.2f}",
             f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>10.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{title:^20}{'-' * 15}")
        for stat, value in summary[key].items():
            lines.append(f"{(stat.capitalize() if stat in ('mean', 'median') else stat.upper()) + ' (ms):':<40}"
                         f"{value:>10.2f}")
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    lines.append("=" * 50)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=16, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", dest="json_path", default=None, help="write the summary (and settings) here")
    args = p.parse_args(argv)
    if args.num_prompts <= 0 or args.output_len <= 0 or args.input_len <= 0:
        p.error("--num-prompts, --input-len and --output-len must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, duration = asyncio.run(run_benchmark(args))
    summary = summarize(results, duration)
    print(format_report(summary))
    if args.json_path:
        settings = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
        with open(args.json_path, "w") as f:
            json.dump({"settings": settings, **summary,
                       "requests": [asdict(r) for r in results]}, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
