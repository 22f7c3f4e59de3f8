"""Tokens as logprob entries show them: each token's own bytes, a string that names it uniquely, and text
offsets that count whole characters.

A byte-level BPE token (GPT-2, Llama-3, SmolLM2) may hold part of a UTF-8 character: the pizza emoji
U+1F355 is ``f0 9f 8d 95``, often split over two tokens. Decoding such a token alone gives U+FFFD, so its
text cannot stand for it; its bytes come from the vocabulary string instead (GPT-2's byte-to-unicode map
inverted), and concatenating the bytes of a response's tokens gives the UTF-8 of its text. A token whose
bytes are not UTF-8 on their own is named ``"bytes:\\xf0\\x9f"`` (vLLM's form), so two such alternatives
stay two entries.
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache

_BYTE_FALLBACK_RE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's map from the 256 printable stand-in characters of byte-level BPE back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's vocabulary strings are GPT-2 byte-level (its backend decoder is ByteLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


class TokenBytes:
    """Each token id's own bytes and display string (cached per id).

    Args:
        tokenizer: a Hugging Face tokenizer (``convert_ids_to_tokens``, ``added_tokens_decoder``).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.added = {i: t.content for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The bytes this token adds to the output text (an added/special token: its text in UTF-8).

        For byte-level vocabularies, the vocabulary string mapped back through :func:`byte_decoder`;
        for SentencePiece ones, ``<0xNN>`` byte-fallback tokens as that byte and ``▁`` as a space.
        """
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = self._compute_bytes(token_id)
        return b

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            table = byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        m = _BYTE_FALLBACK_RE.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def text_of(self, token_id: int) -> str:
        """The token's string in logprobs: its bytes as UTF-8 text, or ``"bytes:\\xf0\\x9f"`` when they
        are not UTF-8 on their own (part of a character)."""
        t = self._text.get(token_id)
        if t is None:
            b = self.bytes_of(token_id)
            try:
                t = b.decode("utf-8")
            except UnicodeDecodeError:
                t = "bytes:" + "".join(f"\\x{x:02x}" for x in b)
            self._text[token_id] = t
        return t


class TextOffsets:
    """Character offsets of consecutive tokens in the text they decode to (legacy ``text_offset``).

    A token that ends inside a character adds no character until a later token completes it.

    Args:
        start: the offset of the first token.
    """

    def __init__(self, start: int = 0):
        self.offset = start
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_bytes: bytes) -> int:
        """The offset of a token with these bytes; advances past its complete characters."""
        at = self.offset
        self.offset += len(self._decoder.decode(token_bytes))
        return at
