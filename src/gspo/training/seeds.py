"""Derived seeds: every random draw of a run is a pure function of ``train.seed`` and tags
(the rollout batch, the step, the rank), so a resumed run replays exactly what an
uninterrupted one would have drawn."""

from __future__ import annotations

import hashlib

from gspo.distributed import Distributed


def derive_seed(seed: int, *tags: object) -> int:
    """A 63-bit seed that is a pure function of ``seed`` and ``tags``."""
    digest = hashlib.sha256(repr((seed, *tags)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rank_seed(seed: int, dist: Distributed, *tags: object) -> int:
    """A seed for this rank's own randomness (its samples, its minibatch split).

    In one process it is ``derive_seed(seed, *tags)``; each rank of a torchrun run adds
    its rank, so ranks draw different samples.
    """
    rank = (("rank", dist.rank),) if dist.enabled else ()
    return derive_seed(seed, *tags, *rank)
