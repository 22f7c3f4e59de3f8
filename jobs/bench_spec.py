"""The ``spec`` section of ``jobs/bench.py``: speculative decoding against plain decoding.

    python jobs/bench.py scenario=smollm2-spec                 # SmolLM2-135M real weights, GPU
    python jobs/bench.py scenario=smollm2-spec spec.batches=[1,8] spec.output_len=64
    python jobs/bench.py scenario=deepseek-v3-tiny-mtp     # MTP drafting on the DeepSeek-V3 shape (CPU)
    python jobs/bench.py scenario=llama-3-8b-spec          # Llama-3-8B shape, n-gram and a Llama-3.2-1B draft

For each batch size, the same workload runs through an engine per method (``spec.methods``: plain, n-gram
and the model drafting for itself, each with the fixed and the confidence schedule); all requests arrive
at once, greedy. The workload is prompts that ask to repeat, edit or continue a given text (where prompt
lookup pays). Each row records output tokens/s, TPOT, the speedup over plain decoding at that batch, and
the speculative counters (drafts proposed / verified / accepted, mean accepted length, acceptance by
position). One model is loaded and shared by every engine; each engine gets its own KV cache.

``mtp`` / ``mtp-confidence`` draft with DeepSeek-V3's multi-token-prediction module: the model is then
loaded with its MTP modules (``spec_model_kwargs``). With dummy weights the drafts are noise (nearly
none accepted), so those rows measure the proposer's overhead per step, not a speedup.

``draft`` / ``draft-confidence`` / ``draft-drained`` draft with a separate model (``spec.draft_model``, loaded
with the target's ``load_format``): with dummy weights its drafts are rejected too, so those rows measure what a
wrong drafter costs, and what the confidence schedule's gate wins back.
"""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, field
from typing import Any

from rayinfer.jobs import benchlib as bl

TEXTS = (
    "The river rose slowly through the night, and by morning the low fields beside the mill were under a "
    "foot of brown water. The miller walked the bank with a lantern, counting the posts that still showed.",
    "To install the package, create a virtual environment, activate it, and run the installer with the "
    "requirements file. Then copy the example configuration into your home directory and edit the paths.",
    "def moving_average(values, window):\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n"
    "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
    "        out.append(total / min(i + 1, window))\n    return out\n",
    "Dear team, the quarterly review is moved to Thursday at ten. Please bring the updated budget sheets, the "
    "hiring plan for the second half, and a short list of risks for each project you lead.",
)
INSTRUCTIONS = (
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{text}",
    "Rewrite the following text, keeping every sentence but changing nothing else:\n\n{text}",
    "Copy the following text, then continue it with one more paragraph in the same style:\n\n{text}",
)


@dataclass
class SpecBenchSpec:
    """The spec section: batch sizes, output length, and the speculative configs compared.

    Attributes:
        batches: requests submitted at once (and ``max_num_seqs``) per measurement.
        output_len: tokens generated per request (``ignore_eos``).
        num_draft_tokens: k of every speculative config.
        methods: names of the configs to run, from ``plain``, ``ngram``, ``ngram-confidence``,
            ``self-draft``, ``self-draft-confidence``, ``mtp``, ``mtp-confidence``, ``mtp-host-drafts``,
            ``mtp-drained`` (DeepSeek-V3 with ``num_nextn_predict_layers`` > 0), ``self-draft-drained``,
            ``self-draft-host-drafts``, ``draft``, ``draft-confidence``, ``draft-drained`` (a separate draft
            model, ``draft_model``): ``mtp``, ``self-draft`` and ``draft`` chain each verification step behind the one in
            flight where scheduling is pipelined (on CUDA), ``-drained`` drains the pipeline before each,
            ``-host-drafts`` drafts before each step from the tokens on the host instead of on the device at
            the end of the step before; ``plain`` is always run first (the speedups' base).
            ``ngram-chained`` looks the n-gram drafts up on the device behind each verification step and chains
            the steps (``speculative.ngram_on_device``); ``ngram`` drains before each.
            ``ngram-gate-plain`` is n-gram confidence with the gate held at plain decoding: what the
            confidence engine's plain steps cost against a plain engine's (the gate's ceiling where
            speculation loses).
        draft_model: the draft model of the ``draft*`` methods (a built-in shape name or a directory, as
            ``model.model``); it must share the target's tokenizer.
        num_kv_blocks: KV blocks of each engine (and of the draft's own cache).
        repeats: runs of every method per batch, interleaved (plain, the others, plain, ...); a row then
            reports the median run's throughput (``output_tok_s_runs``: all of them) and the speedup of
            medians. The H200 moved a method's throughput by up to 40% between single runs.
    """

    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    output_len: int = 128
    num_draft_tokens: int = 4
    methods: list[str] = field(default_factory=lambda: ["plain", "ngram", "ngram-confidence", "self-draft",
                                                        "self-draft-confidence"])
    draft_model: str | None = None
    num_kv_blocks: int = 8192
    repeats: int = 1


