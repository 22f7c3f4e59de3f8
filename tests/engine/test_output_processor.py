"""OutputProcessor on hand-made core deltas (SmolLM2 tokenizer, no model): text equals the tokenizer's
decode, never a broken character; stop strings spanning tokens, include_stop_str_in_output,
skip_special_tokens; a stop string on the max_tokens token wins over "length"; no stop string before
min_tokens; late deltas dropped and the core abort asked for."""

import pytest

from rayinfer.engine.output_processor import OutputProcessor, RequestOutputProcessor
from rayinfer.engine.types import KVHandle, RequestOutput, SampledToken, SamplingParams

PROMPT_TEXT = "Write something."


def deltas(ids, finish_reason="length", stop_reason=None, request_id="r"):
    """One core delta per token (as LLMEngine.step makes them); the last one finished."""
    n = len(ids)
    return [RequestOutput(request_id, [t], new_logprobs=[SampledToken(t, -0.5)], finished=i == n - 1,
                          finish_reason=finish_reason if i == n - 1 else None,
                          stop_reason=stop_reason if i == n - 1 else None, num_prompt_tokens=3,
                          num_output_tokens=i + 1)
            for i, t in enumerate(ids)]


def run(tokenizer, ids, finish_reason="length", stop_reason=None, **params):
    """Feed the deltas of ``ids``; returns (outputs, processor); outputs None for dropped deltas."""
    proc = RequestOutputProcessor(tokenizer, "r", tokenizer.encode(PROMPT_TEXT), SamplingParams(**params))
    return [proc.process(d) for d in deltas(ids, finish_reason, stop_reason)], proc


def text_of(outs):
    return "".join(o.new_text for o in outs if o is not None)


@pytest.mark.parametrize("text", [
    "Hello world, plain ASCII.",
    "Les élèves ont été très contents, ça va?",
    "日本語の文章と中文句子。",
    "Emoji 🌊🌪️👩‍👩‍👧 and more",
    "  leading spaces\n\nand newlines\ttabs",
])
def test_text_equals_decode_and_never_has_a_broken_character(tokenizer, text):
    ids = tokenizer.encode(text)
    outs, proc = run(tokenizer, ids)
    assert text_of(outs) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in o.new_text for o in outs)
    assert outs[-1].finished and outs[-1].finish_reason == "length" and not proc.needs_core_abort
    assert [t for o in outs for t in o.new_token_ids] == ids
    assert [o.num_output_tokens for o in outs] == list(range(1, len(ids) + 1))


def test_multibyte_character_split_over_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🌊")
    assert len(ids) > 1  # byte-level BPE splits the emoji
    outs, _ = run(tokenizer, ids + tokenizer.encode(" x"))
    assert [o.new_text for o in outs[: len(ids) - 1]] == [""] * (len(ids) - 1)
    assert outs[len(ids) - 1].new_text == "🌊"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id] + tokenizer.encode(" after")
    outs, _ = run(tokenizer, ids, skip_special_tokens=skip)
    assert text_of(outs) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert (tokenizer.eos_token in text_of(outs)) is not skip


def test_stop_string_spanning_tokens_ends_the_request(tokenizer):
    ids = tokenizer.encode("The answer is forty-two, and that is final.")
    outs, proc = run(tokenizer, ids, stop=["y-tw"])
    end = next(i for i, o in enumerate(outs) if o.finished)
    assert tokenizer.decode(ids[: end + 1]).find("y-tw") >= 0 > tokenizer.decode(ids[:end]).find("y-tw")
    assert end < len(ids) - 1 and all(o is None for o in outs[end + 1 :])  # later deltas dropped
    last = outs[end]
    assert (last.finish_reason, last.stop_reason) == ("stop", "y-tw") and proc.needs_core_abort
    assert text_of(outs) == "The answer is fort"
    assert [t for o in outs if o for t in o.new_token_ids] == ids[: end + 1]
    # streamed deltas never showed a prefix of the stop string that was then cut
    streamed = ""
    for o in outs[: end + 1]:
        streamed += o.new_text
        assert "The answer is fort".startswith(streamed)


def test_include_stop_str_in_output_and_first_of_several(tokenizer):
    ids = tokenizer.encode("one two three four five six")
    outs, _ = run(tokenizer, ids, stop=["five", "hree f"], include_stop_str_in_output=True)
    assert text_of(outs) == "one two three f"
    assert next(o for o in outs if o.finished).stop_reason == "hree f"


def test_stop_string_at_the_very_start_leaves_no_text(tokenizer):
    ids = tokenizer.encode("Stop right here.")
    outs, _ = run(tokenizer, ids, stop=["Stop"])
    assert text_of(outs) == "" and outs[0].finished and outs[0].finish_reason == "stop"


