"""Our Qwen3-MoE over the paged cache equals Hugging Face Qwen3MoeForCausalLM (float32, small random
configs): chunked prefill + decode of two requests in one batch, greedy generation, per-expert names."""

import pytest
import torch
import transformers

from rayinfer.model.qwen3_moe import Qwen3MoeForCausalLM

BLOCK_SIZE = 4
TABLES = [[5, 2, 9, 7], [11, 0, 3]]  # scattered blocks on purpose
# (request, new tokens) per step: chunked prefills, a decode inside a mixed batch, pure decode batches
SCHEDULE = [[(0, 6), (1, 4)], [(0, 1), (1, 5)], [(0, 4), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1)]]


def tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], max_position_embeddings=256,
                initializer_range=0.1)
    base.update(kw)
    return transformers.Qwen3MoeConfig(**base)


def make_pair(cfg, seed=0):
    torch.manual_seed(seed)
    ref = transformers.Qwen3MoeForCausalLM(cfg).eval()
    ours = Qwen3MoeForCausalLM(cfg).eval()
    assert ours.load_weights(ref.state_dict().items()) == set(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "qkv-stacked"])
@pytest.mark.parametrize("extra", [{}, dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                                            tie_word_embeddings=True, attention_bias=True)])
def test_prefill_then_decode_matches_hf(extra, fuse, paged):
    ref, ours = make_pair(tiny_config(**extra))
    if fuse:  # what the loader does: q, k and v in one projection (fuse_qkv)
        ours.process_weights_after_loading()
        attn = ours.model.layers[0].self_attn
        assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
        assert (attn.qkv_proj.bias is not None) == bool(extra)
    seqs = [torch.randint(0, 128, (14,)), torch.randint(0, 128, (12,))]
    paged.assert_matches_hf(ref, ours, seqs, TABLES, SCHEDULE, BLOCK_SIZE)
    load = ours.expert_load(reset=True)
    num_moe = 2 if not extra else 1
    assert load.shape == (num_moe, 8) and (load.sum(1) == 26 * 2).all()
    assert ours.expert_load().sum() == 0


def test_greedy_generation_matches_hf(paged):
    ref, ours = make_pair(tiny_config(), seed=1)
    prompt = torch.randint(0, 128, (8,))
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = paged.greedy(ours, prompt, 16, [5, 3], TABLES[0] + [12, 13, 14], BLOCK_SIZE)
    assert got == want[0, 8:].tolist()


