"""Which tokens of a rollout batch the loss counts, and with what weight.

:class:`LossMask` is applied once per rollout batch, after pi_old's log-probs are known:

- ``algorithm.rollout_correction`` (:func:`gspo.objectives.rollout_correction`): the
  trainer's pi_old against the sampler's log-probs, as weights ``c_{i,t}`` and dropped
  tokens or responses (``docs/algorithm.md``, "Rollout correction");
- ``algorithm.mask_truncated``: responses cut off by ``rollout.max_new_tokens`` leave the
  loss (DAPO's overlong filtering).

It starts from the rollout's ``action_mask`` (the tokens the model sampled; in a
multi-turn episode the environment's tokens are left out). The update stage hands the
result to :func:`gspo.objectives.policy_loss` as its ``mask`` and ``weights``; the
rollout's own ``completion_mask`` (what the forward computes) is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gspo.config import AlgorithmConfig
from gspo.engines import RolloutBatch
from gspo.objectives import rollout_correction


@dataclass
class LossTokens:
    """``mask`` ``[N, T]`` bool: the tokens in the loss; ``weights`` ``[N, T]`` or None."""

    mask: torch.Tensor
    weights: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class LossMask:
    """``loss_mask.tokens(batch, old_logprobs) -> LossTokens`` for the run's ``algorithm.*``."""

    def __init__(self, algorithm: AlgorithmConfig):
        self.correction = algorithm.rollout_correction
        self.low = algorithm.correction_min
        self.high = algorithm.correction_max
        self.mask_truncated = algorithm.mask_truncated

    def tokens(self, batch: RolloutBatch, old_logprobs: torch.Tensor) -> LossTokens:
        mask = batch.action_mask.bool()  # the model's own tokens: never environment tokens
        out = LossTokens(mask)
        if self.mask_truncated:
            cut = torch.tensor([r == "length" for r in batch.finish_reasons], device=mask.device)
            out.mask = mask & ~cut.unsqueeze(-1)
            out.metrics["train/masked_truncated_fraction"] = cut.float().mean().item()
        if self.correction != "none":
            corr = rollout_correction(
                old_logprobs, batch.sampler_logprobs, mask, self.correction,
                low=self.low, high=self.high,
            )  # fmt: skip
            out.mask = out.mask & corr.keep
            out.weights = corr.weights
            out.metrics.update({f"correction/{k}": v for k, v in corr.metrics.items()})
        return out
