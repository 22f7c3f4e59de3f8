import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """A small embedded Ray instance for the tests that need one (reuses a running one)."""
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
