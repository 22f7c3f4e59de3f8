"""KV transport names, the receive budget, and the transfer agents (gloo, the nccl path's code on CPU): a batch
of scattered blocks arrives intact, and a receiver waiting for a batch keeps answering on its event loop."""

import asyncio


import pytest

from rayinfer.actors.kv_transport import resolve_kv_transport


@pytest.mark.parametrize("gpus, want", [(0, "object_store"), (0.5, "cuda_ipc"), (0.25, "cuda_ipc"), (1, "nccl"),
                                        (2, "nccl")])
def test_auto_picks_by_gpus_per_replica(gpus, want):
    assert resolve_kv_transport("auto", gpus) == want


def test_explicit_names_pass_through_and_bad_names_are_named():
    for name in ("object_store", "nccl", "gloo", "cuda_ipc"):
        assert resolve_kv_transport(name, 0) == name
    with pytest.raises(ValueError, match="kv_transport must be one of .*'rdma'"):
        resolve_kv_transport("rdma", 1)



def test_byte_budget_waits_releases_and_lets_an_oversized_batch_through_alone():
    from rayinfer.actors.kv_transport import ByteBudget

    async def main():
        budget = ByteBudget(100)
        await budget.acquire(60)
        second = asyncio.ensure_future(budget.acquire(50))  # 110 > 100: waits
        await asyncio.sleep(0.05)
        assert not second.done() and budget.used == 60
        await budget.release(60)
        await asyncio.wait_for(second, 5)
        assert budget.used == 50
        oversized = asyncio.ensure_future(budget.acquire(500))  # more than the capacity: only when empty
        await asyncio.sleep(0.05)
        assert not oversized.done()
        await budget.release(50)
        await asyncio.wait_for(oversized, 5)
        assert budget.used == 500 and budget.peak == 500
        await budget.release(500)
        assert budget.used == 0

    asyncio.run(main())
    with pytest.raises(ValueError, match="capacity must be positive"):
        ByteBudget(0)


def test_layer_chunks_cover_every_layer_once():
    from rayinfer.actors import kv_transport
    from rayinfer.actors.kv_transport import layer_chunks

    mib = 1 << 20
    assert layer_chunks((32, 8, 2, 16, 8, 128), 2) == [slice(0, 32)]  # 8 MiB: one chunk
    chunks = layer_chunks((32, 2048, 2, 16, 8, 128), 2)  # 4 GiB: 16 chunks of 2 layers
    assert chunks == [slice(i, i + 2) for i in range(0, 32, 2)]
    odd = layer_chunks((30, 4096, 2, 16, 3, 64), 4)  # 1.4 GiB, 30 layers
    assert [i for c in odd for i in range(c.start, c.stop)] == list(range(30))
    assert all(c.stop - c.start <= 30 for c in odd) and len(odd) > 1
    assert kv_transport.CHUNK_BYTES == 256 * mib


