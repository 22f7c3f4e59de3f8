"""Incremental detokenization with stop strings; never emits a broken UTF-8 sequence."""

from __future__ import annotations

from rayinfer.engine.types import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces and merges come out right


class IncrementalDetokenizer:
    """Turns a request's growing token list into text deltas.

    Decoding a window ``ids[prefix_offset:]`` and diffing it against ``ids[prefix_offset:read_offset]``
    keeps each step O(window); text that ends in U+FFFD (an incomplete UTF-8 sequence) is held back
    until the next token completes it (after vLLM's ``detokenize_incrementally``). With stop strings,
    the last ``max(len(stop)) - 1`` characters are held back until they cannot start a stop string.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        prompt_token_ids: the prompt (its tail gives context to the first output tokens).
        params: the request's sampling params (stop, include_stop_str_in_output, skip_special_tokens).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self._decode = _backend_decode(tokenizer) or tokenizer.decode  # (ids, skip_special_tokens)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self.num_emitted = 0
        self.stop_holdback = max((len(s) for s in params.stop), default=1) - 1

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the matched stop string if one now occurs (text is cut before it,
        or after it with ``include_stop_str_in_output``), else None."""
        ids, decode, skip_special = self.ids, self._decode, self.params.skip_special_tokens
        for token in token_ids:
            ids.append(token)
            prefix_text = decode(ids[self.prefix_offset : self.read_offset], skip_special)
            new_text = decode(ids[self.prefix_offset :], skip_special)
            if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
                continue
            self.prefix_offset, self.read_offset = self.read_offset, len(ids)
            start = max(len(self.output_text) - self.stop_holdback, 0)
            self.output_text += new_text[len(prefix_text) :]
            if self.params.stop:
                stop = self._find_stop(start)
                if stop is not None:
                    return stop
        return None

    def _find_stop(self, start: int) -> str | None:
        best = None
        for s in self.params.stop:
            idx = self.output_text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s) if self.params.include_stop_str_in_output else idx]
        self.num_emitted = min(self.num_emitted, len(self.output_text))
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted (all of it when ``finished``, else minus the stop-string hold-back)."""
        end = len(self.output_text) if finished else max(len(self.output_text) - self.stop_holdback, 0)
        if end <= self.num_emitted:
            return ""
        delta = self.output_text[self.num_emitted : end]
        self.num_emitted = end
        return delta


def _backend_decode(tokenizer):
    """The Rust tokenizer's ``decode`` when ``tokenizer.decode`` of a token list returns exactly its result
    (a fast tokenizer that cleans up no spaces), else None; it skips transformers' per-call overhead."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode and not tokenizer.clean_up_tokenization_spaces):
        return tokenizer.backend_tokenizer.decode
    return None
