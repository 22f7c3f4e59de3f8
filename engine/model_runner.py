"""Executes a SchedulerOutput: builds the batch, runs the model over the paged cache, samples."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from rayinfer import envs
from rayinfer.engine.multimodal import mm_hash_block_chain
from rayinfer.engine.sampler import Sampler, SamplerOutput
from rayinfer.engine.staging import to_device
from rayinfer.engine.types import PLACEHOLDER, ContextParallelPrefill, KVHandle, Request, SchedulerOutput, StepOutput
from rayinfer.kernels.attention_metadata import AttentionMetadata, PaddedBlockTables, host_arrays
from rayinfer.kernels.batch_invariant import batch_invariant_mode

KV_LAYOUT_VERSION = "v1"


def kv_layout_tag(kv_cache: torch.Tensor) -> str:
    """Payload layout tag of a cache: version, axis names of one request's export, dtype."""
    axes = "L,N,2,bs,H,D" if kv_cache.dim() == 6 else "L,N,bs,C"
    return f"{KV_LAYOUT_VERSION}:{axes}:{str(kv_cache.dtype).removeprefix('torch.')}:bs={kv_cache.shape[2 if kv_cache.dim() == 6 else 2]}"


@dataclass
class PendingStep:
    """A launched step whose sampled tokens may still be on the device.

    Attributes:
        sample_reqs: the requests that get a token, in order (speculative: a request's rows are its
            ``len(drafts[i]) + 1`` consecutive rows).
        rows: request id -> row of ``token_ids`` (the device tensor later steps read placeholders from).
        token_ids: [num_sampled] int64 on the device.
        host: the sampler's output, copied (asynchronously on CUDA) to host memory.
        event: recorded after the copy (None on CPU).
    """

    sample_reqs: list[Request]
    rows: dict[str, int] = field(default_factory=dict)
    token_ids: torch.Tensor | None = None
    host: SamplerOutput | None = None
    event: object = None
    drafts: list[tuple[int, ...]] | None = None  # speculative: per sampled request, its verified drafts
    hidden: torch.Tensor | None = None  # [T, hidden_size] last layer before the final norm (capture_hidden)
    # pipelined speculative decoding, set by a proposer that drafted on the device behind this step (its
    # ``launch_drafts``): (request id -> row, inputs [n, k + 1] int64: the target's token after
    # the accepted drafts, then the next k drafts; advance [n] int64: accepted - verified drafts), the inputs
    # of a chained step (``SchedulerOutput.chained``)
    next_inputs: tuple[dict[str, int], torch.Tensor, torch.Tensor] | None = None


