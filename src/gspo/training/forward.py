"""How a rollout batch's log-probs are computed for the ratio: plainly, or through MoE routing.

Two small strategies with one interface, chosen once at setup:

- :class:`PlainForward`: pi_old from the sampler or one no-grad recompute, pi_theta by the
  policy's forward.
- :class:`RoutedForward` (MoE models, when Routing Replay or the churn measurement is
  on): also records which experts pi_old chose for every minibatch, replays them in
  pi_theta's forward if asked, and keeps them for :class:`gspo.training.hooks.ExpertChurn`.
"""

from __future__ import annotations

import torch

from gspo.config import Config
from gspo.moe import capture_routing, replay_routing
from gspo.rollout import RolloutBatch
from gspo.training.policy import Policy
from gspo.training.setup import moe_settings


def build_forward(config: Config, policy: Policy) -> PlainForward | RoutedForward:
    """The run's strategy: routing under pi_old is recorded whenever Routing Replay or the
    churn measurement (``moe.*``) needs it."""
    replay, churn = moe_settings(config, policy.module)
    recompute = config.algorithm.old_logprobs == "recompute"
    if replay or churn:
        return RoutedForward(policy, recompute, replay, churn)
    return PlainForward(policy, recompute)


class PlainForward:
    def __init__(self, policy: Policy, recompute: bool):
        self.policy = policy
        self.recompute = recompute

    def old_logprobs(self, batch: RolloutBatch, minibatches: list[torch.Tensor]):
        """pi_old's log-probs ``[N, T]`` recomputed by the trainer, or ``None`` (sampler's)."""
        if not self.recompute:
            return None
        with torch.no_grad():
            return self.policy.logprobs(batch)

    def logprobs(self, mb: RolloutBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pi_theta's log-probs of minibatch ``k`` and its entropies (with gradient)."""
        return self.policy.logprobs(mb, with_entropy=True)


class RoutedForward:
    """Records each minibatch's routing under pi_old; replays it when ``replay``.

    ``old(k)``: experts of minibatch ``k`` under pi_old, ``[layers, tokens, k]``, laid out
    token for token like the training forward of ``batch.select(rows)``.
    """

    def __init__(self, policy: Policy, recompute: bool, replay: bool, measure_churn: bool):
        self.policy = policy
        self.recompute = recompute
        self.replay = replay
        self.measure_churn = measure_churn
        self._old: list[torch.Tensor | None] = []

    def old(self, k: int) -> torch.Tensor:
        routing = self._old[k]
        assert routing is not None, "minibatch routing is recorded by its forward"
        return routing

    def old_logprobs(self, batch: RolloutBatch, minibatches: list[torch.Tensor]):
        """Before the first update: each minibatch's routing under pi_old.

        The pass runs per minibatch, on the trimmed layout ``batch.select`` gives the
        training forward, so a recorded routing lines up token for token with the forward
        that replays it. With ``algorithm.old_logprobs=recompute`` this pass is the
        recompute (its log-probs are returned, ``[N, T]``, at no extra cost). In sampler
        mode it is an extra no-grad forward over minibatches 1.. (the price of measuring);
        minibatch 0's routing is recorded by its own training forward, which still runs
        under pi_old, so it is left to :meth:`logprobs`.
        """
        recomputed = torch.zeros_like(batch.sampler_logprobs) if self.recompute else None
        self._old = []
        with torch.no_grad():
            for k, rows in enumerate(minibatches):
                if k == 0 and not self.recompute:
                    self._old.append(None)
                    continue
                mb = batch.select(rows)
                with capture_routing(self.policy.module) as recorder:
                    lp = self.policy.logprobs(mb)
                self._old.append(recorder.experts)
                if recomputed is not None:
                    recomputed[rows, : lp.shape[1]] = lp
        return recomputed

    def logprobs(self, mb: RolloutBatch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pi_theta's log-probs of minibatch ``k`` and its entropies (with gradient).

        With routing replay the experts recorded under pi_old are forced. A minibatch
        whose old routing is not recorded yet (the first, in sampler mode) runs under
        pi_old's weights, so its routing is recorded here and is the same either way.
        """
        if self._old[k] is None:
            with capture_routing(self.policy.module) as recorder:
                out = self.policy.logprobs(mb, with_entropy=True)
            self._old[k] = recorder.experts
            return out
        if self.replay:
            with replay_routing(self.policy.module, self._old[k]):
                return self.policy.logprobs(mb, with_entropy=True)
        return self.policy.logprobs(mb, with_entropy=True)
