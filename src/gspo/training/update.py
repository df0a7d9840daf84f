"""The update stage: per minibatch, log-probs -> ``policy_loss`` -> one optimizer step."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gspo.config import AlgorithmConfig
from gspo.distributed import as_float
from gspo.engines import RolloutBatch
from gspo.objectives import PolicyLoss, policy_loss
from gspo.training.experience import Experience
from gspo.training.forward import PlainForward, RoutedForward
from gspo.training.policy import Policy
from gspo.training.reference import Reference


class Objective:
    """:func:`gspo.objectives.policy_loss` with the run's ``algorithm.*`` settings."""

    def __init__(self, algorithm: AlgorithmConfig):
        self.algorithm = algorithm

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
    ) -> PolicyLoss:
        cfg = self.algorithm
        return policy_loss(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            level=cfg.level,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            kl_coef=cfg.kl_coef,
            ref_logprobs=ref_logprobs,
            weights=weights,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
        )


class NonFiniteTraining(ValueError):
    """Too many updates in a row had a non-finite loss or gradient (a one-line error)."""


class PolicyUpdate:
    """One optimizer step on a minibatch; ``step`` counts RL's optimizer steps."""

    def __init__(
        self,
        policy: Policy,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        objective: Objective,
        reference: Reference,
        grad_clip: float,
        max_skipped: int = 3,
    ):
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.objective = objective
        self.reference = reference
        self.grad_clip = grad_clip if grad_clip > 0 else float("inf")
        self.max_skipped = max_skipped
        self.step = 0
        self.skipped = 0  # updates skipped for a non-finite loss or gradient, in all
        self.skipped_in_a_row = 0

    def __call__(
        self,
        mb: RolloutBatch,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        entropy: torch.Tensor | None = None,
        router_loss: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step on minibatch ``mb`` (this rank's share of it); its metrics.

        ``logprobs`` ``[n, T]`` under pi_theta (with gradient), ``old_logprobs`` ``[n, T]``,
        ``advantages`` ``[n]``; ``mask``/``weights`` ``[n, T]`` the tokens in the loss and
        their weights (default: every completion token, weight 1); ``entropy`` ``[n, T]``
        pi_theta's per-position entropy (with gradient); ``router_loss`` a MoE model's
        weighted load-balancing loss (with gradient), added to the policy loss and logged as
        ``moe/router_aux_loss`` (weighted: ``train/loss`` is the sum). The backward is scaled
        so that N ranks holding a share each take the step one process with the whole
        minibatch would. Metrics are this rank's (see :func:`gspo.training.metrics.combine`)
        but the gradient norm, which is global.
        """
        mask = mb.action_mask if mask is None else mask
        ref = self.reference.logprobs(mb)
        out = self.objective(logprobs, old_logprobs, advantages, mask, ref, weights, entropy)
        total = out.loss if router_loss is None else out.loss + router_loss
        self.policy.backward(total, out.metrics["sequences"])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
        loss, norm = total.item(), as_float(grad_norm)  # the norm is global under FSDP
        finite = math.isfinite(loss) and math.isfinite(norm)
        if finite:
            self.optimizer.step()
            self.skipped_in_a_row = 0
        else:  # the weights stay as they were; the schedule moves on
            self.skipped += 1
            self.skipped_in_a_row += 1
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        if finite:
            self.policy.stepped()
        elif self.skipped_in_a_row >= self.max_skipped:
            raise NonFiniteTraining(
                f"train.max_skipped={self.max_skipped}: {self.skipped_in_a_row} updates in a "
                f"row had a non-finite loss or gradient (loss {loss}, grad norm {norm}, "
                f"step {self.step}); stopping. Lower optim.lr or check the rewards; the "
                f"checkpoints hold only finite weights"
            )
        line = {f"train/{key}": value for key, value in out.metrics.items()}
        line["train/loss"] = loss
        line["train/grad_norm"] = norm
        line["train/lr"] = self.scheduler.get_last_lr()[0]
        line["train/skipped_steps"] = float(self.skipped)
        if router_loss is not None:
            line["moe/router_aux_loss"] = router_loss.item()
        return line


@dataclass
class Minibatch:
    """A minibatch just trained on, as the hooks see it after its optimizer step.

    ``logprobs`` are pi_theta's before the step (the ratio's numerator, detached),
    ``old_logprobs`` pi_old's, both ``[n, T]`` over ``batch``'s trimmed columns;
    ``metrics`` the update's log line (this rank's).
    """

    k: int
    batch: RolloutBatch
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    metrics: dict[str, float]


class Hook:
    """An optional instrument attached to the update stage (see :mod:`gspo.training.hooks`).

    ``before_update`` runs at the weights minibatch ``k`` will see, before its forward;
    ``after_update`` after its optimizer step, and returns metrics for its log line.
    """

    def before_update(self, experience: Experience, k: int) -> None:
        return None

    def after_update(self, experience: Experience, minibatch: Minibatch) -> dict[str, float]:
        return {}


class UpdateStage:
    """``stage(experience, k) -> metrics``: minibatch ``k``'s forward, step and hooks."""

    def __init__(
        self,
        forward: PlainForward | RoutedForward,
        update: PolicyUpdate,
        hooks: Sequence[Hook] = (),
    ):
        self.forward = forward
        self.update = update
        self.hooks = list(hooks)

    def __call__(self, experience: Experience, k: int) -> dict[str, float]:
        self.update.policy.train()
        for hook in self.hooks:
            hook.before_update(experience, k)
        start = time.perf_counter()
        rows = experience.minibatches[k]
        mb = experience.batch.select(rows)
        logprobs, entropy = self.forward.logprobs(mb, k)
        width = logprobs.shape[1]
        old_logprobs = experience.old_logprobs[rows][:, :width]
        mask = experience.loss_mask[rows][:, :width]
        weights = experience.loss_weights
        weights = None if weights is None else weights[rows][:, :width]
        advantages = experience.advantages[rows]
        line = self.update(
            mb, logprobs, old_logprobs, advantages, mask, weights, entropy,
            self.forward.router_loss(),
        )  # fmt: skip
        line["train/minibatch"] = k
        line["train/rollout"] = experience.index
        line["time/train"] = time.perf_counter() - start
        done = Minibatch(k, mb, logprobs.detach(), old_logprobs, dict(line))
        for hook in self.hooks:
            line.update(hook.after_update(experience, done))
        return line
