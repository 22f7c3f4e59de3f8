"""Resolve a model name, load its config and tokenizer, and build the model with real or dummy weights.

A model is named by one of: the default model (``"SmolLM2-135M-Instruct"``, ``"default"`` or
``"smollm2"``, any case; converted once, see :mod:`rayinfer.model.default_model`), Gemma-3-270M
(``"gemma-3-270m"`` or ``"gemma3"``; converted the same way), a local Hugging
Face-format directory (config.json + *.safetensors), or a built-in shape of
:mod:`rayinfer.model.shapes` (``load_format="dummy"`` only). Only local paths ever reach transformers,
so nothing is fetched from a model hub.
"""

from __future__ import annotations

import contextlib
import difflib
import json
from pathlib import Path

import torch
import transformers
from torch import nn

from rayinfer.kernels.block_fp8 import FP8_DTYPE, quantize_block_fp8
from rayinfer.model.default_model import DEFAULT_MODEL, GEMMA3_270M, ensure_default_model, ensure_gguf_model
from rayinfer.model.quantization import SCALE_SUFFIX, quantize_linears, resolve_quantization
from rayinfer.model.registry import ARCHITECTURES, get_model_class
from rayinfer.model.shapes import SHAPES, shape_config, shape_name

DEFAULT_ALIASES = (DEFAULT_MODEL.lower(), "default", "smollm2")
GEMMA3_ALIASES = (GEMMA3_270M.name, "gemma3-270m", "gemma3")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def resolve_model(name_or_path: str | Path) -> Path | str:
    """Map a model name to a local directory (converting the default model on first use) or a shape name.

    Returns:
        the model directory (a Path holding config.json), or the key of a built-in shape
        (:func:`~rayinfer.model.shapes.shape_name`: ``llama3-8b`` is ``llama-3-8b``).
    Raises:
        ValueError: for anything else; the message lists what is accepted.
    """
    name = str(name_or_path)
    if name.lower() in DEFAULT_ALIASES:
        return ensure_default_model()
    if name.lower() in GEMMA3_ALIASES:
        return ensure_gguf_model(GEMMA3_270M)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory '{name}' has no config.json")
        return path
    shape = shape_name(name)
    if shape is not None:
        return shape
    known = [m.lower() for m in (DEFAULT_MODEL, GEMMA3_270M.name, *DEFAULT_ALIASES, *GEMMA3_ALIASES, *SHAPES)]
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.75)
    raise ValueError(
        f"unknown model '{name}'{f' (did you mean {close[0]!r}?)' if close else ''}: known models are "
        f"{DEFAULT_MODEL!r} (also 'smollm2', 'default'), "
        f"{GEMMA3_270M.name!r} (also 'gemma3') and the "
        f"built-in shapes, which load random weights (load_format='dummy'): {sorted(SHAPES)}; or give a Hugging Face-format directory "
        "with config.json and *.safetensors"
    )


def load_config(model: str | Path) -> transformers.PretrainedConfig:
    """The Hugging Face config of ``model`` (see :func:`resolve_model`; raises its ValueError)."""
    resolved = resolve_model(model)
    if isinstance(resolved, str):
        return shape_config(resolved)
    return transformers.AutoConfig.from_pretrained(resolved, local_files_only=True)


def check_quantization(config: transformers.PretrainedConfig, quantization: str | None):
    """:func:`~rayinfer.model.quantization.resolve_quantization` for ``config``'s architecture, refusing
    block fp8 where the architecture has no fp8 layers (jobs call it before any work).

    Returns: the block config, or None for the model dtype.
    Raises: ValueError for an unknown ``quantization``, an unsupported checkpoint ``quantization_config``,
        an unknown architecture, or fp8 on an architecture without fp8 layers (naming the supported ones)."""
    block_fp8 = resolve_quantization(quantization, config)
    if block_fp8 is not None:
        arch = (getattr(config, "architectures", None) or ["(none)"])[0]
        if not getattr(get_model_class(arch), "supports_block_fp8", False):
            supported = sorted(a for a in ARCHITECTURES if getattr(get_model_class(a), "supports_block_fp8", False))
            raise ValueError(f"model.quantization: {arch} has no fp8 block-quantized layers (quantization='fp8' or a "
                             f"checkpoint quantization_config); architectures with them: {supported}")
    return block_fp8


