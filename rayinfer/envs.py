"""Environment variables of rayinfer, each read here (and only here) through a typed getter.

Variables:
    RAYINFER_CACHE_DIR: root of rayinfer's caches (converted models live under ``<root>/models``);
        default ``platformdirs.user_cache_dir("rayinfer")``.
    RAYINFER_PDL: "0" turns off programmatic dependent launch of the Triton kernels (on by default
        where the GPU and Triton support it; see ``kernels._triton_utils.use_pdl``).
    RAY_ADDRESS: the Ray cluster the entry points join (``rayinfer.actors.cluster.init_ray``); unset: a
        cluster ``ray start`` left on this machine, else an embedded one.
    RAY_JOB_CONFIG_JSON_ENV_VAR: set by Ray in a job started with ``ray job submit``; its runtime env's
        ``working_dir`` says that the job runs in Ray's temporary copy of the submitted directory
        (``rayinfer.jobs.generate`` then warns about relative output paths).
    RAYINFER_ONE_ROW_FUSION: "0" runs a one-token Llama or DeepSeek-V3 step through the generic layer
        instead of the fused-GEMV one (``model.llama.LlamaDecoderLayer.forward_one_row``,
        ``model.deepseek_v3.DeepseekV3DecoderLayer.forward_one_row``); for A/B benchmarks.
    RAYINFER_FUSE_SHARED_EXPERTS: "0" keeps DeepSeek's shared experts as a separate MLP instead of extra
        experts of the fused MoE kernel (``model.moe.RoutedExperts.fuse_shared_experts``); for A/B benchmarks.
    RAYINFER_EP_FUSED_DISPATCH: "0" runs the expert-parallel dispatch and combine as torch ops instead of the
        Triton kernels of ``kernels.ep_dispatch`` (A/B runs).
    RAYINFER_MLA_BACKEND: "triton" (default), "tilelang" or "auto": the kernel of MLA's absorbed decode
        attention on the GPU (``kernels.mla_attention.mla_decode``); "tilelang" needs the tilelang package;
        "auto" takes TileLang's keys-as-rows tiles for steps of at least 64 tokens
        (``kernels.mla_attention.TILELANG_FROM_TOKENS``) where they apply (tilelang importable, 16 or 32 heads,
        cache blocks of a multiple of 64, e.g. ``engine.block_size=64``) and Triton otherwise.
    RAYINFER_MOE_GROUPED_MM_FROM: token count from which the fused MoE layer runs on torch's grouped GEMM
        (``kernels.fused_moe.fused_moe_grouped_mm``); "0" never; unset: the device table's value for the
        layer's shape (``kernels.fused_moe_config.grouped_mm_from``). For A/B runs.
    RAYINFER_DRAFT_CATCH_UP_LEN: query length of the draft model's catch-up graphs on CUDA (default 32; "0":
        none, a catch-up longer than a verification's runs as one eager forward),
        ``engine.spec_decode.DraftModelProposer``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root directory of rayinfer's on-disk caches (not created here)."""
    value = os.environ.get("RAYINFER_CACHE_DIR")
    if value:
        return Path(value).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rayinfer"))


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() not in ("0", "false", "no", "off")


def pdl_enabled() -> bool:
    """RAYINFER_PDL (default on): whether Triton kernels may use programmatic dependent launch."""
    return _flag("RAYINFER_PDL", True)


def one_row_fusion() -> bool:
    """RAYINFER_ONE_ROW_FUSION (default on): whether a one-token Llama / DeepSeek-V3 step takes the fused-GEMV layers."""
    return _flag("RAYINFER_ONE_ROW_FUSION", True)


def ep_fused_dispatch() -> bool:
    """RAYINFER_EP_FUSED_DISPATCH (default on): whether the expert-parallel dispatch and combine take the Triton
    kernels (``kernels.ep_dispatch``) on CUDA; "0" keeps the torch path (A/B runs)."""
    return _flag("RAYINFER_EP_FUSED_DISPATCH", True)


