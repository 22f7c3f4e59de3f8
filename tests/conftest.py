"""Shared fixtures: one embedded Ray instance per test session, one fleet of the default model on it for
the batch-job tests, the default model's tokenizer, the default model itself loaded once (CPU, float32) for
the engines that tests build around it, the Triton-interpreter server, and a fake clock."""

import os

import pytest

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class FakeClock:
    """A clock for code that takes ``clock: Callable[[], float]``: returns ``now`` (seconds), which tests move."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    """A :class:`FakeClock` at 100 s."""
    return FakeClock()


@pytest.fixture(scope="session")
def ray_cluster():
    """An embedded Ray instance on loopback (logical CPUs beyond the physical ones so several actors
    fit), never a cluster someone else started on the machine; ``$RAY_ADDRESS`` when set."""
    import ray

    from rayinfer import envs
    from rayinfer.actors.cluster import RayConfig, init_ray

    started = not ray.is_initialized()
    if started:
        init_ray(RayConfig(address=None if envs.ray_address() else "local"), num_cpus=8, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


class Interpreter:
    """Runs ``python FILE --interpret ...`` checks under Triton's interpreter through one fork server
    (``tests/interpret_server.py``): each check is a fresh child process of a server that has imported
    torch, Triton and rayinfer once, instead of a new interpreter that imports them again."""

    def __init__(self):
        import subprocess
        import sys
        import tempfile

        self._log = tempfile.TemporaryFile(mode="w+")  # the server's own stderr (a failed start)
        server = os.path.join(os.path.dirname(__file__), "interpret_server.py")
        self._proc = subprocess.Popen([sys.executable, server], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, text=True, env=dict(os.environ, TRITON_INTERPRET="1"))

    def run(self, path: str, *args: str, timeout_s: float = 120) -> tuple[int, str]:
        """Run ``path`` as ``python path --interpret *args`` would; returns (exit code, stdout + stderr).

        Raises:
            subprocess.TimeoutExpired: it ran past ``timeout_s`` (the child is killed).
        """
        return self.check(self.results([[path, *args]], timeout_s)[0])

    def results(self, commands: list[list[str]], timeout_s: float = 120, parallel: int | None = None) -> list[dict]:
        """Run each ``[path, *args]`` as ``python path --interpret *args`` would, one child each, at most
        ``parallel`` at once (default: all), each killed ``timeout_s`` after its start; returns the server's
        answers in order (``argv``, ``returncode``, ``output``, ``timed_out``), without raising for a
        timeout (:meth:`check` does)."""
        import json

        assert self._proc.stdin is not None and self._proc.stdout is not None
        argvs = [[path, "--interpret", *args] for path, *args in commands]
        request = {"commands": argvs, "timeout_s": timeout_s, "parallel": parallel or len(argvs)}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            self._log.seek(0)
            raise RuntimeError(f"the interpreter server exited: {self._log.read()[-3000:]}")
        return [{"argv": argv, "timeout_s": timeout_s, **r} for argv, r in zip(argvs, json.loads(line)["results"])]

    @staticmethod
    def check(result: dict) -> tuple[int, str]:
        """(exit code, output) of one of :meth:`results`' answers.

        Raises:
            subprocess.TimeoutExpired: it ran past its timeout (and was killed).
        """
        import subprocess

        if result["timed_out"]:
            raise subprocess.TimeoutExpired(result["argv"], result["timeout_s"], result["output"])
        return result["returncode"], result["output"]

    def close(self):
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        self._proc.wait(timeout=30)
        self._log.close()


@pytest.fixture(scope="session")
def interpreter():
    """The session's :class:`Interpreter` (its server starts at the first check that asks)."""
    server = Interpreter()
    yield server
    server.close()


@pytest.fixture(scope="session")
def fleet(ray_cluster):
    """A colocated client of one SmolLM2 replica (float32, CPU, 1 CPU, 256 KV blocks) for the whole session,
    shut down after it: the batch-job tests (tests/jobs, tests/data) pass it as ``run(cfg, client=fleet)``
    instead of starting a fleet of their own (one takes tens of seconds to start on a small CPU)."""
    from rayinfer.actors.client import make_client
    from rayinfer.engine.config import EngineConfig, ModelConfig
    from rayinfer.placement.parallel_config import ParallelConfig

    client = make_client(ModelConfig(dtype="float32"), EngineConfig(device="cpu", num_kv_blocks=256),
                         ParallelConfig(dp=1, num_cpus_per_replica=1))
    yield client
    client.shutdown()


@pytest.fixture(scope="session")
def tokenizer():
    from rayinfer.model.loader import load_tokenizer

    return load_tokenizer("SmolLM2-135M-Instruct")


class SharedModel:
    """The default model (SmolLM2-135M-Instruct) on the CPU in float32, loaded once per session.

    :meth:`engine` builds an engine around it with its own KV cache, scheduler and sampler; engines
    never write the weights, so tests can share them.
    """

    def __init__(self):
        import torch

        from rayinfer.model.loader import load_model, load_tokenizer

        self.tokenizer = load_tokenizer("SmolLM2-135M-Instruct")
        torch.manual_seed(0)
        self.model = load_model("SmolLM2-135M-Instruct", torch.float32, torch.device("cpu"), "auto", seed=0)

    def engine(self, config=None, **engine_config):
        """An engine around the shared model: ``config`` (an EngineConfig) or EngineConfig's fields."""
        from rayinfer.engine.config import EngineConfig, ModelConfig
        from rayinfer.engine.llm_engine import LLMEngine

        config = config or EngineConfig(**{"device": "cpu", **engine_config})
        return LLMEngine(ModelConfig(dtype="float32"), config, model=self.model, tokenizer=self.tokenizer)


@pytest.fixture(scope="session")
def smollm2():
    """The default model loaded once (see :class:`SharedModel`)."""
    return SharedModel()


def build_tiny_llava(path):
    """Save a tiny random LLaVA (CLIP 32x32 px, patch 8 -> 16 tokens per image, 2 layers; Llama 2 layers,
    hidden 64) with the default tokenizer plus an ``<image>`` token and a LlavaProcessor into ``path``."""
    import torch
    import transformers

    from rayinfer.model.default_model import ensure_default_model

    tok = transformers.AutoTokenizer.from_pretrained(ensure_default_model(), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    text = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                                    eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8, num_additional_image_tokens=1,
                                            vision_feature_select_strategy="default")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def random_images(n: int, seed: int = 0, size=(40, 48)):
    """``n`` random RGB PIL images (height, width = ``size``) from a fixed seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory):
    """Directory of a tiny random LLaVA checkpoint (see :func:`build_tiny_llava`), built once per session."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))
