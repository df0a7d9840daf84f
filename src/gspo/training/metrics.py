"""Timers, and how each logged metric combines across torchrun ranks."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager

import torch

from gspo.distributed import Distributed, Reduction, combine_metrics
from gspo.objectives import k3_kl, mean_over_tokens


@contextmanager
def timed(metrics: MutableMapping[str, float], key: str) -> Iterator[None]:
    """``metrics[key]`` = seconds the block took (also when it raises); the block is
    marked ``key`` for the profiler (``log.profile_steps``)."""
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(key):  # the stage, in a profile's trace
            yield
    finally:
        metrics[key] = time.perf_counter() - start


def crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(before, after]``."""
    return every > 0 and after // every > before // every


#: How each logged metric combines across ranks (:func:`gspo.distributed.combine_metrics`):
#: counts add up, extremes and times take the extreme (a step lasts as long as its slowest
#: rank), fractions and means are weighted by the tokens or responses behind them.
#: ``rollout.filter_groups`` fills each rank's share on its own: the groups dropped add up,
#: and the extra rounds of a batch are those of the rank that needed the most.
SUMMED = frozenset(
    {
        "train/tokens",
        "train/sequences",
        "mismatch/tokens",
        "mismatch/sequences",
        "rollout/groups_dropped",
        "sft/tokens",
        "moe/churn_tokens",
    }
)
TOKEN_WEIGHTED = frozenset(
    {"train/clip_fraction", "train/clip_fraction_low", "train/clip_fraction_high"}
)
SEQUENCE_WEIGHTED = frozenset(
    {
        "train/objective",
        "train/kl",
        "train/entropy",
        "train/loss",
        "train/clip_fraction_sequences",
    }
)


#: Logged once per rollout batch, on its last minibatch's line: the clip fraction of its
#: on-policy minibatch and of its off-policy ones (:func:`rollout_clip_fractions`).
CLIP_ON_POLICY = "train/clip_fraction_on_policy"
CLIP_OFF_POLICY = "train/clip_fraction_off_policy"


def rollout_clip_fractions(
    lines: Sequence[Mapping[str, float]], staleness: int = 0
) -> dict[str, float]:
    """The clip fraction of a rollout batch, its on-policy and off-policy parts apart.

    ``lines`` are the batch's minibatch lines (over every rank). Minibatch 0 of a batch
    sampled by the weights it trains (``staleness`` 0) is on-policy: its ratio is 1 up to
    the sampler's and the trainer's numerics (which is what it measures: 0 in float32,
    above 0 where bf16 log-probs disagree). The later minibatches, and every minibatch of
    a stale batch, are off-policy: the clip range acts there. Each part is token-weighted
    (clipped tokens / counted tokens over its minibatches, as ``train/clip_fraction`` is
    per minibatch); a part without counted tokens is left out.
    """
    on = [x for x in lines if staleness == 0 and x["train/minibatch"] == 0]
    off = [x for x in lines if not any(x is y for y in on)]
    out = {}
    for key, part in ((CLIP_ON_POLICY, on), (CLIP_OFF_POLICY, off)):
        tokens = sum(x["train/tokens"] for x in part)
        if tokens > 0:
            clipped = sum(x["train/clip_fraction"] * x["train/tokens"] for x in part)
            out[key] = clipped / tokens
    return out


#: Episode metrics (:class:`gspo.training.episodes.MultiTurn`) that are shares of
#: something other than episodes, and the per-episode mean that counts it: the share of
#: valid tool calls is over the calls, the environment's share of tokens over the tokens.
#: (Left out where it has no denominator: a batch without calls logs no valid share.)
EPISODE_SHARES = {
    "env/tool_call_valid_fraction": "env/tool_calls_mean",
    "env/env_token_fraction": "env/episode_length_mean",
}


#: Per-episode counts a multi-turn rollout keeps beside its batch (``Generated.counts``),
#: row by row, so that the ``env/*`` figures can be those of any of its rows.
EPISODE_COUNTS = ("turns", "tool_calls", "tool_errors")


def env_metrics(
    counts: Mapping[str, Sequence[int]], completion_mask: torch.Tensor, action_mask: torch.Tensor
) -> dict[str, float]:
    """The ``env/*`` figures of a batch of episodes: ``counts`` (:data:`EPISODE_COUNTS`,
    one value per episode) and the batch's masks ``[N, T]`` (every token after the prompt;
    the model's own)."""
    episodes = len(counts["turns"])
    calls, errors = sum(counts["tool_calls"]), sum(counts["tool_errors"])
    tokens = int(completion_mask.sum())
    model_tokens = int(action_mask.sum())
    metrics = {
        "env/turns_mean": sum(counts["turns"]) / episodes,
        "env/tool_calls_mean": calls / episodes,
        "env/tool_errors_mean": errors / episodes,
        "env/env_token_fraction": (tokens - model_tokens) / tokens if tokens else 0.0,
        "env/episode_length_mean": tokens / episodes,
        "env/model_tokens_mean": model_tokens / episodes,
    }
    if calls:  # (none made: no share of them valid, not 1.0)
        metrics["env/tool_call_valid_fraction"] = (calls - errors) / calls
    return metrics


