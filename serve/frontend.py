"""The OpenAI HTTP front end as a plain FastAPI app: auth, body limits, routes, error bodies and request
metrics. No Ray here: ``serve/app.py`` builds one per ingress replica around a fleet client, and tests
build one around a fake ``EngineClient`` and call it through ``httpx.ASGITransport``.

    frontend = OpenAIFrontend(cfg, tokenizer, connect_client)   # connect_client: async () -> EngineClient
    app = create_app(frontend)                                   # FastAPI
"""

# no `from __future__ import annotations`: FastAPI reads the route signatures (Request)
import asyncio
import hmac
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayinfer.serve.config import ServeConfig
from rayinfer.serve.metrics import CONTENT_TYPE, ServeMetrics
from rayinfer.serve.protocol import APIError, from_error, parse_json_body
from rayinfer.serve.serving import OpenAIServing, RequestRecord
from rayinfer.serve.serving_chat import ChatServing
from rayinfer.serve.serving_completion import CompletionServing
from rayinfer.serve.serving_tokenize import TokenizeServing

logger = logging.getLogger(__name__)

_PREFIX = {"chat": "chatcmpl", "completions": "cmpl"}
HEALTH_WAIT_S = 1.0  # /health waits this long for a connection to the fleet before answering 503 "starting"
HEALTH_STATS_TIMEOUT_S = 10.0  # ... and this long for the replicas' stats before answering 503 "unhealthy"


