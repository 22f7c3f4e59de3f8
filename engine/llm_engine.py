"""One replica's engine core: requests in, token-id deltas out. No Ray inside.

Text (detokenization, stop strings) is made outside the step loop by
:mod:`rayinfer.engine.output_processor`; :meth:`LLMEngine.generate` shows the wiring.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import NamedTuple

import torch

from rayinfer.engine.block_pool import hash_block_chain
from rayinfer.engine.config import KV_CACHE_DTYPES, EngineConfig, ModelConfig
from rayinfer.engine.errors import InvalidRequestError
from rayinfer.engine.model_runner import ModelRunner, kv_layout_tag
from rayinfer.engine.multimodal import mm_hash_block_chain
from rayinfer.engine.output_processor import OutputProcessor
from rayinfer.engine.sampler import Sampler
from rayinfer.engine.scheduler import Scheduler, SchedulerConfig
from rayinfer.engine.spec_decode import (
    AcceptanceCalibrator,
    Draft,
    DraftModelProposer,
    MtpProposer,
    NgramProposer,
    SpecStats,
    StepTimeModel,
    SpeculationGate,
    choose_num_drafts,
)
from rayinfer.engine.sync_guard import no_host_sync
from rayinfer.engine.types import (
    PLACEHOLDER,
    Completion,
    ContextParallelPrefill,
    EngineRole,
    KVHandle,
    MultiModalInput,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
    SchedulerOutput,
    StepOutput,
)

logger = logging.getLogger(__name__)
_GIB = 1 << 30
_MAX_STORED_HASHES = 1 << 16


class ParkedKV(NamedTuple):
    """A prefilled request's KV left in the pool for a transfer: its blocks, tokens and when it was parked."""

    block_ids: tuple[int, ...]
    num_tokens: int
    since: float


def check_supports_mtp(model: str) -> None:
    """Raises ValueError unless ``model``'s architecture has multi-token-prediction modules."""
    from rayinfer.model.loader import load_config, resolve_model
    from rayinfer.model.registry import get_model_class

    config = load_config(resolve_model(model))
    arch = (getattr(config, "architectures", None) or [None])[0]
    if arch is None or not getattr(get_model_class(arch), "supports_mtp", False):
        raise ValueError(f"speculative.method=mtp needs a model with multi-token-prediction modules "
                         f"(DeepSeek-V3); '{model}' is {arch}")


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available, else cpu. Raises ValueError for cuda without a GPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda was asked for but no CUDA device is available")
    return torch.device(device)