def test_stop_string_on_the_max_tokens_token_finishes_with_stop(tokenizer):
    ids = tokenizer.encode("count: one, two, three")
    outs, proc = run(tokenizer, ids, finish_reason="length", stop=["three"], max_tokens=len(ids))
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", "three")
    assert text_of(outs) == "count: one, two, "
    assert not proc.needs_core_abort  # the core has finished it already


def test_stop_string_with_eos_keeps_the_cores_stop_reason(tokenizer):
    ids = tokenizer.encode("red green blue")
    outs, proc = run(tokenizer, ids, finish_reason="stop", stop_reason=None, stop=[" blue"])
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", None)
    assert text_of(outs) == "red green" and not proc.needs_core_abort


def test_no_stop_string_before_min_tokens(tokenizer):
    ids = tokenizer.encode(" a b a b a b a b")  # " a" / " b" one token each
    assert len(ids) == 8
    # " a" completes at tokens 1, 3, 5, 7: with min_tokens=4 the first that can stop is token 5
    outs, _ = run(tokenizer, ids, stop=[" a"], min_tokens=4, max_tokens=8)
    end = next(i for i, o in enumerate(outs) if o.finished)
    assert end == 4 and text_of(outs) == " a b a b"
    # min_tokens=3: token 4 (" b") may not complete " a", token 5 does
    outs, _ = run(tokenizer, ids, stop=[" a"], min_tokens=3, max_tokens=8)
    assert next(i for i, o in enumerate(outs) if o.finished) == 4
    # " b a" ends at tokens 3, 5, 7: completed by token min_tokens + 1 it counts, by token min_tokens not
    outs, _ = run(tokenizer, ids, stop=[" b a"], min_tokens=2, max_tokens=8)
    assert next(i for i, o in enumerate(outs) if o.finished) == 2
    outs, _ = run(tokenizer, ids, stop=[" b a"], min_tokens=3, max_tokens=8)
    assert next(i for i, o in enumerate(outs) if o.finished) == 4
    # a match may begin in text from before min_tokens if it ends after it
    outs, _ = run(tokenizer, ids, stop=[" a b a"], min_tokens=4, max_tokens=8)
    assert next(i for i, o in enumerate(outs) if o.finished) == 4 and text_of(outs) == " a b"


def test_resumed_request_counts_earlier_tokens_towards_min_tokens(tokenizer):
    ids = tokenizer.encode(" a b a b a b")
    params = SamplingParams(stop=[" a"], min_tokens=4)
    proc = RequestOutputProcessor(tokenizer, "r", tokenizer.encode(PROMPT_TEXT), params, output_token_ids=ids[:2])
    outs = [proc.process(d) for d in deltas(ids[2:])]
    # tokens 3 and 4 are within min_tokens; token 5 (" a") stops; earlier tokens' text is not repeated
    assert [o.finished for o in outs[:3]] == [False, False, True] and text_of(outs) == " a b"


@pytest.mark.parametrize("text, stop, holds_back", [
    ("The answer is forty-two, and that is final.", ["y-tw"], True),  # a stop string across the cut
    ("Emoji 🌊🌪️ and 日本語 then more text", ["日本"], True),  # characters split over tokens
    ("no stop string here at all, just text", [], False),
])
def test_a_stream_resumed_after_any_token_reads_as_one_stream(tokenizer, text, stop, holds_back):
    """A replica dies after token k; another resumes the request from the tokens and the text length the
    caller has (``num_emitted_chars``): the caller's text, tokens and finish equal one uninterrupted
    stream's, whatever the first replica held back for stop strings or inside a character."""
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode(PROMPT_TEXT)
    params = SamplingParams(stop=stop, max_tokens=len(ids))
    whole, _ = run(tokenizer, ids, stop=stop, max_tokens=len(ids))
    want_text, want_ids = text_of(whole), [t for o in whole if o for t in o.new_token_ids]
    end = next(i for i, o in enumerate(whole) if o is not None and o.finished)
    assert end < len(ids) - 1 if stop else end == len(ids) - 1
    held_back = 0
    for k in range(1, end + 1):
        first = RequestOutputProcessor(tokenizer, "r", prompt, params)
        before = [first.process(d) for d in deltas(ids)[:k]]
        sent = text_of(before)
        held_back += len(sent) < len(tokenizer.decode(ids[:k]))
        second = RequestOutputProcessor(tokenizer, "r", prompt, params, output_token_ids=ids[:k],
                                        num_emitted_chars=len(sent))
        after = [second.process(d) for d in deltas(ids)[k:]]
        outs = [o for o in before + after if o is not None]
        assert sent + text_of(after) == want_text, k
        assert [t for o in outs for t in o.new_token_ids] == want_ids, k
        assert outs[-1].finish_reason == whole[end].finish_reason and outs[-1].stop_reason == whole[end].stop_reason
        assert sum(o.finished for o in outs) == 1
    assert bool(held_back) == holds_back  # cuts where the first replica had not sent all its tokens' text


