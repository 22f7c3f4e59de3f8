"""The fused-MoE tile tables: parsing, nearest-M lookup, the default and batch-invariant fallbacks, and the
shipped tables' validity."""

from __future__ import annotations

import json

import pytest
import torch

from rayinfer.kernels import fused_moe_config as fmc
from rayinfer.kernels.fused_moe_config import MoETileConfig, default_tile_config, load_table, lookup, tile_config

ENTRY = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
SHAPE = "E=64,N=2816,K=2048,dtype=bfloat16"


def write_table(tmp_path, device="NVIDIA Test GPU-80GB", entries=None):
    entries = entries if entries is not None else {SHAPE: {"1": dict(ENTRY, BLOCK_M=16), "64": ENTRY,
                                                           "1024": dict(ENTRY, BLOCK_M=64)}}
    path = fmc.table_path(device, tmp_path)
    path.write_text(json.dumps({"device": device, "entries": entries}))
    return path


def test_lookup_takes_the_nearest_tuned_m(tmp_path):
    path = write_table(tmp_path)
    assert path.name == "NVIDIA_Test_GPU_80GB.json"
    table = load_table("NVIDIA Test GPU-80GB", tmp_path)
    pick = [getattr(lookup(table, 64, 2816, 2048, "bfloat16", m), "block_m", None)
            for m in (1, 20, 32, 33, 100, 600, 5000)]
    assert pick == [16, 16, 16, 32, 32, 64, 64]  # 32 is as near 1 as 64 (ties: the smaller M)
    assert lookup(table, 64, 2816, 2048, "bfloat16", 64) == MoETileConfig(32, 128, 64, 8, 3)
    assert lookup(table, 64, 2816, 2048, "float16", 64) is None  # other dtype
    assert lookup(table, 128, 2816, 2048, "bfloat16", 64) is None  # other shape


def test_tile_config_prefers_the_table_but_not_in_batch_invariant_mode(tmp_path, monkeypatch):
    write_table(tmp_path)
    monkeypatch.setattr(fmc, "CONFIG_DIR", tmp_path)
    fmc.load_table.cache_clear()
    fmc.tile_config.cache_clear()
    try:
        dev = "NVIDIA Test GPU-80GB"
        assert tile_config(dev, 64, 2816, 2048, "bfloat16", 64, 6) == MoETileConfig(32, 128, 64, 8, 3)
        assert tile_config(dev, 64, 2816, 2048, "bfloat16", 64, 6, batch_invariant=True) == MoETileConfig(64)
        assert tile_config(dev, 64, 1408, 2048, "bfloat16", 64, 6) == default_tile_config(64, 6)  # no entry
    finally:
        fmc.load_table.cache_clear()
        fmc.tile_config.cache_clear()
    assert tile_config(None, 64, 2816, 2048, "bfloat16", 1, 6) == MoETileConfig(block_m=16)
    assert tile_config(None, 64, 2816, 2048, "bfloat16", 512, 6).block_m == 64  # 3072 pairs
    assert tile_config("no such device", 64, 2816, 2048, "bfloat16", 1, 6).block_m == 16


def test_fused_moe_tiles_take_the_device_table_unless_switched_off(tmp_path, monkeypatch):
    """kernels.fused_moe picks a CUDA call's tiles from the device's table; DEVICE_TABLE 0 (bench_moe's
    "moe-table-0") and CPU calls take the heuristic."""
    from rayinfer.kernels import fused_moe

    dev = "NVIDIA Test GPU-80GB"
    write_table(tmp_path)
    monkeypatch.setattr(fmc, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(fused_moe, "_device_name", lambda index: dev)
    fmc.load_table.cache_clear()
    fmc.tile_config.cache_clear()

    class CudaRows:  # what fused_moe_tiles reads of hidden: its device and row count
        is_cuda = True
        device = torch.device("cuda", 0)
        shape = (64, 2048)
        dtype = torch.bfloat16

    w13 = torch.empty(64, 2816, 2048, dtype=torch.bfloat16)
    try:
        assert fused_moe.fused_moe_tiles(CudaRows(), w13, 6) == MoETileConfig(32, 128, 64, 8, 3)
        assert fused_moe.fused_moe_tiles(torch.empty(64, 2048, dtype=torch.bfloat16), w13, 6) == \
            default_tile_config(64, 6)
        monkeypatch.setattr(fused_moe, "DEVICE_TABLE", 0)
        assert fused_moe.fused_moe_tiles(CudaRows(), w13, 6) == default_tile_config(64, 6)
    finally:
        fmc.load_table.cache_clear()
        fmc.tile_config.cache_clear()


def test_malformed_tables_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="power of two"):
        MoETileConfig(block_m=24)
    with pytest.raises(ValueError, match="exactly the keys"):
        MoETileConfig.from_json({"BLOCK_M": 16})
    write_table(tmp_path, "Bad GPU", {SHAPE: {"1": dict(ENTRY, num_warps=3)}})
    with pytest.raises(ValueError, match="Bad_GPU.json.*E=64"):
        load_table("Bad GPU", tmp_path)


