import pytest

from rayinfer.placement.parallel_config import ParallelConfig


def test_defaults_are_one_cpu_rank():
    cfg = ParallelConfig()
    assert (cfg.num_replicas, cfg.ranks_per_replica, cfg.world_size) == (1, 1, 1)
    assert not cfg.is_disaggregated
    assert (cfg.num_nodes, cfg.ep_num_nodes) == (1, 1)


def test_colocated_sizes():
    cfg = ParallelConfig(dp=2, cp=2, ep=4, device="gpu", devices_per_node=8)
    assert cfg.num_replicas == 2
    assert cfg.ranks_per_replica == 8
    assert cfg.world_size == 16
    assert cfg.num_nodes == 2
    assert cfg.ep_num_nodes == 1


def test_disaggregated_sizes():
    cfg = ParallelConfig(ep=16, num_prefill=2, num_decode=3, devices_per_node=8)
    assert cfg.is_disaggregated
    assert cfg.num_replicas == 5
    assert cfg.world_size == 80
    assert cfg.num_nodes == 10
    assert cfg.ep_num_nodes == 2


def test_frozen():
    with pytest.raises(Exception):
        ParallelConfig().dp = 2


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(dp=0), "dp"),
        (dict(cp=-1), "cp"),
        (dict(ep=0), "ep"),
        (dict(ep=1.5), "ep"),
        (dict(tp=2), "tp"),
        (dict(device="tpu"), "device"),
        (dict(num_prefill=-1), "num_prefill"),
        (dict(num_prefill=1), "num_decode"),
        (dict(num_decode=2), "num_prefill"),
        (dict(dp=2, num_prefill=1, num_decode=1), "dp"),
        (dict(devices_per_node=0), "devices_per_node"),
        (dict(ep=6, devices_per_node=4), "devices_per_node"),  # EP group straddles nodes
        (dict(cp=3, ep=2, devices_per_node=3), "devices_per_node"),  # replica fits, EP group does not
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**kwargs)


def test_topology_and_device_kind():
    assert ParallelConfig().topology == "colocated"
    assert ParallelConfig(dp=3).topology == "colocated"
    assert ParallelConfig(num_prefill=2, num_decode=1).topology == "pd"
    assert ParallelConfig(ep=2).topology == "ep"
    assert ParallelConfig().device_kind == "cpu"
    assert ParallelConfig(num_gpus_per_replica=0.5).device_kind == "gpu"
    assert ParallelConfig(device="npu").device_kind == "npu"


def test_sections_validate_and_copy():
    import dataclasses

    from rayinfer.placement.parallel_config import EncoderSection, EPLBSection, PDSection

    cfg = ParallelConfig(num_prefill=1, num_decode=1, pd=PDSection(kv_transport="gloo", max_retries=2),
                         eplb=EPLBSection(num_redundant_experts=2, interval=10))
    assert (cfg.pd.kv_transport, cfg.pd.max_retries, cfg.eplb.interval) == ("gloo", 2, 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pd.max_retries = 3
    assert dataclasses.replace(cfg, dp=1, num_prefill=2).num_replicas == 3
    for section, kwargs, field in [(PDSection, dict(kv_transport="tcp"), "pd.kv_transport"),
                                   (PDSection, dict(max_retries=-1), "pd.max_retries"),
                                   (PDSection, dict(retry_deadline_s=-1.0), "pd.retry_deadline_s"),
                                   (PDSection, dict(retry_deadline_s=float("nan")), "pd.retry_deadline_s"),
                                   (PDSection, dict(kv_store_max_gib=0), "pd.kv_store_max_gib"),
                                   (PDSection, dict(device_retry_s=-5), "pd.device_retry_s"),
                                   (PDSection, dict(device_retry_s="soon"), "pd.device_retry_s"),
                                   (PDSection, dict(device_retry_s=float("inf")), "pd.device_retry_s"),
                                   (PDSection, dict(device_retry_s=1000), "pd.device_retry_s"),
                                   (EPLBSection, dict(window=0), "eplb.window"),
                                   (EncoderSection, dict(num_encoders=-1), "encoder.num_encoders"),
                                   (EncoderSection, dict(num_encoders=1.5), "encoder.num_encoders"),
                                   (EncoderSection, dict(cache_tokens=-1), "encoder.cache_tokens")]:
        with pytest.raises(ValueError, match=field):
            section(**kwargs)
    for kwargs, field in [(dict(num_gpus_per_replica=-1), "num_gpus_per_replica"),
                          (dict(device="cpu", num_gpus_per_replica=1), "num_gpus_per_replica"),
                          (dict(num_cpus_per_replica=0), "num_cpus_per_replica"),
                          (dict(max_restarts=-2), "max_restarts"),
                          (dict(placement_timeout_s=0), "placement_timeout_s")]:
        with pytest.raises(ValueError, match=field):
            ParallelConfig(**kwargs)


def test_kv_store_section():
    from rayinfer.placement.parallel_config import KVStoreSection, ParallelConfig

    p = ParallelConfig(dp=2, kv_store={"enabled": True, "directory": "/tmp/kv"})
    assert isinstance(p.kv_store, KVStoreSection) and p.kv_store.enabled and p.kv_store.ttl_s == 3 * 24 * 3600
    assert not ParallelConfig().kv_store.enabled  # opt-in
    for bad in ({"max_gib": 0}, {"ttl_s": -1}, {"directory": ""}, {"max_blocks": 0}, {"enabled": "yes"}):
        with pytest.raises(ValueError, match="kv_store"):
            KVStoreSection(**bad)


def test_eplb_profiles_fill_unset_fields_and_round_up_the_redundant_experts():
    """DeepSeek's published EPLB settings per role; explicit fields win; a profile's redundant experts are
    a minimum rounded up to split over the ranks, an explicit count must split as given."""
    from rayinfer.placement.parallel_config import EPLBSection

    prefill, decode = EPLBSection(profile="prefill"), EPLBSection(profile="decode")
    assert (prefill.rebalance_interval, prefill.load_window) == (1000, 100)
    assert (decode.rebalance_interval, decode.load_window) == (10000, 1000)
    assert prefill.num_physical(64, 2) == 68 and prefill.num_physical(64, 8) == 72  # >= 4 redundant
    assert decode.num_physical(64, 1) == 65 and decode.num_physical(64, 4) == 68  # >= 1 redundant
    mine = EPLBSection(profile="decode", interval=50, num_redundant_experts=2)
    assert (mine.rebalance_interval, mine.load_window, mine.num_physical(64, 2)) == (50, 1000, 66)
    plain = EPLBSection()
    assert (plain.rebalance_interval, plain.load_window, plain.num_physical(64, 4)) == (0, 1000, 64)
    with pytest.raises(ValueError, match="do not split over ep=4"):
        EPLBSection(num_redundant_experts=1).num_physical(64, 4)
    with pytest.raises(ValueError, match="set eplb.num_redundant_experts or eplb.profile"):
        plain.num_physical(6, 4)
    with pytest.raises(ValueError, match="eplb.profile must be one of"):
        EPLBSection(profile="serving")
