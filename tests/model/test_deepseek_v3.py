"""Our DeepSeek-V3 over the compressed paged cache equals Hugging Face DeepseekV3ForCausalLM
(float32, small random configs): chunked prefill + decode of two requests in one batch (also with MTP
modules built and loaded), greedy generation, checkpoint names (per-expert, MTP layers skipped or
loaded); the MTP module's forward against a reference of its formula (Hugging Face's decoder layer
plus plain torch)."""

import pytest
import torch
import transformers

from rayinfer.model.deepseek_v3 import DeepseekV3ForCausalLM

BLOCK_SIZE = 4
TABLES = [[5, 2, 9, 7], [11, 0, 3]]  # scattered blocks on purpose
# (request, new tokens) per step: chunked prefills, a decode inside a mixed batch, pure decode batches
SCHEDULE = [[(0, 6), (1, 4)], [(0, 1), (1, 5)], [(0, 4), (1, 1)], [(0, 1), (1, 1)], [(0, 1), (1, 1)], [(0, 1)]]
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)


def tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=32,
                q_lora_rank=48, qk_rope_head_dim=16, v_head_dim=24, qk_nope_head_dim=16, n_group=4, topk_group=2,
                num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                max_position_embeddings=256, initializer_range=0.1, num_nextn_predict_layers=1)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def make_pair(cfg, seed=0, mtp=False):
    """(HF reference, ours with its weights); ``mtp``: ours has MTP modules too, loaded from random
    checkpoint tensors (per-expert names, with copies of the embedding and head) beside the HF ones."""
    torch.manual_seed(seed)
    ref = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, buf in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.1)
    ours = DeepseekV3ForCausalLM(cfg, enable_mtp=mtp).eval()
    checkpoint = dict(ref.state_dict())
    if mtp:
        checkpoint.update(mtp_checkpoint(cfg, ref.state_dict(), seed))
    loaded = ours.load_weights(checkpoint.items())
    assert loaded == set(ours.state_dict())
    return ref, ours


def random_mtp(cfg, seed) -> DeepseekV3ForCausalLM:
    """A model whose MTP modules have random weights (matrices N(0, 0.1), norms and the router bias
    around 1 and 0)."""
    torch.manual_seed(seed + 100)
    src = DeepseekV3ForCausalLM(cfg, enable_mtp=True)
    with torch.no_grad():
        for name, t in [*src.mtp.named_parameters(), *src.mtp.named_buffers()]:
            if "norm" in name and t.dim() == 1:
                t.copy_(1 + 0.1 * torch.randn_like(t))
            elif t.is_floating_point():
                t.normal_(0, 0.1)
    return src


def mtp_checkpoint(cfg, main_state, seed) -> dict[str, torch.Tensor]:
    """Random MTP layers as released checkpoints store them: decoder layer ``num_hidden_layers + d``,
    per-expert names, plus copies of the main embedding and LM head."""
    n, out = cfg.num_hidden_layers, {}
    for name, t in random_mtp(cfg, seed).mtp.state_dict().items():
        d, rest = name.split(".", 1)
        out[f"model.layers.{n + int(d)}.{rest}"] = t
        out[f"model.layers.{n + int(d)}.embed_tokens.weight"] = main_state["model.embed_tokens.weight"]
        out[f"model.layers.{n + int(d)}.shared_head.head.weight"] = main_state["lm_head.weight"]
    return to_checkpoint_names(out, cfg, add_mtp=False)


@pytest.mark.parametrize("variant", ["base", "no_q_lora_no_interleave", "yarn", "with_mtp", "expanded",
                                     "fused_shared"])
