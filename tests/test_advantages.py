"""Tests of ``gspo.objectives.group_advantages`` against ``docs/algorithm.md`` Eq. (1)
("Group-relative advantage": A_i = (r_i - mean_j r_j) / std_j r_j, 0 for a group of equal
rewards, batch-std and no-std (Dr. GRPO) variants)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gspo.objectives import group_advantages


def reference(rewards, group_size: int, scale: str) -> np.ndarray:
    """Eq. (1) of docs/algorithm.md in float64 numpy, unbiased (ddof=1) standard deviations."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    centered = r - r.mean(axis=1, keepdims=True)
    if scale == "group":
        denominator = r.std(axis=1, ddof=1, keepdims=True)
    elif scale == "batch":
        denominator = np.full((r.shape[0], 1), r.std(ddof=1))
    else:
        denominator = np.ones((r.shape[0], 1))
    constant = (r == r[:, :1]).all(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(constant, 0.0, centered / np.where(constant, 1.0, denominator))
    return out.reshape(-1)


# Rewards on a coarse grid: distinct values are far apart, equal values are exactly equal,
# so float32 and float64 agree on which groups are constant.
GRID = [x / 4 for x in range(-20, 21)]


@st.composite
def reward_batches(draw):
    group_size = draw(st.integers(2, 8))
    n_groups = draw(st.integers(1, 6))
    values = st.sampled_from([0.0, 1.0]) if draw(st.booleans()) else st.sampled_from(GRID)
    rewards = draw(st.lists(values, min_size=group_size * n_groups, max_size=group_size * n_groups))
    return rewards, group_size


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_continuous_rewards(scale, seed):
    """Each form matches the float64 formula on continuous rewards (one all-equal group
    included), as float32 of shape [N]."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(6, 5)) * rng.uniform(0.1, 10.0, size=(6, 1))
    rewards[2] = 0.7  # a constant group
    rewards = rewards.reshape(-1)
    out = group_advantages(torch.tensor(rewards, dtype=torch.float64), 5, scale=scale)
    assert out.dtype == torch.float32
    assert out.shape == (30,)
    np.testing.assert_allclose(out.numpy(), reference(rewards, 5, scale), rtol=1e-5, atol=1e-6)
    assert (out[10:15] == 0).all()


@settings(max_examples=50, deadline=None)
@given(batch=reward_batches(), scale=st.sampled_from(["group", "batch", "none"]))
def test_matches_reference_property(batch, scale):
    """Any batch of grid rewards (binary verifier rewards included) matches the formula,
    and no output is NaN."""
    rewards, group_size = batch
    out = group_advantages(torch.tensor(rewards, dtype=torch.float32), group_size, scale=scale)
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(
        out.numpy(), reference(rewards, group_size, scale), rtol=1e-5, atol=1e-6
    )


@settings(max_examples=50, deadline=None)
@given(batch=reward_batches())
def test_group_form_is_standardised(batch):
    """Group form: every non-constant group's advantages have mean 0 and unbiased std 1;
    every constant group's are exactly 0."""
    rewards, group_size = batch
    out = group_advantages(torch.tensor(rewards), group_size).double().view(-1, group_size)
    groups = torch.tensor(rewards).view(-1, group_size)
    for adv, r in zip(out, groups, strict=True):
        if (r == r[0]).all():
            assert (adv == 0).all()
        else:
            # float32: r - mean cancels (hypothesis found [4, 4, 4.25]: mean -1.1e-6)
            assert adv.mean().item() == pytest.approx(0.0, abs=1e-5)
            assert adv.std().item() == pytest.approx(1.0, rel=1e-5)


def test_known_values():
    """Binary rewards [1, 0, 0, 1]: mean 0.5, unbiased std 1/sqrt(3); [1, 1, 0, 1]: mean
    0.75, unbiased std 0.5; Dr. GRPO keeps the centred rewards; batch std is over all N."""
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    third = 0.5 * np.sqrt(3.0)
    np.testing.assert_allclose(
        group_advantages(r, 4).numpy(),
        [third, -third, -third, third, 0.25 / 0.5, 0.25 / 0.5, -0.75 / 0.5, 0.25 / 0.5],
        rtol=1e-6,
    )
    np.testing.assert_allclose(
        group_advantages(r, 4, scale="none").numpy(),
        [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, -0.75, 0.25],
        rtol=1e-6,
    )
    batch_std = np.std(r.numpy().astype(np.float64), ddof=1)
    np.testing.assert_allclose(
        group_advantages(r, 4, scale="batch").numpy(),
        np.array([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, -0.75, 0.25]) / batch_std,
        rtol=1e-6,
    )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 0.3, 0.7, 3.3, 1000.1, 12345.678, -2.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("group_size", [2, 3, 5, 7, 16])
def test_equal_rewards_give_exactly_zero(value, dtype, group_size, scale):
    """A group whose rewards are all equal gets advantages of exactly 0 (never NaN), also
    when the float mean of the equal values is off by rounding (e.g. 3 x 1000.1 in
    float32), and also next to a non-constant group."""
    constant = torch.full((group_size,), value, dtype=dtype)
    out = group_advantages(constant, group_size, scale=scale)
    assert torch.equal(out, torch.zeros(group_size))
    varied = torch.arange(group_size, dtype=dtype)
    out = group_advantages(torch.cat([varied, constant, varied]), group_size, scale=scale)
    assert torch.equal(out[group_size : 2 * group_size], torch.zeros(group_size))
    assert (out[:group_size] != 0).any()
    assert torch.isfinite(out).all()


def test_all_groups_constant_batch_scale():
    """Batch form with every group constant (batch std > 0 or = 0): all zeros, no NaN."""
    r = torch.tensor([0.1, 0.1, 0.1, 0.9, 0.9, 0.9])
    assert torch.equal(group_advantages(r, 3, scale="batch"), torch.zeros(6))
    assert torch.equal(group_advantages(torch.full((6,), 0.1), 3, scale="batch"), torch.zeros(6))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_size_one_gives_zeros(scale):
    """With G = 1 every response is its own group mean: all advantages are 0."""
    r = torch.tensor([0.0, 1.0, 0.5, -3.0])
    out = group_advantages(r, 1, scale=scale)
    assert torch.equal(out, torch.zeros(4))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64])
