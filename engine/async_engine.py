"""The engine's step loop on its own thread, with asyncio streams per request.

The model step is blocking CPU/GPU work; running it on a dedicated thread keeps the caller's event loop
(a Ray async actor, a Serve replica) free to accept requests, stream outputs and handle aborts while a
step runs. Requests and aborts cross to the loop thread through a queue; the core's token-id deltas come
back with one ``loop.call_soon_threadsafe`` per step and event loop, and each request's callback turns them
into text on the caller's event loop (:class:`~rayinfer.engine.output_processor.RequestOutputProcessor`), so
detokenization and stop strings never hold up a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from rayinfer.engine.llm_engine import LLMEngine
from rayinfer.engine.output_processor import RequestOutputProcessor
from rayinfer.engine.types import Completion, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    """Wraps an :class:`LLMEngine` with a background step loop.

    Args:
        engine: the engine; only the loop thread touches it after construction.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        # loop thread only: each live request's stream, bound when its "add" is taken from the inbox, so a
        # request id reused after an abort never receives the aborted request's late deltas
        self._live: dict[str, tuple[asyncio.AbstractEventLoop, Callable]] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list] = {}  # loop thread: deliveries of this step
        self._wake = threading.Event()
        self._stopped = False
        self._stats: dict = engine.stats()
        self._num_steps, self._step_busy_s = 0, 0.0  # loop thread: steps run and seconds spent in them
        self._grammars = None  # GrammarCompilerService, built on the first constrained request
        self.parked_kv_ttl_s = 300.0  # PREFILL role: parked KV nobody took (its router died) is freed after this
        self._next_expiry = 0.0  # loop thread: when to look for expired parked KV next
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- caller side (event loop) --------------------------------------------------------------
    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     deliver: Callable[[RequestOutput | Exception], None], detokenize: bool = True,
                     **kwargs) -> None:
        """Queue a request whose deltas go to ``deliver`` on the caller's event loop.

        ``deliver`` is called with each delta (text and stop strings processed, the last one
        ``finished``) or with one exception (the engine rejected the request: a ValueError naming the
        problem; or its step failed), and never again after that. The loop thread hands each step's
        deltas for one event loop over in one wake-up, so a replica streaming hundreds of requests costs
        the loop one callback batch per step, not one per request. A ``params.response_format`` is
        compiled here (on a thread pool, cached) before the request is queued. ``detokenize=False``
        delivers the core's deltas as they are (no text, no stop strings: for a caller that detokenizes
        once per request itself, as the PD client does across a request's prefill and decode replicas).
        ``num_emitted_chars`` (with ``output_token_ids``) resumes a stream another replica began: see
        ``RequestOutputProcessor``.

        Raises:
            ValueError: the response_format is invalid, fails to compile or times out (a GrammarError).
        """
        if params.response_format is not None and kwargs.get("grammar") is None:
            compiler = self._grammars or await asyncio.to_thread(self.grammar_compiler)  # vocab scan: ~1 s once
            kwargs["grammar"] = matcher = await compiler.matcher(params.response_format)
            for token in (kwargs.get("output_token_ids") or []) if matcher is not None else []:
                matcher.accept_token(token)  # DECODE role: tokens sampled on the prefill replica
        num_emitted_chars = kwargs.pop("num_emitted_chars", None)
        processor = (RequestOutputProcessor(self.engine.tokenizer, request_id, prompt_token_ids, params,
                                            kwargs.get("output_token_ids"), num_emitted_chars)
                     if detokenize else None)
        done = False

        def on_core_output(item: RequestOutput | Exception) -> None:
            nonlocal done
            if done:  # the core's tokens after a stop string, before its abort landed
                return
            if isinstance(item, Exception):
                done = True
                deliver(item)
                return
            out = processor.process(item) if processor is not None else item
            if out is None:
                return
            if out.finished:
                done = True
                if processor is not None and processor.needs_core_abort:  # a stop string: the core runs on
                    self.abort(request_id)
            deliver(out)

        self._inbox.put(("add", request_id, prompt_token_ids, params, kwargs,
                         (asyncio.get_running_loop(), on_core_output)))
        self._wake.set()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its deltas (with text) until it finishes (see :meth:`submit`).

        Deltas that queued while the consumer was busy come as one output. If the consumer leaves
        before the last one, the request is aborted.

        Raises:
            ValueError: if the engine rejects the request (the message names the problem), or its
                response_format is invalid, fails to compile or times out (a GrammarError).
        """
        stream: asyncio.Queue = asyncio.Queue()
        await self.submit(request_id, prompt_token_ids, params, stream.put_nowait, **kwargs)
        kwargs = {}  # the engine owns them now (a KV payload is freed once imported, not when the stream ends)
        finished = False
        try:
            while True:
                items = [await stream.get()]
                while not stream.empty():
                    items.append(stream.get_nowait())
                merged, error = None, None
                for item in items:
                    if isinstance(item, Exception):
                        error = item
                        break
                    merged = item if merged is None else merge_outputs(merged, item)
                if merged is not None:
                    finished = merged.finished
                    yield merged
                    if finished:
                        return
                if error is not None:
                    finished = True
                    raise error
        finally:
            if not finished:  # the consumer went away (client disconnect, cancel): free the request
                self.abort(request_id)

    async def complete(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       **kwargs) -> Completion:
        """Run a request to the end; a rejected request comes back with ``error`` set (never raises)."""
        result = Completion(request_id, list(prompt_token_ids))
        try:
            async for out in self.generate(request_id, prompt_token_ids, params, **kwargs):
                result.add(out)
        except ValueError as e:
            result.error, result.finish_reason = str(e), "error"
        return result

    def grammar_compiler(self):
        """The replica's GrammarCompilerService (xgrammar, for the engine's tokenizer and vocab size)."""
        if self._grammars is None:
            from rayinfer.engine.structured_output import GrammarCompilerService

            e = self.engine
            self._grammars = GrammarCompilerService.from_tokenizer(e.tokenizer, e.vocab_size, e.eos_token_ids)
        return self._grammars

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown ids are ignored)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def run_on_loop(self, fn: Callable[[], object]) -> "concurrent.futures.Future":
        """Run ``fn()`` on the loop thread between two steps (thread-safe), never during one: the engine's
        model and buffers are then free (a context-parallel peer's share of another rank's prefill runs so).
        Returns a future of its result (or its exception)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, future))
        self._wake.set()
        return future

    def release_kv(self, request_ids: list[str]) -> None:
        """Free parked KV (PREFILL role) on the loop thread (thread-safe; unknown ids are ignored)."""
        self._inbox.put(("release_kv", list(request_ids)))
        self._wake.set()

    def stats(self) -> dict:
        """The engine's gauges and counters as of the last step."""
        return dict(self._stats)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- loop thread ---------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        """Queue a core delta or an exception for the request's callback (the last one unbinds it);
        :meth:`_flush` hands them over."""
        entry = self._live.get(request_id)
        if entry is None:
            return
        if isinstance(item, Exception) or item.finished:
            del self._live[request_id]
        loop, callback = entry
        self._outbox.setdefault(loop, []).append((callback, item))

    def _flush(self) -> None:
        """Hand the queued deltas to their event loops: one wake-up per loop."""
        outbox, self._outbox = self._outbox, {}
        for loop, calls in outbox.items():
            try:
                loop.call_soon_threadsafe(_call_all, calls)
            except RuntimeError:  # the caller's loop is closed: nobody is listening
                pass

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _, rid, prompt, params, kwargs, entry = msg
                try:
                    self.engine.add_request(rid, prompt, params, **kwargs)
                except ValueError as e:  # not bound: the id may be a live request's (a duplicate)
                    loop, callback = entry
                    self._outbox.setdefault(loop, []).append((callback, e))
                else:
                    self._live[rid] = entry
            elif msg[0] == "release_kv":
                self.engine.release_kv(msg[1])
            elif msg[0] == "call":
                _, fn, future = msg
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
            else:
                self.engine.abort_request(msg[1])
                self._live.pop(msg[1], None)

    def _run(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            self._flush()  # rejections found while adding
            if self.engine.parked and time.monotonic() >= self._next_expiry:  # a scan a second, not a step
                self.engine.expire_kv(self.parked_kv_ttl_s)
                self._next_expiry = time.monotonic() + 1.0
            if not self.engine.has_unfinished_requests():
                self._stats = {**self.engine.stats(), "num_steps": self._num_steps, "step_busy_s": self._step_busy_s}
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails the requests in it, not the replica
                logger.exception("engine step failed")
                for rid in list(self.engine.scheduler.requests):
                    self.engine.abort_request(rid)
                    self._deliver(rid, RuntimeError(f"engine step failed: {e}"))
                self._flush()
                continue
            for out in outputs:
                self._deliver(out.request_id, out)
            self._flush()
            self._num_steps += 1
            self._step_busy_s += time.perf_counter() - start
            self._stats = {**self.engine.stats(), "num_steps": self._num_steps, "step_busy_s": self._step_busy_s}


def _call_all(calls: list) -> None:
    """Run one step's deliveries on the caller's loop; a failing callback fails alone."""
    for callback, item in calls:
        try:
            callback(item)
        except Exception:  # noqa: BLE001 - one consumer's bug must not starve the others
            logger.exception("delivering an engine output failed")


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive outputs of a request: tokens, text and logprobs joined, the later
    one's finish, counts and handle kept. A consumer slower than the step loop (a Ray stream, an HTTP
    client) then gets one item per wake-up instead of one per step."""
    logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = list(first.new_logprobs or []) + list(later.new_logprobs or [])
    return dataclasses.replace(later, new_token_ids=list(first.new_token_ids) + list(later.new_token_ids),
                               new_text=first.new_text + later.new_text, new_logprobs=logprobs,
                               error=later.error or first.error)
