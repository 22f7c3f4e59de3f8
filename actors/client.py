"""Clients of a fleet (the ``EngineClient`` protocol, ``rayinfer.engine.protocol``), and how to start one.

    client = make_client(model_config, engine_config, parallel)   # starts a Router (owned) and connects
    async for out in client.generate(prompt_ids, params): ...
    client.shutdown()                                              # stops the fleet it started

    router = start_fleet(model_config, engine_config, parallel)   # a fleet shared by many clients
    client = await connect(router)                                 # (Serve: each ingress replica connects)

The client runs in the caller's process and streams tokens from the replicas directly; the Router
actor (``rayinfer.actors.router``) owns the replicas and the balancers, so every client shares one view
of load. ``connect`` picks the client class by the fleet's topology.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import uuid
from contextlib import aclosing
from typing import AsyncGenerator, AsyncIterator

import ray
import ray.exceptions

from rayinfer.actors.router import FleetInfo, RouterActor, check_supported
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.errors import EngineInternalError, InvalidRequestError, RayInferError, UnsupportedError
from rayinfer.engine.protocol import EngineClient, FleetStats
from rayinfer.engine.types import Completion, MultiModalInput, RequestOutput, SamplingParams
from rayinfer.placement.parallel_config import ParallelConfig

logger = logging.getLogger(__name__)

_REPLICA_ATTEMPTS = 3  # colocated: picks for a request whose replica actor dies


def _failed(request_id: str, prompt_token_ids: list[int], error: str) -> Completion:
    """A request's result when it failed before any output: ``error`` set, finish_reason "error"."""
    result = Completion(request_id, list(prompt_token_ids))
    result.error, result.finish_reason = error, "error"
    return result


async def unwrap(ref):
    """Await a Ray ref (or a coroutine awaiting one, such as :func:`granted`); rayinfer's own errors (bad
    request, unsupported, ...) come back as themselves, not wrapped in Ray's RayTaskError."""
    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, RayInferError):
            raise e.cause from None
        if isinstance(e.cause, ValueError):  # a validation error raised below rayinfer's types
            raise InvalidRequestError(str(e.cause)) from None
        raise


class _FleetClient:
    """What every topology's client shares: the router, the fleet's facts, complete, stats, shutdown."""

    def __init__(self, router, info: FleetInfo, owned: bool = False):
        self.router = router
        self.info = info
        self.max_model_len = info.max_model_len
        self.owned = owned
        self._muxes: dict[str, OutputMux] = {}  # by actor id: this process's output stream from each replica
        self._stale = False  # a replica failed: fetch the fleet's actors again before the next call
        self.encoder_pool = None  # the fleet's encoder replicas, if any (encode / prefill / decode)
        if info.encoders:
            from rayinfer.actors.encoder_actor import EncoderPool, actor_encode

            self.encoder_pool = EncoderPool([actor_encode(e, info.encoder_transport) for e in info.encoders])

    async def encode(self, mm_inputs: list[MultiModalInput] | None) -> list[MultiModalInput] | None:
        """A request's images with their embeddings from the fleet's encoder replicas (as object-store
        refs, ``encoder_actor.EmbedsRef``), or as given when the fleet has none.

        Raises:
            InvalidRequestError ("image"): an image the encoder rejects (this request only).
            EngineInternalError: every encoder replica failed.
        """
        if not mm_inputs or self.encoder_pool is None:
            return mm_inputs
        try:
            return await self.encoder_pool.encode(mm_inputs)
        except ray.exceptions.RayError as e:
            raise EngineInternalError(f"image encoding failed: {type(e).__name__}: {e}") from e

    async def replica(self, index: int):
        """The actor at ``FleetInfo.replicas[index]``; after a replica failed (:meth:`replica_failed`) the
        fleet's actors are fetched from the router first, as it may have replaced a dead one."""
        if self._stale:
            self._stale = False
            self.info.replicas = await self.router.replicas.remote()
        return self.info.replicas[index]

    async def replica_failed(self, role: str, replica: int, error: BaseException | None) -> None:
        """Tell the router that replica ``replica`` of ``role`` failed (it probes the replica, keeps it
        out of picks, replaces it if it is dead) and fetch the fleet's actors before the next call. Returns
        once the router has the report, so the caller's next pick leaves the replica out or waits for it."""
        cause = getattr(error, "cause", None) or error
        self._stale = True
        await self.router.report_failure.remote(role, replica, getattr(cause, "actor_id", None))

    def mux(self, actor) -> OutputMux:
        """This client's output stream from ``actor`` (an EngineActor), opened on first use."""
        key = actor._actor_id.hex()
        mux = self._muxes.get(key)
        if mux is None:
            mux = self._muxes[key] = OutputMux(actor)
        return mux

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None
                 ) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None) -> Completion:
        """Run one request to the end; a rejected or failed request comes back with ``error`` set."""
        result = Completion(request_id or uuid.uuid4().hex, list(prompt_token_ids))
        try:
            async for out in self.generate(prompt_token_ids, params, result.request_id,
                                           **({"mm_inputs": mm_inputs} if mm_inputs else {})):
                result.add(out)
        except (RayInferError, ValueError) as e:
            result.error, result.finish_reason = str(e), "error"
        except ray.exceptions.RayError as e:
            result.error, result.finish_reason = f"internal error: {type(e).__name__}", "error"
        return result

    async def stats(self) -> FleetStats:
        return await self.router.stats.remote()

    async def flush(self) -> None:
        """PD: wait until the prefill replicas' write-through puts reached the KV store."""
        await self.router.flush.remote()

    def shutdown(self) -> None:
        """Stop the fleet when this client started it (``make_client``); otherwise only let go."""
        for mux in self._muxes.values():
            mux.close()
        self._muxes.clear()
        if self.owned:
            try:
                ray.get(self.router.shutdown.remote(), timeout=60)
            except ray.exceptions.RayError:
                pass
            ray.kill(self.router)


