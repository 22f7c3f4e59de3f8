"""Structured output and tool calls through the live app: outputs parse and validate."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and a favourite color."}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What's the weather like in Paris today?"}]


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_validates(client, model, seed):
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=0.7, seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_schema_streamed_output_validates(client, model):
    chunks = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=60, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)


def test_constrained_and_free_requests_share_batches(live_server, model):
    import asyncio

    async def one(client, i):
        kw = dict(model=model, messages=ASK, max_tokens=12, temperature=0.5, seed=i)
        if i % 2:
            kw.update(max_tokens=60, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": PERSON}})
        r = await client.chat.completions.create(**kw)
        return i, r.choices[0]

    async def main():
        async with openai.AsyncOpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0) as c:
            return await asyncio.gather(*[one(c, i) for i in range(8)])

    for i, choice in asyncio.run(main()):
        if i % 2:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_is_an_object(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.startswith("{")


def test_regex_ebnf_and_guided_aliases(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "A phone number?"}],
                                       max_tokens=20, temperature=0,
                                       response_format={"type": "regex", "regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", r.choices[0].message.content)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       max_tokens=5, temperature=0,
                                       response_format={"type": "ebnf", "ebnf": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=model, prompt="My favourite fruit is", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["apple", "banana"]})
    assert r.choices[0].text in ("apple", "banana")


def test_invalid_schema_is_400_and_server_keeps_serving(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ASK, max_tokens=5,
                                       response_format={"type": "regex", "regex": "(unclosed"})
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=2).choices


def test_tool_choice_named_gives_valid_arguments(client, model):
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER, ADD], max_tokens=60,
                                       temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_tool_choice_required_streamed(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=WEATHER_Q, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False,
        max_tokens=60, temperature=0, stream=True))
    calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1
    name = calls[0].function.name
    schema = {"get_weather": WEATHER, "add": ADD}[name]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert reasons == ["tool_calls"]
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()


def test_tool_choice_required_parallel_keeps_complete_calls(client, model):
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER, ADD], tool_choice="required",
                                       max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.message.tool_calls and c.finish_reason in ("tool_calls", "length")
    for call in c.message.tool_calls:
        schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_auto_and_none(client, model):
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER], max_tokens=40,
                                       temperature=0)
    c = r.choices[0]
    if c.message.tool_calls:  # the model chose a call: it must parse
        assert c.finish_reason == "tool_calls"
        json.loads(c.message.tool_calls[0].function.arguments)
    else:
        assert c.message.content and "<tool_call>" not in c.message.content[:1]
    r = client.chat.completions.create(model=model, messages=WEATHER_Q, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_results_round_trip(client, model):
    messages = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.content


GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time."}}


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_forced_call_of_a_tool_without_parameters_ends(client, model, choice):
    # issue 23: 200 tokens of whitespace after '"arguments": {', no tool_calls, finish_reason "length"
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What time is it?"}],
                                       tools=[GET_TIME], tool_choice=choice, temperature=0, max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}
    assert not c.message.content and r.usage.completion_tokens < 40
