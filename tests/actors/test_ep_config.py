"""conf/parallel/ep*.yaml are valid EP configs (no Ray needed)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rayinfer.actors.ep_group import ep_config_from_parallel, moe_shape
from rayinfer.engine.config import EPConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "parallel"


@pytest.mark.parametrize("name, ep", [("ep2", 2), ("ep4", 4)])
def test_parallel_yaml_is_an_ep_config(name, ep):
    node = OmegaConf.load(CONF / f"{name}.yaml")
    assert node.topology == "ep"
    cfg = ep_config_from_parallel(node)
    assert cfg.ep == ep and cfg.eplb_interval > 0 and cfg.eplb_window > 0
    assert (64 + cfg.num_redundant_experts) % cfg.ep == 0  # fits DeepSeek-V2-Lite's 64 experts
    # every other key is a field of the structured schema (Hydra would reject a misspelt one)
    merged = OmegaConf.merge(OmegaConf.structured(EPConfig), {k: v for k, v in node.items() if k != "topology"})
    assert OmegaConf.to_object(merged) == cfg
    with pytest.raises(ValueError, match="ep"):
        ep_config_from_parallel({**OmegaConf.to_container(node), "ep": 0})


def test_moe_shape():
    from types import SimpleNamespace

    assert moe_shape(SimpleNamespace(n_routed_experts=64, n_group=8)) == (64, 8)
    assert moe_shape(SimpleNamespace(num_experts=128)) == (128, 1)
    with pytest.raises(ValueError, match="not a MoE model"):
        moe_shape(SimpleNamespace(architectures=["LlamaForCausalLM"]))
