"""Context-parallel (CP) prefill: one long prompt's forward split over the ``cp`` ranks of a replica.

What each rank runs (:func:`cp_prefill_rank`), in steps:

1. Zigzag split (:func:`zigzag_bounds`): the T tokens in ``2N`` contiguous chunks; rank r takes chunks
   ``r`` and ``2N - 1 - r``. Under a causal mask a chunk's attention cost grows with its position, so
   pairing an early chunk with a late one gives every rank the same work (Brandon et al. 2023, "Striped
   Attention" discuss the imbalance; the zigzag pairing is the one of Megatron/DeepSeek/SGLang CP prefill).
2. Every rank embeds its own tokens and runs each decoder layer on them (weights are replicated).
3. In each layer's attention, after RoPE, the ranks all-gather their keys and values
   (``torch.distributed.all_gather`` over the CP group: gloo on CPU, NCCL on GPU), write the whole
   prompt's K/V into a paged cache, and attend their local queries to it with the causal mask of the
   global positions: the two chunks are two "requests" of the paged-attention kernel whose context ends
   at the chunk's end (``kernels.paged_attention``), so no new attention kernel is needed.
4. Rank 0 writes into the replica's real KV cache, at the request's blocks, for every layer: when the
   forward ends the prompt's KV is where the normal engine's decode reads it. The other ranks write
   into a scratch cache of one layer (reused by every layer) that they drop afterwards.

All-gather, not ring: Ring Attention (Liu et al. 2023) passes K/V blocks around the ring and overlaps each
hop with attention of the block in hand, so no rank ever holds the whole K/V. The all-gather is simpler
(one collective per layer, the existing paged-attention kernel) and for GQA models it moves little:
per layer each rank receives ``(N-1)/N * T * 2 * num_kv_heads * head_dim`` elements, 1/4 of Q's size
for Llama-3-8B (8 KV heads against 32 query heads). Ring attention with overlap is future work.

Where CP stops (see ``LLMEngine.add_request``): the CP forward covers the prompt's first ``T - 1``
tokens, delivered to the engine as an imported prefix (a :class:`~rayinfer.engine.types.KVHandle`
whose payload is a :class:`~rayinfer.engine.types.ContextParallelPrefill`). The engine's own next step
on rank 0 computes the last prompt token over that KV and samples the first output token with its usual
sampler (seeds, logprobs, grammar), so no hidden state or logits cross ranks. (With the zigzag split,
rank 0 holds the last chunk anyway.)

Prefix-cache hits reduce the CP work: when rank 0's prefix cache holds the prompt's first ``P`` tokens
(whole blocks, device tier), the CP forward covers only tokens ``P..T-2``, zigzag-split over the ranks as
above. Those tokens attend to the cached prefix too, so in each layer rank 0 broadcasts the prefix's K/V
blocks from its cache (``torch.distributed.broadcast``, ``P * 2 * num_kv_heads * head_dim`` elements)
and the peers write them into their scratch cache before attending. A request is prefilled with CP only
when its uncached part is at least ``cp_min_tokens``; otherwise it runs on rank 0 alone and reuses its
cached prefix.

No Ray here: communication is an :data:`AllGather` and a :data:`Broadcast` callable, so tests run N ranks
as threads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.gemv import linear
from rayinfer.kernels.kv_write import store_kv
from rayinfer.kernels.matmul import dense_linear
from rayinfer.kernels.paged_attention import paged_attention
from rayinfer.kernels.rotary import rotary

AllGather = Callable[[torch.Tensor], list[torch.Tensor]]
"""``all_gather(t)`` -> every CP rank's tensor of ``t``'s shape and dtype, in rank order (a collective:
every rank calls it the same number of times with the same shape)."""


Broadcast = Callable[[torch.Tensor], None]
"""``broadcast(t)``: CP rank 0's ``t`` is copied into every other rank's ``t`` in place (a collective: every
rank calls it with a tensor of the same shape and dtype)."""


def torch_broadcast(group=None) -> Broadcast:
    """A :data:`Broadcast` from the group's rank 0 over a torch.distributed group (None: the default)."""
    import torch.distributed as dist

    src = 0 if group is None else dist.get_global_rank(group, 0)

    def broadcast(t: torch.Tensor) -> None:
        dist.broadcast(t, src=src, group=group)

    return broadcast


def torch_all_gather(group=None) -> AllGather:
    """An :data:`AllGather` over a torch.distributed group (None: the default group)."""
    import torch.distributed as dist

    def all_gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t.contiguous(), group=group)
        return out

    return all_gather


