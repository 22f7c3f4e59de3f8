"""The tiny MoE shapes (dummy weights, both MoE architectures): ``parallel=ep2 model=<tiny-moe>`` runs the
batch job on CPU, and its greedy answers equal one engine's on the same weights (every EP rank draws the
one-process model's dummy experts), with EPLB rebalancing along the way."""

import json

import pytest
from omegaconf import OmegaConf

from rayinfer.cli import compose
from rayinfer.jobs import generate

PROMPTS = ["Hello there", "One two three four", "x"]
MAX_TOKENS = 5


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "deepseek-v3-tiny"])
def test_ep2_runs_the_tiny_moe_like_one_engine(model, tmp_path, ray_cluster):
    from rayinfer.engine.config import EngineConfig
    from rayinfer.engine.llm_engine import LLMEngine
    from rayinfer.engine.types import SamplingParams

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    generate.register_configs()
    # the command line of the README: python jobs/generate.py parallel=ep2 model=<tiny-moe> (+ a small run)
    cfg = OmegaConf.to_object(compose("generate", [
        "parallel=ep2", f"model={model}", "engine.device=cpu", "engine.num_kv_blocks=64", f"input={inp}",
        f"output={out}", f"sampling.max_tokens={MAX_TOKENS}", "+sampling.ignore_eos=true",
        "parallel.eplb.interval=2", "parallel.eplb.window=4"]))
    assert isinstance(cfg, generate.GenerateConfig) and cfg.parallel.topology == "ep"
    assert generate.run(cfg) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert all(r["error"] is None and len(r["output_token_ids"]) == MAX_TOKENS for r in recs), recs

    engine = LLMEngine(cfg.model, EngineConfig(device="cpu", num_kv_blocks=64))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = engine.generate([r["prompt_token_ids"] for r in recs], [greedy] * len(recs), [r["id"] for r in recs])
    assert [r["output_token_ids"] for r in recs] == [c.output_token_ids for c in want]