class OpenAIFrontend:
    """One ingress replica's request handling (routes call these methods; see :func:`create_app`).

    Args:
        cfg: the service config (``api_key``, ``max_request_bytes``, ``max_prompt_chars``,
            ``public_metrics_and_docs``, model name).
        tokenizer: the model's HF tokenizer.
        connect_client: ``async () -> EngineClient``, called once, on the first request that needs the
            fleet.
        metrics: the replica's ServeMetrics (a new one when None).
    """

    def __init__(self, cfg: ServeConfig, tokenizer, connect_client: Callable[[], Awaitable[Any]],
                 metrics: ServeMetrics | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model_name = cfg.model_name
        self.created = int(time.time())
        self.metrics = metrics or ServeMetrics(self.model_name, cfg.metrics_names)
        self._connect_client = connect_client
        # one thread: parsing, templates and tokenization leave the event loop, and never overlap (see
        # OpenAIServing's ``executor``)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayinfer-prepare")
        self.client: Any = None
        self.serving: OpenAIServing | None = None
        self.chat: ChatServing | None = None
        self.completion: CompletionServing | None = None
        self._connect_lock: asyncio.Lock | None = None
        self._connect_task: asyncio.Future | None = None  # a connection /health started

    async def connect(self) -> OpenAIServing:
        """The shared OpenAIServing, connecting to the fleet on first use."""
        if self.serving is not None:
            return self.serving
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self.serving is None:
                client = await self._connect_client()
                images = await asyncio.to_thread(self._image_loader)  # reads the model's config: off the loop
                serving = OpenAIServing(client, self.tokenizer, self.model_name, client.max_model_len,
                                        self.metrics, executor=self.executor,
                                        max_prompt_chars=self.cfg.max_prompt_chars, images=images)
                self.chat, self.completion = ChatServing(serving), CompletionServing(serving)
                self.client, self.serving = client, serving
                logger.info("serving %s, context %d", self.model_name, client.max_model_len)
        return self.serving

    def _image_loader(self):
        """The image-part handler of a vision-language model (an ImageLoader), None for a text model."""
        from rayinfer.model.mm_processor import ImageInputProcessor

        processor = ImageInputProcessor.for_model(self.cfg.model.model)
        if processor is None:
            return None
        from rayinfer.serve.images import ImageLoader

        cfg = self.cfg
        return ImageLoader(processor, cfg.max_image_pixels, cfg.max_images_per_request, cfg.allowed_media_dir)

    # -- checks ------------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        """Raises APIError 401 when an API key is configured and the request does not carry it."""
        if self.cfg.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        expected = str(self.cfg.api_key).encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise APIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'", status=401,
                           type="authentication_error", code="invalid_api_key")

    def check_auth_of_open_route(self, request: Request) -> None:
        """Auth for /metrics and the docs: none with ``public_metrics_and_docs``, else the API key's."""
        if not self.cfg.public_metrics_and_docs:
            self.check_auth(request)

    async def read_body(self, request: Request) -> bytes:
        """The request body, read no further than ``max_request_bytes``.

        Raises:
            APIError: 413 when the body (by its Content-Length, or as read) is larger.
        """
        limit = self.cfg.max_request_bytes
        too_large = APIError(f"the request body is larger than this server's limit of {limit} bytes",
                             status=413, code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    # -- the completion endpoints ------------------------------------------------------------------
    async def handle(self, endpoint: str, request: Request) -> Response:
        """Answer one chat or text completion request.

        Every outcome is counted in ``rayinfer_requests_total``: ``ok`` (with the first choice's
        finish reason), ``error_<status>``, or ``abort`` (the client left first, as vLLM counts it).
        A 5xx body says "internal error" and the request id; the detail is logged under that id.
        """
        arrival = time.perf_counter()
        request_id = f"{_PREFIX[endpoint]}-{uuid.uuid4().hex}"
        record = RequestRecord()
        try:
            self.check_auth(request)
            serving = await self.connect()
            raw = await self.read_body(request)
            body = await serving.prepare(parse_json_body, raw)
            handler = self.chat if endpoint == "chat" else self.completion
            assert handler is not None
            result = await handler.create(body, arrival, request_id=request_id, record=record)
        except asyncio.CancelledError:  # the client disconnected before the answer was ready
            self.metrics.count_request(endpoint, "abort", "abort")
            raise
        except Exception as e:  # mapped by type; a bug or a dead replica fails this request only
            err = from_error(e, request_id=request_id)
            if err.status >= 500:
                logger.error("request %s to %s failed", request_id, endpoint, exc_info=e)
            self.metrics.count_request(endpoint, f"error_{err.status}", "error")
            return JSONResponse(err.body(), status_code=err.status)
        if isinstance(result, dict):
            self.metrics.count_request(endpoint, "ok", record.finish_reason)
            return JSONResponse(result)
        return StreamingResponse(self._counted(endpoint, result, record), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _counted(self, endpoint: str, events: AsyncIterator[str], record: RequestRecord
                       ) -> AsyncIterator[str]:
        completed = False
        try:
            async for event in events:
                yield event
            completed = True
        finally:
            await events.aclose()  # type: ignore[attr-defined]  # on a disconnect: aborts the engine requests
            if completed and record.error_status is not None:  # an error event ended the stream
                self.metrics.count_request(endpoint, f"error_{record.error_status}", "error")
            elif completed:
                self.metrics.count_request(endpoint, "ok", record.finish_reason)
            else:
                self.metrics.count_request(endpoint, "abort", "abort")

    # -- the other routes --------------------------------------------------------------------------
    async def tokens(self, route: str, request: Request) -> Response:
        """``POST /tokenize`` or ``/detokenize`` (vLLM's shapes, :mod:`rayinfer.serve.serving_tokenize`),
        behind the API key; the work runs on the prepare thread."""
        try:
            self.check_auth(request)
            serving = await self.connect()
            body = await serving.prepare(parse_json_body, await self.read_body(request))
            handler = TokenizeServing(serving)
            result = await serving.prepare(handler.tokenize if route == "tokenize" else handler.detokenize, body)
        except Exception as e:  # mapped by type, as for the completion endpoints
            err = from_error(e, request_id=f"{route}-{uuid.uuid4().hex}")
            if err.status >= 500:
                logger.error("%s failed", route, exc_info=e)
            return JSONResponse(err.body(), status_code=err.status)
        return JSONResponse(result)

    async def version(self, request: Request) -> Response:
        """``GET /version``: ``{"version": rayinfer's version}`` (behind the key unless
        ``public_metrics_and_docs``)."""
        try:
            self.check_auth_of_open_route(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        from rayinfer import __version__

        return JSONResponse({"version": __version__})

    async def models(self, request: Request) -> Response:
        try:
            self.check_auth(request)
            await self.connect()
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "rayinfer",
                "root": self.cfg.model.model, "max_model_len": self.client.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self) -> Response:
        """``GET /health``: 200 ``{"status": "ok"}`` when every replica answers its stats; else 503 with
        ``"starting"`` while the fleet is still being connected to (replicas loading their model: a probe
        gets its answer within :data:`HEALTH_WAIT_S` instead of waiting for the load), or ``"unhealthy"``
        and the error (a replica that failed, or stats not answered within :data:`HEALTH_STATS_TIMEOUT_S`)."""
        try:
            if self.serving is None:
                if self._connect_task is None:  # the first probe starts the connection; later ones poll it
                    self._connect_task = asyncio.ensure_future(self.connect())
                task = self._connect_task
                await asyncio.wait({task}, timeout=HEALTH_WAIT_S)
                if not task.done():
                    return JSONResponse({"status": "starting"}, status_code=503)
                self._connect_task = None  # a failed connection is retried by the next probe
                task.result()
            stats = await asyncio.wait_for(self.client.stats(), timeout=HEALTH_STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any replica failure means unhealthy
            logger.warning("health check failed: %r", e)
            return JSONResponse({"status": "unhealthy", "error": type(e).__name__}, status_code=503)
        failed = [r.replica_id for r in stats.replicas if r.error]
        if failed:
            return JSONResponse({"status": "unhealthy", "error": f"replicas {failed} unavailable"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        try:
            self.check_auth_of_open_route(request)
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        try:
            await self.connect()
            self.metrics.set_engine_stats(await self.client.stats())
        except Exception:  # noqa: BLE001 - still expose the request-level metrics
            logger.exception("engine stats unavailable")
            self.metrics.set_engine_stats(None)  # no stale gauges of replicas that cannot answer
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def create_app(frontend: OpenAIFrontend) -> FastAPI:
    """The FastAPI app of one ingress replica: OpenAI routes, /tokenize and /detokenize (vLLM's), /health,
    /metrics, /version and the docs (the last three behind the API key unless ``public_metrics_and_docs``);
    every error an OpenAI error object."""
    app = FastAPI(title="rayinfer", description="OpenAI-compatible LLM inference on Ray Serve",
                  docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), status=exc.status_code,
                       code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await frontend.handle("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await frontend.handle("completions", request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await frontend.models(request)

    @app.get("/health")
    async def health() -> Response:
        return await frontend.health()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await frontend.tokens("tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await frontend.tokens("detokenize", request)

    @app.get("/version")
    async def version(request: Request) -> Response:
        return await frontend.version(request)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return await frontend.metrics_text(request)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        frontend.check_auth_of_open_route(request)
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> HTMLResponse:
        frontend.check_auth_of_open_route(request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="rayinfer")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        frontend.check_auth_of_open_route(request)
        return get_redoc_html(openapi_url="/openapi.json", title="rayinfer")

    return app
