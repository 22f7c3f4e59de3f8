"""Our Llama over the paged cache equals Hugging Face LlamaForCausalLM (float32, random weights)."""

import pytest
import torch
import transformers

from rayinfer.kernels.attention_metadata import AttentionMetadata
from rayinfer.model.llama import LlamaForCausalLM


def tiny_config(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=10000.0, tie_word_embeddings=True)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def test_llama_prefill_then_decode_matches_hf():
    torch.manual_seed(0)
    cfg = tiny_config()
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ours = LlamaForCausalLM(cfg).eval()
    ours.load_weights(ref.state_dict().items())
    block_size, num_blocks = 4, 16
    kv = torch.zeros(ours.kv_cache_shape(num_blocks, block_size))
    ids = torch.randint(0, 128, (11,))
    table = [5, 2, 9, 7]  # scattered blocks on purpose
    with torch.no_grad():
        expected = ref(ids[None]).logits[0]
        # chunk 1: 6 tokens; chunk 2: 4 tokens; then one decode token
        got = []
        for lo, hi in [(0, 6), (6, 10), (10, 11)]:
            meta = AttentionMetadata.build([hi - lo], [hi], [table], block_size)
            h = ours(ids[lo:hi], torch.arange(lo, hi), kv, meta)
            got.append(ours.compute_logits(h))
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-4, atol=1e-4)


def _one_row_vs_generic(paged, device, dtype):
    """``paged.one_row_vs_generic`` of a random Llama (norm weights not all ones, so a norm weight applied
    wrong shows): the one-row (fused-GEMV) path against the generic path."""
    from rayinfer.model.llama import LlamaDecoderLayer

    torch.manual_seed(1)
    cfg = tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(device=device, dtype=dtype)
    return paged.one_row_vs_generic(model, LlamaDecoderLayer, 4)


def test_one_row_path_matches_generic_forward(paged):
    """forward_one_row (norms and residual adds moved into the projections) computes the same layer as
    the generic forward: on CPU its dispatchers run the unfused ops, which checks the wiring."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cpu", torch.float32)
    assert calls == 2  # only the direct call: float32 on CPU keeps the generic path in forward
    torch.testing.assert_close(fused, generic)
    torch.testing.assert_close(direct, generic, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_row_path_matches_generic_forward_on_gpu(paged):
    """bf16 on the GPU: the fused GEMV kernels (with PDL where supported) take every layer of forward."""
    generic, fused, direct, calls = _one_row_vs_generic(paged, "cuda", torch.bfloat16)
    assert calls == 4  # 2 layers through forward, 2 through the direct call
    torch.testing.assert_close(fused.float(), generic.float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(direct.float(), fused.float(), rtol=0, atol=0)