def test_prefill_then_decode_matches_hf(variant, paged, monkeypatch):
    """Every chunk of SCHEDULE is short, so its steps attend in the absorbed form; ``expanded``: the
    multi-token steps take the expanded form (as long prompts do); ``fused_shared``: two shared experts
    moved into the routed experts' slots (what ``load_model`` does), not counted as expert load."""
    extra = {"base": {}, "no_q_lora_no_interleave": dict(q_lora_rank=None, rope_interleave=False),
             "yarn": dict(rope_parameters=YARN), "with_mtp": {}, "expanded": {},
             "fused_shared": dict(n_shared_experts=2)}[variant]
    if variant == "expanded":
        monkeypatch.setattr("rayinfer.kernels.mla_attention.ABSORBED_MAX_QUERY_LEN", 1)
    ref, ours = make_pair(tiny_config(**extra), mtp=variant == "with_mtp")
    if variant == "fused_shared":
        unfused = ours.state_dict()
        ours.process_weights_after_loading()
        moe = ours.model.layers[1].mlp
        assert moe.shared_experts is None and moe.experts.num_shared == 2
        assert moe.experts.w13.shape[0] == 8 + 2 and moe.experts.expert_counts.shape == (8,)
        assert ours.model.layers[0].self_attn.qkv_a_proj is not None  # q_a_proj and kv_a_proj_with_mqa stacked
        assert ours.model.layers[0].mlp.gate_up_proj is not None  # the dense layer's gate_proj and up_proj stacked
        hf_names = ours.hf_state_dict()  # the unfused names and tensors again
        assert hf_names.keys() == unfused.keys()
        for name, t in unfused.items():
            assert torch.equal(hf_names[name], t), name
    seqs = [torch.randint(0, 128, (14,)), torch.randint(0, 128, (12,))]
    paged.assert_matches_hf(ref, ours, seqs, TABLES, SCHEDULE, BLOCK_SIZE)
    load = ours.expert_load()
    assert load.shape == (2, 8) and (load.sum(1) == 26 * 3).all()  # every token of both requests, top-3


def test_greedy_generation_matches_hf(paged):
    cfg = tiny_config()
    ref, ours = make_pair(cfg, seed=1)
    prompt = torch.randint(0, 128, (8,))
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        got = paged.greedy(ours, prompt, 16, [5, 3], TABLES[0] + [12, 13, 14], BLOCK_SIZE)
    assert got == want[0, 8:].tolist()


