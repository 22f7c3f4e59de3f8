"""Our Llama over the paged cache equals Hugging Face LlamaForCausalLM (float32, random weights)."""

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
