"""MoE routers: each token's top-k experts and routing weights from its router logits.

Two routers, each as a plain-torch reference (the CPU path) and a Triton kernel with one program per
token row (one launch per layer instead of a dozen small torch kernels, which dominate a decode step):

- :func:`softmax_topk`: softmax top-k (Qwen3-MoE, Mixtral), optionally renormalized;
- :func:`grouped_topk`: DeepSeek-V3's sigmoid scores, bias-corrected choice within the best expert
  groups, normalization and ``routed_scaling_factor``.

Glossary: T tokens, L (logical) experts, k experts per token, G expert groups.

The kernels return the k experts by descending score (ties: the lower expert id first) and add a
token's k weights in slot order, the batch-invariant contract of the references (see
``kernels.batch_invariant``); outside that mode the references' ``topk(sorted=False)`` and
``sum`` may order differently (same set of experts, weights equal up to rounding).
"""

from __future__ import annotations

import torch

from rayinfer.kernels._triton_utils import pdl_launch, pdl_wait, tl, triton, use_pdl, use_triton
from rayinfer.kernels.batch_invariant import is_batch_invariant
from rayinfer.kernels.matmul import dense_linear

_MAX_EXPERTS = 4096  # one program holds a row of router logits in registers


def _sum_k(weights: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T, 1], the sum of each token's k routing weights; in slot order in batch-invariant mode."""
    if is_batch_invariant():
        total = weights[:, 0].clone()
        for slot in range(1, weights.shape[1]):
            total += weights[:, slot]
        return total[:, None]
    return weights.sum(dim=-1, keepdim=True)


def _check_topk(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, L], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k={top_k} must be in [1, {router_logits.shape[1]}] (the number of experts)")


