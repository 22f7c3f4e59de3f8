"""jobs/hf_baseline.py: the HF twin of both MoE architectures as ``load_model`` builds them (DeepSeek-V3 with its
shared experts fused into the routed experts, 1 and 2 of them; Qwen3-MoE) shares our tensors and gives our
logits (float32, CPU); an out-of-memory batch size is reported as "oom" and its memory released."""

import pytest
import torch

from rayinfer.jobs import hf_baseline as hb
from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.model.loader import load_model
from rayinfer.model.shapes import SHAPES


def _logits_both(model, hf, num_tokens=12):
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(0))
    kv = torch.zeros(model.kv_cache_shape(2, 16))
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], 16)
    with torch.inference_mode():
        ours = model.compute_logits(model(ids, torch.arange(num_tokens), kv, meta))
        theirs = hf(input_ids=ids[None]).logits[0].float()
    return ours, theirs


@pytest.mark.parametrize("num_shared", [1, 2])
def test_hf_twin_of_deepseek_v3_with_fused_shared_experts(num_shared, tmp_path):
    from rayinfer.jobs.moe_cost import write_shape

    shape = {k: v for k, v in SHAPES["deepseek-v3-tiny"].items() if k != "model_type"}
    shape.update(n_shared_experts=num_shared, vocab_size=512)
    model = load_model(write_shape(shape, tmp_path), "float32", "cpu", "dummy", seed=5)
    moe = model.model.layers[1].mlp
    experts, num_routed, inter = moe.experts, shape["n_routed_experts"], shape["moe_intermediate_size"]
    assert moe.shared_experts is None and experts.num_shared == num_shared  # load_model fused them
    assert experts.gate_up_proj.shape[0] == num_routed + num_shared

    hf = hb.hf_twin(model)
    hf_moe = hf.model.layers[1].mlp
    # the routed experts are views of ours (same storage, the first L slots), the shared ones rebuilt
    assert hf_moe.experts.gate_up_proj.shape == (num_routed, 2 * inter, shape["hidden_size"])
    assert hf_moe.experts.gate_up_proj.data_ptr() == experts.gate_up_proj.data_ptr()
    assert hf_moe.experts.down_proj.data_ptr() == experts.down_proj.data_ptr()
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    for s in range(num_shared):
        rows, slot = slice(s * inter, (s + 1) * inter), num_routed + s
        assert torch.equal(hf_moe.shared_experts.gate_proj.weight[rows], w13[slot, :inter])
        assert torch.equal(hf_moe.shared_experts.up_proj.weight[rows], w13[slot, inter:])
        assert torch.equal(hf_moe.shared_experts.down_proj.weight[:, rows], w2[slot])
    ours, theirs = _logits_both(model, hf)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_hf_twin_of_qwen3_moe_tiny():
    model = load_model("qwen3-moe-tiny", "float32", "cpu", "dummy", seed=3)
    hf = hb.hf_twin(model)
    ours_experts = model.model.layers[1].mlp.experts
    assert hf.model.layers[1].mlp.experts.gate_up_proj.data_ptr() == ours_experts.gate_up_proj.data_ptr()
    ours, theirs = _logits_both(model, hf)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_an_out_of_memory_batch_size_is_oom_and_frees_memory(monkeypatch):
    from rayinfer.jobs import benchlib

    released = []
    monkeypatch.setattr(benchlib, "release_device_memory", lambda: released.append(True))

    def generate(hf, items, batch_size):
        if batch_size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if batch_size == 2:
            raise RuntimeError("CUDA error: out of memory")  # what cuBLAS or a launch raises
        return {"batch_size": batch_size, "output_tok_s": 1.0}

    monkeypatch.setattr(hb, "hf_generate_throughput", generate)
    assert hb.hf_generate_or_oom(None, [], 1) == {"batch_size": 1, "output_tok_s": 1.0} and not released
    assert hb.hf_generate_or_oom(None, [], 4) == "oom" and len(released) == 1
    assert hb.hf_generate_or_oom(None, [], 2) == "oom" and len(released) == 2

    def broken(hf, items, batch_size):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(hb, "hf_generate_throughput", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a bug is not an OOM
        hb.hf_generate_or_oom(None, [], 1)
    assert not hb.is_out_of_memory(ValueError("out of memory"))
