"""Batch-invariant mode (``engine.batch_invariant``): one greedy prompt run many times among random
companion requests (batches of varying size and length, prefix-cache hits, chunk sizes, preemption)
gives exactly one output, token ids and logprobs bit for bit.

On CPU the property is checked through the Triton interpreter (the kernels the GPU runs, with ``tl.dot``
written out row by row: see ROWWISE in ``kernels._triton_utils``) on one-layer random models:

- Llama: 6 trials colocated, then 3 through a PREFILL engine whose KV a DECODE engine imports (1P1D
  without Ray);
- Qwen3-MoE (router GEMM, softmax top-k, fused MoE): 4 trials colocated;
- DeepSeek-V3 (MLA with low-rank queries, attending in the absorbed form at every step; shared + routed
  experts, grouped sigmoid top-k): 4 trials colocated and 1 through 1P1D (MLA's compressed KV handle).

Every model's trials run over three engines (whole prompts; 5-token chunks, pipelined; 7-token chunks
with a pool that preempts), so they cover chunking, prefix hits (companions share the target's prefix,
and from the fourth trial an engine holds it from before) and preemption with recompute. With the mode
off the same trials give several outputs (3 of 3 for each MoE model when this was written). Expert-
parallel replicas are checked at the MoE layer in ``tests/model/test_moe_ep.py``.

The GPU test runs SmolLM2's shape and the tiny DeepSeek-V3 shape (MLA + MoE) in bfloat16 with CUDA
graphs and pipelined scheduling, 100 trials, and also reports how many distinct outputs the default mode
gave.

Speculative decoding under the mode is exact to the bit: n-gram engines (drained, chained, confidence-
scheduled) give plain decoding's tokens and logprobs bit for bit, through the interpreter on CPU; the GPU
test checks the same in bfloat16 (SmolLM2's shape with CUDA graphs).

Run as a script (``python tests/engine/test_batch_invariant.py``) it runs the GPU test through pytest;
with ``--interpret`` (and ``TRITON_INTERPRET=1``) the CPU check of the Llama, with ``--interpret --moe``
that of the MoE models (``--interpret --moe qwen3-moe`` or ``deepseek-v3``: one of them), with
``--interpret --spec`` the speculative check.
"""

from __future__ import annotations

import gc
import random
import sys

import pytest
import torch

from rayinfer.engine.types import SamplingParams
from rayinfer.kernels._triton_utils import HAS_TRITON


def run_trial(engine, target: list[int], rng: random.Random, tag: str, *, max_companions: int,
              max_len: int, max_new: int, vocab: int, companion_max_new: int = 16) -> tuple:
    """Run ``target`` (greedy, ``max_new`` tokens, top-2 logprobs) among a random set of companions.

    Companions: random prompts of 1..``max_len`` tokens (a third of them start with a piece of the target,
    so the cache holds prefixes of it), greedy or sampled, 1..``companion_max_new`` new tokens; some are
    queued before the target, some after it, some join after a few steps, and those still running when
    the target ends stay for the next trial (in mid-decode). Returns the target's output as a hashable
    tuple of (token id, logprob, top-2 logprobs) per token, and the number of companions.
    """

    def add_companion(j: int) -> None:
        n = rng.randint(1, max_len)
        if rng.random() < 1 / 3:
            cut = rng.randint(1, len(target))
            prompt = target[:cut] + [rng.randrange(vocab) for _ in range(max(0, n - cut))]
        else:
            prompt = [rng.randrange(vocab) for _ in range(n)]
        temperature = rng.choice([0.0, 0.0, 1.0])
        engine.add_request(f"{tag}-c{j}", prompt, SamplingParams(temperature=temperature, max_tokens=rng.randint(1, companion_max_new),
                                                                 ignore_eos=True, seed=j))

    num_before, num_late = rng.randint(0, max_companions), rng.randint(0, max_companions // 4)
    split = rng.randint(0, num_before)
    for j in range(split):
        add_companion(j)
    target_id = f"{tag}-target"
    engine.add_request(target_id, target, SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True,
                                                         logprobs=2))
    for j in range(split, num_before):
        add_companion(j)
    join_step = rng.randint(1, 4)
    out: list = []
    step, done = 0, False
    while not done:
        for o in engine.step():
            if o.request_id != target_id:
                continue
            assert o.error is None, o.error
            done = o.finished
            for t, lp in zip(o.new_token_ids, o.new_logprobs or []):
                assert lp.top_logprobs is not None
                out.append((t, lp.logprob, tuple(sorted(lp.top_logprobs.items()))))
        step += 1
        if step == join_step:
            for j in range(num_before, num_before + num_late):
                add_companion(j)
    assert len(out) == max_new
    return tuple(out), num_before + num_late


def distinct_outputs(engines, target, num_trials: int, seed: int, progress: bool = False,
                     **trial_kw) -> tuple[set, int, int]:
    """``num_trials`` trials spread round-robin over ``engines`` (each keeps its prefix cache between
    trials); returns the set of distinct target outputs, the companions run and the preemptions."""
    rng = random.Random(seed)
    outputs, companions = set(), 0
    for i in range(num_trials):
        engine = engines[i % len(engines)]
        out, n = run_trial(engine, target, rng, f"trial{i}", **trial_kw)
        outputs.add(out)
        companions += n
        if progress and (i + 1) % 10 == 0:
            print(f"trial {i + 1}/{num_trials}: {companions} companions, {len(outputs)} distinct", flush=True)
    preemptions = sum(e.scheduler.num_preemptions for e in engines)
    return outputs, companions, preemptions


# ---------------------------------------------------------------------------------------------------
# CPU: the Triton interpreter on a tiny model
# ---------------------------------------------------------------------------------------------------

# (max_num_batched_tokens, num_kv_blocks, async_scheduling): whole prompts; chunks of 5 and 7 tokens
# (pipelined); a pool of 12 blocks of 4 tokens, small enough that companions preempt one another.
CPU_ENGINES = [(512, 128, False), (5, 128, True), (7, 12, False)]


# One-layer variants of model.shapes' tiny MoE shapes with a 256-token vocab (the LM head dominates the
# interpreter's time otherwise): Qwen3-MoE (GQA, softmax top-2 of 8 experts), DeepSeek-V3 (MLA with
# low-rank queries, then shared + routed experts with grouped sigmoid top-2: its one layer is an MoE one).
_TINY_MOE = {
    "qwen3-moe": ("qwen3-moe-tiny", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32)),
    "deepseek-v3": ("deepseek-v3-tiny", dict(num_attention_heads=2, num_key_value_heads=2, first_k_dense_replace=0,
                                             num_nextn_predict_layers=0)),
}


def _tiny_model(kind: str = "llama"):
    """A one-layer random model of ``kind`` ("llama" or a key of ``_TINY_MOE``), weights spread (std 0.3)
    so that logits sit far from ties and any rounding difference shows in the logprobs."""
    import transformers

    from rayinfer.model.loader import load_tokenizer

    torch.manual_seed(0)
    if kind == "llama":
        from rayinfer.model.llama import LlamaForCausalLM

        model = LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.5))
    else:
        from rayinfer.model.registry import get_model_class
        from rayinfer.model.shapes import SHAPES

        shape, overrides = _TINY_MOE[kind]
        kwargs = {**SHAPES[shape], "vocab_size": 256, "num_hidden_layers": 1, "max_position_embeddings": 256,
                  **overrides}
        cfg = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
        model = get_model_class(kwargs["architectures"][0])(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval().requires_grad_(False), load_tokenizer("SmolLM2-135M-Instruct")


def _tiny_engines(batch_invariant: bool, kind: str = "llama"):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    model, tokenizer = _tiny_model(kind)
    return [LLMEngine(ModelConfig("tiny-llama", max_model_len=256),
                      EngineConfig(device="cpu", block_size=4, num_kv_blocks=blocks, max_num_seqs=6,
                                   max_num_batched_tokens=chunk, async_scheduling=async_, batch_invariant=batch_invariant),
                      model=model, tokenizer=tokenizer)
            for chunk, blocks, async_ in CPU_ENGINES]


def pd_trial(prefill, decode, target: list[int], rng: random.Random, tag: str, *, max_companions: int,
             max_len: int, max_new: int, vocab: int, companion_max_new: int = 6) -> tuple:
    """The target through 1P1D engines (no Ray: export from the PREFILL engine, import into the DECODE
    one, as the PD actors do), prefilled among random companions and decoded beside them; returns the
    target's output in :func:`run_trial`'s form."""
    import dataclasses

    target_id = f"{tag}-target"
    greedy = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=2)
    prompts, params = {}, {}
    for j in range(rng.randint(1, max_companions)):
        n = rng.randint(1, max_len)
        prompts[f"{tag}-c{j}"] = [rng.randrange(vocab) for _ in range(n)]
        params[f"{tag}-c{j}"] = SamplingParams(temperature=rng.choice([0.0, 1.0]), ignore_eos=True, seed=j,
                                               max_tokens=rng.randint(1, companion_max_new))
    order = list(prompts)
    order.insert(rng.randint(0, len(order)), target_id)
    prompts[target_id], params[target_id] = target, greedy
    for rid in order:
        prefill.add_request(rid, prompts[rid], params[rid])
    out: list = []
    pending = []
    while prefill.has_unfinished_requests():
        for o in prefill.step():
            assert o.error is None, o.error
            if o.request_id == target_id:
                for t, lp in zip(o.new_token_ids, o.new_logprobs or []):
                    out.append((t, lp.logprob, tuple(sorted((lp.top_logprobs or {}).items()))))
            if o.finish_reason == "prefilled":
                pending.append((o.request_id, o.kv_handle, list(o.new_token_ids)))
    rng.shuffle(pending)  # the decode side admits them in another order
    for rid, handle, first in pending:
        payload = prefill.take_kv(rid)
        decode.add_request(rid, prompts[rid], params[rid], kv_handle=dataclasses.replace(handle, payload=payload),
                           output_token_ids=first)
    while decode.has_unfinished_requests():
        for o in decode.step():
            assert o.error is None and o.finish_reason != "preempted", o
            if o.request_id == target_id:
                for t, lp in zip(o.new_token_ids, o.new_logprobs or []):
                    out.append((t, lp.logprob, tuple(sorted((lp.top_logprobs or {}).items()))))
    assert len(out) == max_new
    return tuple(out)


def _pd_engines(batch_invariant: bool, kind: str = "llama"):
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    model, tokenizer = _tiny_model(kind)
    base = dict(device="cpu", block_size=4, num_kv_blocks=128, max_num_seqs=6, batch_invariant=batch_invariant)
    return (LLMEngine(ModelConfig("tiny-llama", max_model_len=256),
                      EngineConfig(role="prefill", max_num_batched_tokens=6, **base), model=model, tokenizer=tokenizer),
            LLMEngine(ModelConfig("tiny-llama", max_model_len=256),
                      EngineConfig(role="decode", **base), model=model, tokenizer=tokenizer))


def _interpreter_check(kind: str = "llama", num_trials: int = 6, num_pd_trials: int = 3) -> None:
    """``num_trials`` colocated trials over :data:`CPU_ENGINES` (round-robin: from the fourth on, an engine
    meets the target's prefix in its cache), then ``num_pd_trials`` 1P1D ones: one output in all."""
    target = [17, 3, 99, 250, 4, 4, 61, 8, 120, 33, 7, 201, 5, 90]
    kw = dict(max_companions=4, max_len=20, max_new=3, vocab=256, companion_max_new=6)
    on, companions, preemptions = distinct_outputs(_tiny_engines(True, kind), target, num_trials, seed=1, **kw)
    print(f"interpreter, {kind}, {num_trials} trials, {companions} companions, {preemptions} preemptions: "
          f"batch_invariant=on {len(on)} distinct output(s)")
    assert preemptions > 0, "the small pool never preempted: the scenario lost its preemption case"
    assert len(on) == 1, f"{kind}: batch-invariant mode gave {len(on)} distinct outputs: {sorted(on)}"
    if not num_pd_trials:
        return
    # 1P1D: prefilled in 6-token chunks among companions, its KV moved to a DECODE engine, decoded there
    prefill, decode = _pd_engines(True, kind)
    rng = random.Random(2)
    pd = {pd_trial(prefill, decode, target, rng, f"pd{i}", **kw) for i in range(num_pd_trials)}
    print(f"interpreter, {kind}, 1P1D, {num_pd_trials} trials: {len(pd)} distinct output(s), equal to colocated: "
          f"{pd == on}")
    assert pd == on, f"{kind}: 1P1D gave {sorted(pd)}, colocated {sorted(on)}"


