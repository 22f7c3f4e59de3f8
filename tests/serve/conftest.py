"""One live Serve app (SmolLM2 on CPU) per test session, shared by every tests/serve module that asks.

Starting Ray, Serve and the engine takes a while, so the app is session-scoped and modules that do not
need it (pure unit tests) never start it.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass

import pytest

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 512


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    api_key: str
    model: str
    app_name: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def engine_stats(self) -> list[dict]:
        """Each replica's stats as a dict (``FleetStats.replicas``)."""
        from ray import serve

        return [r.to_dict() for r in serve.get_app_handle(self.app_name).engine_stats.remote().result().replicas]

    def wait_all_blocks_free(self, timeout_s: float = 30.0) -> list[dict]:
        """Poll until every replica has no requests and all KV blocks free; returns the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine_stats()
            if all(s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0 and s["num_waiting"] == 0
                   for s in stats):
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session(ray_cluster):
    """The session's Ray instance (tests/conftest.py), with Serve shut down after the serve tests."""
    yield
    from ray import serve

    serve.shutdown()


@pytest.fixture(scope="session")
def live_server(ray_session) -> LiveServer:
    from ray import serve

    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.placement.parallel_config import ParallelConfig
    from rayinfer.serve.app import build_app_from_config
    from rayinfer.serve.config import ServeConfig

    cfg = ServeConfig(model=ModelConfig(max_model_len=MAX_MODEL_LEN),
                      engine=EngineConfig(device="cpu", num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=64),
                      api_key=API_KEY, parallel=ParallelConfig(dp=1, num_cpus_per_replica=2))
    for attempt in range(3):
        # the free port can be taken between probing it and Serve's proxy binding it (Ray's own processes
        # open ports meanwhile): then Serve starts again on another one
        port = _free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app_from_config(cfg), name="rayinfer-test", route_prefix="/")
            break
        except Exception as e:  # noqa: BLE001 - only a failed bind is retried
            if "Failed to bind" not in str(e) or attempt == 2:
                raise
            serve.shutdown()
    return LiveServer(f"http://127.0.0.1:{port}", API_KEY, cfg.model_name, "rayinfer-test")


@pytest.fixture(scope="session")
def client(live_server):
    import openai

    return openai.OpenAI(base_url=live_server.v1, api_key=live_server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(live_server) -> str:
    return live_server.model
