"""The OpenAI-compatible HTTP app: FastAPI ingress replicas (a Ray Serve deployment) in front of one
engine fleet, which its own deployment (``EngineFleet``) starts once and owns through a Router actor.

    serve run conf/serve.yaml                                   # Serve config file -> build_app
    serve run rayinfer.serve.app:build_app api_key=secret       # builder with Hydra overrides as args
    python jobs/serve.py port=8001 engine.num_kv_blocks=2048    # Hydra entry point

Endpoints (``serve/frontend.py``): ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), ``/docs``. Every error is an
OpenAI error object; with ``api_key`` set, everything but ``/health`` needs ``Authorization: Bearer
<api_key>`` (``/metrics`` and the docs stay open with ``public_metrics_and_docs``).
"""

import json
import logging
from typing import Any

import ray
from ray import serve

from rayinfer.actors.cluster import configure_worker_logging
from rayinfer.actors.client import connect, start_fleet
from rayinfer.model.loader import load_tokenizer
from rayinfer.serve.config import ServeConfig, compose_config
from rayinfer.serve.frontend import OpenAIFrontend, create_app

logger = logging.getLogger(__name__)


@serve.deployment(name="EngineFleet", num_replicas=1, ray_actor_options={"num_cpus": 0})
class EngineFleet:
    """Owns the service's engine fleet: starts the Router actor (and through it every replica) once, and
    hands its handle to every ingress replica. Deleting the app stops the fleet with it.

    Args:
        cfg: the service config (``model``, ``engine``, ``parallel``).
    """

    def __init__(self, cfg: ServeConfig):
        configure_worker_logging()
        self.router = start_fleet(cfg.model, cfg.engine, cfg.parallel)
        ray.get(self.router.start.remote())  # start-up errors fail the deployment, with their message

    async def router_handle(self):
        """The Router actor's handle (clients stream from the replicas directly and ask it to route)."""
        return self.router

    def __del__(self):
        try:
            ray.get(self.router.shutdown.remote(), timeout=30)
            ray.kill(self.router)
        except Exception:  # noqa: BLE001 - the cluster may already be gone
            pass


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress()
class OpenAIIngress:
    """An ingress replica: the FastAPI app of :mod:`rayinfer.serve.frontend` around a client of the fleet.

    Args:
        cfg: the service config.
        fleet: the ``EngineFleet`` deployment's handle; the replica connects a client to its Router on the
            first request (it starts nothing itself, so any number of ingress replicas share one fleet).
    """

    def __init__(self, cfg: ServeConfig, fleet):
        configure_worker_logging()
        self.cfg = cfg
        self.fleet = fleet
        self.frontend = OpenAIFrontend(cfg, load_tokenizer(cfg.model.model), self._connect)

    def __serve_build_asgi_app__(self):
        return create_app(self.frontend)

    async def _connect(self):
        router = await self.fleet.router_handle.remote()
        client = await connect(router)
        logger.info("connected to the %s fleet", self.cfg.parallel.topology)
        return client

    async def engine_stats(self):
        """The fleet's :class:`~rayinfer.engine.protocol.FleetStats` (for tests and operators through a
        DeploymentHandle)."""
        await self.frontend.connect()
        return await self.frontend.client.stats()


def build_app_from_config(cfg: ServeConfig):
    """The Serve application for a config: the ingress replicas bound to one EngineFleet."""
    fleet = EngineFleet.bind(cfg)
    return OpenAIIngress.options(max_ongoing_requests=cfg.max_ongoing_requests,
                                 num_replicas=cfg.num_ingress_replicas).bind(cfg, fleet)


def build_app(args: dict[str, Any] | None = None):
    """Serve application builder (``import_path: rayinfer.serve.app:build_app``).

    Args:
        args: ``{"overrides": [...]}`` Hydra overrides of conf/serve.yaml, and/or ``key: value`` pairs
            taken as overrides (what ``serve run rayinfer.serve.app:build_app key=value`` passes).
    Raises:
        ValueError: for a bad override or config value.
    """
    args = dict(args or {})
    overrides = args.pop("overrides", None) or []
    if isinstance(overrides, str):
        overrides = overrides.split()
    overrides = list(overrides) + [f"{k}={_override_value(v)}" for k, v in args.items()]
    return build_app_from_config(compose_config(overrides))


def _override_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, list, bool, int, float)):
        return json.dumps(value)
    return str(value)
