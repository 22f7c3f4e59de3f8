"""How a KV payload moves from a prefill replica to a decode replica.

Transports (``ParallelConfig.pd.kv_transport``):

- ``object_store``: the payload is copied to host memory and put in Ray's object store (works across
  machines; outlives the prefill actor).
- ``nccl``: Ray Direct Transport GPU to GPU through a collective group of all replicas; each replica
  holds its own GPU (NCCL refuses two ranks on one device: "Duplicate GPU detected").
- ``cuda_ipc``: Ray Direct Transport between actors that share one GPU: the receiver maps the sender's
  device buffer through a CUDA IPC handle and copies it into its own cache (device to device, no host
  hop, no collective group).
- ``gloo``: Ray Direct Transport between CPU actors (the collective code path of ``nccl``, on CPU).

Ray's own NCCL collective group needs CuPy. Where CuPy is missing, :func:`ensure_nccl_backend` registers
:class:`TorchNCCLGroup` instead: the same Ray collective API over ``torch.distributed``'s NCCL backend,
which ships with every CUDA build of torch.
"""

from __future__ import annotations

import logging

from rayinfer.placement.parallel_config import KV_TRANSPORTS

logger = logging.getLogger(__name__)

COLLECTIVE_TRANSPORTS = ("nccl", "gloo")


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


def torch_group_class(name: str, torch_backend: str):
    """A Ray collective group class named ``name`` over ``torch.distributed``'s ``torch_backend``.

    Rendezvous and every operation are Ray's ``TorchGLOOGroup``'s (they call ``torch.distributed`` with
    this group); only the process group's backend differs. With "nccl", tensors must be on the process's
    current CUDA device. ``torch_group_class("NCCL", "nccl")`` is :class:`TorchNCCLGroup`; tests build a
    "gloo" one to run the same code on CPU.
    """
    import torch
    import torch.distributed as dist
    from ray.experimental import internal_kv
    from ray.util.collective.collective_group.base_collective_group import BaseGroup
    from ray.util.collective.collective_group.torch_gloo_collective_group import (
        TorchGLOOGroup,
        get_master_address_metadata_key,
    )

    class TorchDistGroup(TorchGLOOGroup):
        def __init__(self, world_size: int, rank: int, group_name: str, gloo_timeout: int | None = None):
            if not dist.is_initialized():
                self._rendezvous(group_name, rank, gloo_timeout)
                key = get_master_address_metadata_key(group_name)
                addr, port = internal_kv._internal_kv_get(key).decode().split(":")
                device = torch.device("cuda", torch.cuda.current_device()) if torch_backend == "nccl" else None
                # the rendezvous address goes in the init URL: no process-wide MASTER_* variables written
                dist.init_process_group(backend=torch_backend, init_method=f"tcp://{addr}:{port}",
                                        world_size=world_size, rank=rank, device_id=device)
                if rank == 0:
                    try:
                        internal_kv._internal_kv_del(key)
                    except Exception:  # already gone
                        pass
            BaseGroup.__init__(self, world_size, rank, group_name)
            self._is_default_group = group_name == "default"
            self._pg = dist.group.WORLD if self._is_default_group else dist.new_group(list(range(world_size)),
                                                                                       backend=torch_backend)

        @classmethod
        def backend(cls):
            return name

        @classmethod
        def check_backend_availability(cls) -> bool:
            if not dist.is_available():
                return False
            return torch_backend != "nccl" or (dist.is_nccl_available() and torch.cuda.is_available())

        def send(self, tensor, send_options) -> None:
            dist.send(self._check_tensor_input(tensor), dst=send_options.dst_rank, group=self._pg)

        def recv(self, tensor, recv_options) -> None:
            dist.recv(self._check_tensor_input(tensor), src=recv_options.src_rank, group=self._pg)

    TorchDistGroup.__name__ = TorchDistGroup.__qualname__ = f"Torch{name}Group"
    return TorchDistGroup


def ensure_nccl_backend() -> str:
    """Make Ray's "NCCL" collective backend usable in this process; call it on the driver and in every
    actor before the collective group is created.

    Returns:
        "ray" when Ray's own (CuPy) group is available, "torch" when :class:`TorchNCCLGroup` was
        registered in its place.
    """
    import ray.util.collective  # noqa: F401  (registers Ray's backends first)
    from ray.util.collective.backend_registry import _global_registry, register_collective_backend

    if _global_registry.is_registered("NCCL") and _global_registry.get("NCCL").__name__ == "TorchNCCLGroup":
        return "torch"
    if _global_registry.check("NCCL"):
        return "ray"
    _global_registry._map.pop("NCCL", None)  # registered but unusable (no CuPy): replace it
    register_collective_backend("NCCL", torch_group_class("NCCL", "nccl"))
    logger.info("Ray's NCCL collective group needs CuPy; using torch.distributed's NCCL backend")
    return "torch"


def prepare_transport(kv_transport: str) -> None:
    """Per-process setup a transport needs before actors use it (driver and actors alike)."""
    if kv_transport == "nccl":
        ensure_nccl_backend()
