"""KV transfer bandwidth between two engine-like actors, against the machine's copy bandwidth.

Usage::

    python jobs/bench_kv_transfer.py                       # llama3-8b shape, bf16; 2+ GPUs: nccl + object_store,
                                                           # 1 GPU (two actors sharing it): cuda_ipc + object_store
    python jobs/bench_kv_transfer.py --tokens 1024 8192 32768 --transports nccl object_store --repeats 10
    python jobs/bench_kv_transfer.py --device cpu --shape smollm2 --transports gloo object_store --tokens 256

What a PD handoff does, step by step, each timed on its own (median of ``--repeats``):

1. export: gather the request's blocks out of a paged cache ``[L, num_blocks, 2, bs, H, D]`` into one
   payload ``[L, n, 2, bs, H, D]`` (``LLMEngine.gather_kv``);
2. transfer: the payload from a sender actor to a receiver actor (one GPU each): nccl / gloo through the
   KV transfer agents (``rayinfer.actors.kv_transport.KVTransferAgent``, what PD replicas use: gather into
   the staging buffer, send, receive, scatter into blocks, in batches of at most
   ``--transfer-buffer-gib``, each sent in layer chunks whose gather overlaps the previous chunk's send;
   the time includes the export, not the import, which the decode engine runs at admission), ``cuda_ipc`` (two actors
   on one GPU, as PD replicas do it: the sender names the request's blocks in its cache, which it shared over
   CUDA IPC once, and the receiver gathers them from its mapping of that cache into its own memory;
   ``kv_transport.share_tensor`` / ``read_blocks``), or the object store (device -> host, plasma, host ->
   device);
3. import: scatter the payload into the receiver's paged cache (as the engine imports it).

Transfer times are reported raw and minus the round trip of a one-block payload (Ray's per-call
latency; applied only where the payload takes most of the call), as GB/s, and against the ceilings
measured in the same run: device-to-device copy on one GPU (bytes read + written), GPU-to-GPU peer
copy (when one process sees two GPUs), and pinned device-to-host / host-to-device copies on the
sender's GPU. Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import ray
import torch

from rayinfer.actors.kv_transport import CacheMappings
from rayinfer.jobs.benchlib import git_revision

SHAPES = {  # layers, kv heads, head dim
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (80, 8, 128),
    "smollm2": (30, 3, 64),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm up
    _sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class _Side:
    """One end of the transfer: a paged KV cache on one device, with export and import as the engine does."""

    def __init__(self, shape: tuple[int, ...], dtype: str, block_size: int, num_blocks: int, device: str,
                 transports: tuple[str, ...] = ()):
        from rayinfer.actors.kv_transport import KVTransferAgent

        self.device = torch.device("cuda:0" if device == "cuda" else "cpu")
        layers, heads, dim = shape
        self.cache = torch.randn(layers, num_blocks, 2, block_size, heads, dim, device=self.device).to(DTYPES[dtype])
        self.payloads: dict[int, torch.Tensor] = {}
        self.agent = KVTransferAgent(self.device, 1 << 40) if set(transports) & {"nccl", "gloo"} else None
        self.ipc_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.shared = None  # cuda_ipc sender: this cache's CUDA IPC handle, made once
        self.mappings = CacheMappings()  # cuda_ipc receiver: the sender's cache, mapped once

    def address(self) -> tuple[str, int]:
        from rayinfer.placement.groups import free_port, node_ip

        return node_ip(), free_port()

    async def join(self, backend: str, address: str, port: int, rank: int) -> None:
        assert self.agent is not None
        await self.agent.join(backend, address, port, 2, rank)

    async def agent_send(self, num_blocks: int) -> int:
        """What a prefill replica's send_kv does: gather scattered blocks into the staging buffer, send."""
        assert self.agent is not None
        idx = torch.randperm(self.cache.shape[1], device=self.device)[:num_blocks]
        shape = (self.cache.shape[0], num_blocks, *self.cache.shape[2:])
        return await self.agent.send(lambda out, layers: torch.index_select(self.cache[layers], 1, idx, out=out),
                                     shape, self.cache.dtype, 1)

    async def agent_recv(self, num_blocks: int) -> int:
        """What a decode replica's recv_kv does: receive the batch (its engine imports it later, at
        admission: ``import ms`` in the table)."""
        assert self.agent is not None
        shape = (self.cache.shape[0], num_blocks, *self.cache.shape[2:])
        payload = await self.agent.recv(shape, self.cache.dtype, 0, 0)
        return payload.numel() * payload.element_size()

    def export(self, num_blocks: int, repeats: int) -> float:
        """Gather ``num_blocks`` scattered blocks into a payload (kept for ``send``); returns median seconds."""
        idx = torch.randperm(self.cache.shape[1], device=self.device)[:num_blocks]
        t = _median_s(lambda: self.cache[:, idx].contiguous(), self.device, repeats)
        self.payloads[num_blocks] = self.cache[:, idx].contiguous()
        return t

    def share(self, num_blocks: int):
        """What a prefill replica's share_kv does: name scattered blocks of its cache (shared over CUDA IPC
        once); on CPU, the gathered payload itself."""
        from rayinfer.actors.kv_transport import BlockHandle, share_tensor

        idx = torch.randperm(self.cache.shape[1], device=self.device)[:num_blocks]
        if not self.cache.is_cuda:
            return torch.index_select(self.cache, 1, idx)
        if self.shared is None:
            self.shared = share_tensor(self.cache)
        return BlockHandle(self.shared, "bench", 0, tuple(idx.tolist()))

    def open(self, handle) -> int:
        """What a decode replica's receive_kv does: gather the named blocks from the sender's mapped cache
        into its own memory (its engine imports the payload later, at admission)."""
        from rayinfer.actors.kv_transport import read_blocks

        payload = handle if isinstance(handle, torch.Tensor) else read_blocks(handle, self.ipc_stream, self.mappings)
        return payload.numel() * payload.element_size()

    def send_to_host(self, num_blocks: int) -> torch.Tensor:
        return self.payloads[num_blocks].to("cpu")  # what export_kv does for the object store

    def receive(self, payload: torch.Tensor) -> tuple[int, float]:
        """Import a payload into scattered blocks; returns (bytes, seconds spent moving it to the device)."""
        t = time.perf_counter()
        payload = payload.to(self.device, non_blocking=False)
        if payload.is_cuda and payload.device == self.device and not payload.is_contiguous():
            payload = payload.contiguous()
        _sync(self.device)
        idx = torch.randperm(self.cache.shape[1], device=self.device)[: payload.shape[1]]
        self.cache[:, idx] = payload
        _sync(self.device)
        return payload.numel() * payload.element_size(), time.perf_counter() - t

    def import_time(self, num_blocks: int, repeats: int) -> float:
        payload = self.payloads[num_blocks]
        idx = torch.randperm(self.cache.shape[1], device=self.device)[:num_blocks]

        def scatter():
            self.cache[:, idx] = payload

        return _median_s(scatter, self.device, repeats)

    def ceilings(self, nbytes: int, repeats: int) -> dict[str, float]:
        """GB/s of the copies a transfer is bounded by, on this actor's node."""
        n = nbytes // 2
        src = torch.empty(n, dtype=torch.float16, device=self.device)
        dst = torch.empty_like(src)
        out = {"device_copy_GBps": 2 * nbytes / _median_s(lambda: dst.copy_(src), self.device, repeats) / 1e9}
        if self.device.type == "cuda":
            host = torch.empty(n, dtype=torch.float16, pin_memory=True)
            out["d2h_pinned_GBps"] = nbytes / _median_s(lambda: host.copy_(src), self.device, repeats) / 1e9
            out["h2d_pinned_GBps"] = nbytes / _median_s(lambda: src.copy_(host), self.device, repeats) / 1e9
        return out