METHODS = {
    "plain": {},
    "ngram": {"method": "ngram"},
    "ngram-confidence": {"method": "ngram", "schedule": "confidence"},
    "ngram-chained": {"method": "ngram", "ngram_on_device": True},  # looked up on the device, steps chained
    "ngram-gate-plain": {"method": "ngram", "schedule": "confidence"},  # the gate held at plain (see below)
    "self-draft": {"method": "draft_model"},
    "self-draft-confidence": {"method": "draft_model", "schedule": "confidence"},
    "mtp": {"method": "mtp"},
    "mtp-confidence": {"method": "mtp", "schedule": "confidence"},
    "mtp-host-drafts": {"method": "mtp", "device_drafts": False},  # drafts made before each step, on the host
    "mtp-drained": {"method": "mtp"},  # device drafts, but each verification step drained (no chaining)
    "self-draft-drained": {"method": "draft_model"},  # likewise
    "self-draft-host-drafts": {"method": "draft_model", "device_drafts": False},
    "draft": {"method": "draft_model"},  # with spec.draft_model
    "draft-confidence": {"method": "draft_model", "schedule": "confidence"},
    "draft-drained": {"method": "draft_model"},
}
# engine settings of a method besides its speculative config
METHOD_ENGINE = {"mtp-drained": {"async_scheduling": False}, "self-draft-drained": {"async_scheduling": False},
                 "draft-drained": {"async_scheduling": False}}
DRAFT_METHODS = {"draft", "draft-confidence", "draft-drained"}  # the separate draft model's

GATE_HELD_PLAIN = {"ngram-gate-plain"}


def check_spec(spec: SpecBenchSpec) -> None:
    """Refuse a spec section that cannot run, before any model loads.

    Raises:
        ValueError: naming the setting, for an unknown method name, a ``draft*`` method without
            ``spec.draft_model``, or a size that is not a positive integer.
    """
    if not spec.batches or any(not isinstance(b, int) or b < 1 for b in spec.batches):
        raise ValueError(f"spec.batches must be a non-empty list of positive integers, got {spec.batches}")
    for name in ("output_len", "num_draft_tokens", "num_kv_blocks", "repeats"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"spec.{name} must be a positive integer, got {value!r}")
    bad = [m for m in spec.methods if m not in METHODS]
    if bad:
        raise ValueError(f"spec.methods has unknown entries {bad}; choose from {list(METHODS)}")
    needs_draft = sorted(DRAFT_METHODS.intersection(spec.methods))
    if spec.draft_model is None and needs_draft:
        raise ValueError(f"spec.methods {needs_draft} need a separate draft model: set spec.draft_model "
                         "(e.g. spec.draft_model=llama-3.2-1b)")


def spec_model_kwargs(spec: SpecBenchSpec, model_config, sections) -> dict | None:
    """The model's extra arguments for the spec section: ``enable_mtp`` when an MTP method is asked for.

    Raises:
        ValueError: an MTP method for a model without multi-token-prediction modules.
    """
    if "spec" not in sections or not any(METHODS.get(m, {}).get("method") == "mtp" for m in spec.methods):
        return None
    from rayinfer.engine.llm_engine import check_supports_mtp

    check_supports_mtp(model_config.model)
    return {"enable_mtp": True}