def test_shipped_tables_parse():
    files = sorted(fmc.CONFIG_DIR.glob("*.json"))
    for path in files:
        data = json.loads(path.read_text())
        assert fmc.table_path(data["device"]) == path, f"{path.name} is not named after its device"
        # fused-MoE tiles, one-row GEMV tiles, or both (a device tuned for the GEMVs only has {} entries)
        assert fmc.parse_table(data) or data.get("gemv"), f"{path.name} has no entries"
        fmc.load_grouped_mm_from(data["device"])  # raises on a malformed grouped_mm_from
        fmc.load_gemv_table(data["device"])  # raises on a malformed gemv entry


GEMV = {"block_n": 16, "block_k": 2048, "num_warps": 4, "num_stages": 3}


def test_gemv_tiles_per_weight_shape(tmp_path, monkeypatch):
    """The table's gemv object gives the one-row GEMV's tiles per weight shape and dtype; kernels.gemv takes
    them under PDL unless DEVICE_TABLE is 0, and a config argument still overrides them."""
    from rayinfer.kernels import gemv

    dev = "NVIDIA Test GPU-80GB"
    path = write_table(tmp_path)
    data = json.loads(path.read_text())
    data["gemv"] = {fmc.gemv_key(3648, 2048, "bfloat16"): GEMV}
    path.write_text(json.dumps(data))
    monkeypatch.setattr(fmc, "CONFIG_DIR", tmp_path)
    fmc.load_gemv_table.cache_clear()
    try:
        assert fmc.gemv_tile_config(dev, 3648, 2048, "bfloat16") == GEMV
        assert fmc.gemv_tile_config(dev, 3648, 2048, "float16") is None
        assert fmc.gemv_tile_config(dev, 2048, 2048, "bfloat16") is None
        assert fmc.gemv_tile_config(None, 3648, 2048, "bfloat16") is None
        fmc.gemv_tile_config(dev, 3648, 2048, "bfloat16")["num_warps"] = 8  # a copy: the table is unchanged
        assert fmc.gemv_tile_config(dev, 3648, 2048, "bfloat16") == GEMV

        class CudaRow:  # what _table_config reads of x: its device
            is_cuda = True
            device = torch.device("cuda", 0)

        monkeypatch.setattr(gemv, "_device_name", lambda index: dev)
        w = torch.empty(3648, 2048, dtype=torch.bfloat16)
        assert gemv._table_config(CudaRow(), w) == GEMV
        assert gemv._table_config(CudaRow(), w.to(torch.float16)) == {}
        assert gemv._table_config(torch.empty(1, 2048), w) == {}  # CPU rows: the rule
        monkeypatch.setattr(gemv, "DEVICE_TABLE", 0)
        assert gemv._table_config(CudaRow(), w) == {}
    finally:
        fmc.load_gemv_table.cache_clear()


@pytest.mark.parametrize("entry, problem", [(dict(GEMV, block_n=12), "power of two"),
                                            (dict(GEMV, block_k=8), "power of two"),
                                            (dict(GEMV, num_warps=3), "out of range"),
                                            ({"block_n": 8}, "exactly the keys"),
                                            (dict(GEMV, num_stages="3"), "integers")])
def test_malformed_gemv_entries_name_the_problem(tmp_path, entry, problem):
    path = write_table(tmp_path, "Bad GPU")
    data = json.loads(path.read_text())
    data["gemv"] = {"N=8,K=64,dtype=bfloat16": entry}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"Bad_GPU.json.*N=8,K=64.*{problem}"):
        fmc.load_gemv_table("Bad GPU", tmp_path)