def episode_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The episode metrics of several parts of ``(episodes, metrics)`` as those of all
    their episodes together: each a mean weighted by the episodes, or for
    :data:`EPISODE_SHARES` by what the share is of, over the parts that hold it."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for _, metrics in parts for k in metrics):
        per = EPISODE_SHARES.get(key)
        pairs = [(m[key], n * (m[per] if per else 1.0)) for n, m in parts if key in m]
        total = math.fsum(w for _, w in pairs)
        if total > 0:
            out[key] = math.fsum(v * w for v, w in pairs) / total
    return out


def metric_reduction(
    key: str, level: str, correction: str = "none"
) -> tuple[Reduction, str | None]:
    """``(reduction, weight key)`` of a logged metric for :func:`combine_metrics`;
    ``level`` and ``correction`` are ``algorithm.level`` and ``algorithm.rollout_correction``."""
    if key in SUMMED:
        return "sum", None
    if key == "train/ratio_min":
        return "min", None
    if key == "correction/weight_min":
        return "min", None
    if key in (
        "train/ratio_max",
        "mismatch/token_abs_max",
        "correction/weight_max",
        "rollout/extra_rounds",
    ):
        return "max", None
    if key.startswith("time/"):
        return "max", None
    if key in TOKEN_WEIGHTED or (key == "train/ratio_mean" and level == "token"):
        return "mean", "train/tokens"
    if key in SEQUENCE_WEIGHTED or key == "train/ratio_mean":
        return "mean", "train/sequences"
    if key in ("mismatch/token_abs_mean", "mismatch/k3_kl", "correction/masked_token_fraction"):
        return "mean", "mismatch/tokens"
    if key == "correction/weight_mean":  # over tokens for the token modes, else responses
        token_mode = correction in ("token_tis", "token_mask")
        return "mean", "mismatch/tokens" if token_mode else "mismatch/sequences"
    if key in (
        "mismatch/sequence_mean_delta_abs_mean",
        "mismatch/log_ppl_gap",
        "correction/masked_sequence_fraction",
    ):
        return "mean", "mismatch/sequences"
    if key == "sft/loss":
        return "mean", "sft/tokens"
    if key.startswith("moe/expert_change_fraction"):  # (and its per-layer values)
        return "mean", "moe/churn_tokens"
    if key in EPISODE_SHARES:  # (every rank holds as many episodes)
        return "mean", EPISODE_SHARES[key]
    return "mean", None


def combine(
    dist: Distributed, level: str, metrics: dict[str, float], correction: str = "none"
) -> dict[str, float]:
    """This rank's metrics combined with every other rank's (the identity in one process)."""
    if not dist.enabled:
        return metrics
    gathered = dist.gather_objects(metrics)
    return combine_metrics(gathered, lambda key: metric_reduction(key, level, correction))


def logprob_mismatch(
    sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Training/inference mismatch between the sampler's and the trainer's log-probs.

    Token level: |delta log p| (mean, max) and the k3 estimate of KL(sampler || trainer)
    (token mean of ``exp(r) - r - 1``, ``r = trainer - sampler``, over the sampler's own
    tokens). Response level: |mean_t delta log p| and the log-perplexity gap
    ``mean_t(-trainer) - mean_t(-sampler)``, averaged over responses (positive: the trainer
    finds the responses less likely than the sampler did).
    """
    mask = mask.bool()
    delta = (trainer.float() - sampler.float()).detach()
    token_abs = delta.abs()[mask]
    if token_abs.numel() == 0:
        return {}
    sequence_delta = mean_over_tokens(delta, mask)[mask.any(-1)]
    kl = k3_kl(sampler.float().detach(), trainer.float().detach(), mask)[mask]
    return {
        "mismatch/k3_kl": kl.mean().item(),
        "mismatch/log_ppl_gap": -sequence_delta.mean().item(),
        "mismatch/token_abs_mean": token_abs.mean().item(),
        "mismatch/token_abs_max": token_abs.max().item(),
        "mismatch/sequence_mean_delta_abs_mean": sequence_delta.abs().mean().item(),
        "mismatch/tokens": float(token_abs.numel()),
        "mismatch/sequences": float(sequence_delta.numel()),
    }
