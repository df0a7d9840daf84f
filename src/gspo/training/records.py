"""The records one rollout batch becomes on its way to the update: :class:`Scored`
(sampled and scored), :class:`Sampled` (with its prompt rows and sampling metrics),
:class:`Experience` (advantages, pi_old, the loss mask, the KL reference's log-probs and
MoE routing: ready to update), which hands out each update's :class:`Minibatch`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gspo.engines import RolloutBatch


@dataclass
class Scored:
    """A rollout batch with its decoded completions and rewards.

    ``scorable`` ``[N]`` bool: False where every reward function returned None (the
    completion's reward, 0, is then no evidence: it stays out of its group's baseline and
    gets advantage 0, as in TRL); None when every completion was scored.
    """

    batch: RolloutBatch
    completions: list[Any]
    rewards: torch.Tensor  # [N] float32
    per_function: dict[str, list[float | None]]
    scorable: torch.Tensor | None = None


@dataclass
class Sampled:
    """A rollout batch sampled and scored, before anything that needs the trainer.

    ``picked`` are its prompt rows, ``metrics`` this rank's own (times, dynamic sampling).
    ``old_logprobs`` ``[N, T]``: pi_old recomputed by whoever held the weights that sampled
    the batch (an async producer, :mod:`gspo.training.async_rollout`); None = the trainer
    computes pi_old itself (``algorithm.old_logprobs``).
    """

    index: int
    picked: list[int]
    scored: Scored
    metrics: dict[str, float]
    old_logprobs: torch.Tensor | None = None


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
    loss counts and their weights (:class:`gspo.training.loss_mask.LossMask`);
    ``minibatches`` are the row indices of each update; ``metrics`` describe the whole
    rollout batch over every rank. ``staleness`` (``rollout.max_staleness``) is how many
    rollout batches of updates the weights that sampled the batch lag the trained ones.

    The pass before the first update also puts on it ``ref_logprobs`` ``[N, T]`` (the KL
    reference's, or None) and ``routing``: per minibatch, the MoE experts pi_old chose
    (:class:`gspo.training.forward.RoutedForward`; None until recorded, empty when no
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
        rows = self.minibatches[0]
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
        """The given rows, every per-token tensor cut to their trimmed columns."""
        batch = self.batch.select(rows)
        width = batch.completion_ids.shape[1]

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows][:, :width]

        return Minibatch(
            k,
            rows,
            batch,
            cut(self.old_logprobs),
            self.advantages[rows],
            cut(self.loss_mask),
            cut(self.loss_weights),
            cut(self.ref_logprobs),
        )
