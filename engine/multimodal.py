"""Images in the engine: content hashes, the encoder cache, prefix-cache keys, and the step's image rows.

A request's images arrive as :class:`~rayinfer.engine.types.MultiModalInput` (content hash, the
placeholder range in the prompt, preprocessed pixels or precomputed embeddings). The engine:

1. encodes an image (``model.encode_images``) only when a step computes some of its placeholder tokens
   and its embeddings are neither given nor in the :class:`EncoderCache` (keyed by content hash; all
   of a step's missing images are encoded in one batch, across requests);
2. replaces the decoder's input embeddings at the placeholder rows of the step by the image's rows
   (:func:`gather_mm_embeds`), so a chunk boundary may fall anywhere inside an image;
3. mixes the content hashes of the images whose placeholders fall in a KV block into that block's
   hash (:func:`block_extra_key`): the same text with another image misses the prefix cache.

After vLLM v1's encoder cache and multimodal prefix-cache keys.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np
import torch

from rayinfer.engine.block_pool import NONE_HASH, hash_block, hash_block_chain
from rayinfer.engine.errors import InvalidRequestError
from rayinfer.engine.types import MultiModalInput, Request, ScheduledRequest


def hash_pixel_values(pixel_values: torch.Tensor) -> str:
    """Content hash of a preprocessed image: sha256 (hex) of its shape and float32 bytes, so the same
    picture sent as PNG or as WebP (same pixels) shares encoder-cache and prefix-cache entries."""
    t = pixel_values.detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    h.update(t.numpy().tobytes())
    return h.hexdigest()


def block_extra_key(cache_salt: int | None, mm_inputs: Sequence[MultiModalInput], start: int, end: int) -> int | None:
    """The extra key of the KV block holding positions ``[start, end)``.

    Returns:
        ``cache_salt`` when no image's placeholders overlap the block (text-only blocks hash exactly as
        before), else a signed 64-bit int of blake2b over the salt and the overlapping images' content
        hashes and offsets (the offset tells two images apart when one block holds the end of one and
        the start of the next).
    """
    hit = [m for m in mm_inputs if m.offset < end and start < m.offset + m.length]
    if not hit:
        return cache_salt
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if cache_salt is None else cache_salt))
    for m in hit:
        h.update(struct.pack("<q", m.offset))
        h.update(m.content_hash.encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def mm_hash_block_chain(token_ids: Sequence[int], block_size: int, cache_salt: int | None = None,
                        mm_inputs: Sequence[MultiModalInput] = ()) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` as the engine's prefix cache keys them: each
    block's extra key is :func:`block_extra_key` (the salt, mixed with the content hashes of the images
    whose placeholders it holds). Without images, ``block_pool.hash_block_chain`` exactly.

    The PD handoff (a KVHandle's hashes, checked by the importing replica) and KV-store lookups use it, so
    the same text with another image never matches another image's KV.

    Returns:
        ``len(token_ids) // block_size`` non-zero 64-bit ints (a partial tail block is not hashed).
    """
    if not mm_inputs:
        return hash_block_chain(token_ids, block_size, cache_salt)
    out, parent = [], NONE_HASH
    for b in range(len(token_ids) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        parent = hash_block(parent, token_ids[lo:hi], block_extra_key(cache_salt, mm_inputs, lo, hi))
        out.append(parent)
    return out


def placeholder_ranges(token_ids: Sequence[int], image_token_id: int, lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Where each image's placeholder tokens are: ``(offset, length)`` per image, in prompt order.

    Runs of ``image_token_id`` are split in order by ``lengths`` (two adjacent images make one run).

    Raises:
        InvalidRequestError ("prompt"): if the prompt's image tokens do not add up to ``lengths``.
    """
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.flatnonzero(ids == image_token_id).tolist()
    if len(positions) != sum(lengths):
        raise InvalidRequestError(f"the prompt has {len(positions)} image placeholder tokens, the images need "
                                  f"{sum(lengths)} ({len(lengths)} image(s))", "prompt")
    out, i = [], 0
    for n in lengths:
        run = positions[i : i + n]
        if run[-1] - run[0] != n - 1:
            raise InvalidRequestError("an image's placeholder tokens are not contiguous in the prompt", "prompt")
        out.append((run[0], n))
        i += n
    return out


class EncoderCache:
    """Image embeddings by content hash, least recently used evicted first, bounded in tokens.

    Args:
        max_tokens: embedding rows kept at most (an image bigger than that is still returned, not kept).
    Attributes:
        num_encoder_runs: images encoded; hits: images served without running the encoder, from the
            cache or as a repeat of an image earlier in the same encoder batch (so runs + hits count every
            image asked for by pixels).
    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"encoder cache size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self.num_encoder_runs = 0
        self.hits = 0

    def get(self, content_hash: str) -> torch.Tensor | None:
        """The cached embeddings ``[num_tokens, hidden]`` (counted as a hit), or None."""
        emb = self.entries.get(content_hash)
        if emb is not None:
            self.entries.move_to_end(content_hash)
            self.hits += 1
        return emb

    def put(self, content_hash: str, embeds: torch.Tensor) -> None:
        """Keep ``embeds`` (evicting the least recently used entries to make room)."""
        if content_hash in self.entries or embeds.shape[0] > self.max_tokens:
            return
        while self.num_tokens + embeds.shape[0] > self.max_tokens:
            _, old = self.entries.popitem(last=False)
            self.num_tokens -= old.shape[0]
        self.entries[content_hash] = embeds
        self.num_tokens += embeds.shape[0]

    def stats(self) -> dict:
        return {"num_encoder_runs": self.num_encoder_runs, "encoder_cache_hits": self.hits,
                "encoder_cache_tokens": self.num_tokens}


def encode_missing(model: Any, cache: EncoderCache, inputs: Sequence[MultiModalInput],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """Embeddings of ``inputs`` by content hash: given ones, cached ones, and the rest encoded in one
    ``model.encode_images`` batch (duplicates encoded once) and put in the cache.

    Returns:
        content hash -> [length, hidden] in the model dtype on ``device``.
    Raises:
        ValueError: an input with neither pixels nor embeddings, or embeddings of the wrong row count;
            whatever the encoder raises for bad pixels.
    """
    out: dict[str, torch.Tensor] = {}
    todo: dict[str, MultiModalInput] = {}
    for m in inputs:
        if m.content_hash in out or m.content_hash in todo:
            if m.embeds is None:
                cache.hits += 1  # a repeat within this batch: encoded (or looked up) once
            continue
        if m.embeds is not None:
            out[m.content_hash] = m.embeds.to(device)
            continue
        emb = cache.get(m.content_hash)
        if emb is not None:
            out[m.content_hash] = emb
        elif m.pixel_values is None:
            raise ValueError(f"image {m.content_hash[:12]} has neither pixel_values nor embeddings")
        else:
            todo[m.content_hash] = m
    if todo:
        pixels = torch.stack([torch.as_tensor(m.pixel_values) for m in todo.values()]).to(device)
        embeds = model.encode_images(pixels)
        cache.num_encoder_runs += len(todo)
        for (h, m), e in zip(todo.items(), embeds):
            if e.shape[0] != m.length:
                raise ValueError(f"image encodes to {e.shape[0]} tokens but has {m.length} placeholders")
            cache.put(h, e)
            out[h] = e
    return out


def gather_mm_embeds(model: Any, cache: EncoderCache, scheduled: Sequence[ScheduledRequest],
                     requests: dict[str, Request], starts: np.ndarray,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's image rows: ``(rows [M] int64 on device, embeds [M, hidden])``, or None if the step
    computes no image placeholder.

    Args:
        scheduled: the step's requests, in row order; ``starts[i]`` is the first row of ``scheduled[i]``.
        requests: the live requests by id (their ``mm_inputs``).
    Side effects:
        encodes the images the step needs that are not cached (see :func:`encode_missing`).
    """
    pieces: list[tuple[int, MultiModalInput, int, int]] = []  # (first row, image, first index, end index)
    for i, s in enumerate(scheduled):
        req = requests[s.request_id]
        lo, hi = s.start_pos, s.start_pos + s.num_new_tokens
        for m in req.mm_inputs:
            a, b = max(lo, m.offset), min(hi, m.offset + m.length)
            if a < b:
                pieces.append((int(starts[i]) + a - lo, m, a - m.offset, b - m.offset))
    if not pieces:
        return None
    embeds = encode_missing(model, cache, [p[1] for p in pieces], device)
    rows = torch.cat([torch.arange(r, r + e - a) for r, _, a, e in pieces]).to(device)
    return rows, torch.cat([embeds[m.content_hash][a:e] for _, m, a, e in pieces])