def test_agents_move_a_batch_over_gloo_while_the_receiver_keeps_serving(ray_cluster):
    import time

    import ray
    import torch

    @ray.remote(num_cpus=0)
    class Peer:
        def __init__(self):
            from rayinfer.actors import kv_transport
            from rayinfer.actors.kv_transport import KVTransferAgent

            kv_transport.CHUNK_BYTES = 200  # send in layer chunks (1 layer of 4 blocks is 384 bytes): 2 here

            self.agent = KVTransferAgent(torch.device("cpu"), budget_bytes=1 << 20)
            self.cache = torch.arange(2 * 8 * 2 * 4 * 3, dtype=torch.float32).view(2, 8, 2, 4, 3)  # [L, N, 2, bs, D]

        def address(self):
            from rayinfer.placement.groups import free_port, node_ip

            return node_ip(), free_port()

        async def join(self, addr, port, rank):
            await self.agent.join("gloo", addr, port, 2, rank, timeout_s=60)

        async def send(self, blocks):
            idx = torch.tensor(blocks)
            shape = (2, len(blocks), 2, 4, 3)
            return await self.agent.send(lambda out, layers: torch.index_select(self.cache[layers], 1, idx, out=out),
                                         shape, torch.float32, 1)

        async def recv(self, num_blocks):
            nbytes = num_blocks * 2 * 2 * 4 * 3 * 4
            await self.agent.budget.acquire(nbytes)
            return await self.agent.recv((2, num_blocks, 2, 4, 3), torch.float32, 0, nbytes)

        async def ping(self):
            return self.agent.budget.used

    a, b = Peer.remote(), Peer.remote()
    addr, port = ray.get(a.address.remote())
    ray.get([a.join.remote(addr, port, 0), b.join.remote(addr, port, 1)], timeout=120)
    blocks = [5, 1, 6, 6]
    pending = b.recv.remote(len(blocks))  # waits on the agent's thread for a sender
    want = len(blocks) * 192  # bytes reserved: 2 layers x 2 x 4 x 3 floats per block
    for _ in range(100):  # (Ray may start the ping before the receive)
        if ray.get(b.ping.remote(), timeout=10) == want:
            break
        time.sleep(0.05)
    for _ in range(5):  # the receiver's event loop answers meanwhile, with the batch's bytes reserved
        assert ray.get(b.ping.remote(), timeout=10) == want
    ready, _ = ray.wait([pending], timeout=0.5)
    assert not ready  # still in flight
    sent = ray.get(a.send.remote(blocks), timeout=60)
    got = ray.get(pending, timeout=60)
    cache = torch.arange(2 * 8 * 2 * 4 * 3, dtype=torch.float32).view(2, 8, 2, 4, 3)
    assert torch.equal(got, cache[:, blocks]) and sent == got.numel() * 4
    # the payload went out of scope on the receiver (Ray returned a copy): its bytes are given back
    for _ in range(50):
        if ray.get(b.ping.remote()) == 0:
            break
        time.sleep(0.1)
    assert ray.get(b.ping.remote()) == 0
    for actor in (a, b):
        ray.kill(actor)



_SHARE_IN_CHILD = """
import pickle, sys
import torch
from rayinfer.actors.kv_transport import BlockHandle, share_tensor
cache = torch.arange(2 * 8 * 2 * 4 * 16, dtype=torch.float32, device="cuda").view(2, 8, 2, 4, 16)
shared, replaced = share_tensor(cache), share_tensor(cache * 2)  # the second stands for a new actor's cache
with open(sys.argv[1], "wb") as f:
    pickle.dump([BlockHandle(shared, "first", 0, (5, 1, 6)), BlockHandle(shared, "first", 0, (1,)),
                 BlockHandle(replaced, "second", 0, (1,))], f)
print("shared", flush=True)
sys.stdin.readline()  # the other process has read the blocks: block 1 is reused
cache[:, 1] = -1.0
torch.cuda.synchronize()
print("written", flush=True)
sys.stdin.readline()
"""


@pytest.mark.gpu
def test_blocks_of_a_shared_cache_are_read_in_place_by_another_process(tmp_path):
    """``share_tensor`` / ``read_blocks`` (the cuda_ipc transport) between two processes on one GPU, outside
    Ray: the receiver's payload equals ``index_select`` of the sender's cache over the named blocks; the cache
    is mapped once per source (a later read sees the sender's later writes through the same mapping), and a
    new cache id from that source replaces its mapping."""
    import pickle
    import subprocess
    import sys

    import torch

    from rayinfer.actors.kv_transport import CacheMappings, read_blocks

    path = tmp_path / "handles.pkl"
    child = subprocess.Popen([sys.executable, "-c", _SHARE_IN_CHILD, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "shared"
        with open(path, "rb") as f:
            three, one, new_cache = pickle.load(f)
        cache = torch.arange(2 * 8 * 2 * 4 * 16, dtype=torch.float32, device="cuda").view(2, 8, 2, 4, 16)
        mappings, stream = CacheMappings(), torch.cuda.Stream()
        got = read_blocks(three, stream, mappings)
        torch.testing.assert_close(got, cache[:, [5, 1, 6]], rtol=0, atol=0)
        assert got.data_ptr() != 0 and len(mappings) == 1
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "written"
        assert (read_blocks(one, stream, mappings) == -1.0).all()  # the same mapping, the sender's new values
        assert (got[:, 1] == cache[:, 1]).all()  # the first payload is the receiver's own copy
        torch.testing.assert_close(read_blocks(new_cache, stream, mappings), cache[:, [1]] * 2, rtol=0, atol=0)
        assert len(mappings) == 1  # the replaced cache's mapping is gone
        child.stdin.write("done\n")
        child.stdin.flush()
    finally:
        child.kill()
        child.wait(60)
