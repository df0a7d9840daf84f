"""The algorithm's math: group-relative advantages and the policy-gradient objectives of
GSPO, GSPO-token and GRPO, as pure tensor functions.

Contract: ``docs/algorithm.md``, the project's statement of the algorithm (after Zheng
et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071). Every function here
takes tensors and returns tensors or floats: no model, no config object, no I/O; the
loss and its metrics read nothing back from the device (:class:`PolicyLoss`). Shapes:
``B`` responses, ``T`` completion positions.

Equations of ``docs/algorithm.md``, and where each lives:

- Eq. (1), group-relative advantages (``A_i``)       -> :func:`group_advantages`
- Eq. (2), token ratio (GRPO, ``w_{i,t}``)           -> :func:`token_log_ratio`
- Eq. (3), sequence ratio (GSPO, ``s_i``)             -> :func:`sequence_log_ratio`,
  :func:`sequence_ratio`
- Eq. (4), token-wise sequence ratio (GSPO-token, ``s_{i,t}``) -> :func:`sequence_token_ratio`
- Eq. (5), ``min(ratio * A, clip(ratio) * A)`` and the clip test -> :func:`clipped_objective`
- "Aggregation": mean over responses of the per-response token mean
  -> :func:`mean_over_responses` (inner mean :func:`mean_over_tokens`)
- Eq. (9), the k3 KL estimator                        -> :func:`k3_kl`
- "Rollout correction", the weight ``c_{i,t}`` and the kept tokens of Eq. (11)
  -> :func:`rollout_correction`
- Eqs. (6)-(8), (10) and (11), the whole loss, with the metrics of "Logged metrics"
  -> :func:`policy_loss`
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, get_args

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = get_args(AdvantageScale)

#: A group whose reward standard deviation is at most this is treated as constant:
#: its advantages are exactly 0 (mean subtraction alone can leave rounding noise).
ZERO_STD = 1e-6

Level = Literal["sequence", "sequence_token", "token"]
LEVELS: tuple[str, ...] = get_args(Level)

#: The paper's clip ranges ``(eps_low, eps_high)``: section 5.1 for GSPO, the GRPO baseline
#: (``docs/algorithm.md``, "The clipped term and the clip ranges").
DEFAULT_CLIP: dict[str, tuple[float, float]] = {
    "sequence": (3e-4, 4e-4),
    "sequence_token": (3e-4, 4e-4),
    "token": (0.2, 0.27),
}

#: Log-ratios are clamped to this magnitude before ``exp`` so that no finite input gives
#: inf or NaN. ``exp(20) ~ 4.9e8`` is far outside any clip band, so the clamp never
#: changes which branch of the clipped objective is active (``docs/algorithm.md``, "Numerics").
MAX_LOG_RATIO = 20.0


Correction = Literal["none", "token_tis", "token_mask", "sequence_mask"]
CORRECTIONS: tuple[str, ...] = get_args(Correction)

#: Default ``(min, max)`` bounds of each rollout correction (``docs/algorithm.md``,
#: "Rollout correction"): truncated importance sampling caps the token weight at 2 (Yao et
#: al. 2025, "Your efficient RL framework secretly brings you off-policy RL training";
#: verl's token-TIS default); IcePop keeps tokens whose weight lies in [0.5, 5] (Ring-1T,
#: 2025); the geometric-mean sequence mask keeps responses within [0.999, 1.001] (verl's
#: geometric rejection preset). ``token_tis`` has no lower bound.
DEFAULT_CORRECTION_BOUNDS: dict[str, tuple[float, float]] = {
    "token_tis": (0.0, 2.0),
    "token_mask": (0.5, 5.0),
    "sequence_mask": (0.999, 1.001),
}


@dataclass
class PolicyLoss:
    """Result of :func:`policy_loss`.

    ``loss`` is a scalar tensor (minus the objective, plus the KL penalty) that carries
    the gradient; ``values`` the metrics as 0-dim tensors beside it, computed without
    reading anything back from the device; ``metrics`` the same as floats, read in one
    transfer (:func:`read_scalars`: on CUDA a wait for the forward, so the trainer reads
    them once the backward is queued)."""

    loss: Tensor
    values: dict[str, Tensor] = field(default_factory=dict)

    @cached_property
    def metrics(self) -> dict[str, float]:
        return read_scalars(self.values)


def read_scalars(values: Mapping[str, Tensor]) -> dict[str, float]:
    """0-dim tensors as Python floats, in one transfer: one wait for the device instead
    of one per ``.item()``. Each goes through float64, which holds a float32 or bf16 value
    and an integer count exactly (the floats ``.item()`` gives); one elsewhere is moved."""
    if not values:
        return {}
    device = next(iter(values.values())).device
    stacked = torch.stack(
        [v.detach().reshape(()).to(device, torch.float64) for v in values.values()]
    )
    return dict(zip(values, stacked.tolist(), strict=True))


def check_level(level: str) -> None:
    """Raise ``ValueError`` naming the accepted values when ``level`` is not one of them."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {', '.join(LEVELS)}; got {level!r}")


