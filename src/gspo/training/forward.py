"""How a rollout batch's log-probs are computed for the ratio: plainly, or through MoE routing.

Two small strategies with one interface, chosen once at setup:

- :class:`PlainForward`: pi_old from the sampler or one no-grad recompute, pi_theta by the
  policy's forward.
- :class:`RoutedForward` (MoE models, when Routing Replay, the churn measurement or the
  router aux loss is on): also records which experts pi_old chose for every minibatch,
  replays them in pi_theta's forward if asked, keeps them for
  :class:`gspo.training.hooks.ExpertChurn`, and computes the routers' load-balancing loss
  of pi_theta's forward when ``moe.router_aux_loss_coef > 0``.

Both have ``old_logprobs(batch, minibatches)``, the pass before the first update: pi_old
recomputed (or None: the sampler's) and the routing recorded per minibatch (kept on the
:class:`~gspo.training.records.Experience`); with ``first_from_update`` (set at setup
whenever pi_old is recomputed, unless a ratio dump needs all of pi_old before the only
minibatch's forward) minibatch 0 is left out of that pass: its update's own forward runs
at pi_old's weights, so its log-probs, detached, are pi_old's (and its routing pi_old's
routing) without a forward of their own (:meth:`gspo.training.records.Experience.settle`);
and ``logprobs(experience, mb)``: pi_theta's
log-probs and entropies of one minibatch with, for a MoE model with
``moe.router_aux_loss_coef > 0``, the routers' weighted load-balancing loss (else None),
which the update stage adds to the policy loss.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from gspo.config import Config
from gspo.engines import RolloutBatch
from gspo.models import WithEntropy
from gspo.moe import (
    capture_router_logits,
    capture_routing,
    find_routers,
    load_balancing_loss,
    replay_routing,
    response_token_mask,
)
from gspo.training.policy import Policy
from gspo.training.setup import moe_settings

if TYPE_CHECKING:
    from gspo.training.records import Experience, Minibatch

#: pi_theta's log-probs and entropies ``[n, T]`` (with gradient) and the router loss, or None
ForwardOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def recomputes_old_logprobs(config: Config, compute_dtype: torch.dtype) -> bool:
    """Whether the trainer recomputes pi_old (``algorithm.old_logprobs``), ``auto`` resolved.

    ``auto`` takes the sampler's log-probs only where they are pi_old to float rounding:
    a float32 forward with nothing to correct. In bf16 (or float16) the sampler's and
    the trainer's log-probs differ by more than GSPO's clip range on a sequence's mean
    even with the float32 head (docs/precision.md), so the on-policy minibatch would
    clip; vLLM with ``top_p < 1`` reports the truncated distribution's log-probs, and
    vLLM does not round the head's weight to bf16 (``model.head_precision=bf16_weight``:
    the trainer's head alone does, and the on-policy minibatch clipped in float32). With
    LoRA dropout the sampler keeps every input and the update drops some: the recompute
    drops the update's own (:meth:`Policy.same_dropout`).
    """
    algorithm, source = config.algorithm, config.algorithm.old_logprobs
    if source != "auto":
        return source == "recompute"
    vllm = config.rollout.engine == "vllm"
    other_head = vllm and config.model.head_precision == "bf16_weight"
    truncated = vllm and config.rollout.top_p < 1.0
    # (an async producer recomputes without dropout: the sampler's own log-probs again)
    lora = config.model.lora
    dropout = lora.r > 0 and lora.dropout > 0 and config.rollout.max_staleness == 0
    return (
        compute_dtype != torch.float32
        or algorithm.rollout_correction != "none"
        or truncated
        or other_head
        or dropout
    )


def build_forward(config: Config, policy: Policy) -> PlainForward | RoutedForward:
    """The run's strategy: routing under pi_old is recorded whenever Routing Replay or the
    churn measurement (``moe.*``) needs it."""
    replay, churn = moe_settings(config, policy.module)
    recompute = recomputes_old_logprobs(config, policy.compute_dtype)
    # the gradient-noise dump reads all of pi_old before the last minibatch's forward: with
    # one minibatch that forward is minibatch 0's, so its pi_old is recomputed beforehand
    dump_first = config.log.ratio_dump_every > 0 and config.algorithm.minibatches == 1
    first_from_update = recompute and not dump_first
    # the entropy enters the loss only as a bonus; else it is a metric (no graph)
    entropy: WithEntropy = True if config.algorithm.entropy_coef != 0 else "metric"
    aux = config.moe.router_aux_loss_coef
    if replay or churn or aux > 0:
        return RoutedForward(policy, recompute, replay, churn, aux, first_from_update, entropy)
    return PlainForward(policy, recompute, first_from_update, entropy)


def per_minibatch(
    logprobs: Callable[[RolloutBatch], torch.Tensor],
    batch: RolloutBatch,
    minibatches: list[torch.Tensor],
    *,
    first: bool = True,
    before: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """``logprobs`` of each minibatch ``[N, T]``, one no-grad forward per minibatch on the
    layout ``batch.select`` gives the training forward: the same sums in the same order as
    the update's own forward of those rows. Without ``first`` minibatch 0's rows are left
    at 0; ``before(k)`` runs before minibatch ``k``'s forward."""
    out = torch.zeros_like(batch.sampler_logprobs)
    with torch.no_grad():
        for k, rows in enumerate(minibatches):
            if k == 0 and not first:
                continue
            if before is not None:
                before(k)
            lp = logprobs(batch.select(rows))
            out[rows, : lp.shape[1]] = lp
    return out