# speculative decoding under the mode: prompts that repeat themselves, so n-gram drafts are found and accepted
SPEC_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 1, 2, 3, 1, 2],
                [40, 41, 42, 43, 44, 45, 40, 41, 42, 43, 44, 45, 40]]
# (name, speculative config, engine config): drained fixed-k steps; chained steps (the device n-gram lookup,
# the graphs' static buffers on CPU); the confidence schedule pipelining its plain steps
SPEC_ENGINES = [("ngram", dict(method="ngram", num_draft_tokens=3), {}),
                ("ngram-chained", dict(method="ngram", num_draft_tokens=3, ngram_on_device=True),
                 dict(async_scheduling=True, debug_eager_graphs=True)),
                ("ngram-confidence", dict(method="ngram", num_draft_tokens=3, schedule="confidence"),
                 dict(async_scheduling=True))]


def _spec_outputs(engine, prompts: list[list[int]] = SPEC_PROMPTS, max_tokens: int = 24) -> list[tuple]:
    """Greedy outputs of ``prompts``: per prompt, each token's id, logprob and top-2 logprobs (their reprs, exact)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return [tuple(zip(c.output_token_ids, [repr(lp) for lp in c.logprobs or []]))
            for c in engine.generate(prompts, params)]


def _interpreter_spec_check() -> None:
    """Speculative decoding in batch-invariant mode: a verification step computes each row as a decode step
    would, so the tokens and logprobs equal plain decoding's bit for bit (drained, chained and confidence-
    scheduled n-gram engines). With the mode off the same comparison finds the logprobs' rounding differ
    (the check is sensitive to one ulp)."""
    from rayinfer.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
    from rayinfer.engine.llm_engine import LLMEngine

    model, tokenizer = _tiny_model()

    def engine(batch_invariant: bool, spec: dict | None = None, **kw):
        return LLMEngine(ModelConfig("tiny-llama", max_model_len=256),
                         EngineConfig(device="cpu", block_size=4, num_kv_blocks=128, max_num_seqs=6,
                                      batch_invariant=batch_invariant, speculative=SpeculativeConfig(**(spec or {})),
                                      **kw), model=model, tokenizer=tokenizer)

    for mode in (True, False):
        plain = _spec_outputs(engine(mode))
        for name, spec, kw in SPEC_ENGINES[: 3 if mode else 1]:
            spec_engine = engine(mode, spec, **kw)
            got = _spec_outputs(spec_engine)
            stats = spec_engine.stats()
            tokens = [[t for t, _ in o] for o in got] == [[t for t, _ in o] for o in plain]
            print(f"interpreter, speculative {name}, batch_invariant={mode}: tokens equal {tokens}, "
                  f"logprobs equal {got == plain}, {stats['spec_num_drafts_accepted']} of "
                  f"{stats['spec_num_drafts_verified']} drafts accepted, {stats['spec_chained_steps']} steps chained")
            assert tokens, f"{name}: greedy tokens differ from plain decoding's"
            assert stats["spec_num_drafts_accepted"] > 0, f"{name}: no draft accepted: nothing was verified"
            if name == "ngram-chained":
                assert stats["spec_chained_steps"] > 0, "no verification step chained"
            if mode:
                assert got == plain, f"{name}: batch-invariant speculative logprobs differ from plain decoding's"
            else:
                assert got != plain, "with the mode off the logprobs matched plain's bit for bit: the check is blind"
    print("speculative checks passed: bit for bit with the mode on; with it off the logprobs differ, as they must "
          "(the check can see one ulp)")


# the interpreter checks of this module, each one child process of the session's interpreter server
# (tests/conftest.py): ``python __file__ --interpret *args`` with TRITON_INTERPRET=1
INTERPRETED = {"llama": [], "qwen3-moe": ["--moe", "qwen3-moe"], "deepseek-v3": ["--moe", "deepseek-v3"],
               "speculative": ["--spec"]}


@pytest.fixture(scope="module")
def interpreted(interpreter) -> dict[str, dict]:
    """Every check of :data:`INTERPRETED`, run when the first test asks, two at a time (both CPUs):
    name -> the server's answer, which the tests assert on."""
    results = interpreter.results([[__file__, *args] for args in INTERPRETED.values()], timeout_s=300, parallel=2)
    return dict(zip(INTERPRETED, results))


