"""EngineActor: one engine replica as a Ray actor (thin: all logic lives in rayinfer.engine)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from functools import partial
from typing import AsyncIterator

import numpy as np
import ray
import torch

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.actors.kv_transport import (COLLECTIVE_TRANSPORTS, BlockHandle, ByteBudget, CacheMappings, DeviceHandle,
                                         KVTransferAgent, from_wire, on_stream, read_blocks, release_when_freed,
                                         share_tensor, to_wire)
from rayinfer.engine.async_engine import AsyncLLMEngine
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.model_runner import kv_layout_tag
from rayinfer.engine.types import Completion, KVHandle, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
_KV_IN_TTL_S = 120.0  # a received payload nobody decoded (its client left) is dropped after this
_GIB = 1 << 30
_MAX_PENDING_STORE_WRITES = 2  # write-through copies and puts in flight; more requests are not written


class EngineActorImpl:
    """One replica (role NORMAL, PREFILL or DECODE per ``engine_config.role``).

    Methods are async: the engine steps on its own thread, so many requests stream concurrently.
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, replica_id: int = 0,
                 kv_store: "ray.actor.ActorHandle | str | None" = None, kv_transport: str = "object_store"):
        """Load the model and start the step loop.

        Args:
            model_config, engine_config: the replica's configs (``engine_config.role`` picks the role).
            replica_id: the replica's id in stats.
            kv_store: the KVStoreActor, or its name in this job's namespace (what the router passes, so that
                Ray can restart this actor from its arguments). PREFILL role: new full blocks are written
                through to it. NORMAL role (the store as a third KV tier): a request's leading blocks that the
                store holds beyond this replica's own cache are loaded from it, and finished requests' full
                blocks are written to it, so one replica's prefixes serve the others (and outlive them).
            kv_transport: "object_store", "cuda_ipc" (CUDA IPC handles, :meth:`share_kv` / :meth:`receive_kv`),
                or "nccl" / "gloo" (the fleet's transfer group, :meth:`send_kv` / :meth:`recv_kv`).
        """
        configure_worker_logging()
        self.kv_transport = kv_transport
        self.replica_id = replica_id
        self.engine = AsyncLLMEngine(LLMEngine(model_config, engine_config))
        self.kv_store = ray.get_actor(kv_store) if isinstance(kv_store, str) else kv_store
        e = self.engine.engine
        budget = max(int(engine_config.kv_transfer_buffer_gib * _GIB), 1 << 20)
        self.transfer = KVTransferAgent(e.device, budget) if kv_transport in COLLECTIVE_TRANSPORTS else None
        # DECODE role: bytes of received payloads not yet imported (the transfer group's own budget, or over
        # cuda_ipc one of this replica's: the router reserves a request's bytes here before this replica
        # copies the blocks, so payloads not yet imported stay within kv_transfer_buffer_gib)
        self.receive_budget = (self.transfer.budget if self.transfer is not None
                               else ByteBudget(budget) if kv_transport == "cuda_ipc" and e.role.value == "decode"
                               else None)
        self._reserved: dict[str, int] = {}  # cuda_ipc: request id -> bytes reserved for its payload
        # cuda_ipc on a GPU: where received payloads are copied (not the engine's stream)
        self._ipc_stream = torch.cuda.Stream(e.device) if kv_transport == "cuda_ipc" and e.device.type == "cuda" \
            else None
        self._ipc_mappings = CacheMappings()  # cuda_ipc, DECODE: the prefill replicas' caches, each mapped once
        self._shared_cache: tuple[DeviceHandle, str] | None = None  # cuda_ipc, PREFILL: this cache's handle, id
        self._kv_in: dict[str, tuple[float, torch.Tensor]] = {}  # DECODE: received payloads to decode
        self._outboxes: dict[str, _Outbox] = {}  # client id -> its requests' deltas not yet streamed
        self._kv_writes: list[concurrent.futures.Future] = []  # write-through puts not yet known to be done
        self._store_gathers: dict[str, concurrent.futures.Future] = {}  # write-through copies still reading blocks
        self._store_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-store-write")
        # the store copies' own CUDA stream, so their gathers and device-to-host copies never queue behind
        # (or ahead of) the engine's steps on the compute stream
        self._store_stream = torch.cuda.Stream(e.device) if e.device.type == "cuda" else None
        self.num_store_writes_skipped = 0
        self.num_store_hit_blocks = 0  # blocks loaded from the store (NORMAL role)
        self.num_store_skipped_blocks = 0  # leading blocks of a store hit taken from this replica's own tiers instead
        self.num_store_lookups = 0
        self.cp_peer = None  # a CP peer rank's side of rank 0's prefills (join_cp_group_as_peer)
        if kv_store is not None and e.role.value == "normal":
            e.store_writer = self._put_finished

    def ready(self) -> dict:
        """Returns the replica's static facts once the model is loaded."""
        e = self.engine.engine
        return {"replica_id": self.replica_id, "role": e.role.value, "max_model_len": e.max_model_len,
                "device": str(e.device), "num_blocks": e.scheduler.config.num_blocks,
                "max_num_seqs": e.scheduler.config.max_num_seqs,
                "transfer_budget_blocks": (self.receive_budget.capacity // _block_bytes(e.kv_cache)
                                           if self.receive_budget is not None else 0)}

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas (a Ray streaming generator). Raises ValueError for bad input."""
        await _resolve_mm(kwargs)
        await self._with_stored_prefix(request_id, prompt_token_ids, kwargs)
        async for out in self.engine.generate(request_id, prompt_token_ids, params, **kwargs):
            yield out

    async def complete(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs) -> Completion:
        """Run a request to the end; errors come back in ``Completion.error``."""
        await _resolve_mm(kwargs)
        await self._with_stored_prefix(request_id, prompt_token_ids, kwargs)
        return await self.engine.complete(request_id, prompt_token_ids, params, **kwargs)

    def abort(self, request_id: str) -> None:
        self._kv_in.pop(request_id, None)
        for box in self._outboxes.values():
            box.live.discard(request_id)
        self.engine.abort(request_id)

    # -- the KV store as a third tier (NORMAL role) -----------------------------------------------
    async def _with_stored_prefix(self, request_id: str, prompt_token_ids: list[int], kwargs: dict) -> None:
        """Put a ``kv_handle`` for the store's part of the prompt into ``kwargs`` when the store holds more
        leading blocks than this replica's device and host pools; a store that is down, or blocks that
        turn out missing or damaged, are a miss (the prompt is computed).

        The leading blocks in this replica's device pool and host tier are not fetched: the handle leaves
        them out (``KVHandle.first_block``) and the scheduler takes them from the prefix cache and the host
        tier (a shared system prompt cached here, a conversation's later turns in the store)."""
        e = self.engine.engine
        if (self.kv_store is None or e.role.value != "normal" or kwargs.get("kv_handle") is not None
                or kwargs.get("mm_inputs")):  # the store's hashes know no images
            return
        from rayinfer.policy.kv_store_index import block_hashes

        bs = e.engine_config.block_size
        hashes = block_hashes(list(prompt_token_ids) + list(kwargs.get("output_token_ids") or []), bs)
        kv = e.scheduler.kv
        # a racy read of the engine thread's dicts: only a hint of what is cached here (device pool, then host)
        local = 0
        while local < len(hashes) and hashes[local] in kv.pool.hash_to_block:
            local += 1
        while local < len(hashes) and kv.host is not None and hashes[local] in kv.host.hash_to_slot:
            local += 1
        if local == len(hashes):
            return
        self.num_store_lookups += 1
        try:
            n = await self.kv_store.match.remote(hashes)
            if n <= local:
                return
            layout, blocks = await self.kv_store.get_blocks.remote(hashes[:n], local)
        except ray.exceptions.RayError as err:
            logger.warning("KV store unavailable (%s); computing the prompt", type(err).__name__)
            return
        if not blocks or layout != kv_layout_tag(e.kv_cache):
            return
        self.num_store_hit_blocks += len(blocks)
        self.num_store_skipped_blocks += local
        payload = from_wire(np.concatenate(blocks, axis=1), e.kv_cache.dtype)
        n = local + len(blocks)
        kwargs["kv_handle"] = KVHandle(request_id, list(hashes[:n]), n * bs, layout, payload, first_block=local)

    def _put_finished(self, block_hashes: list[int], start: int, payload: torch.Tensor) -> bool:
        """The engine's store writer (engine thread): copy to host and put, on the store-write thread."""
        self._kv_writes = [f for f in self._kv_writes if not f.done()]
        if len(self._kv_writes) >= 4 * _MAX_PENDING_STORE_WRITES:
            self.num_store_writes_skipped += 1
            return False
        store, layout = self.kv_store, kv_layout_tag(self.engine.engine.kv_cache)
        assert store is not None
        done: concurrent.futures.Future = concurrent.futures.Future()

        def copy_and_put() -> None:
            try:
                host = payload.to("cpu")  # on the compute stream, behind the gather that made the payload
                # waits on this thread (not ray.get, which warns in an asyncio actor whatever the thread)
                store.put.remote(block_hashes, start, to_wire(host), layout).future().result()
                done.set_result(0)
            except Exception as err:  # noqa: BLE001 - a cache write
                done.set_exception(err)

        self._store_executor.submit(copy_and_put)
        self._kv_writes.append(done)
        return True

    # -- prefill/decode disaggregation -----------------------------------------------------------
    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      output_token_ids: list[int] | None = None,
                      stored: tuple[list[int], str | None, list] | None = None,
                      mm_inputs: list | None = None) -> RequestOutput:
        """PREFILL role: compute a request's tokens and sample the next one; its KV stays parked in the pool
        for :meth:`send_kv` (nccl, gloo), :meth:`share_kv` (cuda_ipc) or :meth:`export_kv` (object store).

        Blocks the KV store holds are loaded instead of computed; new full blocks are written through
        to the store afterwards (without waiting for it).

        Args:
            request_id: unique among this replica's live requests.
            prompt_token_ids: the prompt.
            params: sampling params.
            output_token_ids: tokens generated so far (a re-prefill after preemption or a failure).
            stored: (block hashes, layout tag, ObjectRefs of ``[L, 1, 2, bs, H, D]`` blocks in wire form) from the store:
                the leading blocks of prompt + outputs; unreadable or mismatched blocks are recomputed.
            mm_inputs: the prompt's images (vision-language models): pixels, embeddings, or
                ``encoder_actor.EmbedsRef`` from an encoder replica (fetched here from the object store).
        Returns:
            the one output: the sampled token, ``finish_reason`` "prefilled" with ``kv_handle`` (payload
            None: the KV is parked here), or a real finish reason (stop, length) with no handle.
        Raises:
            ValueError: if the engine rejects the request.
        """
        extra: dict = {"mm_inputs": mm_inputs} if mm_inputs else {}
        await _resolve_mm(extra)
        handle = await self._load_stored(request_id, stored)
        out = None
        async for out in self.engine.generate(request_id, prompt_token_ids, params,
                                              output_token_ids=output_token_ids, kv_handle=handle, **extra):
            pass
        if out is not None and out.kv_handle is not None:
            self._write_through(out.kv_handle, len(handle.block_hashes) if handle else 0)
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
        payload = from_wire(np.concatenate(blocks, axis=1), self.engine.engine.kv_cache.dtype)
        return KVHandle(request_id, list(hashes[: len(blocks)]), len(blocks) * bs, layout, payload)

    def _write_through(self, kv: KVHandle, num_stored: int) -> None:
        """Copy a prefilled request's new full blocks to host memory and put them in the KV store, on a
        thread of its own; the request's blocks stay parked until the copy is done. Skipped (it is a
        cache) while earlier copies or puts are still queued, so neither the store (whose lookups gate
        new prefills) nor this replica's transfers ever wait behind write-through."""
        full = len(kv.block_hashes)
        if self.kv_store is None or full <= num_stored:
            return
        self._store_gathers = {k: f for k, f in self._store_gathers.items() if not f.done()}
        self._kv_writes = [f for f in self._kv_writes if not f.done()]
        if len(self._store_gathers) + len(self._kv_writes) >= _MAX_PENDING_STORE_WRITES:
            self.num_store_writes_skipped += 1
            return
        engine, rid, store, stream = self.engine.engine, kv.request_id, self.kv_store, self._store_stream

        def copy_and_put() -> None:
            # the copy and the put's serialization of the payload (hundreds of MB for a long prompt of a
            # large model) both happen here, never on the actor's event loop
            with on_stream(stream):
                blocks = engine.gather_kv([rid], layers=None)[:, num_stored:full]
                host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=blocks.is_cuda)
                host.copy_(blocks)  # waits for the copy (this stream only)
            ref = store.put.remote(kv.block_hashes[:full], num_stored, to_wire(host), kv.layout)
            self._kv_writes.append(ref.future())

        self._store_gathers[rid] = self._store_executor.submit(copy_and_put)

    async def _store_copy_done(self, request_ids: list[str]) -> None:
        """Wait for write-through copies still reading these requests' parked blocks."""
        pending = [self._store_gathers.pop(r) for r in request_ids if r in self._store_gathers]
        if pending:
            await asyncio.gather(*[asyncio.wrap_future(f) for f in pending], return_exceptions=True)

    async def flush_kv_writes(self) -> int:
        """Wait for this replica's write-through puts; returns blocks they stored (failed puts count 0)."""
        await self._store_copy_done(list(self._store_gathers))
        writes, self._kv_writes = self._kv_writes, []
        results = await asyncio.gather(*[asyncio.wrap_future(f) for f in writes], return_exceptions=True)
        return sum(r for r in results if isinstance(r, int))

    async def release_kv(self, request_ids: list[str]) -> None:
        """PREFILL role: free parked KV nobody will take (a request that ended at its first token)."""
        await self._store_copy_done(request_ids)
        self.engine.release_kv(request_ids)

    async def export_kv(self, request_id: str) -> np.ndarray:
        """PREFILL role: a parked request's payload ``[L, n_blocks, 2, bs, H, D]`` in host memory, in wire
        form (``kv_transport.to_wire``), its blocks freed (the object-store transport: the caller's ref
        outlives this actor).

        Raises:
            KeyError: for a request not parked here (never prefilled here, released or expired).
        """
        payload = await asyncio.to_thread(self.engine.engine.gather_kv, [request_id], None, "cpu")
        await self.release_kv([request_id])
        return to_wire(payload)

    async def share_kv(self, request_id: str) -> "BlockHandle | torch.Tensor":
        """PREFILL role (cuda_ipc): where a parked request's KV is, for a replica on this GPU to read in place
        (:class:`~rayinfer.actors.kv_transport.BlockHandle`: this replica's KV cache, shared once, and the
        request's block ids). The blocks stay parked, kept from expiring, until :meth:`release_kv` (the
        router calls it once the receiver has read them, or failed to). A CPU replica answers with the
        payload ``[L, n_blocks, 2, bs, H, D]`` itself and frees the blocks (how the path is tested there).

        Raises:
            KeyError: for a request not parked here (never prefilled here, released or expired).
        """
        e = self.engine.engine
        if e.device.type != "cuda":
            payload = await asyncio.to_thread(e.gather_kv, [request_id])
            await self.release_kv([request_id])
            return payload
        if self._shared_cache is None:  # once: the cache lives as long as this process
            self._shared_cache = (share_tensor(e.kv_cache), uuid.uuid4().hex)
        cache, cache_id = self._shared_cache
        return BlockHandle(cache, cache_id, self.replica_id, e.pin_kv(request_id))

    async def receive_kv(self, request_id: str, handle: "BlockHandle | torch.Tensor") -> int:
        """DECODE role (cuda_ipc): copy the blocks :meth:`share_kv` named into a payload of this replica's own,
        ahead of :meth:`submit` (off the event loop, on a stream of its own; the sender's cache is mapped
        once). The bytes :meth:`reserve_kv` reserved for ``request_id`` (if any) come back to the receive
        budget once the payload is freed (imported or expired); on an error they come back at once. Returns
        the payload's size in bytes.

        Raises:
            ValueError: the sender is on another GPU.
        """
        self._kv_in = _fresh(self._kv_in)
        try:
            if isinstance(handle, torch.Tensor):
                kv_payload = handle
            else:
                kv_payload = await asyncio.to_thread(read_blocks, handle, self._ipc_stream, self._ipc_mappings)
        except BaseException:
            await self.unreserve_kv(request_id)
            raise
        reserved = self._reserved.pop(request_id, 0)
        if reserved and self.receive_budget is not None:
            release_when_freed(kv_payload, self.receive_budget, reserved, asyncio.get_running_loop())
        self._kv_in[request_id] = (time.monotonic(), kv_payload)
        return kv_payload.numel() * kv_payload.element_size()

    async def unreserve_kv(self, request_id: str) -> None:
        """DECODE role (cuda_ipc): give back the bytes :meth:`reserve_kv` reserved for ``request_id`` when its
        payload never arrived (the transfer failed); nothing when :meth:`receive_kv` already took them."""
        reserved = self._reserved.pop(request_id, 0)
        if reserved and self.receive_budget is not None:
            await self.receive_budget.release(reserved)

    # -- context parallelism: rank 0 of a CP replica (rayinfer.actors.cp_group) ---------------------
    def cp_address(self) -> tuple[str, int]:
        """(node IP, a free port) for the CP group's rendezvous."""
        from rayinfer.actors.cp_group import cp_address

        return cp_address()

    async def join_cp_group(self, address: str, port: int, peers: list, min_tokens: int,
                            timeout_s: float = 300.0) -> None:
        """Join the replica's CP group as rank 0 (the peers join at once) and prefill prompts of at least
        ``min_tokens`` uncached tokens with the peers (``LLMEngine.set_context_parallel``).

        Raises:
            ValueError: for a model, role or speculative method CP does not support (before joining).
        """
        from rayinfer.actors.cp_group import check_cp_peers, cp_backend
        from rayinfer.engine.context_parallel import CPPrefiller, torch_all_gather, torch_broadcast
        from rayinfer.placement.groups import init_process_group

        e = self.engine.engine

        def start_peers(token_ids: list[int], num_cached: int):
            # called on the engine's step thread, never the event loop: wait on futures (ray.get here would
            # only draw Ray's "blocking ray.get inside async actor" warning)
            futures = [p.cp_prefill.remote(token_ids, num_cached).future() for p in peers]
            return lambda: [f.result() for f in futures]

        cp_size = len(peers) + 1
        prefiller = CPPrefiller(cp_size, min_tokens, torch_all_gather(), start_peers, torch_broadcast(),
                                lambda: check_cp_peers(peers))
        e.set_context_parallel(None)  # validates the model and config first; on only once joined
        if e.device.type == "cuda":
            torch.cuda.set_device(e.device.index or 0)  # NCCL binds the group to the current device
        await asyncio.to_thread(init_process_group, 0, cp_size, address, port, cp_backend(e.device), timeout_s)
        e.set_context_parallel(prefiller)

    async def join_cp_group_as_peer(self, address: str, port: int, cp_rank: int, cp_size: int,
                                    timeout_s: float = 300.0) -> None:
        """Join the replica's CP group as rank ``cp_rank`` >= 1: this replica keeps serving its own requests
        and also runs its share of rank 0's CP prefills (:meth:`cp_prefill`).

        Raises:
            ValueError: for a model CP does not support (``engine.context_parallel.check_cp_model``).
        """
        from rayinfer.actors.cp_group import cp_backend
        from rayinfer.engine.context_parallel import CPPeer, check_cp_model, torch_all_gather, torch_broadcast
        from rayinfer.placement.groups import init_process_group

        e = self.engine.engine
        check_cp_model(e.model)
        if e.device.type == "cuda":
            torch.cuda.set_device(e.device.index or 0)
        await asyncio.to_thread(init_process_group, cp_rank, cp_size, address, port, cp_backend(e.device), timeout_s)
        self.cp_peer = CPPeer(e.model, cp_rank, cp_size, torch_all_gather(), e.engine_config.block_size, e.kv_dtype,
                              torch_broadcast())

    async def cp_ping(self) -> int:
        """This CP peer's rank (-1 if it is none): rank 0 asks before each CP prefill that the peer is alive."""
        return -1 if self.cp_peer is None else self.cp_peer.cp_rank

    async def cp_prefill(self, token_ids: list[int], num_cached: int = 0) -> int:
        """This rank's share of one of rank 0's CP prefills (the first ``num_cached`` tokens rank 0 has
        cached and broadcasts), run on the engine's step thread between two of this replica's own steps (the
        collectives wait for it there); returns its token count.

        Raises:
            RuntimeError: if this replica never joined a CP group as a peer.
        """
        if self.cp_peer is None:
            raise RuntimeError(f"replica {self.replica_id} is no CP peer (join_cp_group_as_peer was not called)")
        peer = self.cp_peer
        return await asyncio.wrap_future(self.engine.run_on_loop(lambda: peer.prefill(token_ids, num_cached)))

    # -- the transfer group (nccl, gloo) -----------------------------------------------------------
    def transfer_address(self) -> tuple[str, int]:
        """(node IP, a free port) for the transfer group's rendezvous (asked of rank 0)."""
        from rayinfer.placement.groups import free_port, node_ip

        return node_ip(), free_port()

    async def join_transfer_group(self, address: str, port: int, world_size: int, rank: int) -> None:
        """Join the fleet's KV transfer group as ``rank`` (all replicas call it at once)."""
        assert self.transfer is not None, "join_transfer_group needs kv_transport nccl or gloo"
        await self.transfer.join(self.kv_transport, address, port, world_size, rank)

    def parked_blocks(self, request_ids: list[str]) -> list[int]:
        """PREFILL role: the number of parked blocks of each request; 0 for one not parked here."""
        parked = self.engine.engine.parked
        return [len(parked[r].block_ids) if r in parked else 0 for r in request_ids]

    async def send_kv(self, request_ids: list[str], dst_rank: int) -> int:
        """PREFILL role: send the parked KV of ``request_ids`` (in order, as one payload) to ``dst_rank``,
        then free their blocks. Runs on the transfer thread; returns the bytes sent.

        Raises:
            KeyError: a request is not parked here (check with :meth:`parked_blocks` first: the
                receiver is already waiting for the whole batch).
        """
        assert self.transfer is not None, "send_kv needs kv_transport nccl or gloo"
        e = self.engine.engine
        await self._store_copy_done(request_ids)
        num_blocks = sum(len(e.parked[r].block_ids) for r in request_ids)
        shape = (e.kv_cache.shape[0], num_blocks, *e.kv_cache.shape[2:])
        nbytes = await self.transfer.send(lambda out, layers: e.gather_kv(request_ids, out=out, layers=layers),
                                          shape, e.kv_cache.dtype, dst_rank)
        self.engine.release_kv(request_ids)
        return nbytes

    async def reserve_kv(self, num_blocks: int, request_id: str | None = None) -> int:
        """DECODE role: wait until a batch of ``num_blocks`` blocks fits the receive budget and take it;
        returns the bytes reserved. nccl / gloo: pass them to :meth:`recv_kv`. cuda_ipc: name the
        ``request_id`` whose payload :meth:`receive_kv` takes next (or :meth:`unreserve_kv` gives back)."""
        assert self.receive_budget is not None, "reserve_kv needs kv_transport nccl, gloo or cuda_ipc"
        cache = self.engine.engine.kv_cache
        nbytes = num_blocks * _block_bytes(cache)
        await self.receive_budget.acquire(nbytes)
        if request_id is not None:
            self._reserved[request_id] = self._reserved.get(request_id, 0) + nbytes
        return nbytes

    async def recv_kv(self, request_ids: list[str], num_blocks: list[int], src_rank: int, nbytes_reserved: int) -> int:
        """DECODE role: receive one batch from ``src_rank`` (the requests' blocks, in order) and keep each
        request's part for its :meth:`submit`; returns the bytes received."""
        assert self.transfer is not None, "recv_kv needs kv_transport nccl or gloo"
        cache = self.engine.engine.kv_cache
        shape = (cache.shape[0], sum(num_blocks), *cache.shape[2:])
        payload = await self.transfer.recv(shape, cache.dtype, src_rank, nbytes_reserved)
        self._kv_in = _fresh(self._kv_in)
        now, start = time.monotonic(), 0
        for rid, n in zip(request_ids, num_blocks):
            self._kv_in[rid] = (now, payload[:, start:start + n])
            start += n
        return payload.numel() * payload.element_size()

    # -- multiplexed output streams ----------------------------------------------------------------
    async def submit(self, client_id: str, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     output_token_ids: list[int] | None = None, kv_handle: KVHandle | None = None,
                     kv_payload: "torch.Tensor | np.ndarray | None" = None, detokenize: bool = True,
                     mm_inputs: list | None = None, num_emitted_chars: int | None = None) -> None:
        """Queue a request whose deltas stream to ``client_id``'s :meth:`outputs` (opened before or after).

        Args:
            client_id: the caller's output stream (one per client process and replica).
            request_id: unique among this replica's live requests.
            output_token_ids: tokens generated elsewhere (DECODE role: the prefill's first token; NORMAL
                role: a stream resumed after its replica died, re-prefilled here with the prompt).
            kv_handle: DECODE role: the prefill's handle (payload None).
            kv_payload: DECODE role: its payload ``[L, n_blocks, 2, bs, H, D]``; pass the ObjectRef from
                :meth:`export_kv` positionally so Ray resolves it through the object store; None takes the
                payload an earlier :meth:`recv_kv` / :meth:`receive_kv` brought.
            detokenize: False streams the core's token deltas without text or stop strings (the caller
                detokenizes; see ``AsyncLLMEngine.submit``).
            mm_inputs: the prompt's images (``engine.types.MultiModalInput``; vision-language models), their
                embeddings possibly ``encoder_actor.EmbedsRef`` (fetched here). DECODE role: content hashes
                and placeholder ranges only (they key the imported blocks' hashes).
            num_emitted_chars: a resumed stream: characters of ``output_token_ids``' text the dead replica
                already sent (the rest, and stop strings that span the cut, come from here).
        Raises:
            KeyError: DECODE role, kv_payload None and nothing received for the request.
            ValueError: an invalid response_format. Other rejections (the engine's checks) arrive on the
                output stream as the request's exception.
        """
        box = self._outboxes.get(client_id)
        if box is None:
            box = self._outboxes[client_id] = _Outbox()
        kwargs: dict = {"mm_inputs": mm_inputs} if mm_inputs else {}
        if num_emitted_chars is not None:
            kwargs["num_emitted_chars"] = num_emitted_chars
        await _resolve_mm(kwargs)
        if kv_handle is not None:
            if kv_payload is None:
                kv_payload = self._kv_in.pop(request_id)[1]
            kv_payload = from_wire(kv_payload, self.engine.engine.kv_cache.dtype)
            # hold no reference to the payload while the request decodes: the engine drops its own once the
            # KV is imported, and a received batch's transfer budget comes back when all its payloads are gone
            kwargs["kv_handle"] = dataclasses.replace(kv_handle, payload=kv_payload)
            del kv_payload
        elif not mm_inputs:  # the store's hashes know no images
            probe: dict = {"output_token_ids": output_token_ids}
            await self._with_stored_prefix(request_id, prompt_token_ids, probe)
            if probe.get("kv_handle") is not None:
                kwargs["kv_handle"] = probe["kv_handle"]
        box.live.add(request_id)
        try:
            await self.engine.submit(request_id, prompt_token_ids, params, partial(box.put, request_id),
                                     detokenize=detokenize, output_token_ids=output_token_ids, **kwargs)
        except BaseException:
            box.live.discard(request_id)
            raise

    async def outputs(self, client_id: str) -> AsyncIterator[list[tuple[str, RequestOutput | Exception]]]:
        """The deltas of ``client_id``'s requests (a Ray streaming generator): one list of
        ``(request_id, delta or exception)`` per wake-up, in order per request, the last item of a request
        finished (or its exception). When the consumer goes away, its live requests are aborted.

        One stream per client and replica, instead of one per request, keeps the replica's event loop at
        one Ray item per step however many requests stream (vLLM's AsyncLLM does the same with one output
        handler per process).
        """
        box = self._outboxes.get(client_id)
        if box is None:
            box = self._outboxes[client_id] = _Outbox()
        try:
            while True:
                await box.ready.wait()
                box.ready.clear()
                batch, box.items = box.items, []
                if batch:
                    yield batch
        finally:
            if self._outboxes.get(client_id) is box:
                del self._outboxes[client_id]
            for rid in box.live:
                self.engine.abort(rid)

    def stats(self) -> dict:
        out = {"replica_id": self.replica_id, **self.engine.stats(), "num_parked_kv": len(self.engine.engine.parked),
               "num_store_writes_skipped": self.num_store_writes_skipped,
               "kv_store_hit_blocks": self.num_store_hit_blocks, "kv_store_lookups": self.num_store_lookups,
               "kv_store_skipped_blocks": self.num_store_skipped_blocks}
        if self.transfer is not None:
            out.update(self.transfer.stats())
        elif self.receive_budget is not None:  # cuda_ipc
            out.update(self.receive_budget.stats())
        if self.cp_peer is not None:
            out.update(cp_rank=self.cp_peer.cp_rank, num_cp_peer_prefills=self.cp_peer.num_prefills)
        return out