class ModelRunner:
    """Runs one step of the model for the scheduled requests.

    Args:
        model: a rayinfer model (``forward(input_ids, positions, kv_cache, meta)``, ``compute_logits``).
        kv_cache: the whole paged cache, shape ``model.kv_cache_shape(num_blocks, block_size)``.
        block_size: tokens per block.
        sampler: the :class:`Sampler`.
        batch_invariant: run the model and the logprobs in batch-invariant mode
            (``kernels.batch_invariant``), CUDA-graph capture included.
        local_kv_cache: the sliding-window layers' own cache (a model with two KV groups; ``kv_cache`` then
            holds the full-attention layers only), or None.

    ``cp`` (set by the engine of a context-parallel replica's rank 0): the
    :class:`~rayinfer.engine.context_parallel.CPPrefiller` that computes the KV of an imported
    :class:`~rayinfer.engine.types.ContextParallelPrefill` handle; None otherwise.

    ``capture_hidden`` (set by the engine for MTP drafting, before :meth:`capture_cuda_graphs`): every step
    runs ``model.forward_with_prenorm`` (eagerly, or the graphs captured with it) and keeps the last
    layer's hidden states before the final norm in :attr:`PendingStep.hidden` (rows in the step's token
    order).

    ``group_batch_size`` (an expert-parallel rank: its MoE layers' collectives must line up with the other
    ranks'): None, the rank runs no graph (every step eager, exact dispatch splits); set before a
    decode step to the group's largest decode batch, every rank replays the graph of that padded size
    (a rank with fewer requests pads, one with none replays it over padding rows only), so every rank
    runs the same fixed-size dispatch. Unused outside expert parallelism (:attr:`in_group` False).
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int, sampler: Sampler,
                 batch_invariant: bool = False, local_kv_cache: torch.Tensor | None = None):
        self.model = model
        self.local_kv_cache = local_kv_cache
        # what the model's forward takes: the cache, or the (global, local) pair
        self.model_kv = kv_cache if local_kv_cache is None else (kv_cache, local_kv_cache)
        self.batch_invariant = batch_invariant
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.graphs = None  # DecodeGraphs once captured
        self.padded_tables = PaddedBlockTables()  # reused rows of unchanged block tables across steps
        self.sync_guard = False  # raise on a hidden host sync while launching a step (tests)
        self.host_cache = None  # a HostKVCache when the host KV tier is on (set by the engine)
        self.capture_hidden = False
        self.cp = None
        # a vision-language model's image embeddings by content hash (engine.multimodal); None for text models
        self.encoder_cache = None
        self.in_group = False  # an expert-parallel rank: graphs only at the group's batch size (class docstring)
        self.group_batch_size: int | None = None
        self.num_group_graph_steps = 0  # steps run at the group's graph size (empty ones included)
        # RAYINFER_SIDE_STREAM_COPIES: (upload, download) streams, so that a step's inputs travel while the
        # previous step computes and its tokens travel while the next one does
        self.copy_streams = None
        if self.device.type == "cuda" and envs.side_stream_copies():
            self.copy_streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))

    def capture_cuda_graphs(self, max_model_len: int, max_num_seqs: int, max_query_len: int = 1,
                            eager: bool = False) -> None:
        """Capture decode graphs (CUDA only), and verification graphs up to ``max_query_len`` tokens per
        request (speculative decoding: k + 1). ``eager``: build the graphs' buffers only and run their
        padded steps eagerly (CPU tests of the graph paths)."""
        from rayinfer.engine.cuda_graph import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, max_model_len, max_num_seqs,
                                   max_query_len=max_query_len, with_hidden=self.capture_hidden, eager=eager)
        with batch_invariant_mode(self.batch_invariant):
            self.graphs.capture()

    @property
    def prompt_capacity(self) -> int:
        """Tokens that one prompt's KV may take in the cache ([layers, blocks, ...]): all its blocks; 0 with a
        sliding-window pool beside it (``warm_up_prefill`` does not take that layout)."""
        return self.kv_cache.shape[1] * self.block_size if self.local_kv_cache is None else 0

    # the shortest prompt the warm-up runs besides num_tokens: below it, prefill-sized kernels (the fused-MoE
    # tiles tuned for up to 256 tokens, say) are the ones the decode graphs' capture already compiled
    WARM_UP_MIN_TOKENS = 512

    @torch.inference_mode()
    def warm_up_prefill(self, num_tokens: int) -> list[int]:
        """Run prompts of ``num_tokens`` and ``num_tokens - 1`` tokens through the model (logits included) before
        any request, then of half, a quarter ... of it down to :data:`WARM_UP_MIN_TOKENS` (each also one token
        less), so that the kernels a long prefill takes are compiled and their tiles chosen then, not in the
        first user's TTFT. Triton specializes integer arguments on divisibility by 16, hence both lengths; and
        tiles follow the token count (the fused-MoE table's entries per M, torch's grouped GEMM from
        ``grouped_mm_from`` tokens), hence the halvings: with only the 8K chunk warmed, a V2-Lite-shaped
        engine's first 1K prompt still took 2.1 s on an H200 (4.2 s without any warm-up; 35-42 ms once warm).
        Their KV goes to the cache's first blocks, which no request holds yet and which every later request
        writes before it reads. Returns the lengths run ([] when ``num_tokens`` < 2).

        Raises:
            ValueError: ``num_tokens`` above the cache's capacity.
        """
        capacity = self.prompt_capacity
        if num_tokens > capacity:
            raise ValueError(f"warm-up prompt of {num_tokens} tokens does not fit the KV cache ({capacity} tokens)")
        sizes, size = [num_tokens], num_tokens // 2
        while size >= self.WARM_UP_MIN_TOKENS:
            sizes.append(size)
            size //= 2
        lengths = [n for size in sizes for n in (size, size - 1) if n >= 2]
        for n in lengths:
            blocks = list(range(-(-n // self.block_size)))
            meta = AttentionMetadata.build([n], [n], [blocks], self.block_size, self.device)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            with batch_invariant_mode(self.batch_invariant):
                hidden = self.model(ids, torch.arange(n, device=self.device), self.model_kv, meta)
                self.model.compute_logits(hidden[-1:])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return lengths

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, requests: dict[str, Request]) -> StepOutput:
        """Run the step and wait; returns a sampled token for each request with ``needs_sample``."""
        return self.finish(self.execute_async(sched, requests))

    @torch.inference_mode()
    def execute_async(self, sched: SchedulerOutput, requests: dict[str, Request],
                      prev: PendingStep | None = None) -> PendingStep:
        """Launch the step without waiting for the device.

        Input tokens equal to ``PLACEHOLDER`` are the ones ``prev`` sampled; they are read from its
        device tensor, so step N+1 can be launched before step N's tokens reach the host.

        Raises:
            RuntimeError: under ``sync_guard``, if launching the step synchronizes with the device.
        """
        from rayinfer.engine.sync_guard import no_host_sync

        self.run_host_transfers(sched)
        if sched.chained:
            return self._execute_chained(sched, requests, prev)
        for _, block_ids, handle in sched.kv_imports:
            self.import_kv(block_ids, handle)
        scheduled = sched.scheduled
        query_lens = [len(s.token_ids) for s in scheduled]
        seq_lens = [s.start_pos + q for s, q in zip(scheduled, query_lens)]
        tables = [s.block_ids for s in scheduled]
        padded = self.padded_tables.pad([s.request_id for s in scheduled], tables)
        starts, *meta_arrays, positions = host_arrays(query_lens, seq_lens, tables, self.block_size, padded)
        local_arrays = self._local_arrays(scheduled, query_lens, seq_lens, starts, meta_arrays[2])
        num_tokens = len(positions)
        input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in scheduled), np.int64, num_tokens)
        sample_idx = [i for i, s in enumerate(scheduled) if s.needs_sample]
        sample_reqs = [requests[scheduled[i].request_id] for i in sample_idx]
        extra = []  # [rows of the placeholders, their rows in prev.token_ids], [the rows to sample]
        holes = (input_ids == PLACEHOLDER).nonzero()[0]
        if holes.size:  # filled from the previous step's sampled tokens, on the device
            hole_reqs = np.searchsorted(starts, holes, side="right") - 1
            extra += [holes, np.array([prev.rows[scheduled[i].request_id] for i in hole_reqs.tolist()], np.int64)]
        row_reqs, offsets, drafts = sample_reqs, None, None
        if any(scheduled[i].num_draft_tokens for i in sample_idx):  # speculative: a row per verified token
            ks = [scheduled[i].num_draft_tokens for i in sample_idx]
            ends = starts[1:][sample_idx].astype(np.int64)
            sample_rows = np.concatenate([np.arange(e - k - 1, e) for e, k in zip(ends.tolist(), ks)])
            row_reqs = [r for r, k in zip(sample_reqs, ks) for _ in range(k + 1)]
            offsets = [j for k in ks for j in range(k + 1)]
            drafts = [scheduled[i].draft_token_ids for i in sample_idx]
        else:
            sample_rows = starts[1:][sample_idx].astype(np.int64) - 1
        all_sampled = len(sample_rows) == num_tokens  # then the sampled rows are all rows, in order
        verify_width = None  # a verification step (last tokens + drafts only) that a captured graph runs
        if (offsets is not None and all_sampled and self.graphs is not None and not holes.size and not local_arrays
                and self.encoder_cache is None and not self.in_group):
            verify_width = self.graphs.ragged_width(query_lens, seq_lens)
        if sample_idx and not all_sampled:
            extra.append(sample_rows)
        mm_embeds = None
        if self.encoder_cache is not None:  # encodes the images this step needs that are not cached
            from rayinfer.engine.multimodal import gather_mm_embeds

            mm_embeds = gather_mm_embeds(self.model, self.encoder_cache, scheduled, requests, starts, self.device)
        # one host-to-device copy for all inputs
        with no_host_sync(self.sync_guard), batch_invariant_mode(self.batch_invariant):
            ids, pos, *dev = self._upload([input_ids, positions, starts, *meta_arrays, *local_arrays, *extra])
            meta, extra = AttentionMetadata(*dev[:4], self.block_size, query_lens, seq_lens), dev[4 + len(local_arrays):]
            if local_arrays:
                meta.local = AttentionMetadata(
                    meta.query_start_loc, meta.seq_lens, dev[4], dev[5], self.block_size, query_lens, seq_lens,
                    kv_start=dev[6], kv_start_cpu=local_arrays[2].tolist())
            decode_graph, floor = False, None
            if mm_embeds is None and self.graphs is not None and meta.is_decode_only:
                floor = self._graph_floor(len(scheduled))
                decode_graph = self.graphs.padded_size(len(scheduled), min_batch=floor) is not None
            # a pipelined decode step whose every input is the previous step's token: the graph gathers them
            # into its input buffer in one launch (else: a gather, a scatter and the buffer's copy)
            gather = (prev.token_ids, extra[1]) if decode_graph and holes.size == num_tokens else None
            if holes.size and gather is None:
                ids[extra[0]] = prev.token_ids[extra[1]]
            prenorm = None
            if mm_embeds is not None:  # image rows: eager, never a decode graph
                out = self.model(ids, pos, self.model_kv, meta, mm_embeds=mm_embeds)
            elif decode_graph:
                assert self.graphs is not None
                self.num_group_graph_steps += self.in_group
                out = self.graphs.run(ids, pos, meta.slot_mapping, meta.seq_lens, meta.block_tables, min_batch=floor,
                                      gather_ids=gather)
            elif verify_width is not None:
                out = self.graphs.run_ragged(ids, meta_arrays[2], query_lens, seq_lens, meta_arrays[1], verify_width)
            elif self.capture_hidden:
                out = self.model.forward_with_prenorm(ids, pos, self.model_kv, meta)
            else:
                out = self.model(ids, pos, self.model_kv, meta)
            if isinstance(out, tuple):  # capture_hidden (the graphs then return the pair too)
                hidden, prenorm = out
                if decode_graph:  # a view of the graph's buffer, which the next replay (maybe launched before this
                    prenorm = prenorm.clone()  # step is processed: pipelined scheduling) rewrites
            else:
                hidden = out
            step = PendingStep(sample_reqs, drafts=drafts, hidden=prenorm)
            if not sample_idx:
                return step
            logits = self.model.compute_logits(hidden if all_sampled else hidden[extra[-1]])
            self._attach(step, row_reqs, self.sampler.sample(logits, row_reqs, offsets))
        return step

    def _attach(self, step: PendingStep, row_reqs: list[Request], out: SamplerOutput) -> None:
        """Give a launched step its draws: each request's last row, the tokens on the device, and their copy
        on the way to the host (asynchronous on CUDA)."""
        step.rows = {r.request_id: i for i, r in enumerate(row_reqs)}  # a request's last row
        step.token_ids = out.token_ids
        if self.device.type == "cuda":
            step.host, step.event = self._download(out)
        else:
            step.host = out

    def can_chain(self, num_reqs: int, query_len: int) -> bool:
        """Whether a chained verification step of ``num_reqs`` requests of ``query_len`` tokens runs here: it
        needs a captured graph of that shape (on CPU, the graphs' eager buffers), and none of what the
        graphs do not take (expert-parallel group sizes, images, a sliding-window cache, context parallel)."""
        return (self.graphs is not None and self.graphs.padded_size(num_reqs, query_len) is not None
                and not self.in_group and self.encoder_cache is None and self.local_kv_cache is None and self.cp is None)

    def _execute_chained(self, sched: SchedulerOutput, requests: dict[str, Request], prev: PendingStep | None) -> PendingStep:
        """Launch a chained verification step (``SchedulerOutput.chained``) in the graph of its shape: each
        request's inputs are the row of ``prev.next_inputs`` (the in-flight step's target token and the drafts
        made behind it), its positions, context length, cache slots and sampled output positions move by that
        row's advance, all on the device. ``PendingStep.drafts`` is left None: the engine sets it once ``prev``
        is processed and the drafts are on the host (``finish`` needs them).

        Raises:
            RuntimeError: under ``sync_guard``, if launching the step synchronizes with the device.
            ValueError: ``prev`` has no next inputs for a scheduled request.
        """
        from rayinfer.engine.sync_guard import no_host_sync

        scheduled = sched.scheduled
        if prev is None or prev.next_inputs is None or any(s.request_id not in prev.next_inputs[0] for s in scheduled):
            raise ValueError("a chained verification step needs the drafts made behind the step before it")
        assert self.graphs is not None
        rows_of, next_ids, next_advance = prev.next_inputs
        q, n = len(scheduled[0].token_ids), len(scheduled)
        query_lens = [q] * n
        seq_lens = [s.start_pos + q for s in scheduled]  # as if the step before accepted every draft
        tables = [s.block_ids for s in scheduled]
        padded = self.padded_tables.pad([s.request_id for s in scheduled], tables)
        _, seq_arr, table_arr, _, positions = host_arrays(query_lens, seq_lens, tables, self.block_size, padded)
        src = np.fromiter((rows_of[s.request_id] for s in scheduled), np.int64, n)
        reqs = [requests[s.request_id] for s in scheduled]
        row_reqs = [r for r in reqs for _ in range(q)]
        with no_host_sync(self.sync_guard), batch_invariant_mode(self.batch_invariant):
            pos, seq_t, tables_t, src_t = self._upload([positions, seq_arr, table_arr, src])
            advance = next_advance[src_t]
            ids = next_ids[src_t][:, :q].reshape(-1)  # the target's token, then the drafts this step verifies
            out = self.graphs.run(ids, pos, None, seq_t, tables_t, query_len=q, advance=advance)
            hidden, prenorm = out if isinstance(out, tuple) else (out, None)
            # the graph's buffer is rewritten by the next replay, which is launched before this step is processed
            step = PendingStep(reqs, hidden=None if prenorm is None else prenorm.clone())
            self._attach(step, row_reqs, self.sampler.sample(self.model.compute_logits(hidden), row_reqs,
                                                             list(range(q)) * n, position_shift=advance.repeat_interleave(q)))
        return step

    def _upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """A step's input arrays on the device (``staging.to_device``), without waiting. With copy streams
        the copy runs on the upload stream and the compute stream waits for it there (an event), so the
        copy overlaps the step still running instead of sitting between two steps' kernels."""
        if self.copy_streams is None:
            return to_device(arrays, self.device)
        compute, upload = torch.cuda.current_stream(self.device), self.copy_streams[0]
        # no wait on the compute stream: the source is a fresh pinned buffer and the destination a fresh block
        # of the upload stream's pool (the allocator reuses a block only after the streams recorded on it)
        with torch.cuda.stream(upload):
            dev = to_device(arrays, self.device)
        compute.wait_stream(upload)
        if dev:
            dev[0].record_stream(compute)  # one device buffer behind every view: not reused before compute is done
        return dev

    def _download(self, out: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event]:
        """The sampler's output copied to pinned host memory, and the event recorded after the copy. With
        copy streams the copy waits for the sampler on the download stream, so the next step's kernels
        need not wait behind it."""
        tensors = (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)
        stream = None if self.copy_streams is None else self.copy_streams[1]
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            for t in tensors:
                if t is not None:
                    t.record_stream(stream)
        with torch.cuda.stream(stream):  # None: the current stream
            host = SamplerOutput(*(None if t is None else
                                   torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                   for t in tensors), errors=out.errors)
            event = torch.cuda.Event()
            event.record()
        return host, event

    def _local_arrays(self, scheduled, query_lens, seq_lens, starts: np.ndarray, slots: np.ndarray) -> list[np.ndarray]:
        """The sliding layers' block tables, slot mapping and ``kv_start`` ([] without a local KV group).

        Also sets ``slots`` (the full-attention layers' slot mapping) to -1 on the rows of a bounded
        replay: their KV is cached (a prefix hit, maybe shared by other requests) and must not be rewritten.
        """
        if self.local_kv_cache is None:
            return []
        for i, s in enumerate(scheduled):
            if s.num_replay_tokens:
                slots[starts[i] : starts[i] + s.num_replay_tokens] = -1
        tables = [s.local_block_ids for s in scheduled]
        _, _, local_tables, local_slots, _ = host_arrays(query_lens, seq_lens, tables, self.block_size)
        kv_start = np.fromiter((s.local_kv_start for s in scheduled), np.int32, len(scheduled))
        return [local_tables, local_slots, kv_start]

    @torch.inference_mode()
    def run_host_transfers(self, sched: SchedulerOutput) -> None:
        """The step's host-tier copies: evicted blocks out, then host hits back in (before the forward)."""
        host = self.host_cache
        if host is None:
            return
        host.finish_offloads()
        if sched.kv_offloads:
            blocks, slots = zip(*sched.kv_offloads)
            host.offload(blocks, slots)
        if sched.kv_loads:
            slots, blocks = zip(*sched.kv_loads)
            host.load(slots, blocks)

    def _graph_floor(self, num_reqs: int = 0) -> int | None:
        """The least graph batch size this step may use: the group's (expert parallel; a huge one, so no
        graph fits, when the rank runs without the group's graph), else None (any).

        Raises:
            RuntimeError: a rank with more decode requests than the group's batch size (its graph would
                differ from the other ranks' and their collectives would never line up).
        """
        if not self.in_group:
            return None
        if self.group_batch_size is None:
            return 1 << 30
        if num_reqs > self.group_batch_size:
            raise RuntimeError(f"expert-parallel decode step of {num_reqs} requests on a rank, but the group "
                               f"agreed on at most {self.group_batch_size}")
        return self.group_batch_size

    @torch.inference_mode()
    def execute_empty(self) -> None:
        """Run the model over zero tokens (nothing is sampled or written to the cache).

        An expert-parallel rank with no scheduled work calls it so that it still meets the other ranks
        in the MoE layers' collectives (see ``rayinfer.actors.ep_group``): at the group's graph batch
        size, the graph of that size over padding rows only (as the others replay it), else eagerly.
        """
        if self.in_group and self.graphs is not None and self.graphs.padded_size(0, min_batch=self._graph_floor()):
            self.num_group_graph_steps += 1
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            with batch_invariant_mode(self.batch_invariant):
                self.graphs.run(empty, empty, empty, empty.to(torch.int32), empty.to(torch.int32).view(0, 1),
                                min_batch=self._graph_floor())
            return
        meta = AttentionMetadata.build([], [], [], self.block_size, self.device)
        no_tokens = torch.empty(0, dtype=torch.long, device=self.device)
        with batch_invariant_mode(self.batch_invariant):
            self.model(no_tokens, no_tokens, self.model_kv, meta)

    def finish(self, step: PendingStep) -> StepOutput:
        """Wait for a launched step and return its sampled tokens (advancing grammar matchers); a request
        whose own sampling preparation raised is in ``errors`` instead of ``sampled``."""
        if step.host is None:
            return StepOutput({})
        if step.event is not None:
            step.event.synchronize()
        if step.drafts is None:
            sampled, errors = self.sampler.finish(step.host, step.sample_reqs)
            return StepOutput({r.request_id: t for r, t in zip(step.sample_reqs, sampled) if t is not None}, errors)
        row_reqs = [r for r, d in zip(step.sample_reqs, step.drafts) for _ in range(len(d) + 1)]
        sampled, errors = self.sampler.finish(step.host, row_reqs)
        out = StepOutput({}, errors)
        row = 0
        for req, drafts in zip(step.sample_reqs, step.drafts):
            tokens = sampled[row: row + len(drafts) + 1]
            row += len(drafts) + 1
            if req.request_id in errors:
                continue
            num_accepted = accepted_length(drafts, [t.token_id for t in tokens if t is not None])
            out.sampled[req.request_id] = tokens[num_accepted]
            if drafts:
                out.accepted[req.request_id] = tokens[:num_accepted]
        return out

    def kv_handle(self, req: Request, num_tokens: int) -> KVHandle:
        """The handle (no payload) of a request's first ``num_tokens`` tokens: block hashes, layout."""
        full = num_tokens // self.block_size
        hashes = req.block_hashes[:full]
        if len(hashes) < full:  # prefix caching off: the scheduler kept no hashes, the KV store needs them
            hashes = mm_hash_block_chain(req.all_token_ids[: full * self.block_size], self.block_size, req.cache_salt,
                                         req.mm_inputs)
        return KVHandle(req.request_id, list(hashes), num_tokens, kv_layout_tag(self.kv_cache))

    def import_kv(self, block_ids, handle: KVHandle) -> None:
        """Write a handle's payload into the given blocks of the cache; a
        :class:`~rayinfer.engine.types.ContextParallelPrefill` payload is computed there by the CP ranks.

        Raises:
            ValueError: if the payload's layout tag or block count does not match this cache, or a CP
                payload reaches a runner without ``cp``.
        """
        if isinstance(handle.payload, ContextParallelPrefill):
            if self.cp is None:
                raise ValueError("a context-parallel prefill reached an engine without CP ranks")
            self.cp.prefill(self.model, self.kv_cache, block_ids, handle.payload.token_ids, handle.payload.num_cached)
            return
        if handle.layout != kv_layout_tag(self.kv_cache):
            raise ValueError(f"KV layout {handle.layout!r} does not match this engine's {kv_layout_tag(self.kv_cache)!r}")
        payload = handle.payload
        if payload.shape[1] != len(block_ids):
            raise ValueError(f"KV payload has {payload.shape[1]} blocks, expected {len(block_ids)}")
        idx = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.kv_cache[:, idx] = payload.to(self.device, self.kv_cache.dtype)


def accepted_length(draft_token_ids, target_token_ids) -> int:
    """How many leading drafts the target accepts: drafts ``d_1..d_k`` and the target's tokens
    ``t_0..t_k`` sampled after the last known token and after each draft; ``d_j`` is accepted while
    ``t_{j-1} == d_j`` for every earlier j.

    With a deterministic drafter (a one-hot draft distribution q), this is the speculative rejection rule
    of Leviathan et al. 2023 / Chen et al. 2023 with coupled randomness: ``t_{j-1}`` is a draw from the
    target p at that position, so ``d_j`` is accepted with probability ``p(d_j) = min(1, p/q)``, and on a
    rejection ``t_{j-1}`` is a draw of p conditioned on ``!= d_j``, which is the residual
    ``norm(max(0, p - q))``. Every emitted token is the one plain sampling would draw at its position
    with the same seed, so output is token-for-token that of non-speculative decoding.
    """
    n = 0
    for d, t in zip(draft_token_ids, target_token_ids):
        if d != t:
            break
        n += 1
    return n