def check_deployment(config: transformers.PretrainedConfig, quantization: str | None, ep: int = 1):
    """What the jobs check of a model before any work (before Ray starts): :func:`check_quantization`, and with
    expert parallelism (``ep`` > 1) that the model has routed experts (:func:`rayinfer.model.moe.moe_shape`).

    Returns: :func:`check_quantization`'s block config, or None for the model dtype.
    Raises: ValueError from either check."""
    block_fp8 = check_quantization(config, quantization)
    if ep > 1:
        from rayinfer.model.moe import moe_shape

        moe_shape(config)
    return block_fp8


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """Turn "float32" / "bfloat16" / "float16" (or fp32/bf16/fp16, or a torch.dtype) into a torch.dtype.

    "auto" is float32 on CPU and bfloat16 on CUDA; with no device, CUDA counts when one is available.

    Raises:
        ValueError: naming ``dtype`` for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of float32, bfloat16, float16, got {dtype}")
        return dtype
    if dtype == "auto":
        kind = torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.bfloat16 if kind == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of 'auto', {', '.join(repr(k) for k in _DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def load_model(
    model: str | Path,
    dtype: str | torch.dtype,
    device: str | torch.device,
    load_format: str = "auto",
    seed: int = 0,
    model_kwargs: dict | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """Build the model class registered for ``model``'s architecture and fill its weights.

    Parameters are created on the meta device, then allocated once on ``device`` in ``dtype`` (so a large
    shape never materializes in float32 on the host); buffers such as RoPE's inv_freq stay float32.

    Args:
        model: a name or directory, see :func:`resolve_model`.
        dtype: parameter dtype (see :func:`parse_dtype`).
        device: where the parameters live.
        load_format: "auto" / "safetensors" (the directory's *.safetensors, shards included) or "dummy"
            (random weights: N(0, initializer_range or 0.02) for matrices, 1 for norms, 0 for biases).
        seed: seed of dummy weights.
        model_kwargs: extra keyword arguments of the model class, e.g. ``{"ep": ExpertParallelism(...)}``
            for an expert-parallel rank of a MoE model (dummy weights then equal the one-process model's).
        quantization: the linear layers' and routed experts' weights (``ModelConfig.quantization``,
            :func:`rayinfer.model.quantization.resolve_quantization`): None as the checkpoint's
            ``quantization_config`` says, "fp8" 128 x 128 fp8 blocks (a 16/32-bit checkpoint or dummy
            weights quantized as they load), "none" the model dtype (an fp8 checkpoint dequantized).
            Quantized layers hold float8_e4m3fn weights and float32 ``weight_scale_inv``.
    Returns:
        the model in eval mode with ``requires_grad=False`` parameters; ``model.config`` is its HF config.
    Raises:
        ValueError: for a bad ``load_format``, ``dtype`` or ``quantization`` (naming the field), an unknown
            model or architecture, a shape without ``load_format="dummy"``, an unsupported
            ``quantization_config`` (naming its field) or fp8 on a model without fp8 layers, or checkpoint
            keys or shapes that do not match the model (missing, unexpected, mis-shaped).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    device = torch.device(device)
    dtype = parse_dtype(dtype, device)
    resolved = resolve_model(model)
    if isinstance(resolved, str) and load_format != "dummy":
        raise ValueError(f"model '{model}' is a built-in shape without weights: use load_format='dummy'")
    config = load_config(resolved)
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch is None:
        raise ValueError(f"config of model '{model}' names no architectures")
    block_fp8 = check_quantization(config, quantization)
    with _params_on_meta():
        net = get_model_class(arch)(config, **(model_kwargs or {}))
    if block_fp8 is not None:
        quantize_linears(net, block_fp8)
    _materialize(net, dtype, device)
    with torch.no_grad():
        if load_format == "dummy":
            _init_dummy(net, getattr(config, "initializer_range", None) or 0.02, seed, device, dtype)
        else:
            _load_safetensors(net, resolved)
        # a model's own layout changes once its weights are in (e.g. DeepSeek's fused shared experts)
        post_load = getattr(net, "process_weights_after_loading", None)
        if post_load is not None:
            post_load()
    return net.eval()


def _local_tokenizer(path: Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer in ``path``, from local files. Where its tokenizer_config.json names
    ``PreTrainedTokenizerFast`` (the default model's does), that class is loaded directly: the class
    ``AutoTokenizer`` would pick, without its look-up over every model type (about 2 s of each engine process's
    start on a small CPU). No length warning from transformers at tokenization: the engine checks prompts against
    max_model_len and rejects a too-long one with its own error."""
    try:
        named = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    cls = transformers.PreTrainedTokenizerFast if named == "PreTrainedTokenizerFast" else transformers.AutoTokenizer
    return cls.from_pretrained(path, local_files_only=True,
                               model_max_length=transformers.tokenization_utils_base.VERY_LARGE_INTEGER)


def load_tokenizer(model: str | Path) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of ``model`` from local files; a model without one borrows the default model's.

    Raises:
        ValueError: for an unknown model, or one without a tokenizer whose vocab_size is smaller than the
            default tokenizer's (its token ids would fall outside the embedding).
    """
    resolved = resolve_model(model)
    if isinstance(resolved, Path) and any((resolved / f).is_file() for f in _TOKENIZER_FILES):
        return _local_tokenizer(resolved)
    config = load_config(resolved)
    vocab_size = getattr(config, "text_config", config).vocab_size  # a vision-language model: its decoder's
    tok = _local_tokenizer(ensure_default_model())
    if len(tok) > vocab_size:
        raise ValueError(f"model '{model}' has no tokenizer, and the default one ({len(tok)} tokens) does not "
                         f"fit its vocab_size {vocab_size}")
    return tok


@contextlib.contextmanager
def _params_on_meta():
    """Register every new parameter on the meta device; buffers stay real (after accelerate's
    ``init_empty_weights(include_buffers=False)``)."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        if param is not None and param.device.type != "meta":  # a meta param is kept: weight tying
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(net: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Allocate the meta parameters on ``device`` (floats in ``dtype``, tied ones once); move buffers.

    Block-fp8 parameters keep their dtypes: fp8 weights stay float8_e4m3fn, ``weight_scale_inv`` float32.
    """
    allocated: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(meta) -> (meta kept alive, real)
    for module in net.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in allocated:
                keep = not p.is_floating_point() or p.dtype == FP8_DTYPE or name.endswith("scale_inv")
                real = torch.empty(p.shape, dtype=p.dtype if keep else dtype, device=device)
                allocated[id(p)] = (p, nn.Parameter(real, requires_grad=False))
            module._parameters[name] = allocated[id(p)][1]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = b.to(device)


def _init_dummy(net: nn.Module, std: float, seed: int, device: torch.device, dtype: torch.dtype) -> None:
    """Random weights (see :func:`load_model`), drawn in parameter order from one seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    # Routed experts are drawn for all logical experts and sliced, so that every expert-parallel rank
    # (which holds only some slots, maybe replicas) gets the one-process model's weights.
    experts = {name: m for name, m in net.named_modules() if hasattr(m, "load_stacked")}
    params = dict(net.named_parameters())
    for name, p in net.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if leaf.endswith("scale_inv"):  # filled with its fp8 weight
            continue
        if owner in experts:
            # fp8 experts: drawn in the model dtype (the unquantized model's stream), quantized by load_stacked
            full = torch.empty((experts[owner].num_logical_experts, *p.shape[1:]),
                               dtype=dtype if p.dtype == FP8_DTYPE else p.dtype, device=device)
            experts[owner].load_stacked(leaf, full.normal_(0.0, std, generator=gen))
        elif p.dtype == FP8_DTYPE:
            # drawn in the model dtype as an unquantized model's, then quantized: realistic fp8 blocks, and
            # the same random stream (a quantized dummy model is the dummy model quantized)
            w = torch.empty(p.shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
            q, scale_inv = quantize_block_fp8(w)
            p.copy_(q)
            params[f"{owner}.{SCALE_SUFFIX}"].copy_(scale_inv)
        elif p.ndim == 1 and "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a directory: those of the shard index, else model.safetensors, else all."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory '{path}' has no *.safetensors weights (load_format='dummy' needs none)")
    return files


def _load_safetensors(net: nn.Module, path: Path) -> None:
    """Copy every checkpoint tensor into the same-named parameter or persistent buffer, strictly."""
    from safetensors import safe_open

    if hasattr(net, "load_weights"):  # models whose checkpoint names differ (per-expert MoE weights, MTP)
        def named_tensors():
            for file in _checkpoint_files(path):
                with safe_open(str(file), framework="pt") as f:
                    for key in f.keys():
                        yield key, f.get_tensor(key)

        try:
            loaded_names = net.load_weights(named_tensors())
        except KeyError as e:
            raise ValueError(f"checkpoint in '{path}' has unexpected weights: {e.args[0]}") from None
        missing = sorted(set(net.state_dict()) - set(loaded_names))
        if missing:
            raise ValueError(f"checkpoint in '{path}' does not match {type(net).__name__}: missing "
                             f"{missing[:8]} ({len(missing)})")
        return
    targets = net.state_dict(keep_vars=True)  # tied names appear under each name, sharing one tensor
    loaded: set[int] = set()
    unexpected: list[str] = []
    for file in _checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("inv_freq"):  # RoPE tables are recomputed from the config
                    continue
                if key not in targets:
                    unexpected.append(key)
                    continue
                tensor, target = f.get_tensor(key), targets[key]
                if tensor.shape != target.shape:
                    raise ValueError(f"weight {key!r} in {file.name} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(target.shape)}")
                target.copy_(tensor)
                loaded.add(id(target))
    missing = [k for k, t in targets.items() if id(t) not in loaded]
    if missing or unexpected:
        raise ValueError(f"checkpoint in '{path}' does not match {type(net).__name__}: "
                         f"missing {missing[:8]} ({len(missing)}), unexpected {unexpected[:8]} ({len(unexpected)})")