def _peer_copy_GBps(nbytes: int, repeats: int) -> float | None:
    """GPU 0 -> GPU 1 copy in one process (NVLink / PCIe peer bandwidth), or None without two GPUs."""
    if torch.cuda.device_count() < 2:
        return None
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda:0")
    dst = torch.empty_like(src, device="cuda:1")

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize("cuda:1")

    return nbytes / _median_s(copy, torch.device("cuda:0"), repeats) / 1e9


def _timed_transfer(sender, receiver, num_blocks: int, transport: str, repeats: int, chunk_blocks: int) -> float:
    """Median seconds from submitting the send to the payload sitting in the receiver's cache.

    nccl / gloo move the blocks as the PD router does: batches of at most ``chunk_blocks`` blocks
    (``pd.transfer_buffer_gib``), one after another, each gathered from scattered blocks on the sender and
    scattered into blocks on the receiver (export and import included in the time)."""
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        if transport in ("nccl", "gloo"):
            left = num_blocks
            while left:
                n = min(left, chunk_blocks)
                ray.get([sender.agent_send.remote(n), receiver.agent_recv.remote(n)])
                left -= n
            if i:
                times.append(time.perf_counter() - t)
            continue
        if transport == "object_store":
            ref = sender.send_to_host.remote(num_blocks)
            ray.get(receiver.receive.remote(ref))
        else:  # cuda_ipc
            ref = sender.share.remote(num_blocks)
            ray.get(receiver.open.remote(ref))
        if i:  # the first is a warm-up (communicator and buffers)
            times.append(time.perf_counter() - t)
        del ref
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--transports", nargs="+", default=None,
                    help="nccl, cuda_ipc, gloo, object_store (default: nccl or cuda_ipc, and object_store, on "
                         "GPU; gloo object_store on CPU)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transfer-buffer-gib", type=float, default=4.0,
                    help="nccl/gloo: the largest batch per send/recv, as pd.transfer_buffer_gib")
    ap.add_argument("--out", default="benchmarks/results/kv_transfer.json")
    ap.add_argument("--git-rev", default=None, help="revision of the code (default: the checkout's short commit)")
    args = ap.parse_args()
    max_blocks = -(-max(args.tokens) // args.block_size)
    from rayinfer.actors.cluster import init_ray

    print(init_ray(), flush=True)
    gpus = ray.cluster_resources().get("GPU", 0)
    if args.device == "cuda" and gpus < 1:
        raise SystemExit("bench_kv_transfer --device cuda needs a GPU; this cluster has none")
    shared = args.device == "cuda" and gpus < 2  # one GPU: sender and receiver share it
    num_gpus = (0.5 if shared else 1) if args.device == "cuda" else 0
    default = ["cuda_ipc" if shared else "nccl", "object_store"] if args.device == "cuda" else ["gloo", "object_store"]
    transports = args.transports or default
    if shared and "nccl" in transports:
        raise SystemExit("nccl needs one GPU per actor (NCCL refuses two ranks on one device); use cuda_ipc")
    layers, heads, dim = SHAPES[args.shape]
    per_token = layers * 2 * heads * dim * DTYPES[args.dtype].itemsize
    peer = None
    if args.device == "cuda":  # before the actors take the GPUs
        peer = ray.get(ray.remote(num_gpus=min(2, int(ray.cluster_resources().get("GPU", 1))))(
            _peer_copy_GBps).remote(max(args.tokens) * per_token, args.repeats))
    Side = ray.remote(num_gpus=num_gpus, num_cpus=1)(_Side)
    sender, receiver = (Side.remote(SHAPES[args.shape], args.dtype, args.block_size, max_blocks + 64, args.device,
                                    tuple(transports)) for _ in range(2))
    collectives = [t for t in transports if t in ("nccl", "gloo")]
    if len(collectives) > 1:
        raise SystemExit("one of nccl / gloo per run (each actor joins one transfer group)")
    if collectives:
        address, port = ray.get(sender.address.remote())
        ray.get([sender.join.remote(collectives[0], address, port, 0), receiver.join.remote(collectives[0], address, port, 1)])
    chunk_blocks = max(1, int(args.transfer_buffer_gib * 2**30) // (args.block_size * per_token))
    ceilings = ray.get(sender.ceilings.remote(max(args.tokens) * per_token, args.repeats))
    ceilings["peer_copy_GBps"] = peer
    ray.get(sender.export.remote(1, 1))
    tiny = {t: _timed_transfer(sender, receiver, 1, t, args.repeats, chunk_blocks) for t in transports}  # ~latency
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows):
        rev = args.git_rev or git_revision()[0]
        out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "git_rev": rev,
                                   "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                                   "args": vars(args), "host": platform.node(), "ray": ray.__version__,
                                   "torch": torch.__version__, "gpus": gpus, "shared_gpu": shared,
                                   "ceilings": ceilings, "rows": rows}, indent=1))

    save(rows)
    print(f"{args.shape} {args.dtype} bs={args.block_size} on {args.device}: {per_token} B of KV per token; "
          + ", ".join(f"{k} {v:.1f}" for k, v in ceilings.items() if v is not None) + " GB/s")
    print(f"{'tokens':>7} {'MiB':>8} {'transport':>12} {'export ms':>10} {'xfer ms':>9} {'GB/s':>7} "
          f"{'GB/s-lat':>9} {'import ms':>10} {'vs copy':>8} {'vs peer':>8}")
    for tokens in args.tokens:
        n = -(-tokens // args.block_size)
        nbytes = n * args.block_size * per_token
        export_s = ray.get(sender.export.remote(n, args.repeats))
        ray.get(receiver.export.remote(n, 1))  # gives the receiver a payload of this size to scatter
        import_s = ray.get(receiver.import_time.remote(n, args.repeats))
        for transport in transports:
            t = _timed_transfer(sender, receiver, n, transport, args.repeats, chunk_blocks)
            gbps = nbytes / t / 1e9
            # latency-corrected only where the payload dominates the call (else the difference is noise)
            gbps_net = nbytes / (t - tiny[transport]) / 1e9 if t > 2 * tiny[transport] else gbps
            row = {"tokens": tokens, "blocks": n, "bytes": nbytes, "transport": transport, "export_s": export_s,
                   "transfer_s": t, "latency_s": tiny[transport], "import_s": import_s, "GBps": gbps,
                   "GBps_minus_latency": gbps_net,
                   "vs_device_copy": gbps_net / ceilings["device_copy_GBps"],
                   "vs_peer_copy": gbps_net / peer if peer else None}
            rows.append(row)
            save(rows)  # after every row: a run cut short keeps what it measured
            vs_peer = f"{row['vs_peer_copy']:8.3f}" if peer else f"{'-':>8}"
            print(f"{tokens:7d} {nbytes / 2**20:8.1f} {transport:>12} {export_s * 1e3:10.2f} {t * 1e3:9.2f} "
                  f"{gbps:7.2f} {gbps_net:9.2f} {import_s * 1e3:10.2f} {row['vs_device_copy']:8.3f} {vs_peer}")
    print(f"wrote {out}")
    ray.shutdown()


if __name__ == "__main__":
    main()
