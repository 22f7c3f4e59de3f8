"""EncoderActor (role ENCODE): images in, embeddings out, batched across requests, with the content-hash
encoder cache; and the client side that routes each image to the replica with the fewest patches in
flight (:class:`~rayinfer.policy.encoder_balance.PatchBalancer`).

The logic is in plain classes (:class:`BatchingEncoder`, :class:`EncoderPool`) that tests drive without
Ray; the actor only wires a model to a BatchingEncoder. An engine given an image's ``embeds`` (a
``MultiModalInput`` with ``embeds`` set) never runs its own encoder for it (``engine.multimodal``).

Encode / prefill / decode disaggregation (``parallel.encoder.num_encoders`` > 0, ``conf/parallel/epd.yaml``),
per request with images:

1. the client (``rayinfer.actors.client`` / ``rayinfer.actors.pd``) sends the request's images to an
   :class:`EncoderPool` over the fleet's EncoderActors (:class:`actor_encode`): each image goes to the
   replica with the fewest patches in flight, and each replica batches the images of concurrent
   requests into one ``encode_images`` call;
2. the embeddings stay in the Ray object store: the client gets :class:`EmbedsRef` (an ObjectRef and an
   index), never the tensors, and hands them to the prefill (or NORMAL) replica with the request;
3. that replica's actor resolves them (:func:`resolve_embeds`: one object-store read, zero-copy on CPU)
   before its engine sees the request, so the engine's encoder never runs (``num_encoder_runs`` stays 0);
4. the decode replica gets the images without pixels or embeddings: it only needs their content hashes,
   which key the KV blocks' hashes (so the PD handle's hashes check out and its prefix cache stays per
   image).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import ray
import ray.exceptions
import torch

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.engine.errors import InvalidRequestError, RayInferError
from rayinfer.engine.multimodal import EncoderCache, encode_missing
from rayinfer.engine.types import MultiModalInput
from rayinfer.placement.parallel_config import ParallelConfig
from rayinfer.policy.encoder_balance import PatchBalancer


def check_encoder_model(parallel: ParallelConfig, model: str) -> None:
    """Refuse encoder replicas for a model without a vision encoder (before anything starts).

    Raises:
        ValueError: naming ``encoder.num_encoders`` and the model.
    """
    if not parallel.num_encoders:
        return
    from rayinfer.model.loader import load_config

    if getattr(load_config(model), "vision_config", None) is None:
        raise ValueError(f"parallel.encoder.num_encoders={parallel.num_encoders} needs a vision-language model "
                         f"(LLaVA); model {model!r} has no vision encoder (set encoder.num_encoders=0)")


class BatchingEncoder:
    """Encodes the images of concurrent callers in one batch per wake-up, through an :class:`EncoderCache`.

    Args:
        model: has ``encode_images(pixel_values [N, 3, H, W]) -> [N, tokens, hidden]`` (LLaVA), and
            optionally ``image_size`` / ``num_image_tokens`` (each image is checked against them first).
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
        self.num_images = 0  # images asked for (encoded, cached or given)

    async def encode(self, images: Sequence[MultiModalInput], on_device: bool = False) -> list[torch.Tensor]:
        """Embeddings ``[length, hidden]`` (model dtype; on the CPU, or on the encoder's device with
        ``on_device``) of ``images``, in order.

        Raises:
            InvalidRequestError ("image"): an image whose pixels or placeholder count do not fit the model
                (checked before batching: only this caller fails).
            ValueError: from the encoder for this caller's images (a batch that fails is encoded again
                caller by caller, so other callers' requests do not fail with it).
        """
        self._check(images)
        self.num_images += len(images)
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())
        assert self._wake is not None
        future = asyncio.get_running_loop().create_future()
        self._pending.append((list(images), future))
        self._wake.set()
        embeds = await future
        return embeds if on_device else [e.cpu() for e in embeds]

    def _check(self, images: Sequence[MultiModalInput]) -> None:
        size = getattr(self.model, "image_size", None)
        num_tokens = getattr(self.model, "num_image_tokens", None)
        for i, m in enumerate(images):
            if m.embeds is not None:
                continue
            if m.pixel_values is None:
                raise InvalidRequestError(f"image {i} has neither pixel_values nor embeddings", "image")
            if size is not None and tuple(m.pixel_values.shape) != (3, size, size):
                raise InvalidRequestError(f"image {i}: pixel_values have shape {tuple(m.pixel_values.shape)}, "
                                          f"expected {(3, size, size)} (use the model's image processor)", "image")
            if num_tokens is not None and m.length != num_tokens:
                raise InvalidRequestError(f"image {i} has {m.length} placeholder tokens; this model gives an "
                                          f"image {num_tokens}", "image")

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(0)  # let the callers of this wake-up queue up: one batch for all of them
            batch, self._pending = self._pending, []
            if batch:
                self._run(batch)

    def _run(self, batch: list[tuple[list[MultiModalInput], asyncio.Future]]) -> None:
        """Encode a batch and answer its callers; if it fails, each caller is encoded on its own (so the
        error reaches the callers whose images cause it, and only them)."""
        try:
            with torch.inference_mode():
                by_hash = encode_missing(self.model, self.cache, [m for images, _ in batch for m in images],
                                         self.device)
            self.num_batches += 1
        except Exception as e:  # noqa: BLE001 - the callers get the error, the actor goes on
            if len(batch) > 1:
                for one in batch:
                    self._run([one])
                return
            if not batch[0][1].done():
                batch[0][1].set_exception(e)
            return
        for images, future in batch:
            if not future.done():
                future.set_result([by_hash[m.content_hash] for m in images])

    def stats(self) -> dict:
        return {**self.cache.stats(), "num_batches": self.num_batches, "num_images": self.num_images}