class _Outbox:
    """One client's deltas waiting for its :meth:`EngineActorImpl.outputs` stream (event loop only)."""

    def __init__(self):
        self.items: list[tuple[str, RequestOutput | Exception]] = []
        self.ready = asyncio.Event()
        self.live: set[str] = set()  # its requests not yet finished (aborted if the stream goes away)

    def put(self, request_id: str, item: RequestOutput | Exception) -> None:
        self.items.append((request_id, item))
        self.ready.set()
        if isinstance(item, Exception) or item.finished:
            self.live.discard(request_id)


async def _resolve_mm(kwargs: dict) -> None:
    """Replace encoder replicas' embeddings refs in ``kwargs["mm_inputs"]`` by their tensors."""
    if kwargs.get("mm_inputs"):
        from rayinfer.actors.encoder_actor import resolve_embeds

        kwargs["mm_inputs"] = await resolve_embeds(kwargs["mm_inputs"])


def _block_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block across all layers of a ``[L, num_blocks, ...]`` cache."""
    return kv_cache[:, 0].numel() * kv_cache.element_size()


def _fresh(stash: dict[str, tuple[float, torch.Tensor]]) -> dict[str, tuple[float, torch.Tensor]]:
    """A payload stash without entries older than the TTL (their client gave up or died)."""
    now = time.monotonic()
    return {k: v for k, v in stash.items() if now - v[0] < _KV_IN_TTL_S}


EngineActor = ray.remote(EngineActorImpl)