def _assert_passed(interpreter, result: dict) -> None:
    returncode, output = interpreter.check(result)
    assert returncode == 0, output
    print(output)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_one_output_among_companions_through_triton_interpreter(interpreter, interpreted):
    _assert_passed(interpreter, interpreted["llama"])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_moe_and_mla_one_output_through_triton_interpreter(interpreter, interpreted):
    """Tiny Qwen3-MoE (router GEMM, softmax top-k, fused MoE) and DeepSeek-V3 (MLA's low-rank projections
    and absorbed attention for every step, shared + routed experts, grouped top-k), one child process
    each."""
    for model in ("qwen3-moe", "deepseek-v3"):
        _assert_passed(interpreter, interpreted[model])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_speculative_decoding_keeps_plain_bits_through_triton_interpreter(interpreter, interpreted):
    """Batch-invariant mode makes speculative decoding exact to the bit: n-gram engines (drained, chained
    behind the step in flight, confidence-scheduled) give plain decoding's tokens and logprobs bit for bit
    on a one-layer random Llama, while with the mode off their logprobs differ in rounding."""
    _assert_passed(interpreter, interpreted["speculative"])


def test_config_and_mode_switch():
    """The engine flag reaches the runner; the mode is scoped to the block that enters it."""
    from rayinfer.engine.config import EngineConfig
    from rayinfer.kernels.batch_invariant import batch_invariant_mode, is_batch_invariant

    assert EngineConfig().batch_invariant is False
    assert not is_batch_invariant()
    with batch_invariant_mode():
        assert is_batch_invariant()
        with batch_invariant_mode(False):
            assert not is_batch_invariant()
        assert is_batch_invariant()
    assert not is_batch_invariant()


def test_runner_carries_the_mode(tiny_engine):
    assert tiny_engine(batch_invariant=True).runner.batch_invariant is True
    assert tiny_engine().runner.batch_invariant is False