@dataclass(frozen=True)
class DeviceEmbeds:
    """Embeddings an EncoderActor holds on its GPU (:meth:`EncoderActorImpl.encode_for_transfer`): its
    handle, the hold id that the engine replica passes to ``take``, and the Ray Direct Transport
    ``take`` runs with ("cuda_ipc")."""

    handle: Any
    hold_id: int
    transport: str


@dataclass(frozen=True)
class EmbedsRef:
    """One image's embeddings in the Ray object store, as a ``MultiModalInput.embeds`` in transit:
    item ``index`` of the list ``ref`` resolves to, a ``[rows, hidden]`` array in wire form
    (``kv_transport.to_wire``: an integer view of ``dtype``). Resolved by :func:`resolve_embeds`.

    Attributes:
        ref: ObjectRef of ``list[np.ndarray]`` (one EncoderActor call's images), or a
            :class:`DeviceEmbeds` (``list[torch.Tensor]`` on the encoder's GPU, taken by Ray Direct
            Transport).
        index: this image's item.
        dtype: the embeddings' torch dtype name ("float32", "bfloat16", ...).
    """

    ref: Any
    index: int
    dtype: str


async def resolve_embeds(mm_inputs: Sequence[MultiModalInput] | None) -> list[MultiModalInput] | None:
    """``mm_inputs`` with every :class:`EmbedsRef` replaced by its tensor ``[rows, hidden]`` (each
    ObjectRef fetched once; on the CPU a read-only view of the object store's buffer, which the engine
    only reads).

    Raises:
        ray.exceptions.RayError: an embeddings object is lost (its encoder's node failed).
    """
    if not mm_inputs:
        return None if mm_inputs is None else list(mm_inputs)
    from rayinfer.actors.kv_transport import from_wire

    embeds = [m.embeds for m in mm_inputs if isinstance(m.embeds, EmbedsRef)]
    refs = list(dict.fromkeys(e.ref for e in embeds if not isinstance(e.ref, DeviceEmbeds)))
    held = list(dict.fromkeys(e.ref for e in embeds if isinstance(e.ref, DeviceEmbeds)))
    if not refs and not held:
        return list(mm_inputs)
    values = dict(zip(refs, await asyncio.gather(*refs)))
    if held:
        # Ray Direct Transport (one-sided, cuda_ipc): this replica calls ``take``, so it owns the result, and
        # ray.get (off the event loop) maps the encoder's tensors
        taken = [h.handle.take.options(tensor_transport=h.transport).remote(h.hold_id) for h in held]
        values.update(zip(held, await asyncio.to_thread(ray.get, taken)))
    out = []
    for m in mm_inputs:
        e = m.embeds
        if isinstance(e, EmbedsRef):
            value = values[e.ref][e.index]
            if not isinstance(e.ref, DeviceEmbeds):
                value = from_wire(value, getattr(torch, e.dtype))
            else:  # our own copy on the device: the mapping is the encoder's memory, freed with the object
                value = value.clone()
            m = dataclasses.replace(m, embeds=value)
        out.append(m)
    return out


