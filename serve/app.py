"""The OpenAI-compatible HTTP app: a FastAPI ingress as a Ray Serve deployment in front of EngineActors.

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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayinfer.serve.config import ServeConfig, compose_config
from rayinfer.serve.protocol import APIError

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


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    """The ingress replica: validates requests, renders prompts, fans out to engine replicas, streams.

    Args:
        cfg: the service config; the constructor loads the tokenizer and starts ``cfg.num_replicas``
            EngineActors through an EngineClient (waiting until their models are loaded).
    """

    def __init__(self, cfg: ServeConfig):
        from rayinfer.actors.client import EngineClient
        from rayinfer.model.loader import load_tokenizer
        from rayinfer.serve.metrics import ServeMetrics
        from rayinfer.serve.serving import OpenAIServing
        from rayinfer.serve.serving_chat import ChatServing
        from rayinfer.serve.serving_completion import CompletionServing

        logging.basicConfig(level=logging.INFO)
        self.cfg = cfg
        self.model_name = cfg.model_name
        self.created = int(time.time())
        self.tokenizer = load_tokenizer(cfg.model.model)
        if cfg.parallel.topology == "colocated":
            self.client = EngineClient(cfg.model, cfg.engine, cfg.num_replicas, cfg.num_cpus_per_replica,
                                       cfg.num_gpus_per_replica)
        else:  # prefill/decode disaggregation: PDClient has EngineClient's interface
            from rayinfer.actors.topology import make_client

            self.client = make_client(cfg.model, cfg.engine, cfg.parallel)
        self.metrics = ServeMetrics(self.model_name)
        self.serving = OpenAIServing(self.client, self.tokenizer, self.model_name, self.client.max_model_len,
                                     self.metrics)
        self.chat = ChatServing(self.serving)
        self.completion = CompletionServing(self.serving)
        logger.info("serving %s with %d engine replica(s), context %d", self.model_name, cfg.num_replicas,
                    self.client.max_model_len)

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

    async def _handle(self, endpoint: str, handler, request: Request) -> Response:
        arrival = time.perf_counter()
        try:
            self._check_auth(request)
            result = await handler.create(await self._json_body(request), arrival)
        except APIError as e:
            self.metrics.count_request(endpoint, f"error_{e.status}")
            return JSONResponse(e.body(), status_code=e.status)
        except Exception as e:  # a bug or a dead replica: this request fails, the server stays up
            logger.exception("request to %s failed", endpoint)
            self.metrics.count_request(endpoint, "error_500")
            err = APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_error")
            return JSONResponse(err.body(), status_code=500)
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
        return await self._handle("chat", self.chat, request)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle("completions", self.completion, request)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._check_auth(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rayinfer",
                "root": self.cfg.model.model, "max_model_len": self.client.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health(self) -> Response:
        try:
            await self.client.stats()
        except Exception as e:  # noqa: BLE001 - any replica failure means unhealthy
            return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        from rayinfer.serve.metrics import CONTENT_TYPE

        try:
            self.metrics.set_engine_stats(await self.client.stats())
        except Exception:  # noqa: BLE001 - still expose the request-level metrics
            logger.exception("engine stats unavailable")
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def engine_stats(self) -> list[dict]:
        """Each engine replica's stats (for tests and operators through a DeploymentHandle)."""
        return await self.client.stats()


def build_app_from_config(cfg: ServeConfig):
    """The Serve application for a config (bind the ingress with its deployment options)."""
    return OpenAIIngress.options(max_ongoing_requests=cfg.max_ongoing_requests).bind(cfg)


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
