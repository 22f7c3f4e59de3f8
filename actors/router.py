"""Router over NORMAL engine replicas: least-loaded choice with prefix affinity."""

from __future__ import annotations

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

    def pick(self, prompt_token_ids: list[int]) -> int:
        """Choose a replica and count the request against it."""
        least = min(range(len(self.in_flight)), key=lambda i: self.in_flight[i])
        key = hash_block_chain(prompt_token_ids[: self.block_size], self.block_size)
        choice = least
        if key:
            pref = self._affinity.get(key[0])
            if pref is not None and self.in_flight[pref] <= self.in_flight[least] + self.affinity_slack:
                choice = pref
            self._affinity[key[0]] = choice
        self.in_flight[choice] += 1
        return choice

    def done(self, replica: int) -> None:
        self.in_flight[replica] -= 1