def test_gemv_tuner_writes_winners_and_drops_the_rest(tmp_path):
    """jobs/tune_gemv.py writes a shape's winner only when it beats the rule's tiles by the margin, removes
    the entry of a shape where it does not, and keeps the rest of the file."""
    from jobs import tune_gemv

    path = write_table(tmp_path)
    data = json.loads(path.read_text())
    data["gemv"] = {fmc.gemv_key(2048, 2048, "bfloat16"): GEMV, fmc.gemv_key(9, 9, "bfloat16"): GEMV}
    path.write_text(json.dumps(data))
    rule = {"block_n": 8, "block_k": 2048, "num_warps": 8, "num_stages": 3}
    tuned = {(3648, 2048): {"config": GEMV, "us": 4.8, "rule": rule, "rule_us": 5.5},
             (2048, 2048): {"config": GEMV, "us": 2.95, "rule": rule, "rule_us": 3.0}}
    table = tune_gemv.merge_table(path, "NVIDIA Test GPU-80GB", "bfloat16", tuned, margin=0.03)
    assert table["gemv"] == {fmc.gemv_key(3648, 2048, "bfloat16"): GEMV, fmc.gemv_key(9, 9, "bfloat16"): GEMV}
    assert table["entries"] == data["entries"]
    with pytest.raises(ValueError, match="not of 'Other GPU'"):
        tune_gemv.merge_table(path, "Other GPU", "bfloat16", tuned, margin=0.03)
    assert tune_gemv.parse_shape("64x128:silu_and_mul") == ("64x128:silu_and_mul", [(64, 128, "silu_and_mul")])
    assert tune_gemv.parse_shape("deepseek-v2-lite")[1][0] == (3648, 2048, "rms_norm")
    for bad in ("64x", "64x128:gelu", "llama"):
        with pytest.raises(ValueError, match="shape"):
            tune_gemv.parse_shape(bad)


def test_grouped_mm_from_per_shape(tmp_path, monkeypatch):
    """The table's grouped_mm_from gives, per shape, where the grouped-GEMM path starts; no entry, another
    dtype, no device (CPU) or no file: never. The environment variable overrides it; on CPU tensors the
    path never applies."""
    import torch

    from rayinfer import envs
    from rayinfer.kernels import fused_moe as fm

    device = "NVIDIA Test GPU-80GB"
    path = write_table(tmp_path, device)
    data = json.loads(path.read_text())
    data["grouped_mm_from"] = {SHAPE: 4096}
    path.write_text(json.dumps(data))
    monkeypatch.setattr(fmc, "CONFIG_DIR", tmp_path)
    fmc.load_grouped_mm_from.cache_clear()
    try:
        assert fmc.grouped_mm_from(device, 64, 2816, 2048, "bfloat16") == 4096
        assert fmc.grouped_mm_from(device, 64, 2816, 2048, "float8_e4m3fn") is None
        assert fmc.grouped_mm_from(device, 128, 1536, 2048, "bfloat16") is None
        assert fmc.grouped_mm_from(None, 64, 2816, 2048, "bfloat16") is None
        assert fmc.grouped_mm_from("no such device", 64, 2816, 2048, "bfloat16") is None
        data["grouped_mm_from"] = {SHAPE: 0}
        fmc.table_path("Bad GPU", tmp_path).write_text(json.dumps(data))
        with pytest.raises(ValueError, match="positive token counts"):
            fmc.grouped_mm_from("Bad GPU", 64, 2816, 2048, "bfloat16")
    finally:
        fmc.load_grouped_mm_from.cache_clear()
    monkeypatch.setenv("RAYINFER_MOE_GROUPED_MM_FROM", "2048")
    assert envs.moe_grouped_mm_from() == 2048
    monkeypatch.setenv("RAYINFER_MOE_GROUPED_MM_FROM", "")
    assert envs.moe_grouped_mm_from() == -1
    monkeypatch.setenv("RAYINFER_MOE_GROUPED_MM_FROM", "-3")
    with pytest.raises(ValueError, match="RAYINFER_MOE_GROUPED_MM_FROM"):
        envs.moe_grouped_mm_from()
    monkeypatch.setattr(fm, "GROUPED_MM_FROM", 1)
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert not fm.grouped_mm_applies(x, torch.zeros(4, 32, 16, dtype=torch.bfloat16))