def _accumulation_dtype(t: Tensor) -> torch.dtype:
    """float32 for half-precision inputs, otherwise the input's own (float32/float64)."""
    return torch.promote_types(t.dtype, torch.float32)


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


def token_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``lp_{i,t} - olp_{i,t}`` in float32 or wider, 0 where ``mask`` is false.

    The log of GRPO's token ratio ``w_{i,t}``, ``docs/algorithm.md`` Eq. (2).

    Shapes: ``[B, T]`` in, ``[B, T]`` out. Masked positions may hold any value (even
    -inf): they are replaced, not multiplied, so they can never produce NaN.
    """
    dtype = _accumulation_dtype(logprobs)
    delta = logprobs.to(dtype) - old_logprobs.to(dtype)
    return torch.where(mask.bool(), delta, torch.zeros((), dtype=dtype, device=delta.device))


def response_lengths(mask: Tensor) -> Tensor:
    """``|y_i|``: the number of counted tokens per response, ``[B, T] -> [B]`` (float32).

    ``docs/algorithm.md``, "Notation".
    """
    return mask.bool().sum(dim=-1).to(torch.float32)


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised log-ratio ``(1/|y_i|) sum_t (lp_{i,t} - olp_{i,t})``.

    The log of ``s_i``, ``docs/algorithm.md`` Eq. (3).

    ``[B, T] -> [B]``, clamped to ``[-MAX_LOG_RATIO, MAX_LOG_RATIO]``. Rows with an
    all-zero mask give 0 (ratio 1).
    """
    delta = token_log_ratio(logprobs, old_logprobs, mask)
    return mean_over_tokens(delta, mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO's ``s_i = (pi_theta(y_i|x) / pi_old(y_i|x))^(1/|y_i|)``, ``[B, T] -> [B]``.

    ``docs/algorithm.md`` Eq. (3).
    """
    return sequence_log_ratio(logprobs, old_logprobs, mask).exp()


def sequence_token_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token's ``s_{i,t} = sg[s_i] * exp(lp_{i,t} - sg[lp_{i,t}])``, ``[B, T] -> [B, T]``.

    ``docs/algorithm.md`` Eq. (4). Its value equals ``s_i`` at every token; its gradient
    flows through each token's own log-prob, with weight ``s_i``, except in a row whose
    mean log-ratio is past ``MAX_LOG_RATIO`` (or not finite: a -inf log-prob), where
    GSPO's clamp passes no gradient and neither does this.
    """
    mean = mean_over_tokens(token_log_ratio(logprobs, old_logprobs, mask), mask)
    s = mean.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp().detach()
    lp = logprobs.to(_accumulation_dtype(logprobs))
    # Masked positions may hold -inf/NaN: exp(lp - lp) would be NaN there, and its NaN
    # gradient would leak through the later masking `where` (0 * NaN). Replace them first,
    # and the tokens of a row the clamp holds (whose lp may be -inf too).
    live = mask.bool() & (mean.abs() <= MAX_LOG_RATIO).unsqueeze(-1)
    lp = torch.where(live, lp, torch.zeros((), dtype=lp.dtype, device=lp.device))
    return s.unsqueeze(-1) * torch.exp(lp - lp.detach())


def clipped_objective(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)`` and the clip test.

    ``docs/algorithm.md`` Eq. (5). ``ratio`` and ``advantages`` broadcast together.
    Returns ``(objective, clipped_low, clipped_high)`` where ``clipped_high`` marks
    ``ratio > 1 + clip_high`` with ``A > 0`` and ``clipped_low`` marks
    ``ratio < 1 - clip_low`` with ``A < 0``: exactly the entries where the clipped branch
    of the min is active and the gradient is zero. Written as a ``where`` on that test,
    which is the min itself case by case, so the metric and the gradient cannot disagree.
    """
    clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
    clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
    clipped = clipped_high | clipped_low
    bound = ratio.detach().clamp(1.0 - clip_low, 1.0 + clip_high)
    objective = torch.where(clipped, bound * advantages, ratio * advantages)
    return objective, clipped_low, clipped_high


def mean_over_tokens(per_token: Tensor, mask: Tensor) -> Tensor:
    """Each response's mean over its counted tokens, ``[B, T] -> [B]`` (0 for empty rows).

    The inner ``(1/|y_i|) sum_t`` of ``docs/algorithm.md`` Eqs. (3) and (7)-(9).
    """
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    per_token = torch.where(mask.bool(), per_token, zero)
    return per_token.sum(dim=-1) / response_lengths(mask).to(per_token.dtype).clamp(min=1.0)


def mean_over_responses(per_token: Tensor, mask: Tensor) -> Tensor:
    """The paper's aggregation: mean over responses of each response's token mean.

    The outer ``(1/|V|) sum_{i in V}`` of ``docs/algorithm.md`` Eqs. (6)-(9) ("Aggregation").

    ``per_token`` ``[B, T]`` (or ``[B]``, already one value per response), ``mask``
    ``[B, T]``. Responses with no counted token are left out; if none is left the result
    is a zero that still depends on ``per_token`` (so ``backward`` works and gives 0).
    """
    valid = mask.bool().any(dim=-1)
    per_response = mean_over_tokens(per_token, mask) if per_token.dim() == 2 else per_token
    n_valid = valid.sum()
    zero = torch.zeros((), dtype=per_response.dtype, device=per_response.device)
    total = torch.where(valid, per_response, zero).sum()
    return total / n_valid.clamp(min=1).to(per_response.dtype)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): ``exp(r) - r - 1``, ``r = ref - lp``.

    ``docs/algorithm.md`` Eq. (9).

    ``[B, T] -> [B, T]``, 0 at masked positions, log-ratio clamped like the policy ratio.
    Written ``expm1(r) - r``: ``exp(r) - r - 1`` loses the value to float32 rounding for the
    small ``r`` it is mostly measured at (about 5e-7 at ``r = 1e-3``, next to rounding
    errors of 1e-7 in ``exp(r)``), even below 0, which the estimator never is.
    """
    r = token_log_ratio(ref_logprobs, logprobs, mask).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.expm1(r) - r


@dataclass
class RolloutCorrection:
    """Result of :func:`rollout_correction`: what :func:`policy_loss` takes, and metrics.

    ``weights`` ``[B, T]``: the weight ``c_{i,t}`` of each token's term (1 where nothing
    is reweighted); ``keep`` ``[B, T]`` bool: the counted tokens that stay in the loss.
    """

    weights: Tensor
    keep: Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def rollout_correction(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    mode: str,
    *,
    low: float | None = None,
    high: float | None = None,
) -> RolloutCorrection:
    """Correct for the sampler not being pi_old: ``docs/algorithm.md`` Eq. (11).

    The per-token weight is ``rho_{i,t} = pi_old(y_{i,t}) / pi_sampler(y_{i,t})``
    (the trainer's recompute over the rollout engine's log-probs of the sampled token).

    - ``"none"``: weights 1, every counted token kept (the metrics are still reported).
    - ``"token_tis"``: truncated importance sampling, ``c_{i,t} = min(rho_{i,t}, high)``.
    - ``"token_mask"``: IcePop, tokens with ``rho_{i,t}`` outside ``[low, high]`` drop out.
    - ``"sequence_mask"``: a response drops out when its geometric-mean weight
      ``exp(mean_t log rho_{i,t})`` lies outside ``[low, high]``.

    ``low``/``high`` default to :data:`DEFAULT_CORRECTION_BOUNDS`. Shapes ``[B, T]``;
    masked positions may hold any value. Metrics: ``weight_mean/min/max`` (``c_{i,t}``
    for token_tis, ``rho_{i,t}`` for token_mask, over counted tokens; per response the
    geometric mean otherwise), ``masked_token_fraction`` (counted tokens dropped)
    and ``masked_sequence_fraction`` (responses that lost at least one token).
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"mode must be one of {', '.join(CORRECTIONS)}; got {mode!r}")
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            "old_logprobs, sampler_logprobs and mask must share one [B, T] shape; got "
            f"{list(old_logprobs.shape)}, {list(sampler_logprobs.shape)}, {list(mask.shape)}"
        )
    default_low, default_high = DEFAULT_CORRECTION_BOUNDS.get(mode, (0.0, math.inf))
    low = default_low if low is None else float(low)
    high = default_high if high is None else float(high)
    mask = mask.bool()
    # each token's rho clamped as GRPO's w is; the geometric mean, as GSPO's s_i, after
    # the mean (a token's clamp would move it: one log-ratio of -50 in 10 is e^-5, not e^-2)
    rho = (
        token_log_ratio(old_logprobs, sampler_logprobs, mask)
        .clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        .exp()
    )
    ones = torch.ones_like(rho)
    valid_rows = mask.any(dim=-1)
    geometric = sequence_ratio(old_logprobs, sampler_logprobs, mask)  # [B]
    if mode == "token_tis":
        weights = torch.where(mask, rho.clamp(max=high), ones)
        keep = mask
        shown = weights[mask]
    elif mode == "token_mask":
        weights = ones
        keep = mask & (rho >= low) & (rho <= high)
        shown = rho[mask]
    else:
        weights = ones
        inside = (geometric >= low) & (geometric <= high)
        keep = mask & inside.unsqueeze(-1) if mode == "sequence_mask" else mask
        shown = geometric[valid_rows]
    n_tokens = int(mask.sum().item())
    n_rows = int(valid_rows.sum().item())
    dropped = mask & ~keep
    metrics = {
        "masked_token_fraction": dropped.sum().item() / max(n_tokens, 1),
        "masked_sequence_fraction": dropped.any(dim=-1).sum().item() / max(n_rows, 1),
    }
    if shown.numel():
        metrics.update(
            weight_mean=shown.mean().item(),
            weight_min=shown.min().item(),
            weight_max=shown.max().item(),
        )
    return RolloutCorrection(weights=weights.detach(), keep=keep, metrics=metrics)


def _as_advantages(advantages: Tensor, mask: Tensor, level: str) -> Tensor:
    """Validate the advantage shape: ``[B]`` for every level, ``[B, T]`` for token levels."""
    b, t = mask.shape
    if advantages.shape == (b,):
        return advantages
    if advantages.shape == (b, t):
        if level == "sequence":
            raise ValueError(
                "advantages of shape [B, T] need level='sequence_token' or 'token'; "
                "level='sequence' takes one advantage per response, shape [B]"
            )
        return advantages
    raise ValueError(
        f"advantages must have shape [B]={[b]} or [B, T]={[b, t]}; got {list(advantages.shape)}"
    )


def _ratio_stats(ratio: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """The mean, least and greatest ``ratio`` where ``valid`` (NaN where none is), by masked
    reductions: selecting the values would wait for the device to count them. The mean is
    the selection's to float rounding (the same sum in another order where some are not
    valid)."""
    values = ratio.detach()
    zero, inf, nan = (values.new_tensor(x) for x in (0, math.inf, math.nan))
    if values.numel() == 0:  # (no rows, or no columns: the shape is known on the host)
        return {"ratio_mean": nan, "ratio_min": nan.clone(), "ratio_max": nan.clone()}
    count = valid.sum()
    some = count > 0
    return {
        "ratio_mean": torch.where(valid, values, zero).sum() / count.to(values.dtype),
        "ratio_min": torch.where(some, torch.where(valid, values, inf).amin(), nan),
        "ratio_max": torch.where(some, torch.where(valid, values, -inf).amax(), nan),
    }


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    level: str = "sequence",
    clip_low: float | None = None,
    clip_high: float | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    weights: Tensor | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> PolicyLoss:
    """The clipped policy-gradient loss of GSPO, GSPO-token or GRPO.

    ``docs/algorithm.md`` Eq. (6) (GSPO), (7) (GSPO-token) or (8) (GRPO), plus the KL
    penalty of Eq. (10); the metrics are those of its "Logged metrics".

    Args:
        logprobs: ``[B, T]`` current-policy log-probs of the sampled tokens (with grad).
        old_logprobs: ``[B, T]`` behaviour-policy log-probs (no grad needed).
        advantages: ``[B]`` one per response, or ``[B, T]`` per token (token levels).
        mask: ``[B, T]`` bool or 0/1, the completion tokens that count.
        level: ``"sequence"`` (GSPO), ``"sequence_token"`` (GSPO-token), ``"token"`` (GRPO).
        clip_low, clip_high: ``eps_low``, ``eps_high``; ``None`` takes the paper's range
            for the level (:data:`DEFAULT_CLIP`).
        ref_logprobs: ``[B, T]`` reference-policy log-probs for the KL penalty.
        kl_coef: weight of the k3 KL penalty (needs ``ref_logprobs`` when non-zero).
        weights: ``[B, T]`` (or ``[B]``) non-negative weights ``c_{i,t}`` of each token's
            clipped term, Eq. (11) (:func:`rollout_correction`); treated as constants.
            ``None`` = 1. Tokens to leave out altogether go out through ``mask``.
        entropy: ``[B, T]`` the policy's entropy at each position (with gradient), for the
            ``entropy`` metric and the bonus; aggregated like the KL.
        entropy_coef: weight of the entropy bonus, ``loss -= entropy_coef * H`` (needs
            ``entropy`` when non-zero).

    Returns:
        :class:`PolicyLoss` with ``loss = -J + kl_coef * KL`` where ``J`` is the mean over
        responses of the (token-mean) clipped objective, and metrics (``values``, as
        floats ``metrics``):
        ``clip_fraction`` (token-weighted, the paper's Figure 2), ``clip_fraction_low``,
        ``clip_fraction_high``, ``clip_fraction_sequences`` (mean over responses of each
        response's clipped-token fraction; for GSPO the fraction of clipped responses),
        ``ratio_mean/min/max`` (of ``s_i`` for the sequence levels, ``w_{i,t}`` for token),
        ``objective``, ``tokens``, ``sequences``, and ``kl`` when a reference is given.
    """
    check_level(level)
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must share one [B, T] shape; got "
            f"{list(logprobs.shape)}, {list(old_logprobs.shape)}, {list(mask.shape)}"
        )
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T]; got {logprobs.dim()} dimensions")
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef is non-zero but ref_logprobs is None")
    if entropy_coef != 0.0 and entropy is None:
        raise ValueError("entropy_coef is non-zero but entropy is None")
    if entropy_coef != 0.0 and logprobs.requires_grad and not entropy.requires_grad:
        raise ValueError("entropy_coef is non-zero but entropy has no gradient (a metric's)")
    default_low, default_high = DEFAULT_CLIP[level]
    clip_low = default_low if clip_low is None else float(clip_low)
    clip_high = default_high if clip_high is None else float(clip_high)
    if not (clip_low >= 0 and clip_high >= 0):  # (NaN fails too)
        raise ValueError(f"clip_low and clip_high must be >= 0; got {clip_low}, {clip_high}")

    mask = mask.bool()
    advantages = _as_advantages(advantages, mask, level)
    dtype = _accumulation_dtype(logprobs)
    advantages = advantages.to(dtype)
    valid_rows = mask.any(dim=-1)

    if level == "sequence":
        ratio = sequence_ratio(logprobs, old_logprobs, mask)  # [B]
        objective, low, high = clipped_objective(ratio, advantages, clip_low, clip_high)
        # A clipped response clips all of its tokens: broadcast the test to [B, T].
        low_tokens = low.unsqueeze(-1) & mask
        high_tokens = high.unsqueeze(-1) & mask
        stats = _ratio_stats(ratio, valid_rows)
    else:
        if level == "token":
            log_w = token_log_ratio(logprobs, old_logprobs, mask)
            ratio = log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()  # w_{i,t}
            stats = _ratio_stats(ratio, mask)
        else:
            ratio = sequence_token_ratio(logprobs, old_logprobs, mask)  # s_{i,t}
            # Every token of response i holds the value s_i: report it once per response.
            stats = _ratio_stats(mean_over_tokens(ratio, mask), valid_rows)
        token_advantages = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
        objective, low, high = clipped_objective(ratio, token_advantages, clip_low, clip_high)
        low_tokens = low & mask
        high_tokens = high & mask

    if weights is not None:
        if weights.shape not in (mask.shape, mask.shape[:1]):
            raise ValueError(
                f"weights must have shape [B, T]={list(mask.shape)} or [B]; "
                f"got {list(weights.shape)}"
            )
        weights = weights.detach().to(dtype)
        weights = weights if weights.dim() == 2 else weights.unsqueeze(-1).expand(mask.shape)
        # masked positions may hold anything: 0 * NaN in backward would leak otherwise
        weights = torch.where(mask, weights, torch.ones((), dtype=dtype, device=mask.device))
        # c_{i,t} multiplies each token's term; GSPO's one term per response is the term
        # of each of its tokens (the inner token mean leaves it unchanged when c = 1)
        per_token = objective if objective.dim() == 2 else objective.unsqueeze(-1)
        objective = per_token * weights
    objective_value = mean_over_responses(objective, mask)
    loss = -objective_value

    metrics: dict[str, Tensor] = {"objective": objective_value.detach()}
    if ref_logprobs is not None:
        kl = mean_over_responses(k3_kl(logprobs, ref_logprobs, mask), mask)
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl
        metrics["kl"] = kl.detach()
    if entropy is not None:
        h = mean_over_responses(entropy.to(dtype), mask)
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * h
        metrics["entropy"] = h.detach()

    n_tokens = mask.sum()
    # token fractions as exact counts divided in float64 (as Python divides two ints)
    per_token = n_tokens.clamp(min=1).to(torch.float64)
    clipped_tokens = low_tokens | high_tokens
    per_response_fraction = mean_over_tokens(clipped_tokens.float(), mask)
    metrics.update(
        {
            "clip_fraction": clipped_tokens.sum().to(torch.float64) / per_token,
            "clip_fraction_low": low_tokens.sum().to(torch.float64) / per_token,
            "clip_fraction_high": high_tokens.sum().to(torch.float64) / per_token,
            "clip_fraction_sequences": mean_over_responses(per_response_fraction, mask).detach(),
            **stats,
            "tokens": n_tokens,
            "sequences": valid_rows.sum(),
        }
    )
    return PolicyLoss(loss=loss, values=metrics)
