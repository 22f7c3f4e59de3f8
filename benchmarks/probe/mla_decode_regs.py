"""Probe (no GPU needed): registers, spills and shared memory of the MLA decode kernel per tile set, compiled for
a Hopper target by Triton on any machine (``triton.compile`` with ``GPUTarget("cuda", 90, 32)``) and read from the
cubin with the ptxas tools Triton ships (``cuobjdump -res-usage``). STACK is the spilled bytes a thread.

    PYTHONPATH=. python benchmarks/probe/mla_decode_regs.py            # V2-Lite's shape: 16 heads, 512 + 64
    PYTHONPATH=. python benchmarks/probe/mla_decode_regs.py --arch 100  # another target

The numbers come from this machine's Triton, which may allocate differently from the GPU machine's.
"""
import argparse
import os
import subprocess
import tempfile

import triton
import triton.backends.nvidia as nvidia_backend
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rayinfer.kernels.mla_attention import _mla_decode_kernel

POINTERS = {"ql_ptr": "*bf16", "qp_ptr": "*bf16", "cache_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32"}
# (block_n, num_stages, prefetch_index, num_warps, swap_ab): the default first
TILE_SETS = [(32, 3, True, 4, False), (32, 2, False, 4, False), (16, 3, True, 4, False), (32, 3, True, 8, False),
             (64, 2, True, 4, False), (64, 2, False, 4, False), (64, 2, True, 8, False), (32, 3, True, 4, True)]


def resource_usage(cubin: bytes) -> str:
    """The ``REG:... STACK:... SHARED:...`` line of ``cuobjdump -res-usage`` for a one-kernel cubin."""
    tool = os.path.join(os.path.dirname(nvidia_backend.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    return next((line.strip() for line in out.splitlines() if "REG:" in line), out.strip())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 of the target")
    ap.add_argument("--rank", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--heads", type=int, default=16, help="BLOCK_H")
    args = ap.parse_args()
    names = _mla_decode_kernel.arg_names
    for block_n, stages, ahead, warps, swap in TILE_SETS:
        constexprs = dict(RANK=args.rank, ROPE=args.rope, BLOCK_R=triton.next_power_of_2(args.rank),
                          BLOCK_P=max(16, triton.next_power_of_2(args.rope)), BLOCK_H=args.heads, BLOCK_N=block_n,
                          KV_BLOCK_SIZE=16, IEEE=False, ROWWISE=False, USE_SPLITS=True, MIN_SPLIT_TOKENS=64,
                          USE_PDL=False, SWAP_AB=swap, SWAP_BLOCK_N=64, SWAP_MIN_KEYS=0, PREFETCH_INDEX=ahead)
        signature = {n: POINTERS.get(n, "constexpr" if n in constexprs else "fp32" if n == "qk_scale" else "i32")
                     for n in names}
        src = ASTSource(fn=_mla_decode_kernel, signature=signature,
                        constexprs={(names.index(k),): v for k, v in constexprs.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", args.arch, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        print(f"block_n={block_n} stages={stages} prefetch_index={ahead} warps={warps} swap_ab={swap}: "
              f"triton shared {kernel.metadata.shared} B | {resource_usage(kernel.asm['cubin'])}", flush=True)


if __name__ == "__main__":
    main()