def resolve_encoder_transport(transport: str, num_gpus_per_replica: float) -> str:
    """Resolve ``encoder.transport`` "auto" to "object_store": measured on an H200 with 576-token images
    (2.4 MB each in bf16), 256 concurrent image requests had a lower TTFT through the object store (p50
    2.40 s) than by cuda_ipc (3.03 s), whose per-request ``take`` round trip costs more than the copy it
    saves. "cuda_ipc" stays selectable; other names pass through. ``num_gpus_per_replica``: a cuda_ipc
    fleet needs GPUs (checked here).

    Raises:
        ValueError: for a name outside ``placement.parallel_config.ENCODER_TRANSPORTS``, or "cuda_ipc"
            without GPUs.
    """
    from rayinfer.placement.parallel_config import ENCODER_TRANSPORTS

    if transport not in ENCODER_TRANSPORTS:
        raise ValueError(f"encoder.transport must be one of {ENCODER_TRANSPORTS}, got {transport!r}")
    if transport == "cuda_ipc" and num_gpus_per_replica <= 0:
        raise ValueError("encoder.transport=cuda_ipc moves embeddings between GPU actors; this fleet has no GPUs "
                         "(num_gpus_per_replica=0)")
    return "object_store" if transport == "auto" else transport


_HELD_TTL_S = 120.0  # device embeddings not taken by then are dropped (their client gave up)


class EncoderActorImpl:
    """A vision encoder replica (role ENCODE): the model's ``encode_images`` behind a
    :class:`BatchingEncoder`. Only the vision tower and projector stay loaded (the decoder is dropped).

    Args:
        model_config: the vision-language model (``rayinfer.engine.config.ModelConfig``: name or directory,
            dtype, load_format, seed; dummy weights equal the engines' for the same seed).
        device: "auto" (cuda when available), "cpu" or "cuda".
        cache_tokens: the encoder cache's size in embedding rows.
    Raises:
        ValueError: the model has no vision encoder.
    """

    def __init__(self, model_config, device: str = "auto", cache_tokens: int = 16384):
        configure_worker_logging()
        from rayinfer.engine.llm_engine import resolve_device
        from rayinfer.model.loader import load_model, parse_dtype

        dev = resolve_device(device)
        net = load_model(model_config.model, parse_dtype(model_config.dtype, dev), dev, model_config.load_format,
                         model_config.seed, quantization=model_config.quantization)
        if not getattr(net, "is_multimodal", False):
            raise ValueError(f"model {model_config.model!r} has no vision encoder")
        for name in ("model", "lm_head"):  # the decoder: never run here
            if isinstance(getattr(net, name, None), torch.nn.Module):
                setattr(net, name, None)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        self.device = dev
        self.encoder = BatchingEncoder(net, cache_tokens, dev)
        self._held: dict[int, tuple[float, list[torch.Tensor]]] = {}  # cuda_ipc: embeddings until taken
        self._next_id = 0

    def ready(self) -> dict:
        """The replica's static facts, once the model is loaded."""
        return {"device": str(self.device), "num_image_tokens": getattr(self.encoder.model, "num_image_tokens", 0)}

    @ray.method(num_returns=2)
    async def encode(self, images: list[MultiModalInput]) -> tuple[tuple[str, list[int]], list[np.ndarray]]:
        """Encode ``images``; two objects: ``(dtype name, rows per image)`` (small: the caller awaits it)
        and the embeddings, one ``[rows, hidden]`` array in wire form per image (left in the object store
        for the engine replica; see :class:`EmbedsRef`).

        Raises:
            InvalidRequestError, ValueError: see :meth:`BatchingEncoder.encode`.
        """
        from rayinfer.actors.kv_transport import to_wire

        embeds = await self.encoder.encode(images)
        dtype = str(embeds[0].dtype).removeprefix("torch.") if embeds else "float32"
        return (dtype, [e.shape[0] for e in embeds]), [to_wire(e) for e in embeds]

    async def encode_for_transfer(self, images: list[MultiModalInput]) -> tuple[str, list[int], int]:
        """Encode ``images`` and hold their embeddings on this replica's device for :meth:`take`
        (Ray Direct Transport); returns ``(dtype name, rows per image, hold id)``.

        Raises:
            InvalidRequestError, ValueError: see :meth:`BatchingEncoder.encode`.
        """
        import time

        embeds = await self.encoder.encode(images, on_device=True)
        now = time.monotonic()
        self._held = {k: v for k, v in self._held.items() if now - v[0] < _HELD_TTL_S}
        self._next_id += 1
        self._held[self._next_id] = (now, [e.contiguous() for e in embeds])
        dtype = str(embeds[0].dtype).removeprefix("torch.") if embeds else "float32"
        return dtype, [e.shape[0] for e in embeds], self._next_id

    def take(self, hold_id: int) -> list[torch.Tensor]:
        """The embeddings held by :meth:`encode_for_transfer` (called with
        ``.options(tensor_transport="cuda_ipc")``: they stay on the device and the engine replica maps them).

        Raises:
            KeyError: nothing held under ``hold_id`` (taken already, or dropped after the TTL).
        """
        return self._held.pop(hold_id)[1]

    def stats(self) -> dict:
        """The encoder cache's counters (``num_encoder_runs``, ``encoder_cache_hits``,
        ``encoder_cache_tokens``), ``num_batches`` and ``num_images``."""
        return self.encoder.stats()