def to_checkpoint_names(state_dict, cfg, add_mtp=True):
    """Hugging Face 5.x stacked experts -> per-expert names as released checkpoints store them, plus
    (``add_mtp``) a partial MTP layer (index num_hidden_layers) that must be skipped."""
    out, inter = {}, cfg.moe_intermediate_size
    for name, t in state_dict.items():
        if name.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                out[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = t[e, :inter]
                out[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            out[name] = t
    if not add_mtp:
        return out
    mtp = f"model.layers.{cfg.num_hidden_layers}"
    out.update({f"{mtp}.eh_proj.weight": torch.zeros(64, 128), f"{mtp}.enorm.weight": torch.ones(64),
                f"{mtp}.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64)})
    return out


def test_loads_checkpoint_names_and_skips_mtp():
    cfg = tiny_config()
    ref, ours = make_pair(cfg)
    fresh = DeepseekV3ForCausalLM(cfg).eval()
    loaded = fresh.load_weights(to_checkpoint_names(ref.state_dict(), cfg).items())
    assert loaded == set(ref.state_dict())
    for name, t in ours.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], t), name
    with pytest.raises(KeyError):
        fresh.load_weights([("model.layers.0.mlp.bogus.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="fp8 expert weights without their weight_scale_inv"):  # a scale alone
        fresh.load_weights([("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv", torch.ones(1, 1))])
    with pytest.raises(ValueError, match="weight_scale_inv without their fp8 weight"):  # fp8 dense layers: tests/model/test_quantization.py
        fresh.load_weights([("model.layers.0.mlp.gate_proj.weight_scale_inv", torch.ones(1, 1))])


def test_cache_is_compressed():
    cfg = tiny_config()
    assert DeepseekV3ForCausalLM(cfg).kv_cache_shape(10, 4) == (3, 10, 4, 32 + 16)


def test_loads_mtp_layers_when_built():
    cfg = tiny_config()
    ref, _ = make_pair(cfg)
    main = to_checkpoint_names(ref.state_dict(), cfg, add_mtp=False)
    checkpoint = {**main, **mtp_checkpoint(cfg, ref.state_dict(), seed=0)}
    ours = DeepseekV3ForCausalLM(cfg, enable_mtp=True).eval()
    assert ours.load_weights(checkpoint.items()) == set(ours.state_dict())
    got = ours.mtp.state_dict()
    for name, t in random_mtp(cfg, seed=0).mtp.state_dict().items():
        assert torch.equal(got[name], t), name
    assert ours.mtp[0].embed_weight is None and ours.mtp[0].head_weight is None  # equal copies: shared
    own_head = torch.randn_like(ref.lm_head.weight)
    checkpoint[f"model.layers.{cfg.num_hidden_layers}.shared_head.head.weight"] = own_head
    ours.load_weights(checkpoint.items())
    assert ours.mtp[0].head_weight is not None and torch.equal(ours.mtp[0].head_weight, own_head)
    with pytest.raises(ValueError, match="no MTP layer model.layers.3"):
        DeepseekV3ForCausalLM(cfg, enable_mtp=True).load_weights(main.items())
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        DeepseekV3ForCausalLM(tiny_config(num_nextn_predict_layers=0), enable_mtp=True)
    assert ours.expert_load().shape == (2, 8)  # the MTP module's experts stay out of EPLB


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("variant", ["base", "yarn"])
def test_mtp_forward_matches_its_formula(variant, paged):
    """h'_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) -> decoder block -> shared_head.norm -> head,
    with Hugging Face's DeepseekV3DecoderLayer (causal over the MTP entries) as the block, over the
    target's hidden states before its final norm; prefilled in two chunks through our paged MTP cache."""
    from rayinfer.kernels.attention_metadata import AttentionMetadata
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = tiny_config(**({"rope_parameters": YARN} if variant == "yarn" else {}))
    _, ours = make_pair(cfg, mtp=True)
    tokens = torch.randint(0, 128, (11,))
    with torch.no_grad():
        meta = AttentionMetadata.build([11], [11], [[1, 4, 2]], BLOCK_SIZE)
        kv = torch.zeros(ours.kv_cache_shape(8, BLOCK_SIZE))
        _, h = ours.forward_with_prenorm(tokens, torch.arange(11), kv, meta)
        # ours: entry i pairs h_i with t_{i+1}, at position i + 1; two chunks (7 entries, then 3)
        mtp_kv, outs = torch.zeros(ours.mtp_kv_cache_shape(8, BLOCK_SIZE)), []
        for lo, hi in [(0, 7), (7, 10)]:
            m = AttentionMetadata.build([hi - lo], [hi], [[3, 0, 5]], BLOCK_SIZE)
            outs.append(ours.mtp_forward(tokens[lo + 1: hi + 1], h[lo:hi], torch.arange(lo + 1, hi + 1), mtp_kv, m))
        got = ours.mtp_logits(torch.cat(outs))

        layer, eps, emb, head = ours.mtp[0], cfg.rms_norm_eps, ours.model.embed_tokens.weight, ours.lm_head.weight
        block = hf.DeepseekV3DecoderLayer(cfg, cfg.num_hidden_layers).eval()
        block_state = {k: v for k, v in layer.state_dict().items() if k.split(".")[0] in
                       ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
        block.load_state_dict(block_state)
        x = torch.cat([_rms(emb[tokens[1:]], layer.enorm.weight, eps), _rms(h[:10], layer.hnorm.weight, eps)], -1)
        x = (x @ layer.eh_proj.weight.T)[None]
        position_ids = torch.arange(1, 11)[None]
        cos_sin = hf.DeepseekV3RotaryEmbedding(cfg)(x, position_ids)
        causal = torch.full((10, 10), float("-inf")).triu(1)[None, None]
        out = block(x, attention_mask=causal, position_ids=position_ids, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        want = _rms(out[0], layer.shared_head.norm.weight, eps) @ head.T
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _one_row_vs_generic(paged, device, dtype, fp8=False, **cfg_kw):
    """``paged.one_row_vs_generic`` of a random model (norm weights not all ones, so a norm weight applied wrong
    shows): the one-row path is GEMVs with the norms and residual adds fused in, the MoE sum added into the
    residual stream. ``fp8``: the linears and experts in 128 x 128 fp8 blocks, the one-row path's linears
    on the fp8 GEMV."""
    from rayinfer.model.deepseek_v3 import DeepseekV3DecoderLayer
    from rayinfer.model.quantization import BlockFp8Config, quantize_linears

    cfg = tiny_config(**cfg_kw)
    _, model = make_pair(cfg, seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.process_weights_after_loading()  # qkv_a_proj, shared experts fused, one_row_fusion decided
    assert model.one_row_fusion
    model = model.to(device=device, dtype=dtype)
    if fp8:
        quantize_linears(model, BlockFp8Config())
    return paged.one_row_vs_generic(model, DeepseekV3DecoderLayer, BLOCK_SIZE, fp8)


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_one_row_path_matches_generic_forward(q_lora_rank, paged):
    """forward_one_row computes the same layers (dense and MoE) as the generic forward: on CPU its
    dispatchers run the unfused ops, which checks the wiring (norm placement, residual adds)."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cpu", torch.float32, q_lora_rank=q_lora_rank)
    assert calls == 3  # only the direct loop: float32 on CPU keeps forward on the generic path
    torch.testing.assert_close(fused, generic)
    torch.testing.assert_close(direct, generic, rtol=1e-5, atol=1e-5)


def test_one_row_path_with_fp8_weights_matches_generic_forward(paged):
    """fp8 block weights: forward_one_row passes each projection's scales (on CPU to block_fp8_linear)."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cpu", torch.float32, fp8=True, q_lora_rank=48)
    assert calls == 3
    torch.testing.assert_close(direct, generic, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_lora_rank,fp8", [(48, False), (None, False), (48, True), (None, True)])
def test_one_row_path_matches_generic_forward_on_gpu(q_lora_rank, fp8, paged):
    """bf16 on the GPU: the GEMV kernels and the fused MoE's residual add take every layer of forward;
    with fp8 block weights, the fp8 GEMV (scales in its K loop) against block_fp8_linear's one-row calls."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cuda", torch.bfloat16, fp8=fp8, q_lora_rank=q_lora_rank)
    assert calls == 6  # 3 layers through forward, 3 through the direct loop
    # with fp8 and q_lora the generic path rounds q_a_layernorm's output to bf16 before q_b_proj (the 16-bit
    # model's generic path takes the fused GEMV there too): 4 of 64 outputs differed by up to 0.047 on an H200.
    # The dense layer's MLP in the one-row path does not round its normalized input to bf16 either: 1 of 64
    # outputs differed by 0.031 (q_lora) / 0.038 (none) after the three layers on an H200 (68b7c94), by
    # 0.055 / 0.039 with that MLP unfused; the one-row path and its direct loop stay bit-equal.
    tol = 6e-2
    torch.testing.assert_close(fused.float(), generic.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(direct.float(), fused.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_gives_the_formulas_bits(dtype):
    """rope_args reads cos/sin rows of the table built after loading, bit for bit the formula's, at the first
    and last positions of max_position_embeddings and in between; a model moved to another dtype after the
    build computes them again instead of reading a table in the wrong dtype."""
    cfg = tiny_config(rope_parameters=YARN)
    _, model = make_pair(cfg, seed=2)
    model = model.to(dtype)
    model.process_weights_after_loading()
    table = model.rope_table
    assert table is not None and table.shape == (cfg.max_position_embeddings, 2, cfg.qk_rope_head_dim // 2)
    assert table.dtype == dtype
    positions = torch.tensor([0, 1, 7, cfg.max_position_embeddings // 2 + 3, cfg.max_position_embeddings - 1])
    hidden = torch.zeros(len(positions), cfg.hidden_size, dtype=dtype)
    cos, sin = model.rope_args(positions, hidden)
    want_cos, want_sin = model._rope_formula(positions, dtype)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert cos.untyped_storage().data_ptr() == sin.untyped_storage().data_ptr()  # views of one gather
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    cos2, _ = model.to(other).rope_args(positions, hidden.to(other))
    assert torch.equal(cos2, model._rope_formula(positions, other)[0])


def test_rope_table_end_mtp_clamps_main_path_raises():
    """Past the table's end: an MTP forward (whose chained drafting steps past a request's wanted drafts reach
    max_model_len + k - 4 in the engine's graphs) reads the last row, as the formula at the clamped position
    gives; the main model's rope_args raises instead of reading a wrong row."""
    from rayinfer.kernels.attention_metadata import AttentionMetadata

    cfg = tiny_config()
    _, model = make_pair(cfg, mtp=True)
    model.process_weights_after_loading()
    assert model.rope_table is not None
    end = cfg.max_position_embeddings
    positions = torch.tensor([end - 2, end - 1, end, end + 4])
    torch.manual_seed(3)
    ids, prev = torch.randint(0, cfg.vocab_size, (4,)), torch.randn(4, cfg.hidden_size)
    table, outs = model.rope_table, []
    with torch.no_grad():
        for rope_table, pos in ((table, positions), (None, positions.clamp(max=end - 1))):  # None: the formula
            model.rope_table = rope_table
            kv = torch.zeros(model.mtp_kv_cache_shape(4, BLOCK_SIZE))
            outs.append(model.mtp_forward(ids, prev, pos, kv, AttentionMetadata.build([4], [4], [[2]], BLOCK_SIZE)))
        assert torch.equal(outs[0], outs[1])
        model.rope_table = table
        with pytest.raises(IndexError):
            model.rope_args(positions, prev)
