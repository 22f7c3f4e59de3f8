"""EngineActor: one engine replica as a Ray actor (thin: all logic lives in rayinfer.engine)."""

from __future__ import annotations

import logging
from typing import AsyncIterator

import ray

from rayinfer.engine.async_engine import AsyncLLMEngine
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.types import Completion, RequestOutput, SamplingParams


class EngineActorImpl:
    """One replica (role NORMAL, PREFILL or DECODE per ``engine_config.role``).

    Methods are async: the engine steps on its own thread, so many requests stream concurrently.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, replica_id: int = 0):
        logging.basicConfig(level=logging.INFO)
        self.replica_id = replica_id
        self.engine = AsyncLLMEngine(LLMEngine(model_config, engine_config))

    def ready(self) -> dict:
        """Returns the replica's static facts once the model is loaded."""
        e = self.engine.engine
        return {"replica_id": self.replica_id, "role": e.role.value, "max_model_len": e.max_model_len,
                "device": str(e.device), "num_blocks": e.scheduler.config.num_blocks}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas (a Ray streaming generator). Raises ValueError for bad input."""
        async for out in self.engine.generate(request_id, prompt_token_ids, params, **kwargs):
            yield out

    async def complete(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs) -> Completion:
        """Run a request to the end; errors come back in ``Completion.error``."""
        return await self.engine.complete(request_id, prompt_token_ids, params, **kwargs)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, **self.engine.stats()}


EngineActor = ray.remote(EngineActorImpl)