def test_loads_per_expert_names():
    cfg = tiny_config()
    ref, ours = make_pair(cfg)
    named, inter = [], cfg.moe_intermediate_size
    for name, t in ref.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                named += [(name.replace("gate_up_proj", f"{e}.gate_proj.weight"), t[e, :inter]),
                          (name.replace("gate_up_proj", f"{e}.up_proj.weight"), t[e, inter:])]
        elif name.endswith("experts.down_proj"):
            named += [(name.replace("down_proj", f"{e}.down_proj.weight"), t[e]) for e in range(t.shape[0])]
        else:
            named.append((name, t))
    fresh = Qwen3MoeForCausalLM(cfg)
    assert fresh.load_weights(named) == set(ref.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    with pytest.raises(ValueError):
        fresh.load_weights([("model.layers.0.mlp.experts.0.gate_proj.weight", torch.zeros(3, 3))])


def test_stacked_qkv_with_fp8_blocks_and_hf_twin():
    """fp8 block projections stack with their scales when q's and k's rows fill 128-row blocks (the same
    projections as unstacked); with fewer rows they stay apart. The HF twin of a stacked model takes q/k/v as
    row slices of qkv_proj (hf_state_dict) and gives HF's own logits; so does a fresh model loading them."""
    from rayinfer.jobs.hf_baseline import hf_twin

    cfg = tiny_config(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, head_dim=32)
    ref, ours = make_pair(cfg)
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        want = ref(ids).logits
        ours.process_weights_after_loading()
        got = hf_twin(ours)(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    names = ours.hf_state_dict()
    assert set(names) == set(ref.state_dict()) - {n for n in ref.state_dict() if n.endswith("inv_freq")}
    assert Qwen3MoeForCausalLM(cfg).load_weights(names.items()) == set(names)

    from rayinfer.model.quantization import BlockFp8Config, linear, quantize_linears

    _, plain = make_pair(cfg, seed=2)
    quantize_linears(plain, BlockFp8Config())
    attn = plain.model.layers[0].self_attn
    x = torch.randn(5, cfg.hidden_size)
    before = {n: t.clone() for n, t in plain.state_dict().items()}
    with torch.no_grad():
        want = torch.cat([linear(x, m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)
        assert attn.fuse_qkv() and attn.qkv_proj.weight_scale_inv.shape[0] == 3  # 384 rows: 3 blocks
        torch.testing.assert_close(linear(x, attn.qkv_proj), want, atol=1e-5, rtol=1e-5)
    after = plain.hf_state_dict()  # the fp8 weights and their scales back under their own names, as they were
    assert set(after) == set(before)
    assert all(torch.equal(after[n].view(torch.uint8), before[n].view(torch.uint8)) for n in before)  # bitwise
    _, small = make_pair(tiny_config(), seed=3)
    quantize_linears(small, BlockFp8Config())
    assert not small.model.layers[0].self_attn.fuse_qkv()  # 64 query rows: not whole blocks


def _one_row_vs_generic(paged, device, dtype, fp8=False, **cfg_kw):
    """``paged.one_row_vs_generic`` of a random model (norm weights not all ones and biases not zero, so one
    applied wrong shows): the one-row path is GEMVs with the norms and residual adds fused in, the router's
    norm in its kernel, the MoE sum added into the residual stream. ``fp8``: 128 x 128 fp8 block linears
    (q/k/v stack when their rows fill whole blocks), the one-row path's on the fp8 GEMV."""
    from rayinfer.model.qwen3_moe import Qwen3MoeDecoderLayer
    from rayinfer.model.quantization import BlockFp8Config, quantize_linears

    _, model = make_pair(tiny_config(**cfg_kw), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):  # HF initializes them to zero
                p.uniform_(-0.5, 0.5)
    model = model.to(device=device, dtype=dtype)
    if fp8:
        quantize_linears(model, BlockFp8Config())
    model.process_weights_after_loading()  # qkv_proj stacked, one_row_fusion decided
    assert model.one_row_fusion
    return paged.one_row_vs_generic(model, Qwen3MoeDecoderLayer, BLOCK_SIZE, fp8)


@pytest.mark.parametrize("extra", [{}, dict(attention_bias=True, norm_topk_prob=False)])
def test_one_row_path_matches_generic_forward(extra, paged):
    """forward_one_row computes the same layers (MoE and the dense layer 1) as the generic forward: on CPU its
    dispatchers run the unfused ops, which checks the wiring (norm placement, residual adds, the router's
    normed input, q/k norms and RoPE on the stacked projection's columns)."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cpu", torch.float32, **extra)
    assert calls == 3  # only the direct loop: float32 on CPU keeps forward on the generic path
    torch.testing.assert_close(fused, generic)
    torch.testing.assert_close(direct, generic, rtol=1e-5, atol=1e-5)


def test_one_row_path_with_fp8_weights_matches_generic_forward(paged):
    """fp8 block weights: forward_one_row passes each projection's scales (on CPU to block_fp8_linear)."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cpu", torch.float32, fp8=True, hidden_size=128,
                                                        num_key_value_heads=4, head_dim=32)
    assert calls == 3
    torch.testing.assert_close(direct, generic, rtol=1e-5, atol=1e-5)


def test_one_row_fusion_off_by_switch(monkeypatch):
    """RAYINFER_ONE_ROW_FUSION=0 keeps a loaded model on the generic path."""
    monkeypatch.setenv("RAYINFER_ONE_ROW_FUSION", "0")
    _, model = make_pair(tiny_config())
    model.process_weights_after_loading()
    assert not model.one_row_fusion


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_one_row_path_matches_generic_forward_on_gpu(fp8, paged):
    """bf16 on the GPU: the GEMV kernels, the router's fused norm and the fused MoE's residual add take every
    layer of forward; with fp8 block weights, the fp8 GEMV against block_fp8_linear's one-row calls."""
    kw = dict(hidden_size=128, num_key_value_heads=4, head_dim=32) if fp8 else {}
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cuda", torch.bfloat16, fp8=fp8, **kw)
    assert calls == 6  # 3 layers through forward, 3 through the direct loop
    # the one-row path does not round the normed inputs of its GEMVs to bf16, the generic path does
    tol = 6e-2
    torch.testing.assert_close(fused.float(), generic.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(direct.float(), fused.float(), rtol=3e-2, atol=3e-2)
