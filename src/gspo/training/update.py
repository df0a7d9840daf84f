"""The update stage: per minibatch, log-probs -> loss -> backward -> one optimizer step.

What it consumes is an :class:`Experience`: one rollout batch with everything the loss
needs besides pi_theta (pi_old, advantages, the tokens in the loss and their weights, the
KL reference's log-probs, MoE routing), computed before the first update by the rollout
stage (:mod:`gspo.training.rollout`); it hands out each update's :class:`Minibatch` itself
(:meth:`Experience.minibatch`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gspo.config import AlgorithmConfig
from gspo.config.algorithm import OptimConfig
from gspo.distributed import whole
from gspo.engines import RolloutBatch
from gspo.models import to_device
from gspo.objectives import PolicyLoss, policy_loss, read_scalars
from gspo.training.checkpoint import load_checkpoint
from gspo.training.metrics import timed
from gspo.training.policy import PlainForward, Policy, RoutedForward


@dataclass
class Minibatch:
    """Rows of an :class:`Experience`, trimmed to their own columns, as the loss takes them.

    ``k`` is the minibatch's index in its rollout batch (-1: other rows, such as the
    gradient-noise halves); ``batch`` the rows' :class:`RolloutBatch`; the tensors ``[n, T]``
    (``advantages`` ``[n]``) line up with its trimmed columns: pi_old's log-probs, the
    tokens in the loss and their weights (or None), and the KL reference's log-probs (or
    None when the KL is off). ``mask`` is None on a minibatch handed out before its
    experience was settled (:meth:`Experience.settle`): it is for the forward only.
    """

    k: int
    rows: torch.Tensor
    batch: RolloutBatch
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor | None
    weights: torch.Tensor | None
    ref_logprobs: torch.Tensor | None


@dataclass
class Experience:
    """One scored rollout batch (this rank's share), ready for the update stage.

    ``advantages`` ``[N]`` and ``old_logprobs`` ``[N, T]`` (pi_old, from the sampler or
    the trainer's recompute; ``recomputed`` says which) line up with ``batch``'s rows;
    ``loss_mask`` ``[N, T]`` and ``loss_weights`` ``[N, T]`` (or None) are the tokens the
    loss counts and their weights (:class:`gspo.training.rollout.LossMask`);
    ``minibatches`` are the row indices of each update; ``metrics`` describe the whole
    rollout batch over every rank. ``staleness`` (``rollout.max_staleness``) is how many
    rollout batches of updates the weights that sampled the batch lag the trained ones.

    The pass before the first update also puts on it ``ref_logprobs`` ``[N, T]`` (the KL
    reference's, or None) and ``routing``: per minibatch, the MoE experts pi_old chose
    (:class:`gspo.training.policy.RoutedForward`; None until recorded, empty when no
    routing is recorded). :meth:`minibatch` hands out each update's rows.

    ``unsettled``: when pi_old is recomputed, minibatch 0's is its own update's forward
    (at pi_old's weights), so that pass leaves its rows out and what needs all of pi_old
    (the loss mask, the mismatch metrics: ``unsettled(experience)``) waits for
    :meth:`settle`; until then ``loss_mask`` is None.
    """

    index: int
    batch: RolloutBatch
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    recomputed: bool
    minibatches: list[torch.Tensor]
    metrics: dict[str, float]
    loss_mask: torch.Tensor | None
    loss_weights: torch.Tensor | None = None
    staleness: int = 0  # rollout batches of updates between the sampling weights and these
    ref_logprobs: torch.Tensor | None = None
    routing: list[torch.Tensor | None] = field(default_factory=list)
    unsettled: Callable[[Experience], None] | None = None

    def settle(self, logprobs: torch.Tensor) -> Minibatch:
        """Minibatch 0's pi_old from its update's forward (``logprobs`` ``[n, T']``,
        detached), then what waited for all of pi_old; minibatch 0 again, now whole."""
        assert self.unsettled is not None, "settled once, by minibatch 0's forward"
        rows = to_device(self.minibatches[0], logprobs.device)
        self.old_logprobs[rows, : logprobs.shape[1]] = logprobs
        finish, self.unsettled = self.unsettled, None
        finish(self)
        return self.minibatch(0)

    @property
    def last_minibatch(self) -> int:
        return len(self.minibatches) - 1

    def minibatch(self, k: int) -> Minibatch:
        """The rows of update ``k``."""
        return self.view(self.minibatches[k], k)

    def view(self, rows: torch.Tensor, k: int = -1) -> Minibatch:
        """The given rows (in CPU memory), every per-token tensor cut to their trimmed
        columns; on CUDA without waiting for the device (indices copied to it from the host
        one tensor at a time waited for it once each)."""
        batch = self.batch.select(rows)
        width = batch.completion_ids.shape[1]
        on_device = to_device(rows, self.advantages.device)

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[on_device][:, :width]

        return Minibatch(
            k,
            rows,
            batch,
            cut(self.old_logprobs),
            self.advantages[on_device],
            cut(self.loss_mask),
            cut(self.loss_weights),
            cut(self.ref_logprobs),
        )


class Objective:
    """:func:`gspo.objectives.policy_loss` of one minibatch with the run's ``algorithm.*``."""

    def __init__(self, algorithm: AlgorithmConfig):
        self.algorithm = algorithm

    def loss(
        self, mb: Minibatch, logprobs: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> PolicyLoss:
        """``logprobs`` ``[n, T]`` pi_theta's (with gradient), ``entropy`` ``[n, T]`` its
        per-position entropy (with gradient, or None)."""
        cfg = self.algorithm
        return policy_loss(
            logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.mask,
            level=cfg.level,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            kl_coef=cfg.kl_coef,
            ref_logprobs=mb.ref_logprobs,
            weights=mb.weights,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
        )


class NonFiniteTraining(ValueError):
    """Too many updates in a row had a non-finite loss or gradient (a one-line error);
    ``step``: the RL step it stopped at (None: in the cold start)."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


@contextlib.contextmanager
def logged_if_stopped(lines: list[tuple[int, dict[str, float]]], logger: Any) -> Iterator[None]:
    """Around one minibatch's update of a rollout batch: where ``train.max_skipped`` stops
    the run there (:class:`NonFiniteTraining`), the batch's ``lines`` so far go to
    ``logger.log(step, line)`` (the run's ordered log) first: lines are logged at a batch's
    end, and its skipped steps before the stop were missing from metrics.jsonl."""
    try:
        yield
    except NonFiniteTraining:
        for step, line in lines:
            logger.log(step, line)
        raise


def step_if_finite(
    optimizer: torch.optim.Optimizer, norm: torch.Tensor, scaler: torch.amp.GradScaler | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimizer's step where the gradients (their clipped ``norm``) are finite, with
    no read: fused AdamW skips on the device (``found_inf``, as float16's scaler does).

    Returns two 0-dim tensors: 1 where the step was skipped, and 1 where it counts toward
    ``train.max_skipped`` (float16: not an overflow at a loss scale above 1, which the
    scale's halving remedies). A non-fused optimizer reads the norm."""
    bad = (~torch.isfinite(norm)).float()
    if scaler is not None:  # (it found the overflow in unscale_; the norm holds it)
        counted = bad * (scaler._get_scale_async() <= 1).float()
        scaler.step(optimizer)
        scaler.update()
        return bad, counted
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale, optimizer.found_inf = None, bad  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
    elif math.isfinite(norm.item()):
        optimizer.step()
    return bad, bad


def resumed_optim_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    optim: OptimConfig,
) -> None:
    """A resumed run's optimizer with the config's ``optim.*``: loading its state put back
    the learning rate, betas and weight decay it was saved with, so an override on
    ``--resume`` was recorded in config.yaml and ignored. The rate is the schedule's at the
    step reached (unchanged settings: the very values loaded)."""
    scheduler.base_lrs = [optim.lr] * len(optimizer.param_groups)
    for group, rate in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
        group["initial_lr"] = optim.lr
        group["lr"] = optim.lr * rate(scheduler.last_epoch)
        group["betas"] = tuple(optim.betas)
        group["weight_decay"] = optim.weight_decay


#: A checkpoint's skipped-update counts and float16 loss scale, where they are not the
#: defaults (:meth:`PolicyUpdate.checkpoint_files`).
UPDATE_STATE = "update_state.pt"


class PolicyUpdate:
    """One optimizer step from a loss; ``step`` counts RL's optimizer steps."""

    def __init__(
        self,
        policy: Policy,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        grad_clip: float,
        max_skipped: int = 3,
        scaler: torch.amp.GradScaler | None = None,
    ):
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip if grad_clip > 0 else float("inf")
        self.max_skipped = max_skipped
        self.scaler = scaler  # a float16 run's loss scaling (gspo.training.policy.loss_scaler)
        self.step = 0
        self.skipped = 0  # updates skipped for a non-finite loss or gradient, in all
        self.skipped_in_a_row = 0

    def checkpoint_files(self) -> dict[str, object]:
        """What a checkpoint needs to resume exactly beside the optimizer and schedule: the
        skipped-update counts (``train/skipped_steps``, ``train.max_skipped``'s) and a
        float16 run's loss scale; no file while they are the defaults (none skipped, no
        scaler)."""
        if not self.skipped and self.scaler is None:
            return {}
        scale = None if self.scaler is None else self.scaler.state_dict()
        counts = {"skipped": self.skipped, "skipped_in_a_row": self.skipped_in_a_row}
        return {UPDATE_STATE: {**counts, "loss_scale": scale}}

    def resume(self, checkpoint: Path, optim: OptimConfig) -> None:
        """The weights, optimizer, schedule and step from ``checkpoint``, the optimizer with
        ``optim``'s settings (:func:`resumed_optim_settings`), then the skipped-update
        counts and loss scale (the defaults where it has none)."""
        self.step = load_checkpoint(checkpoint, self.policy, self.optimizer, self.scheduler)
        resumed_optim_settings(self.optimizer, self.scheduler, optim)
        if not (checkpoint / UPDATE_STATE).is_file():
            return
        state = torch.load(checkpoint / UPDATE_STATE, weights_only=True)
        self.skipped, self.skipped_in_a_row = state["skipped"], state["skipped_in_a_row"]
        if self.scaler is not None and state["loss_scale"] is not None:
            self.scaler.load_state_dict(state["loss_scale"])

    def apply(self, out: PolicyLoss, router_loss: torch.Tensor | None = None) -> dict[str, float]:
        """Backward, clip and step on a minibatch's loss (this rank's share of it); its metrics.

        ``router_loss`` is a MoE model's weighted load-balancing loss (with gradient), added
        to the policy loss and logged as ``moe/router_aux_loss`` (weighted: ``train/loss`` is
        the sum). The backward is scaled so that N ranks holding a share each take the step
        one process with the whole minibatch would (the router loss, over each rank's
        tokens, is averaged over ranks, whatever their counted responses). Metrics are
        this rank's (see :func:`gspo.training.metrics.combine`) but the gradient norm,
        which is global.

        Everything the step logs is read from the device once, after the backward and the
        clip were queued: the one wait of a minibatch on CUDA (whether the step is finite
        decides whether it is taken). Reading the loss's metrics before the backward made
        the host wait for the forward before queueing any of the backward.

        With a ``scaler`` (float16) the gradients are unscaled before the clip, the scale
        used is logged (``train/loss_scale``), and a step whose gradients overflowed at a
        scale above 1 is skipped (in ``train/skipped_steps``) without counting toward
        ``train.max_skipped``: lowering the scale is the scaler's remedy.
        """
        total = out.loss if router_loss is None else out.loss + router_loss
        scaler = self.scaler
        self.policy.backward(out.loss, out.values["sequences"], own=router_loss, scaler=scaler)
        if scaler is not None:
            scaler.unscale_(self.optimizer)  # the clip and the logged norm: the true gradient
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.grad_clip)
        own = {"train/loss": total, "train/grad_norm": whole(grad_norm)}  # the norm: global
        if router_loss is not None:
            own["moe/router_aux_loss"] = router_loss
        if scaler is not None:
            own["train/loss_scale"] = scaler._get_scale_async()  # (read with the rest)
        read = read_scalars({**{f"train/{k}": v for k, v in out.values.items()}, **own})
        loss, norm = read["train/loss"], read["train/grad_norm"]
        finite = math.isfinite(loss) and math.isfinite(norm)
        # (from what every rank shares, the scale: a rank's own loss would part the counts)
        overflow = scaler is not None and read["train/loss_scale"] > 1
        # the rate this step takes (the scheduler then moves on; its get_last_lr() is the
        # rate loaded with a resumed run's state, where optim.lr was changed on --resume)
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.optimizer.step()
            self.skipped_in_a_row = 0
        else:  # the weights stay as they were; the schedule moves on
            self.skipped += 1
            self.skipped_in_a_row += not overflow
        if scaler is not None:
            scaler.update()  # (from the overflow check unscale_ made: halved if it found one)
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
                f"checkpoints hold only finite weights",
                step=self.step,
            )
        line = {k: v for k, v in read.items() if k != "moe/router_aux_loss"}
        line["train/lr"] = lr
        line["train/skipped_steps"] = float(self.skipped)
        if router_loss is not None:
            line["moe/router_aux_loss"] = read["moe/router_aux_loss"]
        return line


class Hook:
    """An optional instrument attached to the update stage (see :mod:`gspo.training.hooks`).

    ``before_update`` runs at the weights minibatch ``k`` will see, before its forward
    (for ``k = 0`` under a recomputed pi_old the experience is not settled yet:
    ``experience.unsettled`` is set, minibatch 0's pi_old, the loss mask and the mismatch
    metrics come with its forward);
    ``after_update`` after its optimizer step, with pi_theta's log-probs before the step
    (the ratio's numerator, detached) and the update's log line (this rank's); it returns
    metrics for that line.
    """

    def before_update(self, experience: Experience, k: int) -> None:
        return None

    def after_update(
        self,
        experience: Experience,
        mb: Minibatch,
        logprobs: torch.Tensor,
        metrics: dict[str, float],
    ) -> dict[str, float]:
        return {}


class UpdateStage:
    """``stage.train(experience, k) -> metrics``: minibatch ``k``'s forward, loss, step, hooks."""

    def __init__(
        self,
        forward: PlainForward | RoutedForward,
        objective: Objective,
        update: PolicyUpdate,
        hooks: Sequence[Hook] = (),
    ):
        self.forward = forward
        self.objective = objective
        self.update = update
        self.hooks = list(hooks)

    def train(self, experience: Experience, k: int) -> dict[str, float]:
        self.update.policy.train()
        for hook in self.hooks:
            hook.before_update(experience, k)
        took: dict[str, float] = {}
        with timed(took, "time/train"):
            mb = experience.minibatch(k)
            try:  # (a replayed routing lasts through the backward: RoutedForward.release)
                with self.update.policy.same_dropout(k):  # pi_old's recompute's masks
                    logprobs, entropy, router_loss = self.forward.logprobs(
                        mb.batch, k, experience.routing
                    )
                if experience.unsettled is not None:  # minibatch 0: this forward is pi_old's too
                    mb = experience.settle(logprobs.detach())
                line = self.update.apply(self.objective.loss(mb, logprobs, entropy), router_loss)
            finally:
                self.forward.release()
        line["train/minibatch"] = k
        line["train/rollout"] = experience.index
        line.update(took)
        logprobs, metrics = logprobs.detach(), dict(line)
        for hook in self.hooks:
            line.update(hook.after_update(experience, mb, logprobs, metrics))
        return line
