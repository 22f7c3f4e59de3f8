"""Online serving benchmark: N streaming requests at a Poisson rate against a running server.

    python jobs/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 \
        --max-concurrency 64 --input-len 64 --output-len 32 --goodput ttft:200 tpot:50 --json bench.json
    python jobs/bench_serve.py --dataset-name sharegpt --dataset-path ShareGPT_V3.json --num-prompts 500
    python jobs/bench_serve.py --dataset-name spec --num-prompts 200 --request-rate 4 --output-len 128  # speculative

Reports TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p95, p99, in ms), request / token
throughput and, with ``--goodput``, the requests per second that met every SLO, as vLLM's ``bench serve``
does. Lengths are in tokens, counted by the server's own ``/tokenize`` (or ``--tokenizer``, a local one):
random prompts are seeded words cut to ``--input-len`` tokens; a ShareGPT file gives each conversation's
first human turn as the prompt and the length of its answer as ``max_tokens`` (vLLM's sampling and
filters). Every request asks for exactly its ``max_tokens`` (``ignore_eos``) so runs are comparable. A
plain argparse client: it needs no model config, only the server's address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

_WORDS = ("time year people way day man thing woman life child world school state family student group "
          "country problem hand part place case week company system program question work government "
          "number night point home water room mother area money story fact month lot right study book "
          "eye job word business issue side kind head house service friend father power hour game line").split()
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
# vLLM's ShareGPT filters: both sides at least 4 tokens, prompt at most 1024, prompt + output at most 2048
_MIN_LEN, _MAX_PROMPT_LEN, _MAX_TOTAL_LEN = 4, 1024, 2048


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

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first (0 for a request of one token, as vLLM counts it)."""
        return (self.latency - self.ttft) / (self.num_output_tokens - 1) if self.num_output_tokens > 1 else 0.0


@dataclass
class SampleRequest:
    """One request to send: its prompt text, the prompt's length in tokens (the text alone, before any
    chat template) and ``max_tokens``."""

    prompt: str
    prompt_len: int
    output_len: int


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class LocalTokenizer:
    """A Hugging Face tokenizer (``--tokenizer``: a built-in model name or a local directory)."""

    def __init__(self, name: str):
        from rayinfer.model.loader import load_tokenizer

        self.tok = load_tokenizer(name)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class RemoteTokenizer:
    """The server's own tokenizer, through ``POST /tokenize`` and ``/detokenize`` (rayinfer's and vLLM's).

    Raises (from encode / decode):
        RuntimeError: the server answered with an error (its message).
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, path: str, body: dict) -> dict:
        r = self.client.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path} answered HTTP {r.status_code}: {r.text[:200]}")
        return r.json()

    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    def decode(self, ids: list[int]) -> str:
        return self._post("/detokenize", {"tokens": ids})["prompt"]


def random_requests(num: int, input_len: int, output_len: int, seed: int, tokenizer: Tokenizer) -> list[SampleRequest]:
    """``num`` seeded prompts of ``input_len`` tokens each (random words, cut at ``input_len`` tokens;
    ``prompt_len`` is the cut text's own count, which a tokenizer that merges across the cut may make
    one or two shorter)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        words = " ".join(rng.choice(_WORDS) for _ in range(input_len + 8))  # a word is at least one token
        text = tokenizer.decode(tokenizer.encode(words)[:input_len])
        out.append(SampleRequest(text, len(tokenizer.encode(text)), output_len))
    return out


def spec_requests(num: int, output_len: int, tokenizer: Tokenizer) -> list[SampleRequest]:
    """``num`` prompts that ask to repeat, fix, rewrite or continue a given text (the workload of
    ``jobs/bench_spec.py``, where prompt lookup pays: speculative decoding under online arrivals), cycled, each
    asking for ``output_len`` tokens."""
    from rayinfer.jobs.bench_spec import spec_prompt

    prompts = [spec_prompt(i) for i in range(num)]
    return [SampleRequest(p, len(tokenizer.encode(p)), output_len) for p in prompts]


