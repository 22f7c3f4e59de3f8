"""FP8 block-quantized dense linear layers of a model: the checkpoint's ``quantization_config``, turning a
built model's linear weights into fp8 blocks, adapting checkpoint tensors to them, and the one
dispatch the models' call sites use (:func:`linear`).

Format and GEMM: :mod:`rayinfer.kernels.block_fp8` (DeepSeek-V3's 128 x 128 blocks). A quantized
``nn.Linear`` holds ``weight`` float8_e4m3fn [N, K] and ``weight_scale_inv`` float32 [ceil(N/128),
ceil(K/128)], the checkpoint names. Quantized: every ``nn.Linear`` of a model that declares
``supports_block_fp8`` except the LM head, routers (``gate``) and the linears the model names in
``block_fp8_dequantized`` (DeepSeek-V3's ``kv_b_proj``, whose weight MLA reads directly), and the
routed experts (``RoutedExperts.quantize_fp8``: stacked fp8 weights with per-expert block scales, which
the fused MoE kernel dequantizes in its GEMMs); embeddings and norms stay in the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayinfer.engine.config import QUANTIZATIONS  # None, "fp8", "none": ModelConfig.quantization
from rayinfer.kernels.block_fp8 import (
    FP8_DTYPE,
    WEIGHT_BLOCK,
    block_fp8_dequant_ref,
    quantize_block_fp8,
    scale_shape,
)
from rayinfer.kernels.gemv import fused_linear
from rayinfer.kernels.matmul import dense_linear

SCALE_SUFFIX = "weight_scale_inv"
_SKIPPED_LINEARS = ("lm_head", "gate")  # the LM head stays 16-bit; a router's logits pick the experts


@dataclass(frozen=True)
class BlockFp8Config:
    """FP8 (e4m3) weights with one float32 scale per ``weight_block_size`` block (rows N, columns K)."""

    weight_block_size: tuple[int, int] = WEIGHT_BLOCK


def parse_quantization_config(quant_config: Mapping[str, Any] | Any | None) -> BlockFp8Config | None:
    """The block-fp8 config of a Hugging Face ``quantization_config`` (config.json), None without one.

    Accepted: ``quant_method "fp8"``, ``fmt "e4m3"`` (or absent), ``activation_scheme "dynamic"`` (or
    absent: activations stay 16-bit here either way) and ``weight_block_size [128, 128]``, as DeepSeek-V3
    ships it.

    Raises:
        ValueError: naming the field, for any other method, format, activation scheme or block size
            (``weight_block_size`` absent is per-tensor fp8, not supported).
    """
    if quant_config is None:
        return None
    if not isinstance(quant_config, Mapping):  # a transformers QuantizationConfigMixin
        quant_config = quant_config.to_dict()
    method = quant_config.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported (only 'fp8' with "
                         f"weight_block_size [128, 128])")
    fmt = quant_config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    scheme = quant_config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not supported (only 'dynamic')")
    block = quant_config.get("weight_block_size")
    if block is None or tuple(block) != WEIGHT_BLOCK:
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported (only "
                         f"{list(WEIGHT_BLOCK)})")
    return BlockFp8Config(tuple(block))


def resolve_quantization(quantization: str | None, hf_config) -> BlockFp8Config | None:
    """How to hold a model's linear weights, from ``ModelConfig.quantization`` and its HF config.

    Args:
        quantization: None (as the checkpoint's ``quantization_config`` says: none, or block fp8),
            "fp8" (128 x 128 fp8 blocks; a 16/32-bit checkpoint or dummy weights are quantized as they
            load) or "none" (the model dtype; an fp8 checkpoint is dequantized as it loads).
        hf_config: the model's Hugging Face config.
    Returns:
        the block config, or None for the model dtype.
    Raises:
        ValueError: for an unknown ``quantization`` or a checkpoint ``quantization_config`` that
            :func:`parse_quantization_config` rejects (also with "fp8" or "none": the checkpoint's
            tensors must be readable).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    from_checkpoint = parse_quantization_config(getattr(hf_config, "quantization_config", None))
    if quantization == "none":
        return None
    return BlockFp8Config() if quantization == "fp8" else from_checkpoint


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules of ``model`` that block fp8 quantizes (see the module docstring), by name."""
    skipped = set(_SKIPPED_LINEARS) | set(getattr(model, "block_fp8_dequantized", ()))
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rpartition(".")[2] not in skipped}


def quantize_linears(model: nn.Module, config: BlockFp8Config) -> list[str]:
    """Turn each quantizable linear's ``weight`` into float8_e4m3fn and register its ``weight_scale_inv``;
    the routed experts likewise (``RoutedExperts.quantize_fp8``).

    On meta parameters (a model built under the loader's ``_params_on_meta``, before materialization)
    the new ones are meta too, to be allocated and filled by the loader; real weights are quantized
    (:func:`~rayinfer.kernels.block_fp8.quantize_block_fp8`).

    Args:
        model: a model whose class sets ``supports_block_fp8`` (its call sites use :func:`linear`).
        config: the block size (128 x 128).
    Returns:
        the names of the quantized modules.
    Raises:
        ValueError: for a model without ``supports_block_fp8``.
    """
    if not getattr(model, "supports_block_fp8", False):
        raise ValueError(f"{type(model).__name__} does not support fp8 block-quantized weights "
                         "(quantization='fp8' or a checkpoint quantization_config); supported: DeepSeek-V3, Qwen3-MoE")
    block = config.weight_block_size
    names = []
    from rayinfer.model.moe import RoutedExperts  # model.moe imports this module

    for name, experts in model.named_modules():
        if isinstance(experts, RoutedExperts):
            experts.quantize_fp8()
            names.append(name)
    for name, layer in quantizable_linears(model).items():
        w = layer.weight
        if w.is_meta:
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device="meta")
            s = torch.empty(scale_shape(w.shape, block), dtype=torch.float32, device="meta")
        else:
            q, s = quantize_block_fp8(w.detach(), block)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.register_parameter(SCALE_SUFFIX, nn.Parameter(s, requires_grad=False))
        names.append(name)
    return names


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """The model's linear layer: :func:`~rayinfer.kernels.block_fp8.block_fp8_linear` when ``layer``
    carries ``weight_scale_inv`` (one row on a GPU: the fp8 GEMV, ``kernels.gemv.fused_linear``), else :func:`~rayinfer.kernels.matmul.dense_linear` (batch-invariant
    mode included).

    x: [..., K]; layer: an ``nn.Linear`` [N, K] (fp8 + scales, or x's dtype). Returns [..., N], x's dtype.
    """
    scale_inv = layer._parameters.get(SCALE_SUFFIX)  # a dict lookup: Module.__getattr__ costs more per call
    if scale_inv is None:
        return dense_linear(x, layer.weight, layer.bias)
    # one row on a GPU: the GEMV streams the fp8 weight; otherwise fused_linear runs block_fp8_linear
    y = fused_linear(x.reshape(-1, x.shape[-1]), layer.weight, layer.bias, weight_scale=scale_inv)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def adapt_checkpoint(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     params: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors in the form the model's parameters hold them (fp8 blocks or the model dtype).

    1. A weight whose parameter is float8_e4m3fn: an fp8 checkpoint tensor passes; a 16/32-bit one is
       quantized (yielded with its ``weight_scale_inv``: online quantization of a bf16 checkpoint).
    2. An fp8 weight whose parameter is not fp8 (``kv_b_proj``, or ``quantization="none"``) waits for
       its ``weight_scale_inv`` (either may come first) and is yielded dequantized to the parameter's
       dtype, once; that scale is not a parameter and is not yielded.
    3. Everything else passes unchanged (stacked expert tensors too: ``RoutedExperts.load_stacked``
       quantizes those itself).

    Args:
        named_tensors: (checkpoint name, tensor) pairs.
        params: the model's parameters by name (the targets; ``MoEModelMixin.load_weights`` adds the
            per-expert checkpoint names, each standing for its experts' stacked parameter).
    Yields:
        (name, tensor) pairs to copy into ``params``.
    Raises:
        ValueError: an fp8 weight or a scale left without its partner at the end, or an fp8 dtype other
            than float8_e4m3fn for a linear weight.
    """
    weights: dict[str, torch.Tensor] = {}  # case 2: fp8 weights waiting for their scale, by weight name
    scales: dict[str, torch.Tensor] = {}  # ... and scales waiting for their weight
    for name, tensor in named_tensors:
        if name.endswith(SCALE_SUFFIX) and name not in params:
            weight_name = name[: -len(SCALE_SUFFIX)] + "weight"
            target = params.get(weight_name)
            if target is None or target.dtype == FP8_DTYPE:
                yield name, tensor
            elif weight_name in weights:
                yield weight_name, block_fp8_dequant_ref(weights.pop(weight_name), tensor, target.dtype)
            else:
                scales[weight_name] = tensor
            continue
        target = params.get(name) if name.endswith(".weight") else None  # stacked experts: load_stacked's
        is_fp8 = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
        if target is None or not (is_fp8 or target.dtype == FP8_DTYPE):
            yield name, tensor
        elif is_fp8 and tensor.dtype != FP8_DTYPE:
            raise ValueError(f"{name}: {tensor.dtype} weights are not supported (only float8_e4m3fn)")
        elif target.dtype == FP8_DTYPE and not is_fp8:
            q, s = quantize_block_fp8(tensor.to(target.device))
            yield name, q
            yield name[: -len("weight")] + SCALE_SUFFIX, s
        elif target.dtype == FP8_DTYPE:
            yield name, tensor
        elif name in scales:
            yield name, block_fp8_dequant_ref(tensor, scales.pop(name), target.dtype)
        else:
            weights[name] = tensor
    if weights or scales:
        what = "expert" if any(".experts." in n for n in [*weights, *scales]) else "checkpoint"
        raise ValueError(f"fp8 {what} weights without their {SCALE_SUFFIX}: {sorted(weights)[:4]}; "
                         f"{SCALE_SUFFIX} without their fp8 weight: {sorted(scales)[:4]}")
