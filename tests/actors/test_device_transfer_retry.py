"""The router's cuda_ipc transfers after a transport failure (no Ray cluster: the Router driven directly, its
replicas stood in for by objects whose methods answer like actor calls): the object store takes over for
``pd.device_retry_s``, one trial transfer then goes by device, and its success brings cuda_ipc back for every
pick; a replica's death changes nothing."""

import asyncio

import pytest
import ray.exceptions

from rayinfer.actors.router import FleetInfo, Router
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import ParallelConfig, PDSection
from rayinfer.policy.pd import DeviceTransferBreaker
from rayinfer.policy.routing import DecodeBalancer


class Method:
    """An actor method: ``.remote(...)`` answers with a done future (its result, or the next queued error)."""

    def __init__(self, result=None):
        self.result, self.errors, self.calls = result, [], 0

    def remote(self, *args):
        self.calls += 1
        fut = asyncio.get_running_loop().create_future()
        if self.errors:
            fut.set_exception(self.errors.pop(0))
        else:
            fut.set_result(self.result)
        return fut


class Replica:
    def __init__(self):
        self.parked_blocks = Method([3])
        self.share_kv = Method("handle")
        self.release_kv, self.reserve_kv, self.receive_kv, self.unreserve_kv = Method(), Method(), Method(), Method()


def cuda_ipc_router(clock) -> tuple[Router, Replica, Replica]:
    pd = PDSection(kv_transport="cuda_ipc", device_retry_s=30.0)
    r = Router(ModelConfig("SmolLM2-135M-Instruct"), EngineConfig(device="cpu"),
               ParallelConfig(num_prefill=1, num_decode=1, pd=pd))
    prefill, decode = Replica(), Replica()
    r.info = FleetInfo("pd", 512, 16, [prefill, decode], 1, kv_transport="cuda_ipc")
    r.decode_lb = DecodeBalancer(1, 8, 4096)
    r._device = DeviceTransferBreaker(enabled=True, recoverable=True, retry_s=pd.device_retry_s, clock=clock)
    return r, prefill, decode


async def rdt(router: Router) -> bool:
    ticket, by_device = await router.pick_decode(16, 0)
    router.release_decode(ticket)
    return by_device


def test_a_failed_cuda_ipc_transfer_falls_back_for_a_while_then_a_trial_brings_cuda_ipc_back(clock):
    async def main():
        router, prefill, decode = cuda_ipc_router(clock)
        assert await rdt(router)
        await router.transfer_kv(0, 0, "a")
        decode.receive_kv.errors.append(ray.exceptions.RayTaskError(
            "receive_kv", "Traceback ...", RuntimeError("CUDA error: invalid resource handle")))
        with pytest.raises(ray.exceptions.RayTaskError):
            await router.transfer_kv(0, 0, "b")
        assert prefill.release_kv.calls == 2  # the blocks are freed either way
        assert not await rdt(router) and not await rdt(router)  # the object store, for pd.device_retry_s
        assert router.num_kv_device_failures == 1 and not router._device.closed
        clock.now += 30.0
        assert await rdt(router)  # one trial...
        assert not await rdt(router)  # ...at a time
        await router.transfer_kv(0, 0, "c")  # the trial goes through
        assert await rdt(router) and await rdt(router)  # cuda_ipc for every pick again

        # a second failure in a row (the trial's) doubles the wait
        decode.receive_kv.errors.append(ray.exceptions.RayTaskError("receive_kv", "", RuntimeError("CUDA error")))
        with pytest.raises(ray.exceptions.RayTaskError):
            await router.transfer_kv(0, 0, "d")
        clock.now += 30.0
        assert await rdt(router)
        decode.receive_kv.errors.append(ray.exceptions.RayTaskError("receive_kv", "", RuntimeError("CUDA error")))
        with pytest.raises(ray.exceptions.RayTaskError):
            await router.transfer_kv(0, 0, "e")
        clock.now += 59.0
        assert not await rdt(router)
        clock.now += 1.0
        assert await rdt(router)

    asyncio.run(main())


def test_a_dead_replica_or_an_expired_request_does_not_open_the_breaker(clock):
    async def main():
        router, prefill, decode = cuda_ipc_router(clock)
        decode.receive_kv.errors.append(ray.exceptions.RayActorError())  # the decode replica died
        with pytest.raises(ray.exceptions.RayActorError):
            await router.transfer_kv(0, 0, "a")
        prefill.share_kv.errors.append(ray.exceptions.RayTaskError("share_kv", "", KeyError("b")))  # expired
        with pytest.raises(KeyError):
            await router.transfer_kv(0, 0, "b")
        assert await rdt(router) and router._device.closed and router.num_kv_device_failures == 0

    asyncio.run(main())
