"""Tile configurations of the fused-MoE grouped GEMM, as data: tuned per device and expert shape.

A table is one JSON file per device under ``rayinfer/kernels/configs/`` (package data), named after the device
(``torch.cuda.get_device_name``, e.g. ``NVIDIA_H200.json``)::

    {"device": "NVIDIA H200",
     "entries": {"E=64,N=2816,K=2048,dtype=bfloat16": {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
                                              "num_warps": 4, "num_stages": 4}, "16": {...}, ...}}}

keyed by the layer's expert shape (E experts, ``w13`` of [E, N = 2 * I, K = H]) and dtype, then by the token
count M the entry was tuned for; a call with M tokens takes the entry of the nearest tuned M (after
vLLM's per-device fused-MoE configs). One entry serves both GEMMs of the layer (the alignment's
``BLOCK_M`` must be common to both). ``jobs/tune_moe.py`` writes the tables. With no file for the
device, no entry for the shape, or in batch-invariant mode, :func:`default_tile_config` applies.

An optional ``"grouped_mm_from": {"E=64,N=2816,K=2048,dtype=bfloat16": 8192, ...}`` gives, per shape, the
token count from which the layer runs on torch's grouped GEMM instead of the Triton kernel
(``kernels.fused_moe.fused_moe_grouped_mm``; measured per device, :func:`grouped_mm_from`); a shape not
listed always takes the Triton kernel.

An optional ``"gemv": {"N=3648,K=2048,dtype=bfloat16": {"block_n": 16, "block_k": 2048, "num_warps": 4,
"num_stages": 3}, ...}`` gives the one-row GEMV's tiles (``kernels.gemv``) per weight shape [N, K] and weight
dtype, measured on the device under programmatic dependent launch (:func:`gemv_tile_config`); a shape not
listed takes ``kernels.gemv._choose_config``'s rule.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


@dataclass(frozen=True)
class MoETileConfig:
    """Tiles of the grouped GEMM: BLOCK_M rows (of expert-sorted pairs; also the alignment's padding),
    BLOCK_N output columns and BLOCK_K reduction steps per program; Triton's num_warps and num_stages."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name, value in asdict(self).items():
            if name.startswith("block") and (value < 16 or value & (value - 1)):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"num_warps={self.num_warps} / num_stages={self.num_stages} out of range")

    @classmethod
    def from_json(cls, entry: dict) -> "MoETileConfig":
        """From ``{"BLOCK_M": .., "BLOCK_N": .., "BLOCK_K": .., "num_warps": .., "num_stages": ..}``.

        Raises: ValueError on a missing or extra key or a bad value."""
        if set(entry) != set(_KEYS):
            raise ValueError(f"tile config {entry} must have exactly the keys {_KEYS}")
        return cls(*(int(entry[k]) for k in _KEYS))

    def to_json(self) -> dict:
        return dict(zip(_KEYS, (self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages)))


def default_tile_config(num_tokens: int, top_k: int, batch_invariant: bool = False) -> MoETileConfig:
    """The heuristic (and batch-invariant) tiles: 16-row tiles for up to 1024 pairs, else 64 (always 64 in
    batch-invariant mode); 64-wide N and K tiles (the GEMM clips a tile to its weight's size)."""
    return MoETileConfig(block_m=64 if batch_invariant or num_tokens * top_k > 1024 else 16)


def shape_key(num_experts: int, n: int, k: int, dtype: str) -> str:
    """``"E=64,N=2816,K=2048,dtype=bfloat16"``: w13's shape [E, N, K] and the activations' dtype name."""
    return f"E={num_experts},N={n},K={k},dtype={dtype}"


def table_path(device_name: str, config_dir: Path | None = None) -> Path:
    """The table file of a device in ``config_dir`` (default :data:`CONFIG_DIR`): the device's name with
    every run of non-alphanumerics as one ``_``."""
    slug = "".join(c if c.isalnum() else " " for c in device_name).split()
    return (config_dir or CONFIG_DIR) / f"{'_'.join(slug)}.json"


def parse_table(data: dict) -> dict[str, dict[int, MoETileConfig]]:
    """A table's JSON object -> {shape key: {M: config}}.

    Raises: ValueError on a malformed table (naming the entry)."""
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise ValueError("a fused-MoE tile table needs an 'entries' object")
    table: dict[str, dict[int, MoETileConfig]] = {}
    for shape, by_m in entries.items():
        try:
            table[shape] = {int(m): MoETileConfig.from_json(entry) for m, entry in by_m.items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"fused-MoE tile table entry {shape!r}: {exc}") from exc
    return table


def _read_table(device_name: str, config_dir: Path | None = None) -> tuple[Path, dict | None]:
    """(path, the device's table file as JSON, or None without a file); its readers cache what they take.
    Raises: ValueError on bad JSON."""
    path = table_path(device_name, config_dir)
    if not path.is_file():
        return path, None
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: {exc}") from exc


