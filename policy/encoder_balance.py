"""Which encoder replica encodes an image: the one with the fewest vision patches in flight.

After DeepSeek's vision-encoder (VE) load balancing idea: an encoder's work grows with the patches of
the images it holds (the ViT runs over every patch), not with the number of requests, so the balancer
counts patches. Ties go to the lowest replica index.
"""

from __future__ import annotations

from collections.abc import Collection


class PatchBalancer:
    """Patches in flight per encoder replica.

    Args:
        num_replicas: encoder replicas (> 0).
    Raises:
        ValueError: for no replicas, or a negative patch count.
    """

    def __init__(self, num_replicas: int):
        if num_replicas <= 0:
            raise ValueError(f"num_replicas must be positive, got {num_replicas}")
        self.in_flight = [0] * num_replicas

    def pick(self, num_patches: int, exclude: Collection[int] = ()) -> int:
        """Assign an image of ``num_patches`` patches to the least-loaded replica not in ``exclude`` (all
        replicas when every one is excluded); returns its index."""
        if num_patches < 0:
            raise ValueError(f"num_patches must be >= 0, got {num_patches}")
        candidates = [i for i in range(len(self.in_flight)) if i not in exclude] or range(len(self.in_flight))
        idx = min(candidates, key=self.in_flight.__getitem__)
        self.in_flight[idx] += num_patches
        return idx

    def release(self, idx: int, num_patches: int) -> None:
        """An image of ``num_patches`` on replica ``idx`` is done (encoded or failed)."""
        self.in_flight[idx] = max(0, self.in_flight[idx] - num_patches)
