"""PDClient: prefill/decode disaggregation over Ray actors, with a KV-cache store between them.

Per request (DESIGN.md "Disaggregated"):
    store.match(block hashes) -> store.get -> pick a prefill replica (PrefillBalancer) -> prefill: load
    the stored prefix, compute the rest, sample the first token, write new full blocks through to the
    store -> pop_kv (object store, or Ray Direct Transport GPU to GPU) -> pick a decode replica
    (DecodeBalancer) -> decode: import the KV, stream tokens.

Ownership: the payload ref comes back from ``pop_kv``, so this client (its caller) owns it and it
outlives the prefill actor; stored blocks are owned by the KVStoreActor. A decode replica that must
preempt hands the request back ("preempted") and it is re-prefilled from prompt + outputs so far; a
prefill or decode actor that dies is restarted by Ray (``max_restarts``) and its in-flight requests are
re-prefilled the same way. Tokens are streamed to the caller exactly once because every leg starts from
the tokens already streamed. Text is detokenized here, once per request, so stop strings that span a
handoff are still found.

Ray Direct Transport (``actors/kv_transport.py``): over nccl/gloo all replicas join one collective
group and transfers run one at a time per actor (collective send/recv must pair up in order, which
async actors do not guarantee); over cuda_ipc (replicas sharing a GPU) the decode replica maps the
prefill replica's device buffer, no group needed. A restarted actor is outside the group, so its KV
goes through the object store; a failed transfer makes Ray kill both ends for good and destroy the
group, so this client then uses the object store for every transfer.

Same interface as EngineClient (``generate``, ``complete``, ``stats``, ``shutdown``, ``max_model_len``),
so the batch job and Serve take either.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
import weakref
from dataclasses import dataclass, field
from typing import AsyncIterator

import ray

from rayinfer.actors.engine_actor import EngineActor, EngineActorImpl
from rayinfer.actors.kv_store import KVStoreActor
from rayinfer.actors.kv_transport import COLLECTIVE_TRANSPORTS, KV_TRANSPORTS, prepare_transport, resolve_kv_transport
from rayinfer.actors.router import DecodeBalancer, PrefillBalancer
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.detokenizer import IncrementalDetokenizer
from rayinfer.engine.kv_store_index import block_hashes
from rayinfer.engine.types import Completion, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
_GIB = 1 << 30


@dataclass
class PDConfig:
    """Topology of a disaggregated deployment.

    Attributes:
        num_prefill, num_decode: replicas of each role.
        kv_transport: "auto" (nccl when each replica holds a GPU, cuda_ipc when they share GPUs, else
            the object store), "object_store", "nccl", "cuda_ipc" or "gloo" (see actors/kv_transport.py).
        kv_store_max_blocks, kv_store_max_gib, kv_store_ttl_s: KV store limits (None: no limit).
        max_restarts: Ray restarts of each engine actor (-1: forever).
        max_retries: re-prefills of one request after actor failures before it fails.
        num_cpus_per_replica, num_gpus_per_replica: Ray resources of each engine actor.
        prefill_overrides, decode_overrides: EngineConfig fields set on one role only.
    """

    num_prefill: int = 1
    num_decode: int = 1
    kv_transport: str = "auto"
    kv_store_max_blocks: int | None = None
    kv_store_max_gib: float | None = 2.0
    kv_store_ttl_s: float | None = None
    max_restarts: int = 3
    max_retries: int = 5
    num_cpus_per_replica: float = 1
    num_gpus_per_replica: float = 0
    prefill_overrides: dict = field(default_factory=dict)
    decode_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.num_prefill <= 0 or self.num_decode <= 0:
            raise ValueError(f"num_prefill and num_decode must be positive, got {self.num_prefill}, {self.num_decode}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {self.kv_transport!r}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")


@dataclass
class _Stream:
    """One request as the client sees it across its legs."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    outputs: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None


class _HandedBack(Exception):
    """A decode replica preempted the request; re-prefill it."""


