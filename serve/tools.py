"""Tool calling, Hermes/Qwen style: tool definitions in the prompt, ``<tool_call>{json}</tool_call>`` out.

When the model's chat template renders ``tools`` itself, tools are passed through; otherwise (SmolLM2's
template ignores them) the definitions go into the system message the way Qwen2.5's template writes them,
earlier assistant tool calls become ``<tool_call>`` text and tool results become ``<tool_response>``
user turns. ``tool_choice`` required and named are enforced with an xgrammar structural tag, so every
call is well formed and its arguments validate against the tool's parameter schema.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

_SYSTEM_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a ``tools`` variable."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def tool_system_prompt(tools: list[dict]) -> str:
    """The system-message block that describes the tools (Qwen2.5 / Hermes wording)."""
    return _SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def _call_text(name: str, arguments: str | dict) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_BEGIN}\n{body}\n{TOOL_CALL_END}"


def prepare_messages(messages: list[dict], tools: list[dict] | None, template_has_tools: bool) -> list[dict]:
    """Rewrite OpenAI messages so a template without tool support still sees tools and tool turns.

    Args:
        messages: OpenAI chat messages (dicts; ``developer`` is treated as ``system``).
        tools: the request's tool definitions to show the model, or None.
        template_has_tools: the template renders ``tools``, ``tool_calls`` and ``tool`` turns itself.
    Returns:
        messages for :func:`rayinfer.serve.chat.render_chat`.
    """
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if m["role"] == "developer":
            m["role"] = "system"
        if not template_has_tools:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = "\n".join(_call_text(c["function"]["name"], c["function"]["arguments"])
                                  for c in m.pop("tool_calls"))
                text = _text_of(m.get("content"))
                m["content"] = f"{text}\n{calls}" if text else calls
            elif m["role"] == "tool":
                m = {"role": "user", "content": f"<tool_response>\n{_text_of(m.get('content'))}\n</tool_response>"}
        out.append(m)
    if tools and not template_has_tools:
        block = tool_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text_of(out[0].get('content'))}\n\n{block}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


# Whitespace the arguments' JSON may hold between two tokens of JSON. Unbounded, a greedy small model
# fills max_tokens with spaces after "{" and never closes the call (issue 23); 4 still admits
# ", " and a newline with an indent of up to 3.
MAX_ARGUMENT_WHITESPACE = 4


def _tool_tag(tool: dict) -> dict:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "tag",
        "begin": f'{TOOL_CALL_BEGIN}\n{{"name": "{fn["name"]}", "arguments": ',
        "content": {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE},
        "end": "}\n" + TOOL_CALL_END,
    }


def tool_call_format(tools: list[dict], tool_choice: str | dict, parallel_tool_calls: bool = True) -> dict | None:
    """The structural-tag response format that forces tool calls, or None when nothing is forced.

    Args:
        tools: OpenAI tool definitions.
        tool_choice: "none" / "auto" (nothing forced), "required" (one or more calls of any tool), or
            ``{"type": "function", "function": {"name": ...}}`` (exactly one call of that tool).
        parallel_tool_calls: with "required", allow several calls (at most one per tool when no tool
            takes arguments: a repeated call without arguments only repeats its answer).
    Returns:
        ``{"type": "structural_tag", "format": ...}`` for ``SamplingParams.response_format``, or None.
    Raises:
        ValueError: if the named tool is not among ``tools``.
    """
    if tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ValueError(f"tool_choice names '{name}', which is not among the tools")
        return {"type": "structural_tag", "format": _tool_tag(chosen[0])}
    tags = [_tool_tag(t) for t in tools]
    if parallel_tool_calls and all(_takes_no_arguments(t) for t in tools) and len(tools) > 1:
        # a call without arguments made twice answers the same twice: at most one call per tool, so a
        # model that would repeat its call forever must stop (issue 23)
        one = {"type": "or", "elements": tags}
        return {"type": "structural_tag", "format": {"type": "sequence", "elements": [
            one, {"type": "repeat", "min": 0, "max": len(tools) - 1,
                  "content": {"type": "sequence", "elements": [{"type": "const_string", "value": "\n"}, one]}}]}}
    return {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
        "stop_after_first": not parallel_tool_calls or all(_takes_no_arguments(t) for t in tools),
    }}


def _takes_no_arguments(tool: dict) -> bool:
    """Whether the tool's parameters admit only ``{}`` (none given, or an object without properties)."""
    params = tool["function"].get("parameters")
    return not params or (params.get("type") == "object" and not params.get("properties")
                          and params.get("additionalProperties") is not True)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, tool_names: set[str]) -> tuple[str | None, list[dict]]:
    """Split model output into content and OpenAI ``tool_calls``.

    A ``<tool_call>`` whose body is not a JSON object with a known ``name`` is left in the content, so
    nothing the model wrote is lost. An unterminated last call (output cut by max_tokens) is parsed if
    its JSON is complete, and dropped if it is not but complete calls precede it.

    Returns:
        (content before the first call, stripped, or None if empty; tool calls as
        ``[{"id", "type": "function", "function": {"name", "arguments": str}}]``).
    """
    first = text.find(TOOL_CALL_BEGIN)
    if first == -1:
        return (text or None), []
    calls = []
    for m in _CALL_RE.finditer(text, first):
        call = _parse_one(m.group(1), tool_names)
        if call is None:
            if calls and not m.group(0).endswith(TOOL_CALL_END) and m.end() == len(text):
                break  # a last call cut off by max_tokens: keep the complete ones before it
            return (text or None), []
        calls.append(call)
    content = text[:first].strip()
    return (content or None), calls


def _parse_one(body: str, tool_names: set[str]) -> dict | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolStreamParser:
    """Streams content until a ``<tool_call>`` starts, then holds the rest for :meth:`finish`.

    Text that might be the start of ``<tool_call>`` is held back, so no fragment of the tag reaches the
    client as content.

    Args:
        tool_names: names of the request's tools.
    """

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.text = ""
        self.num_emitted = 0
        self.in_calls = False

    def feed(self, delta: str) -> str:
        """Add output text; returns the content that can be sent now."""
        self.text += delta
        if self.in_calls:
            return ""
        idx = self.text.find(TOOL_CALL_BEGIN, self.num_emitted)
        if idx != -1:
            self.in_calls = True
            end = idx
        else:
            end = len(self.text) - _partial_suffix(self.text, TOOL_CALL_BEGIN)
        out = self.text[self.num_emitted : end]
        self.num_emitted = max(self.num_emitted, end)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """At the end of output: (content still to send, parsed tool calls)."""
        _, calls = parse_tool_calls(self.text, self.tool_names)
        if calls:
            return "", calls
        rest = self.text[self.num_emitted :]
        self.num_emitted = len(self.text)
        return rest, []


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
