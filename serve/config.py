"""The online service's structured config (Hydra schema of ``conf/serve.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayinfer.actors.cluster import RayConfig
from rayinfer.engine.config import EngineConfig, ModelConfig
from rayinfer.placement.parallel_config import ParallelConfig


@dataclass
class ServeConfig:
    """Settings of the OpenAI-compatible Serve app.

    Attributes:
        model, engine: every engine replica's config (the ``conf/model`` and ``conf/engine`` groups).
        served_model_name: the name clients put in ``model``; None takes ``model.model``.
        host, port: where ``jobs/serve.py`` starts Serve's HTTP proxy.
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <api_key>`` (401 otherwise).
        parallel: the fleet behind the ingress (``conf/parallel``): ``parallel.dp`` colocated replicas,
            prefill/decode disaggregation (``parallel=1p1d``) or an expert-parallel MoE replica
            (``parallel=ep2``), with each rank's Ray resources.
        num_ingress_replicas: Serve replicas of the HTTP ingress; all share the one fleet (started once
            by the ``EngineFleet`` deployment) and its balancers.
        max_ongoing_requests: concurrent HTTP requests the ingress accepts (Serve's backpressure).
        max_request_bytes: the largest request body accepted, in bytes; a larger one is refused with 413
            before it is parsed.
        max_prompt_chars: the most characters of prompt text one request may carry (every string in
            chat ``messages`` and ``tools``, or in a completion ``prompt``); more is a 400 before any
            tokenization.
        allowed_media_dir: vision-language models: a directory whose image files chat requests may name
            by path in ``image_url.url``; None (the default) allows only ``data:`` URLs. Images are never
            fetched from the network.
        max_image_pixels: the most pixels (width x height) of one image; a larger one is a 400.
        max_images_per_request: the most images in one chat request; more is a 400.
        public_metrics_and_docs: with ``api_key`` set, still serve ``/metrics``, ``/docs``,
            ``/redoc`` and ``/openapi.json`` without the key (vLLM's behaviour). False (the default)
            puts them behind the key; ``/health`` is always open.
        metrics_names: the names ``/metrics`` exports: "rayinfer" (``rayinfer_*``), "vllm" (vLLM's
            ``vllm:*`` names and labels, for dashboards built for vLLM) or "both".
        ray: which Ray cluster ``jobs/serve.py`` uses (``ray.address=local``: an embedded one, on
            loopback); see :class:`~rayinfer.actors.cluster.RayConfig`.
        proxy_location, http_options, applications: the Serve config-file keys of the same YAML, read
            by ``serve run conf/serve.yaml`` and ignored here.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    num_ingress_replicas: int = 1
    max_ongoing_requests: int = 1024
    max_request_bytes: int = 8 * 2**20
    max_prompt_chars: int = 2**20
    allowed_media_dir: str | None = None
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    public_metrics_and_docs: bool = False
    metrics_names: str = "rayinfer"
    ray: RayConfig = field(default_factory=RayConfig)
    proxy_location: Any = None
    http_options: Any = None
    applications: Any = None

    def __post_init__(self):
        if not isinstance(self.num_ingress_replicas, int) or self.num_ingress_replicas <= 0:
            raise ValueError(f"num_ingress_replicas must be a positive integer, got {self.num_ingress_replicas!r}")
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port!r}")
        if self.max_ongoing_requests <= 0:
            raise ValueError(f"max_ongoing_requests must be positive, got {self.max_ongoing_requests}")
        for name in ("max_request_bytes", "max_prompt_chars", "max_image_pixels", "max_images_per_request"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.metrics_names not in ("rayinfer", "vllm", "both"):
            raise ValueError(f"metrics_names must be one of rayinfer, vllm, both; got {self.metrics_names!r}")
        if self.api_key is not None and not str(self.api_key):
            raise ValueError("api_key must be non-empty when set")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.model


def register_configs() -> None:
    """Register the schema as ``serve_schema`` (the first entry of conf/serve.yaml's defaults)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


def compose_config(overrides: list[str] | None = None) -> ServeConfig:
    """Compose ``conf/serve.yaml`` with Hydra overrides, outside ``@hydra.main`` (for ``serve run``).

    Raises:
        ValueError: for a bad override or value.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from rayinfer.cli import compose

    register_configs()
    cfg = compose("serve", list(overrides or []))  # a bad override: ValueError naming it (and a close key)
    try:
        result = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ValueError(f"bad serve config: {e}") from None
    if not isinstance(result, ServeConfig):
        raise ValueError(f"bad serve config: composed a {type(result).__name__}, not a ServeConfig")
    return result