def recompute_per_minibatch(
    policy: Policy, batch: RolloutBatch, minibatches: list[torch.Tensor], first: bool = True
) -> torch.Tensor:
    """pi_old's log-probs ``[N, T]`` by :func:`per_minibatch` (one forward over the whole
    batch packs rows differently, and under bf16 that moved a short response's mean
    log-ratio past GSPO's 3e-4 clip on the on-policy step), each minibatch under the
    dropout masks of its update's forward; without ``first`` minibatch 0's rows are left
    at 0, for its update's forward to fill."""
    return per_minibatch(
        policy.logprobs, batch, minibatches, first=first, before=policy.same_dropout
    )


class PlainForward:
    def __init__(
        self,
        policy: Policy,
        recompute: bool,
        first_from_update: bool = False,
        entropy: WithEntropy = True,
    ):
        self.policy = policy
        self.recompute = recompute
        self.first_from_update = first_from_update  # (build_forward: only with recompute)
        self.entropy = entropy  # pi_theta's entropies: with a gradient, or as a metric

    def old_logprobs(
        self, batch: RolloutBatch, minibatches: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """pi_old's log-probs ``[N, T]`` recomputed by the trainer (minibatch 0's rows left
        to its update with ``first_from_update``), or ``None`` (the sampler's); no routing."""
        if not self.recompute:
            return None, []
        first = not self.first_from_update
        return recompute_per_minibatch(self.policy, batch, minibatches, first), []

    def logprobs(self, experience: Experience, mb: Minibatch) -> ForwardOut:
        """pi_theta's log-probs of minibatch ``mb`` and its entropies (with gradient)."""
        logprobs, entropy = self.policy.logprobs(mb.batch, with_entropy=self.entropy)
        return logprobs, entropy, None


class RoutedForward:
    """Records each minibatch's routing under pi_old; replays it when ``replay``.

    The routing of minibatch ``k`` under pi_old (``experience.routing[k]``) is the experts
    ``[layers, tokens, k]``, laid out token for token like the training forward of
    ``batch.select(rows)``.
    """

    def __init__(
        self,
        policy: Policy,
        recompute: bool,
        replay: bool,
        measure_churn: bool,
        aux_coef: float = 0.0,
        first_from_update: bool = False,
        entropy: WithEntropy = True,
    ):
        self.policy = policy
        self.recompute = recompute
        self.replay = replay
        self.measure_churn = measure_churn
        self.aux_coef = aux_coef
        self.first_from_update = first_from_update  # (build_forward: only with recompute)
        self.entropy = entropy  # pi_theta's entropies: with a gradient, or as a metric

    def old_logprobs(
        self, batch: RolloutBatch, minibatches: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Before the first update: each minibatch's routing under pi_old.

        The pass runs per minibatch, on the trimmed layout ``batch.select`` gives the
        training forward, so a recorded routing lines up token for token with the forward
        that replays it. With ``algorithm.old_logprobs=recompute`` this pass is the
        recompute (its log-probs are returned, ``[N, T]``, at no extra cost). In sampler
        mode it is an extra no-grad forward over minibatches 1.. (the price of measuring);
        minibatch 0's routing is recorded by its own training forward, which still runs
        under pi_old, so it is left to :meth:`logprobs` (None in its place), and so are
        its log-probs with ``first_from_update``.
        """
        routing: list[torch.Tensor | None] = []
        first = not self.first_from_update
        if not (self.replay or self.measure_churn):  # the aux loss alone needs no old routing
            if not self.recompute:
                return None, routing
            return recompute_per_minibatch(self.policy, batch, minibatches, first), routing
        recomputed = torch.zeros_like(batch.sampler_logprobs) if self.recompute else None
        with torch.no_grad():
            for k, rows in enumerate(minibatches):
                if k == 0 and not (self.recompute and first):
                    routing.append(None)
                    continue
                mb = batch.select(rows)
                self.policy.same_dropout(k)
                with capture_routing(self.policy.module) as recorder:
                    lp = self.policy.logprobs(mb)
                routing.append(recorder.experts)
                if recomputed is not None:
                    recomputed[rows, : lp.shape[1]] = lp
        return recomputed, routing

    def logprobs(self, experience: Experience, mb: Minibatch) -> ForwardOut:
        """pi_theta's log-probs of minibatch ``k`` and its entropies (with gradient).

        With routing replay the experts recorded under pi_old are forced. A minibatch
        whose old routing is not recorded yet (the first, in sampler mode) runs under
        pi_old's weights, so its routing is recorded here (on ``experience``) and is the
        same either way. The router loss is that of this forward, with gradient.
        """
        routing, k, batch = experience.routing, mb.k, mb.batch
        with contextlib.ExitStack() as stack:
            logits = None
            if self.aux_coef > 0:
                logits = stack.enter_context(capture_router_logits(self.policy.module))
            if not (self.replay or self.measure_churn):
                # aux loss only; pi_old may also come from elsewhere (the async producer)
                out = self.policy.logprobs(batch, with_entropy=self.entropy)
            elif routing[k] is None:
                recorder = stack.enter_context(capture_routing(self.policy.module))
                out = self.policy.logprobs(batch, with_entropy=self.entropy)
                routing[k] = recorder.experts
            elif self.replay:
                stack.enter_context(replay_routing(self.policy.module, routing[k]))
                out = self.policy.logprobs(batch, with_entropy=self.entropy)
            else:
                out = self.policy.logprobs(batch, with_entropy=self.entropy)
        aux = None if logits is None else self.aux_coef * self._load_balancing(batch, logits)
        return out[0], out[1], aux

    def _load_balancing(self, mb: RolloutBatch, logits: list[list[torch.Tensor]]) -> torch.Tensor:
        """The load-balancing loss of one forward's router logits, over the response tokens."""
        module = self.policy.module
        response = response_token_mask(
            module,
            lambda p, c: self.policy.logprobs(replace(mb, prompt_ids=p, completion_ids=c)),
            mb.prompt_ids,
            mb.prompt_mask,
            mb.completion_mask,
        )
        top_k = find_routers(module)[0].top_k
        return load_balancing_loss([calls[0] for calls in logits], top_k, response)
