"""Online service: the OpenAI-compatible app on Ray Serve, started on an embedded (or given) Ray.

    python jobs/serve.py                                    # SmolLM2 on http://127.0.0.1:8000/v1
    python jobs/serve.py port=8001 api_key=secret parallel.dp=2 engine.num_kv_blocks=2048
    RAY_ADDRESS=auto python jobs/serve.py host=0.0.0.0      # on a running cluster
    python jobs/serve.py ray.address=local                  # an embedded Ray even if one is running
    rayinfer serve --model smollm2 --port 8001 --api-key secret   # the console script (vLLM's flags)

An embedded Ray listens on 127.0.0.1 only (``ray.node_ip_address=auto``: every interface).

The same conf/serve.yaml is a Serve config file: ``serve run conf/serve.yaml``. Stops on Ctrl-C.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from rayinfer.serve.config import ServeConfig, register_configs

logger = logging.getLogger("rayinfer.serve")


def run(cfg: ServeConfig, blocking: bool = True) -> int:
    """Start Serve with the app and wait until interrupted; returns the process exit code.

    Raises:
        ValueError: for an unknown model or a bad RAYINFER_* value (before any actor starts).
    """
    from ray import serve

    from rayinfer import envs
    from rayinfer.actors.cluster import init_ray
    from rayinfer.model.loader import check_deployment, load_config, resolve_model
    from rayinfer.serve.app import build_app_from_config

    envs.check()  # a bad RAYINFER_* value: now, not in a replica
    resolve_model(cfg.model.model)  # unknown model: ValueError now; converts the default model once
    # fp8 on a model without fp8 layers, expert parallelism without routed experts: before Ray starts
    check_deployment(load_config(cfg.model.model), cfg.model.quantization, cfg.parallel.ep)
    print(init_ray(cfg.ray, logging_level=logging.WARNING), flush=True)
    # Serve's driver-side INFO lines as Ray's: off (its "Connecting to existing Serve app ... will not be
    # applied" when run() deploys into the Serve that start() began is expected, not a conflict)
    logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app_from_config(cfg), name="rayinfer", route_prefix="/")
    print(f"serving {cfg.model_name} at http://{cfg.host}:{cfg.port}/v1 (Ctrl-C to stop)", flush=True)
    if not blocking:
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # a supervisor's (or container's) stop shuts down as Ctrl-C does
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("shutting down (Ctrl-C again to exit without waiting)", flush=True)
    finally:
        code = _shutdown(serve)
    return code


def _shutdown(serve) -> int:
    """Shut Serve down; a second Ctrl-C meanwhile exits at once (130) instead of printing a traceback."""
    try:
        serve.shutdown()
    except KeyboardInterrupt:
        print("exiting without waiting for Serve to shut down", flush=True)
        return 130
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def execute(cfg: DictConfig | ServeConfig) -> int:
    """Build the config and serve until interrupted, turning the errors a user can fix into one line on
    stderr. Returns the exit code: 0 stopped, 2 a bad config, unknown model, or Ray that cannot be joined
    or started (nothing ran)."""
    from rayinfer.actors.cluster import RayStartError

    try:
        return run(cfg if isinstance(cfg, ServeConfig) else OmegaConf.to_object(cfg))  # pyright: ignore[reportArgumentType]
    except (ValueError, RayStartError) as e:  # bad config or unknown model: a clear message, no work done
        print(f"error: {e}", file=sys.stderr)
        return 2


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(dcfg: DictConfig) -> None:
    sys.exit(execute(dcfg))


if __name__ == "__main__":
    from rayinfer.cli import normalize_overrides

    sys.argv[1:] = normalize_overrides(sys.argv[1:])  # model=<shape, path or unknown name> -> model.model=...
    register_configs()
    main()