EncoderActor = ray.remote(EncoderActorImpl)
# with Ray Direct Transport (encoder.transport "cuda_ipc"): ``take`` returns device tensors by reference
EncoderActorRDT = ray.remote(enable_tensor_transport=True)(EncoderActorImpl)  # pyright: ignore[reportCallIssue]


class EncoderPool:
    """The caller's side of several encoder replicas: each image goes to the replica with the fewest
    patches in flight; images come back as inputs with ``embeds`` set (pixels dropped). Images that
    already have embeddings pass through untouched.

    A replica that fails (its actor died or is restarting) is left out and its images go to another
    replica, up to one attempt per replica.

    Args:
        replicas: objects whose ``encode(images)`` returns an awaitable of embeddings (EncoderActor
            handles wrapped by :class:`actor_encode`, or BatchingEncoders in tests).
    """

    def __init__(self, replicas: Sequence[Any]):
        self.replicas = list(replicas)
        self.balancer = PatchBalancer(len(self.replicas))
        self.num_retries = 0  # image groups sent again after their replica failed

    async def encode(self, images: Sequence[MultiModalInput]) -> list[MultiModalInput]:
        """Encode a request's images (spread over the replicas); returns them with ``embeds``.

        Raises:
            whatever a replica raised for these images (InvalidRequestError for a bad image), or its
            ``ray.exceptions.RayActorError`` once every replica failed.
        """
        out = list(images)
        todo = [i for i, m in enumerate(images) if m.embeds is None]
        failed: set[int] = set()
        for attempt in range(len(self.replicas) + 1):
            if not todo:
                break
            picks = {i: self.balancer.pick(images[i].num_patches, failed) for i in todo}
            groups: dict[int, list[int]] = {}
            for i, r in picks.items():
                groups.setdefault(r, []).append(i)
            try:
                results = await asyncio.gather(*(self.replicas[r].encode([images[i] for i in idx])
                                                 for r, idx in groups.items()), return_exceptions=True)
            finally:
                for i, r in picks.items():
                    self.balancer.release(r, images[i].num_patches)
            todo = []
            for (r, idx), res in zip(groups.items(), results):
                if isinstance(res, BaseException):
                    if isinstance(res, ray.exceptions.RayActorError) and attempt < len(self.replicas):
                        failed.add(r)
                        todo += idx
                        self.num_retries += 1
                        continue
                    raise res
                for i, e in zip(idx, res):
                    out[i] = dataclasses.replace(images[i], embeds=e, pixel_values=None)
        return out


class actor_encode:
    """Adapts an EncoderActor handle to :class:`EncoderPool`'s ``encode(images) -> awaitable``: returns
    one :class:`EmbedsRef` per image once the replica has encoded them (the embeddings themselves stay in
    the object store, or with ``transport`` "cuda_ipc" on the replica's GPU until the engine replica takes
    them by Ray Direct Transport).

    Raises (from ``encode``):
        rayinfer's errors (InvalidRequestError for a bad image) and ValueError as the replica raised them;
        ``ray.exceptions.RayActorError`` when the replica failed.
    """

    def __init__(self, handle, transport: str = "object_store"):
        self.handle = handle
        self.transport = transport

    async def encode(self, images: Sequence[MultiModalInput]) -> list[EmbedsRef]:
        embeds = None
        try:
            if self.transport == "object_store":
                meta, embeds = self.handle.encode.remote(list(images))
                dtype, rows = await meta
            else:  # held on the encoder's device; the engine replica takes them by Ray Direct Transport
                dtype, rows, hold_id = await self.handle.encode_for_transfer.remote(list(images))
                # the engine replica calls ``take`` itself: Ray fetches a device object only for its owner
                embeds = DeviceEmbeds(self.handle, hold_id, self.transport)
        except ray.exceptions.RayTaskError as e:
            if embeds is not None:
                with contextlib.suppress(Exception):  # the same error: seen here, not logged as unhandled
                    await embeds
            if isinstance(e.cause, RayInferError):
                raise e.cause from None
            if isinstance(e.cause, ValueError):
                raise InvalidRequestError(f"image: {e.cause}", "image") from None
            raise
        return [EmbedsRef(embeds, i, dtype) for i in range(len(rows))]