def load_sharegpt(path: str, num: int, seed: int, tokenizer: Tokenizer, output_len: int | None = None
                  ) -> list[SampleRequest]:
    """``num`` requests from a ShareGPT-format file, as vLLM samples them.

    The file is a JSON list of ``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt",
    "value": ...}, ...]}``. Conversations with at least two turns are shuffled (``seed``); each gives its
    first turn as the prompt and the second turn's length in tokens as ``max_tokens`` (or
    ``output_len``). Pairs with fewer than 4 tokens on either side, a prompt over 1024 tokens, or over
    2048 together are skipped.

    Raises:
        ValueError: the file is not a list of conversations, or holds fewer than ``num`` usable ones.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} objects")
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and isinstance(c.get("conversations"), list) and len(c["conversations"]) >= 2]
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, answer in pairs:
        prompt_len = len(tokenizer.encode(prompt))
        n = output_len if output_len is not None else len(tokenizer.encode(answer))
        if prompt_len < _MIN_LEN or n < _MIN_LEN or prompt_len > _MAX_PROMPT_LEN or prompt_len + n > _MAX_TOTAL_LEN:
            continue
        out.append(SampleRequest(prompt, prompt_len, n))
        if len(out) == num:
            return out
    raise ValueError(f"{path}: only {len(out)} usable conversations of {len(pairs)} (at least two turns, 4 to 1024 "
                     f"prompt tokens, at most 2048 with the answer); --num-prompts asks for {num}")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (SLOs in ms; keys ttft, tpot, e2el).

    Raises:
        ValueError: naming the bad item (unknown key, not KEY:VALUE, not a positive number).
    """
    slos: dict[str, float] = {}
    for item in items or []:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput {key}: the SLO must be a positive number of milliseconds; got {value!r}")
        slos[key] = ms
    return slos


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (TTFT, TPOT, end-to-end latency; ms)."""
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    return r.success and all(values[k] * 1000 <= ms for k, ms in slos_ms.items())


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


def sample_requests(args: argparse.Namespace) -> list[SampleRequest]:
    """The requests of a run, by ``--dataset-name`` (lengths counted by ``--tokenizer`` or the server)."""
    tokenizer: Tokenizer = (LocalTokenizer(args.tokenizer) if args.tokenizer
                            else RemoteTokenizer(args.base_url, args.api_key))
    if args.dataset_name == "sharegpt":
        return load_sharegpt(args.dataset_path, args.num_prompts, args.seed, tokenizer, args.sharegpt_output_len)
    if args.dataset_name == "spec":
        return spec_requests(args.num_prompts, args.output_len, tokenizer)
    return random_requests(args.num_prompts, args.input_len, args.output_len, args.seed, tokenizer)


async def run_benchmark(args: argparse.Namespace, requests: list[SampleRequest]) -> tuple[list[RequestResult], float]:
    """Send the requests (a progress bar counts the finished ones); returns (per-request results,
    wall-clock duration in seconds)."""
    import httpx
    from tqdm import tqdm

    chat = args.endpoint == "chat"
    url = args.base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    delays = arrival_delays(len(requests), args.request_rate, args.seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    base: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True},
                            "temperature": args.temperature, "ignore_eos": True}
    if args.model:
        base["model"] = args.model
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=args.disable_tqdm)

    async def limited(client, req: SampleRequest) -> RequestResult:
        prompt = {"messages": [{"role": "user", "content": req.prompt}]} if chat else {"prompt": req.prompt}
        async with limit:
            result = await _one_request(client, url, headers, {**base, **prompt, "max_tokens": req.output_len}, chat)
        bar.update(1)
        return result

    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=args.max_concurrency or len(requests) + 8)
    try:
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            start = time.perf_counter()
            tasks = []
            for req, delay in zip(requests, delays):
                await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(limited(client, req)))
            results = await asyncio.gather(*tasks)
            return list(results), time.perf_counter() - start
    finally:
        bar.close()


def _stats_ms(values: list[float], percentiles: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, **{f"p{p:g}": 0.0 for p in percentiles}}
    xs = sorted(values)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return (xs[lo] + (xs[hi] - xs[lo]) * (k - lo)) * 1000

    return {"mean": sum(xs) / len(xs) * 1000, "median": pct(50), **{f"p{p:g}": pct(p) for p in percentiles}}


def summarize(results: list[RequestResult], duration: float, percentiles=(90, 95, 99),
              goodput_ms: dict[str, float] | None = None) -> dict:
    """Aggregate results into vLLM ``bench serve``-style metrics (latencies in ms).

    Args:
        goodput_ms: SLOs in ms (``parse_goodput``); when given, ``request_goodput`` is the requests per
            second that succeeded and met all of them.
    """
    ok = [r for r in results if r.success]
    out_tokens = sum(r.num_output_tokens for r in ok)
    in_tokens = sum(r.num_prompt_tokens for r in ok)
    summary = {
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
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.num_output_tokens > 1], list(percentiles)),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl], list(percentiles)),
        "e2el_ms": _stats_ms([r.latency for r in ok], list(percentiles)),
    }
    if goodput_ms:
        good = sum(meets_slos(r, goodput_ms) for r in ok)
        summary.update(goodput_slos_ms=dict(goodput_ms), num_good=good,
                       request_goodput=good / duration if duration else 0.0)
    return summary


def format_report(summary: dict) -> str:
    """A human-readable table of the summary."""
    lines = ["============ Serving Benchmark Result ============",
             f"{'Successful requests:':<40}{summary['completed']:>10}",
             f"{'Failed requests:':<40}{summary['failed']:>10}",
             f"{'Benchmark duration (s):':<40}{summary['duration_s']:>10.2f}",
             f"{'Total input tokens:':<40}{summary['total_input_tokens']:>10}",
             f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>10}",
             f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>10.2f}",
             *([f"{'Request goodput (req/s):':<40}{summary['request_goodput']:>10.2f}"] if 'request_goodput' in summary
               else []),
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
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--dataset-name", choices=("random", "sharegpt", "spec"), default="random",
                   help="random words; ShareGPT conversations; spec: prompts to repeat, fix or continue a text "
                        "(speculative decoding's workload, --output-len tokens each)")
    p.add_argument("--dataset-path", default=None, help="the ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="max_tokens of every ShareGPT request (default: the length of its answer)")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=32,
                   help="prompt length in tokens (random dataset)")
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=16,
                   help="max_tokens of each request (random and spec datasets)")
    p.add_argument("--tokenizer", default=None,
                   help="count tokens with this local tokenizer (a built-in model name or a directory); "
                        "default: the server's /tokenize")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, in ms: ttft:200 tpot:50 e2el:2000")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--json", dest="json_path", default=None, help="write the summary (and settings) here")
    p.add_argument("--metadata", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra fields for the JSON (e.g. device=H200 git_rev=abc123 topology=1p1d)")
    args = p.parse_args(argv)
    if args.num_prompts <= 0 or args.output_len <= 0 or args.input_len <= 0:
        p.error("--num-prompts, --input-len and --output-len must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path FILE.json")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len <= 0:
        p.error("--sharegpt-output-len must be positive")
    try:
        args.goodput_ms = parse_goodput(args.goodput)
    except ValueError as e:
        p.error(str(e))
    bad = [kv for kv in args.metadata if "=" not in kv]
    if bad:
        p.error(f"--metadata takes KEY=VALUE, got {bad[0]!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        requests = sample_requests(args)
    except (ValueError, OSError, RuntimeError) as e:  # a bad dataset file, a server that cannot tokenize
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(requests)} requests, prompts of {sum(r.prompt_len for r in requests) / len(requests):.1f} tokens "
          f"and max_tokens {sum(r.output_len for r in requests) / len(requests):.1f} on average ({args.dataset_name})",
          flush=True)
    results, duration = asyncio.run(run_benchmark(args, requests))
    summary = summarize(results, duration, goodput_ms=args.goodput_ms)
    print(format_report(summary))
    if args.json_path:
        settings = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in vars(args).items()}
        with open(args.json_path, "w") as f:
            json.dump({"command": shlex.join(["python", "jobs/bench_serve.py", *(sys.argv[1:] if argv is None else argv)]),
                       **dict(kv.split("=", 1) for kv in args.metadata), "settings": settings, **summary,
                       "requests": [asdict(r) for r in results]}, f, indent=2)
        print(f"wrote {args.json_path}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