async def _stream(gen, abort, what: str) -> AsyncGenerator[RequestOutput, None]:
    """Yield the deltas of a Ray streaming call until the finished one; if the consumer leaves first,
    ``abort()`` the request and cancel the call (its KV blocks are freed).

    Raises:
        RayInferError: as the replica raised it (a rejected request).
        EngineInternalError: ``what`` failed (dead actor, lost object).
    """
    finished = False
    try:
        async for ref in gen:
            try:
                out = await unwrap(ref)
            except RayInferError:
                finished = True
                raise
            except ray.exceptions.RayError as e:
                finished = True
                raise EngineInternalError(f"{what} failed: {type(e).__name__}") from e
            yield out
            if out.finished:
                finished = True
    finally:
        if not finished:
            abort()
            ray.cancel(gen)


class OutputMux:
    """This process's one output stream from one replica (``EngineActor.outputs``), shared by all the
    requests it sends there, and the per-request queues it fans out to.

    A Ray streaming call per request costs the replica's event loop one Ray item per request per step:
    hundreds of requests decoding at 40 steps a second saturate it and slow the engine's steps. Through
    the mux the replica sends one list per step. If the stream fails (the actor died or restarts),
    every request waiting on it gets the error; the next request opens a new stream.

    Args:
        actor: the EngineActor handle.
    """

    def __init__(self, actor):
        self.actor = actor
        self.client_id = ""  # the open stream's id, new for each stream (_open)
        self.queues: dict[str, asyncio.Queue] = {}
        self._gen = None
        self._task: asyncio.Task | None = None

    def _open(self) -> str:
        """The client id of the open stream (a new stream, and id, after one failed or its loop ended)."""
        if self._task is None or self._task.done():
            self.client_id = uuid.uuid4().hex
            self._gen = self.actor.outputs.options(num_returns="streaming").remote(self.client_id)
            self._task = asyncio.get_running_loop().create_task(self._pump(self._gen))
        return self.client_id

    async def _pump(self, gen) -> None:
        error: BaseException
        try:
            async for ref in gen:
                for request_id, item in await ref:
                    queue = self.queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(item)
            error = ray.exceptions.RayError("the replica's output stream ended")
        except ray.exceptions.RayError as e:
            error = e
        except asyncio.CancelledError:  # its event loop ends (asyncio.run returns) or close()
            ray.cancel(gen)
            raise
        for queue in self.queues.values():  # every request waiting on this stream fails with it
            queue.put_nowait(error)

    async def generate(self, request_id: str, submit, *args, **kwargs) -> AsyncGenerator[RequestOutput, None]:
        """Send a request with ``submit`` (an actor method taking ``client_id, request_id, *args``) and
        yield its deltas until the finished one; if the consumer leaves first, abort it on the replica.

        Raises:
            the request's exception as the replica delivered it (a ValueError for a rejected request,
            a RuntimeError for a failed step), or a ``ray.exceptions.RayError`` when the actor or its
            stream failed; a RayTaskError of ``submit`` unwrapped as :func:`unwrap` does.
        """
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = queue
        finished = False
        try:
            client_id = self._open()
            await unwrap(submit.remote(client_id, request_id, *args, **kwargs))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self.queues.get(request_id) is queue:
                del self.queues[request_id]
            if not finished:
                self.actor.abort.remote(request_id)

    def close(self) -> None:
        """Stop listening (the replica aborts this client's requests still running)."""
        if self._task is not None and not self._task.done():
            try:
                ray.cancel(self._gen)
                self._task.cancel()
            except Exception:  # noqa: BLE001 - the stream or its loop is already gone
                pass
        self._gen = self._task = None


