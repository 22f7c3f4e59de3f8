"""Incremental detokenization with stop strings; never emits a broken UTF-8 sequence."""

from __future__ import annotations

from rayinfer.engine.types import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading spaces and merges come out right


class IncrementalDetokenizer:
    """Turns a request's growing token list into text deltas and finds its stop strings.

    Decoding a window ``ids[prefix_offset:]`` and diffing it against ``ids[prefix_offset:read_offset]``
    keeps each step O(window); text that ends in U+FFFD (an incomplete UTF-8 sequence) is held back
    until a later token completes it or the request ends (after vLLM's ``detokenize_incrementally``).
    The emitted text always equals ``decode(prompt + output)`` minus what ``decode(prompt)`` already
    shows, also when the prompt ends inside a character that the output completes. With stop strings,
    the last ``max(len(stop)) - 1`` characters are held back until they cannot start a stop string.

    Stop strings are matched only on tokens after the first ``params.min_tokens`` output tokens, and a
    match must end in text such a token added (it may begin earlier); the sampler bans EOS and stop
    token ids for the same first ``min_tokens`` tokens (after vLLM v1's detokenizer).

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        prompt_token_ids: the tokens before the output this detokenizer will see (their tail gives
            context to the first output tokens).
        params: the request's sampling params (stop, include_stop_str_in_output, skip_special_tokens,
            min_tokens).
        num_output_tokens: output tokens already generated and included at the end of
            ``prompt_token_ids`` (a request resumed after a prefill elsewhere); they count towards
            ``min_tokens`` but their text is not emitted.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, num_output_tokens: int = 0):
        self.tokenizer = tokenizer
        self.params = params
        self._decode = _backend_decode(tokenizer) or tokenizer.decode  # (ids, skip_special_tokens)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""
        self.num_emitted = 0
        self.num_output_tokens = num_output_tokens
        self.stop_holdback = max((len(s) for s in params.stop), default=1) - 1
        self.stopped = False  # a stop string matched

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens; returns the matched stop string if one now occurs, else None.

        On a match the text is cut before the stop string (after it with ``include_stop_str_in_output``)
        and the tokens after the matching one are not consumed (``num_output_tokens`` tells how many were).
        """
        ids, decode, p = self.ids, self._decode, self.params
        for token in token_ids:
            ids.append(token)
            self.num_output_tokens += 1
            prefix_text = decode(ids[self.prefix_offset : self.read_offset], p.skip_special_tokens)
            new_text = decode(ids[self.prefix_offset :], p.skip_special_tokens)
            if new_text.endswith("\ufffd"):
                continue
            checked = len(self.output_text)
            self._append(prefix_text, new_text)
            if p.stop and self.num_output_tokens > p.min_tokens:
                stop = self._find_stop(checked)
                if stop is not None:
                    return stop
        return None

    def _append(self, prefix_text: str, new_text: str) -> None:
        """Add the text the unread tokens make and mark them read.

        The new text starts where ``new_text`` first differs from ``prefix_text``, not at
        ``len(prefix_text)``: when the prompt ends inside a UTF-8 character (its text ends in U+FFFD),
        the first output token that completes the character changes that U+FFFD, and the character
        belongs to the output.
        """
        n, limit = 0, min(len(prefix_text), len(new_text))
        while n < limit and prefix_text[n] == new_text[n]:
            n += 1
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.output_text += new_text[n:]

    def flush(self) -> None:
        """At the end of the request: add the text of tokens held back because they end inside a
        character (as U+FFFD, which the tokenizer's decode of the whole output shows too)."""
        if self.read_offset < len(self.ids) and not self.stopped:
            decode, skip = self._decode, self.params.skip_special_tokens
            self._append(decode(self.ids[self.prefix_offset : self.read_offset], skip),
                         decode(self.ids[self.prefix_offset :], skip))

    def _find_stop(self, checked: int) -> str | None:
        """The stop string that occurs first among those ending after ``output_text[:checked]``."""
        best = None
        for s in self.params.stop:
            idx = self.output_text.find(s, max(checked - len(s) + 1, 0))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.stopped = True
        self.output_text = self.output_text[: idx + len(s) if self.params.include_stop_str_in_output else idx]
        self.num_emitted = min(self.num_emitted, len(self.output_text))
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet emitted (all of it when ``finished``, tokens held back inside a character
        included, else minus the stop-string hold-back)."""
        if finished:
            self.flush()
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
