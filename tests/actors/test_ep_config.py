"""conf/parallel/*.yaml are valid ParallelConfigs of the topology their name says (no Ray needed)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from rayinfer.actors.ep_group import moe_shape
from rayinfer.placement.parallel_config import ParallelConfig

CONF = Path(__file__).resolve().parents[2] / "conf" / "parallel"


def load(name: str) -> ParallelConfig:
    """The YAML merged into the structured schema, as Hydra does (a misspelt key raises)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.load(CONF / f"{name}.yaml")))


@pytest.mark.parametrize("name, ep", [("ep2", 2), ("ep4", 4)])
def test_ep_yaml(name, ep):
    cfg = load(name)
    assert cfg.topology == "ep" and cfg.ep == ep and cfg.eplb.profile == "decode"
    assert (cfg.eplb.rebalance_interval, cfg.eplb.load_window) == (10000, 1000)  # DeepSeek's decode settings
    # DeepSeek-V2-Lite's 64 experts + at least 1 redundant, rounded up to split over the ranks
    assert cfg.eplb.num_physical(64, cfg.ep) == {2: 66, 4: 68}[ep]


@pytest.mark.parametrize("name, topology, num_replicas", [
    ("colocated", "colocated", 1), ("1p1d", "pd", 2), ("2p1d", "pd", 3), ("2p2d", "pd", 4)])
def test_other_yamls(name, topology, num_replicas):
    cfg = load(name)
    assert (cfg.topology, cfg.num_replicas) == (topology, num_replicas)


@pytest.mark.parametrize("name, num_encoders", [("epd", 1), ("2e1p1d", 2)])
def test_epd_yamls(name, num_encoders):
    from rayinfer.placement import encoder_bundle_indices, placement_bundles

    cfg = load(name)
    assert (cfg.topology, cfg.num_replicas, cfg.num_encoders) == ("pd", 2, num_encoders)
    assert len(placement_bundles(cfg)) == cfg.num_bundles == 2 + num_encoders
    assert encoder_bundle_indices(cfg) == list(range(2, 2 + num_encoders))  # after the engine ranks


def test_misspelt_key_is_rejected():
    with pytest.raises(Exception, match="eplb_interval"):
        OmegaConf.merge(OmegaConf.structured(ParallelConfig), {"eplb_interval": 3})
    with pytest.raises(ValueError, match="ep"):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ParallelConfig), {"ep": 0}))


def test_moe_shape():
    from types import SimpleNamespace

    assert moe_shape(SimpleNamespace(n_routed_experts=64, n_group=8)) == (64, 8)
    assert moe_shape(SimpleNamespace(num_experts=128)) == (128, 1)
    with pytest.raises(ValueError, match="not a MoE model"):
        moe_shape(SimpleNamespace(architectures=["LlamaForCausalLM"]))
