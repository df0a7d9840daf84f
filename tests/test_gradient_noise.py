"""Gradient noise by length: buckets, halves, cosines and the full-batch combination."""

import math

import pytest
import torch

from gspo.gradient_noise import (
    LengthHalves,
    bucket_cosines,
    combine,
    cosine,
    flatten,
    length_buckets,
    length_halves,
)
from gspo.objectives import policy_loss


def test_cosine_of_hand_made_vectors():
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0])) == pytest.approx(1.0)
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == pytest.approx(0.0)
    assert cosine(torch.tensor([1.0, 1.0]), torch.tensor([-1.0, 0.0])) == pytest.approx(
        -1 / math.sqrt(2)
    )
    assert math.isnan(cosine(torch.zeros(3), torch.ones(3)))  # no direction


def test_flatten_fills_unused_parameters_with_zeros():
    params = [torch.zeros(2, 2), torch.zeros(3)]
    flat = flatten([torch.ones(2, 2), None], params)
    assert flat.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_halves_partition_the_batch_by_length():
    lengths = torch.tensor([5, 5, 5, 5, 20, 20, 20, 21, 40, 41, 42, 43, 80, 90, 95])
    halves = length_halves(lengths, buckets=4, generator=torch.Generator().manual_seed(0))
    rows = torch.cat([torch.cat([h.first, h.second]) for h in halves])
    assert sorted(rows.tolist()) == list(range(len(lengths)))  # every row exactly once
    for h in halves:
        assert len(h.second) - len(h.first) in (0, 1)
        both = lengths[torch.cat([h.first, h.second])]
        assert (both >= h.lo).all() and (both <= h.hi).all()
    assert halves[0].lo == 5 and halves[-1].hi == 95
    assert length_buckets(torch.tensor([4, 4, 4])) == [(4, 4)]


def test_combine_is_the_full_batch_gradient_of_the_policy_loss():
    """policy_loss is a mean over responses, so the halves' weighted mean is exact."""
    torch.manual_seed(0)
    theta = torch.randn(6, 9, requires_grad=True)
    old = torch.randn(6, 9) * 0.1
    mask = torch.arange(9).unsqueeze(0) < torch.tensor([[3], [9], [5], [1], [7], [8]])
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 0.0])

    def grad(rows, level):
        loss = policy_loss(theta[rows], old[rows], adv[rows], mask[rows], level=level,
                           clip_low=0.05, clip_high=0.05).loss  # fmt: skip
        return torch.autograd.grad(loss, theta)[0].reshape(-1)

    for level in ("token", "sequence"):
        parts = [torch.tensor([0, 3]), torch.tensor([1, 2, 5]), torch.tensor([4])]
        combined = combine([grad(p, level) for p in parts], [2, 3, 1])
        assert torch.allclose(combined, grad(torch.arange(6), level), atol=1e-6)


def test_bucket_cosines_of_hand_made_gradients():
    halves = [
        LengthHalves(1, 9, torch.tensor([0]), torch.tensor([1])),
        LengthHalves(10, 30, torch.tensor([2]), torch.tensor([3])),
    ]
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    off = [(e1, e1), (e1, e2)]  # short bucket: halves agree; long: orthogonal
    on = [(e1, e2), (e1, e2)]
    out = bucket_cosines(halves, off, on, [(1, 1), (1, 1)], torch.tensor([2, 4, 10, 30]))
    assert out["cosine_halves"].tolist() == pytest.approx([1.0, 0.0])
    full = torch.tensor([3.0, 1.0]) / 4  # (e1 + e1 + e1 + e2) / 4
    to_full_long = (cosine(e1, full) + cosine(e2, full)) / 2
    assert out["cosine_to_full"].tolist() == pytest.approx([cosine(e1, full), to_full_long])
    assert out["cosine_to_on_policy"].tolist() == pytest.approx([0.5, 1.0])
    assert out["cosine_length_mean"].tolist() == pytest.approx([3.0, 20.0])
    assert out["cosine_length_lo"].tolist() == [1, 10]
    assert out["cosine_responses"].tolist() == [2, 2]
    assert out["cosine_full_to_on_policy"].item() == pytest.approx(cosine(full, e1 + e2))