def softmax_topk_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in plain torch (Qwen3-MoE, Mixtral).

    Args:
        router_logits: [T, L], the hidden states' dtype.
        top_k: experts per token.
        renormalize: divide the k probabilities by their sum (``norm_topk_prob``).
    Returns:
        (topk_weights [T, k] in router_logits' dtype, topk_ids [T, k] int64), by descending probability.
    Source: Hugging Face ``Qwen3MoeTopKRouter``.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / _sum_k(weights)
    return weights.to(router_logits.dtype), ids


def grouped_topk_ref(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing in plain torch: sigmoid scores, bias-corrected choice within the best groups.

    Steps: 1. scores = sigmoid(logits); choice = scores + bias. 2. A group's score is the sum of its
    two best choices; keep the ``topk_groups`` best groups. 3. Pick the ``top_k`` best choices inside
    them. 4. Weights are the picked *uncorrected* scores, optionally renormalized (sum + 1e-20), times
    ``routed_scaling_factor``.

    Args:
        router_logits: [T, L] float32.
        e_score_correction_bias: [L] float32 (aux-loss-free load balancing bias).
        top_k, num_groups (``n_group``), topk_groups (``topk_group``): as in the config; L must divide
            into ``num_groups`` groups of at least two experts.
        renormalize: ``norm_topk_prob``.
        routed_scaling_factor: multiplies the weights.
    Returns:
        (topk_weights [T, k] float32, topk_ids [T, k] int64); in batch-invariant mode by descending
        choice (``topk(sorted=False)``'s order may follow the algorithm torch picks for the batch's shape,
        and the slot order is the order in which a token's expert outputs are added).
    Source: DeepSeek-V3 technical report (2024), section 2.1.2; Hugging Face ``DeepseekV3TopkRouter``.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + e_score_correction_bias
    per_group = num_experts // num_groups  # explicit sizes: T may be 0 (an EP rank without work)
    group_scores = choice.view(num_tokens, num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_ids = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, per_group).reshape(num_tokens, num_experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=is_batch_invariant())[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (_sum_k(weights) + 1e-20)
    return weights * routed_scaling_factor, ids


# ----------------------------------------------------------------------------------------------------
# Triton kernels: program r routes token r. Top-k is k rounds of (max, lowest index holding it, mask
# it out); the k results are kept in registers as [BLOCK_K] vectors and stored once.
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _softmax_topk_kernel(
    logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    ok = experts < num_experts
    pdl_wait(USE_PDL)
    x = tl.load(logits_ptr + row * stride_t + experts, mask=ok, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    probs = tl.where(ok, e / tl.sum(e, 0), float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    total = 0.0
    for i in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        idx = tl.min(tl.where(probs == best, experts, BLOCK_E), 0)
        ids = tl.where(slots == i, idx.to(tl.int64), ids)
        weights = tl.where(slots == i, best, weights)
        total = total + best  # slot order: the batch-invariant sum
        probs = tl.where(experts == idx, float("-inf"), probs)
    if RENORMALIZE:
        weights = weights / total
    out = row * TOP_K + slots
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)
    tl.store(weights_ptr + out, weights.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)


@triton.jit
def _router_logits_kernel(hidden_ptr, gate_ptr, logits_ptr, norm_w_ptr, normed_ptr, num_experts, hidden_size,
                          stride_h, stride_g, stride_t, stride_n, eps, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                          RMS_NORM: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """Program (t, c): float32 logits of token t for experts c * BLOCK_E .. + BLOCK_E - 1. RMS_NORM (one
    BLOCK_H tile holds the row): the logits of ``rms_norm(hidden[t], norm_w)`` computed as
    ``kernels.norm`` computes it (float32 statistics, rounded to hidden's dtype, then the weight), which
    program (t, 0) also stores to ``normed[t]`` for the experts."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    w_rows = gate_ptr + experts[:, None].to(tl.int64) * stride_g
    hs = tl.arange(0, BLOCK_H)
    h_ok = hs < hidden_size
    # the gate's first tile is requested before the wait (weights are constant during a step)
    w = tl.load(w_rows + hs[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
    if RMS_NORM:
        norm_w = tl.load(norm_w_ptr + hs, mask=h_ok, other=0.0)
        pdl_wait(USE_PDL)
        x = tl.load(hidden_ptr + row * stride_h + hs, mask=h_ok, other=0.0)
        xf = x.to(tl.float32)
        normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden_size + eps)).to(x.dtype)
        normed = (norm_w.to(tl.float32) * normed.to(tl.float32)).to(normed_ptr.dtype.element_ty)
        if tl.program_id(1) == 0:
            tl.store(normed_ptr + row * stride_n + hs, normed, mask=h_ok)
        acc += w * normed.to(tl.float32)[None, :]
    else:
        pdl_wait(USE_PDL)
        for h0 in range(0, hidden_size, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h_ok = hs < hidden_size
            hid = tl.load(hidden_ptr + row * stride_h + hs, mask=h_ok, other=0.0).to(tl.float32)
            if h0 > 0:
                w = tl.load(w_rows + hs[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
            acc += w * hid[None, :]
    tl.store(logits_ptr + row * stride_t + experts, tl.sum(acc, 1), mask=e_ok)


_ROUTER_BLOCK_H = 2048  # hidden columns per tile of the router-logits kernel (the fused norm needs one tile)


@triton.jit
def _router_gemm_kernel(hidden_ptr, gate_ptr, logits_ptr, num_tokens, num_experts, hidden_size,
                        stride_h, stride_g, stride_t, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (m, n): float32 logits of tokens m * BLOCK_M .. for experts n * BLOCK_N .., as tensor-core
    products of hidden's and the gate's own dtype accumulated in float32 (16-bit products are exact in
    float32; no float32 copies of either operand)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    experts = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, e_ok = rows < num_tokens, experts < num_experts
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    pdl_wait(USE_PDL)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        a = tl.load(hidden_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(gate_ptr + experts[None, :].to(tl.int64) * stride_g + ks[:, None],
                    mask=e_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(logits_ptr + rows[:, None].to(tl.int64) * stride_t + experts[None, :], acc,
             mask=row_ok[:, None] & e_ok[None, :])


def router_gemm_triton(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """float32 ``hidden @ gate_weight.T`` for prefill-sized batches: hidden [T, H], gate_weight [L, H] of one
    dtype (16-bit or float32) -> [T, L] float32, one launch of 64-token
    tiles (the torch path made float32 copies of hidden and the gate, then a float32 FFMA GEMM: 66 us a
    layer of V2-Lite at 4K tokens on an H200)."""
    num_tokens, hidden_size = hidden.shape
    num_experts = gate_weight.shape[0]
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=hidden.device)
    block_m, block_n = 64, min(128, max(16, triton.next_power_of_2(num_experts)))
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(num_experts, block_n))
    _router_gemm_kernel[grid](hidden, gate_weight, logits, num_tokens, num_experts, hidden_size,
                              hidden.stride(0), gate_weight.stride(0), logits.stride(0), BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=64, IEEE=hidden.dtype == torch.float32, num_warps=4,
                              num_stages=3, **pdl_launch(use_pdl(hidden)))
    return logits


def router_logits_triton(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """float32 ``hidden @ gate_weight.T`` for decode-sized batches: hidden [T, H], gate_weight [L, H] (any
    float dtypes, products and sums in float32) -> [T, L] float32. Programs (token, 4 experts): a decode
    step's router spreads its weight read over L / 4 multiprocessors (one program per token reading the
    whole gate was bound by one SM's memory latency), with no casts of hidden or the weight."""
    return _launch_router_logits(hidden, gate_weight, None, 0.0)[0]


def norm_router_logits_triton(hidden: torch.Tensor, gate_weight: torch.Tensor, norm_weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`router_logits_triton` of ``rms_norm(hidden, norm_weight, eps)`` with the norm in the kernel's
    prologue, one launch for what was a norm kernel and this one. hidden [T, H] (H <= 2048), norm_weight
    [H]. Returns (logits [T, L] float32, the normed rows [T, H] in hidden's dtype).
    Raises: ValueError for rows of more than 2048 columns."""
    logits, normed = _launch_router_logits(hidden, gate_weight, norm_weight, eps)
    assert normed is not None
    return logits, normed


def _launch_router_logits(hidden, gate_weight, norm_weight, eps) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, hidden_size = hidden.shape
    num_experts = gate_weight.shape[0]
    logits = torch.empty((num_tokens, num_experts), dtype=torch.float32, device=hidden.device)
    block_e = 4
    block_h = max(16, min(_ROUTER_BLOCK_H, triton.next_power_of_2(hidden_size)))
    fuse = norm_weight is not None
    if fuse and block_h < hidden_size:
        raise ValueError(f"the router's fused norm takes rows of at most {_ROUTER_BLOCK_H}, got {hidden_size}")
    normed = torch.empty_like(hidden) if fuse else logits
    _router_logits_kernel[(num_tokens, triton.cdiv(num_experts, block_e))](
        hidden, gate_weight, logits, norm_weight if fuse else gate_weight, normed, num_experts, hidden_size,
        hidden.stride(0), gate_weight.stride(0), logits.stride(0), normed.stride(0), float(eps),
        BLOCK_E=block_e, BLOCK_H=block_h, RMS_NORM=fuse, num_warps=4, **pdl_launch(use_pdl(hidden)),
    )
    return logits, (normed if fuse else None)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scaling_factor,
    NUM_GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOP_K: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    RENORMALIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_SHARED: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BLOCK_G)
    members = tl.arange(0, BLOCK_P)
    ok = (groups[:, None] < NUM_GROUPS) & (members[None, :] < PER_GROUP)
    experts = groups[:, None] * PER_GROUP + members[None, :]  # [BLOCK_G, BLOCK_P]
    bias = tl.load(bias_ptr + experts, mask=ok, other=0.0).to(tl.float32)  # a weight: before the wait
    pdl_wait(USE_PDL)
    x = tl.load(logits_ptr + row * stride_t + experts, mask=ok, other=0.0).to(tl.float32)
    scores = tl.sigmoid(x)
    choice = tl.where(ok, scores + bias, float("-inf"))
    if TOPK_GROUPS < NUM_GROUPS:
        # a group's score: its two best choices added (torch: topk(2).sum(-1))
        top1 = tl.max(choice, 1)
        first = tl.min(tl.where(choice == top1[:, None], members[None, :], BLOCK_P), 1)
        top2 = tl.max(tl.where(members[None, :] == first[:, None], float("-inf"), choice), 1)
        group_scores = tl.where(groups < NUM_GROUPS, top1 + top2, float("-inf"))
        keep = groups < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.max(group_scores, 0)
            g = tl.min(tl.where(group_scores == best, groups, BLOCK_G), 0)
            keep = keep | (groups == g)
            group_scores = tl.where(groups == g, float("-inf"), group_scores)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    total = 0.0
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.max(choice, 1), 0)
        idx = tl.min(tl.min(tl.where(choice == best, experts, BLOCK_G * BLOCK_P), 1), 0)
        picked = experts == idx
        score = tl.max(tl.max(tl.where(picked, scores, float("-inf")), 1), 0)
        ids = tl.where(slots == i, idx.to(tl.int64), ids)
        weights = tl.where(slots == i, score, weights)
        total = total + score  # slot order: the batch-invariant sum
        choice = tl.where(picked, float("-inf"), choice)
    if RENORMALIZE:
        weights = weights / (total + 1e-20)
    weights = weights * scaling_factor
    if NUM_SHARED > 0:  # fused shared experts: slots TOP_K + s are experts L + s, weight 1
        shared = (slots >= TOP_K) & (slots < TOP_K + NUM_SHARED)
        ids = tl.where(shared, (NUM_GROUPS * PER_GROUP + slots - TOP_K).to(tl.int64), ids)
        weights = tl.where(shared, 1.0, weights)
    out_k = TOP_K + NUM_SHARED
    out = row * out_k + slots
    tl.store(ids_ptr + out, ids, mask=slots < out_k)
    tl.store(weights_ptr + out, weights, mask=slots < out_k)


def _kernel_applies(router_logits: torch.Tensor, *others: torch.Tensor) -> bool:
    return (
        router_logits.shape[0] > 0
        and router_logits.shape[1] <= _MAX_EXPERTS
        and router_logits.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and router_logits.stride(1) == 1
        and use_triton(router_logits, *others)
    )


def softmax_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`softmax_topk_ref` in one Triton launch (same contract; ``router_logits.stride(1) == 1``)."""
    _check_topk(router_logits, top_k)
    num_tokens, num_experts = router_logits.shape
    weights = router_logits.new_empty((num_tokens, top_k))
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    _softmax_topk_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=max(16, triton.next_power_of_2(num_experts)),
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), num_warps=4 if num_experts > 256 else 1,
        **pdl_launch(use_pdl(router_logits)),
    )
    return weights, ids


def grouped_topk_triton(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grouped_topk_ref` in one Triton launch (same contract; experts by descending choice).

    num_shared: S fused shared experts appended as slots ``k .. k+S-1`` (experts ``L .. L+S-1``, weight 1).
    """
    num_tokens, num_experts = router_logits.shape
    out_k = top_k + num_shared
    weights = torch.empty((num_tokens, out_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, out_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    per_group = num_experts // num_groups
    _grouped_topk_kernel[(num_tokens,)](
        router_logits, e_score_correction_bias, weights, ids, router_logits.stride(0), float(routed_scaling_factor),
        NUM_GROUPS=num_groups, PER_GROUP=per_group, TOP_K=top_k, TOPK_GROUPS=topk_groups, RENORMALIZE=renormalize,
        BLOCK_G=triton.next_power_of_2(num_groups), BLOCK_P=max(2, triton.next_power_of_2(per_group)),
        BLOCK_K=max(2, triton.next_power_of_2(out_k)), NUM_SHARED=num_shared,
        num_warps=4 if num_experts > 256 else 1, **pdl_launch(use_pdl(router_logits)),
    )
    return weights, ids


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing (Qwen3-MoE, Mixtral); the Triton kernel on CUDA tensors.

    Args and returns: as :func:`softmax_topk_ref` (experts by descending probability).
    Raises:
        ValueError: if router_logits is not 2-D or top_k is not in ``[1, L]``.
    """
    _check_topk(router_logits, top_k)
    if _kernel_applies(router_logits):
        return softmax_topk_triton(router_logits, top_k, renormalize)
    return softmax_topk_ref(router_logits, top_k, renormalize)


def append_shared_experts(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_shared: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of fused shared experts: append slots ``k .. k+S-1`` choosing experts ``L .. L+S-1`` with
    weight 1 (shared experts run as extra experts of the fused MoE kernel, every token through all).

    weights [T, k] float, ids [T, k] int64 -> ([T, k+S], [T, k+S]); unchanged when S is 0.
    """
    if num_shared == 0:
        return weights, ids
    num_tokens = ids.shape[0]
    shared_ids = torch.arange(num_experts, num_experts + num_shared, device=ids.device).expand(num_tokens, -1)
    shared_w = torch.ones((num_tokens, num_shared), dtype=weights.dtype, device=weights.device)
    return torch.cat([weights, shared_w], 1), torch.cat([ids, shared_ids.to(ids.dtype)], 1)


def _check_grouped(num_experts: int, top_k: int, num_groups: int, topk_groups: int, bias: torch.Tensor) -> None:
    if num_groups < 1 or num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(f"{num_experts} experts do not split into num_groups={num_groups} groups of at least 2")
    if not 1 <= topk_groups <= num_groups or top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(f"topk_groups={topk_groups} of {num_groups} groups cannot hold top_k={top_k} experts")
    if bias.shape != (num_experts,):
        raise ValueError(f"e_score_correction_bias {tuple(bias.shape)} must be [{num_experts}]")


def grouped_topk(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing (see :func:`grouped_topk_ref`); the Triton kernel on CUDA tensors, which
    returns the experts by descending choice in either mode.

    num_shared: S shared experts appended as in :func:`append_shared_experts` (returns [T, k+S]).
    Raises:
        ValueError: if L does not split into ``num_groups`` groups of at least two experts, or
            ``topk_groups`` / ``top_k`` do not fit (``1 <= top_k <= topk_groups * L / num_groups``).
    """
    _check_topk(router_logits, top_k)
    num_experts = router_logits.shape[1]
    _check_grouped(num_experts, top_k, num_groups, topk_groups, e_score_correction_bias)
    if (router_logits.dtype == torch.float32 and e_score_correction_bias.dtype == torch.float32
            and _kernel_applies(router_logits, e_score_correction_bias)):
        return grouped_topk_triton(router_logits, e_score_correction_bias.contiguous(), top_k, num_groups,
                                   topk_groups, renormalize, routed_scaling_factor, num_shared)
    weights, ids = grouped_topk_ref(router_logits, e_score_correction_bias, top_k, num_groups, topk_groups,
                                    renormalize, routed_scaling_factor)
    return append_shared_experts(weights, ids, num_experts, num_shared)


# The router's logits by router_logits_triton (each token re-reads the gate weight, from L2) for
# decode-sized batches and routers up to this many weight elements (DeepSeek-V2-Lite's 64 x 2048,
# Qwen3-30B-A3B's 128 x 2048, DeepSeek-V3's 256 x 7168 = 1.8M too); larger ones take the GEMM.
ROUTER_LOGITS_KERNEL_MAX_TOKENS = 128
ROUTER_LOGITS_KERNEL_MAX_WEIGHTS = 1 << 21


def router_logits(hidden: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's router logits from the hidden states: float32 ``hidden @ gate_weight.T`` (as Hugging
    Face's ``DeepseekV3TopkRouter``).

    On CUDA, for up to :data:`ROUTER_LOGITS_KERNEL_MAX_TOKENS` tokens and a gate of up to
    :data:`ROUTER_LOGITS_KERNEL_MAX_WEIGHTS` elements, from :func:`router_logits_triton` (no casts; a
    decode step's router was five launches: two casts, a GEMV and its reduction, then the routing
    kernel, and is two now); for more tokens, with hidden and the gate in one dtype, from
    :func:`router_gemm_triton` (tensor-core products accumulated in float32, no float32 copies). In
    batch-invariant mode always the torch GEMM (its rows do not depend on the batch; the kernels' sums
    differ from it by rounding, so a token's route would follow the batch size).

    Args:
        hidden: [T, H] bf16/fp16/fp32; gate_weight: [L, H].
    Returns:
        [T, L] float32.
    Raises:
        ValueError: if hidden and gate_weight do not match.
    """
    if hidden.dim() != 2 or gate_weight.dim() != 2 or hidden.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match gate weight {tuple(gate_weight.shape)}")
    if _router_kernel_applies(hidden, gate_weight):
        return router_logits_triton(hidden, gate_weight)
    if _router_gemm_applies(hidden, gate_weight):
        return router_gemm_triton(hidden, gate_weight)
    return dense_linear(hidden.float(), gate_weight.float())


def router_grouped_topk(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
    num_shared: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router from the hidden states: :func:`router_logits`, then :func:`grouped_topk`.

    Args:
        hidden: [T, H] bf16/fp16/fp32; gate_weight: [L, H]; the rest as :func:`grouped_topk`.
    Returns:
        (topk_weights [T, k+S] float32, topk_ids [T, k+S] int64).
    Raises:
        ValueError: as :func:`grouped_topk`, or if hidden and gate_weight do not match.
    """
    return grouped_topk(router_logits(hidden, gate_weight), e_score_correction_bias.float(), top_k, num_groups,
                        topk_groups, renormalize, routed_scaling_factor, num_shared)


def _router_gemm_applies(hidden: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    return (hidden.shape[0] > 0 and not is_batch_invariant() and hidden.stride(1) == 1 and gate_weight.stride(1) == 1
            and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and gate_weight.dtype == hidden.dtype and use_triton(hidden, gate_weight))


def _router_kernel_applies(hidden: torch.Tensor, gate_weight: torch.Tensor) -> bool:
    return (0 < hidden.shape[0] <= ROUTER_LOGITS_KERNEL_MAX_TOKENS
            and gate_weight.numel() <= ROUTER_LOGITS_KERNEL_MAX_WEIGHTS and not is_batch_invariant()
            and hidden.stride(1) == 1 and gate_weight.stride(1) == 1
            and hidden.dtype in (torch.float16, torch.bfloat16, torch.float32) and use_triton(hidden, gate_weight))


def norm_router_logits(residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       gate_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = rms_norm(residual, norm_weight, eps)`` and :func:`router_logits` of x: the MoE layer's
    post-attention norm and router logits. Where the router kernel applies to rows of up to 2048 columns
    of norm_weight's dtype, the norm runs in its prologue (:func:`norm_router_logits_triton`; one launch less
    a layer at decode), else ``kernels.norm.rms_norm`` first.

    Args:
        residual: [T, H] the residual stream; norm_weight: [H]; gate_weight: [L, H].
    Returns:
        (logits [T, L] float32, x [T, H] in residual's dtype).
    Raises:
        ValueError: as :func:`router_logits`.
    """
    from rayinfer.kernels.norm import rms_norm

    if (_router_kernel_applies(residual, gate_weight) and residual.shape[1] <= _ROUTER_BLOCK_H
            and norm_weight.dtype == residual.dtype and gate_weight.shape[1] == residual.shape[1]):
        return norm_router_logits_triton(residual, gate_weight, norm_weight, eps)
    x = rms_norm(residual, norm_weight, eps)
    return router_logits(x, gate_weight), x