def test_prefilled_and_preempted_pass_through(tokenizer):
    proc = RequestOutputProcessor(tokenizer, "r", [1, 2, 3], SamplingParams(stop=["x"]))
    handle = KVHandle("r", [], 3, "v1")
    out = proc.process(RequestOutput("r", tokenizer.encode("x"), finished=True, finish_reason="prefilled",
                                     num_output_tokens=1, kv_handle=handle))
    assert out.finish_reason == "prefilled" and out.kv_handle is handle and not proc.needs_core_abort
    proc = RequestOutputProcessor(tokenizer, "r", [1, 2, 3], SamplingParams())
    out = proc.process(RequestOutput("r", [], finished=True, finish_reason="preempted"))
    assert out.finished and out.finish_reason == "preempted" and out.new_text == ""


def test_multi_token_delta_is_cut_after_the_stop_string(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    proc = RequestOutputProcessor(tokenizer, "r", [1], SamplingParams(stop=[" gamma"], logprobs=0))
    out = proc.process(RequestOutput("r", ids, new_logprobs=[SampledToken(t) for t in ids],
                                     num_output_tokens=len(ids)))
    k = len(tokenizer.encode("alpha beta gamma"))
    assert out.new_token_ids == ids[:k] and len(out.new_logprobs) == k and out.num_output_tokens == k
    assert (out.new_text, out.finish_reason, proc.needs_core_abort) == ("alpha beta", "stop", True)


def test_output_processor_batches_and_lists_requests_to_abort(tokenizer):
    proc = OutputProcessor(tokenizer)
    a, b = tokenizer.encode("stop here now"), tokenizer.encode("keep going on")
    assert len(a) == len(b)
    proc.add_request("a", [1], SamplingParams(stop=[" here"]))
    proc.add_request("b", [1], SamplingParams())
    seen, aborts = {"a": "", "b": ""}, []
    for da, db in zip(deltas(a, request_id="a"), deltas(b, request_id="b")):
        res = proc.process_outputs([da, db, RequestOutput("unknown", [5])])
        aborts += res.reqs_to_abort
        for o in res.request_outputs:
            seen[o.request_id] += o.new_text
    assert seen == {"a": "stop", "b": "keep going on"} and aborts == ["a"]
    assert not proc.has_unfinished_requests()


def _random_ids(rng, tokenizer, n, partial, emoji):
    """Token ids biased towards pieces of UTF-8 characters (the hard cases), else any id."""
    out = []
    for _ in range(n):
        r = rng.random()
        out.append(rng.choice(partial) if r < 0.4 else rng.choice(emoji) if r < 0.6 else rng.randrange(len(tokenizer)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_is_decode_of_all_minus_decode_of_the_prompt(tokenizer, seed):
    """Random token-id prompts and outputs against the tokenizer's own decode: the streamed text is
    ``decode(prompt + output)`` after its common prefix with ``decode(prompt)``, also when the prompt ends
    inside a character the output completes and when the output ends inside one."""
    import random

    rng = random.Random(seed)
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    emoji = tokenizer.encode("🍕🧀🍅 naïve 東京 👩‍👩‍👧", add_special_tokens=False)
    num_split_prompts = num_split_ends = 0
    for _ in range(150):
        prompt = _random_ids(rng, tokenizer, rng.randint(1, 8), partial, emoji)
        output = _random_ids(rng, tokenizer, rng.randint(1, 12), partial, emoji)
        p = tokenizer.decode(prompt, skip_special_tokens=True)
        full = tokenizer.decode(prompt + output, skip_special_tokens=True)
        n = 0
        while n < min(len(p), len(full)) and p[n] == full[n]:
            n += 1
        num_split_prompts += n < len(p)
        num_split_ends += full.endswith("\ufffd")
        chunk = rng.choice([1, 1, 2, 3])  # one token per delta, or several (async scheduling, PD)
        pieces = [output[k : k + chunk] for k in range(0, len(output), chunk)]
        proc = RequestOutputProcessor(tokenizer, "r", prompt, SamplingParams(max_tokens=100))
        text = ""
        for k, ids in enumerate(pieces):
            last = k == len(pieces) - 1
            out = proc.process(RequestOutput("r", ids, finished=last, finish_reason="length" if last else None))
            assert out is not None
            text += out.new_text
        assert text == full[n:], (prompt, output)
    assert num_split_prompts > 2 and num_split_ends > 2  # the hard cases did come up
