"""Shared pieces of mixture-of-experts (MoE) models: routers (re-exported from ``kernels.moe_routing``),
the routed-expert layer with expert parallelism and expert-load counting, and weight loading from
Hugging Face names.

Glossary:
    logical expert: an expert of the checkpoint (``L = n_routed_experts`` / ``num_experts`` of them).
    physical expert: a slot holding one logical expert's weights on some rank; with redundant experts
        there are ``P > L`` slots and a hot logical expert has several replicas.
    phy2log: [P] int64, the logical expert of each physical slot; rank r of an expert-parallel (EP)
        group of size ep holds slots ``r * P/ep .. (r+1) * P/ep - 1``.
    log2phy: [L, max_replicas] int64, the physical slots of each logical expert (-1 padded).
    expert load: tokens routed to each logical expert, counted per MoE layer for EPLB.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rayinfer.kernels.activation import silu_and_mul
from rayinfer.kernels.batch_invariant import is_batch_invariant
from rayinfer.kernels.block_fp8 import FP8_DTYPE, WEIGHT_BLOCK, block_fp8_dequant_ref, quantize_block_fp8, scale_shape
from rayinfer.kernels.fused_moe import ExpertMap, fused_moe, fused_moe_slots, quantize_w13, sum_slots
from rayinfer.kernels.moe_routing import grouped_topk, softmax_topk  # noqa: F401 (the models' routers)
from rayinfer.model.ep_dispatch import DispatchCounters, all_to_all_moe, is_capturing
from rayinfer.model.quantization import SCALE_SUFFIX, adapt_checkpoint, linear


class GatedMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with Hugging Face names (dense layers, shared experts);
    each projection may be block-fp8 (:func:`rayinfer.model.quantization.linear`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        """Raises: ValueError for an activation other than SiLU."""
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None  # fuse_gate_up's stack of the two

    def fuse_gate_up(self) -> bool:
        """Stack ``gate_proj`` and ``up_proj`` into one ``gate_up_proj`` [2I, H] (gate rows first) and drop
        them, so a step runs one GEMM (and a one-token step one GEMV, ``kernels.gemv.fused_linear``) where it
        ran two and a concatenation. fp8 blocks stack when I fills whole 128-row blocks (their scales stack
        with them; V2-Lite's dense I = 10944 does not, so such a layer stays unfused). Returns whether it
        fused."""
        gate, up = self.gate_proj, self.up_proj
        scales = [getattr(m, SCALE_SUFFIX, None) for m in (gate, up)]
        fp8 = scales[0] is not None
        aligned = not fp8 or gate.out_features % WEIGHT_BLOCK[0] == 0
        if self.gate_up_proj is not None or fp8 != (scales[1] is not None) or not aligned:
            return False
        fused = nn.Linear(gate.in_features, 2 * gate.out_features, bias=False, device="meta")
        fused.weight = nn.Parameter(torch.cat([gate.weight, up.weight]), requires_grad=False)
        if fp8:
            fused.register_parameter(SCALE_SUFFIX, nn.Parameter(torch.cat(scales), requires_grad=False))
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]."""
        if self.gate_up_proj is not None:
            gate_up = linear(x, self.gate_up_proj)
        else:
            gate_up = torch.cat([linear(x, self.gate_proj), linear(x, self.up_proj)], dim=-1)
        return linear(silu_and_mul(gate_up), self.down_proj)


def log2phy_table(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Invert a physical-to-logical map.

    Args:
        phy2log: [P] int, logical expert of each physical slot.
        num_logical: L.
    Returns:
        (log2phy [L, max_replicas] int64 padded with -1, in ascending slot order; replica_counts [L] int64).
    Raises:
        ValueError: if an entry is outside ``[0, L)`` or a logical expert has no slot.
    """
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
    if phy2log.dim() != 1 or (phy2log < 0).any() or (phy2log >= num_logical).any():
        raise ValueError(f"phy2log must be 1-D with entries in [0, {num_logical}), got {phy2log.tolist()}")
    slots: list[list[int]] = [[] for _ in range(num_logical)]
    for p, e in enumerate(phy2log.tolist()):
        slots[e].append(p)
    missing = [e for e, s in enumerate(slots) if not s]
    if missing:
        raise ValueError(f"phy2log places no replica of logical experts {missing}")
    width = max(len(s) for s in slots)
    table = torch.tensor([s + [-1] * (width - len(s)) for s in slots], dtype=torch.int64)
    return table, torch.tensor([len(s) for s in slots], dtype=torch.int64)


@dataclass(frozen=True)
class ExpertParallelism:
    """How a model's routed experts are spread over ranks.

    Attributes:
        group: torch.distributed process group of the EP ranks (gloo or NCCL); None for one process.
        num_physical_experts: P, slots over all ranks (P - L redundant); None means L.
        phy2log: initial map, [P] for every MoE layer or [num_moe_layers, P]; None means
            ``arange(P) % L``.
    """

    group: Any = None
    num_physical_experts: int | None = None
    phy2log: torch.Tensor | None = None

    def layer_phy2log(self, moe_layer: int, num_logical: int) -> torch.Tensor:
        num_physical = self.num_physical_experts or num_logical
        if self.phy2log is None:
            return torch.arange(num_physical) % num_logical
        table = torch.as_tensor(self.phy2log, dtype=torch.int64)
        return table if table.dim() == 1 else table[moe_layer]


@dataclass
class PlacementMove:
    """An expert-placement change in flight (:meth:`RoutedExperts.start_placement`).

    Attributes:
        phy2log: [P] int64, the map to switch to.
        incoming: new slot p -> its weights (and fp8 scales) as one uint8 buffer, for this rank's slots
            that change (filled in the background when they come from another rank).
        works: the posted sends and receives.
        poll: completion is read from the works alone (NCCL); else a helper thread waits for them (gloo).
    """

    phy2log: torch.Tensor
    incoming: dict[int, torch.Tensor]
    works: list
    poll: bool = True

    def __post_init__(self):
        # gloo reports a send or receive completed only once something waited for it: a helper thread
        # waits (gloo's waits block the host only). NCCL's query their CUDA event, and a wait there
        # would make the device's current stream, which the steps use, wait for the move: poll instead.
        self._waited = threading.Event()
        if self.poll or not self.works:
            self._waited.set()
        else:
            threading.Thread(target=self._wait_all, name="expert-move", daemon=True).start()

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        finally:
            self._waited.set()

    def is_done(self) -> bool:
        """Whether every transfer of this rank has completed (no wait)."""
        return self._waited.is_set() and all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Block until the transfers are done (NCCL: their data usable by the calling thread's stream)."""
        if not self.poll:  # the helper thread waited (a gloo work must not be waited for twice: it would hang)
            self._waited.wait()
            return
        for w in self.works:
            w.wait()


def moe_shape(hf_config) -> tuple[int, int]:
    """(L routed experts per MoE layer, expert groups of the routing) of a Hugging Face MoE config.

    Raises:
        ValueError: for a config without routed experts.
    """
    num_logical = getattr(hf_config, "n_routed_experts", None) or getattr(hf_config, "num_experts", None)
    if not num_logical:
        raise ValueError(f"{getattr(hf_config, 'architectures', None)} is not a MoE model: expert parallelism "
                         "needs routed experts (n_routed_experts or num_experts)")
    return int(num_logical), int(getattr(hf_config, "n_group", None) or 1)


class RoutedExperts(nn.Module):
    """The routed experts of one MoE layer, stacked, optionally spread over an expert-parallel group.

    Parameters keep Hugging Face 5.x names so its ``state_dict`` loads as is at ep=1:
    ``gate_up_proj`` [P_local, 2 * I, H] (gate rows, then up rows; ``w13``) and ``down_proj``
    [P_local, H, I] (``w2``). Buffers: ``expert_counts`` [L] int64 (tokens routed to each logical
    expert by this rank, for EPLB) and ``phy2log`` [P].

    Expert-parallel forward (every rank of the group must call it at the same step, with any number
    of tokens, zero included): dispatch and combine by all-to-all (:mod:`rayinfer.model.ep_dispatch`):
    each (token, slot) pair goes to replica ``(token * ep + rank) % replica_count`` of its logical
    expert, each token travels once to each rank that holds one of its slots, that rank runs its fused
    MoE over what it received, and the outputs come back by the reverse all-to-all to be summed at
    home. The result equals ep=1 up to float summation order. ``dispatch_capacity`` (None: exact
    splits, one count exchange read by the host) sets fixed-size buffers of that many rows per rank
    pair instead (no host read; taken as the batch size while a CUDA graph is captured, so every rank
    must then replay the same padded size). ``dispatch_counters`` counts the rows moved.

    In batch-invariant mode (``kernels.batch_invariant``) each (token, slot)'s output is kept apart
    ([N, k, H] float32, :func:`~rayinfer.kernels.fused_moe.fused_moe_slots`) on the rank that computed
    it and comes back as such, and the home rank adds a token's k outputs in slot order: its row is the
    bits of ep=1 whatever the other ranks hold, for k float32 rows per token on the way back instead
    of one.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        group: Any = None,
        phy2log: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        """Args: num_experts L; sizes H and I; group and phy2log as in :class:`ExpertParallelism`.

        Raises:
            ValueError: if P is not a multiple of the group size or phy2log is invalid.
        """
        super().__init__()
        self.num_logical_experts = num_experts
        self.intermediate_size = intermediate_size
        self.group = group
        self.ep_size = dist.get_world_size(group) if group is not None else 1
        self.ep_rank = dist.get_rank(group) if group is not None else 0
        phy2log = torch.arange(num_experts) if phy2log is None else torch.as_tensor(phy2log, dtype=torch.int64)
        self.num_physical_experts = phy2log.numel()
        if self.num_physical_experts % self.ep_size:
            raise ValueError(f"{self.num_physical_experts} physical experts do not split over {self.ep_size} ranks")
        self.num_local_experts = self.num_physical_experts // self.ep_size
        self.first_local = self.ep_rank * self.num_local_experts
        self.dispatch_capacity: int | None = None
        self.dispatch_counters = DispatchCounters()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, intermediate_size, **kw))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.num_shared = 0  # fused shared experts in slots num_local .. num_local + num_shared - 1
        counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.register_buffer("expert_counts", counts, persistent=False)
        for name in ("phy2log", "log2phy", "replica_counts"):  # filled by _set_placement
            self.register_buffer(name, torch.empty(0, dtype=torch.int64, device=device), persistent=False)
        self._set_placement(phy2log)

    @property
    def w13(self) -> torch.Tensor:
        return self.gate_up_proj

    @property
    def w2(self) -> torch.Tensor:
        return self.down_proj

    @property
    def is_fp8(self) -> bool:
        return self.gate_up_proj.dtype == FP8_DTYPE

    def _scales(self) -> dict:
        """fused_moe's fp8 keyword arguments (none for 16/32-bit experts)."""
        if not self.is_fp8:
            return {}
        return dict(w13_scale=self.gate_up_proj_scale_inv, w2_scale=self.down_proj_scale_inv)

    def quantize_fp8(self) -> None:
        """Hold the experts as DeepSeek-V3's fp8 blocks (``kernels.block_fp8``): ``gate_up_proj`` and
        ``down_proj`` float8_e4m3fn, with ``gate_up_proj_scale_inv`` [P, 2 * ceil(I/128), ceil(H/128)]
        (the gate and the up half in blocks of their own, ``kernels.fused_moe.quantize_w13``) and
        ``down_proj_scale_inv`` [P, ceil(H/128), ceil(I/128)] float32. On meta parameters (the loader's
        build) the new ones are meta; real weights are quantized. The fused MoE kernel dequantizes in its
        GEMMs."""
        bn, bk = WEIGHT_BLOCK
        w13, w2 = self.gate_up_proj, self.down_proj
        p, _, h = w13.shape
        if w13.is_meta:
            q13, q2 = (torch.empty(w.shape, dtype=FP8_DTYPE, device="meta") for w in (w13, w2))
            s13 = torch.empty((p, 2 * -(-self.intermediate_size // bn), -(-h // bk)), device="meta")
            s2 = torch.empty(scale_shape(w2.shape), device="meta")
        else:
            (q13, s13), (q2, s2) = quantize_w13(w13.detach()), quantize_block_fp8(w2.detach())
        self.gate_up_proj = nn.Parameter(q13, requires_grad=False)
        self.down_proj = nn.Parameter(q2, requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(s13.float(), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(s2.float(), requires_grad=False)

    def _set_placement(self, phy2log: torch.Tensor) -> None:
        log2phy, replica_counts = log2phy_table(phy2log, self.num_logical_experts)
        device = self.expert_counts.device
        self.phy2log = torch.as_tensor(phy2log, dtype=torch.int64).to(device)
        self.log2phy = log2phy.to(device)
        self.replica_counts = replica_counts.to(device)
        self._identity_placement = self.ep_size == 1 and torch.equal(
            self.phy2log.cpu(), torch.arange(self.num_logical_experts))

    @property
    def expert_map(self) -> ExpertMap | None:
        """Logical ids -> this rank's slots; None where that is the identity (one rank, no replicas)."""
        if self._identity_placement:
            return None
        return ExpertMap(self.log2phy, self.replica_counts, self.first_local, self.num_local_experts)

    @property
    def can_fuse_shared(self) -> bool:
        """Shared experts can join this layer's slots: one rank, each logical expert in its own slot (under
        EP or with replicas the shared experts stay a separate MLP)."""
        return self.group is None and self._identity_placement and self.num_shared == 0

    def accepts_shared(self, shared: GatedMLP) -> bool:
        """Whether :meth:`fuse_shared_experts` can take ``shared``: :attr:`can_fuse_shared`, an MLP of S * I
        channels of the experts' hidden size, in the experts' dtype, and for fp8 blocks that align with
        the experts' (I a multiple of 128: its scales then copy as they are, no second rounding)."""
        gate, inter = shared.gate_proj.weight, self.intermediate_size
        same_dtype = all(m.weight.dtype == self.w13.dtype for m in (shared.gate_proj, shared.up_proj, shared.down_proj))
        return (self.can_fuse_shared and gate.shape[0] % inter == 0 and gate.shape[1] == self.w13.shape[2]
                and same_dtype and (not self.is_fp8 or inter % WEIGHT_BLOCK[0] == 0))

    @torch.no_grad()
    def fuse_shared_experts(self, shared: GatedMLP) -> None:
        """Append a shared-expert MLP as ``S = I_shared / I`` extra experts (slots ``L .. L+S-1``).

        An MLP of intermediate size ``S * I`` is the sum of S MLPs of size I, one per slice of its
        intermediate channels (SiLU-and-mul acts per channel), so the shared experts run inside the fused
        MoE kernel as experts every token picks with weight 1 (``moe_routing.append_shared_experts``),
        instead of three GEMMs, a concatenation, an activation and an add of their own (after SGLang's
        shared-experts fusion). The parameters are replaced by [L + S, ...] copies; the expert-load
        counters stay [L] (the shared slots are not counted).

        Raises:
            ValueError: when :meth:`accepts_shared` is False.
        """
        inter = self.intermediate_size
        gate, up, down = shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight
        if not self.accepts_shared(shared):
            raise ValueError(f"cannot fuse a shared MLP of {tuple(gate.shape)} into {self.num_local_experts} "
                             f"experts of intermediate size {inter} (ep={self.ep_size}, fused={self.num_shared})")
        num_shared = gate.shape[0] // inter

        def slots(g: torch.Tensor, u: torch.Tensor, d: torch.Tensor, rows: int):
            # gate/up [S * rows, X] -> [S, 2 * rows, X]; down [Y, S * rows] -> [S, Y, rows] (also their scales)
            w13 = torch.cat([g.reshape(num_shared, rows, -1), u.reshape(num_shared, rows, -1)], dim=1)
            return w13, d.reshape(d.shape[0], num_shared, rows).transpose(0, 1).contiguous()

        w13, w2 = slots(gate, up, down, inter)
        self.gate_up_proj = nn.Parameter(torch.cat([self.gate_up_proj.data, w13]), requires_grad=False)
        self.down_proj = nn.Parameter(torch.cat([self.down_proj.data, w2]), requires_grad=False)
        if self.is_fp8:  # blocks align (accepts_shared): the scales copy as they are
            s13, s2 = slots(shared.gate_proj.weight_scale_inv, shared.up_proj.weight_scale_inv,
                            shared.down_proj.weight_scale_inv, inter // WEIGHT_BLOCK[0])
            self.gate_up_proj_scale_inv = nn.Parameter(torch.cat([self.gate_up_proj_scale_inv.data, s13]),
                                                       requires_grad=False)
            self.down_proj_scale_inv = nn.Parameter(torch.cat([self.down_proj_scale_inv.data, s2]),
                                                    requires_grad=False)
        self.num_shared = num_shared

    def _local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[N, k] logical ids (-1 = none) -> ids of this rank's slots, -1 where another rank computes."""
        expert_map = ExpertMap(self.log2phy, self.replica_counts, self.first_local, self.num_local_experts)
        return expert_map.local_ids(topk_ids)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum of each token's routed experts; counts the tokens per logical expert.

        Args:
            hidden: [T, H] this rank's tokens.
            topk_ids: [T, k] int64 logical expert ids.
            topk_weights: [T, k] float routing weights.
            residual: [T, H] like hidden, or None: the sum is added into it in place and it is returned
                (on one rank inside the fused kernel's last launch).
        Returns:
            [T, H], hidden's dtype.
        Side effects: ``expert_counts += bincount(topk_ids)`` (on one rank inside the alignment kernel);
        under EP, collectives on ``group``.

        With fused shared experts (:meth:`fuse_shared_experts`) topk_ids / topk_weights are [T, k + S], the
        last S slots the shared experts (``moe_routing.append_shared_experts``).
        """
        if self.group is None:
            return fused_moe(hidden, self.w13, self.w2, topk_ids, topk_weights, self.expert_map,
                             expert_load=self.expert_counts, residual=residual, **self._scales())
        out = self._forward_ep(hidden, topk_ids, topk_weights)
        return out if residual is None else residual.add_(out)

    def _forward_ep(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.reshape(-1).long()
        self.expert_counts.index_add_(0, ids.clamp(min=0), (ids >= 0).long())
        invariant = is_batch_invariant()
        moe = fused_moe_slots if invariant else fused_moe
        scales = self._scales()

        def experts(rows: torch.Tensor, slot_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
            if rows.shape[0] == 0:  # nothing came here (the collectives still ran)
                shape = (0, slot_ids.shape[1], rows.shape[1]) if invariant else (0, rows.shape[1])
                return rows.new_zeros(shape, dtype=torch.float32 if invariant else rows.dtype)
            return moe(rows, self.w13, self.w2, slot_ids, weights, None, **scales)

        capacity = self.dispatch_capacity
        if capacity is None and is_capturing(hidden):
            capacity = hidden.shape[0]  # a graph: every rank replays the same padded batch size
        out = all_to_all_moe(hidden, topk_ids, topk_weights, experts, group=self.group, log2phy=self.log2phy,
                             replica_counts=self.replica_counts, num_local=self.num_local_experts,
                             capacity=capacity, counters=self.dispatch_counters)
        if invariant:  # [T, k, H] float32, each slot's output from the rank that computed it
            out = sum_slots(out).to(hidden.dtype)
        return out

    def read_expert_counts(self, reset: bool = False) -> torch.Tensor:
        """Tokens this rank routed to each logical expert since the last reset: [L] int64 (a copy)."""
        counts = self.expert_counts.clone()
        if reset:
            self.expert_counts.zero_()
        return counts

    def load_expert_weight(self, logical_id: int, kind: str, weight: torch.Tensor) -> None:
        """Copy one checkpoint expert projection into every local slot that holds ``logical_id``.

        Args:
            logical_id: the expert index of the checkpoint name ``experts.{e}.{kind}.weight``.
            kind: "gate_proj" or "up_proj" ([I, H]) or "down_proj" ([H, I]).
            weight: in the model dtype, or float8_e4m3fn for fp8 experts (its scale comes through
                :meth:`load_expert_scale`; ``MoEModelMixin.load_weights`` quantizes or dequantizes a
                checkpoint's tensors to the experts' form first).
        Raises:
            ValueError: on a bad kind, id or shape, or a weight in fp8 for 16/32-bit experts or vice versa.
        """
        if not 0 <= logical_id < self.num_logical_experts or kind not in ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"no expert weight {logical_id}.{kind}")
        if (weight.dtype == FP8_DTYPE) != self.is_fp8:
            raise ValueError(f"expert {logical_id}.{kind}: a {weight.dtype} weight for experts held in {self.w13.dtype}")
        for slot in self._local_slots_of(logical_id):
            dst = self._expert_rows(self.down_proj if kind == "down_proj" else self.gate_up_proj, slot, kind,
                                    self.intermediate_size)
            if dst.shape != weight.shape:
                raise ValueError(f"expert {logical_id}.{kind}: expected {tuple(dst.shape)}, got {tuple(weight.shape)}")
            dst.copy_(weight)

    def load_expert_scale(self, logical_id: int, kind: str, scale_inv: torch.Tensor) -> None:
        """Copy one fp8 expert projection's ``weight_scale_inv`` ([I/128, ceil(H/128)] for gate/up,
        [ceil(H/128), I/128] for down) into its slots' scales. Raises: ValueError on 16/32-bit experts,
        a bad kind or id, or a shape mismatch."""
        if not self.is_fp8 or not 0 <= logical_id < self.num_logical_experts:
            raise ValueError(f"no fp8 expert scale {logical_id}.{kind} (experts held in {self.w13.dtype})")
        rows = -(-self.intermediate_size // WEIGHT_BLOCK[0])  # the gate half's scale rows
        for slot in self._local_slots_of(logical_id):
            dst = self._expert_rows(self.down_proj_scale_inv if kind == "down_proj" else self.gate_up_proj_scale_inv,
                                    slot, kind, rows)
            if dst.shape != scale_inv.shape:
                raise ValueError(f"expert {logical_id}.{kind} scale: expected {tuple(dst.shape)}, "
                                 f"got {tuple(scale_inv.shape)}")
            dst.copy_(scale_inv)

    @staticmethod
    def _expert_rows(param: torch.Tensor, slot: int, kind: str, rows: int) -> torch.Tensor:
        if kind == "down_proj":
            return param.data[slot]
        return param.data[slot, :rows] if kind == "gate_proj" else param.data[slot, rows:]

    def load_stacked(self, name: str, weight: torch.Tensor) -> None:
        """Copy a Hugging Face 5.x stacked tensor (``gate_up_proj`` [L, 2I, H] or ``down_proj`` [L, H, I];
        for fp8 experts also ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``). A 16/32-bit weight for
        fp8 experts is quantized (with its scales).

        Raises:
            ValueError: on a bad name or shape, or fp8 weights for 16/32-bit experts.
        """
        param = self._parameters.get(name) if name in _STACKED_NAMES else None
        if param is None or weight.shape[1:] != param.shape[1:] or weight.shape[0] != self.num_logical_experts:
            raise ValueError(f"stacked expert weight {name} of shape {tuple(weight.shape)} does not fit {self}")
        if weight.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
            raise ValueError(f"stacked expert weight {name}: fp8 for experts held in {param.dtype}")
        local = self.phy2log[self.first_local : self.first_local + self.num_local_experts].to(weight.device)
        if param.dtype == FP8_DTYPE and weight.dtype != FP8_DTYPE:
            quantize = quantize_w13 if name == "gate_up_proj" else quantize_block_fp8
            q, scale = quantize(weight[local].to(param.device))
            param.data[: self.num_local_experts].copy_(q)
            self._parameters[f"{name}_scale_inv"].data[: self.num_local_experts].copy_(scale)
            return
        param.data[: self.num_local_experts].copy_(weight[local])

    def _local_slots_of(self, logical_id: int) -> list[int]:
        local = self.phy2log[self.first_local : self.first_local + self.num_local_experts].tolist()
        return [s for s, e in enumerate(local) if e == logical_id]

    @torch.no_grad()
    def update_placement(self, new_phy2log: torch.Tensor) -> None:
        """Switch to a new physical-to-logical map now, moving expert weights in place (collective):
        :meth:`start_placement` then :meth:`finish_placement`.

        Every rank of the group calls it with the same map at the same step.

        Raises:
            ValueError: if P changes or the map is invalid (nothing is modified then).
        """
        self.finish_placement(self.start_placement(new_phy2log))

    @torch.no_grad()
    def start_placement(self, new_phy2log: torch.Tensor, group: Any = None) -> "PlacementMove":
        """Start moving expert weights for a new physical-to-logical map, without switching to it: the layer
        keeps computing with its current map and weights until :meth:`finish_placement`.

        A slot whose logical expert changes is filled from a replica on its own rank when there is one,
        else from the first old replica on another rank (point-to-point send/recv, posted here and
        completed in the background). The weights to send are copied now, so steps may run meanwhile.
        Every rank of the group calls it with the same map (at any step; the sends and receives match by
        tag). ``group``: the process group of the moves, the ranks of :attr:`group` in the same order;
        give a group of its own while steps run (NCCL and gloo order one group's operations, so moves
        posted between a step's collectives would otherwise interleave with them); None uses the layer's.

        Args:
            new_phy2log: [P] int, P unchanged (EPLB keeps the slot count fixed).
        Returns:
            the move in flight; its staging buffers hold one copy of each slot this rank sends or receives.
        Raises:
            ValueError: if P changes, the map is invalid, or the layer has fused shared experts (nothing
                is posted then).
        Source: after DeepSeek EPLB's rebalancing step and vLLM's ``rearrange_expert_weights_inplace``.
        """
        new = torch.as_tensor(new_phy2log, dtype=torch.int64).cpu()
        if self.num_shared:
            raise ValueError("a layer with fused shared experts has one fixed placement (one rank, no replicas)")
        if new.numel() != self.num_physical_experts:
            raise ValueError(f"new phy2log has {new.numel()} slots, the layer has {self.num_physical_experts}")
        log2phy_table(new, self.num_logical_experts)  # validates
        old, new_list = self.phy2log.cpu().tolist(), new.tolist()
        per = self.num_local_experts
        replicas: dict[int, list[int]] = {}
        for q, e in enumerate(old):
            replicas.setdefault(e, []).append(q)
        plan = []  # (new slot p, source rank, old source slot q), in ascending p on every rank
        for p, e in enumerate(new_list):
            if old[p] == e:
                continue
            same_rank = [q for q in replicas[e] if q // per == p // per]
            q = same_rank[0] if same_rank else replicas[e][0]
            plan.append((p, q // per, q))
        group = group if group is not None else self.group
        me = self.ep_rank
        sources = {q: self._pack(q - self.first_local) for _, src, q in plan if src == me}
        received, pending = {}, []
        for p, src, q in plan:
            dst = p // per
            if src == me and dst != me:
                pending.append(dist.isend(sources[q], dist.get_global_rank(group, dst), group=group, tag=p))
            elif dst == me and src != me:
                size = sum(t[0].numel() * t.element_size() for t in self._slot_params())
                received[p] = torch.empty(size, dtype=torch.uint8, device=self.gate_up_proj.device)
                pending.append(dist.irecv(received[p], dist.get_global_rank(group, src), group=group, tag=p))
        incoming = {p: sources[q] if src == me else received[p] for p, src, q in plan if p // per == me}
        return PlacementMove(new, incoming, pending, poll=group is not None and dist.get_backend(group) == "nccl")

    @torch.no_grad()
    def finish_placement(self, move: "PlacementMove") -> None:
        """Wait for a move's transfers, copy its weights into their slots and switch to its map.

        Every rank of the group calls it at the same step (the map must change everywhere at once).
        Parameters keep their storage; the map buffers are replaced (a captured CUDA graph must be
        recaptured). Expert counts are logical and are kept.
        """
        move.wait()
        for p, flat in move.incoming.items():
            self._unpack(p - self.first_local, flat)
        self._set_placement(move.phy2log)

    def _slot_params(self) -> list[torch.Tensor]:
        return [p for name in _STACKED_NAMES if (p := self._parameters.get(name)) is not None]

    def _pack(self, slot: int) -> torch.Tensor:
        """One slot's weights (and fp8 scales) as one uint8 buffer, for a point-to-point move."""
        return torch.cat([p.data[slot].reshape(-1).view(torch.uint8) for p in self._slot_params()])

    def _unpack(self, slot: int, flat: torch.Tensor) -> None:
        offset = 0
        for p in self._slot_params():
            n = p[slot].numel() * p.element_size()
            p.data[slot].copy_(flat[offset : offset + n].view(p.dtype).view_as(p[slot]))
            offset += n


_STACKED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv")


class MoEModelMixin:
    """Expert-load reading, rebalancing and Hugging Face weight loading for MoE models.

    A model using it is an ``nn.Module`` with ``config.num_hidden_layers``; its routed-expert layers
    are found as :class:`RoutedExperts` submodules in layer order.
    """

    def expert_layers(self) -> list[RoutedExperts]:
        return [m for m in self.modules() if isinstance(m, RoutedExperts)]

    def expert_load(self, reset: bool = False) -> torch.Tensor:
        """This rank's tokens per logical expert of every MoE layer: [num_moe_layers, L] int64 (EPLB input)."""
        return torch.stack([layer.read_expert_counts(reset) for layer in self.expert_layers()])

    def update_expert_placement(self, phy2log: torch.Tensor) -> None:
        """Apply EPLB's new map, [num_moe_layers, P], to every MoE layer now (collective; see
        ``RoutedExperts.update_placement``)."""
        self.finish_expert_placement(self.start_expert_placement(phy2log))

    def start_expert_placement(self, phy2log: torch.Tensor, group: Any = None) -> list[PlacementMove]:
        """Start moving every MoE layer's weights to EPLB's new map, [num_moe_layers, P], in the background
        (``RoutedExperts.start_placement``; ``group``: a process group for the moves). Raises ValueError
        for a map of the wrong shape (nothing is posted then)."""
        layers = self.expert_layers()
        if len(phy2log) != len(layers):
            raise ValueError(f"phy2log has {len(phy2log)} rows for {len(layers)} MoE layers")
        return [layer.start_placement(row, group) for layer, row in zip(layers, phy2log)]

    def finish_expert_placement(self, moves: list[PlacementMove]) -> None:
        """Switch every MoE layer to its started move (same step on every rank; waits for transfers)."""
        for layer, move in zip(self.expert_layers(), moves):
            layer.finish_placement(move)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors (a safetensors checkpoint or a 5.x ``state_dict``).

        Accepts per-expert names (``...experts.{e}.gate_proj.weight``, as checkpoints store them) and
        5.x stacked names (``...experts.gate_up_proj``); under EP only this rank's experts are kept.
        Layers ``>= num_hidden_layers`` are DeepSeek's multi-token-prediction (MTP) modules
        (``num_nextn_predict_layers``): skipped here, as Hugging Face does (DeepSeek-V3's own
        ``load_weights`` renames them to its ``mtp`` modules first when those are built).

        FP8 block-quantized checkpoints (DeepSeek-V3's ``weight`` float8_e4m3fn + ``weight_scale_inv``,
        see :func:`~rayinfer.model.quantization.adapt_checkpoint`): a quantized dense linear
        (:mod:`rayinfer.model.quantization`) takes both as stored, one held in the model dtype
        (``kv_b_proj``, ``quantization="none"``) gets the weight dequantized, and a 16/32-bit checkpoint
        weight is quantized for a quantized linear. Routed experts alike: fp8 experts
        (:meth:`RoutedExperts.quantize_fp8`) take per-expert ``weight`` + ``weight_scale_inv`` as stored
        (or quantize a 16/32-bit checkpoint), 16/32-bit experts get an fp8 checkpoint's weights dequantized.

        Returns:
            names of the parameters and buffers written (experts as ``...experts.gate_up_proj`` etc.).
        Raises:
            KeyError: for a name the model does not have; ValueError: on a shape mismatch, or an fp8
            weight without its scale (or a scale without its weight).
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        params.update(self.named_buffers(remove_duplicate=False))
        experts = {name: m for name, m in self.named_modules() if isinstance(m, RoutedExperts)}
        num_layers = self.config.num_hidden_layers
        loaded: set[str] = set()

        def kept():
            for name, tensor in named_tensors:
                layer = re.match(r"model\.layers\.(\d+)\.", name)
                if not ((layer and int(layer.group(1)) >= num_layers) or name.endswith("rotary_emb.inv_freq")):
                    yield name, tensor

        # per-expert checkpoint names stand for their experts' stacked parameters, so adapt_checkpoint
        # quantizes a 16/32-bit expert for fp8 experts and dequantizes an fp8 one for 16/32-bit experts
        # as it does for the dense linears
        targets = dict(params)
        for prefix, layer in experts.items():
            for e in range(layer.num_logical_experts):
                for kind in ("gate_proj", "up_proj", "down_proj"):
                    targets[f"{prefix}.{e}.{kind}.weight"] = (layer.down_proj if kind == "down_proj"
                                                              else layer.gate_up_proj)[0]
        for name, tensor in adapt_checkpoint(kept(), targets):
            per_expert = re.fullmatch(
                r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)", name)
            stacked = re.fullmatch(r"(.*\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?", name)
            if per_expert and per_expert.group(1) in experts:
                prefix, e, kind, leaf = per_expert.groups()
                layer, stacked_name = experts[prefix], "down_proj" if kind == "down_proj" else "gate_up_proj"
                if leaf == SCALE_SUFFIX:
                    layer.load_expert_scale(int(e), kind, tensor)
                    loaded.add(f"{prefix}.{stacked_name}_scale_inv")
                else:
                    layer.load_expert_weight(int(e), kind, tensor)
                    loaded.add(f"{prefix}.{stacked_name}")
            elif stacked and stacked.group(1) in experts:
                layer = experts[stacked.group(1)]
                layer.load_stacked(stacked.group(2) + (stacked.group(3) or ""), tensor)
                loaded.add(name)
                if layer.is_fp8 and tensor.dtype != FP8_DTYPE and not stacked.group(3):
                    loaded.add(f"{name}_scale_inv")
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: expected {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
            else:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
        return loaded
