"""How a KV payload moves from a prefill replica to a decode replica.

Transports (``ParallelConfig.pd.kv_transport``):

- ``nccl``: a transfer group of all prefill and decode replicas over ``torch.distributed``'s NCCL
  backend (:class:`KVTransferAgent`); each replica holds its own GPU (NCCL refuses two ranks on one
  device). The router batches the requests waiting to move between a pair of replicas into one
  send/recv: the prefill side gathers their blocks straight from its KV pool into one staging buffer,
  the decode side receives them into one payload that its engine imports block by block.
- ``gloo``: the same group and code over gloo, between CPU actors (how the nccl path is tested on CPU).
- ``cuda_ipc``: between actors that share one GPU: the prefill replica shares its whole paged KV cache
  once (:func:`share_tensor`, torch's CUDA reduction) and answers each transfer with the request's
  block ids (:class:`BlockHandle`, a few hundred bytes through Ray); the decode replica maps that cache
  once and gathers the blocks straight into its own memory (:func:`read_blocks`: one device-to-device
  gather, no host hop, no staging copy, no collective group); the prefill replica frees the blocks when
  the router says the copy is done (or failed).
- ``object_store``: the payload is copied to host memory and put in Ray's object store (works across
  machines; outlives the prefill actor).

Payloads that cross Ray on the host (the object store transport, the KV store's blocks) travel as numpy
arrays of the payload's bytes (:func:`to_wire` / :func:`from_wire`): Ray pickles a torch tensor (a copy on
each side, the GIL held throughout, half a second for a 1K-token prompt of an 8B model) but puts a numpy
array into the object store with one parallel memcpy and reads it back without a copy.

Memory: a prefilled request's KV stays in the prefill replica's pool (parked) until it is sent, so a
backlog of transfers holds the prefill replica's blocks and its scheduler admits fewer new prompts
(back-pressure); a decode replica reserves a received batch's bytes from a budget
(``pd.transfer_buffer_gib``, kept out of its KV pool) before the batch is sent, and gets them back when
the engine has imported every request of the batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import math
import threading
import weakref
from typing import Callable

import numpy as np
import ray
import torch

from rayinfer.placement.parallel_config import KV_TRANSPORTS

logger = logging.getLogger(__name__)

COLLECTIVE_TRANSPORTS = ("nccl", "gloo")  # moved by KVTransferAgent, batched by the router


def resolve_kv_transport(kv_transport: str, num_gpus_per_replica: float) -> str:
    """Resolve "auto": "nccl" when every replica holds a whole GPU, "cuda_ipc" when replicas share GPUs
    (a fraction each), else "object_store". Any other name passes through.

    Raises:
        ValueError: for a name outside :data:`KV_TRANSPORTS`.
    """
    if kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport must be one of {KV_TRANSPORTS}, got {kv_transport!r}")
    if kv_transport != "auto":
        return kv_transport
    if num_gpus_per_replica >= 1:
        return "nccl"
    return "cuda_ipc" if num_gpus_per_replica > 0 else "object_store"


class ByteBudget:
    """Bytes in use out of a capacity, awaited on an event loop (a decode replica's received payloads).

    A request for more than the whole capacity is granted when nothing else is in use (so one oversized
    batch cannot wait forever). ``peak`` is the most ever in use.
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"budget capacity must be positive, got {capacity}")
        self.capacity, self.used, self.peak = capacity, 0, 0
        self._cond: asyncio.Condition | None = None

    def _condition(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def acquire(self, nbytes: int) -> None:
        """Wait until ``nbytes`` fit, then take them."""
        cond = self._condition()
        async with cond:
            await cond.wait_for(lambda: self.used + nbytes <= self.capacity or self.used == 0)
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    async def release(self, nbytes: int) -> None:
        cond = self._condition()
        async with cond:
            self.used -= nbytes
            cond.notify_all()

    def stats(self) -> dict:
        """The budget's bytes as replica stats: ``kv_transfer_budget`` (capacity), ``_used`` and ``_peak``."""
        return {"kv_transfer_budget_used": self.used, "kv_transfer_budget_peak": self.peak,
                "kv_transfer_budget": self.capacity}


@dataclasses.dataclass(frozen=True)
class DeviceHandle:
    """A CUDA tensor shared with other processes on its GPU (:func:`share_tensor`).

    ``rebuild(*args)`` is torch's ``rebuild_cuda_tensor`` with its arguments (``args[6]`` is the device
    index, remapped by the receiver); ``gpu_id`` is the device's id among the sender's Ray GPU ids (None
    outside a Ray worker).
    """

    rebuild: Callable
    args: tuple
    gpu_id: object


def share_tensor(tensor: torch.Tensor) -> DeviceHandle:
    """A handle to a CUDA tensor that other processes on its GPU map (torch's CUDA IPC reduction,
    ``torch.multiprocessing.reductions.reduce_tensor``: an IPC handle of the memory and of an event recorded
    on the current stream, which a receiver's stream waits on once, when it maps the memory). Meant for
    memory that lives as long as the process (a replica's KV cache, shared once): torch keeps it past its
    last reference while a receiver maps it.

    Raises:
        ValueError: for a tensor not on a CUDA device.
    """
    if not tensor.is_cuda:
        raise ValueError(f"share_tensor shares CUDA memory, not {tensor.device} tensors")
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(tensor)
    gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else []
    index = tensor.device.index or 0
    return DeviceHandle(rebuild, tuple(args), gpu_ids[index] if index < len(gpu_ids) else None)


@dataclasses.dataclass(frozen=True)
class BlockHandle:
    """A parked request's KV blocks in a prefill replica's paged cache, for a replica on the same GPU to read
    in place (cuda_ipc; :func:`read_blocks`).

    ``cache`` is the sender's whole KV cache ``[L, num_blocks, ...]`` as :func:`share_tensor` shared it (the
    same handle for every transfer; a receiver maps it once), ``cache_id`` names that sharing (an actor that
    replaces a dead one shares a new cache), ``source`` the sender's replica (a receiver keeps one mapping per
    source) and ``block_ids`` the request's blocks, in order.
    """

    cache: DeviceHandle
    cache_id: str
    source: object
    block_ids: tuple[int, ...]


def _map(handle: DeviceHandle) -> torch.Tensor:
    """A view of the memory ``handle`` shares (``cudaIpcOpenMemHandle`` through torch); the current stream
    waits for the sender's event.

    Raises:
        ValueError: this process does not hold the sender's GPU (cuda_ipc needs both on one device).
    """
    if handle.gpu_id is None:
        index = torch.cuda.current_device()
    else:
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        if str(handle.gpu_id) not in gpu_ids:
            raise ValueError(f"cuda_ipc: the sender's GPU {handle.gpu_id} is not one of this replica's GPUs "
                             f"{gpu_ids}; cuda_ipc moves KV between replicas sharing a GPU")
        index = gpu_ids.index(str(handle.gpu_id))
    args = list(handle.args)
    args[6] = index  # rebuild_cuda_tensor's storage_device: this process's index of that GPU
    with torch.cuda.stream(torch.cuda.current_stream(index)):
        return handle.rebuild(*args)


class CacheMappings:
    """The KV caches of senders on this GPU, each mapped once (a decode replica's, for :func:`read_blocks`;
    thread-safe): source -> (cache_id, mapped cache). A new ``cache_id`` from a source (its replica was
    replaced) replaces that source's mapping."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_source: dict[object, tuple[str, torch.Tensor]] = {}

    def get(self, handle: BlockHandle) -> torch.Tensor:
        """The mapped cache ``handle`` names (mapped now if new, the current stream waiting for the sender).

        Raises:
            ValueError: this process does not hold the sender's GPU.
        """
        with self._lock:
            mapped = self._by_source.get(handle.source)
            if mapped is None or mapped[0] != handle.cache_id:
                self._by_source.pop(handle.source, None)  # let go of a replaced sender's cache first
                mapped = self._by_source[handle.source] = (handle.cache_id, _map(handle.cache))
            return mapped[1]

    def __len__(self) -> int:
        return len(self._by_source)


def read_blocks(handle: BlockHandle, stream: "torch.cuda.Stream | None", mappings: CacheMappings) -> torch.Tensor:
    """This process's own payload ``[L, len(block_ids), ...]`` of the blocks ``handle`` names, gathered from
    the sender's KV cache (mapped once in ``mappings``) on ``stream`` (default: the current stream). Returns
    once the gather is done; the sender may free the blocks then. Blocks the calling thread: call it off
    the event loop.

    Raises:
        ValueError: this process does not hold the sender's GPU (cuda_ipc needs both on one device).
    """
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        cache = mappings.get(handle)
        idx = torch.tensor(handle.block_ids, dtype=torch.long).to(cache.device, non_blocking=True)
        payload = torch.index_select(cache, 1, idx)
        torch.cuda.current_stream(cache.device).synchronize()
    return payload


def release_when_freed(tensor: torch.Tensor, budget: ByteBudget, nbytes: int, loop: asyncio.AbstractEventLoop) -> None:
    """Give ``nbytes`` back to ``budget`` (on ``loop``, from whichever thread frees it) once ``tensor`` is
    garbage (a received payload, after the engine imported it)."""
    weakref.finalize(tensor, lambda: loop.call_soon_threadsafe(lambda: asyncio.ensure_future(budget.release(nbytes))))


class KVTransferAgent:
    """One replica's end of a PD fleet's KV transfer group (``torch.distributed``, NCCL or gloo).

    Every send and receive runs on the agent's own thread (and on GPU its own CUDA stream), one at a time,
    so the actor's event loop keeps serving other requests and the engine keeps stepping while KV moves;
    the router runs one batch at a time per replica (send/recv pairs then always line up).

    Args:
        device: the KV cache's device.
        budget_bytes: receive budget (decode side): bytes of received payloads not yet imported.
    """

    def __init__(self, device: torch.device, budget_bytes: int):
        self.device = device
        self.budget = ByteBudget(budget_bytes)
        self.rank: int | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # sends and receives
        self._gather_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._staging: torch.Tensor | None = None  # sender: [2, chunk numel], grown to the largest chunk
        self.num_batches = self.num_bytes_sent = self.num_bytes_received = 0

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def join(self, backend: str, address: str, port: int, world_size: int, rank: int,
                   timeout_s: float = 300.0) -> None:
        """Join the group (every member calls this at once). Raises RuntimeError on a rendezvous failure."""
        import torch.distributed as dist

        def init():
            device = self.device
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            kwargs = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", world_size=world_size,
                                    rank=rank, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)

        await self._run(init)
        self.rank = rank

    async def send(self, gather: Callable[[torch.Tensor, slice], object], shape: tuple[int, ...],
                   dtype: torch.dtype, dst: int) -> int:
        """Send a batch's KV ``shape`` = ``[L, n, ...]`` to rank ``dst``, in layer chunks (:func:`layer_chunks`).

        ``gather(out, layers)`` fills ``out`` (``[len(layers), n, ...]``, contiguous) with those layers of
        the batch. On GPU the gather of chunk i+1 (its own stream) overlaps the send of chunk i, through
        two staging buffers. Returns the bytes sent, once the last send completed (the blocks may be freed).
        """
        import torch.distributed as dist

        def run() -> int:
            chunks = layer_chunks(shape, dtype.itemsize)
            per_layer = math.prod(shape[1:])
            chunk_numel = max(c.stop - c.start for c in chunks) * per_layer
            if self._staging is None or self._staging.dtype != dtype or self._staging.shape[1] < chunk_numel:
                self._staging = None
                self._staging = torch.empty(2, chunk_numel, dtype=dtype, device=self.device)
            sent: list = [None, None]  # per staging buffer: the event of its last send
            for i, layers in enumerate(chunks):
                buf = self._staging[i % 2, : (layers.stop - layers.start) * per_layer].view(
                    layers.stop - layers.start, *shape[1:])
                if self._stream is None:
                    gather(buf, layers)
                    dist.send(buf, dst)
                    continue
                with torch.cuda.stream(self._gather_stream):
                    if sent[i % 2] is not None:
                        self._gather_stream.wait_event(sent[i % 2])  # its previous chunk has left
                    gather(buf, layers)
                    gathered = torch.cuda.Event()
                    gathered.record(self._gather_stream)
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(gathered)
                    dist.send(buf, dst)
                    sent[i % 2] = torch.cuda.Event()
                    sent[i % 2].record(self._stream)
            if self._stream is not None:
                self._stream.synchronize()
            return math.prod(shape) * dtype.itemsize

        nbytes = await self._run(run)
        self.num_batches += 1
        self.num_bytes_sent += nbytes
        return nbytes

    async def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, nbytes_reserved: int) -> torch.Tensor:
        """Receive a batch's payload of ``shape`` from rank ``src`` into a new tensor (chunk by chunk, as
        the sender sends them).

        The ``nbytes_reserved`` taken from :attr:`budget` are given back when the tensor (and every view
        of it) is freed, i.e. once the engine imported all of the batch's requests.
        """
        import torch.distributed as dist

        def run() -> torch.Tensor:
            with on_stream(self._stream):
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                for layers in layer_chunks(shape, dtype.itemsize):
                    dist.recv(buf[layers], src)
                if self._stream is not None:
                    buf.record_stream(torch.cuda.default_stream(self.device))  # imported on the compute stream
                    self._stream.synchronize()
            return buf

        try:
            buf = await self._run(run)
        except BaseException:
            await self.budget.release(nbytes_reserved)
            raise
        release_when_freed(buf, self.budget, nbytes_reserved, asyncio.get_running_loop())
        self.num_batches += 1
        self.num_bytes_received += buf.numel() * buf.element_size()
        return buf

    def stats(self) -> dict:
        return {"kv_transfer_batches": self.num_batches, "kv_transfer_bytes_sent": self.num_bytes_sent,
                "kv_transfer_bytes_received": self.num_bytes_received, **self.budget.stats()}


CHUNK_BYTES = 256 << 20  # a batch is sent in layer chunks of about this size


def layer_chunks(shape: tuple[int, ...], itemsize: int) -> list[slice]:
    """The layer ranges a ``[L, n, ...]`` payload is sent in: about :data:`CHUNK_BYTES` each (whole layers),
    so the sender's gather of one chunk overlaps the send of the previous one. Sender and receiver derive
    the same ranges from the shape."""
    num_layers = shape[0]
    total = math.prod(shape) * itemsize
    count = min(num_layers, max(1, total // CHUNK_BYTES))
    step = -(-num_layers // count)
    return [slice(i, min(i + step, num_layers)) for i in range(0, num_layers, step)]


_WIRE_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_wire(payload: torch.Tensor) -> np.ndarray:
    """A host KV payload as a numpy array of the same bytes (an integer view of its dtype: numpy has no
    bfloat16 or float8), for Ray to move without pickling. No copy for a contiguous CPU tensor."""
    payload = payload.detach().cpu().contiguous()
    return payload.view(_WIRE_DTYPES[payload.element_size()]).numpy()


def from_wire(payload: "np.ndarray | torch.Tensor", dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``dtype`` that :func:`to_wire` made ``payload`` from (a tensor passes through). No
    copy: the result may view a read-only object-store buffer, so it must only be read (copied into a
    KV cache)."""
    if isinstance(payload, torch.Tensor):
        return payload
    import warnings

    with warnings.catch_warnings():  # read-only views of the object store: we only ever read them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(payload).view(dtype)


def on_stream(stream: "torch.cuda.Stream | None"):
    """``torch.cuda.stream(stream)`` on GPU; a no-op context for None (CPU)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
