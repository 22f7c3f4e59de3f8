"""EncoderActor (role ENCODE): images in, embeddings out, batched across requests, with the content-hash
encoder cache; and the client side that routes each image to the replica with the fewest patches in
flight (:class:`~rayinfer.policy.encoder_balance.PatchBalancer`).

The logic is in plain classes (:class:`BatchingEncoder`, :class:`EncoderPool`) that tests drive without
Ray; the actor only wires a model to a BatchingEncoder. An engine given an image's ``embeds`` (a
``MultiModalInput`` with ``embeds`` set) never runs its own encoder for it (``engine.multimodal``).

Not built yet: an ``parallel=epd`` topology (E + 1P1D) that starts encoder replicas and has the
router fetch embeddings before the prefill; today the colocated engine runs its encoder itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

import ray
import torch

from rayinfer.engine.multimodal import EncoderCache, encode_missing
from rayinfer.engine.types import MultiModalInput
from rayinfer.policy.encoder_balance import PatchBalancer


class BatchingEncoder:
    """Encodes the images of concurrent callers in one batch per wake-up, through an :class:`EncoderCache`.

    Args:
        model: has ``encode_images(pixel_values [N, 3, H, W]) -> [N, tokens, hidden]`` (LLaVA).
        cache_tokens: embedding rows the cache keeps.
        device: where pixels go for the encoder.
    """

    def __init__(self, model: Any, cache_tokens: int = 16384, device: torch.device | str = "cpu"):
        self.model = model
        self.cache = EncoderCache(cache_tokens)
        self.device = torch.device(device)
        self._pending: list[tuple[list[MultiModalInput], asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.num_batches = 0

    async def encode(self, images: Sequence[MultiModalInput]) -> list[torch.Tensor]:
        """Embeddings ``[length, hidden]`` (on the CPU) of ``images``, in order.

        Raises:
            ValueError: from the encoder (bad pixels) for every caller of the failed batch.
        """
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        assert self._wake is not None
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(images), future))
        self._wake.set()
        return await future

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # let the callers of this wake-up queue up: one batch for all of them
            batch, self._pending = self._pending, []
            if not batch:
                continue
            try:
                with torch.inference_mode():
                    by_hash = encode_missing(self.model, self.cache, [m for images, _ in batch for m in images],
                                             self.device)
                self.num_batches += 1
            except Exception as e:  # noqa: BLE001 - the batch's callers get the error, the actor goes on
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            for images, future in batch:
                if not future.done():
                    future.set_result([by_hash[m.content_hash].cpu() for m in images])

    def stats(self) -> dict:
        return {**self.cache.stats(), "num_batches": self.num_batches}


@ray.remote
class EncoderActor:
    """A vision encoder replica (role ENCODE): the model's ``encode_images`` behind a
    :class:`BatchingEncoder`.

    Args:
        model: a model name or directory (a vision-language model), loaded with ``dtype`` on ``device``.
        cache_tokens: the encoder cache's size in embedding rows.
    """

    def __init__(self, model: str, dtype: str = "auto", device: str = "cpu", cache_tokens: int = 16384):
        from rayinfer.model.loader import load_model

        net = load_model(model, dtype, device)
        if not getattr(net, "is_multimodal", False):
            raise ValueError(f"model {model!r} has no vision encoder")
        self.encoder = BatchingEncoder(net, cache_tokens, device)

    async def encode(self, images: list[MultiModalInput]) -> list[torch.Tensor]:
        return await self.encoder.encode(images)

    def stats(self) -> dict:
        return self.encoder.stats()


class EncoderPool:
    """The caller's side of several encoder replicas: each image goes to the replica with the fewest
    patches in flight; images come back as inputs with ``embeds`` set (pixels dropped).

    Args:
        replicas: objects whose ``encode(images)`` returns an awaitable of embeddings (EncoderActor
            handles' ``encode.remote``, wrapped by :func:`actor_encode`, or BatchingEncoders in tests).
    """

    def __init__(self, replicas: Sequence[Any]):
        self.replicas = list(replicas)
        self.balancer = PatchBalancer(len(self.replicas))

    async def encode(self, images: Sequence[MultiModalInput]) -> list[MultiModalInput]:
        """Encode a request's images (spread over the replicas); returns them with ``embeds``."""
        picks = [self.balancer.pick(m.num_patches) for m in images]
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(picks):
            groups.setdefault(r, []).append(i)
        try:
            results = await asyncio.gather(*(self.replicas[r].encode([images[i] for i in idx])
                                             for r, idx in groups.items()))
        finally:
            for m, r in zip(images, picks):
                self.balancer.release(r, m.num_patches)
        out = list(images)
        for (r, idx), embeds in zip(groups.items(), results):
            for i, e in zip(idx, embeds):
                out[i] = dataclasses.replace(images[i], embeds=e, pixel_values=None)
        return out


class actor_encode:
    """Adapts an EncoderActor handle to :class:`EncoderPool`'s ``encode(images) -> awaitable``."""

    def __init__(self, handle):
        self.handle = handle

    def encode(self, images):
        return self.handle.encode.remote(list(images))
