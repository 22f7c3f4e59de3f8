"""Replica load balancing policies (pure, no Ray inside).

Colocated NORMAL replicas: least-loaded choice with prefix affinity (:class:`ReplicaLoadBalancer`).
Disaggregated: :class:`PrefillBalancer` (queued compute, stored-prefix credit, length buckets) and
:class:`DecodeBalancer` (running requests and KV tokens even). Data-parallel NORMAL replicas that share
collectives: :func:`vote_step_kind`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from rayinfer.engine.block_pool import hash_block_chain


class ReplicaLoadBalancer:
    """Picks a replica for each request (pure policy; no Ray inside).

    Load is the number of requests in flight; among replicas whose load is within ``affinity_slack`` of
    the least loaded, the one that last served the request's first prompt block wins (so shared system
    prompts keep hitting one replica's prefix cache).

    Args:
        num_replicas: replicas to balance.
        block_size: tokens per block used for the affinity key.
        affinity_slack: extra in-flight requests tolerated for a prefix-affine replica.
    """

    def __init__(self, num_replicas: int, block_size: int = 16, affinity_slack: int = 4):
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.in_flight = [0] * num_replicas
        self.block_size = block_size
        self.affinity_slack = affinity_slack
        self._affinity: dict[int, int] = {}

    def pick(self, prompt_token_ids: list[int], among: Sequence[int] | None = None) -> int:
        """Choose a replica (one of ``among`` when given) and count the request against it.

        Raises:
            ValueError: if ``among`` is empty.
        """
        candidates = range(len(self.in_flight)) if among is None else among
        if not candidates:
            raise ValueError("no replica to pick from")
        least = min(candidates, key=lambda i: self.in_flight[i])
        key = hash_block_chain(prompt_token_ids[: self.block_size], self.block_size)
        choice = least
        if key:
            pref = self._affinity.get(key[0])
            if (pref is not None and pref in candidates
                    and self.in_flight[pref] <= self.in_flight[least] + self.affinity_slack):
                choice = pref
            self._affinity[key[0]] = choice
        self.in_flight[choice] += 1
        return choice

    def done(self, replica: int) -> None:
        self.in_flight[replica] -= 1


# -- prefill/decode disaggregation ---------------------------------------------------------------

@dataclass
class PrefillTicket:
    """A prefill counted against a replica until ``PrefillBalancer.done``.

    Attributes:
        replica: the chosen replica.
        cost: the request's estimated compute (token-equivalents; see ``PrefillBalancer.cost``).
        bucket: the request's context-length bucket.
    """

    replica: int
    cost: float
    bucket: int


class PrefillBalancer:
    """Picks a prefill replica: least queued compute, stored-prefix hits credited, lengths bucketed.

    A prefill's compute is its new tokens (linear layers) plus the attention over its context, so the
    cost of computing tokens ``num_cached .. num_tokens`` is
    ``(num_tokens - num_cached) + (num_tokens**2 - num_cached**2) / (2 * attn_tokens)``, where
    ``attn_tokens`` is the context length at which a token's attention costs as much as its linear
    layers. Blocks the KV store already holds are loaded, not computed, so they are credited (they cut
    both terms). Requests are bucketed by total context length; among replicas with equal queued compute
    the one holding fewest requests of the same bucket wins, which spreads long prompts over replicas
    (after DeepSeek's prefill load balancer: balance core-attention compute and tokens per replica).

    Args:
        num_replicas: prefill replicas.
        bucket_bounds: increasing context lengths that split the buckets (``b`` bounds give ``b + 1``).
        attn_tokens: see above (about params / (2 * layers * hidden) for a dense model).
    Raises:
        ValueError: for no replicas, unsorted bounds or a non-positive ``attn_tokens``.
    """

    def __init__(self, num_replicas: int, bucket_bounds: tuple[int, ...] = (1024, 4096, 16384),
                 attn_tokens: float = 8192.0):
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if list(bucket_bounds) != sorted(set(bucket_bounds)):
            raise ValueError(f"bucket_bounds must be strictly increasing, got {bucket_bounds}")
        if attn_tokens <= 0:
            raise ValueError(f"attn_tokens must be positive, got {attn_tokens}")
        self.bucket_bounds = tuple(bucket_bounds)
        self.attn_tokens = attn_tokens
        self.queued_cost = [0.0] * num_replicas
        self.bucket_counts = [[0] * (len(bucket_bounds) + 1) for _ in range(num_replicas)]

    def bucket(self, num_tokens: int) -> int:
        """Index of the length bucket: ``[0, b0) -> 0, [b0, b1) -> 1, ...``."""
        return bisect.bisect_right(self.bucket_bounds, num_tokens)

    def cost(self, num_tokens: int, num_cached_tokens: int = 0) -> float:
        """Estimated compute of a prefill of ``num_tokens`` whose first ``num_cached_tokens`` are stored."""
        c = min(num_cached_tokens, num_tokens)
        return (num_tokens - c) + (num_tokens * num_tokens - c * c) / (2 * self.attn_tokens)

    def pick(self, num_tokens: int, num_cached_tokens: int = 0, exclude: set[int] | frozenset = frozenset()
             ) -> PrefillTicket:
        """Choose a replica and count the prefill against it.

        Args:
            num_tokens: the request's context (prompt plus any outputs being re-prefilled).
            num_cached_tokens: leading tokens the KV store holds.
            exclude: replicas to avoid (e.g. restarting); ignored if it would exclude all.
        Returns:
            the ticket to pass to :meth:`done`. Ties: fewer same-bucket requests, then lower index.
        """
        candidates = [r for r in range(len(self.queued_cost)) if r not in exclude] or range(len(self.queued_cost))
        b = self.bucket(num_tokens)
        r = min(candidates, key=lambda i: (self.queued_cost[i], self.bucket_counts[i][b], i))
        ticket = PrefillTicket(r, self.cost(num_tokens, num_cached_tokens), b)
        self.queued_cost[r] += ticket.cost
        self.bucket_counts[r][b] += 1
        return ticket

    def done(self, ticket: PrefillTicket) -> None:
        """The prefill left its replica (finished or failed)."""
        self.queued_cost[ticket.replica] = max(self.queued_cost[ticket.replica] - ticket.cost, 0.0)
        self.bucket_counts[ticket.replica][ticket.bucket] -= 1


@dataclass
class DecodeTicket:
    """A request running on a decode replica; ``num_tokens`` grows with ``DecodeBalancer.grow``."""

    replica: int
    num_tokens: int


class DecodeBalancer:
    """Picks a decode replica so that running requests and KV tokens stay even, both at once.

    A replica's load after taking a request is ``(running + 1) / max_num_seqs + (kv_tokens + n) /
    kv_capacity``: each term is the fraction of that capacity in use, so neither count can run ahead.

    Args:
        num_replicas: decode replicas.
        max_num_seqs: running requests a replica holds at most.
        kv_capacity: KV tokens a replica holds (blocks x block size).
    Raises:
        ValueError: for no replicas or a non-positive capacity.
    """

    def __init__(self, num_replicas: int, max_num_seqs: int, kv_capacity: int):
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        if max_num_seqs <= 0 or kv_capacity <= 0:
            raise ValueError(f"max_num_seqs and kv_capacity must be positive, got {max_num_seqs}, {kv_capacity}")
        self.max_num_seqs, self.kv_capacity = max_num_seqs, kv_capacity
        self.num_running = [0] * num_replicas
        self.kv_tokens = [0] * num_replicas

    def load(self, replica: int, num_tokens: int = 0, num_requests: int = 0) -> float:
        """The replica's load with ``num_requests`` more requests holding ``num_tokens`` more KV tokens."""
        return ((self.num_running[replica] + num_requests) / self.max_num_seqs
                + (self.kv_tokens[replica] + num_tokens) / self.kv_capacity)

    def pick(self, num_tokens: int, exclude: set[int] | frozenset = frozenset()) -> DecodeTicket:
        """Choose the replica with the least load after taking the request (ties: lower index)."""
        candidates = [r for r in range(len(self.num_running)) if r not in exclude] or range(len(self.num_running))
        r = min(candidates, key=lambda i: (self.load(i, num_tokens, 1), i))
        self.num_running[r] += 1
        self.kv_tokens[r] += num_tokens
        return DecodeTicket(r, num_tokens)

    def grow(self, ticket: DecodeTicket, num_tokens: int = 1) -> None:
        """The request's KV grew by ``num_tokens`` (a decoded token)."""
        ticket.num_tokens += num_tokens
        self.kv_tokens[ticket.replica] += num_tokens

    def done(self, ticket: DecodeTicket) -> None:
        """The request left its replica (finished, preempted or failed)."""
        self.num_running[ticket.replica] -= 1
        self.kv_tokens[ticket.replica] -= ticket.num_tokens


# -- data-parallel NORMAL replicas: one kind of step for the whole group --------------------------

@dataclass(frozen=True)
class StepVote:
    """One rank's view before a step.

    Attributes:
        num_prefill_tokens: prompt tokens waiting to be computed on this rank.
        num_decode_requests: running requests that would decode this step.
        num_decode_steps: decode steps this rank ran since its last prefill step.
    """

    num_prefill_tokens: int = 0
    num_decode_requests: int = 0
    num_decode_steps: int = 0

    def to_list(self) -> list[int]:
        """The vote as ints, for an all-gather across ranks (``[3]`` per rank)."""
        return [self.num_prefill_tokens, self.num_decode_requests, self.num_decode_steps]


def vote_step_kind(votes: list[StepVote], max_decode_steps: int = 8, min_prefill_tokens: int = 512) -> str:
    """The kind of the next step for every rank of a data-parallel group: "prefill", "decode" or "idle".

    Ranks of one group run MoE collectives together, whose prefill and decode variants differ, so every
    rank must run the same kind of step (a rank with nothing of that kind runs a dummy step). All ranks
    all-gather their votes and call this function on the same list, so they agree without a leader
    (after DeepSeek's engine notes). Rules, in order:

    1. no rank has work: "idle";
    2. no rank has decode work: "prefill"; no rank has prefill work: "decode";
    3. both: "prefill" once some rank has decoded ``max_decode_steps`` steps since its last prefill (a
       bound on time to first token) or the group's waiting prompt tokens reach ``min_prefill_tokens``
       (a prefill step worth its cost to decode latency); else "decode".

    Args:
        votes: one :class:`StepVote` per rank, in rank order.
    Raises:
        ValueError: for an empty list.
    """
    if not votes:
        raise ValueError("votes must hold one StepVote per rank")
    prefill = sum(v.num_prefill_tokens for v in votes)
    decode = sum(v.num_decode_requests for v in votes)
    if not prefill and not decode:
        return "idle"
    if not decode:
        return "prefill"
    if not prefill:
        return "decode"
    if max(v.num_decode_steps for v in votes) >= max_decode_steps or prefill >= min_prefill_tokens:
        return "prefill"
    return "decode"
