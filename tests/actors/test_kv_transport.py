"""KV transport names: "auto" resolution, bad names, and the CuPy-free NCCL backend's registration."""

import pytest

from rayinfer.actors.kv_transport import ensure_nccl_backend, resolve_kv_transport


@pytest.mark.parametrize("gpus, want", [(0, "object_store"), (0.5, "cuda_ipc"), (0.25, "cuda_ipc"), (1, "nccl"),
                                        (2, "nccl")])
def test_auto_picks_by_gpus_per_replica(gpus, want):
    assert resolve_kv_transport("auto", gpus) == want


def test_explicit_names_pass_through_and_bad_names_are_named():
    for name in ("object_store", "nccl", "gloo", "cuda_ipc"):
        assert resolve_kv_transport(name, 0) == name
    with pytest.raises(ValueError, match="kv_transport must be one of .*'rdma'"):
        resolve_kv_transport("rdma", 1)


def test_nccl_backend_registered_without_cupy():
    pytest.importorskip("ray")
    from ray.util.collective.backend_registry import _global_registry

    try:
        import cupy  # noqa: F401
        has_cupy = True
    except ImportError:
        has_cupy = False
    which = ensure_nccl_backend()
    assert _global_registry.is_registered("NCCL")
    cls = _global_registry.get("NCCL")
    assert cls.backend() == "NCCL"
    if not has_cupy:
        assert which == "torch" and cls.__name__ == "TorchNCCLGroup"
    assert ensure_nccl_backend() == which  # idempotent: a second call keeps the same class
    assert _global_registry.get("NCCL") is cls


def test_torch_group_sends_between_two_actors(ray_cluster):
    """The CuPy-free group's own code (rendezvous, process group, send/recv) on CPU: the same class as
    TorchNCCLGroup built over gloo, used through Ray's collective API by two actors."""
    import ray
    import torch
    from ray.util import collective

    name = "TORCHGLOOTEST"

    def register():
        from ray.util.collective.backend_registry import _global_registry, register_collective_backend

        from rayinfer.actors.kv_transport import torch_group_class

        if not _global_registry.is_registered(name):
            register_collective_backend(name, torch_group_class(name, "gloo"))

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self):
            register()

        def send(self, n):
            collective.send(torch.arange(n, dtype=torch.float32) * 3, 1, "kvtest")
            return True

        def recv(self, n):
            out = torch.zeros(n)
            collective.recv(out, 0, "kvtest")
            return out

    register()
    a, b = Peer.remote(), Peer.remote()
    collective.create_collective_group([a, b], 2, [0, 1], backend=name, group_name="kvtest")
    sent, got = ray.get([a.send.remote(1000), b.recv.remote(1000)], timeout=60)
    assert sent and torch.equal(got, torch.arange(1000, dtype=torch.float32) * 3)
    for actor in (a, b):
        ray.kill(actor)
