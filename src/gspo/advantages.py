"""Group-relative advantage estimators (shared by GRPO and GSPO).

``A_i = (r_i - mean_j r_j) / std_j r_j`` over the ``G`` responses to one query:
``docs/algorithm.md`` Eq. (1), section "Group-relative advantage".
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = get_args(AdvantageScale)

#: A group whose reward standard deviation is at most this is treated as constant:
#: its advantages are exactly 0 (mean subtraction alone can leave rounding noise).
ZERO_STD = 1e-6


def group_advantages(
    rewards: Tensor,
    group_size: int,
    *,
    scale: str = "group",
    batch_std: Tensor | None = None,
    scorable: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages, ``[N] -> [N]`` float32 (``docs/algorithm.md`` Eq. (1)).

    Args:
        rewards: ``[N]`` scalar rewards; rows ``k*G .. k*G+G-1`` are one query's group.
        group_size: ``G``; ``N`` must be a multiple of it.
        scale: ``"group"`` divides by each group's std (the paper's form, default),
            ``"batch"`` by the std of all ``N`` rewards, ``"none"`` does not divide
            (Dr. GRPO's advantages; Dr. GRPO's loss also drops the per-response length
            mean, which gspo's keeps). Standard deviations are unbiased (Bessel), as in
            TRL and verl.
        batch_std: for ``"batch"``, the std of the whole rollout batch when ``rewards``
            is one rank's share of it (torchrun); by default that of ``rewards``.
        scorable: ``[N]`` bool, False for a completion no reward function scored (all
            returned None): it stays out of its group's mean and std (and the batch's)
            and gets advantage 0, as in TRL. None: every completion was scored.

    A group whose rewards are all equal gets advantages of exactly 0, never NaN.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)}; got {scale!r}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N]; got shape {list(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rewards {rewards.numel()}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite (got NaN or inf)")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32))
    if scorable is not None and not bool(scorable.all()):
        return _partly_scored(r, group_size, scale, batch_std, scorable.to(torch.bool))
    groups = r.view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if group_size > 1:
        group_std = groups.std(dim=1, keepdim=True)
    else:
        group_std = torch.zeros_like(groups)
    # Exact equality as well as a small std: the float mean of equal rewards can be off by
    # an ulp (e.g. 3 x 1000.1 in float32), leaving a std of rounding noise (~7e-5) that
    # would be divided out into advantages of about +-0.8 for an all-equal group.
    all_equal = (groups == groups[:, :1]).all(dim=1, keepdim=True)
    constant = all_equal | (group_std <= ZERO_STD)
    return _divided(centered, group_std, constant, scale, batch_std, r)


def _partly_scored(
    r: Tensor, group_size: int, scale: str, batch_std: Tensor | None, scorable: Tensor
) -> Tensor:
    """:func:`group_advantages` over the scored completions of each group only (the
    others: advantage 0). A group with fewer than two scored completions, or whose scored
    rewards are all equal, gets advantages of 0."""
    groups, valid = r.view(-1, group_size), scorable.view(-1, group_size)
    count = valid.sum(dim=1, keepdim=True)
    zero = torch.zeros_like(groups)
    mean = torch.where(valid, groups, zero).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = groups - mean
    squares = torch.where(valid, centered, zero).square().sum(dim=1, keepdim=True)
    group_std = (squares / (count - 1).clamp(min=1)).sqrt()
    first = groups.gather(1, valid.to(torch.int64).argmax(dim=1, keepdim=True))  # a scored one
    all_equal = (torch.where(valid, groups, first) == first).all(dim=1, keepdim=True)
    constant = all_equal | (count < 2) | (group_std <= ZERO_STD)
    return _divided(centered, group_std, constant | ~valid, scale, batch_std, r[scorable])


def _divided(
    centered: Tensor,
    group_std: Tensor,
    zeroed: Tensor,
    scale: str,
    batch_std: Tensor | None,
    batch: Tensor,
) -> Tensor:
    """``centered`` ``[groups, G]`` over ``scale``'s denominator (``group_std``, the std of
    ``batch`` or ``batch_std``, or 1), 0 where ``zeroed``; flat float32."""
    if scale == "group":
        denominator = group_std
    elif scale == "batch":
        if batch_std is None:
            batch_std = batch.std() if batch.numel() > 1 else torch.zeros((), dtype=batch.dtype)
        denominator = batch_std.to(centered.dtype).expand_as(group_std)
    else:
        denominator = torch.ones_like(group_std)
    safe = torch.where(zeroed, torch.ones_like(denominator), denominator)
    advantages = torch.where(zeroed, torch.zeros_like(centered), centered / safe)
    return advantages.reshape(-1).to(torch.float32)