def side_stream_copies() -> bool:
    """RAYINFER_SIDE_STREAM_COPIES (default off: the GPU measurements disagree, benchmarks/README.md twentieth
    round): whether a CUDA step's input upload and its sampled tokens' download run on streams of their own
    (``engine.model_runner``), out of the compute stream's way, instead of between two steps' kernels."""
    return _flag("RAYINFER_SIDE_STREAM_COPIES", False)


def fused_graph_inputs() -> bool:
    """RAYINFER_FUSED_GRAPH_INPUTS (default off: the GPU measurements disagree, benchmarks/README.md twentieth
    round): whether a CUDA graph replay's inputs go into the graph's buffers in one launch
    (``kernels.graph_inputs.fill_graph_inputs``) instead of 6-8 torch ops; read once, at import of
    ``engine.cuda_graph`` (its ``FUSED_INPUTS``)."""
    return _flag("RAYINFER_FUSED_GRAPH_INPUTS", False)


def fuse_shared_experts() -> bool:
    """RAYINFER_FUSE_SHARED_EXPERTS (default on): whether DeepSeek's shared experts join the fused MoE kernel."""
    return _flag("RAYINFER_FUSE_SHARED_EXPERTS", True)


def ray_address() -> str | None:
    """RAY_ADDRESS, or None when unset or empty."""
    return os.environ.get("RAY_ADDRESS") or None


def ray_job_working_dir() -> str | None:
    """The ``working_dir`` of the ``ray job submit`` job this process is (None outside such a job, or
    when the job has no working dir); read from Ray's RAY_JOB_CONFIG_JSON_ENV_VAR."""
    value = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not value:
        return None
    try:
        runtime_env = json.loads(value).get("runtime_env") or {}
    except (ValueError, AttributeError):
        return None
    working_dir = runtime_env.get("working_dir") if isinstance(runtime_env, dict) else None
    return str(working_dir) if working_dir else None


def mla_backend() -> str:
    """RAYINFER_MLA_BACKEND, lower-cased: "triton" (default), "tilelang" or "auto".

    Raises:
        ValueError: for any other value.
    """
    value = (os.environ.get("RAYINFER_MLA_BACKEND") or "triton").strip().lower()
    if value not in ("triton", "tilelang", "auto"):
        raise ValueError(f"RAYINFER_MLA_BACKEND must be 'triton', 'tilelang' or 'auto', got {value!r}")
    return value


def moe_grouped_mm_from() -> int:
    """RAYINFER_MOE_GROUPED_MM_FROM as an int >= 0, or -1 when unset or empty (the device table decides).

    Raises:
        ValueError: for a value that is not a non-negative integer.
    """
    value = (os.environ.get("RAYINFER_MOE_GROUPED_MM_FROM") or "").strip()
    if not value:
        return -1
    if not value.isdigit():
        raise ValueError(f"RAYINFER_MOE_GROUPED_MM_FROM must be a non-negative integer, got {value!r}")
    return int(value)


def draft_catch_up_len() -> int:
    """RAYINFER_DRAFT_CATCH_UP_LEN (default 32): tokens a request of the draft model's catch-up graphs (0: none).

    Raises:
        ValueError: for a value that is not a non-negative integer.
    """
    value = (os.environ.get("RAYINFER_DRAFT_CATCH_UP_LEN") or "").strip()
    if not value:
        return 32
    if not value.isdigit():
        raise ValueError(f"RAYINFER_DRAFT_CATCH_UP_LEN must be a non-negative integer, got {value!r}")
    return int(value)


def check() -> None:
    """Read every variable whose getter can refuse a value, so that entry points report a bad one before any
    work (the getters themselves run where the value is used, often inside an actor or on CUDA only).

    Raises:
        ValueError: naming the first variable with a bad value.
    """
    mla_backend()
    moe_grouped_mm_from()
    draft_catch_up_len()
