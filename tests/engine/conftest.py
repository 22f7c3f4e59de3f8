"""Engine-test factories: a tiny random Llama (float32, CPU) with the SmolLM2 tokenizer's vocab, its
Hugging Face twin as a reference, and engines built from them (no checkpoint, seconds per test)."""

import pytest
import torch

from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.engine.llm_engine import LLMEngine


def _tiny_config(tokenizer):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
        tie_word_embeddings=True, initializer_range=0.1, eos_token_id=tokenizer.eos_token_id,
        architectures=["LlamaForCausalLM"])


def hf_greedy(ref, prompt: list[int], num_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of the HF model by recomputing the whole sequence each step (no cache), and per
    step the gap between the top-2 logits."""
    ids, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(num_new):
            logits = ref(torch.tensor([ids])).logits[0, -1].float()
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], gaps


@pytest.fixture(scope="session")
def tiny_llama(tokenizer):
    """``(model, ref)``: our 2-layer :class:`~rayinfer.model.llama.LlamaForCausalLM` and a
    ``transformers.LlamaForCausalLM`` with the same random weights; vocab = the SmolLM2 tokenizer's."""
    import transformers

    from rayinfer.model.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = _tiny_config(tokenizer)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    model = LlamaForCausalLM(cfg)
    model.load_weights(ref.state_dict().items())
    return model.eval().requires_grad_(False), ref


@pytest.fixture
def tiny_engine(tiny_llama, tokenizer):
    """``tiny_engine(**engine_config_overrides)`` -> an :class:`LLMEngine` over the tiny model (CPU,
    block size 4, 64 blocks, context 512)."""

    def make(**kw):
        cfg = dict(device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=512,
                   async_scheduling=False)
        cfg.update(kw)
        return LLMEngine(ModelConfig("tiny-llama", max_model_len=512), EngineConfig(**cfg),
                         model=tiny_llama[0], tokenizer=tokenizer)

    return make


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama):
    """``tiny_reference(prompt, num_new)`` -> (greedy token ids, top-2 logit gaps) of the tiny model's
    Hugging Face twin, recomputing the whole sequence each step."""
    return lambda prompt, num_new: hf_greedy(tiny_llama[1], prompt, num_new)