def test_output_is_float32_of_shape_n(dtype):
    """Whatever the reward dtype, the result is float32 with shape [N]."""
    r = torch.tensor([1, 0, 0, 1, 2, 0], dtype=dtype)
    out = group_advantages(r, 3)
    assert out.dtype == torch.float32
    assert out.shape == (6,)
    np.testing.assert_allclose(out.numpy(), reference([1, 0, 0, 1, 2, 0], 3, "group"), rtol=1e-6)


@pytest.mark.parametrize(("n", "group_size"), [(5, 2), (7, 3), (4, 8), (4, 0)])
def test_group_size_must_divide_n(n, group_size):
    """N not a multiple of group_size (or group_size < 1) is a ValueError."""
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(n), group_size)


def test_unknown_scale_raises_naming_accepted_values():
    """An unknown scale is a ValueError whose message names group, batch and none."""
    with pytest.raises(ValueError) as info:
        group_advantages(torch.zeros(4), 2, scale="std")
    for name in ("group", "batch", "none"):
        assert name in str(info.value)


def test_rejects_non_finite_and_non_1d_rewards():
    """NaN/inf rewards and rewards that are not [N] are rejected instead of spreading NaN."""
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.tensor([1.0, float("inf")]), 2)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2), 2)


def test_batch_scale_takes_the_whole_batchs_std_when_given():
    """Under torchrun a rank holds a share of the rollout batch: the std is the batch's."""
    rewards = torch.tensor([0.0, 1.0, 2.0, 2.0, 5.0, 9.0])
    centered = rewards.view(-1, 3) - rewards.view(-1, 3).mean(dim=1, keepdim=True)
    given = group_advantages(rewards, 3, scale="batch", batch_std=torch.tensor(4.0))
    torch.testing.assert_close(given, (centered / 4.0).reshape(-1))
    own = group_advantages(rewards, 3, scale="batch")
    torch.testing.assert_close(own, (centered / rewards.std()).reshape(-1))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_unscored_completions_stay_out_of_the_baseline_with_advantage_0(scale):
    """A completion every reward function returned None for (reward 0, no evidence) was
    part of its group's mean and std and got an advantage: TRL leaves it out (advantage
    0), and so does gspo now."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 5.0, 2.0, 2.0, 3.0, 0.0, 7.0, 0.0, 0.0, 0.0])
    scorable = torch.tensor([1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    got = group_advantages(rewards, 4, scale=scale, scorable=scorable)
    assert (got[~scorable] == 0).all() and (got[8:] == 0).all()  # group 3: one scored
    for g, rows in ((0, [0, 1, 3]), (1, [4, 6, 7])):  # each group's scored completions
        if scale == "batch":  # centred in the group, over the std of every scored reward
            alone = (rewards[rows] - rewards[rows].mean()) / rewards[scorable].std()
        else:
            alone = group_advantages(rewards[rows], 3, scale=scale)
        torch.testing.assert_close(got[rows], alone, msg=f"group {g}")
    every = torch.ones(12, dtype=torch.bool)  # all scored: the plain path, bitwise
    assert torch.equal(group_advantages(rewards, 4, scale=scale, scorable=every),
                       group_advantages(rewards, 4, scale=scale))  # fmt: skip
