"""Hugging Face transformers on our weights, the baseline of jobs/bench.py: the HF twin of a loaded model
(:func:`hf_twin`, sharing its tensors) and the offline workload's throughput through HF ``generate``
(:func:`hf_generate_throughput`; :func:`hf_generate_or_oom` at a batch size that may not fit the device).

Plain functions (no Hydra, no Ray); tests drive them on CPU with tiny shapes. Re-exported by
:mod:`rayinfer.jobs.benchlib`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from rayinfer.jobs.benchlib import WorkItem

# architecture -> builder of the HF twin, for models whose weights need more than hf_twin's default mapping
HF_TWIN_BUILDERS: dict[str, Any] = {}


def hf_twin(model) -> torch.nn.Module:
    """A Hugging Face ``AutoModelForCausalLM`` of ``model.config`` that shares ``model``'s weight tensors.

    An architecture in :data:`HF_TWIN_BUILDERS` is built by its own builder (``builder(model) -> HF model``).

    Built on the meta device, then given our tensors (no copy, no extra memory): same-named ones as they
    are, the HF projections that our model fuses (its ``_STACKED`` map, e.g. q/k/v -> qkv_proj) as
    row slices of the fused weight, and what a model fuses after loading under its HF names from its
    ``hf_state_dict()`` (DeepSeek-V3: the stacked query/latent projection as row views, fused shared
    experts as views of the routed ones and small copies of the shared ones). Buffers that are in no
    state dict (RoPE tables) are rebuilt on the model's device.

    Raises:
        ValueError: if our tensors do not cover the HF model's (another architecture needs its own mapping).
    """
    import copy

    import transformers

    arch = (getattr(model.config, "architectures", None) or [None])[0]
    if arch in HF_TWIN_BUILDERS:
        return HF_TWIN_BUILDERS[arch](model)
    param = next(model.parameters())
    config = copy.deepcopy(model.config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    ours = model.hf_state_dict() if hasattr(model, "hf_state_dict") else model.state_dict()
    wanted = hf.state_dict()
    stacked = getattr(model, "_STACKED", {})  # checkpoint projection -> (fused projection, shard index)
    tensors = {}
    for name, meta in wanted.items():
        parts = name.split(".")
        if name in ours:
            tensors[name] = ours[name]
        elif len(parts) >= 2 and parts[-2] in stacked:
            fused, shard = stacked[parts[-2]]
            before = [p for p, (f, s) in stacked.items() if f == fused and s < shard]
            offset = sum(wanted[".".join(parts[:-2] + [p, parts[-1]])].shape[0] for p in before)
            source = ours.get(".".join(parts[:-2] + [fused, parts[-1]]))
            if source is not None:
                tensors[name] = source.narrow(0, offset, meta.shape[0])
    missing, _ = hf.load_state_dict(tensors, strict=False, assign=True)
    if missing:
        raise ValueError(f"the HF model needs weights ours lacks: {missing[:8]} ({len(missing)})")
    for module in hf.modules():
        stale = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if stale:
            fresh = type(module)(config=module.config)
            for k in stale:
                module._buffers[k] = fresh._buffers[k].to(param.device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"HF twin has tensors left on the meta device: {left[:8]}")
    return hf.eval()


@torch.inference_mode()
def hf_generate_throughput(hf, items: list[WorkItem], batch_size: int) -> dict[str, Any]:
    """Run ``items`` through ``hf.generate`` (greedy, exactly ``max_tokens`` new tokens each) and time it.

    Items are sorted by prompt length and batched ``batch_size`` at a time, left-padded; a batch generates
    its longest ``max_tokens`` (min_new_tokens = max_new_tokens, so EOS never stops it early) and only each
    item's own ``max_tokens`` count as output.

    Returns:
        ``output_tok_s`` (useful output tokens / wall seconds), ``elapsed_s``, token counts, batch size.
    Raises:
        torch.OutOfMemoryError (or another error of the device) as ``generate`` raises it.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    device = next(hf.parameters()).device
    order = sorted(items, key=lambda it: -len(it.prompt_token_ids))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def generate(prompts: list[list[int]], new: int):
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, width - len(prompt):] = torch.tensor(prompt)
            mask[r, width - len(prompt):] = 1
        out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                          min_new_tokens=new, do_sample=False, pad_token_id=0)
        return out.shape[1] - width

    generate([it.prompt_token_ids[:16] for it in batches[0][:2]], 2)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    generated = 0
    for batch in batches:
        generated += generate([it.prompt_token_ids for it in batch], max(it.max_tokens for it in batch)) * len(batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    useful = sum(it.max_tokens for it in items)
    return {"num_requests": len(items), "batch_size": batch_size, "num_prompt_tokens":
            sum(len(it.prompt_token_ids) for it in items), "num_output_tokens": useful,
            "num_generated_tokens": generated, "elapsed_s": elapsed, "output_tok_s": useful / elapsed}


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is a device allocation failure: torch's ``OutOfMemoryError``, or a RuntimeError
    whose message says "out of memory" (cuBLAS workspaces, Triton, CUDA's own launch errors)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def hf_generate_or_oom(hf, items: list[WorkItem], batch_size: int) -> dict[str, Any] | str:
    """:func:`hf_generate_throughput`, or ``"oom"`` when the device runs out of memory at this batch size.

    After an OOM the memory the attempt held (its KV cache, activations) is returned to the driver
    (``benchlib.release_device_memory``) before returning, so a smaller batch size can run next.

    Raises:
        any other error of ``generate``.
    """
    from rayinfer.jobs.benchlib import release_device_memory

    try:
        return hf_generate_throughput(hf, items, batch_size)
    except Exception as e:
        if not is_out_of_memory(e):
            raise
    # outside the except block: the traceback, and the frames holding the attempt's tensors, are gone
    release_device_memory()
    return "oom"
