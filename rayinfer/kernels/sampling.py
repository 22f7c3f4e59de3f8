"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, with per-request seeds.

Randomness is counter based: the uniform of token ``i`` in a request's step is a hash of
``(seed, step, i)``, so a request draws the same token whatever batch it sits in and whichever
implementation runs. A token is drawn by an exponential race (Gumbel-max): the winner is
``argmax_i (logits_i / T - log(-log u_i))`` over the allowed tokens, which samples ``softmax(logits / T)``
restricted to them exactly. The reference and the kernel compute the same uniforms (an integer hash),
the same top-k/top-p thresholds (one shared torch function), and the temperature, min-p floor and race
with the same float operations (correctly rounded ``libdevice`` logs, no FMA contraction), so on CUDA
they agree token for token (checked on an H200). On CPU the reference is the implementation.

Filter order and semantics (after Hugging Face's warpers: temperature, top-k, top-p, min-p), all in the
temperature-scaled logit domain ``s = logits * (1 / T)``:
    * top-k: keep tokens with ``s >= `` the k-th largest ``s`` (ties at the boundary are kept);
      ``k <= 0`` or ``k >= V`` is off.
    * top-p: over the top-k survivors renormalized, sorted by ``s`` descending, keep the shortest
      prefix whose mass reaches ``p`` (position j is kept iff the mass before it is ``< p``), then every
      token whose ``s`` is ``>=`` the last kept one; ``p >= 1`` is off.
    * min-p: keep tokens with ``s >= max(s) + log(min_p)``, i.e. probability ``>= min_p * p_max``
      (renormalization does not change the ratio, so its place in the order does not matter);
      ``min_p <= 0`` is off.
    * temperature ``<= 0``: greedy, the first index of the largest logit; filters are ignored.
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import device_sms, libdevice, tl, triton, use_libdevice, use_triton

_M32 = 0xFFFFFFFF
_MIX_C1 = 0x7FEB352D  # multipliers of Wellons' "lowbias32" integer hash
_MIX_C2 = 0x846CA68B


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 x in [0, 2**32), without overflowing int64."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons, "Hash function prospector") on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_C2)
    return x ^ (x >> 16)


def request_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit keys of ``(seed, step)``.

    Args:
        seeds, steps: [B] int64 (any values; both 64-bit halves count).
    Returns:
        [B] int64 in [0, 2**32).
    """
    seeds, steps = seeds.long(), steps.long()
    k = _mix32(seeds & _M32)
    k = _mix32(k ^ ((seeds >> 32) & _M32))
    k = _mix32(k ^ (steps & _M32))
    return _mix32(k ^ ((steps >> 32) & _M32))


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The uniforms of the race: ``u[b, i] = ((hash(hash(i) ^ key_b) >> 9) + 0.5) / 2**23``.

    23 bits, so that ``+ 0.5`` is exact in float32 and ``u`` is never 0 or 1.

    Args:
        keys: [B] int64 from :func:`request_keys`.
    Returns:
        [B, vocab_size] float32 in (0, 1), never 0 or 1.
    """
    idx = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    h = _mix32(_mix32(idx)[None, :] ^ keys[:, None])
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def sampling_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_top_k_top_p: bool = True,
    use_min_p: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse temperatures and the per-row scaled-logit threshold of the top-k/top-p/min-p filters.

    Pure torch without host syncs; shared by :func:`sample_ref` and :func:`sample` so that both allow
    exactly the same tokens. Top-k/top-p sort each row (the costly part); ``use_top_k_top_p=False``
    skips them for every row (and ``use_min_p=False`` min-p), for callers that know from the host-side
    sampling parameters that no row asks for them.

    Args:
        logits: [B, V] float32.
        temperature, top_p, min_p: [B] float32; top_k: [B] int32 or int64.
    Returns:
        (inv_temperature [B] float32, 1 for greedy rows; threshold [B] float32: token i of row b is
        allowed iff ``logits[b, i] * inv_temperature[b] >= threshold[b]``).
    """
    batch, vocab = logits.shape
    inv_temp = torch.where(temperature > 0, 1.0 / temperature.clamp(min=1e-30), 1.0).float()
    threshold = torch.full((batch,), float("-inf"), dtype=torch.float32, device=logits.device)
    if not (use_top_k_top_p or use_min_p) or batch == 0:
        return inv_temp, threshold
    scaled = logits * inv_temp[:, None]
    if use_top_k_top_p:
        ranked = scaled.sort(dim=-1, descending=True).values
        k = top_k.long()
        k = torch.where((k > 0) & (k < vocab), k, vocab)
        in_top_k = torch.arange(vocab, device=logits.device)[None, :] < k[:, None]
        probs = torch.softmax(ranked.masked_fill(~in_top_k, float("-inf")), dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        p = top_p.float()[:, None]
        keep = in_top_k & ((mass_before < p) | (p >= 1.0))
        num_keep = keep.sum(dim=-1).clamp(min=1)
        threshold = ranked.gather(1, (num_keep - 1)[:, None]).squeeze(1)
    if use_min_p:
        min_p = min_p.float()
        floor = scaled.amax(dim=-1) + torch.log(min_p.clamp(min=1e-30))
        threshold = torch.maximum(threshold, torch.where(min_p > 0, floor, float("-inf")))
    return inv_temp, threshold


def allowed_token_mask(logits, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """[B, V] bool: the tokens a sampled (non-greedy) row may draw after its filters."""
    inv_temp, threshold = sampling_thresholds(logits, temperature, top_k, top_p, min_p)
    return logits * inv_temp[:, None] >= threshold[:, None]


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    use_top_k_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """Draw one token per row (plain torch; the module docstring defines the filters).

    Args:
        logits: [B, V] float32.
        temperature: [B] float32, ``<= 0`` greedy. top_k: [B] int32, ``0`` or ``>= V`` off.
        top_p: [B] float32, ``1`` off. min_p: [B] float32, ``0`` off.
        seeds: [B] int64 per-request seeds; steps: [B] int64 per-request counters (e.g. the number of
            tokens generated so far), so each step draws fresh uniforms.
        use_top_k_top_p, use_min_p: False skips that filter for every row (see
            :func:`sampling_thresholds`).
    Returns:
        [B] int64 token ids.
    """
    logits = logits.float()
    inv_temp, threshold = sampling_thresholds(logits, temperature, top_k, top_p, min_p, use_top_k_top_p, use_min_p)
    scaled = logits * inv_temp[:, None]
    u = uniform_noise(request_keys(seeds, steps), logits.shape[1])
    race = torch.where(scaled >= threshold[:, None], scaled - torch.log(-torch.log(u)), float("-inf"))
    return torch.where(temperature <= 0, logits.argmax(dim=-1), race.argmax(dim=-1))


@triton.jit
def _mix32_u32(x):  # _mix32 on uint32 (wrapping multiplies); constants as _MIX_C1, _MIX_C2
    x = x ^ (x >> 16)
    x = x * tl.full([], 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _race_kernel(
    logits_ptr, stride_row, temp_ptr, min_p_ptr, row_max_ptr, threshold_ptr, seed_ptr, step_ptr,
    part_val_ptr, part_idx_ptr, vocab, chunk_len, num_chunks,
    BLOCK: tl.constexpr, HAS_THRESHOLD: tl.constexpr, USE_MIN_P: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
):
    """One (row, vocabulary chunk): the chunk's race winner. Repeats, per row, the scalar steps of
    :func:`sampling_thresholds` (inverse temperature, min-p floor) and :func:`request_keys` with the
    same float operations, so the result is bit-identical to the torch reference on CUDA."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    greedy = temp <= 0.0
    if USE_LIBDEVICE:
        inv_temp = tl.where(greedy, 1.0, libdevice.div_rn(1.0, tl.maximum(temp, 1e-30)))
    else:
        inv_temp = tl.where(greedy, 1.0, 1.0 / tl.maximum(temp, 1e-30))
    threshold = tl.full([], float("-inf"), tl.float32)
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    if USE_MIN_P:
        min_p = tl.load(min_p_ptr + row)
        if USE_LIBDEVICE:
            log_min_p = libdevice.log(tl.maximum(min_p, 1e-30))
        else:
            log_min_p = tl.log(tl.maximum(min_p, 1e-30))
        # max(x * c) == max(x) * c for c > 0: float rounding is monotone.
        floor = tl.load(row_max_ptr + row) * inv_temp + log_min_p
        threshold = tl.where(min_p > 0.0, tl.maximum(threshold, floor), threshold)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    key = _mix32_u32(seed.to(tl.uint32))
    key = _mix32_u32(key ^ (seed >> 32).to(tl.uint32))
    key = _mix32_u32(key ^ step.to(tl.uint32))
    key = _mix32_u32(key ^ (step >> 32).to(tl.uint32))
    lo = chunk * chunk_len
    hi = tl.minimum(lo + chunk_len, vocab)
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = lo
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        x = tl.load(row_ptr + offs, mask=ok, other=float("-inf"))
        scaled = x * inv_temp
        allowed = ok & (scaled >= threshold)
        if greedy:
            val = tl.where(ok, x, float("-inf"))
        elif tl.max(allowed.to(tl.int32), 0) > 0:  # filtered rows skip the noise of blocks with no candidate
            h = _mix32_u32(_mix32_u32(offs.to(tl.uint32)) ^ key)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            if USE_LIBDEVICE:  # the same correctly rounded logf as torch on CUDA: token-exact agreement
                gumbel = libdevice.log(-libdevice.log(u))
            else:
                gumbel = tl.log(-tl.log(u))
            val = tl.where(allowed, scaled - gumbel, float("-inf"))
        else:
            val = tl.full([BLOCK], float("-inf"), tl.float32)
        m = tl.max(val, 0)
        i = tl.argmax(val, 0)
        better = m > best_val  # strict: the earliest index wins ties, as torch.argmax
        best_idx = tl.where(better, start + i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(part_val_ptr + row * num_chunks + chunk, best_val)
    tl.store(part_idx_ptr + row * num_chunks + chunk, best_idx)


_RACE_BLOCK = 2048


def sample_triton(
    logits, temperature, top_k, top_p, min_p, seeds, steps, use_top_k_top_p=True, use_min_p=True
) -> torch.Tensor:
    """Triton version of :func:`sample_ref` (same arguments and result, no host sync).

    Top-k/top-p thresholds come from :func:`sampling_thresholds` (torch, a sort); everything else
    (temperature, min-p, the per-request keys, the race) runs in one kernel over vocabulary chunks, and
    a torch argmax over the chunk winners picks the token.
    """
    logits = logits.float()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    if batch == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    temperature = temperature.float().contiguous()
    threshold = row_max = None
    if use_top_k_top_p:
        _, threshold = sampling_thresholds(logits, temperature, top_k, top_p, min_p, True, False)
    if use_min_p:
        row_max = logits.amax(dim=-1)
    max_chunks = triton.cdiv(vocab, 2 * _RACE_BLOCK)
    num_chunks = max(1, min(max_chunks, triton.cdiv(4 * device_sms(logits), batch)))
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), _RACE_BLOCK) * _RACE_BLOCK
    num_chunks = triton.cdiv(vocab, chunk_len)
    part_val = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((batch, num_chunks), dtype=torch.int32, device=logits.device)
    _race_kernel[(batch, num_chunks)](
        logits, logits.stride(0), temperature,
        min_p.float().contiguous() if use_min_p else temperature,
        row_max if use_min_p else temperature,
        threshold if use_top_k_top_p else temperature,
        seeds.long().contiguous(), steps.long().contiguous(),
        part_val, part_idx, vocab, chunk_len, num_chunks,
        BLOCK=_RACE_BLOCK, HAS_THRESHOLD=use_top_k_top_p, USE_MIN_P=use_min_p, USE_LIBDEVICE=use_libdevice(),
        num_warps=8,
        enable_fp_fusion=False,  # keep ``x * inv_temp - gumbel`` two roundings, as torch computes it
    )
    best_chunk = part_val.argmax(dim=1, keepdim=True)
    return part_idx.gather(1, best_chunk).squeeze(1).long()


def sample(
    logits, temperature, top_k, top_p, min_p, seeds, steps, use_top_k_top_p=True, use_min_p=True
) -> torch.Tensor:
    """Same contract as :func:`sample_ref`; the Triton race on CUDA tensors (no host sync)."""
    if logits.dim() == 2 and use_triton(logits, temperature, seeds):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds, steps, use_top_k_top_p, use_min_p)
    return sample_ref(logits, temperature, top_k, top_p, min_p, seeds, steps, use_top_k_top_p, use_min_p)
