"""The OpenAI-compatible HTTP app: FastAPI ingress replicas (a Ray Serve deployment) in front of one
engine fleet, which its own deployment (``EngineFleet``) starts once and owns through a Router actor.

    serve run conf/serve.yaml                                   # Serve config file -> build_app
    serve run rayinfer.serve.app:build_app api_key=secret       # builder with Hydra overrides as args
    python jobs/serve.py port=8001 engine.num_kv_blocks=2048    # Hydra entry point

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). Every error is an OpenAI error object; with ``api_key`` set, ``/v1/*``
needs ``Authorization: Bearer <api_key>``.
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures (Request) through Serve's
# wrapper, which cannot resolve string annotations
import hmac
import json
import logging
import time
from typing import Any, AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayinfer.actors.client import connect, start_fleet
from rayinfer.model.loader import load_tokenizer
from rayinfer.serve.config import ServeConfig, compose_config
from rayinfer.serve.metrics import CONTENT_TYPE, ServeMetrics
from rayinfer.serve.protocol import APIError, from_error
from rayinfer.serve.serving import OpenAIServing
from rayinfer.serve.serving_chat import ChatServing
from rayinfer.serve.serving_completion import CompletionServing

logger = logging.getLogger(__name__)

app = FastAPI(title="rayinfer", description="OpenAI-compatible LLM inference on Ray Serve")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = APIError(str(exc.detail), status=exc.status_code,
                   code="not_found" if exc.status_code == 404 else None)
    return JSONResponse(err.body(), status_code=exc.status_code)


@app.exception_handler(APIError)
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@serve.deployment(name="EngineFleet", num_replicas=1, ray_actor_options={"num_cpus": 0})
class EngineFleet:
    """Owns the service's engine fleet: starts the Router actor (and through it every replica) once, and
    hands its handle to every ingress replica. Deleting the app stops the fleet with it.

    Args:
        cfg: the service config (``model``, ``engine``, ``parallel``).
    """

    def __init__(self, cfg: ServeConfig):
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
@serve.ingress(app)
class OpenAIIngress:
    """An ingress replica: validates requests, renders prompts, fans out ``n``, streams.

    Args:
        cfg: the service config.
        fleet: the ``EngineFleet`` deployment's handle; the replica connects a client to its Router (it
            starts nothing itself, so any number of ingress replicas share one fleet).
    """

    def __init__(self, cfg: ServeConfig, fleet):
        self.cfg = cfg
        self.fleet = fleet
        self.model_name = cfg.model_name
        self.created = int(time.time())
        self.tokenizer = load_tokenizer(cfg.model.model)
        self.metrics = ServeMetrics(self.model_name)
        self.client = None
        self.serving = self.chat = self.completion = None

    async def _connect(self) -> None:
        """Connect to the fleet on first use (Serve constructs replicas synchronously)."""
        if self.client is not None:
            return
        router = await self.fleet.router_handle.remote()
        client = await connect(router)
        self.serving = OpenAIServing(client, self.tokenizer, self.model_name, client.max_model_len, self.metrics)
        self.chat = ChatServing(self.serving)
        self.completion = CompletionServing(self.serving)
        self.client = client
        logger.info("serving %s (%s fleet), context %d", self.model_name, self.cfg.parallel.topology,
                    client.max_model_len)

    # -- helpers -------------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        expected = str(self.cfg.api_key).encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'", status=401,
                           type="authentication_error", code="invalid_api_key")

    @staticmethod
    async def _json_body(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None

    async def _handle(self, endpoint: str, handler_name: str, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            self._check_auth(request)
            await self._connect()
            handler = getattr(self, handler_name)
            result = await handler.create(await self._json_body(request), arrival)
        except APIError as e:
            self.metrics.count_request(endpoint, f"error_{e.status}")
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # mapped by type; a bug or a dead replica fails this request only
            err = from_error(e)
            if err.status >= 500:
                logger.exception("request to %s failed", endpoint)
            self.metrics.count_request(endpoint, f"error_{err.status}")
            return JSONResponse(err.body(), status_code=err.status)
        if isinstance(result, dict):
            self.metrics.count_request(endpoint, "ok")
            return JSONResponse(result)
        return StreamingResponse(self._counted(endpoint, result), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _counted(self, endpoint: str, events: AsyncIterator[str]) -> AsyncIterator[str]:
        outcome = "cancelled"
        try:
            async for event in events:
                yield event
            outcome = "ok"
        finally:
            await events.aclose()  # on a client disconnect: aborts the engine requests, frees their KV
            self.metrics.count_request(endpoint, outcome)

    # -- routes --------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle("chat", "chat", request)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle("completions", "completion", request)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
            await self._connect()
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rayinfer",
                "root": self.cfg.model.model, "max_model_len": self.client.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await self._connect()
            stats = await self.client.stats()
        except Exception as e:  # noqa: BLE001 - any replica failure means unhealthy
            logger.warning("health check failed: %s", e)
            return JSONResponse({"status": "unhealthy", "error": type(e).__name__}, status_code=503)
        failed = [r.replica_id for r in stats.replicas if r.error]
        if failed:
            return JSONResponse({"status": "unhealthy", "error": f"replicas {failed} unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        try:
            await self._connect()
            self.metrics.set_engine_stats(await self.client.stats())
        except Exception:  # noqa: BLE001 - still expose the request-level metrics
            logger.exception("engine stats unavailable")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def engine_stats(self):
        """The fleet's :class:`~rayinfer.engine.protocol.FleetStats` (for tests and operators through a
        DeploymentHandle)."""
        await self._connect()
        return await self.client.stats()


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