# ---------------------------------------------------------------------------------------------------
# GPU: the SmolLM2 shape and the tiny DeepSeek-V3 shape (MLA + MoE) in bfloat16 (dummy weights), CUDA
# graphs and pipelined scheduling on
# ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", ["SmolLM2-135M-Instruct", "deepseek-v3-tiny"])
def test_one_output_in_100_trials_on_gpu(model):
    """100 trials of one prompt among 0..255 companions of 1..256 tokens, over engines with whole
    prompts, 512- and 128-token chunks, and a small pool that preempts: one distinct output with the mode
    on; the count with the mode off is printed (the nondeterminism the mode removes). ``deepseek-v3-tiny``
    (``model.shapes``: MLA, a dense layer, then shared + routed experts with grouped top-k) takes the
    MoE and MLA paths."""
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.engine.llm_engine import LLMEngine

    def engines(batch_invariant: bool):
        made = []
        # explicit pools (20000 blocks: 7 GiB of SmolLM2 KV each): three engines share the GPU
        for chunk, blocks in ((None, 20000), (512, 20000), (128, 48)):
            # the model's shape and tokenizer with seeded random weights (the GPU machine has no real ones;
            # random weights make near ties common, which is what exposes batch-dependent rounding)
            made.append(LLMEngine(ModelConfig(model, dtype="bfloat16", max_model_len=2048, load_format="dummy"),
                                  EngineConfig(device="cuda", max_num_batched_tokens=chunk, num_kv_blocks=blocks,
                                               batch_invariant=batch_invariant)))
            assert made[-1].runner.graphs is not None and made[-1].async_scheduling
        return made

    on_engines = engines(True)
    tok = on_engines[0].tokenizer
    target = tok.encode("Explain, step by step, why the sky is blue and sunsets are red. " * 6)
    kw = dict(max_companions=255, max_len=256, max_new=32, vocab=on_engines[0].vocab_size)
    on, companions, preemptions = distinct_outputs(on_engines, target, 100, seed=0, progress=True, **kw)
    del on_engines
    gc.collect()
    torch.cuda.empty_cache()
    # the mode off: the first 30 of the same trials (enough to show the spread the mode removes)
    off, _, off_preemptions = distinct_outputs(engines(False), target, 30, seed=0, progress=True, **kw)
    print(f"\nGPU, {model}, 100 trials (30 with the mode off), {companions} companions, "
          f"{preemptions}/{off_preemptions} preemptions: "
          f"batch_invariant=on {len(on)} distinct output(s), off {len(off)}")
    assert len(on) == 1, f"batch-invariant mode gave {len(on)} distinct outputs"
    assert preemptions > 0, "the small pool never preempted: the scenario lost its preemption case"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_speculative_decoding_keeps_plain_bits_on_gpu():
    """SmolLM2's shape in bfloat16 (dummy weights, whose text soon repeats, so n-gram drafts are accepted), CUDA
    graphs: with the mode on, drained, chained and confidence-scheduled n-gram engines give the plain engine's
    greedy tokens and logprobs bit for bit (the verification step's k + 1 rows take the same kernels and
    tiles as a decode step's one). With the mode off, how many outputs differ is printed: the one-row GEMV of
    plain decode and cuBLAS's verification GEMMs round differently."""
    from rayinfer.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
    from rayinfer.engine.llm_engine import LLMEngine

    prompts = [[(7 * i + j) % 4000 + 3 for j in range(8 + 5 * i)] for i in range(8)]

    def outputs(batch_invariant: bool, spec: dict | None = None, **kw):
        engine = LLMEngine(ModelConfig("SmolLM2-135M-Instruct", dtype="bfloat16", load_format="dummy"),
                           EngineConfig(device="cuda", num_kv_blocks=1024, batch_invariant=batch_invariant,
                                        speculative=SpeculativeConfig(**(spec or {})), **kw))
        return _spec_outputs(engine, prompts, max_tokens=64), engine.stats()

    for mode in (True, False):
        plain, _ = outputs(mode)
        for name, spec, kw in SPEC_ENGINES:
            got, stats = outputs(mode, spec, **{k: v for k, v in kw.items() if k != "debug_eager_graphs"})
            same = sum(a == b for a, b in zip(got, plain))
            print(f"GPU, speculative {name}, batch_invariant={mode}: {same} of {len(plain)} outputs equal plain's "
                  f"bit for bit, {stats['spec_num_drafts_accepted']} drafts accepted, "
                  f"{stats['spec_chained_steps']} steps chained")
            assert stats["spec_num_drafts_accepted"] > 0
            if mode:
                assert got == plain, f"{name}: batch-invariant speculative output differs from plain decoding's"


if __name__ == "__main__":
    if "--interpret" in sys.argv and "--moe" in sys.argv:  # both MoE models, or the one named after --moe
        if "deepseek-v3" not in sys.argv:
            _interpreter_check("qwen3-moe", num_trials=3, num_pd_trials=0)
        if "qwen3-moe" not in sys.argv:
            _interpreter_check("deepseek-v3", num_trials=4, num_pd_trials=1)
    elif "--interpret" in sys.argv and "--spec" in sys.argv:
        _interpreter_spec_check()
    elif "--interpret" in sys.argv:
        _interpreter_check()
    else:
        sys.exit(pytest.main([__file__, "-m", "gpu", "-q", "-s", *sys.argv[1:]]))
