"""Output processing: the engine core's token-id deltas -> the caller's text deltas (after vLLM v1's
OutputProcessor).

The core (:class:`~rayinfer.engine.llm_engine.LLMEngine`) samples tokens and ends requests for the
reasons it can see in token ids: EOS, a stop token id, ``max_tokens`` or the context limit, a finished
grammar, an abort, a hand-back ("preempted") or a finished prefill ("prefilled"). Text is made here,
outside the step loop: incremental detokenization, stop strings, ``include_stop_str_in_output``. A stop
string ends a request here first; the caller then aborts it in the core, which may have run a step or
two more meanwhile (async scheduling, the abort crossing threads); those tokens are dropped here.

Glossary: a *core delta* is a :class:`RequestOutput` from ``LLMEngine.step`` (token ids, ``new_text``
empty); an *output* is the :class:`RequestOutput` the caller streams (text filled in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rayinfer.engine.detokenizer import IncrementalDetokenizer
from rayinfer.engine.types import RequestOutput, SamplingParams


class RequestOutputProcessor:
    """One request's detokenizer and stop strings; turns its core deltas into outputs.

    Finish rules (the core's reason stands unless noted):

    1. A stop string matched on a delta the core did not finish ends the request with finish_reason
       "stop" and ``stop_reason`` the string; :attr:`needs_core_abort` becomes True.
    2. A stop string matched on the token that exhausts ``max_tokens`` or the context limit (core
       reason "length") wins: "stop" with the string.
    3. On a core "stop" (EOS, stop token id, grammar end) the text is still cut at a matched stop
       string; ``stop_reason`` stays the core's (the token id, or None).
    4. "prefilled", "preempted", "abort" and "error" stand (a prefill's stop string is the decoding
       side's to act on).
    5. Stop strings are matched only on tokens after the first ``min_tokens`` output tokens.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        request_id: the id outputs carry.
        prompt_token_ids: the prompt.
        params: the request's sampling params (stop, include_stop_str_in_output, skip_special_tokens,
            min_tokens).
        output_token_ids: tokens generated before the core took the request (DECODE role, re-prefill):
            context for detokenization, counted towards ``min_tokens``, their text not emitted again.
        num_emitted_chars: with ``output_token_ids``, a stream resumed from an earlier processor of the
            same request (its replica died): that processor emitted the first ``num_emitted_chars``
            characters of their text. The rest (held back for stop strings or inside a character) comes out
            here, and a stop string may begin in their text. None: their text is context only, as above.
    """

    def __init__(self, tokenizer, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 output_token_ids: list[int] | None = None, num_emitted_chars: int | None = None):
        self.request_id = request_id
        self.params = params
        prior = list(output_token_ids or [])
        if num_emitted_chars is None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids) + prior, params,
                                                      num_output_tokens=len(prior))
        else:  # the earlier processor's detokenizer, rebuilt: same tokens, same text, same hold-back
            self.detokenizer = IncrementalDetokenizer(tokenizer, list(prompt_token_ids), params)
            self.detokenizer.add_tokens(prior)
            self.detokenizer.num_emitted = num_emitted_chars
        self.is_finished = False
        self.needs_core_abort = False  # finished here by a stop string while the core still runs it

    def process(self, delta: RequestOutput) -> RequestOutput | None:
        """Detokenize one core delta and apply the stop strings.

        Args:
            delta: the core's delta for this request (``new_text`` ignored).
        Returns:
            the output to stream, or None once the request has finished (a late delta is dropped).
            When the output is finished and :attr:`needs_core_abort` is True, the caller must abort
            the request in the core.
        """
        if self.is_finished:
            return None
        detok = self.detokenizer
        tokens = delta.new_token_ids
        before = detok.num_output_tokens
        stop = detok.add_tokens(tokens) if tokens else None
        finished, reason, stop_reason = delta.finished, delta.finish_reason, delta.stop_reason
        new_token_ids, new_logprobs = tokens, delta.new_logprobs
        if stop is not None:
            consumed = detok.num_output_tokens - before
            truncated = consumed < len(tokens)
            if truncated:  # a multi-token delta: the tokens after the stop string are dropped
                new_token_ids = tokens[:consumed]
                new_logprobs = new_logprobs[:consumed] if new_logprobs is not None else None
            if not finished or truncated or reason == "length":
                finished, reason, stop_reason = True, "stop", stop
            self.needs_core_abort = not delta.finished
        self.is_finished = finished
        return dataclasses.replace(
            delta,
            new_token_ids=list(new_token_ids),
            new_text=detok.take_delta(finished),
            new_logprobs=new_logprobs,
            finished=finished,
            finish_reason=reason if finished else None,
            stop_reason=stop_reason if finished else None,
            num_output_tokens=delta.num_output_tokens - (len(tokens) - len(new_token_ids)),
        )


@dataclass
class ProcessedOutputs:
    """What :meth:`OutputProcessor.process_outputs` gives back.

    Attributes:
        request_outputs: the outputs to stream, in the order of the core deltas.
        reqs_to_abort: ids of requests a stop string ended here: abort them in the core.
    """

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """The :class:`RequestOutputProcessor` of every live request of one engine (the offline loop's and
    a lockstep group's view; ``AsyncLLMEngine.generate`` keeps one per stream instead).

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestOutputProcessor] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    output_token_ids: list[int] | None = None) -> None:
        """Start tracking a request the core accepted (arguments as for :class:`RequestOutputProcessor`)."""
        self.requests[request_id] = RequestOutputProcessor(self.tokenizer, request_id, prompt_token_ids, params,
                                                           output_token_ids)

    def abort_request(self, request_id: str) -> None:
        """Forget a request (unknown ids are ignored); its later deltas are dropped."""
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, deltas: list[RequestOutput]) -> ProcessedOutputs:
        """Turn one step's core deltas into outputs; finished requests are forgotten.

        Deltas of requests not tracked here (finished, aborted, never added) are dropped.
        """
        result = ProcessedOutputs()
        for delta in deltas:
            proc = self.requests.get(delta.request_id)
            out = proc.process(delta) if proc is not None else None
            if out is None:
                continue
            result.request_outputs.append(out)
            if out.finished:
                del self.requests[delta.request_id]
                if proc.needs_core_abort:
                    result.reqs_to_abort.append(delta.request_id)
        return result
