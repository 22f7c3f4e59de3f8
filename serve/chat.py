"""Chat-template rendering that never lets user text become control tokens.

The model's Jinja chat template (from its tokenizer config) is rendered with every message's text
replaced by a sentinel; the rendered text is then split at the sentinels. Template pieces are encoded
with special tokens recognised (they carry ``<|im_start|>`` and friends); message texts are encoded with
special-token text split into ordinary tokens, so ``<|im_start|>`` typed by a user stays plain text.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from rayinfer.serve.tools import prepare_messages, template_renders_tools

_SENTINEL = "RAYINFERMSG{}X"
_IMAGE_SENTINEL = "RAYINFERIMG{}X"
_SENTINEL_RE = re.compile(r"RAYINFER(MSG|IMG)(\d+)X")

# on_image(image_url part's url, prompt position of its first placeholder, image index) -> its token ids
OnImage = Callable[[str, int, int], list[int]]


def render_chat(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, on_image: OnImage | None = None, **template_kwargs) -> list[int]:
    """Render OpenAI-style chat messages to prompt token ids with the model's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str | [{"type": "text",
            "text": str}, ...] | None, ...}]``.
        add_generation_prompt: end with the assistant turn's header.
        tools: OpenAI tool definitions passed to the template.
        on_image: for ``{"type": "image_url", "image_url": {"url": ...}}`` parts (vision-language
            models): called in prompt order with (url, position of the image's first token, image index),
            it returns the image's placeholder token ids, inserted there (never text the tokenizer could
            merge with its neighbours). None: image parts are refused.
    Returns:
        prompt token ids.
    Raises:
        ValueError: if messages are missing, malformed, have image parts without ``on_image``, or the
            tokenizer has no chat template; whatever ``on_image`` raises.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a raw prompt instead")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    texts: list[str] = []
    image_urls: list[str] = []
    templated = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            pieces, run = [], []  # consecutive text parts become one text, an image part its own sentinel
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image_url":
                    url = (p.get("image_url") or {}).get("url") if isinstance(p.get("image_url"), dict) else None
                    if on_image is None:
                        raise ValueError(f"messages[{i}].content: this model does not take images")
                    if not isinstance(url, str):
                        raise ValueError(f"messages[{i}].content: an image_url part needs image_url.url")
                    if run:
                        pieces.append(_SENTINEL.format(len(texts)))
                        texts.append("".join(run))
                        run = []
                    pieces.append(_IMAGE_SENTINEL.format(len(image_urls)))
                    image_urls.append(url)
                elif isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str):
                    run.append(p["text"])
                else:
                    raise ValueError(f"messages[{i}].content: only text and image_url parts are supported")
            if run and "".join(run):
                pieces.append(_SENTINEL.format(len(texts)))
                texts.append("".join(run))
            m = dict(m)
            m["content"] = "".join(pieces)
            templated.append(m)
            continue
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of text parts, or null")
        m = dict(m)
        if content:
            m["content"] = _SENTINEL.format(len(texts))
            texts.append(content)
        else:
            m["content"] = content or ""
        templated.append(m)
    rendered = tokenizer.apply_chat_template(templated, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    ids: list[int] = []
    pos = 0
    num_images = 0
    for match in _SENTINEL_RE.finditer(rendered):
        ids += tokenizer.encode(rendered[pos : match.start()], add_special_tokens=False)
        k = int(match.group(2))
        if match.group(1) == "MSG":
            ids += encode_plain(tokenizer, texts[k])
        else:
            assert on_image is not None
            ids += on_image(image_urls[k], len(ids), num_images)
            num_images += 1
        pos = match.end()
    ids += tokenizer.encode(rendered[pos:], add_special_tokens=False)
    return ids


def encode_plain(tokenizer, text: str) -> list[int]:
    """Encode user text with special-token strings treated as ordinary text."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def render_messages(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, on_image: OnImage | None = None) -> list[int]:
    """OpenAI chat messages to prompt token ids, the one way the service and the batch job both render.

    Maps OpenAI roles onto what the model's template knows (``developer`` is ``system``), writes tools
    and tool turns into the prompt when the template cannot (``serve.tools.prepare_messages``), then
    renders with :func:`render_chat`.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        messages: ``[{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": ..., ...}]``.
        tools: OpenAI tool definitions to show the model, or None.
        add_generation_prompt: end with the assistant turn's header.
        on_image: image parts' handler (vision-language models), see :func:`render_chat`.
    Returns:
        prompt token ids.
    Raises:
        ValueError: for malformed messages (naming the message) or a tokenizer without a template.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'")
    has_tools = template_renders_tools(tokenizer)
    try:
        prepared = prepare_messages(messages, tools, has_tools)
    except (KeyError, TypeError, AttributeError) as e:  # a tool call or tool turn of the wrong shape
        raise ValueError(f"messages: a tool call or tool message is malformed ({type(e).__name__}: {e})") from None
    return render_chat(tokenizer, prepared, add_generation_prompt=add_generation_prompt,
                       tools=tools if tools and has_tools else None, on_image=on_image)
