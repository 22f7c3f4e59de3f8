"""Console scripts ``rayinfer serve`` and ``rayinfer generate`` (``[project.scripts]``): vLLM's common flags,
parsed with argparse and mapped onto the Hydra config that ``jobs/serve.py`` and ``jobs/generate.py`` read
(conf/serve.yaml, conf/generate.yaml), which Hydra's compose API builds. Hydra ``key=value`` overrides
after the flags still apply, and win over a flag for the same key.

    rayinfer serve --model smollm2 --port 8000 --api-key secret --max-num-seqs 64
    rayinfer generate --model qwen3-moe-tiny --parallel ep2 --input prompts.jsonl --output out.jsonl
    rayinfer generate -i batch.jsonl -o results.jsonl engine.num_kv_blocks=512 parallel.dp=2

``--model`` (and a ``model=`` override, here and in the jobs) takes a config of conf/model/ (``smollm2``,
``llama-3-8b``, ``qwen3-moe-tiny``, ...; ``llama3-8b`` names the same config: case, ``-``, ``_`` and ``.``
do not count), else a model name or directory for ``model.model`` (an unknown one fails with exit code 2
and the list of known ones).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent / "conf"

# flag dest -> Hydra key; each is a plain value override (a string value is quoted for Hydra)
_COMMON_KEYS = {
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "load_format": "model.load_format",
    "quantization": "model.quantization",
    "seed": "model.seed",
    "device": "engine.device",
    "max_num_seqs": "engine.max_num_seqs",
    "max_num_batched_tokens": "engine.max_num_batched_tokens",
    "gpu_memory_utilization": "engine.gpu_memory_utilization",
    "data_parallel_size": "parallel.dp",
}
_COMMAND_KEYS = {
    "serve": {"host": "host", "port": "port", "api_key": "api_key", "served_model_name": "served_model_name"},
    "generate": {"input": "input", "output": "output", "input_format": "input_format", "base_dir": "base_dir",
                 "served_model_name": "served_model_name", "max_tokens": "sampling.max_tokens",
                 "temperature": "sampling.temperature", "top_p": "++sampling.top_p"},
}
_STRING_KEYS = {"model.dtype", "model.load_format", "model.quantization", "engine.device", "host", "api_key",
                "served_model_name", "input", "output", "input_format", "base_dir"}


def config_options(group: str) -> list[str]:
    """The options of a Hydra config group: the names of ``conf/<group>/*.yaml``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _canonical(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def model_override(value: str) -> str:
    """The Hydra override that selects model ``value``: ``model=<config>`` when it names a config of
    conf/model/ (case, ``-``, ``_`` and ``.`` ignored: ``llama3-8b`` is ``llama-3-8b``), else
    ``model.model=<value>`` (a model name, shape or directory, checked by the job with a clear error)."""
    by_canonical = {_canonical(o): o for o in config_options("model")}
    option = by_canonical.get(_canonical(value))
    return f"model={option}" if option else f"model.model={hydra_value(value)}"


def normalize_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with every ``model=VALUE`` replaced by :func:`model_override`'s (a sweep's
    ``model=a,b`` is left to Hydra); everything else unchanged.

    Without this, ``model=nope`` fails inside Hydra (exit 1, a traceback-like message) while
    ``model.model=nope`` gets the job's own error (exit 2, the known models listed).
    """
    out = []
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and key == "model" and value and "," not in value and "(" not in value:
            o = model_override(value)
        out.append(o)
    return out


def hydra_value(value: str) -> str:
    """``value`` as a quoted string of Hydra's override grammar (so ``true``, ``123``, ``a b`` or ``$x``
    stay the string given)."""
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)  # backslashes before a quote double
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)  # ... and before the closing quote
    text = text.replace("${", "\\${")  # no interpolation
    return f"'{text}'"


def _closest(name: str, flags: list[str]) -> list[str]:
    """The known flag closest to ``name``: among those it begins (a shortened flag, which the parser refuses),
    else by ``difflib``'s ratio; [] when none is close."""
    starts = [f for f in flags if f.startswith(name)]
    return difflib.get_close_matches(name, starts, n=1, cutoff=0) if starts else difflib.get_close_matches(
        name, flags, n=1)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose error for an unknown flag names the closest known one (``difflib``), as an unknown
    Hydra key's error does (:func:`did_you_mean`)."""

    def error(self, message: str):  # argparse's hook: prints the usage and the message, exits 2
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
            hints = [(name, close[0]) for token in message[len(prefix):].split()
                     if (name := token.split("=", 1)[0]).startswith("--") and (close := _closest(name, flags))]
            if len(hints) == 1:
                message += f" (did you mean {hints[0][1]}?)"
            elif hints:
                message += f" (did you mean {', '.join(f'{known} for {name}' for name, known in hints)}?)"
        super().error(message)


def build_parser(command: str) -> argparse.ArgumentParser:
    """The argparse parser of ``rayinfer <command>`` ("serve" or "generate")."""
    what = {"serve": "Start the OpenAI-compatible service (jobs/serve.py) and serve until Ctrl-C.",
            "generate": "Run the batch job (jobs/generate.py): JSONL in (OpenAI Batch or rayinfer lines), "
                        "one output line per input line."}[command]
    p = _Parser(prog=f"rayinfer {command}", description=what, allow_abbrev=False,
                                epilog="Hydra overrides (key=value) after the flags still apply and win, e.g. "
                                       "engine.num_kv_blocks=512 parallel.pd.kv_transport=gloo.")
    p.add_argument("--model", help=f"a config of conf/model ({', '.join(config_options('model'))}), a model "
                                   "name or a Hugging Face-format directory")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, help="context limit in tokens")
    p.add_argument("--load-format", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--quantization", "-q", choices=["fp8", "none"],
                   help="dense linear weights: fp8 (128x128 blocks, quantized at load) or none (the model dtype); "
                        "default: as the checkpoint says")
    p.add_argument("--seed", type=int, help="seed of dummy weights and of unseeded sampling")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-num-seqs", type=int, help="running requests per replica at most")
    p.add_argument("--max-num-batched-tokens", type=int, help="new tokens per step at most")
    p.add_argument("--gpu-memory-utilization", type=float, help="fraction of the GPU's memory a replica may use")
    p.add_argument("--parallel", choices=config_options("parallel"),
                   help="a topology of conf/parallel (colocated, 1p1d, ep2, ...)")
    p.add_argument("--data-parallel-size", "-dp", type=int, help="colocated replicas (parallel.dp)")
    p.add_argument("--served-model-name", help="the name requests must give as 'model'")
    if command == "serve":
        p.add_argument("--host", help="address of the HTTP proxy (default 127.0.0.1)")
        p.add_argument("--port", type=int, help="port of the HTTP proxy (default 8000)")
        p.add_argument("--api-key", help="require 'Authorization: Bearer <key>'")
    else:
        p.add_argument("--input", "--input-file", "-i", help="input JSONL (default: built-in prompts)")
        p.add_argument("--output", "--output-file", "-o", help="output JSONL (default: <input>.out.jsonl)")
        p.add_argument("--input-format", choices=["auto", "openai", "rayinfer"])
        p.add_argument("--base-dir", help="directory relative paths resolve against (default: the current one)")
        # the defaults of every rayinfer line (a line's own field wins; OpenAI Batch bodies keep their own)
        p.add_argument("--max-tokens", type=int, help="output tokens per line at most (default 256)")
        p.add_argument("--temperature", type=float, help="sampling temperature (default 0: greedy)")
        p.add_argument("--top-p", type=float, help="nucleus sampling probability mass (default 1)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides")
    return p


def to_overrides(command: str, args: argparse.Namespace) -> list[str]:
    """The Hydra overrides of parsed flags: the flags' first, then the positional ones (normalized, see
    :func:`normalize_overrides`); a flag whose key a positional override sets is dropped, so the
    override wins."""
    flags: list[tuple[str, str]] = []
    if args.model is not None:
        key, _, value = model_override(args.model).partition("=")
        flags.append((key, value))
    if args.parallel is not None:
        flags.append(("parallel", args.parallel))
    for dest, key in {**_COMMON_KEYS, **_COMMAND_KEYS[command]}.items():
        value = getattr(args, dest, None)
        if value is not None:
            flags.append((key, hydra_value(str(value)) if key in _STRING_KEYS else str(value)))
    positional = normalize_overrides(list(args.overrides))
    given = {o.partition("=")[0].lstrip("+~") for o in positional}
    return [f"{k}={v}" for k, v in flags if k.lstrip("+") not in given] + positional


def compose(config_name: str, overrides: list[str]):
    """Compose ``conf/<config_name>.yaml`` with ``overrides`` through Hydra's compose API.

    Raises:
        ValueError: for an override Hydra or the config schema refuses (one line).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_module(config_module="rayinfer.conf", version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        message = " ".join(str(e).split())
        missing = re.search(r"Could not override '([^']+)'", message)
        cause = str(e.__cause__ or "").strip().splitlines()
        if missing:  # a misspelt key: Hydra's "+key" hint only leads to the unknown-key error below
            message = re.sub(r"\.?\s*To append to your config use \+\S+", ": the config has no such key", message)
            with initialize_config_module(config_module="rayinfer.conf", version_base="1.3"):
                base = hydra_compose(config_name=config_name)
            hint = did_you_mean(base, missing.group(1))
            if not hint and is_open_node(base, missing.group(1)):  # sampling.top_p: a field its defaults leave out
                hint = f" (to add it, write +{missing.group(1)}=...)"
            message += hint
        elif cause and cause[0] not in message:  # "Error merging override k=v" says why only in its cause
            message += f": {cause[0]}"
        # an unknown preset (parallel=ep3): its group's options, the closest ones, without Hydra's search path
        message = re.sub(r"\s*Config search path:.*$", "", message)
        preset = re.search(r"Could not find '[^'/]+/([^']+)'.*Available options in '[^']+': (.*)$", message)
        if preset:
            close = difflib.get_close_matches(preset.group(1), preset.group(2).split(), n=3)
            message += f" (did you mean {' or '.join(sorted(close))}?)" if close else ""
        raise ValueError(f"bad {config_name} config: {message}") from None
    extra = unknown_keys(cfg)
    if extra:  # "+key=value" adds a key to a schema node, where nothing would ever read it
        raise ValueError(f"bad {config_name} config: unknown key(s) {', '.join(extra)}"
                         + "".join(did_you_mean(cfg, k) for k in extra))
    return cfg


def declared_keys(node) -> list[str] | None:
    """The field names of ``node``'s dataclass schema (a composed DictConfig), or None for an untyped node."""
    import dataclasses

    from omegaconf import OmegaConf

    schema = OmegaConf.get_type(node)
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None


def did_you_mean(cfg, dotted: str) -> str:
    """`` (did you mean <key>?)`` for the declared key of ``dotted``'s parent node in ``cfg`` closest to its
    last part (``difflib``), or "" when none is close or the parent is not a config node."""
    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = dotted.lstrip("+~").rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    if not isinstance(node, DictConfig):
        return ""
    names = declared_keys(node)
    names = names if names is not None else [str(k) for k in node.keys()]
    close = difflib.get_close_matches(leaf, [n for n in names if n != leaf], n=1)
    return f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""


def is_open_node(cfg, dotted: str) -> bool:
    """Whether ``dotted``'s parent node in ``cfg`` is a config node without a schema (``sampling``), to which
    ``+key=value`` adds keys that are read."""
    from omegaconf import DictConfig, OmegaConf

    parent = dotted.lstrip("+~").rpartition(".")[0]
    node = OmegaConf.select(cfg, parent) if parent else None
    return isinstance(node, DictConfig) and declared_keys(node) is None


def unknown_keys(node, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` (a composed DictConfig) that its dataclass schema does not declare (what
    a ``+key=value`` override adds to a typed node: accepted by Hydra, read by nothing)."""
    from omegaconf import DictConfig

    declared = declared_keys(node)
    out = []
    for key in node.keys():
        name = f"{prefix}{key}"
        if declared is not None and key not in declared:
            out.append(name)
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            out += unknown_keys(child, name + ".")
    return out


_USAGE = """usage: rayinfer {serve,generate} [flags] [key=value ...]

commands:
  generate  answer a JSONL file of prompts (OpenAI Batch or rayinfer lines) offline, then exit
  serve     start the OpenAI-compatible server (Ray Serve) and keep it running

flags are listed by 'rayinfer <command> --help'; key=value pairs are Hydra overrides of the job's config
(e.g. engine.max_num_seqs=64, parallel=1p1d), as for python jobs/generate.py and python jobs/serve.py"""


def main(argv: list[str] | None = None) -> int:
    """``rayinfer {serve,generate} [flags] [key=value ...]``; returns the exit code (2: a bad flag,
    override or config value, or an unknown model)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("serve", "generate"):
        asked = argv[:1] in (["-h"], ["--help"])
        print(_USAGE if asked else _USAGE.splitlines()[0] + "; rayinfer --help for the commands",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    command = argv[0]
    args = build_parser(command).parse_intermixed_args(argv[1:])  # a bad flag: argparse's exit 2
    overrides = to_overrides(command, args)
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")  # as hydra/job_logging: stdout
    if command == "generate":
        from rayinfer.jobs import generate

        generate.register_configs()
        try:
            dcfg = compose("generate", overrides)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return generate.execute(dcfg)
    from rayinfer.jobs import serve
    from rayinfer.serve.config import compose_config

    try:
        cfg = compose_config(overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return serve.execute(cfg)


if __name__ == "__main__":
    sys.exit(main())