@functools.lru_cache(maxsize=None)
def load_table(device_name: str, config_dir: Path | None = None) -> dict[str, dict[int, MoETileConfig]]:
    """The parsed table of a device ({} when it has no file). Raises: ValueError on a malformed file."""
    path, data = _read_table(device_name, config_dir)
    if data is None:
        return {}
    try:
        return parse_table(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def lookup(table: dict[str, dict[int, MoETileConfig]], num_experts: int, n: int, k: int, dtype: str,
           num_tokens: int) -> MoETileConfig | None:
    """The entry of the nearest tuned M for this shape and dtype (ties: the smaller M), or None."""
    by_m = table.get(shape_key(num_experts, n, k, dtype))
    if not by_m:
        return None
    return by_m[min(by_m, key=lambda m: (abs(m - num_tokens), m))]


@functools.lru_cache(maxsize=4096)
def tile_config(device_name: str | None, num_experts: int, n: int, k: int, dtype: str, num_tokens: int,
                top_k: int, batch_invariant: bool = False) -> MoETileConfig:
    """The grouped GEMM's tiles for a call: the device table's entry, else :func:`default_tile_config`.

    Args:
        device_name: ``torch.cuda.get_device_name`` of the call's device; None (CPU, interpreter) takes
            the default.
        num_experts, n, k: ``w13``'s shape [E, N = 2 * I, K = H]; dtype: the activations' dtype name
            (``"bfloat16"``).
        num_tokens: M, the call's token count; top_k: k.
        batch_invariant: fixed tiles whatever M (the default's), never the table's.
    Raises:
        ValueError: if the device's table file is malformed.
    """
    if device_name is not None and not batch_invariant:
        found = lookup(load_table(device_name), num_experts, n, k, dtype, num_tokens)
        if found is not None:
            return found
    return default_tile_config(num_tokens, top_k, batch_invariant)


@functools.lru_cache(maxsize=None)
def load_grouped_mm_from(device_name: str, config_dir: Path | None = None) -> dict[str, int]:
    """The device table's ``grouped_mm_from`` object ({} without a file or the key).

    Raises: ValueError when it is not an object of positive integer token counts."""
    path, table = _read_table(device_name, config_dir)
    data = table.get("grouped_mm_from", {}) if table is not None else {}
    if not isinstance(data, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                             for v in data.values()):
        raise ValueError(f"{path}: 'grouped_mm_from' must map shape keys to positive token counts, not {data!r}")
    return data


def grouped_mm_from(device_name: str | None, num_experts: int, n: int, k: int, dtype: str) -> int | None:
    """Token count from which a layer of this shape takes the grouped-GEMM path on this device, or None
    (never; also for CPU, ``device_name`` None). Args as :func:`tile_config`.
    Raises: ValueError if the device's table file is malformed."""
    if device_name is None:
        return None
    return load_grouped_mm_from(device_name).get(shape_key(num_experts, n, k, dtype))


_GEMV_KEYS = ("block_n", "block_k", "num_warps", "num_stages")


def gemv_key(n: int, k: int, dtype: str) -> str:
    """``"N=3648,K=2048,dtype=bfloat16"``: a GEMV weight's shape [N, K] and its dtype name."""
    return f"N={n},K={k},dtype={dtype}"


def _check_gemv_entry(entry) -> dict:
    """One ``gemv`` entry, checked. Raises: ValueError on missing or extra keys or a bad value."""
    if not isinstance(entry, dict) or set(entry) != set(_GEMV_KEYS):
        raise ValueError(f"tiles {entry!r} must have exactly the keys {_GEMV_KEYS}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in entry.values()):
        raise ValueError(f"tiles {entry!r} must be integers")
    bn, bk, warps, stages = (entry[k] for k in _GEMV_KEYS)
    if bn < 1 or bn & (bn - 1) or bk < 16 or bk & (bk - 1):
        raise ValueError(f"tiles {entry!r}: block_n must be a power of two, block_k one >= 16")
    if warps not in (1, 2, 4, 8, 16) or not 1 <= stages <= 8:
        raise ValueError(f"tiles {entry!r}: num_warps / num_stages out of range")
    return dict(entry)


@functools.lru_cache(maxsize=None)
def load_gemv_table(device_name: str, config_dir: Path | None = None) -> dict[str, dict]:
    """The device table's ``gemv`` object ({} without a file or the key): {gemv_key: tiles}.

    Raises: ValueError on a malformed entry (naming the file and the shape)."""
    path, table = _read_table(device_name, config_dir)
    data = table.get("gemv", {}) if table is not None else {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: 'gemv' must be an object of weight shapes, not {data!r}")
    out = {}
    for shape, entry in data.items():
        try:
            out[shape] = _check_gemv_entry(entry)
        except ValueError as exc:
            raise ValueError(f"{path}: gemv entry {shape!r}: {exc}") from exc
    return out


def gemv_tile_config(device_name: str | None, n: int, k: int, dtype: str) -> dict | None:
    """The one-row GEMV's tiles for an [n, k] weight of dtype name ``dtype`` on this device (a copy of the
    table's entry: block_n, block_k, num_warps, num_stages), or None (no entry; ``device_name`` None).
    Raises: ValueError if the device's table file is malformed."""
    if device_name is None:
        return None
    found = load_gemv_table(device_name).get(gemv_key(n, k, dtype))
    return dict(found) if found is not None else None
