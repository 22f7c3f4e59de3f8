"""Structured configs of one replica (Hydra schemas; YAML under conf/ only overrides them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rayinfer.engine.types import EngineRole

_LOAD_FORMATS = ("auto", "safetensors", "dummy")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = (None, "fp8", "none")


@dataclass
class ModelConfig:
    """Which model to load and how.

    Attributes:
        model: a built-in name (default "SmolLM2-135M-Instruct"), a Hugging Face-format directory, or a
            built-in shape name such as "llama-3-8b" (with ``load_format="dummy"``).
        dtype: "auto" (float32 on CPU, bfloat16 on GPU), "float32", "bfloat16" or "float16".
        load_format: "auto" (safetensors in the directory), "safetensors" or "dummy" (random weights).
        max_model_len: context limit in tokens; None takes the model's max_position_embeddings.
        seed: seed of dummy weights and of unseeded sampling.
        quantization: the linear layers' and routed experts' weights. None: as the checkpoint's
            ``quantization_config`` says (DeepSeek-V3's fp8 128 x 128 blocks, or none); "fp8": fp8
            (e4m3) weights with a float32 scale per 128 x 128 block, quantized as they load when the
            checkpoint is 16/32-bit or the weights are dummy; "none": the model dtype (an fp8
            checkpoint is dequantized as it loads). Activations stay in the model dtype; embeddings,
            the LM head, routers and norms are never quantized. fp8 needs a model
            with fp8 layers (DeepSeek-V3, Qwen3-MoE): the loader raises ValueError for another.
    """

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"
    load_format: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty name or path")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {_LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")


SPECULATIVE_METHODS = ("none", "ngram", "draft_model", "mtp")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, one target forward verifies them.

    Attributes:
        method: "none" (off), "ngram" (prompt lookup, no model), "draft_model" (a small model sharing
            the target's tokenizer, with its own paged KV cache) or "mtp" (the target's own
            multi-token-prediction module, DeepSeek-V3 with ``num_nextn_predict_layers`` > 0: loaded from
            the checkpoint, it drafts from the target's hidden states; see
            :class:`rayinfer.engine.spec_decode.MtpProposer`). The engine raises ValueError for "mtp"
            on a model without MTP modules or a checkpoint without their weights.
        num_draft_tokens: draft tokens proposed per request and step (k), at most.
        draft_model: the draft model (a built-in name or a directory, as ``ModelConfig.model``); None
            with ``method="draft_model"`` drafts with the target model itself (acceptance 1 in greedy: a
            test of the machinery and its upper bound).
        draft_load_format: the draft model's ``load_format``.
        ngram_min, ngram_max: n-gram lengths tried, longest first (prompt lookup).
        schedule: "fixed" (verify every draft) or "confidence" (verify a draft prefix per request chosen
            from the drafter's running product of top-1 probabilities under a per-step budget of
            verification tokens that a controller corrects from measured step times).
        max_verify_tokens: "confidence": the per-step budget of draft tokens verified, at most; None
            takes ``num_draft_tokens`` x max_num_seqs.
        min_confidence: "confidence": drafts whose running product falls below it are never verified.
        device_drafts: MTP and the draft model draft the next step's tokens on the device at the end of each
            verification step (no drafting pass of its own before the next step, no host sync between them); with
            pipelined scheduling the next verification step is then launched behind the one in flight (chained;
            the confidence schedule picks each chained step's width from the confidences the host already has,
            those of the step before). False drafts before each step from the tokens on the host (``propose``).
            A draft model on CUDA without graphs (``enforce_eager``) drafts on the host. N-gram follows
            ``ngram_on_device``.
        ngram_on_device: n-gram also looks its drafts up on the device behind each verification step, so that
            with pipelined scheduling its verification steps chain as MTP's do (a request without a match then
            verifies k placeholder drafts: one width a graph). Off by default: not yet measured on a GPU.
    Raises:
        ValueError: naming the field, for an unknown method or schedule or a non-positive count.
    """

    method: str = "none"
    num_draft_tokens: int = 4
    draft_model: str | None = None
    draft_load_format: str = "auto"
    ngram_min: int = 1
    ngram_max: int = 4
    schedule: str = "fixed"
    max_verify_tokens: int | None = None
    min_confidence: float = 0.05
    device_drafts: bool = True
    ngram_on_device: bool = False

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"engine.speculative.method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        for name in ("num_draft_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"engine.speculative.{name} must be a positive integer, got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"engine.speculative.ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})")
        if self.schedule not in ("fixed", "confidence"):
            raise ValueError(f"engine.speculative.schedule must be 'fixed' or 'confidence', got {self.schedule!r}")
        if self.max_verify_tokens is not None and (not isinstance(self.max_verify_tokens, int)
                                                   or self.max_verify_tokens <= 0):
            raise ValueError(f"engine.speculative.max_verify_tokens must be a positive integer or null, "
                             f"got {self.max_verify_tokens!r}")
        if not 0 <= self.min_confidence < 1:
            raise ValueError(f"engine.speculative.min_confidence must be in [0, 1), got {self.min_confidence}")
        if self.draft_load_format not in _LOAD_FORMATS:
            raise ValueError(f"engine.speculative.draft_load_format must be one of {_LOAD_FORMATS}, "
                             f"got {self.draft_load_format!r}")
        if self.draft_model is not None and self.method != "draft_model":
            raise ValueError(f"engine.speculative.draft_model is set but method is {self.method!r} (use draft_model)")
        if self.method == "none" and (self.schedule != "fixed" or self.ngram_on_device):
            key = "schedule" if self.schedule != "fixed" else "ngram_on_device"
            raise ValueError(f"engine.speculative.{key} is set but method is 'none': choose a method "
                             f"(engine.speculative.method=ngram, draft_model or mtp)")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn"}  # name -> torch dtype name (None: the model's)