class PDClient:
    """Starts prefill and decode EngineActors and a KVStoreActor, and runs requests through them.

    Args:
        model_config: every replica's model.
        engine_config: every replica's engine settings (``role`` is set per replica).
        config: the topology.
    Raises:
        ValueError: for a bad config (before any actor starts).
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig, config: PDConfig | None = None):
        from rayinfer.model.loader import load_tokenizer

        self.config = cfg = config or PDConfig()
        self.transport = resolve_kv_transport(cfg.kv_transport, cfg.num_gpus_per_replica)
        prepare_transport(self.transport)
        pcfg = dataclasses.replace(engine_config, role="prefill", **cfg.prefill_overrides)
        dcfg = dataclasses.replace(engine_config, role="decode", **cfg.decode_overrides)
        self.block_size = engine_config.block_size
        max_bytes = int(cfg.kv_store_max_gib * _GIB) if cfg.kv_store_max_gib else None
        self.store = KVStoreActor.options(num_cpus=0, max_restarts=-1).remote(
            cfg.kv_store_max_blocks, max_bytes, cfg.kv_store_ttl_s)
        actor_cls = EngineActor
        if self.transport != "object_store":
            actor_cls = ray.remote(enable_tensor_transport=True)(EngineActorImpl)
        opts = dict(num_cpus=cfg.num_cpus_per_replica, num_gpus=cfg.num_gpus_per_replica,
                    max_restarts=cfg.max_restarts, max_concurrency=4096)
        self.prefills = [actor_cls.options(**opts).remote(model_config, pcfg, i, kv_store=self.store,
                                                          kv_transport=self.transport)
                         for i in range(cfg.num_prefill)]
        self.decodes = [actor_cls.options(**opts).remote(model_config, dcfg, cfg.num_prefill + i,
                                                         kv_transport=self.transport)
                        for i in range(cfg.num_decode)]
        self.info = ray.get([r.ready.remote() for r in self.prefills + self.decodes])
        if self.transport in COLLECTIVE_TRANSPORTS:
            from ray.experimental.collective import create_collective_group

            create_collective_group(self.prefills + self.decodes, backend=self.transport)
        self._rdt_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> (role, idx) -> Lock
        self.max_model_len = self.info[0]["max_model_len"]
        num_decode_blocks = min(i["num_blocks"] for i in self.info[cfg.num_prefill:])
        self.prefill_lb = PrefillBalancer(cfg.num_prefill)
        self.decode_lb = DecodeBalancer(cfg.num_decode, dcfg.max_num_seqs, num_decode_blocks * self.block_size)
        self.tokenizer = load_tokenizer(model_config.model)
        self._suspects: dict[str, set[int]] = {"prefill": set(), "decode": set()}
        # replicas that failed once: a restarted actor is outside the RDT collective group, so its KV
        # goes through the object store from then on
        self._restarted: dict[str, set[int]] = {"prefill": set(), "decode": set()}
        # a failed RDT transfer makes Ray kill both ends and destroy the group: object store from then on
        self._rdt_ok = self.transport != "object_store"
        self._probes: set[asyncio.Task] = set()
        self.num_retries = 0  # legs re-run after an actor failure
        self.num_handbacks = 0  # legs re-run after a decode replica preempted

    # -- the caller's side ----------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Stream a request's deltas: prefill on one replica, decode on another, retried on failures.

        If the consumer stops early, the request is aborted on its decode replica.

        Raises:
            ValueError: when an engine rejects the request, or for keyword arguments this client does
                not take.
        """
        if kwargs:
            raise ValueError(f"PDClient.generate takes no {', '.join(sorted(kwargs))}")
        rid = request_id or uuid.uuid4().hex
        st = _Stream(rid, list(prompt_token_ids), params,
                     IncrementalDetokenizer(self.tokenizer, list(prompt_token_ids), params))
        failures = leg = 0
        while True:
            erid = f"{rid}@{leg}"  # a fresh engine-side id per leg: a late copy never collides
            leg += 1
            legs = self._run_legs(st, erid)
            try:
                async for out in legs:
                    yield out
                    if out.finished:
                        return
            except _HandedBack:
                self.num_handbacks += 1
            except ray.exceptions.RayError as e:
                failures += 1
                self.num_retries += 1
                if failures > self.config.max_retries:
                    yield self._error(st, f"gave up after {failures} failed attempts: {e}")
                    return
                logger.warning("request %s: leg %s failed (%s); re-prefilling %d tokens", rid, erid,
                               type(e).__name__, len(st.prompt) + len(st.outputs))
                await asyncio.sleep(min(0.05 * 2**failures, 2.0))
            finally:
                await legs.aclose()  # runs its cleanup now (abort on the decode replica), not at GC

    async def complete(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       **kwargs) -> Completion:
        """Run one request to the end; a rejected request comes back with ``error`` set (never raises)."""
        result = Completion(request_id or uuid.uuid4().hex, list(prompt_token_ids))
        try:
            async for out in self.generate(prompt_token_ids, params, result.request_id, **kwargs):
                result.add(out)
        except ValueError as e:
            result.error, result.finish_reason = str(e), "error"
        return result

    async def stats(self) -> list[dict]:
        """Each replica's gauges and counters (with ``role``), then the KV store's (``kv_store_*``)."""
        actors = self.prefills + self.decodes
        results = await asyncio.gather(*[a.stats.remote() for a in actors], self.store.stats.remote(),
                                       return_exceptions=True)
        out = []
        for info, r in zip(self.info + [{"replica_id": "kv_store", "role": "kv_store"}], results):
            if isinstance(r, Exception):
                out.append({"replica_id": info["replica_id"], "role": info["role"], "error": str(r)})
            else:
                out.append({"role": info["role"], **r})
        out[-1]["num_retries"], out[-1]["num_handbacks"] = self.num_retries, self.num_handbacks
        return out

    async def flush(self) -> None:
        """Wait until every prefill replica's write-through puts reached the store (for tests, benchmarks)."""
        await asyncio.gather(*[p.flush_kv_writes.remote() for p in self.prefills], return_exceptions=True)

    def shutdown(self) -> None:
        for a in self.prefills + self.decodes + [self.store]:
            ray.kill(a, no_restart=True)

    # -- one prefill leg and one decode leg ------------------------------------------------------
    async def _run_legs(self, st: _Stream, erid: str) -> AsyncIterator[RequestOutput]:
        """Prefill prompt + outputs so far, then decode; raises _HandedBack or a RayError to re-run."""
        tokens = st.prompt + st.outputs
        hashes = block_hashes(tokens, self.block_size)
        layout, refs = await self._stored(hashes)
        ticket = self.prefill_lb.pick(len(tokens), len(refs) * self.block_size, self._suspects["prefill"])
        try:
            replica = await self._replica("prefill", ticket.replica)
            out = await _unwrap(replica.prefill.remote(erid, st.prompt, st.params, list(st.outputs),
                                                       (hashes[: len(refs)], layout, refs)))
        except ray.exceptions.RayActorError as e:
            self._suspect("prefill", ticket.replica, e)
            raise
        finally:
            self.prefill_lb.done(ticket)
        if st.num_cached_tokens is None:
            st.num_cached_tokens = out.num_cached_tokens
        handle = out.kv_handle
        emitted = self._emit(st, out, out.finish_reason != "prefilled")
        try:
            yield emitted
        except GeneratorExit:
            if handle is not None:
                replica.pop_kv.remote(erid)  # drop the exported payload now rather than at its TTL
            raise
        if emitted.finished:
            return
        dticket = self.decode_lb.pick(len(st.prompt) + len(st.outputs), self._suspects["decode"])
        decode, clean, rdt = None, False, False
        try:
            decode = await self._replica("decode", dticket.replica)
            rdt = (self._rdt_ok and ticket.replica not in self._restarted["prefill"]
                   and dticket.replica not in self._restarted["decode"])
            if rdt and self.transport not in COLLECTIVE_TRANSPORTS:  # one-sided (cuda_ipc): no pairing
                payload = replica.pop_kv.options(tensor_transport=self.transport).remote(erid)
                await decode.receive_kv.remote(erid, payload)
                payload = None
            elif rdt:  # one collective transfer at a time per actor: send/recv pairs must line up
                async with self._rdt_lock("prefill", ticket.replica), self._rdt_lock("decode", dticket.replica):
                    payload = replica.pop_kv.options(tensor_transport=self.transport).remote(erid)
                    await decode.receive_kv.remote(erid, payload)
                payload = None
            else:
                payload = replica.pop_kv.remote(erid)
            gen = decode.decode.options(num_returns="streaming").remote(
                erid, st.prompt, st.params, list(st.outputs), handle, payload)
            async for ref in gen:
                out = await _unwrap(ref)
                if out.finish_reason == "preempted":
                    clean = True
                    raise _HandedBack()
                self.decode_lb.grow(dticket, len(out.new_token_ids))
                emitted = self._emit(st, out, out.finished)
                clean = emitted.finished and out.finished
                yield emitted
                if emitted.finished:
                    return
        except ray.exceptions.RayActorError as e:
            clean = True
            self._suspect("decode", dticket.replica, e)
            self._suspect("prefill", ticket.replica, e)  # pop_kv's actor may be the one that died
            if rdt and self._rdt_ok:
                logger.error("a KV transfer over %s failed (%s); using the object store from now on",
                             self.transport, type(e).__name__)
                self._rdt_ok = False
            raise
        finally:
            self.decode_lb.done(dticket)
            if not clean and decode is not None:  # the consumer left, or a stop string ended it here
                decode.abort.remote(erid)

    def _emit(self, st: _Stream, out: RequestOutput, engine_finished: bool) -> RequestOutput:
        """Fold a replica's delta into the request and re-detokenize it here (stop strings included)."""
        st.outputs.extend(out.new_token_ids)
        stop = st.detok.add_tokens(out.new_token_ids)
        finished, reason, stop_reason = engine_finished, out.finish_reason, out.stop_reason
        if stop is not None and not finished:
            finished, reason, stop_reason = True, "stop", stop
        return RequestOutput(
            request_id=st.request_id,
            new_token_ids=list(out.new_token_ids),
            new_text=st.detok.take_delta(finished),
            new_logprobs=out.new_logprobs,
            finished=finished,
            finish_reason=reason if finished else None,
            stop_reason=stop_reason if finished else None,
            num_prompt_tokens=len(st.prompt),
            num_output_tokens=len(st.outputs),
            num_cached_tokens=st.num_cached_tokens or 0,
            error=out.error,
        )

    def _error(self, st: _Stream, message: str) -> RequestOutput:
        return RequestOutput(st.request_id, finished=True, finish_reason="error", error=message,
                             num_prompt_tokens=len(st.prompt), num_output_tokens=len(st.outputs))

    async def _stored(self, hashes: list[int]) -> tuple[str | None, list]:
        """(layout, refs) of the stored leading blocks; a store that is down is a miss."""
        if not hashes:
            return None, []
        try:
            n = await self.store.match.remote(hashes)
            if not n:
                return None, []
            return await self.store.get.remote(hashes[:n])
        except ray.exceptions.RayError as e:
            logger.warning("KV store unavailable (%s); computing the prompt in full", type(e).__name__)
            return None, []

    def _rdt_lock(self, role: str, idx: int) -> asyncio.Lock:
        """The lock that keeps one Ray Direct Transport transfer at a time on a replica (per event loop)."""
        locks = self._rdt_locks.setdefault(asyncio.get_running_loop(), {})
        return locks.setdefault((role, idx), asyncio.Lock())

    # -- failed replicas -------------------------------------------------------------------------
    def _suspect(self, role: str, idx: int, error: ray.exceptions.RayActorError) -> None:
        """Keep a replica out of new picks until its ``ready`` answers again (after Ray restarts it).

        Only when ``error`` names this replica's actor (or names none).
        """
        actor = (self.prefills if role == "prefill" else self.decodes)[idx]
        culprit = getattr(error, "actor_id", None)
        if idx in self._suspects[role] or (culprit is not None and culprit != actor._actor_id.hex()):
            return
        self._suspects[role].add(idx)
        self._restarted[role].add(idx)

        async def probe():
            for attempt in range(60):
                try:
                    await actor.ready.remote()
                    self._suspects[role].discard(idx)
                    return
                except ray.exceptions.ActorUnavailableError:  # restarting: ask again
                    await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
                except ray.exceptions.RayError:
                    return  # gone for good: stays out (balancers ignore the exclusion if all are out)

        task = asyncio.get_running_loop().create_task(probe())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _replica(self, role: str, idx: int):
        """The actor, after waiting for it to come back if it is restarting (every replica was out)."""
        actor = (self.prefills if role == "prefill" else self.decodes)[idx]
        if idx in self._suspects[role]:
            await actor.ready.remote()
        return actor


async def _unwrap(ref):
    """Await a ref; an engine's ValueError (bad request) comes back as itself, not wrapped by Ray."""
    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise ValueError(str(e.cause)) from None
        raise
