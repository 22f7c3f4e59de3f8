"""The PD admission gate: requests wait before their prefill while prefill + decode hold the limit, and are
admitted first come, first served as requests leave (no Ray: the Router's balancers driven directly); a grant
whose caller left is given back (``client.granted``, with Ray tasks standing for the router)."""

import asyncio

import pytest

from rayinfer.actors.router import AdmissionGate, Router
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import ParallelConfig, PDSection


def pd_router(limit: int) -> Router:
    """A Router with a PD admission gate (as after start) and no replica."""
    r = Router(ModelConfig("SmolLM2-135M-Instruct"), EngineConfig(device="cpu"),
               ParallelConfig(num_prefill=1, num_decode=1, pd=PDSection(admission_headroom=0.0)))
    r.admission = AdmissionGate(limit, lambda: r.num_admitted)
    return r


def test_requests_wait_before_prefill_until_one_leaves():
    async def main():
        router = pd_router(limit=2)
        order: list[int] = []

        async def request(i: int):
            await router.admit()
            order.append(i)

        tasks = [asyncio.ensure_future(request(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        assert order == [0, 1]  # two in flight (the limit); three wait before their prefill
        assert router.admission is not None and router.admission.num_waiting == 3
        router.leave()  # one request ends: exactly one more is let in
        await asyncio.sleep(0.05)
        assert order == [0, 1, 2]
        router.leave()
        router.leave()
        await asyncio.sleep(0.05)
        assert order == [0, 1, 2, 3, 4]  # first come, first served
        assert router.num_admitted == 2 and router.admission.num_waited == 3
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_cancelled_waiter_passes_its_turn_on():
    async def main():
        count = {"n": 1}
        gate = AdmissionGate(1, lambda: count["n"])
        a = asyncio.ensure_future(gate.admit())
        b = asyncio.ensure_future(gate.admit())
        await asyncio.sleep(0.01)
        count["n"] = 0
        gate.wake()  # room for one: a is woken...
        a.cancel()  # ...but its caller leaves before taking a ticket: b gets the place
        with pytest.raises(asyncio.CancelledError):
            await a
        await asyncio.wait_for(b, 5)

    asyncio.run(main())


def test_admission_headroom_is_validated():
    with pytest.raises(ValueError, match="admission_headroom"):
        PDSection(admission_headroom=-0.5)
    assert PDSection(admission_headroom=None).admission_headroom is None


def test_a_grant_whose_caller_left_is_given_back_after_its_loop_is_gone(ray_cluster):
    """A caller cancelled while the router's grant is in flight gives the grant back when it arrives, even
    when the caller's event loop has closed by then (as when a job's run ends on an error): the router's
    in-flight counts stay true, and no give-back task dies pending with the loop."""
    import threading
    import time

    import ray

    from rayinfer.actors.client import granted

    @ray.remote(num_cpus=0)
    def slow_grant(value: int) -> int:
        time.sleep(1.0)
        return value

    released: list[int] = []
    done = threading.Event()

    def release(value: int) -> None:
        released.append(value)
        done.set()

    async def main():
        task = asyncio.ensure_future(granted(slow_grant.remote(7), release))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())  # the loop is closed before the grant arrives
    assert done.wait(60)
    assert released == [7]

    @ray.remote(num_cpus=0)
    def failed_grant() -> int:
        time.sleep(0.5)
        raise RuntimeError("no replica")

    async def fails():
        task = asyncio.ensure_future(granted(failed_grant.remote(), release))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(fails())
    time.sleep(2.0)
    assert released == [7]  # a failed pick granted nothing: nothing is given back
