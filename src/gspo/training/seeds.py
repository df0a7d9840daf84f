"""Derived seeds: every random draw of a run is a pure function of ``train.seed`` and tags
(the rollout batch, the step, the rank), so a resumed run replays exactly what an
uninterrupted one would have drawn."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch

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


@contextlib.contextmanager
def seeded_global_draws(seed: int, device: torch.device) -> Iterator[None]:
    """Torch's global generators (the CPU's and ``device``'s) seeded with ``seed`` inside
    the block, and given back their own state after it: for draws that only the global
    generator feeds (``nn.Dropout``, PEFT's dropout) while the caller's random stream
    (the user's code, the model's other draws) goes on as if the block never ran."""
    accelerator = device.type not in ("cpu", "meta")
    devices = [device] if accelerator else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if accelerator else None):
        torch.default_generator.manual_seed(seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        elif accelerator:
            torch.get_device_module(device.type).manual_seed(seed)
        yield