def spec_prompt(i: int) -> str:
    """The workload's ``i``-th user message (before any chat template): texts x instructions, cycled."""
    return INSTRUCTIONS[(i // len(TEXTS)) % len(INSTRUCTIONS)].format(text=TEXTS[i % len(TEXTS)])


def spec_workload(tokenizer, num_prompts: int, output_len: int) -> list[bl.WorkItem]:
    """``num_prompts`` chat prompts (the tokenizer's template) cycling over texts x instructions."""
    items = []
    for i in range(num_prompts):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": spec_prompt(i)}],
                                               add_generation_prompt=True, tokenize=False)
        items.append(bl.WorkItem(tokenizer.encode(prompt, add_special_tokens=False), output_len))
    return items


def run_spec_section(spec: SpecBenchSpec, model_config, engine_config, model, tokenizer,
                     line=print) -> list[dict[str, Any]]:
    """Run every (batch, method) of ``spec`` and return one row each (see the module docstring).

    Args:
        spec: the section's settings.
        model_config, engine_config: the bench's configs (``speculative``, ``max_num_seqs`` and
            ``num_kv_blocks`` are set per run).
        model, tokenizer: the loaded target (shared by every engine; the drafter of self-draft).
        line: prints one result line.
    Raises:
        ValueError: for an unknown method name, or a ``draft*`` method without ``spec.draft_model``.
    """
    import dataclasses

    from rayinfer.engine.config import SpeculativeConfig
    from rayinfer.engine.llm_engine import LLMEngine, resolve_device

    check_spec(spec)
    names = ["plain"] + [m for m in spec.methods if m != "plain"]
    rows = []
    for batch in spec.batches:
        items = spec_workload(tokenizer, batch, spec.output_len)
        runs: dict[str, list[tuple[dict, dict, list]]] = {name: [] for name in names}
        for rep in range(max(spec.repeats, 1)):
            for name in names:
                draft = dict(draft_model=spec.draft_model, draft_load_format=model_config.load_format) \
                    if name in DRAFT_METHODS else {}
                sc = SpeculativeConfig(**METHODS[name], **draft, num_draft_tokens=spec.num_draft_tokens) \
                    if METHODS[name] else SpeculativeConfig()
                cfg = dataclasses.replace(engine_config, max_num_seqs=batch, num_kv_blocks=spec.num_kv_blocks,
                                          speculative=sc, **METHOD_ENGINE.get(name, {}))
                if rep == 0 and resolve_device(cfg.device).type == "cuda":
                    # an untimed pass on a throwaway engine of each method (no prefix cache carried over): kernels
                    # for this batch's prefill and verification sizes compile there, not in the timed runs (a 0.8 s
                    # first TTFT at batch 32 once inflated every speedup of that batch; each call's first run of a
                    # speculative method at a batch measured up to 4x slower than its later runs)
                    warm = LLMEngine(model_config, cfg, model=model, tokenizer=tokenizer)
                    if name in GATE_HELD_PLAIN:
                        warm.gate.speculate = lambda batch_size: False
                    bl.run_offline(warm, items, request_prefix="spec-warm")
                    del warm
                    gc.collect()
                    bl.release_device_memory()
                engine = LLMEngine(model_config, cfg, model=model, tokenizer=tokenizer)
                if name in GATE_HELD_PLAIN:
                    engine.gate.speculate = lambda batch_size: False
                bl.warm_up(engine, cfg.block_size)
                run = bl.run_offline(engine, items, request_prefix=f"spec-{name}")
                runs[name].append((run.summary(), engine.stats(), [t.token_ids for t in run.timings]))
                del engine
                gc.collect()
                bl.release_device_memory()
        base_runs = [summary["output_tok_s"] for summary, _, _ in runs["plain"]]
        base = statistics.median(base_runs)
        base_outputs = runs["plain"][0][2]
        for name in names:
            rates = [summary["output_tok_s"] for summary, _, _ in runs[name]]
            # the run whose throughput is the median (the lower middle one for an even count)
            summary, stats, outputs = sorted(runs[name], key=lambda r: r[0]["output_tok_s"])[(len(rates) - 1) // 2]
            # greedy: speculation never changes the output, except where the verification's kernels round
            # a near tie differently from plain decode's (bf16 on the GPU without engine.batch_invariant)
            same = sum(a == b for a, b in zip(outputs, base_outputs)) / len(outputs)
            row = {"batch": batch, "method": name, **summary, "output_tok_s": statistics.median(rates),
                   "speedup": statistics.median(rates) / base,
                   **({"output_tok_s_runs": rates, "speedup_runs": [r / p for r, p in zip(rates, base_runs)]}
                      if len(rates) > 1 else {}),
                   "fraction_outputs_equal_plain": same,
                   **{k: v for k, v in stats.items() if k.startswith("spec_")}}
            rows.append(row)
            acc = f", accepted length {row['spec_mean_accepted_length']:.2f}" if "spec_mean_accepted_length" in row \
                else ""
            spread = f" (runs {min(row['speedup_runs']):.2f}-{max(row['speedup_runs']):.2f}x)" \
                if "speedup_runs" in row else ""
            line(f"  spec B={batch:<4} {name:<22} {row['output_tok_s']:10.1f} out tok/s  "
                 f"TPOT p50 {summary['median_tpot_ms'] or 0:.2f} ms  {row['speedup']:.2f}x{spread}{acc}, "
                 f"{same:.0%} of outputs equal plain's")
    return rows
