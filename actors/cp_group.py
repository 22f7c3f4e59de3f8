"""A context-parallel replica on Ray: ``cp`` EngineActors in one placement group, rank 0 on bundle 0 and
peer r on bundle r. Every rank is a full replica that serves requests of its own; rank 0 also leads the
long prefills, and the peers join them.

Thin wiring around ``rayinfer.engine.context_parallel`` (where the math and its choices are described):

- the ``cp`` processes form one torch.distributed group (gloo on CPU, NCCL on GPU), the replica's CP
  group, joined by :func:`start_cp_group` once every rank has loaded the model;
- the Router sends prompts of at least ``parallel.cp_min_tokens`` tokens to rank 0, and shorter ones to
  whichever rank of the fleet holds the fewest requests, peers included, so the peers do useful work
  while no long prompt is being prefilled;
- rank 0's engine thread starts a CP prefill on the peers with one actor call each
  (``EngineActor.cp_prefill``), runs its own share into its KV cache, and waits for them. A peer runs its
  share on its own engine thread between two of its steps (``AsyncLLMEngine.run_on_loop``), so its own
  requests pause for that long, and its scratch cache for the share is allocated then and freed after.
  Prefills run one at a time, in the same order everywhere, so the collectives line up;
- rank 0 decodes the long request after its prefill, as any other of its requests.

A rank 0 prompt whose uncached part is under ``cp_min_tokens`` (a prefix-cache hit) runs on rank 0 alone;
a longer one reuses the hit (rank 0 broadcasts its K/V) and CP computes only the rest.

A peer that dies is not replaced as part of the group: rank 0 pings its peers before each CP prefill
(:func:`check_cp_peers`); when one does not answer, rank 0 switches CP off and computes that prompt and
all later ones alone (a peer restarted by Ray serves requests of its own but no longer joins prefills).
A peer that fails mid-prefill fails that request and switches CP off the same way. Rank 0 restarted by
Ray runs without CP.

Memory: on GPU a peer sizes its KV pool like any replica; its share's scratch cache (one layer's K/V of the
prompt) and activations come out of the engine's activation reserve, as rank 0's share's activations do.
"""
from __future__ import annotations

import asyncio

import torch

from rayinfer.placement.groups import free_port, node_ip


def cp_backend(device: torch.device) -> str:
    """The CP group's collective backend on ``device``: "nccl" on CUDA, else "gloo"."""
    return "nccl" if device.type == "cuda" else "gloo"


PEER_CHECK_TIMEOUT_S = 30.0


def check_cp_peers(peers: list, timeout_s: float = PEER_CHECK_TIMEOUT_S) -> None:
    """Raises :class:`~rayinfer.engine.context_parallel.CPRankLost` unless every peer answers
    ``cp_ping`` within ``timeout_s`` as a CP peer. Called on rank 0's engine thread before each CP prefill,
    so a dead peer costs one failed ping instead of a prefill stuck in a collective."""
    import concurrent.futures

    from rayinfer.engine.context_parallel import CPRankLost

    # futures, not ray.get: called on the engine thread of an async actor, where ray.get draws Ray's
    # "blocking ray.get inside async actor" warning (the event loop is not blocked here)
    futures = [p.cp_ping.remote().future() for p in peers]
    done, _ = concurrent.futures.wait(futures, timeout=timeout_s)
    try:
        if len(done) < len(futures):
            raise TimeoutError(f"{len(futures) - len(done)} of {len(futures)} peers did not answer")
        ranks = [f.result() for f in futures]
    except Exception as e:  # noqa: BLE001 - RayActorError, TimeoutError, ...: the peer is gone either way
        raise CPRankLost(f"a CP peer did not answer within {timeout_s:.0f} s: {e!r}") from e
    if ranks != list(range(1, len(peers) + 1)):
        raise CPRankLost(f"CP peers answered ranks {ranks}, expected 1..{len(peers)} (restarted outside the group)")


def cp_address() -> tuple[str, int]:
    """(node IP, a free port) for the CP group's rendezvous, asked of rank 0."""
    return node_ip(), free_port()


async def start_cp_group(rank0, peers: list, min_tokens: int, timeout_s: float = 300.0) -> None:
    """Form a replica's CP group: rank 0 and its peers (EngineActors) join at once; rank 0's engine then
    prefills prompts of at least ``min_tokens`` uncached tokens with CP, the peers joining.

    Raises:
        ValueError: from rank 0 for a model or config CP does not support (see
            ``LLMEngine.set_context_parallel``).
    """
    address, port = await rank0.cp_address.remote()
    cp_size = len(peers) + 1
    await asyncio.gather(rank0.join_cp_group.remote(address, port, peers, min_tokens, timeout_s),
                         *[p.join_cp_group_as_peer.remote(address, port, r, cp_size, timeout_s)
                           for r, p in enumerate(peers, start=1)])