def zigzag_bounds(num_tokens: int, cp_size: int) -> list[int]:
    """Boundaries of the ``2 * cp_size`` chunks: chunk c is tokens ``[b[c], b[c + 1])``; sizes differ by
    at most one token.

    Raises:
        ValueError: if ``num_tokens < 2 * cp_size`` (a chunk would be empty) or ``cp_size < 1``.
    """
    if cp_size < 1 or num_tokens < 2 * cp_size:
        raise ValueError(f"context-parallel prefill needs at least 2 * cp = {2 * cp_size} tokens; got {num_tokens}")
    n = 2 * cp_size
    return [c * num_tokens // n for c in range(n + 1)]


def zigzag_chunks(num_tokens: int, cp_size: int, cp_rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Rank ``cp_rank``'s two chunks ``((start, end), (start, end))``: chunks ``r`` and ``2N - 1 - r``."""
    b = zigzag_bounds(num_tokens, cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return (b[cp_rank], b[cp_rank + 1]), (b[late], b[late + 1])


def _local_positions(num_tokens: int, cp_size: int, cp_rank: int) -> list[int]:
    (s0, e0), (s1, e1) = zigzag_chunks(num_tokens, cp_size, cp_rank)
    return list(range(s0, e0)) + list(range(s1, e1))


def check_cp_model(model) -> None:
    """Raises ValueError unless ``model`` is one :func:`cp_prefill_rank` knows (the Llama family)."""
    from rayinfer.model.llama import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        raise ValueError(f"context-parallel prefill (parallel.cp > 1) supports Llama-architecture models "
                         f"(Llama, Mistral, SmolLM2); {type(model).__name__} is not one")


@torch.inference_mode()
def cp_prefill_rank(model, token_ids: Sequence[int], cp_rank: int, cp_size: int, all_gather: AllGather,
                    layer_caches: Sequence[torch.Tensor], block_table: Sequence[int], num_cached: int = 0,
                    broadcast: Broadcast | None = None) -> torch.Tensor:
    """One CP rank's share of a prompt's forward (steps 1-4 of the module docstring).

    Every rank of the group calls it at once with the same ``token_ids`` and ``num_cached``.

    Args:
        model: a :class:`~rayinfer.model.llama.LlamaForCausalLM` (see :func:`check_cp_model`).
        token_ids: the T tokens (positions ``0..T-1``), ``T - num_cached >= 2 * cp_size``.
        cp_rank, cp_size: this rank and the group's size.
        all_gather: the group's :data:`AllGather`.
        layer_caches: per layer the paged cache ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
            that receives the prompt's K/V (written in place): rank 0 passes its real cache's layers,
            the others one scratch tensor repeated.
        block_table: the blocks (of every layer's cache) that hold tokens ``0..T-1``, in order.
        num_cached: tokens ``0..num_cached-1`` are a prefix whose K/V rank 0's ``layer_caches`` already
            hold (a multiple of the block size); only the rest is computed, and rank 0 broadcasts the
            prefix's blocks to the other ranks layer by layer.
        broadcast: the group's :data:`Broadcast` (needed when ``num_cached > 0``).
    Returns:
        hidden: [num_local_tokens, hidden_size] after the final norm, rows in the order of this rank's
        positions (its early chunk, then its late one), the model's dtype.
    Raises:
        ValueError: for too few uncached tokens, a block table too short, a ``num_cached`` that is not a
            multiple of the block size (or has no broadcast), or a model other than Llama's.
    """
    check_cp_model(model)
    num_tokens = len(token_ids)
    block_size = layer_caches[0].shape[2]
    if len(block_table) * block_size < num_tokens:
        raise ValueError(f"block table of {len(block_table)} blocks cannot hold {num_tokens} tokens")
    if num_cached % block_size or num_cached < 0 or (num_cached and broadcast is None):
        raise ValueError(f"num_cached={num_cached} must be a multiple of the block size {block_size} "
                         "and comes with a broadcast")
    device = model.inv_freq.device
    num_new = num_tokens - num_cached  # the positions computed here: num_cached..T-1, zigzag-split
    (s0, e0), (s1, e1) = ((num_cached + s, num_cached + e) for s, e in zigzag_chunks(num_new, cp_size, cp_rank))
    local = torch.tensor(list(range(s0, e0)) + list(range(s1, e1)), dtype=torch.long, device=device)
    num_local = local.numel()
    # every rank's positions in rank order: row i of the concatenated gather sits at position order[i]
    sizes = [len(_local_positions(num_new, cp_size, r)) for r in range(cp_size)]
    max_local = max(sizes)
    order = torch.tensor([p for r in range(cp_size) for p in _local_positions(num_new, cp_size, r)],
                         dtype=torch.long, device=device)
    table = torch.tensor(list(block_table), dtype=torch.long, device=device)
    new_pos = torch.arange(num_cached, num_tokens, device=device)
    slots = table[new_pos // block_size] * block_size + new_pos % block_size  # [T - num_cached]
    prefix_blocks = table[: num_cached // block_size]
    # the early and the late chunk as two requests whose context ends where the chunk ends
    meta = AttentionMetadata.build([e0 - s0, e1 - s1], [e0, e1], [list(block_table)] * 2, block_size, device)

    ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)[local]
    hidden = model.model.embed_tokens(ids)  # [n, hidden]
    residual = None
    prefix = None  # one layer's prefix K/V blocks, the broadcast's buffer (reused by every layer)
    for i, layer in enumerate(model.model.layers):
        if num_cached:
            if cp_rank == 0:
                prefix = layer_caches[i][prefix_blocks]
            elif prefix is None:
                prefix = torch.empty((len(prefix_blocks), *layer_caches[i].shape[1:]), dtype=layer_caches[i].dtype,
                                     device=device)
            assert broadcast is not None
            broadcast(prefix)
            if cp_rank:
                layer_caches[i][prefix_blocks] = prefix
        if residual is None:
            residual, hidden = hidden, layer.input_layernorm(hidden)
        else:
            hidden, residual = layer.input_layernorm(hidden, residual)
        attn = layer.self_attn
        qkv = dense_linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.reshape(num_local, attn.num_heads, attn.head_dim)
        k = k.reshape(num_local, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(num_local, attn.num_kv_heads, attn.head_dim)
        q, k = rotary(q, k, local, model.inv_freq)
        kv = torch.zeros(max_local, 2, attn.num_kv_heads, attn.head_dim, dtype=k.dtype, device=device)
        kv[:num_local, 0], kv[:num_local, 1] = k, v  # padded: all_gather takes one shape from every rank
        gathered = torch.cat([part[:n] for part, n in zip(all_gather(kv), sizes)])  # [T - P, 2, H_kv, D], rank order
        full = torch.empty_like(gathered)
        full[order] = gathered  # position order
        store_kv(full[:, 0], full[:, 1], layer_caches[i], slots)
        out = paged_attention(q, layer_caches[i], meta, attn.scale).reshape(num_local, attn.q_size)
        hidden = linear(out, attn.o_proj.weight, attn.o_proj.bias)
        hidden, residual = layer.post_attention_layernorm(hidden, residual)
        hidden = layer.mlp(hidden)
    return model.model.norm(hidden, residual)[0]


def scratch_cache(model, num_tokens: int, block_size: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[int]]:
    """A non-zero rank's cache for :func:`cp_prefill_rank`: one layer's blocks for ``num_tokens``,
    repeated for every layer, and its block table ``0..n-1``. Memory: ``T * 2 * H_kv * D`` elements."""
    num_layers, _, two, _, heads, dim = model.kv_cache_shape(1, block_size)
    num_blocks = -(-num_tokens // block_size)
    cache = torch.zeros(num_blocks, two, block_size, heads, dim, dtype=dtype, device=model.inv_freq.device)
    return [cache] * num_layers, list(range(num_blocks))


class CPRankLost(RuntimeError):
    """A CP peer did not answer before a prefill (dead or unreachable): rank 0 stops using CP."""


class CPPeer:
    """A CP rank other than 0: the model and the group, waiting for rank 0's prefills.

    Args:
        model: the replica's model (same weights as rank 0's).
        cp_rank, cp_size: this rank (>= 1) and the group's size.
        all_gather, broadcast: the group's :data:`AllGather` and :data:`Broadcast`.
        block_size, kv_dtype: the replica's KV block size and cache dtype (the scratch cache's).
    """

    def __init__(self, model, cp_rank: int, cp_size: int, all_gather: AllGather, block_size: int,
                 kv_dtype: torch.dtype, broadcast: Broadcast | None = None):
        check_cp_model(model)
        self.model, self.cp_rank, self.cp_size, self.all_gather = model, cp_rank, cp_size, all_gather
        self.broadcast = broadcast
        self.block_size, self.kv_dtype = block_size, kv_dtype
        self.num_prefills = 0

    def prefill(self, token_ids: Sequence[int], num_cached: int = 0) -> int:
        """Run this rank's share of one prompt whose first ``num_cached`` tokens rank 0 has cached (rank 0
        runs its share at the same time); returns the number of local tokens computed."""
        caches, table = scratch_cache(self.model, len(token_ids), self.block_size, self.kv_dtype)
        hidden = cp_prefill_rank(self.model, token_ids, self.cp_rank, self.cp_size, self.all_gather, caches, table,
                                 num_cached, self.broadcast)
        self.num_prefills += 1
        return hidden.shape[0]


def _solo_all_gather(t: torch.Tensor) -> list[torch.Tensor]:
    return [t]


def _solo_broadcast(t: torch.Tensor) -> None:
    return None


class CPPrefiller:
    """Rank 0's side: starts the peers' share of a prefill and runs its own into the engine's KV cache.

    The engine calls :meth:`prefill` on its step thread while importing a request's
    :class:`~rayinfer.engine.types.ContextParallelPrefill`; prefills therefore run one at a time, in the
    same order on every rank (the collectives line up).

    A lost peer: before each prefill ``check_peers()`` asks every peer to answer; if one does not
    (:class:`CPRankLost`), or a collective fails, CP is switched off for good (:attr:`lost` says why),
    that prompt is computed by rank 0 alone (the same code with a group of one) or fails, and every later
    prompt runs on rank 0 as in a replica without CP. No prefill waits on a dead peer's collective.

    Args:
        cp_size: ranks in the group (rank 0 included).
        min_tokens: prompts whose uncached part has at least this many tokens are prefilled with CP.
        all_gather, broadcast: rank 0's :data:`AllGather` and :data:`Broadcast` of the group.
        start_peers: ``start_peers(token_ids, num_cached)`` makes ranks ``1..N-1`` start their share
            (``CPPeer.prefill``) and returns a function that waits for them (raising their error).
        check_peers: raises :class:`CPRankLost` unless every peer answers (None: no check).
    """

    def __init__(self, cp_size: int, min_tokens: int, all_gather: AllGather,
                 start_peers: Callable[[list[int], int], Callable[[], object]],
                 broadcast: Broadcast | None = None, check_peers: Callable[[], None] | None = None):
        self.cp_size, self.min_tokens = cp_size, max(min_tokens, 2 * cp_size)
        self.all_gather, self.broadcast, self.start_peers = all_gather, broadcast, start_peers
        self.check_peers = check_peers
        self.lost: str | None = None
        self.num_prefills = 0
        self.num_prefill_tokens = 0
        self.num_solo_prefills = 0

    def applies(self, num_uncached_tokens: int) -> bool:
        """Whether a prompt with this many tokens not in the prefix cache is prefilled with CP."""
        return self.lost is None and num_uncached_tokens >= self.min_tokens

    def prefill(self, model, kv_cache: torch.Tensor, block_ids: Sequence[int], token_ids: Sequence[int],
                num_cached: int = 0) -> None:
        """CP forward of ``token_ids`` (positions ``0..T-1``), their K/V written into ``kv_cache``
        (``[L, num_blocks, 2, bs, H_kv, D]``) at ``block_ids``; the first ``num_cached`` tokens' K/V are
        already there (a prefix-cache hit) and are not computed again.

        Raises:
            whatever a rank raised (the request then fails; see ``LLMEngine._execute_isolated``); CP is
            then off (:attr:`lost`).
        """
        tokens = list(token_ids)
        caches = list(kv_cache)
        if self.lost is None and self.check_peers is not None:
            try:
                self.check_peers()
            except CPRankLost as e:
                self.lost = str(e)
        if self.lost is not None:  # computed here alone: the same forward with a group of one
            cp_prefill_rank(model, tokens, 0, 1, _solo_all_gather, caches, block_ids, num_cached, _solo_broadcast)
            self.num_solo_prefills += 1
            return
        wait = self.start_peers(tokens, num_cached)
        try:
            cp_prefill_rank(model, tokens, 0, self.cp_size, self.all_gather, caches, block_ids, num_cached,
                            self.broadcast)
        except BaseException as e:
            self.lost = f"a collective failed: {e!r}"
            raise
        finally:
            try:
                wait()
            except BaseException as e:
                self.lost = self.lost or f"a peer failed its share: {e!r}"
                raise
        self.num_prefills += 1
        self.num_prefill_tokens += len(tokens) - num_cached

    def stats(self) -> dict:
        return {"cp": self.cp_size, "num_cp_prefills": self.num_prefills,
                "num_cp_prefill_tokens": self.num_prefill_tokens, "num_cp_solo_prefills": self.num_solo_prefills,
                "cp_active": self.lost is None}
