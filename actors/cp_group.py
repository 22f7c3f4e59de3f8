"""A context-parallel replica on Ray: rank 0 is the replica's EngineActor; ranks ``1..cp-1`` are
:class:`CPPeerActor` s that hold the model and join rank 0's long prefills.

Thin wiring around ``rayinfer.engine.context_parallel`` (where the math and its choices are described):

- the replica's placement group has ``cp`` bundles (one device each, ``rayinfer.placement``): rank 0
  on bundle 0, peer r on bundle r;
- the ``cp`` processes form one torch.distributed group (gloo on CPU, NCCL on GPU), the replica's CP
  group, joined by :func:`start_cp_group` once every rank has loaded the model;
- rank 0's engine thread starts a CP prefill on the peers with one actor call each
  (:meth:`CPPeerImpl.prefill`), runs its own share into its KV cache, and waits for them. Prefills
  run one at a time, in the same order everywhere, so the collectives line up.

Prompts under ``parallel.cp_min_tokens`` run on rank 0 alone: the peers idle meanwhile (a peer serves
no requests of its own). A peer that dies is not replaced as part of the group: rank 0's CP prefills
then fail (that request only) until the replica is restarted; rank 0 restarted by Ray runs without CP.
"""

from __future__ import annotations

import asyncio
import logging

import ray
import torch

from rayinfer.engine.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig
from rayinfer.placement.groups import free_port, init_process_group, node_ip

logger = logging.getLogger(__name__)


def cp_backend(device: torch.device) -> str:
    """The CP group's collective backend on ``device``: "nccl" on CUDA, else "gloo"."""
    return "nccl" if device.type == "cuda" else "gloo"


class CPPeerImpl:
    """CP rank ``cp_rank`` >= 1 of one replica: the model (same weights as rank 0's; dummy weights are
    seeded alike) and, after :meth:`start`, its :class:`~rayinfer.engine.context_parallel.CPPeer`.

    Args:
        model_config, engine_config: the replica's configs (device, dtype, block size, KV cache dtype).
        cp_rank, cp_size: this rank and the replica's ``parallel.cp``.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, cp_rank: int, cp_size: int):
        from rayinfer.engine.llm_engine import resolve_device
        from rayinfer.model.loader import load_model, parse_dtype

        self.device = resolve_device(engine_config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's one GPU as device 0
        dtype = parse_dtype(model_config.dtype, self.device)
        kv_name = KV_CACHE_DTYPES[engine_config.kv_cache_dtype]
        self.kv_dtype = getattr(torch, kv_name) if kv_name else dtype
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_config.model, dtype, self.device, model_config.load_format,
                                seed=model_config.seed, quantization=model_config.quantization)
        self.block_size, self.cp_rank, self.cp_size = engine_config.block_size, cp_rank, cp_size
        self.peer = None

    def start(self, address: str, port: int, timeout_s: float = 300.0) -> None:
        """Join the CP group (blocks until every rank has joined)."""
        from rayinfer.engine.context_parallel import CPPeer, torch_all_gather

        init_process_group(self.cp_rank, self.cp_size, address, port, cp_backend(self.device), timeout_s)
        self.peer = CPPeer(self.model, self.cp_rank, self.cp_size, torch_all_gather(), self.block_size, self.kv_dtype)

    def prefill(self, token_ids: list[int]) -> int:
        """This rank's share of one CP prefill (rank 0 runs its share at once); returns its token count."""
        assert self.peer is not None, "CPPeerImpl.prefill before start"
        return self.peer.prefill(token_ids)

    def stats(self) -> dict:
        return {"cp_rank": self.cp_rank, "num_cp_prefills": self.peer.num_prefills if self.peer else 0}


CPPeerActor = ray.remote(CPPeerImpl)


def cp_address() -> tuple[str, int]:
    """(node IP, a free port) for the CP group's rendezvous, asked of rank 0."""
    return node_ip(), free_port()


async def start_cp_group(rank0, peers: list, min_tokens: int, timeout_s: float = 300.0) -> None:
    """Form a replica's CP group: rank 0 (an EngineActor) and its peers join at once; rank 0's engine
    then prefills prompts of at least ``min_tokens`` uncached tokens with CP.

    Raises:
        ValueError: from rank 0 for a model or config CP does not support (see
            ``LLMEngine.set_context_parallel``).
    """
    address, port = await rank0.cp_address.remote()
    await asyncio.gather(rank0.join_cp_group.remote(address, port, peers, min_tokens, timeout_s),
                         *[p.start.remote(address, port, timeout_s) for p in peers])
