"""CUDA graphs for decode and verification steps: the model's forward captured once per padded batch
size and query length.

A decode step of a small model is a few hundred tiny kernel launches whose CPU cost exceeds their GPU
time; replaying a captured graph launches them all at once. Inputs live in static buffers that each
step overwrites; padding rows get slot -1 (their KV is never written).

Speculative decoding adds steps in which each request computes its last token plus its drafts (a
*verification* step, 2..k+1 query tokens per request) and the draft model's catch-up steps. Those are
captured too, per query length ``q`` (``max_query_len``), for every batch size decode captures (or up to
``max_verify_seqs``): a step
whose requests have different query lengths runs in the graph of its longest one, each request padded to
``q`` rows (:meth:`DecodeGraphs.run_ragged`). A padding row sits after its request's real rows, so causal
attention never shows it to them, and its slot is -1. A draft model that skipped steps (the confidence
schedule's plain steps) catches up on many tokens at once: one wider query length (``catch_up_len``) is
captured for the batch sizes whose ``size * catch_up_len`` rows fit ``max_catch_up_tokens``, and a longer
catch-up runs as several replays of it (:meth:`DecodeGraphs.catch_up_rounds`) instead of one eager forward
(a few hundred launches from Python, and a compile for each new shape).

With ``with_hidden`` (MTP drafting reads the target's last hidden states) the captured forward is
``model.forward_with_prenorm`` and each replay returns both outputs.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from rayinfer import envs
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.kernels.graph_inputs import fill_graph_inputs, fill_graph_inputs_ref

# 1: a replay's inputs go into the graph's buffers in one launch (kernels/graph_inputs.py); 0: by separate torch
# ops (RAYINFER_FUSED_GRAPH_INPUTS, default 0 until the GPU measurements agree; tested against the torch ops).
FUSED_INPUTS = int(envs.fused_graph_inputs())

logger = logging.getLogger(__name__)

Outputs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a forward's hidden states, or the pair with_hidden


def _rows(out: Outputs, index) -> Outputs:
    return tuple(o[index] for o in out) if isinstance(out, tuple) else out[index]  # type: ignore[return-value]


@contextlib.contextmanager
def fixed_dispatch(model, rows: int):
    """Within the block, the model's expert-parallel MoE layers dispatch with fixed-size buffers of ``rows``
    rows per rank pair (``model.moe.RoutedExperts.dispatch_capacity``): a graph's step, which every rank
    of the group runs at the same padded size. No effect on a model without such layers."""
    layers = [m for m in (model.expert_layers() if hasattr(model, "expert_layers") else ()) if m.group is not None]
    old = [m.dispatch_capacity for m in layers]
    for m in layers:
        m.dispatch_capacity = rows
    try:
        yield
    finally:
        for m, capacity in zip(layers, old):
            m.dispatch_capacity = capacity


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured forwards for a set of (batch size, query length) pairs.

    Args:
        model: the model (``forward(input_ids, positions, kv_cache, meta)``).
        kv_cache: the paged cache tensor.
        block_size: tokens per block.
        max_model_len: longest context a replay may see (attention's split-KV size is baked in for it).
        max_num_seqs: largest batch captured for one-token (decode) steps.
        max_query_len: longest query per request captured (1: decode only; k + 1 for speculative
            verification with k drafts).
        max_verify_seqs: largest batch captured for query lengths above 1 (default: every decode size; a
            verification step that outgrows its graphs runs eagerly, 10x slower on a small model).
        eager: run the model on the static buffers instead of replaying graphs (no capture; for CPU tests
            of the padding and buffer logic).
        with_hidden: capture ``model.forward_with_prenorm``: replays return (hidden after the final
            norm, hidden before it), both [rows, hidden_size].
        catch_up_len: one more query length captured, above ``max_query_len`` (0: none), for the batch
            sizes with ``size * catch_up_len <= max_catch_up_tokens``; none for a model whose
            ``max_graph_query_len`` is shorter (MLA: longer queries take a prefill path sized on the host).
    """

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_model_len: int, max_num_seqs: int,
                 max_query_len: int = 1, max_verify_seqs: int | None = None, eager: bool = False, with_hidden: bool = False,
                 catch_up_len: int = 0, max_catch_up_tokens: int = 4096):
        dev = kv_cache.device
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.forward = model.forward_with_prenorm if with_hidden else model
        self.max_model_len = max_model_len
        self.eager = eager
        self.sizes = capture_sizes(max_num_seqs)
        limit = max_verify_seqs if max_verify_seqs is not None else self.sizes[-1]
        self.verify_sizes = [s for s in self.sizes if s <= limit] if max_query_len > 1 else []
        self.max_query_len = max_query_len if self.verify_sizes else 1
        cap = getattr(model, "max_graph_query_len", None)  # MLA: only short queries read their lengths on the device
        if cap is not None and catch_up_len > cap:
            catch_up_len = 0
        catch_up_sizes = [s for s in self.sizes if s * catch_up_len <= max_catch_up_tokens]
        self.catch_up_len = catch_up_len if catch_up_len > self.max_query_len and catch_up_sizes else 0
        self.catch_up_sizes = catch_up_sizes if self.catch_up_len else []
        n = self.sizes[-1]
        num_tokens = max(n, (self.verify_sizes[-1] if self.verify_sizes else 0) * self.max_query_len,
                         (self.catch_up_sizes or [0])[-1] * self.catch_up_len)
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        self.positions = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((num_tokens,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=dev)
        # per query length q: request i's rows start at i * q
        self.query_start_loc = {q: torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=dev)
                                for q in self.query_lens()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], Outputs] = {}

    def _meta(self, bs: int, q: int) -> AttentionMetadata:
        return AttentionMetadata(self.query_start_loc[q][: bs + 1], self.seq_lens[:bs], self.block_tables[:bs],
                                 self.slot_mapping[: bs * q], self.block_size, [q] * bs, [self.max_model_len] * bs)

    def _args(self, bs: int, q: int) -> tuple:
        t = bs * q
        return self.input_ids[:t], self.positions[:t], self.kv_cache, self._meta(bs, q)

    def query_lens(self) -> list[int]:
        """The captured query lengths: 1 .. ``max_query_len``, then ``catch_up_len`` if any."""
        return list(range(1, self.max_query_len + 1)) + ([self.catch_up_len] if self.catch_up_len else [])

    def _sizes_for(self, q: int) -> list[int]:
        if q == 1:
            return self.sizes
        return self.verify_sizes if q <= self.max_query_len else self.catch_up_sizes if q == self.catch_up_len else []

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every (size, query length), largest first, sharing one memory pool.

        A query length above 1 whose capture fails (a model whose multi-token attention cannot be
        captured) is dropped with a warning: those steps then run eagerly.
        """
        if self.eager:
            return
        pool = None
        for q in self.query_lens():
            self.seq_lens.fill_(q)  # a context of q tokens at capture (its keys: block 0's slots)
            try:
                for bs in reversed(self._sizes_for(q)):
                    args = self._args(bs, q)
                    with fixed_dispatch(self.model, bs * q):
                        self.forward(*args)  # warm-up: Triton compiles outside the capture
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool):
                            self.outputs[(bs, q)] = self.forward(*args)
                    pool = graph.pool()
                    self.graphs[(bs, q)] = graph
            except Exception as exc:  # noqa: BLE001 - any capture failure leaves eager steps, not a dead engine
                if q == 1:
                    raise
                logger.warning("CUDA graphs for %d-token queries not captured (%s): those steps run eagerly", q, exc)
                for key in [k for k in self.graphs if k[1] >= q]:
                    del self.graphs[key], self.outputs[key]
                if q <= self.max_query_len:
                    self.max_query_len = q - 1
                self.catch_up_len, self.catch_up_sizes = 0, []
                torch.cuda.synchronize()
                break
        self.seq_lens.fill_(1)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for batch sizes %s (1-token queries)%s%s", self.sizes,
                    f" and {self.verify_sizes} (2..{self.max_query_len}-token queries)" if self.max_query_len > 1 else "",
                    f", {self.catch_up_sizes} ({self.catch_up_len}-token catch-ups)" if self.catch_up_len else "")

    def padded_size(self, num_reqs: int, query_len: int = 1, min_batch: int | None = None) -> int | None:
        """Smallest captured size holding ``num_reqs`` requests of ``query_len`` tokens (and at least
        ``min_batch``: an expert-parallel group's size), or None."""
        if not (1 <= query_len <= self.max_query_len or query_len == self.catch_up_len > 0):
            return None
        for bs in self._sizes_for(query_len):
            if bs >= max(num_reqs, min_batch or 0):
                return bs
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor | None,
            seq_lens: torch.Tensor, block_tables: torch.Tensor, query_len: int = 1,
            min_batch: int | None = None, gather_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
            advance: torch.Tensor | None = None) -> Outputs:
        """Replay the graph for ``n`` requests of ``query_len`` tokens each (inputs already on the device).

        Args:
            input_ids, positions, slot_mapping: [n * query_len], request i's tokens at rows
                ``i * query_len ...``. seq_lens: [n] int32. block_tables: [n, w] int32 (w at most the
                blocks of ``max_model_len``). n may be 0 (padding rows only: an expert-parallel rank
                without requests meeting the others in the graph's collectives).
            min_batch: replay a graph of at least this many requests (the group's size).
            gather_ids: (source, rows): the input ids are ``source[rows]`` (int64 device tensors: a previous
                step's sampled tokens and the row of each input), gathered straight into the graph's input
                buffer; ``input_ids`` is then not read.
            advance: optional [n] int device tensor: request i's positions and context length move by
                ``advance[i]`` and its slots are computed from its block table on the device
                (``kernels.graph_inputs``; ``slot_mapping`` is then not read), so the count may come from a
                step still in flight. Its table must already hold the moved positions' blocks.
        Returns:
            hidden states [n * query_len, hidden_size] (a view of the graph's output buffer, valid until
            the next replay); with ``with_hidden`` the pair (after the final norm, before it).
        """
        n, q = seq_lens.shape[0], query_len
        bs = self.padded_size(n, q, min_batch)
        assert bs is not None, f"no graph for {n} requests of {q} tokens (at least {min_batch})"
        t = n * q
        fill = fill_graph_inputs if FUSED_INPUTS else fill_graph_inputs_ref
        fill((self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables),
             gather_ids if gather_ids is not None else input_ids, positions, slot_mapping, seq_lens, block_tables,
             bs, q, advance, self.block_size)
        if self.eager:  # the host lists the CPU attention reads are the real ones here
            ids, pos, kv, meta = self._args(bs, q)
            meta.seq_lens_cpu = self.seq_lens[:bs].tolist()
            with fixed_dispatch(self.model, bs * q):
                return _rows(self.forward(ids, pos, kv, meta), slice(0, t))
        self.graphs[(bs, q)].replay()
        return _rows(self.outputs[(bs, q)], slice(0, t))

    def ragged_width(self, query_lens: list[int], seq_lens: list[int]) -> int | None:
        """The query length whose graphs can run a step of these requests (its longest query, or
        ``catch_up_len`` above ``max_query_len``), or None (none captured, too many requests, or a padded
        context past ``max_model_len``)."""
        if not query_lens:
            return None
        width = max(query_lens)
        if width > self.max_query_len and width <= self.catch_up_len:
            width = self.catch_up_len
        if self.padded_size(len(query_lens), width) is None:
            return None
        if any(s - q + width > self.max_model_len for q, s in zip(query_lens, seq_lens)):
            return None
        return width

    def catch_up_rounds(self, query_lens: list[int], seq_lens: list[int], max_rounds: int = 16) -> list[list[int]] | None:
        """Split catch-ups longer than the captured widths into replays of ``catch_up_len`` tokens a request: how many of its next tokens each request feeds in each replay but the last, so
        that the last replay feeds every request's last ``min(query_len, width)`` tokens (its last token's
        hidden state gives its first draft). A request longer than the width feeds ``min(width, left -
        width)`` tokens a replay, so it has the width left for the last.

        Args:
            query_lens, seq_lens: per request, the tokens to catch up on and its context after them.
            max_rounds: most replays in all (more: an eager forward is cheaper).
        Returns:
            per replay before the last, the tokens of each request ([] when every catch-up fits one
            replay), or None when they cannot run in graphs (no ``catch_up_len`` and longer than
            ``max_query_len``, too many rounds, requests or context).
        """
        if not self.catch_up_len:  # no catch-up graphs: one replay or none
            return [] if self.ragged_width(query_lens, seq_lens) is not None else None
        width = self.catch_up_len
        left, rounds = list(query_lens), []
        while left and max(left) > width:
            take = [min(width, n - width) if n > width else 0 for n in left]
            rows = [i for i, t in enumerate(take) if t]
            if len(rounds) + 2 > max_rounds or self.padded_size(len(rows), width) is None:
                return None
            rounds.append(take)
            left = [n - t for n, t in zip(left, take)]
        if self.ragged_width(left, seq_lens) is None:
            return None
        return rounds

    def run_ragged(self, input_ids: np.ndarray | torch.Tensor, slot_mapping: np.ndarray, query_lens: list[int], seq_lens: list[int], block_tables: np.ndarray, width: int) -> Outputs:
        """Replay the graph of ``width``-token queries for requests of up to ``width`` new tokens each.

        Each request is padded to ``width`` rows at its end (slot -1, the positions that follow its
        last), its context to ``seq_len - query_len + width``.

        Args:
            input_ids: [T] int64 (a device tensor; a host array only off CUDA) and slot_mapping: [T]
                int64 (host), the step's tokens request after request; query_lens, seq_lens: per request
                (tokens; the positions follow from them); block_tables: [n, w] int32 (host); width: from
                :meth:`ragged_width`.
        Returns:
            hidden states [T, hidden_size] of the real rows, in order (a new tensor; with ``with_hidden``
            the pair, as :meth:`run`).
        """
        from rayinfer.engine.staging import to_device

        dev = self.input_ids.device
        n = len(query_lens)
        q = np.asarray(query_lens, dtype=np.int64)
        first = np.asarray(seq_lens, dtype=np.int64) - q  # each request's first new position
        rows = np.concatenate([i * width + np.arange(k) for i, k in enumerate(query_lens)])
        pos = (first[:, None] + np.arange(width)[None, :]).reshape(-1)
        slots = np.full(n * width, -1, dtype=np.int64)
        slots[rows] = slot_mapping
        tables = np.ascontiguousarray(block_tables, dtype=np.int32)
        # one non-blocking copy of the padded inputs (launching a step must not wait for the device)
        rows_t, pos_t, slots_t, seq_t, tables_t = to_device([rows, pos, slots, (first + width).astype(np.int32), tables], dev)
        ids = torch.zeros(n * width, dtype=torch.long, device=dev)
        ids[rows_t] = input_ids if isinstance(input_ids, torch.Tensor) else torch.from_numpy(input_ids).to(dev)
        return _rows(self.run(ids, pos_t, slots_t, seq_t, tables_t, query_len=width), rows_t)