def test_tuner_candidates_and_table_merge(tmp_path):
    from rayinfer.jobs import tune_moe

    small = {c.block_m for c in tune_moe.candidates(1, 64, 6)}
    large = {c.block_m for c in tune_moe.candidates(4096, 64, 6)}
    assert small == {16} and large == {16, 32, 64, 128}
    assert tune_moe.parse_shape("64x1408x2048x6") == ("64x1408x2048x6", (64, 1408, 2048, 6, 0))
    assert tune_moe.parse_shape("64x1408x2048x6x2")[1] == (64, 1408, 2048, 6, 2)
    with pytest.raises(ValueError, match="ExIxHxk"):
        tune_moe.parse_shape("v3")
    path = write_table(tmp_path)
    tuned = {(8, 16, 32, 2, 0): {1: {"config": ENTRY}, 64: {"config": dict(ENTRY, BLOCK_M=64)}},
             (8, 16, 32, 2, 1): {1: {"config": ENTRY}}}  # one fused shared expert: the kernel holds 9
    table = tune_moe.merge_table(path, "NVIDIA Test GPU-80GB", "float16", tuned)
    parsed = fmc.parse_table(table)
    # the file's other shape is kept
    assert set(parsed) == {SHAPE, "E=8,N=32,K=32,dtype=float16", "E=9,N=32,K=32,dtype=float16"}
    assert parsed["E=8,N=32,K=32,dtype=float16"][64].block_m == 64
    with pytest.raises(ValueError, match="not of 'Other'"):
        tune_moe.merge_table(path, "Other", "float16", tuned)
    # tuning some token counts again replaces those and keeps the shape's others
    path.write_text(json.dumps(table))
    again = tune_moe.merge_table(path, "NVIDIA Test GPU-80GB", "float16",
                                 {(8, 16, 32, 2, 0): {1: {"config": dict(ENTRY, BLOCK_N=32)}}})
    entry = fmc.parse_table(again)["E=8,N=32,K=32,dtype=float16"]
    assert sorted(entry) == [1, 64] and entry[1].block_n == 32 and entry[64].block_m == 64


def test_tuner_sets_where_the_grouped_gemm_starts(tmp_path):
    """grouped_mm_from: the smallest timed M from which the grouped path wins by the margin at every larger
    timed M; dropped when it never wins; left alone when the run timed no M on it."""
    from rayinfer.jobs import tune_moe

    def res(triton_us, grouped_us=None):
        r = {"config": ENTRY, "us": triton_us}
        return r if grouped_us is None else dict(r, grouped_mm_us=grouped_us)

    start = tune_moe.grouped_mm_start
    assert start({1: res(5.0), 1024: res(100, 95), 2048: res(200, 150), 4096: res(400, 300)}) == 2048
    assert start({1024: res(100, 80), 2048: res(200, 199), 4096: res(400, 300)}) == 4096  # 2048 within the margin
    assert start({1024: res(100, 80), 2048: res(200, 250), 4096: res(400, 300)}) == 4096  # not below a loss
    assert start({1024: res(100, 80), 4096: res(400, 450)}) is None  # the largest M loses
    assert start({1: res(5.0), 64: res(9.0)}) is False
    path = write_table(tmp_path)
    shape = (8, 16, 32, 2, 0)
    key = "E=8,N=32,K=32,dtype=bfloat16"
    table = tune_moe.merge_table(path, "NVIDIA Test GPU-80GB", "bfloat16", {shape: {2048: res(200, 150)}})
    assert table["grouped_mm_from"] == {key: 2048}
    path.write_text(json.dumps(table))
    kept = tune_moe.merge_table(path, "NVIDIA Test GPU-80GB", "bfloat16", {shape: {16: res(5.0)}})
    assert kept["grouped_mm_from"] == {key: 2048}
    dropped = tune_moe.merge_table(path, "NVIDIA Test GPU-80GB", "bfloat16", {shape: {2048: res(200, 220)}})
    assert dropped["grouped_mm_from"] == {}
