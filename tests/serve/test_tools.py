"""serve/tools.py: prompt rewriting, forced-call formats and output parsing (no model, no Ray)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from rayinfer.engine.structured_output import check_response_format
from rayinfer.serve.tools import (
    ToolStreamParser,
    parse_tool_calls,
    prepare_messages,
    tool_call_format,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}


def test_parse_content_and_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("text", [
    "just text",
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
    "<tool_call>{not json}</tool_call>",
])
def test_unparseable_calls_stay_content(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert calls == [] and content == text


def test_unterminated_call_with_complete_json_is_parsed():
    _, calls = parse_tool_calls('<tool_call>\n{"name": "get_time", "arguments": {}}', NAMES)
    assert len(calls) == 1
    cut = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_ti'
    content, calls = parse_tool_calls(cut, NAMES)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    only_cut = '<tool_call>\n{"name": "get_ti'
    assert parse_tool_calls(only_cut, NAMES) == (only_cut, [])


def test_stream_parser_never_leaks_the_tag():
    text = 'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    p = ToolStreamParser(NAMES)
    sent = "".join(p.feed(ch) for ch in text)
    assert sent == "Sure. "
    rest, calls = p.finish()
    assert rest == "" and len(calls) == 1
    p = ToolStreamParser(NAMES)
    sent = "".join(p.feed(ch) for ch in "a < b <tool")
    rest, calls = p.finish()
    assert sent + rest == "a < b <tool" and calls == []


def test_prepare_messages_without_template_support():
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = prepare_messages(msgs, [WEATHER], template_has_tools=False)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content":
                      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert prepare_messages(msgs[1:2], [WEATHER], False)[0]["role"] == "system"  # system message added
    assert prepare_messages(msgs[1:2], None, False) == [{"role": "user", "content": "Weather in Paris?"}]


def _matches(rf: dict, text: str) -> bool:
    vocab = sorted({*text, "<eos>"})
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[vocab.index("<eos>")])
    m = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(json.dumps(rf)))
    return all(m.accept_token(vocab.index(c)) for c in text) and m.accept_token(vocab.index("<eos>"))


def test_forced_formats_compile_and_match_the_parser():
    assert tool_call_format([WEATHER], "auto") is None and tool_call_format([WEATHER], "none") is None
    named = tool_call_format([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    required = tool_call_format([WEATHER, TIME], "required", parallel_tool_calls=True)
    check_response_format(named)
    check_response_format(required)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _matches(named, call)
    assert not _matches(named, call.replace("get_weather", "get_time"))
    two = call + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _matches(required, two)
    assert len(parse_tool_calls(two, NAMES)[1]) == 2
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_format([WEATHER], {"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_forced_arguments_cannot_run_on_in_whitespace(choice):
    from rayinfer.serve.tools import MAX_ARGUMENT_WHITESPACE

    rf = tool_call_format([{"type": "function", "function": {"name": "get_time"}}], choice, False)  # no parameters
    call = '<tool_call>\n{{"name": "get_time", "arguments": {args}}}\n</tool_call>'
    assert _matches(rf, call.format(args="{}"))
    assert _matches(rf, call.format(args="{" + " " * MAX_ARGUMENT_WHITESPACE + "}"))
    assert not _matches(rf, call.format(args="{" + " " * (MAX_ARGUMENT_WHITESPACE + 1) + "}"))
    assert not _matches(rf, call.format(args="{" + "\n" * 200 + "}"))
    assert not _matches(rf, call.format(args='{"x": 1}'))  # a tool without parameters takes {}
    rf = tool_call_format([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    assert _matches(rf, call.replace("get_time", "get_weather").format(args='{\n  "city": "Oslo"\n}'))


def test_required_calls_of_tools_without_arguments_are_bounded():
    a, b = ({"type": "function", "function": {"name": n}} for n in ("a", "b"))
    call = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'.format
    one = tool_call_format([a], "required", parallel_tool_calls=True)
    check_response_format(one)
    assert _matches(one, call("a")) and not _matches(one, call("a") + "\n" + call("a"))
    two = tool_call_format([a, b], "required", parallel_tool_calls=True)
    check_response_format(two)
    assert _matches(two, call("b")) and _matches(two, call("a") + "\n" + call("b"))
    assert not _matches(two, call("a") + "\n" + call("b") + "\n" + call("a")) and not _matches(two, "")
    # a tool that takes arguments may be called any number of times
    many = tool_call_format([WEATHER, a], "required", parallel_tool_calls=True)
    w = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _matches(many, "\n".join([w, w, w, call("a"), call("a")]))