@dataclass
class EngineConfig:
    """Scheduling, KV-cache and device settings of one replica.

    Attributes:
        device: "auto" (cuda when available), "cpu" or "cuda".
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks; None sizes the pool from ``kv_cache_memory_gib`` (CPU) or
            ``gpu_memory_utilization`` (GPU).
        kv_cache_memory_gib: KV-cache memory on CPU (GiB).
        kv_cache_dtype: "auto" (the model's dtype) or "fp8" (float8_e4m3fn, scale 1: half the bytes of
            bf16 per token; keys and values are rounded on write and widened on read).
        gpu_memory_utilization: fraction of the GPU's memory this replica may use (weights + KV +
            activations), bounded by what is free; replicas sharing a GPU each take their own fraction.
        max_num_seqs: running requests at most; None picks by device (:meth:`for_device`).
        max_num_batched_tokens: new tokens per step at most; None picks by device.
        enable_prefix_caching, enable_chunked_prefill: as named.
        role: "normal", "prefill" or "decode".
        async_scheduling: schedule step N+1 while the device runs step N (None: on CUDA only).
        enforce_eager: no CUDA graphs for decode.
        batch_invariant: compute every request's rows with kernels whose reduction order does not
            depend on the batch (persistent Triton matmul without split-K, attention without split-KV
            in one tile shape, row-wise log-softmax; see ``kernels.batch_invariant``): greedy tokens
            and logprobs are then the same bits alone or in any batch, chunked or after a prefix hit.
            Slower; exact where the Triton kernels run (CUDA).
        debug_sync_guard: raise if launching a step synchronizes with the GPU (for tests).
        debug_eager_graphs: off CUDA, build the decode graphs' static buffers and run their padded
            steps eagerly (no capture), so CPU tests cover the graph paths (padding, expert-parallel
            groups replaying one batch size); ignored on CUDA.
        host_kv_cache_gib: host-memory KV tier in GiB (0: off). Cached blocks the device pool evicts
            are copied there (pinned memory on CUDA, off the compute stream) and kept in their own LRU; a
            prefix that misses the device pool but hits there is loaded back instead of recomputed.
            Needs ``enable_prefix_caching``. On CPU it is a second pool in the same memory.
        kv_transfer_buffer_gib: GPU memory kept out of the KV pool for PD transfer buffers (a prefill
            replica's send staging, a decode replica's received payloads not yet imported); set by the
            router from ``ParallelConfig.pd.transfer_buffer_gib``.
        speculative: speculative decoding (:class:`SpeculativeConfig`; off by default).
        encoder_cache_tokens: vision-language models: image embedding rows kept by content hash so that
            a repeated image is not encoded again (``engine.multimodal.EncoderCache``; 0: none kept).
    """

    device: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    role: str = "normal"
    async_scheduling: bool | None = None
    enforce_eager: bool = False
    batch_invariant: bool = False
    debug_sync_guard: bool = False
    debug_eager_graphs: bool = False
    kv_transfer_buffer_gib: float = 0.0
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    host_kv_cache_gib: float = 0.0
    encoder_cache_tokens: int = 16384

    def __post_init__(self):
        if isinstance(self.speculative, dict):
            self.speculative = SpeculativeConfig(**self.speculative)
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if name != "block_size" and getattr(self, name) is None:
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.encoder_cache_tokens, int) or self.encoder_cache_tokens < 0:
            raise ValueError(f"encoder_cache_tokens must be a non-negative integer, got {self.encoder_cache_tokens!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be positive, got {self.kv_cache_memory_gib}")
        if isinstance(self.host_kv_cache_gib, bool) or not isinstance(self.host_kv_cache_gib, (int, float)) \
                or not 0 <= self.host_kv_cache_gib < float("inf"):
            raise ValueError(f"host_kv_cache_gib must be a finite number of GiB >= 0 (0: off), got {self.host_kv_cache_gib!r}")
        if not self.kv_transfer_buffer_gib >= 0:
            raise ValueError(f"kv_transfer_buffer_gib must be >= 0, got {self.kv_transfer_buffer_gib}")
        try:
            EngineRole(self.role)
        except ValueError:
            raise ValueError(f"role must be one of normal, prefill, decode; got {self.role!r}") from None
        if self.speculative.enabled and self.role == "prefill":
            raise ValueError("speculative decoding needs a replica that decodes (role normal or decode), not prefill")

    def for_device(self, device_type: str, device_memory_gib: float = 0.0) -> "EngineConfig":
        """This config with ``max_num_seqs`` / ``max_num_batched_tokens`` chosen where they are None.

        GPUs of 40 GiB or more (A100-80G, H100, H200): 256 sequences and 8,192 tokens per step, the best
        of the 8B-shape sweeps on an H200 (9,638 out tok/s against 6,583 with 64/2048); smaller GPUs: 128
        and 4,096; CPU: 64 and 2,048 (a CPU step's time grows with its tokens, so smaller steps keep
        streams smooth). Values the user set are kept.

        Args:
            device_type: "cuda" or "cpu" (anything else is treated as CPU).
            device_memory_gib: the device's total memory (GPU only).
        """
        if device_type == "cuda":
            seqs, tokens = (256, 8192) if device_memory_gib >= 40 else (128, 4096)
        else:
            seqs, tokens = 64, 2048
        return dataclasses.replace(self, max_num_seqs=self.max_num_seqs or seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens or tokens)
