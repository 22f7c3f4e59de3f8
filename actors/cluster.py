"""How every entry point reaches Ray: join a cluster, or start an embedded one bound to loopback.

    from rayinfer.actors.cluster import RayConfig, init_ray
    init_ray(RayConfig(address="local"))   # a new embedded cluster, listening on 127.0.0.1 only

Ray's own ``ray.init()`` joins any cluster that ``ray start`` left running on the machine (someone
else's, possibly) and starts an embedded one that listens on every interface. ``init_ray`` makes both
visible and safe: it logs which cluster it joined, ``address="local"`` always starts a new one, and an
embedded cluster listens on ``node_ip_address`` (loopback unless asked otherwise).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from rayinfer import envs

LOOPBACK = "127.0.0.1"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_worker_logging(level: int = logging.INFO) -> None:
    """Show rayinfer's log records of a Ray worker process (each actor's ``__init__`` calls this): ``level``
    and above go to stderr as ``time LEVEL logger: message``, which Ray forwards to the driver after the
    actor's name and pid. A worker's root logger has no handler, so it would show warnings only; Ray's
    own ``LoggingConfig`` shows them but appends eight ids of Ray's context (job, worker, node, actor,
    task...) to every line.

    Idempotent. A process whose root logger has a handler (a driver under Hydra, a test) is left as it is:
    its rayinfer records already reach that handler.
    """
    logger = logging.getLogger("rayinfer")
    if logging.getLogger().handlers or any(getattr(h, "rayinfer_worker", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S"))
    handler.rayinfer_worker = True  # pyright: ignore[reportAttributeAccessIssue]
    logger.addHandler(handler)
    logger.setLevel(level)


class RayStartError(RuntimeError):
    """Ray could not be joined or started; the message is one line that names the address, where it
    came from and why (the entry points print it and exit, without a traceback)."""


@dataclass
class RayConfig:
    """Which Ray cluster an entry point uses (the ``ray`` key of the batch job's and the service's config).

    Attributes:
        address: None: ``$RAY_ADDRESS`` when set, else a cluster already started on this machine with
            ``ray start`` (joined, and logged), else a new embedded one. "local": always a new embedded
            cluster. "auto", "host:port" or "ray://host:port": that cluster.
        node_ip_address: the address an embedded cluster's processes listen on: "127.0.0.1" (default:
            reachable from this machine only) or "auto" (Ray's choice: the machine's IP, every
            interface, so other machines can join it). Not used when joining a cluster.
    """

    address: str | None = None
    node_ip_address: str = LOOPBACK

    def __post_init__(self):
        if self.address is not None and not str(self.address).strip():
            raise ValueError("ray.address must be null, 'local', 'auto', host:port or ray://host:port; got ''")
        if not str(self.node_ip_address).strip():
            raise ValueError("ray.node_ip_address must be an IP address or 'auto'")


def resolve_address(cfg: RayConfig) -> tuple[str | None, str]:
    """The address to pass to ``ray.init`` (None: start an embedded cluster) and where it came from.

    Returns:
        (address, source): source is "ray.address", "RAY_ADDRESS", "running on this machine" or
        "embedded".
    """
    if cfg.address == "local":
        return None, "embedded"
    if cfg.address is not None:
        return cfg.address, "ray.address"
    env = envs.ray_address()
    if env and env != "local":
        return env, "RAY_ADDRESS"
    if env == "local":
        return None, "embedded"
    found = _running_cluster()
    return (found, "running on this machine") if found else (None, "embedded")


def _running_cluster() -> str | None:
    """The GCS address of a cluster that ``ray start`` left on this machine (what a bare ``ray.init()``
    would join), or None."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address(None)  # pyright: ignore[reportArgumentType]
    except Exception:  # noqa: BLE001 - none that answers: start one of our own
        return None


