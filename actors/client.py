"""EngineClient: the caller's side of a set of engine replicas (used by the batch job and Serve)."""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

import ray

from rayinfer.actors.engine_actor import EngineActor
from rayinfer.actors.router import ReplicaLoadBalancer
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.types import Completion, RequestOutput, SamplingParams


class EngineClient:
    """Starts NORMAL replicas as EngineActors and routes requests to them.

    Args:
        model_config, engine_config: every replica's config.
        num_replicas: data-parallel NORMAL replicas.
        num_cpus_per_replica, num_gpus_per_replica: Ray resources of each EngineActor.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, num_replicas: int = 1,
                 num_cpus_per_replica: float = 1, num_gpus_per_replica: float = 0):
        self.replicas = [
            EngineActor.options(num_cpus=num_cpus_per_replica, num_gpus=num_gpus_per_replica,
                                max_concurrency=4096).remote(model_config, engine_config, i)
            for i in range(num_replicas)
        ]
        self.info = ray.get([r.ready.remote() for r in self.replicas])
        self.max_model_len = self.info[0]["max_model_len"]
        self.balancer = ReplicaLoadBalancer(num_replicas, engine_config.block_size)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas from the replica the balancer picks.

        If the consumer stops early (client disconnect, cancellation), the request is aborted on its
        replica and its KV blocks are freed.

        Raises:
            ValueError: when the engine rejects the request (Ray's wrapper is unwrapped).
        """
        request_id = request_id or uuid.uuid4().hex
        idx = self.balancer.pick(prompt_token_ids)
        replica = self.replicas[idx]
        gen = replica.generate.options(num_returns="streaming").remote(request_id, prompt_token_ids, params, **kwargs)
        finished = False
        try:
            async for ref in gen:
                try:
                    out = await ref
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, ValueError):
                        finished = True
                        raise ValueError(str(e.cause)) from None
                    raise
                yield out
                if out.finished:
                    finished = True
        finally:
            self.balancer.done(idx)
            if not finished:
                replica.abort.remote(request_id)
                ray.cancel(gen)

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> Completion:
        """Run one request to the end (errors in ``Completion.error``)."""
        request_id = request_id or uuid.uuid4().hex
        idx = self.balancer.pick(prompt_token_ids)
        try:
            return await self.replicas[idx].complete.remote(request_id, prompt_token_ids, params, **kwargs)
        finally:
            self.balancer.done(idx)

    async def stats(self) -> list[dict]:
        """Each replica's gauges and counters."""
        return await asyncio.gather(*[r.stats.remote() for r in self.replicas])

    def shutdown(self) -> None:
        for r in self.replicas:
            ray.kill(r)