class ColocatedClient(_FleetClient):
    """Data-parallel NORMAL replicas: the router picks, the client streams from the replica. A request
    whose replica actor dies is sent again (up to ``_REPLICA_ATTEMPTS`` picks), to another replica or to the
    failed one once it restarted or was replaced; a stream cut after its first tokens resumes there from the
    tokens it already has (re-prefilled with the prompt), and its text goes on where the caller's stopped."""

    num_resumed = 0  # streams this client resumed on another replica after theirs died mid-stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas from the replica the router picks (see ``EngineClient.generate``).

        If the replica dies mid-stream, the request goes on on another pick with ``output_token_ids`` the
        tokens streamed so far and ``num_emitted_chars`` the text's length, so the caller sees one stream:
        the same tokens as without the failure under greedy sampling (seeded sampling draws anew), and text
        the dead replica held back for stop strings, or a stop string across the cut, not lost.
        """
        request_id = request_id or uuid.uuid4().hex
        mm_inputs = await self.encode(mm_inputs)
        extra = {"mm_inputs": mm_inputs} if mm_inputs else {}
        tokens: list[int] = []  # streamed so far
        num_chars = 0  # characters of text streamed so far
        resumed = False
        for attempt in range(1, _REPLICA_ATTEMPTS + 1):
            idx = await self._pick(prompt_token_ids)
            try:
                mux = self.mux(await self.replica(idx))
                resume = {"output_token_ids": list(tokens), "num_emitted_chars": num_chars} if tokens else {}
                async with aclosing(mux.generate(request_id, mux.actor.submit, prompt_token_ids, params,
                                                 **resume, **extra)) as outs:
                    async for out in outs:
                        tokens += out.new_token_ids
                        num_chars += len(out.new_text)
                        yield out
                return
            except (RayInferError, ValueError):
                raise
            except (ray.exceptions.RayError, RuntimeError) as e:
                if isinstance(e, ray.exceptions.RayActorError):
                    await self.replica_failed("colocated", idx, e)
                    if attempt < _REPLICA_ATTEMPTS:
                        if attempt == 1:
                            self.router.count_resend.remote()
                        if tokens and not resumed:
                            resumed = True
                            self.num_resumed += 1
                            logger.warning("request %s: replica %d died after %d tokens; resuming the stream on the "
                                           "router's next pick (another replica, or this one's restart or "
                                           "replacement)", request_id, idx, len(tokens))
                        continue
                raise EngineInternalError(f"replica {idx} failed: {type(e).__name__}: {e}") from e
            finally:
                self.router.release.remote(idx)

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None) -> Completion:
        """Run one request to the end on the replica the router picks, in one call (no per-token
        stream: the batch job's path); a rejected or failed request comes back with ``error`` set."""
        request_id = request_id or uuid.uuid4().hex
        try:
            mm_inputs = await self.encode(mm_inputs)
        except RayInferError as e:
            return _failed(request_id, prompt_token_ids, str(e))
        extra = {"mm_inputs": mm_inputs} if mm_inputs else {}
        attempt = 0
        while True:
            attempt += 1
            try:
                idx = await self._pick(prompt_token_ids)
            except RayInferError as e:  # every replica is dead for good
                return _failed(request_id, prompt_token_ids, str(e))
            try:
                actor = await self.replica(idx)
                return await unwrap(actor.complete.remote(request_id, prompt_token_ids, params, **extra))
            except ray.exceptions.RayError as e:
                if isinstance(e, ray.exceptions.RayActorError):
                    await self.replica_failed("colocated", idx, e)
                    if attempt < _REPLICA_ATTEMPTS:
                        if attempt == 1:
                            self.router.count_resend.remote()
                        continue
                return _failed(request_id, prompt_token_ids,
                               f"internal error: replica {idx} failed ({type(e).__name__})")
            finally:
                self.router.release.remote(idx)

    async def _pick(self, prompt_token_ids: list[int]) -> int:
        """The router's pick (counted against the replica until released).

        Raises:
            ReplicasDeadError: every replica is gone for good.
        """
        return await unwrap(granted(self.router.pick.remote(list(prompt_token_ids[: self.info.block_size]),
                                                            len(prompt_token_ids)),
                                    lambda i: self.router.release.remote(i)))


class EPClient(_FleetClient):
    """The expert-parallel replica: requests stream through the router, which sends them to
    the self-stepping EP ranks and reads their outputs."""

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, mm_inputs: list[MultiModalInput] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas from the EP ranks (see ``EngineClient.generate``)."""
        if mm_inputs:
            raise UnsupportedError("images are served by the colocated and pd topologies, not ep", "image_url")
        request_id = request_id or uuid.uuid4().hex
        gen = self.router.generate.options(num_returns="streaming").remote(request_id, list(prompt_token_ids),
                                                                           params)
        async with aclosing(_stream(gen, lambda: self.router.abort.remote(request_id), "the EP replica")) as outs:
            async for out in outs:
                yield out


async def granted(ref, release):
    """Await a grant from the router (a replica pick, a ticket); if the caller is cancelled meanwhile,
    ``release`` what the router grants, so its count of in-flight requests stays true. The release runs on
    Ray's side (a callback of the ref's future), so it happens even when the caller's event loop is gone
    by then (a job whose run ended on an error); ``release`` must be a thread-safe call (a ``.remote``)."""
    try:
        return await ref
    except asyncio.CancelledError:
        def give_back(fut: concurrent.futures.Future) -> None:
            if not fut.cancelled() and fut.exception() is None:  # else the pick failed: nothing was granted
                release(fut.result())

        ref.future().add_done_callback(give_back)
        raise


def client_for(router, info: FleetInfo, owned: bool = False) -> EngineClient:
    """The client class of ``info.topology`` over a started fleet."""
    if info.topology == "pd":
        from rayinfer.actors.pd import PDClient

        return PDClient(router, info, owned)
    return (EPClient if info.topology == "ep" else ColocatedClient)(router, info, owned)


async def connect(router, owned: bool = False) -> EngineClient:
    """The client for a fleet (started here if it was not yet), by its topology.

    Args:
        router: a RouterActor handle.
        owned: whether the client's ``shutdown`` stops the fleet.
    Raises:
        TimeoutError, ValueError: when the fleet cannot start (see ``Router.start``).
    """
    return client_for(router, await unwrap(router.start.remote()), owned)


def start_fleet(model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig):
    """Start a Router actor for ``parallel`` (its replicas start on the first ``connect``).

    Raises:
        UnsupportedError: for a topology that is not run yet.
    """
    check_supported(parallel)
    return RouterActor.remote(model_config, engine_config, parallel)


def make_client(model_config: ModelConfig, engine_config: EngineConfig, parallel: ParallelConfig | None = None,
                ) -> EngineClient:
    """Start a fleet, wait until it is ready, and return a client that owns it (the batch job's and the
    tests' way in; call it outside an event loop).

    Raises:
        UnsupportedError, ValueError: for a bad or unsupported config; TimeoutError: the cluster
            cannot place the replicas (the message names the shortfall).
    """
    router = start_fleet(model_config, engine_config, parallel or ParallelConfig())
    try:
        try:
            info: FleetInfo = ray.get(router.start.remote())  # pyright: ignore[reportAssignmentType]
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, (ValueError, TimeoutError, RayInferError)):
                raise e.cause from None
            raise
        return client_for(router, info, owned=True)
    except BaseException:
        ray.kill(router)
        raise