def init_ray(cfg: RayConfig | None = None, *, num_cpus: int | None = None, **kwargs: Any) -> str:
    """Connect this process to Ray per ``cfg`` unless it already is; returns a one-line description of
    the cluster (the entry points print it).

    Args:
        cfg: which cluster (default: ``RayConfig()``).
        num_cpus: logical CPUs of an embedded cluster (default: the machine's).
        kwargs: more ``ray.init`` arguments (logging, ...).
    Raises:
        ValueError: ``num_cpus`` given for a cluster that is joined, not started.
        RayStartError: when the cluster cannot be joined (nothing answers at a ``host:port`` address:
            at once) or started; one line with Ray's reason.
    """
    import ray

    cfg = cfg or RayConfig()
    if not sys.stdout.isatty():  # the actors' log lines Ray prints here: no colour codes in a file or pipe
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if num_cpus is not None and (cfg.address not in (None, "local") or resolve_address(cfg)[0] is not None):
        raise ValueError("num_cpus sizes an embedded cluster; a joined cluster keeps its own")
    if ray.is_initialized():
        return f"using the Ray cluster this process already joined ({ray.get_runtime_context().gcs_address})"
    address, source = resolve_address(cfg)
    kwargs.setdefault("include_dashboard", False)
    if address is None:
        _check_own_address(cfg.node_ip_address)
        try:
            _init_embedded(cfg.node_ip_address, {**kwargs, "num_cpus": num_cpus})
        except Exception as e:  # noqa: BLE001 - whatever Ray raised, as one line
            raise RayStartError(f"could not start an embedded Ray cluster: {_first_line(e)}") from e
        gcs = ray.get_runtime_context().gcs_address
        where = "loopback only" if cfg.node_ip_address == LOOPBACK else "all interfaces"
        line = f"started an embedded Ray cluster at {gcs} ({where})"
    else:
        _check_reachable(address, source)
        try:
            with _keep_loopback(_is_loopback(address)):
                ray.init(address=address, **kwargs)
        except Exception as e:  # noqa: BLE001 - whatever Ray raised, as one line
            raise RayStartError(f"could not join the Ray cluster at {address} ({source}): {_first_line(e)}") from e
        line = (f"joined the Ray cluster at {ray.get_runtime_context().gcs_address} ({source}: {address}); "
                "ray.address=local starts a cluster of this job's own")
    return line


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _check_reachable(address: str, source: str, timeout_s: float = 3.0) -> None:
    """Fail at once when a ``host:port`` address has nothing listening (``ray.init`` would retry for
    minutes, logging a warning every few seconds). "auto" and ``ray://`` addresses are left to Ray.

    Raises:
        RayStartError: naming the address, where it came from, and the socket error.
    """
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise RayStartError(f"no Ray cluster answers at {address} ({source}): {e.strerror or e}; start one "
                            "with `ray start --head`, or use ray.address=local for a cluster of this job's own") from None


def _check_own_address(node_ip_address: str) -> None:
    """An embedded cluster can only listen on an address of this machine (Ray would wait for minutes).

    Raises:
        RayStartError: when ``node_ip_address`` is not "auto" and cannot be bound here.
    """
    if node_ip_address == "auto":
        return
    try:
        with socket.socket(socket.AF_INET6 if ":" in node_ip_address else socket.AF_INET) as s:
            s.bind((node_ip_address, 0))
    except OSError as e:
        raise RayStartError(f"ray.node_ip_address={node_ip_address} is not an address of this machine "
                            f"({e.strerror or e}); use 127.0.0.1 or auto") from None


def _init_embedded(node_ip_address: str, kwargs: dict[str, Any]) -> None:
    """``ray.init(address="local")`` whose processes listen on ``node_ip_address``."""
    import ray

    if node_ip_address == "auto":
        ray.init(address="local", **kwargs)
        return
    with _keep_loopback(node_ip_address == LOOPBACK):
        ray.init(address="local", _node_ip_address=node_ip_address, **kwargs)


@contextlib.contextmanager
def _keep_loopback(enabled: bool):
    """While ``enabled``, stop Ray from replacing a loopback address by the machine's IP.

    Ray does that (and its servers then listen on every interface) unless multi-node clusters are off,
    as on macOS; its switch is the module constant ``ray_constants.ENABLE_RAY_CLUSTER``, turned off here
    for the duration of one ``ray.init`` only (a driver joining a loopback cluster needs it too).
    """
    from ray._private import ray_constants

    if not enabled:
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _is_loopback(address: str) -> bool:
    host = address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")
