"""EngineActor: one engine replica as a Ray actor (thin: all logic lives in rayinfer.engine)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import AsyncIterator

import ray
import torch

from rayinfer.engine.async_engine import AsyncLLMEngine
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.model_runner import kv_layout_tag
from rayinfer.engine.types import Completion, KVHandle, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
_KV_OUT_TTL_S = 300.0  # a stashed payload nobody took (its router died) is dropped after this


class EngineActorImpl:
    """One replica (role NORMAL, PREFILL or DECODE per ``engine_config.role``).

    Methods are async: the engine steps on its own thread, so many requests stream concurrently.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, replica_id: int = 0,
                 kv_store: "ray.actor.ActorHandle | None" = None, kv_transport: str = "object_store"):
        """Load the model and start the step loop.

        Args:
            model_config, engine_config: the replica's configs (``engine_config.role`` picks the role).
            replica_id: the replica's id in stats.
            kv_store: PREFILL role: the KVStoreActor that new full blocks are written through to.
            kv_transport: "object_store" (payloads exported to CPU) or a Ray Direct Transport name
                ("nccl", "cuda_ipc", "gloo"): payloads stay on the cache's device for :meth:`pop_kv`.
        """
        from rayinfer.actors.kv_transport import prepare_transport

        prepare_transport(kv_transport)
        self.kv_transport = kv_transport
        self.replica_id = replica_id
        self.engine = AsyncLLMEngine(LLMEngine(model_config, engine_config))
        self.kv_store = kv_store
        if kv_transport != "object_store":
            self.engine.engine.kv_export_device = self.engine.engine.device
        self._kv_out: dict[str, tuple[float, torch.Tensor]] = {}  # PREFILL: exported payloads to pop
        self._kv_in: dict[str, tuple[float, torch.Tensor]] = {}  # DECODE: received payloads to decode
        self._kv_writes: list[concurrent.futures.Future] = []  # write-through puts not yet known to be done

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

    # -- prefill/decode disaggregation -----------------------------------------------------------
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      output_token_ids: list[int] | None = None,
                      stored: tuple[list[int], str | None, list] | None = None) -> RequestOutput:
        """PREFILL role: compute a request's tokens and sample the next one; keep its KV for :meth:`pop_kv`.

        Blocks the KV store holds are loaded instead of computed; new full blocks are written through
        to the store afterwards (without waiting for it).

        Args:
            request_id: unique among this replica's live requests.
            prompt_token_ids: the prompt.
            params: sampling params.
            output_token_ids: tokens generated so far (a re-prefill after preemption or a failure).
            stored: (block hashes, layout tag, ObjectRefs of ``[L, 1, 2, bs, H, D]`` blocks) from the store:
                the leading blocks of prompt + outputs; unreadable or mismatched blocks are recomputed.
        Returns:
            the one output: the sampled token, ``finish_reason`` "prefilled" with ``kv_handle`` (payload
            None; fetch it with :meth:`pop_kv`), or a real finish reason (stop, length) with no handle.
        Raises:
            ValueError: if the engine rejects the request.
        """
        handle = await self._load_stored(request_id, stored)
        out = None
        async for out in self.engine.generate(request_id, prompt_token_ids, params,
                                              output_token_ids=output_token_ids, kv_handle=handle):
            pass
        kv = out.kv_handle
        if kv is not None:
            self._kv_out = _fresh(self._kv_out)
            self._kv_out[request_id] = (time.monotonic(), kv.payload)
            self._write_through(kv, len(handle.block_hashes) if handle else 0)
            out.kv_handle = dataclasses.replace(kv, payload=None)
        return out

    async def _load_stored(self, request_id: str, stored) -> KVHandle | None:
        if not stored or not stored[2]:
            return None
        hashes, layout, refs = stored
        if layout != kv_layout_tag(self.engine.engine.kv_cache):
            return None
        try:
            blocks = await asyncio.gather(*refs)
        except ray.exceptions.RayError as e:  # the store restarted and its objects went with it
            logger.warning("stored KV unreadable, recomputing: %s", e)
            return None
        bs = self.engine.engine.engine_config.block_size
        return KVHandle(request_id, list(hashes[: len(blocks)]), len(blocks) * bs, layout, torch.cat(blocks, dim=1))

    def _write_through(self, kv: KVHandle, num_stored: int) -> None:
        full = len(kv.block_hashes)
        if self.kv_store is None or full <= num_stored:
            return
        self._kv_writes = [f for f in self._kv_writes if not f.done()]
        payload = kv.payload[:, num_stored:full].to("cpu").contiguous()
        ref = self.kv_store.put.remote(kv.block_hashes[:full], num_stored, payload, kv.layout)
        self._kv_writes.append(ref.future())

    async def flush_kv_writes(self) -> int:
        """Wait for this replica's write-through puts; returns blocks they stored (failed puts count 0)."""
        writes, self._kv_writes = self._kv_writes, []
        results = await asyncio.gather(*[asyncio.wrap_future(f) for f in writes], return_exceptions=True)
        return sum(r for r in results if isinstance(r, int))

    def pop_kv(self, request_id: str) -> torch.Tensor:
        """The KV payload a :meth:`prefill` exported, ``[L, n_blocks, 2, bs, H, D]``; removed here.

        Call it as ``.options(tensor_transport="nccl")`` (or "cuda_ipc", "gloo") to keep the payload on
        the device (Ray Direct Transport); otherwise it travels through the object store, owned by the
        caller.

        Raises:
            KeyError: for an unknown request (never prefilled here, already popped, or expired).
        """
        if self.kv_transport == "cuda_ipc" and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # free earlier payloads whose receivers have let go of their IPC views
        return self._kv_out.pop(request_id)[1]

    def receive_kv(self, request_id: str, kv_payload: torch.Tensor) -> int:
        """DECODE role: take a payload ahead of :meth:`decode` (the Ray Direct Transport path).

        Pass the ObjectRef from :meth:`pop_kv` positionally so Ray moves it (GPU to GPU over nccl). The
        caller runs one such transfer at a time per actor: collective send/recv pairs must match in
        order, which concurrent transfers on async actors do not guarantee.

        Returns:
            the payload's size in bytes.
        """
        self._kv_in = _fresh(self._kv_in)
        if self.kv_transport == "cuda_ipc":  # a view of the prefill replica's memory: copy it out now
            kv_payload = kv_payload.clone()
        self._kv_in[request_id] = (time.monotonic(), kv_payload)
        return kv_payload.numel() * kv_payload.element_size()

    async def decode(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     output_token_ids: list[int], kv_handle: KVHandle,
                     kv_payload: torch.Tensor | None = None) -> AsyncIterator[RequestOutput]:
        """DECODE role: admit a prefilled request with its KV and stream its deltas (a Ray generator).

        Args:
            kv_handle: the prefill's handle (payload None).
            kv_payload: its payload ``[L, n_blocks, 2, bs, H, D]``; pass the ObjectRef from :meth:`pop_kv`
                positionally so Ray resolves it through the object store; None takes the payload an
                earlier :meth:`receive_kv` brought.
        Yields:
            deltas; a last one with ``finish_reason`` "preempted" hands the request back for a re-prefill.
        Raises:
            KeyError: kv_payload None and nothing received for the request.
            ValueError: if the engine rejects the request (e.g. a layout mismatch).
        """
        if kv_payload is None:
            kv_payload = self._kv_in.pop(request_id)[1]
        handle = dataclasses.replace(kv_handle, payload=kv_payload)
        async for out in self.engine.generate(request_id, prompt_token_ids, params,
                                              output_token_ids=output_token_ids, kv_handle=handle):
            yield out

    def stats(self) -> dict:
        return {"replica_id": self.replica_id, **self.engine.stats()}


def _fresh(stash: dict[str, tuple[float, torch.Tensor]]) -> dict[str, tuple[float, torch.Tensor]]:
    """A payload stash without entries older than the TTL (their router gave up or died)."""
    now = time.monotonic()
    return {k: v for k, v in stash.items() if now - v[0] < _KV_OUT_TTL_S}


EngineActor = ray.remote(EngineActorImpl)
