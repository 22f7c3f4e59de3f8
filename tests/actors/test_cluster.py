"""Which Ray cluster an entry point uses: RAY_ADDRESS, a running one (logged), or an embedded one that
listens on loopback only."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rayinfer.actors import cluster
from rayinfer.actors.cluster import RayConfig, resolve_address

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("address, env, running, want", [
    (None, None, None, (None, "embedded")),
    (None, None, "10.0.0.5:6379", ("10.0.0.5:6379", "running on this machine")),
    (None, "10.0.0.7:6379", "10.0.0.5:6379", ("10.0.0.7:6379", "RAY_ADDRESS")),
    (None, "local", "10.0.0.5:6379", (None, "embedded")),
    ("local", "10.0.0.7:6379", "10.0.0.5:6379", (None, "embedded")),
    ("ray://head:10001", "10.0.0.7:6379", None, ("ray://head:10001", "ray.address")),
])
def test_resolve_address_order(monkeypatch, address, env, running, want):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if env is not None:
        monkeypatch.setenv("RAY_ADDRESS", env)
    monkeypatch.setattr(cluster, "_running_cluster", lambda: running)
    assert resolve_address(RayConfig(address=address)) == want


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="ray.address"):
        RayConfig(address=" ")


PROBE = textwrap.dedent("""
    import json, sys
    import ray
    import psutil  # Ray's vendored copy, on the path once ray is imported
    from rayinfer.actors.cluster import RayConfig, init_ray

    local = sys.argv[1] == "local"
    line = init_ray(RayConfig(address=sys.argv[1]), num_cpus=1 if local else None, log_to_driver=False)
    me = psutil.Process()
    pids = {me.pid} | {c.pid for c in me.children(recursive=True)}
    listening = sorted({c.laddr.ip for c in psutil.net_connections(kind="inet")
                        if c.status == "LISTEN" and c.pid in pids})
    print(json.dumps({"line": line, "listening": listening, "gcs": ray.get_runtime_context().gcs_address}))
    ray.shutdown()
""")


def probe(address: str, env: dict | None = None) -> dict:
    import os

    proc = subprocess.run([sys.executable, "-c", PROBE, address], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_embedded_cluster_listens_on_loopback_only():
    got = probe("local")
    assert got["line"].startswith("started an embedded Ray cluster at 127.0.0.1:")
    assert got["gcs"].startswith("127.0.0.1:")
    assert got["listening"], "no listening socket found"
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for ip in got["listening"]), got["listening"]


def test_joining_a_cluster_names_it(ray_cluster):
    gcs = ray_cluster.get_runtime_context().gcs_address
    got = probe(gcs)
    assert got["gcs"] == gcs
    assert got["line"].startswith(f"joined the Ray cluster at {gcs} (ray.address: {gcs})")
    assert "ray.address=local" in got["line"]


def test_an_address_nothing_answers_fails_at_once_in_one_line():
    """Ray's own ray.init retries such an address for minutes, logging a warning every few seconds."""
    import socket
    import time

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(cluster.RayStartError) as e:
        cluster._check_reachable(f"127.0.0.1:{port}", "RAY_ADDRESS")
    assert time.monotonic() - start < 5
    assert str(e.value).startswith(f"no Ray cluster answers at 127.0.0.1:{port} (RAY_ADDRESS)")
    assert "\n" not in str(e.value)
    cluster._check_reachable("auto", "ray.address")  # left to Ray
    cluster._check_reachable("ray://head:10001", "ray.address")


def test_an_embedded_cluster_needs_an_address_of_this_machine():
    cluster._check_own_address("127.0.0.1")
    cluster._check_own_address("auto")
    with pytest.raises(cluster.RayStartError, match="203.0.113.77 is not an address of this machine"):
        cluster._check_own_address("203.0.113.77")  # TEST-NET-3: documentation only, never local


@pytest.mark.parametrize("root_handler", [False, True], ids=["worker", "driver"])
def test_worker_logging_shows_rayinfer_info_once_in_one_short_line(root_handler):
    """An actor's process (no root handler) prints rayinfer's INFO records as ``time LEVEL logger: message``,
    once however often the actors' inits call it; a process with a root handler (a driver) keeps its own."""
    code = textwrap.dedent(f"""
        import logging
        if {root_handler}:
            logging.basicConfig(level=logging.INFO, format="root %(levelname)s %(name)s: %(message)s")
        from rayinfer.actors.cluster import configure_worker_logging
        configure_worker_logging()
        configure_worker_logging()
        logging.getLogger("rayinfer.engine.llm_engine").info("engine ready")
        logging.getLogger("rayinfer.engine.llm_engine").debug("not shown")
    """)
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stderr
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    if root_handler:
        assert lines[0] == "root INFO rayinfer.engine.llm_engine: engine ready"
    else:
        assert lines[0].endswith(" INFO rayinfer.engine.llm_engine: engine ready") and len(lines[0]) < 60