class LLMEngine:
    """A single replica's core: model, paged KV cache, scheduler, sampler; token ids in and out.

    The model and tokenizer are loaded from ``model_config`` unless given (tests inject a tiny model).

    Args:
        model_config: which model and dtype; with ``model`` given, only ``max_model_len`` and ``seed``
            (of unseeded sampling) are read, and the name in logs.
        engine_config: scheduling, KV cache, device and role.
        model_kwargs: extra arguments of the model class (``{"ep": ExpertParallelism(...)}`` on an
            expert-parallel rank; see :func:`rayinfer.model.loader.load_model`).
        model: a built model with the engine's interface (:class:`rayinfer.model.llama.PagedCausalLM`:
            ``config``, ``kv_cache_shape``, ``forward``, ``compute_logits``), in eval mode; the engine
            runs on its parameters' device and dtype.
        tokenizer: a Hugging Face tokenizer for ``model`` (``decode``, ``eos_token_id``, what the
            grammar compiler reads); None loads ``model_config.model``'s.
    Raises:
        ValueError: for an unknown model or a bad config (before any work is done), an injected
            model on another device than ``engine_config.device`` names, or ``speculative.method="mtp"``
            with a model without multi-token-prediction modules (or a checkpoint without their weights).
    """

    def __init__(self, model_config: ModelConfig | None = None, engine_config: EngineConfig | None = None,
                 model_kwargs: dict | None = None, *, model=None, tokenizer=None):
        from rayinfer.model.loader import load_model, load_tokenizer, parse_dtype

        self.model_config = model_config = model_config or ModelConfig()
        self.engine_config = cfg = engine_config or EngineConfig()
        if model is None:
            self.device = resolve_device(cfg.device)
            self.dtype = parse_dtype(model_config.dtype, self.device)
        else:
            if model_kwargs:
                raise ValueError("model_kwargs apply to a loaded model, not an injected one")
            weight = next(model.parameters())
            self.device, self.dtype = weight.device, weight.dtype
            if cfg.device != "auto" and torch.device(cfg.device).type != self.device.type:
                raise ValueError(f"engine_config.device={cfg.device!r} but the given model is on {self.device}")
        chosen = [k for k in ("max_num_seqs", "max_num_batched_tokens") if getattr(cfg, k) is None]
        mem_gib = (torch.cuda.get_device_properties(self.device).total_memory / _GIB
                   if self.device.type == "cuda" else 0.0)
        self.engine_config = cfg = cfg.for_device(self.device.type, mem_gib)
        if chosen:  # name only what the user left unset
            logger.info("%s (chosen for %s%s; set %s to override)",
                        " ".join(f"{k}={getattr(cfg, k)}" for k in chosen), self.device.type,
                        f", {mem_gib:.0f} GiB" if mem_gib else "", " / ".join(f"engine.{k}" for k in chosen))
        kv_name = KV_CACHE_DTYPES[cfg.kv_cache_dtype]
        self.kv_dtype = getattr(torch, kv_name) if kv_name else self.dtype
        self.role = EngineRole(cfg.role)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_config.model)
        spec = cfg.speculative
        if model is None:
            if spec.method == "mtp":
                model_kwargs = {**(model_kwargs or {}), "enable_mtp": True}
                check_supports_mtp(model_config.model)
            torch.manual_seed(model_config.seed)
            model = load_model(model_config.model, self.dtype, self.device, model_config.load_format,
                               seed=model_config.seed, model_kwargs=model_kwargs,
                               quantization=model_config.quantization)
            if self.role == EngineRole.DECODE and hasattr(model, "drop_vision_encoder"):
                model.drop_vision_encoder()  # prompts arrive prefilled: the tower's memory goes to the KV cache
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
        self.model = model
        hf_config = self.model.config
        self.max_model_len = model_config.max_model_len or hf_config.max_position_embeddings
        if self.max_model_len > hf_config.max_position_embeddings:  # as vLLM: positions the model was not built for
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                             f"{hf_config.max_position_embeddings}")
        self.vocab_size = hf_config.vocab_size
        self.eos_token_ids = _eos_token_ids(hf_config, self.tokenizer)

        draft_model, draft_shape = None, None  # draft_shape: one block of the proposer's own KV cache
        if spec.method == "draft_model":
            draft_model = self.model  # drafting for itself: the machinery's upper bound (acceptance 1 greedy)
            if spec.draft_model is not None:
                torch.manual_seed(model_config.seed)
                draft_model = load_model(spec.draft_model, self.dtype, self.device, spec.draft_load_format,
                                         seed=model_config.seed)
            draft_shape = draft_model.kv_cache_shape(1, cfg.block_size)
        elif spec.method == "mtp":
            if not len(getattr(self.model, "mtp", ())):
                raise ValueError(f"speculative.method=mtp needs a model with multi-token-prediction modules "
                                 f"(DeepSeek-V3 built with enable_mtp=True); {type(self.model).__name__} has none")
            draft_shape = self.model.mtp_kv_cache_shape(1, cfg.block_size)
        num_blocks = cfg.num_kv_blocks or self._auto_num_blocks(draft_shape)
        if self.kv_dtype != self.dtype and not getattr(self.model, "supports_fp8_kv_cache", False):
            raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} is not supported by {type(self.model).__name__} "
                             "(fp8 KV needs the paged-attention models: Llama, Qwen3-MoE)")
        # sliding-window models (Gemma 3): the full-attention layers' cache here, and a small second cache
        # for the sliding layers, whose tables keep only each request's window (engine.kv_cache_manager)
        sliding_window = getattr(self.model, "sliding_window", None) if hasattr(self.model, "kv_cache_group_shapes") else None
        if sliding_window and self.role != EngineRole.NORMAL:
            raise ValueError(f"role={self.role.value}: prefill/decode disaggregation does not support sliding-window "
                             f"models ({type(self.model).__name__}) yet; a KV handle carries only the "
                             "full-attention layers, and the decode side would have to replay the window")
        num_local_blocks = self._num_local_blocks(sliding_window) if sliding_window else 0
        self.local_kv_cache = None
        if sliding_window:
            global_shape, local_shape = self.model.kv_cache_group_shapes(num_blocks, num_local_blocks, cfg.block_size)
            self.kv_cache = torch.zeros(global_shape, dtype=self.kv_dtype, device=self.device)
            self.local_kv_cache = torch.zeros(local_shape, dtype=self.kv_dtype, device=self.device)
        else:
            self.kv_cache = torch.zeros(self.model.kv_cache_shape(num_blocks, cfg.block_size), dtype=self.kv_dtype,
                                        device=self.device)
        num_host_blocks = self._num_host_blocks()
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=cfg.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            role=self.role,
            num_host_blocks=num_host_blocks,
            sliding_window=sliding_window or None,
            num_local_blocks=num_local_blocks,
        ))
        self.sampler = Sampler(self.vocab_size, model_config.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, cfg.block_size, self.sampler, cfg.batch_invariant,
                                  self.local_kv_cache)
        self.runner.sync_guard = cfg.debug_sync_guard
        self.is_multimodal = bool(getattr(self.model, "is_multimodal", False))
        if self.is_multimodal:
            from rayinfer.engine.multimodal import EncoderCache

            self.runner.encoder_cache = EncoderCache(cfg.encoder_cache_tokens)
        if num_host_blocks:
            from rayinfer.engine.host_kv_cache import HostKVCache

            self.runner.host_cache = HostKVCache(self.kv_cache, num_host_blocks)
        on_cuda = self.device.type == "cuda"
        self.async_scheduling = on_cuda if cfg.async_scheduling is None else cfg.async_scheduling
        self.proposer = None
        self.spec_stats = SpecStats(spec.num_draft_tokens)
        self.step_time = StepTimeModel()
        self.calibrator = AcceptanceCalibrator(spec.num_draft_tokens)
        self.gate = SpeculationGate()  # "confidence": speculate only where it measured faster than plain
        self._draft_probs: dict[str, list[float] | None] = {}  # of the drafts being verified, by request
        self.num_device_drafted_steps = 0  # steps whose drafts (some of them) were made on the device (MTP)
        # pipelined speculative decoding: a verification step is planned and launched behind the one in flight,
        # from the drafts made on the device behind it (MTP or a draft model, in the target's graphs; see
        # _step_chained; the confidence schedule picks each chained step's width from the step before's confidences)
        # (n-gram with the confidence schedule never chains: its drafts carry no probabilities to choose a chained
        # step's width from, see _chained_num_drafts)
        chains = spec.device_drafts and (spec.method in ("mtp", "draft_model") or spec.method == "ngram"
                                         and spec.ngram_on_device and spec.schedule == "fixed")
        if spec.enabled:
            if spec.method == "ngram":
                self.proposer = NgramProposer(spec.ngram_min, spec.ngram_max, on_device=spec.ngram_on_device)
            elif spec.method == "mtp":
                self.proposer = MtpProposer(self.model, num_blocks, cfg.block_size, self.vocab_size)
            else:
                self.proposer = DraftModelProposer(draft_model, num_blocks, cfg.block_size, self.vocab_size,
                                                   max_catch_up_tokens=cfg.max_num_batched_tokens)
            # MTP reads the target's hidden states: every step keeps them (graphs capture them too)
            self.runner.capture_hidden = self.proposer.needs_hidden
            if self.async_scheduling and not chains and (self.proposer.needs_hidden or spec.schedule != "confidence"):
                # drafts need the last step's tokens (MTP: its hidden states) on the host: every step drafts, so
                # every step drains; with the confidence schedule only drafting steps drain, plain ones pipeline.
                # MTP and draft models drafting on the device chain verification steps instead (_step_chained)
                logger.info("speculative decoding (%s, %s schedule): pipelined scheduling is off, steps run "
                            "drained", spec.method, spec.schedule)
                self.async_scheduling = False
        self._inflight = None  # (SchedulerOutput, PendingStep, its requests) launched but not yet processed
        self._inflight_speculative = False  # whether the step in flight was launched as a drafting step
        self._last_speculative = False  # whether the last step drafted (the gate's choice)
        self._gate_sample = None  # the last pure-decode call's measurement, recorded at the next call
        # the confidence schedule's plain steps look n-gram drafts up now and then (_look_for_drafts)
        self._plain_steps_look = (self.proposer is not None and self.proposer.drafts_vary
                                  and spec.schedule == "confidence")
        self._plain_lookups = 0  # plain decode calls of the confidence schedule (_look_for_drafts)
        self._last_lookup = (0.0, 0.0)  # the last of their draft lookups: (when, seconds it took)
        if (on_cuda and not cfg.enforce_eager or not on_cuda and cfg.debug_eager_graphs) and self.local_kv_cache is None:
            # speculative: verification steps (each request's last token + up to k drafts) get graphs too
            def graph_query_len(model) -> int:
                # a model may cap it (MLA: only its absorbed attention reads the lengths on the device)
                if not spec.enabled:
                    return 1
                return min(spec.num_draft_tokens + 1, getattr(model, "max_graph_query_len", None) or 1 << 30)

            self.runner.capture_cuda_graphs(self.max_model_len, min(cfg.max_num_seqs, 512), graph_query_len(self.model),
                                            eager=not on_cuda)
            # the proposers' own graphs are captured on CUDA only (debug_eager_graphs: the target's alone)
            if on_cuda and isinstance(self.proposer, DraftModelProposer):
                self.proposer.capture_cuda_graphs(self.max_model_len, min(cfg.max_num_seqs, 512),
                                                  graph_query_len(self.proposer.model))
            elif on_cuda and isinstance(self.proposer, MtpProposer):
                self.proposer.capture_cuda_graphs(self.max_model_len, min(cfg.max_num_seqs, 512),
                                                  spec.num_draft_tokens)
        can_chain = chains and self.async_scheduling and self.runner.graphs is not None
        # MTP's and a draft model's device drafts also serve drained steps; n-gram's device lookup only feeds chained
        # ones (elsewhere it would run behind every verification step for nothing: 0.45 ms a step on a CPU)
        if (self.proposer is not None and spec.device_drafts
                and (can_chain or not isinstance(self.proposer, NgramProposer))):
            self.proposer.enable_device_drafts(self.max_model_len, min(cfg.max_num_seqs, 512), spec.num_draft_tokens)
        self.chain_verification = can_chain and self.proposer is not None and self.proposer.device_graphs is not None
        self.num_chained_steps = 0
        if self.proposer is not None and self.async_scheduling:
            logger.info("speculative decoding (%s, %s schedule): verification steps %s", spec.method, spec.schedule,
                        "chained behind the step in flight" if self.chain_verification else "drained")
        if spec.method == "ngram" and spec.ngram_on_device and not self.chain_verification:
            logger.info("speculative decoding: ngram_on_device has no effect here: its lookup feeds chained steps only, "
                        "which need device_drafts, the fixed schedule, pipelined scheduling and CUDA graphs (here: "
                        "device_drafts %s, schedule %s, async_scheduling %s, graphs %s); drafts are looked up on the host",
                        spec.device_drafts, spec.schedule, self.async_scheduling, self.runner.graphs is not None)
        self._warm_up_prefill(on_cuda)
        self.num_prompt_tokens = 0  # counters for metrics
        self.num_generation_tokens = 0
        self.num_computed_tokens = 0
        # PREFILL role: prefilled requests whose KV waits in the pool for a transfer (written on the engine
        # thread; other threads read entries to gather their blocks, see gather_kv)
        self.parked: dict[str, ParkedKV] = {}
        self._parked_lock = threading.RLock()  # pin_kv (any thread) against release_kv / expire_kv
        # KV store tier (NORMAL role, set by the engine actor): called on the engine thread as
        # store_writer(block hashes from block 0, start, payload [L, n, ...] on the cache's device) with a
        # finished request's full blocks from ``start`` on; it copies the payload to the host and puts it
        # in the store off this thread, and returns whether it took the write. ``stored_hashes``: hashes known to be in the store (LRU, bounded).
        self.store_writer = None
        self.stored_hashes: OrderedDict[int, None] = OrderedDict()
        fp8 = any(p.dtype == torch.float8_e4m3fn for p in self.model.parameters())  # checkpoint or model.quantization
        role = "" if self.role == EngineRole.NORMAL else f" ({self.role.value} replica)"  # PD: which one this is
        logger.info("engine ready%s: %s on %s (%s%s), %d KV blocks of %d", role, model_config.model, self.device,
                    self.dtype, ", fp8 block weights" if fp8 else "", num_blocks, cfg.block_size)

    def _num_host_blocks(self) -> int:
        """Host KV tier slots from ``host_kv_cache_gib`` (0 when off). Raises ValueError for a size under
        one block or a tier without prefix caching."""
        cfg = self.engine_config
        if not cfg.host_kv_cache_gib:
            return 0
        per_block = self.kv_cache[:, 0].numel() * self.kv_cache.element_size()
        n = int(cfg.host_kv_cache_gib * _GIB // per_block)
        if n <= 0:
            raise ValueError(f"host_kv_cache_gib={cfg.host_kv_cache_gib} holds no KV block (one block is "
                             f"{per_block} bytes)")
        if not cfg.enable_prefix_caching:
            raise ValueError("host_kv_cache_gib > 0 needs enable_prefix_caching (the host tier holds cached blocks)")
        return n

    def _num_local_blocks(self, window: int) -> int:
        """Blocks of the sliding layers' pool: every running request's window plus the blocks a step's
        new tokens can span (``max_num_seqs * (ceil(W / bs) + 2) + ceil(max_num_batched_tokens / bs)``),
        and the reserved null block."""
        cfg = self.engine_config
        bs = cfg.block_size
        return cfg.max_num_seqs * (-(-window // bs) + 2) + -(-cfg.max_num_batched_tokens // bs) + 1

    def _warm_up_prefill(self, on_cuda: bool) -> None:
        """On CUDA, run a chunk-sized prompt and its halvings down to 512 tokens through the model at startup
        (``ModelRunner.warm_up_prefill``), as vLLM's start-up forward does: the first 1K prompt of a
        V2-Lite-shaped MoE engine waited 4.2 s for its kernels to compile without it, 57 ms with it. Not for a
        DECODE-role engine (it never prefills), a sliding-window or context-parallel layout, or a process in a
        distributed group (expert-parallel ranks step in lockstep)."""
        import torch.distributed as dist

        cfg, runner = self.engine_config, self.runner
        grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if (not on_cuda or self.role == EngineRole.DECODE or grouped or runner.local_kv_cache is not None
                or runner.cp is not None):
            return
        num_tokens = min(cfg.max_num_batched_tokens, self.max_model_len - 1, runner.prompt_capacity)
        started = time.perf_counter()
        try:
            lengths = runner.warm_up_prefill(num_tokens)
        except Exception as e:  # noqa: BLE001 - an optimization only: the engine serves without it
            logger.warning("warm-up prefill of %d tokens failed (%s: %s); the first long prompt compiles its "
                           "kernels instead", num_tokens, type(e).__name__, e)
            torch.cuda.empty_cache()  # CUDA only gets here
            return
        logger.info("warm-up prefill of %s tokens in %.2f s", lengths, time.perf_counter() - started)

    def _auto_num_blocks(self, draft_shape: tuple[int, ...] | None = None) -> int:
        cfg = self.engine_config
        per_block = math.prod(self.model.kv_cache_shape(1, cfg.block_size)) * self.kv_dtype.itemsize
        local_bytes = 0
        window = getattr(self.model, "sliding_window", None) if hasattr(self.model, "kv_cache_group_shapes") else None
        if window:  # the main pool holds the full-attention layers; the sliding layers' pool comes first
            global_shape, local_shape = self.model.kv_cache_group_shapes(1, self._num_local_blocks(window), cfg.block_size)
            per_block = math.prod(global_shape) * self.kv_dtype.itemsize
            local_bytes = math.prod(local_shape) * self.kv_dtype.itemsize
        if draft_shape is not None:  # the proposer's own cache gets as many blocks, from the same budget
            per_block += math.prod(draft_shape) * self.dtype.itemsize
        if self.device.type == "cuda":
            # this replica's share of the whole GPU minus what it already holds (weights), within what is
            # free: replicas sharing a GPU (PD over cuda_ipc) each pass their own fraction
            free, total = torch.cuda.mem_get_info(self.device)
            activation_reserve = 2 * _GIB
            own = torch.cuda.memory_reserved(self.device)
            budget = (min(total * cfg.gpu_memory_utilization - own, free) - activation_reserve
                      - cfg.kv_transfer_buffer_gib * _GIB)
        else:
            budget = cfg.kv_cache_memory_gib * _GIB
        num_blocks = int((budget - local_bytes) // per_block)
        if num_blocks <= 0:
            raise ValueError("no memory left for the KV cache; lower the model size or raise the memory budget")
        return num_blocks

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    grammar=None, kv_handle: KVHandle | None = None,
                    output_token_ids: list[int] | None = None,
                    mm_inputs: list[MultiModalInput] | None = None) -> None:
        """Validate and queue a request.

        Args:
            request_id: unique among live requests.
            prompt_token_ids: the prompt, non-empty, shorter than the context limit.
            params: sampling parameters (``n`` must be 1 here; callers fan out ``n > 1``).
            grammar: an xgrammar GrammarMatcher constraining the output, or None.
            kv_handle: KV computed elsewhere for the first ``kv_handle.num_tokens`` tokens (payload a
                tensor of this cache's layout): DECODE role, the prefilled request (required there);
                PREFILL / NORMAL role, a prefix loaded from the KV store instead of recomputed.
            output_token_ids: tokens already generated elsewhere (the first token after a prefill, or
                all tokens so far when a preempted or failed request is re-prefilled); a grammar is
                advanced over them.
            mm_inputs: the prompt's images (vision-language models), in prompt order: content hash,
                placeholder range, pixels or precomputed embeddings (see ``engine.multimodal``). An image
                whose placeholders all lie in ``kv_handle``'s tokens needs neither (DECODE role: its content
                hash keys the blocks' hashes, so the prefix cache and the handle's hashes stay per image).
        Raises:
            InvalidRequestError: naming the problem, with ``param`` "prompt" (empty or too long, a token
                id out of range), "max_tokens" (beyond the context), "n", "response_format" (output
                tokens the grammar rejects) or None (more KV blocks than the pool holds, duplicate id,
                missing handle, a handle that covers every token or whose block hashes, layout or
                payload shape do not match), "image" (images for a text-only model, a placeholder range
                outside the prompt, overlapping or not on image tokens, wrong pixel or embedding shapes).
        """
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt")
        if params.n != 1:
            raise InvalidRequestError("the engine takes n=1 per request; fan out n > 1 above it", "n")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {n} tokens but the context limit (max_model_len) is "
                                      f"{self.max_model_len}; no room for output", "prompt")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                      f"context limit of {self.max_model_len} tokens", "max_tokens")
        limit = min(n + (params.max_tokens or self.max_model_len), self.max_model_len)
        blocks = self.scheduler.kv.blocks_needed(limit)
        if blocks > self.scheduler.config.num_blocks:
            raise InvalidRequestError(f"request may need {blocks} KV blocks but the pool holds "
                                      f"{self.scheduler.config.num_blocks}")
        if self.role == EngineRole.DECODE and kv_handle is None:
            raise InvalidRequestError("a decode-only replica admits requests only with a KV handle")
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"duplicate request id {request_id!r}")
        all_ids = list(prompt_token_ids) + list(output_token_ids or [])
        if mm_inputs:
            self._check_mm_inputs(mm_inputs, prompt_token_ids, kv_handle.num_tokens if kv_handle is not None else 0)
        if kv_handle is not None:
            self._check_handle(kv_handle, all_ids, mm_inputs or ())
        elif not output_token_ids and not mm_inputs and self._uses_cp(prompt_token_ids):  # CP: text prompts only
            # the CP ranks compute all but the last prompt token when this request's KV is imported; the
            # next step computes the last one here and samples (rayinfer.engine.context_parallel)
            kv_handle = KVHandle(request_id, [], n - 1, kv_layout_tag(self.kv_cache),
                                 ContextParallelPrefill(tuple(prompt_token_ids[:-1]), self.runner.cp.min_tokens))
        if grammar is not None:
            for t in output_token_ids or []:
                if not grammar.accept_token(t):
                    raise InvalidRequestError(f"output token {t} is not allowed by the request's "
                                              "response_format", "response_format")
        req = Request(request_id, list(prompt_token_ids), params, eos_token_ids=self.eos_token_ids,
                      grammar=grammar, kv_handle=kv_handle, output_token_ids=list(output_token_ids or []),
                      mm_inputs=list(mm_inputs or []))
        self.scheduler.add_request(req)

    def set_context_parallel(self, prefiller) -> None:
        """Make this engine rank 0 of a context-parallel replica: prompts whose part not in the prefix cache
        has at least ``prefiller.min_tokens`` tokens are prefilled by the CP ranks
        (:class:`~rayinfer.engine.context_parallel.CPPrefiller`); the rest run here alone. None only
        checks that the engine supports CP (and turns it off).

        Raises:
            ValueError: for a model other than Llama's, a role other than NORMAL, or speculative decoding
                with a draft model or MTP (their own KV of the prompt would not be computed).
        """
        from rayinfer.engine.context_parallel import check_cp_model

        check_cp_model(self.model)
        if self.role != EngineRole.NORMAL:
            raise ValueError(f"context-parallel prefill runs in NORMAL replicas only, not {self.role.value}")
        if self.engine_config.speculative.enabled and self.engine_config.speculative.method in ("draft_model", "mtp"):
            raise ValueError(f"context-parallel prefill (parallel.cp > 1) does not support speculative.method="
                             f"{self.engine_config.speculative.method} (the drafter's KV of the prompt is not computed)")
        self.runner.cp = prefiller

    def _uses_cp(self, prompt_token_ids: list[int]) -> bool:
        """Whether a new prompt is prefilled with CP: its tokens beyond rank 0's cached prefix (device and
        host tiers, a hint read on the engine thread) reach the prefiller's threshold."""
        cp = self.runner.cp
        if cp is None or not cp.applies(len(prompt_token_ids) - 1):
            return False
        kv, bs = self.scheduler.kv, self.engine_config.block_size
        hashes = hash_block_chain(prompt_token_ids, bs)
        num_cached = len(kv.pool.match_prefix(hashes, count=False))
        while kv.host is not None and num_cached < len(hashes) and hashes[num_cached] in kv.host.hash_to_slot:
            num_cached += 1
        return cp.applies(len(prompt_token_ids) - 1 - num_cached * bs)

    def _check_mm_inputs(self, mm_inputs: list[MultiModalInput], prompt: list[int], num_imported: int = 0) -> None:
        """Raises InvalidRequestError ("image") unless the images fit this model and the prompt; an image
        within the first ``num_imported`` tokens (imported KV) may come without pixels or embeddings."""
        if not self.is_multimodal:
            raise InvalidRequestError(f"model {self.model_config.model!r} does not take images", "image")
        model, end = self.model, 0
        hidden = self.model.config.hidden_size
        for i, m in enumerate(mm_inputs):
            if m.offset < end or m.length <= 0 or m.offset + m.length > len(prompt):
                raise InvalidRequestError(f"image {i}: placeholder range [{m.offset}, {m.offset + m.length}) is "
                                          "empty, overlaps the previous image or leaves the prompt", "image")
            if any(t != model.image_token_id for t in prompt[m.offset : m.offset + m.length]):
                raise InvalidRequestError(f"image {i}: the prompt has other tokens than the image token "
                                          f"{model.image_token_id} at its placeholders", "image")
            end = m.offset + m.length
            if m.embeds is not None:
                if tuple(m.embeds.shape) != (m.length, hidden):
                    raise InvalidRequestError(f"image {i}: embeddings have shape {tuple(m.embeds.shape)}, expected "
                                              f"{(m.length, hidden)}", "image")
            elif m.pixel_values is None:
                if m.offset + m.length > num_imported:
                    raise InvalidRequestError(f"image {i} has neither pixel_values nor embeddings", "image")
            else:
                want = (3, model.image_size, model.image_size)
                if tuple(m.pixel_values.shape) != want:
                    raise InvalidRequestError(f"image {i}: pixel_values have shape {tuple(m.pixel_values.shape)}, "
                                              f"expected {want} (use the model's image processor)", "image")
                if m.length != model.num_image_tokens:
                    raise InvalidRequestError(f"image {i} has {m.length} placeholder tokens; this model gives an "
                                              f"image {model.num_image_tokens}", "image")

    def _check_handle(self, handle: KVHandle, token_ids: list[int], mm_inputs=()) -> None:
        bs = self.engine_config.block_size
        if not 0 < handle.num_tokens < len(token_ids):
            raise InvalidRequestError(f"KV handle covers {handle.num_tokens} tokens; the request has "
                                      f"{len(token_ids)} and at least one must be left to compute")
        n = len(handle.block_hashes)
        if n > handle.num_tokens // bs or mm_hash_block_chain(token_ids[: n * bs], bs, None, mm_inputs) != list(
                handle.block_hashes):
            raise InvalidRequestError("KV handle's block hashes do not match the request's tokens")
        if not 0 <= handle.first_block <= n:
            raise InvalidRequestError(f"KV handle leaves out {handle.first_block} leading blocks; it may leave "
                                      f"out only its {n} hashed full blocks")
        if handle.layout != kv_layout_tag(self.kv_cache):
            raise InvalidRequestError(f"KV layout {handle.layout!r} does not match this engine's "
                                      f"{kv_layout_tag(self.kv_cache)!r}")
        shape = (self.kv_cache.shape[0], -(-handle.num_tokens // bs) - handle.first_block, *self.kv_cache.shape[2:])
        if handle.payload is not None and tuple(handle.payload.shape) != shape:
            raise InvalidRequestError(f"KV payload has shape {tuple(handle.payload.shape)}, expected {shape}")

    def abort_request(self, request_ids) -> None:
        """Abort live requests (unknown ids are ignored); their blocks are freed at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for rid in ids:
            self.parked.pop(rid, None)
            self._forget(rid)

    # -- PD: parked KV (PREFILL role) ------------------------------------------------------------
    def gather_kv(self, request_ids: list[str], out: torch.Tensor | None = None,
                  device: torch.device | str | None = None, layers: slice | None = None) -> torch.Tensor:
        """Copy the parked KV of ``request_ids`` (in order) into one payload ``[L, n, 2, bs, H, D]`` (or
        only ``layers`` of it: ``[len(layers), n, ...]``).

        Safe from any thread while the requests stay parked (parked blocks are never written, and are
        freed only by :meth:`release_kv` / :meth:`expire_kv` on the engine thread).

        Args:
            request_ids: parked requests; ``n`` is the sum of their blocks.
            out: a contiguous tensor of that shape and the cache's dtype on the cache's device to fill
                (a reused staging buffer), or None for a new tensor.
            device: where a new payload lands (default the cache's device); ignored with ``out``.
        Raises:
            KeyError: naming a request that is not parked here (never prefilled, released or expired).
        """
        blocks: list[int] = []
        for rid in request_ids:
            entry = self.parked.get(rid)
            if entry is None:
                raise KeyError(f"no parked KV for request {rid!r} (released, expired or never prefilled here)")
            blocks.extend(entry.block_ids)
        idx = torch.tensor(blocks, dtype=torch.long).to(self.device)
        cache = self.kv_cache if layers is None else self.kv_cache[layers]
        if out is not None:
            return torch.index_select(cache, 1, idx, out=out)
        payload = torch.index_select(cache, 1, idx)
        return payload if device is None else payload.to(device)

    def release_kv(self, request_ids: list[str]) -> None:
        """Free parked requests' blocks (engine thread only; unknown ids are ignored). Full blocks stay in
        the prefix cache until evicted."""
        for rid in request_ids:
            with self._parked_lock:
                entry = self.parked.pop(rid, None)
            if entry is not None:
                self.scheduler.finish_requests(rid, RequestStatus.FINISHED_PREFILLED)

    def take_kv(self, request_id: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """Gather one parked request's payload onto ``device`` and free its blocks (engine thread only).

        Raises:
            KeyError: if the request is not parked here.
        """
        payload = self.gather_kv([request_id], device=device)
        self.release_kv([request_id])
        return payload

    def pin_kv(self, request_id: str) -> tuple[int, ...]:
        """Keep a parked request's blocks from expiring while another process reads them in place (a cuda_ipc
        transfer); returns its block ids. :meth:`release_kv` frees them as before. Safe from any thread: an
        expiry scan either freed the request first (KeyError) or leaves it be.

        Raises:
            KeyError: if the request is not parked here (never prefilled, released or expired).
        """
        with self._parked_lock:
            entry = self.parked.get(request_id)
            if entry is None:
                raise KeyError(f"no parked KV for request {request_id!r} (released, expired or never prefilled "
                               "here)")
            self.parked[request_id] = entry._replace(since=math.inf)
            return entry.block_ids

    def expire_kv(self, ttl_s: float) -> list[str]:
        """Release parked KV older than ``ttl_s`` seconds (nobody came for it); returns the ids."""
        now = time.monotonic()
        with self._parked_lock:
            old = [rid for rid, e in self.parked.items() if now - e.since > ttl_s]
            self.release_kv(old)
        return old

    def _forget(self, request_id: str) -> None:
        self.sampler.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)
            self._draft_probs.pop(request_id, None)

    def _speculate_next(self) -> bool:
        """Whether the next step drafts: always with ``schedule="fixed"``; with "confidence" when the
        :class:`SpeculationGate` measured speculation faster at the running batch size (or is measuring).
        A step that does not draft may run pipelined."""
        if self.engine_config.speculative.schedule != "confidence":
            return True
        running = len(self.scheduler.running)
        return running > 0 and self.gate.speculate(running)

    def _propose(self) -> None:
        """Speculative decoding: draft tokens for the running requests that decode next (their only token
        left to compute is the last one), as many as the schedule picks (``speculative.schedule``).

        Requests with a grammar or penalties get no drafts (their sampling reads host state token by
        token); neither do requests within one token of ``max_tokens`` or the context limit.
        """
        spec = self.engine_config.speculative
        reqs, ks = self._draft_candidates()
        assert self.proposer is not None
        ready = self.proposer.take_drafts(reqs)  # made on the device behind the last step (MTP)
        if not reqs:
            return
        self.num_device_drafted_steps += bool(ready)
        rest = [(r, k) for r, k in zip(reqs, ks) if r.request_id not in ready]  # the proposer drafts those now
        proposed = iter(self.proposer.propose([r for r, _ in rest], [k for _, k in rest]) if rest else ())
        drafts = []
        for req, k in zip(reqs, ks):
            d = ready.get(req.request_id)
            drafts.append(next(proposed) if d is None else
                          Draft(d.token_ids[:k], None if d.probs is None else d.probs[:k]))
        self.spec_stats.num_drafts_proposed += sum(len(d.token_ids) for d in drafts)
        if self.proposer.drafts_vary and spec.schedule == "confidence":
            self.gate.note_drafts(True, len(self.scheduler.running), sum(len(d.token_ids) for d in drafts) / len(drafts))
        keep = self._drafts_to_verify(drafts) if spec.schedule == "confidence" else [len(d.token_ids) for d in drafts]
        for req, d, k in zip(reqs, drafts, keep):
            req.draft_token_ids = d.token_ids[:k]
            self._draft_probs[req.request_id] = d.probs

    def _draft_candidates(self, step_in_flight: bool = False) -> tuple[list[Request], list[int]]:
        """The running requests that may draft for their next step, and the most drafts worth proposing for
        each (at least 1): decoding (one token left to compute, the prompt done; with ``step_in_flight``, none
        left while a step computes it), no grammar or penalties (their sampling reads host state token by
        token), room left before ``max_tokens`` and the context limit."""
        spec = self.engine_config.speculative
        reqs, ks = [], []
        for req in self.scheduler.running:
            p = req.params
            if (req.num_tokens - req.num_computed_tokens not in ((0, 1) if step_in_flight else (1,))
                    or req.num_computed_tokens < req.num_prompt_tokens or req.grammar is not None or p.needs_penalties):
                continue
            room = self.max_model_len - req.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            k = min(spec.num_draft_tokens, room)
            if k > 0:
                reqs.append(req)
                ks.append(k)
        return reqs, ks

    # the confidence schedule's plain steps look drafts up (a proposer whose drafts vary with the text) every so
    # many steps, for so many requests at most (in turn), and only while the lookups take at most this share of the time
    DRAFT_LOOKUP_EVERY = 8
    DRAFT_LOOKUP_REQUESTS = 32
    DRAFT_LOOKUP_SHARE = 0.05

    def _look_for_drafts(self) -> None:
        """A plain decode step of the confidence schedule, with a proposer whose drafts vary with the text (n-gram):
        every ``DRAFT_LOOKUP_EVERY`` such steps, and no sooner than the last lookup's time over
        ``DRAFT_LOOKUP_SHARE``, count the drafts it would find now for the gate
        (:meth:`SpeculationGate.note_drafts`: the mean a request). A larger batch is sampled: each lookup takes the
        next ``DRAFT_LOOKUP_REQUESTS`` of the running requests in turn, as a mean needs no more. The lookup
        reads the tokens known on the host (with a step in flight, one step old) and changes nothing."""
        self._plain_lookups += 1
        now = time.perf_counter()
        last_at, last_s = self._last_lookup
        if self._plain_lookups % self.DRAFT_LOOKUP_EVERY or now - last_at < last_s / self.DRAFT_LOOKUP_SHARE:
            return
        reqs, ks = self._draft_candidates(step_in_flight=True)
        n = self.DRAFT_LOOKUP_REQUESTS
        if len(reqs) > n:
            start = (self._plain_lookups // self.DRAFT_LOOKUP_EVERY * n) % len(reqs)
            reqs, ks = (reqs + reqs)[start : start + n], (ks + ks)[start : start + n]
        if reqs:
            assert self.proposer is not None
            drafts = self.proposer.propose(reqs, ks)
            self.gate.note_drafts(False, len(self.scheduler.running), sum(len(d.token_ids) for d in drafts) / len(reqs))
            self._last_lookup = (now, time.perf_counter() - now)

    def _drafts_to_verify(self, drafts: list[Draft]) -> list[int]:
        """The confidence schedule: how many of each draft to verify this step (:func:`choose_num_drafts` over
        the calibrated confidences of the drafts, with the step time model, one base token per running request)."""
        spec = self.engine_config.speculative
        conf = torch.zeros(len(drafts), spec.num_draft_tokens)
        for i, d in enumerate(drafts):
            if d.token_ids:
                conf[i, : len(d.token_ids)] = torch.tensor(self.calibrator.confidence(d), dtype=torch.float32)
        max_verify = spec.max_verify_tokens or spec.num_draft_tokens * self.engine_config.max_num_seqs
        num_base = len(self.scheduler.running)
        return choose_num_drafts(conf, num_base, float(num_base), self.step_time.a, self.step_time.b, max_verify,
                                 spec.min_confidence).tolist()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._inflight is not None

    # -- the loop ------------------------------------------------------------------------------
    def step(self, run_empty: bool = False, step_kind: str | None = None) -> list[RequestOutput]:
        """Schedule, run the model, sample. Returns one core delta per request that moved.

        A delta has the step's token ids and logprobs, ``new_text`` empty, and the core's finish
        reasons: "length", "stop" (EOS: ``stop_reason`` None; a stop token id: that id; a finished
        grammar), "prefilled" (PREFILL role, with ``kv_handle``) or "preempted" (DECODE role, no tokens).
        Stop strings are not checked here: an :class:`~rayinfer.engine.output_processor.OutputProcessor`
        does, and its caller aborts the request (:meth:`generate` shows how).

        ``run_empty``: when nothing is scheduled, still run the model over zero tokens (an expert-
        parallel rank steps in lockstep with the others; its MoE layers are collectives).
        ``step_kind``: None, "prefill", "decode" or "idle": which work to plan (``Scheduler.schedule``;
        the group-voted kind of a lockstep step).

        With ``async_scheduling`` the step is pipelined: this call schedules and launches step N while
        the device may still run step N-1, then processes step N-1's tokens. Inputs sampled by N-1 are
        placeholders filled on the device; stop checks land one step late, and the extra token of a
        request that finished meanwhile is dropped. A step whose sampling needs host state (grammar,
        penalties, min_tokens) first drains the pipeline. A verification step drafted on the device behind
        the step before it (MTP or a draft model) is launched before that step is processed
        (:meth:`_step_chained`); other drafting steps drain the pipeline first.
        """
        started = time.perf_counter()
        self._flush_gate_sample(started)
        speculating = self.proposer is not None and self._speculate_next()
        if self._plain_steps_look and not speculating and self.scheduler.running:
            self._look_for_drafts()
        if self.chain_verification and speculating and step_kind is None and self._inflight is not None:
            chained = self._step_chained(started)
            if chained is not None:
                return chained
        drained: list[RequestOutput] = []
        # a verification step left in flight (chained) is processed before a plain step is scheduled: its rejected
        # drafts roll the requests back, so a step planned before that would start past them
        verifying = self._inflight is not None and any(s.num_draft_tokens for s in self._inflight[0].scheduled)
        if speculating or verifying:
            if self._inflight is not None:  # drafts start from the last step's tokens: drain the pipeline
                drained_sched = self._inflight[0]
                drained = self._process(*self._inflight)
                self._inflight = None
                # the drained step's tokens and the wait for them count for the mode that launched it
                self.gate.record(self._inflight_speculative, len(drained_sched.scheduled), _num_tokens(drained),
                                 time.perf_counter() - started)
                started = time.perf_counter()
            if speculating:
                self._propose()
        sched = self.scheduler.schedule() if step_kind is None else self.scheduler.schedule(step_kind)
        live = self.scheduler.requests
        step_reqs = {s.request_id: live[s.request_id] for s in sched.scheduled}  # before anything finishes
        outputs = drained + [self._handed_back_output(req) for req in self.scheduler.take_handed_back()]
        num_drafts = sum(s.num_draft_tokens for s in sched.scheduled)
        prev, prev_speculative = self._inflight, self._inflight_speculative
        self._inflight = None
        num_prev_tokens = 0  # tokens of the step that was in flight (its mode: prev_speculative)
        prev_s = 0.0  # seconds this call spent processing that step (on a GPU, mostly the wait for it)
        # (a verification step in flight was processed above; one of a drafting step that found no draft, here)
        if prev is not None and (not self.async_scheduling or sched.is_empty or self._needs_drain(sched)
                                 or prev[1].drafts is not None):
            prev_outputs, prev_s = self._process_timed(prev)
            num_prev_tokens = _num_tokens(prev_outputs)
            outputs += prev_outputs
            prev_step, prev = prev[1], None
        else:
            prev_step = prev[1] if prev is not None else None
        had_inflight = prev_step is not None
        if not sched.is_empty:
            self.num_computed_tokens += sched.num_scheduled_tokens
            try:
                launched = self.runner.execute_async(sched, step_reqs, prev_step)
            except Exception as e:  # noqa: BLE001 - find the requests at fault; the step goes on for the rest
                if prev is not None:  # its tokens come first
                    prev_outputs, prev_s = self._process_timed(prev)
                    num_prev_tokens = _num_tokens(prev_outputs)
                    outputs += prev_outputs
                    prev = None
                outputs += self._execute_isolated(sched, step_reqs, prev_step, e)
            else:
                if self.proposer is not None:
                    try:  # the next step's drafts, queued on the device behind this step (MTP)
                        with no_host_sync(self.runner.sync_guard):
                            self.proposer.launch_drafts(sched, launched, self.engine_config.speculative.num_draft_tokens)
                    except Exception:  # noqa: BLE001 - drafts are only proposals: the next step drafts on the host
                        if self.runner.sync_guard:  # debug mode: a hidden host sync is the test's failure
                            raise
                        logger.exception("drafting on the device failed; the next step drafts on the host")
                # a verification step is left in flight only where the next one may chain behind it (from the
                # drafts made on the device); else the next step starts from its accepted tokens on the host
                if self.async_scheduling and (not num_drafts or self.chain_verification):
                    self._inflight, self._inflight_speculative = (sched, launched, step_reqs), speculating
                else:
                    outputs += self._process(sched, launched, step_reqs)
        elif run_empty:
            self.runner.execute_empty()
        if prev is not None:
            prev_outputs, prev_s = self._process_timed(prev)
            num_prev_tokens = _num_tokens(prev_outputs)
            outputs += prev_outputs
        if self.proposer is not None and not sched.is_empty:
            seconds = time.perf_counter() - started
            pure_decode = sched.num_scheduled_tokens == len(sched.scheduled) + num_drafts
            if speculating or not (pure_decode and self.async_scheduling):
                # pipelined plain decode steps are left out: a call there takes max(host, device) of two
                # overlapped steps, not a + b * tokens, and beside drained drafting steps the fit read the
                # pipeline's saving as a cost per token (at batch 1, a 1-token pipelined step against a
                # 3-5-token drained one), so the per-draft schedule verified few drafts
                self.step_time.update(sched.num_scheduled_tokens, seconds)
            if pure_decode:
                batch = len(sched.scheduled)
                num_tokens = _num_tokens(outputs[len(drained):])
                # recorded at the next call, with the caller's work on this call's outputs (see _flush_gate_sample)
                refill = not speculating and self._last_speculative and not had_inflight and self._inflight is not None
                switched = had_inflight and prev_speculative != speculating
                other = num_prev_tokens if switched else 0
                self._gate_sample = (speculating, batch, num_tokens - other, other, prev_s if switched else None, refill,
                                     started, time.perf_counter())
            self._last_speculative = speculating
        return outputs

    def _process_timed(self, inflight: tuple) -> tuple[list[RequestOutput], float]:
        """:meth:`_process` of a step left in flight, and the seconds it took (on a GPU, mostly the wait for it)."""
        at = time.perf_counter()
        outputs = self._process(*inflight)
        return outputs, time.perf_counter() - at

    def _flush_gate_sample(self, now: float) -> None:
        """Hand the last pure-decode call's measurement to the gate, timed up to ``now`` (the next call):
        the caller's work on a call's outputs (output processing, detokenizing, streaming) is part of what
        a step costs, and speculation saves it by taking fewer steps (at batch 1 on the H200 about a fifth
        of plain's TPOT). A gap longer than the call itself counts as the call's length (the caller idled).

        A call that processed a pipelined step of the other mode (launched before the gate switched: a drafting
        step that verified no draft, or a plain step) splits: the time it spent processing that step (on a GPU,
        the wait for it), the caller's work on the outputs and that step's tokens count for that step's mode;
        the rest of the call (planning and launching its own step; on a CPU, computing it) for the call's mode.
        Counted whole for the call's mode, the first plain call after such a drafting step paid for the drafting
        step's forward, and plain run in short stretches measured a step slower per stretch than it runs (on CPU
        with a simulated 10 ms device step, 17.6 ms a step; at the Llama-3-8B shape on the H100, 17.5 ms between
        n-gram drafting steps against 9.95 ms alone, and n-gram confidence ran 0.68x plain at batch 256, 0.96x since)."""
        sample, self._gate_sample = self._gate_sample, None
        if sample is None:
            return
        speculating, batch, num_tokens, other, other_s, refill, started, ended = sample
        gap = min(max(now - ended, 0.0), ended - started)
        seconds = (ended - started) + gap
        if refill:
            # the pipeline's refill after a drafting step (this step's host work overlapped nothing): a cost
            # of speculation; the step's tokens come back with the next call, as plain's
            self.gate.charge(True, batch, seconds)
        elif other_s is not None:
            own = max(ended - started - other_s, 0.0)
            self.gate.record(not speculating, batch, other, seconds - own, other_tokens=num_tokens, other_seconds=own)
        else:
            self.gate.record(speculating, batch, num_tokens, seconds)

    def _chained_num_drafts(self) -> int:
        """Drafts each request verifies in the next chained step: k with the fixed schedule; with "confidence"
        the most that :func:`choose_num_drafts` keeps for any running request, from the calibrated confidences
        of the drafts its last verification step took (one step old: the next step's own are still on the
        device) and the step time model. A graph runs every request at the step's width, so drafts kept for
        one request cost the others nothing more."""
        spec = self.engine_config.speculative
        k = spec.num_draft_tokens
        if spec.schedule != "confidence":
            return k
        # the drafts' ids do not matter to the schedule, only their probabilities (none: no draft kept)
        last = [self._draft_probs.get(req.request_id) or [] for req in self.scheduler.running]
        keep = self._drafts_to_verify([Draft([0] * len(p[:k]), list(p[:k])) for p in last])
        return max(keep, default=0)

    def _step_chained(self, started: float) -> list[RequestOutput] | None:
        """Pipelined speculative decoding: plan and launch the next verification step of every running request
        behind the verification step still in flight, from the drafts made on the device behind it
        (``Scheduler.schedule_chained``, ``ModelRunner`` chained steps), then process the step in flight,
        give the new step its drafts and positions on the host, and queue the drafts for the step after it.
        The device never waits for the host between verification steps.

        Returns:
            the outputs of the step that was in flight, or None (nothing launched) where the next step cannot
            chain: a request not drafted on the device, a request that cannot verify k more drafts (room,
            host-state sampling), requests waiting, too few free blocks, no graph of the shape, or a launch
            that raised (logged; the caller then drains as usual).
        """
        assert self._inflight is not None and self.proposer is not None
        prev_sched, prev_step, prev_reqs = self._inflight
        running = self.scheduler.running
        if prev_step.next_inputs is None or any(r.request_id not in prev_step.next_inputs[0] for r in running):
            return None
        num_made = self.engine_config.speculative.num_draft_tokens  # what the drafter made behind the step
        k = self._chained_num_drafts()  # what the next step verifies of them
        if k < 1 or not self.runner.can_chain(len(running), k + 1):
            return None  # (no draft kept: the usual path decides with the fresh drafts)
        sched = self.scheduler.schedule_chained(k)
        if sched is None:
            return None
        live = self.scheduler.requests
        step_reqs = {s.request_id: live[s.request_id] for s in sched.scheduled}
        try:
            launched = self.runner.execute_async(sched, step_reqs, prev_step)
        except Exception:  # noqa: BLE001 - the caller drains and plans the step as usual
            if self.runner.sync_guard:
                raise
            logger.exception("launching a chained verification step failed; draining the pipeline")
            self.scheduler.undo_chained(sched)
            return None
        self._inflight = None
        self.num_chained_steps += 1
        self.num_computed_tokens += sched.num_scheduled_tokens
        drafts = self.proposer.take_chained()
        outputs = self._process(prev_sched, prev_step, prev_reqs)
        # the step in flight is processed: its accepted counts give the new step's positions and first tokens
        resolved, verified = [], []
        for s in sched.scheduled:
            req, d = live.get(s.request_id), drafts.get(s.request_id)
            tokens = list(d.token_ids[:k]) if d is not None else [PLACEHOLDER] * k
            if req is step_reqs[s.request_id] and not req.is_finished and d is not None:
                s = replace(s, token_ids=(req.output_token_ids[-1], *tokens), start_pos=req.num_computed_tokens - k - 1)
                self._draft_probs[s.request_id] = d.probs
                self.spec_stats.num_drafts_proposed += len(d.token_ids)
            resolved.append(s)
            verified.append(tuple(tokens))
        self.num_device_drafted_steps += 1
        sched = replace(sched, scheduled=tuple(resolved))
        launched.drafts = verified
        try:
            with no_host_sync(self.runner.sync_guard):
                self.proposer.launch_drafts(sched, launched, num_made)
        except Exception:  # noqa: BLE001 - drafts are only proposals: the next step drafts on the host
            if self.runner.sync_guard:
                raise
            logger.exception("drafting on the device failed; the next step drafts on the host")
        self._inflight, self._inflight_speculative = (sched, launched, step_reqs), True
        self._last_speculative = True
        if self.engine_config.speculative.schedule == "confidence":  # the gate's sample of this call, as a drained one's
            self._gate_sample = (True, len(running), _num_tokens(outputs), 0, None, False, started, time.perf_counter())
        return outputs

    def _needs_drain(self, sched) -> bool:
        from rayinfer.engine.sampler import needs_host_state

        reqs = self.scheduler.requests
        return any(s.needs_sample and s.request_id in reqs and needs_host_state(reqs[s.request_id])
                   for s in sched.scheduled)

    def _process(self, sched, launched, step_reqs: dict[str, Request]) -> list[RequestOutput]:
        try:
            step_out = self.runner.finish(launched)
        except Exception as e:  # noqa: BLE001 - waiting for the device failed: the step's samples are lost
            logger.exception("finishing an engine step failed")
            step_out = StepOutput({}, {s.request_id: e for s in sched.scheduled if s.needs_sample})
        ended = self._drop_ended(step_out, step_reqs)  # before the proposer sees the step
        if self.proposer is not None:
            if launched.hidden is not None:
                self.proposer.observe(sched, launched.hidden, step_out, ended)
            for s in sched.scheduled:
                if s.num_draft_tokens and s.request_id in step_out.sampled:
                    num_accepted = len(step_out.accepted.get(s.request_id, ()))
                    self.spec_stats.record(s.num_draft_tokens, num_accepted)
                    self.calibrator.record(self._draft_probs.get(s.request_id), s.num_draft_tokens, num_accepted)
        return self._apply(sched, step_out, step_reqs)

    def _execute_isolated(self, sched: SchedulerOutput, step_reqs: dict[str, Request], prev_step,
                          error: Exception) -> list[RequestOutput]:
        """Rerun a step that raised as a whole one request at a time (synchronously), so that a fault of
        one request (its KV import, its sampling inputs) fails that request only.

        Rerunning is safe: the step's scheduler state is already advanced and each request writes the
        same KV slots again; nothing was sampled. Side effects: the failed requests are finished with
        an error (see :meth:`_apply`).
        """
        logger.warning("engine step of %d requests failed (%s: %s); rerunning them one at a time",
                       len(sched.scheduled), type(error).__name__, error)
        if len(sched.scheduled) == 1:
            step_out = StepOutput({}, {sched.scheduled[0].request_id: error})
        else:
            step_out = StepOutput({})
            for s in sched.scheduled:
                alone = SchedulerOutput((s,), kv_imports=tuple(i for i in sched.kv_imports if i[0] == s.request_id))
                try:
                    out = self.runner.finish(self.runner.execute_async(alone, step_reqs, prev_step))
                except Exception as e:  # noqa: BLE001 - this request's fault
                    step_out.errors[s.request_id] = e
                else:
                    step_out.sampled.update(out.sampled)
                    step_out.errors.update(out.errors)
                    step_out.accepted.update(out.accepted)
        self._drop_ended(step_out, step_reqs)  # the step before may have ended some (processed first)
        return self._apply(sched, step_out, step_reqs)

    def _apply(self, sched: SchedulerOutput, step_out: StepOutput, step_reqs: dict[str, Request]) -> list[RequestOutput]:
        """Fail the requests in ``step_out.errors``, then append the others' tokens and make their deltas
        (a request whose delta raises fails alone too). The callers have dropped the requests that ended while
        the step was in flight (:meth:`_drop_ended`)."""
        outputs = []
        for rid, e in step_out.errors.items():
            step_out.sampled.pop(rid, None)
            outputs.append(self._fail(step_reqs[rid], e))
        for req in self.scheduler.update_from_output(sched, step_out):
            try:
                outputs.append(self._make_output(req, step_out.tokens(req.request_id)))
            except Exception as e:  # noqa: BLE001 - e.g. exporting its KV: this request's fault
                outputs.append(self._fail(req, e))
        return outputs

    def _drop_ended(self, step_out: StepOutput, step_reqs: dict[str, Request]) -> frozenset[str]:
        """Drop from ``step_out`` the requests that ended while the step was in flight (aborted, a stop string
        found outside the core, finished by the step before a chained one): their tokens are not appended,
        and their ids may already name new requests, whose tokens these are not. Returns their ids."""
        live = self.scheduler.requests
        ended = frozenset(rid for rid, req in step_reqs.items() if live.get(rid) is not req)
        for rid in ended:
            step_out.sampled.pop(rid, None)
            step_out.errors.pop(rid, None)
            step_out.accepted.pop(rid, None)
        return ended

    def _fail(self, req: Request, error: Exception) -> RequestOutput:
        """End one request with an error (its blocks freed); the engine and other requests go on."""
        logger.error("request %s failed in an engine step: %s: %s", req.request_id, type(error).__name__, error,
                     exc_info=error)
        self.scheduler.finish_requests(req.request_id, RequestStatus.FINISHED_ERROR)
        req.status = RequestStatus.FINISHED_ERROR
        self._forget(req.request_id)
        message = str(error) if isinstance(error, ValueError) else f"internal error: {type(error).__name__}: {error}"
        return RequestOutput(req.request_id, finished=True, finish_reason="error", error=message,
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens)

    def _handed_back_output(self, req: Request) -> RequestOutput:
        """DECODE role: a preempted request leaves with finish_reason "preempted" (no new tokens); the
        router re-prefills prompt + the outputs it has already streamed."""
        self._forget(req.request_id)
        return RequestOutput(req.request_id, finished=True, finish_reason="preempted",
                             num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=req.num_output_tokens,
                             num_cached_tokens=req.num_cached_tokens)

    def _make_output(self, req: Request, tokens: list) -> RequestOutput:
        """The core delta of a request that got ``tokens`` (SampledTokens, already appended) this step."""
        rid = req.request_id
        self.num_generation_tokens += len(tokens)
        num_output = len(req.output_token_ids)
        if num_output == len(tokens):
            self.num_prompt_tokens += len(req.prompt_token_ids)
        handle = None
        prefilled = req.status == RequestStatus.FINISHED_PREFILLED
        if prefilled:  # the KV stays in the pool, parked, until take_kv / release_kv
            handle = self.runner.kv_handle(req, req.num_computed_tokens)
            self.parked[rid] = ParkedKV(tuple(req.block_ids[: -(-handle.num_tokens // self.runner.block_size)]),
                                        handle.num_tokens, time.monotonic())
        finished = req.is_finished
        out = RequestOutput(
            request_id=rid,
            new_token_ids=[t.token_id for t in tokens],
            new_logprobs=list(tokens) if req.params.logprobs is not None else None,
            finished=finished,
            finish_reason="prefilled" if prefilled else req.finish_reason if finished else None,
            stop_reason=req.stop_reason,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=num_output,
            num_cached_tokens=req.num_cached_tokens,
            kv_handle=handle,
            queue_time_s=None if req.first_scheduled_time is None else req.first_scheduled_time - req.arrival_time,
        )
        if finished:
            self._forget(rid)
            if self.store_writer is not None and req.status != RequestStatus.FINISHED_PREFILLED:
                self._write_to_store(req)
        return out

    def mark_stored(self, block_hashes) -> None:
        """Remember hashes the KV store holds (written or read), so they are not written again."""
        known = self.stored_hashes
        for h in block_hashes:
            known[h] = None
            known.move_to_end(h)
        while len(known) > _MAX_STORED_HASHES:
            known.popitem(last=False)

    def _write_to_store(self, req: Request) -> None:
        """Hand a finished request's full blocks that are still cached (and not known stored) to the store
        writer. Engine thread: the blocks were just freed and nothing reuses them before the gather, which
        the device runs in stream order ahead of any later step."""
        hashes = req.block_hashes
        block_ids = self.scheduler.kv.pool.match_prefix(hashes, count=False)
        start = 0
        while start < len(block_ids) and hashes[start] in self.stored_hashes:
            start += 1
        if start >= len(block_ids):
            return
        n = len(block_ids)
        idx = torch.tensor(block_ids[start:], dtype=torch.long).to(self.device, non_blocking=True)
        payload = torch.index_select(self.kv_cache, 1, idx)
        try:
            queued = self.store_writer(list(hashes[:n]), start, payload)  # pyright: ignore[reportOptionalCall]
        except Exception:  # noqa: BLE001 - a cache write never fails a request
            logger.exception("KV store write failed")
            return
        if queued:
            self.mark_stored(hashes[:n])

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 request_ids: list[str] | None = None,
                 mm_inputs: list[list[MultiModalInput]] | None = None) -> list[Completion]:
        """Run prompts to completion with text and stop strings (a convenience for tests and offline jobs).

        Args:
            prompts: token-id lists.
            params: one SamplingParams for all, or one per prompt.
            request_ids: one per prompt (default ``gen-<i>``).
            mm_inputs: per prompt, its images (see :meth:`add_request`).
        Returns:
            one Completion per prompt, in order; a prompt rejected by validation gets ``error`` set.
        """
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = request_ids or [f"gen-{i}" for i in range(len(prompts))]
        results = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts)}
        processor = OutputProcessor(self.tokenizer)
        for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params_list)):
            try:
                self.add_request(rid, prompt, p, mm_inputs=mm_inputs[i] if mm_inputs else None)
            except ValueError as e:
                results[rid].error, results[rid].finish_reason = str(e), "error"
                continue
            processor.add_request(rid, prompt, p)
        while self.has_unfinished_requests():
            processed = processor.process_outputs(self.step())
            if processed.reqs_to_abort:
                self.abort_request(processed.reqs_to_abort)
            for out in processed.request_outputs:
                results[out.request_id].add(out)
        return [results[rid] for rid in ids]

    # -- stats ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Gauges and counters for metrics and load balancing."""
        kv = self.scheduler.kv
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": kv.usage,
            "prefix_cache_hit_rate": kv.prefix_hit_rate,
            "prefix_cache_queries": kv.pool.num_queries,
            "prefix_cache_hits": kv.pool.num_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "num_free_blocks": kv.pool.num_free_blocks,
            "num_blocks": kv.pool.num_blocks,
            **({"num_replayed_tokens": self.scheduler.num_replayed_tokens,
                "num_local_free_blocks": kv.local_pool.num_free_blocks,
                "num_local_blocks": kv.local_pool.num_blocks} if kv.local_pool is not None else {}),
            **({**self.spec_stats.to_dict(), "num_spec_gated_steps": self.gate.num_plain_steps,
                "spec_gate_plain_steps": self.gate.num_plain_steps,
                "spec_gate_drafting_steps": self.gate.num_drafting_steps,
                "spec_gate_explore_steps": self.gate.num_explore_steps,
                "spec_gate_draft_triggers": self.gate.num_draft_triggers,
                "spec_device_drafted_steps": self.num_device_drafted_steps,
                "spec_chained_steps": self.num_chained_steps,
                "spec_gate_plain_s": self.gate.seconds[False], "spec_gate_drafting_s": self.gate.seconds[True]}
               if self.proposer is not None else {}),
            **(self._host_stats() if kv.host is not None else {}),
            **(self.runner.cp.stats() if self.runner.cp is not None else {}),
            **(self.runner.encoder_cache.stats() if self.runner.encoder_cache is not None else {}),
        }

    def _host_stats(self) -> dict:
        host, cache = self.scheduler.kv.host, self.runner.host_cache
        assert host is not None and cache is not None
        return {**host.stats(), "host_kv_bytes_moved": cache.num_bytes_moved}


def _eos_token_ids(hf_config, tokenizer) -> tuple[int, ...]:
    ids = set()
    for source in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, (list, tuple)):
            ids.update(source)
    return tuple(sorted(ids))


def _num_tokens(outputs: list[RequestOutput]) -> int:
    """Tokens the deltas carry (a step's output, for :class:`SpeculationGate`)."""
    return sum(len(o.new_token_ids) for o in outputs)
