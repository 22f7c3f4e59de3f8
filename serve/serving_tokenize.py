"""``/tokenize`` and ``/detokenize`` (vLLM's request and response shapes), on the same rendering as the
completion endpoints: a prompt tokenizes as ``/v1/completions`` encodes it, messages as
``/v1/chat/completions`` renders them."""

from __future__ import annotations

from typing import Any

from rayinfer.serve.chat import render_messages
from rayinfer.serve.protocol import APIError, DetokenizeRequest, TokenizeRequest, parse_body
from rayinfer.serve.serving import OpenAIServing


class TokenizeServing:
    """Token ids of a prompt or chat, and text of token ids (runs on the serving's executor).

    Args:
        serving: the shared OpenAIServing (tokenizer, model name, context limit).
    """

    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    def tokenize(self, body: Any) -> dict:
        """``POST /tokenize``.

        Args:
            body: decoded JSON, a :class:`~rayinfer.serve.protocol.TokenizeRequest`.
        Returns:
            ``{"count": int, "max_model_len": int, "tokens": [int], "token_strs": [str] | None}``.
        Raises:
            APIError: 400 for a bad body, neither or both of prompt and messages, ``add_special_tokens``
                with messages, or malformed messages; 404 for another model.
        """
        s = self.serving
        req: TokenizeRequest = parse_body(TokenizeRequest, body)  # pyright: ignore[reportAssignmentType]
        s.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' or 'messages'", param="prompt")
        if req.messages is not None:
            if req.add_special_tokens:
                raise APIError("add_special_tokens applies to 'prompt' only; a chat template adds its own special "
                               "tokens", param="add_special_tokens")
            s.check_prompt_chars([body.get("messages"), body.get("tools")], "messages")
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            try:
                ids = render_messages(s.tokenizer, [m.model_dump(exclude_none=True) for m in req.messages], tools,
                                      add_generation_prompt=req.add_generation_prompt)
            except ValueError as e:
                raise APIError(str(e), param="messages") from None
        else:
            s.check_prompt_chars(req.prompt, "prompt")
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = s.tokenizer.encode(req.prompt, add_special_tokens=add) if req.prompt else []
        ids = [int(t) for t in ids]
        strs = s.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize(self, body: Any) -> dict:
        """``POST /detokenize``.

        Args:
            body: decoded JSON, a :class:`~rayinfer.serve.protocol.DetokenizeRequest`.
        Returns:
            ``{"prompt": str}``: the ids decoded, special tokens included.
        Raises:
            APIError: 400 for a bad body or an id outside the vocabulary (``param`` names it); 404 for
                another model.
        """
        s = self.serving
        req: DetokenizeRequest = parse_body(DetokenizeRequest, body)  # pyright: ignore[reportAssignmentType]
        s.check_model(req.model)
        vocab = len(s.tokenizer)
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab:
                raise APIError(f"token id {t} is outside the vocabulary [0, {vocab})", param=f"tokens.{i}")
        return {"prompt": s.tokenizer.decode(req.tokens)}
