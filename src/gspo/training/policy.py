"""The weights being trained, behind one handle (:class:`Policy`), and how a rollout
batch's log-probs are computed from them for the ratio: two small strategies with one
interface, chosen once at setup (:func:`build_forward`):

- :class:`PlainForward`: pi_old from the sampler or one no-grad recompute, pi_theta by the
  policy's forward.
- :class:`RoutedForward` (MoE models, when Routing Replay, the churn measurement or the
  router aux loss is on): also records which experts pi_old chose for every minibatch,
  replays them in pi_theta's forward if asked, keeps them for
  :class:`gspo.training.hooks.ExpertChurn`, and computes the routers' load-balancing loss
  of pi_theta's forward when ``moe.router_aux_loss_coef > 0``.

Both have ``old_logprobs(batch, minibatches)``, the pass before the first update: pi_old
recomputed (or None: the sampler's) and the routing recorded per minibatch (kept on the
:class:`~gspo.training.update.Experience`); with ``first_from_update`` (set at setup
whenever pi_old is recomputed, unless a ratio dump needs all of pi_old before the only
minibatch's forward) minibatch 0 is left out of that pass: its update's own forward runs
at pi_old's weights, so its log-probs, detached, are pi_old's (and its routing pi_old's
routing) without a forward of their own (:meth:`gspo.training.update.Experience.settle`);
and ``logprobs(batch, k, routing)``: pi_theta's log-probs and entropies of minibatch ``k``
with, for a MoE model with ``moe.router_aux_loss_coef > 0``, the routers' weighted
load-balancing loss (else None), which the update stage adds to the policy loss.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from dataclasses import replace

import torch

from gspo.config import Config
from gspo.distributed import Distributed, full_state_dict, shard_policy
from gspo.engines import RolloutBatch
from gspo.models import CompletionLogprobs, WithEntropy, to_device
from gspo.moe import (
    NO_SOFTMAX_BALANCE,
    SCORED_ROUTERS,
    capture_router_logits,
    capture_routing,
    find_routers,
    is_moe,
    load_balancing_loss,
    replay_routing,
    response_token_mask,
)
from gspo.training.lora import is_lora
from gspo.training.seeds import derive_seed, seeded_global_draws


class Policy:
    """The trained model as the loop sees it: forward, backward, version, whole weights.

    ``module`` is the HF causal LM; ``forward`` (:class:`CompletionLogprobs` over it) is
    the training forward and, under torchrun, FSDP2's root unit. :meth:`replica` gives the
    whole weights as a plain HF module: the module itself in one process, a copy refreshed
    from the shards under FSDP. Rollout engines sample from it and checkpoints export it.
    ``version`` counts optimizer steps (SFT and RL) so that whoever holds a copy of the
    weights knows when it is stale.

    With LoRA (``adapters``) ``module`` is a PEFT model: only the adapters train, the
    replica under FSDP is refreshed from the gathered adapters alone, :meth:`base` is the
    same module with its adapters off (the KL reference); engines that take plain weights
    get the replica with its adapters merged into a copy
    (:func:`gspo.training.sampler.push_weights`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        dist: Distributed,
        *,
        compute_dtype: torch.dtype,
        temperature: float,
    ):
        self.module = module
        self.forward = CompletionLogprobs(module)
        self.dist = dist
        self.compute_dtype = compute_dtype
        self.device = next(module.parameters()).device
        self.temperature = temperature
        self.adapters = is_lora(module)
        self._replica = module
        if dist.enabled:
            self._replica = copy.deepcopy(module).requires_grad_(False)
            shard_policy(self.forward, module, dist.world_size)
        self.version = 0
        self._replica_version = 0
        #: the current rollout batch's dropout seed (LoRA dropout), None = no dropout
        self.dropout_seed: int | None = None

    def parameters(self):
        return self.forward.parameters()

    def train(self) -> None:
        self.forward.train()

    def same_dropout(self, k: int) -> contextlib.AbstractContextManager[None]:
        """Around a forward of minibatch ``k``: torch's global generator, which PEFT's
        dropout draws from, seeded for that minibatch, so pi_old's recompute and the
        update's forward of one minibatch drop the same inputs and the ratio is 1 on the
        same weights; its state before is given back after the block (the run reseeds no
        generator a user's code or the model's other draws read). A no-op while
        ``dropout_seed`` is None."""
        if self.dropout_seed is None:
            return contextlib.nullcontext()
        return seeded_global_draws(derive_seed(self.dropout_seed, k), self.device)

    def stepped(self) -> None:
        """Record that an optimizer step (or a checkpoint load) changed the weights."""
        self.version += 1

    def base(self):
        """Context in which the forward runs the frozen base: the adapters switched off.

        Only for a LoRA policy; under FSDP every rank enters it at the same point.
        """
        if not self.adapters:
            raise ValueError("Policy.base: the policy has no adapters (model.lora.r=0)")
        return self.module.disable_adapter()

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def logprobs(
        self,
        batch: RolloutBatch,
        module: torch.nn.Module | None = None,
        *,
        with_entropy: WithEntropy = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Completion log-probs ``[N, T]`` of ``batch`` under ``module`` (the policy by default).

        ``with_entropy``: ``(log-probs, entropy)``, the entropy of each completion position's
        next-token distribution from the same chunked pass (no full logits tensor).
        The responses of a group share their prompt, which is computed once for them
        (``share_prompts``, see :func:`gspo.models.packed_completion_logprobs`).
        """
        forward = self.forward if module is None else CompletionLogprobs(module)
        with self.autocast():
            return forward(
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                temperature=self.temperature,
                share_prompts="auto",
                with_entropy=with_entropy,
                on_host=batch.on_host(),
            )

    def backward(
        self,
        loss: torch.Tensor,
        local_count: float | torch.Tensor,
        own: torch.Tensor | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """``loss.backward()`` for a mean over ``local_count`` items of this rank's share.

        Under torchrun the loss is scaled (:meth:`Distributed.mean_scale`) so that FSDP's
        average over ranks is the gradient of the mean over the whole global batch.
        ``own``: a loss each rank computes over its whole share whatever was counted (a
        MoE model's load balancing), added unscaled: FSDP averages it over ranks.
        ``scaler``: a float16 run's (:func:`loss_scaler`), which scales the sum up first.
        """
        if self.dist.enabled:
            scale = self.dist.mean_scale(local_count)  # (a float64 tensor: in the loss's dtype)
            loss = loss * scale.to(loss.dtype)
        total = loss if own is None else loss + own
        (total if scaler is None else scaler.scale(total)).backward()

    def replica(self) -> torch.nn.Module:
        """The whole weights as a plain HF module, brought up to the current version.

        A collective under torchrun (gathered from the shards): every rank calls it at the
        same point of the loop.
        """
        if self._replica_version != self.version:
            if self._replica is not self.module:
                # a LoRA run gathers the adapters only: the frozen base never changes
                state = full_state_dict(self.module, self.dist, trainable_only=self.adapters)
                self._replica.load_state_dict(state, strict=not self.adapters)
            self._replica_version = self.version
        return self._replica


def loss_scaler(policy: Policy) -> torch.amp.GradScaler | None:
    """A float16 run's loss scaling (``model.dtype=float16``), None otherwise (bfloat16's
    and float32's range hold the gradients): the loss is scaled up before the backward, so
    that gradients below float16's smallest (~6e-8) do not become 0, and the gradients
    down before the clip; a step whose gradients overflowed is skipped and the scale
    halved (doubled after 2,000 steps without). Under FSDP2 the overflow check is reduced
    over the ranks (torch's DTensor), so every rank skips the same steps."""
    if policy.compute_dtype != torch.float16:
        return None
    return torch.amp.GradScaler(policy.device.type)


#: pi_theta's log-probs and entropies ``[n, T]`` (with gradient) and the router loss, or None
ForwardOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
#: Per minibatch of a rollout batch, the MoE experts pi_old chose (None: not recorded yet)
Routing = list[torch.Tensor | None]


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


def moe_settings(config: Config, model: torch.nn.Module) -> tuple[bool, bool]:
    """``(routing_replay, measure_churn)`` for ``model``; the churn is on by default for MoE
    (off by default with ``rollout.max_staleness > 0``: pi_old's routing is not the trainer's).

    Asking for either on a model without MoE routers is a one-line ``ValueError``.
    """
    replay, churn = config.moe.routing_replay, config.moe.measure_churn
    aux = config.moe.router_aux_loss_coef > 0
    for key, wanted in (
        ("moe.routing_replay", replay),
        ("moe.measure_churn", churn),
        ("moe.router_aux_loss_coef", aux),
    ):
        if wanted:
            try:
                routers = find_routers(model)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
            scored = [
                type(r).__name__
                for r in routers
                if SCORED_ROUTERS.get(type(r).__name__) in NO_SOFTMAX_BALANCE
            ]
            if key == "moe.router_aux_loss_coef" and scored:
                raise ValueError(
                    f"{key}: {scored[0]} scores its experts its own way (DeepSeek's bias or "
                    "grouped top-k), which gspo's softmax load-balancing loss does not "
                    "describe; set moe.router_aux_loss_coef=0"
                )
    if churn is None:
        churn = is_moe(model) and config.rollout.max_staleness == 0
    return replay, churn


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
    around: Callable[[int], contextlib.AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """``logprobs`` of each minibatch ``[N, T]``, one no-grad forward per minibatch on the
    layout ``batch.select`` gives the training forward: the same sums in the same order as
    the update's own forward of those rows. Without ``first`` minibatch 0's rows are left
    at 0; minibatch ``k``'s forward runs inside ``around(k)``."""
    out = torch.zeros_like(batch.sampler_logprobs)
    with torch.no_grad():
        for k, rows in enumerate(minibatches):
            if k == 0 and not first:
                continue
            with contextlib.nullcontext() if around is None else around(k):
                lp = logprobs(batch.select(rows))
            out[to_device(rows, out.device), : lp.shape[1]] = lp  # (CPU indices would wait)
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
        policy.logprobs, batch, minibatches, first=first, around=policy.same_dropout
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

    def logprobs(self, batch: RolloutBatch, k: int, routing: Routing) -> ForwardOut:
        """pi_theta's log-probs of minibatch ``k`` (its rows: ``batch``) and its entropies
        (with gradient); no routing."""
        logprobs, entropy = self.policy.logprobs(batch, with_entropy=self.entropy)
        return logprobs, entropy, None

    def release(self) -> None:
        """After the update's backward: nothing is held (:meth:`RoutedForward.release`)."""


class RoutedForward:
    """Records each minibatch's routing under pi_old; replays it when ``replay``.

    The routing of minibatch ``k`` under pi_old (``routing[k]``, kept on the experience)
    is the experts each token chose, ``[layers, tokens, top_k]``, laid out token for token
    like the training forward of ``batch.select(rows)``.
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
        self.replaying = contextlib.ExitStack()  # the replay of the last forward, until release

    def release(self) -> None:
        """After the update's backward: the replay of :meth:`logprobs` ends. It is held
        until then because with ``model.activation_checkpointing`` the backward runs each
        layer again, whose routers must replay the same experts (else they route anew:
        torch's CheckpointError, or other gradients)."""
        self.replaying.close()
        self.replaying = contextlib.ExitStack()

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
                with self.policy.same_dropout(k), capture_routing(self.policy.module) as recorder:
                    lp = self.policy.logprobs(mb)
                routing.append(recorder.experts)
                if recomputed is not None:
                    recomputed[to_device(rows, recomputed.device), : lp.shape[1]] = lp
        return recomputed, routing

    def logprobs(self, batch: RolloutBatch, k: int, routing: Routing) -> ForwardOut:
        """pi_theta's log-probs of minibatch ``k`` (its rows: ``batch``) and its entropies
        (with gradient).

        ``routing`` is the rollout batch's, per minibatch (the experience's). With routing
        replay the experts recorded under pi_old are forced. A minibatch whose old routing
        is not recorded yet (the first, in sampler mode or with ``first_from_update``)
        runs under pi_old's weights, so
        its routing is recorded here (``routing[k]``) and is the same either way. The
        router loss is that of this forward, with gradient.
        """
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
            elif self.replay:  # (held through the backward: :meth:`release`)
                self.replaying.enter_context(replay_routing(self.policy.module, routing[k]))
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
