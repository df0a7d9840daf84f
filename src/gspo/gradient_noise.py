"""Gradient noise by response length: cosines between subset and full-batch gradients.

Pure tensor functions (no model, no I/O); :func:`gspo.training.hooks.gradient_cosines`
feeds them gradients of :func:`gspo.objectives.policy_loss` and ``gspo compare`` reads
the result from the ratio dumps.

The policy loss is a mean over responses (of each response's token mean), so it is
linear in the responses: the gradient over a whole rollout batch is the response-count
weighted mean of the gradients over any partition of it (:func:`combine`). One pass over
the partition therefore gives both the subset gradients and the full-batch gradient.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor


def length_buckets(lengths: Tensor, buckets: int = 4) -> list[tuple[int, int]]:
    """Up to ``buckets`` response-length ranges ``[lo, hi]`` with about equal counts."""
    if lengths.numel() == 0:
        return []
    qs = torch.quantile(lengths.float(), torch.linspace(0, 1, buckets + 1)).round().long()
    edges = sorted(set(qs.tolist()))
    if len(edges) == 1:
        return [(edges[0], edges[0])]
    ranges = [(lo, hi - 1) for lo, hi in itertools.pairwise(edges[:-1])]
    return [*ranges, (edges[-2], edges[-1])]


@dataclass
class LengthHalves:
    """The responses of one length bucket ``[lo, hi]``, split at random into two halves."""

    lo: int
    hi: int
    first: Tensor  # [n1] row indices into the batch
    second: Tensor  # [n2] row indices, n2 - n1 in {0, 1}


def length_halves(
    lengths: Tensor, *, buckets: int = 4, generator: torch.Generator | None = None
) -> list[LengthHalves]:
    """Length buckets of a batch (:func:`length_buckets`), each cut into two random halves.

    ``lengths`` ``[B]``. Every row lands in exactly one half of one bucket, so the halves
    partition the batch; a bucket of a single response gets an empty first half.
    """
    out = []
    for lo, hi in length_buckets(lengths, buckets):
        rows = ((lengths >= lo) & (lengths <= hi)).nonzero().squeeze(-1)
        rows = rows[torch.randperm(len(rows), generator=generator)]
        out.append(LengthHalves(lo, hi, rows[: len(rows) // 2], rows[len(rows) // 2 :]))
    return out


def flatten(grads: list[Tensor | None], like: list[Tensor]) -> Tensor:
    """One float32 vector of per-parameter gradients (``None``, an unused parameter, is 0)."""
    parts = [
        (g if g is not None else torch.zeros_like(p)).reshape(-1).float()
        for g, p in zip(grads, like, strict=True)
    ]
    return torch.cat(parts)


def cosine(a: Tensor, b: Tensor) -> float:
    """Cosine similarity of two flat vectors; NaN when either is zero (no direction)."""
    a, b = a.double(), b.double()
    norms = a.norm() * b.norm()
    return (a @ b / norms).item() if norms > 0 else math.nan


def combine(grads: list[Tensor], counts: list[int]) -> Tensor:
    """The gradient of the mean loss over the union: ``sum(n_k g_k) / sum(n_k)``.

    ``grads[k]`` is the gradient of a mean over ``counts[k]`` responses (disjoint sets).
    """
    total = sum(counts)
    if total == 0:
        return torch.zeros_like(grads[0])
    return sum(n * g for n, g in zip(counts, grads, strict=True)) / total


def bucket_cosines(
    halves: list[LengthHalves],
    off_policy: list[tuple[Tensor, Tensor]],
    on_policy: list[tuple[Tensor, Tensor]],
    counts: list[tuple[int, int]],
    lengths: Tensor,
) -> dict[str, Tensor]:
    """Per length bucket, how noisy the gradient of a bucket half is.

    ``off_policy[b]`` holds the two halves' gradients of bucket ``b`` (the loss with the
    run's importance ratios), ``on_policy[b]`` the same with ratios 1 (old log-probs set to
    the current ones), ``counts[b]`` the responses each gradient averages over. Returns
    ``[buckets]`` tensors: ``cosine_halves`` (the two halves against each other),
    ``cosine_to_full`` (each half against the full-batch gradient, averaged),
    ``cosine_to_on_policy`` (each half against its own ratio-1 gradient: how far the
    ratios and the clipping turn it), ``cosine_length_lo/hi/mean``, ``cosine_responses``;
    and scalar ``cosine_full_to_on_policy`` for the whole batch.
    """
    flat_counts = [n for pair in counts for n in pair]
    full = combine([g for pair in off_policy for g in pair], flat_counts)
    full_on = combine([g for pair in on_policy for g in pair], flat_counts)
    columns: dict[str, list[float]] = {
        k: [] for k in ("halves", "to_full", "to_on_policy", "length_mean")
    }
    for h, (a, b), (a0, b0) in zip(halves, off_policy, on_policy, strict=True):
        columns["halves"].append(cosine(a, b))
        columns["to_full"].append(_nanmean([cosine(a, full), cosine(b, full)]))
        columns["to_on_policy"].append(_nanmean([cosine(a, a0), cosine(b, b0)]))
        rows = torch.cat([h.first, h.second])
        columns["length_mean"].append(lengths[rows].float().mean().item())
    out = {f"cosine_{k}": torch.tensor(v, dtype=torch.float32) for k, v in columns.items()}
    out["cosine_length_lo"] = torch.tensor([h.lo for h in halves], dtype=torch.long)
    out["cosine_length_hi"] = torch.tensor([h.hi for h in halves], dtype=torch.long)
    out["cosine_responses"] = torch.tensor([sum(c) for c in counts], dtype=torch.long)
    out["cosine_full_to_on_policy"] = torch.tensor(cosine(full, full_on))
    return out


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan
