"""Optional instruments on the update stage, each a :class:`~gspo.training.update.Hook`.

- :class:`FirstMinibatchMismatch`: sampler vs trainer log-probs, free in sampler mode.
- :class:`OnPolicyClipWarning`: one line when the on-policy minibatch clips,
  :class:`EmptyLossWarning`: one line when no token of a rollout batch is in the loss, and
  :class:`FlatRewardWarning`: one line when rewards never vary within a group (all read
  the batch's log lines, combined over ranks, not a minibatch's).
- :class:`ExpertChurn`: share of activated MoE experts that moved since pi_old.
- :class:`RatioDumps`: importance ratios (and gradient noise by length) to ``ratios/``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from gspo.config import Config
from gspo.distributed import Distributed
from gspo.engines import RolloutBatch
from gspo.gradient_noise import bucket_cosines, flatten, length_halves
from gspo.moe import capture_routing, expert_change_fraction, response_token_mask
from gspo.objectives import response_lengths, sequence_log_ratio, token_log_ratio
from gspo.training.metrics import CLIP_ON_POLICY, logprob_mismatch
from gspo.training.policy import PlainForward, Policy, RoutedForward
from gspo.training.reference import Reference
from gspo.training.seeds import derive_seed
from gspo.training.update import Experience, Hook, Minibatch, Objective


def build_hooks(
    config: Config,
    output_dir: Path,
    dist: Distributed,
    forward: PlainForward | RoutedForward,
    objective: Objective,
    reference: Reference,
) -> list[Hook]:
    """The instruments the config asks for, in the order their metrics are added."""
    hooks: list[Hook] = [FirstMinibatchMismatch()]
    if isinstance(forward, RoutedForward) and forward.measure_churn:
        hooks.append(ExpertChurn(forward.policy))
    if config.log.ratio_dump_every > 0:
        hooks.append(
            RatioDumps(
                config.log.ratio_dump_every,
                output_dir,
                dist,
                forward.policy,
                objective,
                reference,
                config.train.seed,
                gradient_noise_skipped(config, dist, forward),
            )
        )
    return hooks


def gradient_noise_skipped(
    config: Config, dist: Distributed, forward: PlainForward | RoutedForward
) -> str | None:
    """Why a ratio dump holds no gradient cosines (:func:`gradient_cosines`), or None.

    The cosines take the gradient "with the run's ratios" over halves of the batch laid
    out otherwise than the run's minibatches; where the run's ratios depend on that layout
    they would be another quantity, unmarked: with LoRA dropout the halves' forwards drop
    other inputs than pi_old's recompute did (on a single on-policy minibatch, whose run
    ratios are all 1, the ratio-1 cosine read 0.30); with Routing Replay the run's
    forward replays pi_old's routing, which the halves' forwards cannot.
    """
    if dist.enabled:
        return "torchrun: the cosines take gradients outside FSDP's hooks (one process only)"
    if config.model.lora.drops_inputs:
        return (
            "model.lora.dropout > 0: the halves' forwards would draw other dropout masks "
            "than the ones pi_old's log-probs were recomputed under"
        )
    if isinstance(forward, RoutedForward) and forward.replay:
        return (
            "moe.routing_replay: the run's ratios are of pi_old's replayed routing, which "
            "the halves' forwards (laid out otherwise) cannot replay"
        )
    return None


class FirstMinibatchMismatch(Hook):
    """In sampler mode the first minibatch is on-policy: its forward is the recompute.

    So the training/inference mismatch is measured there for free (with
    ``old_logprobs=recompute`` the rollout stage measures it over the whole batch). Not
    for a batch sampled by stale weights (``rollout.max_staleness``): its first minibatch
    is off-policy.
    """

    def after_update(
        self,
        experience: Experience,
        mb: Minibatch,
        logprobs: torch.Tensor,
        metrics: dict[str, float],
    ) -> dict[str, float]:
        if mb.k != 0 or experience.recomputed or experience.staleness > 0:
            return {}  # (stale weights sampled the batch: not the same policy, no mismatch)
        return logprob_mismatch(mb.batch.sampler_logprobs, logprobs, mb.batch.action_mask)


class BatchWarnings:
    """The loop's one-line warnings, each once a run, read from a rollout batch's lines
    (combined over ranks) after its updates: :class:`EmptyLossWarning`,
    :class:`FlatRewardWarning`, :class:`OnPolicyClipWarning`."""

    def __init__(self, config: Config, dist: Distributed):
        self.empty_loss = EmptyLossWarning(dist)
        self.flat_rewards = FlatRewardWarning(dist, config.rollout_batches)
        self.on_policy_clip = OnPolicyClipWarning(
            dist, config.algorithm.old_logprobs, config.rollout.logit_noise
        )

    def check(
        self, index: int, lines: list[dict[str, float]], clip: dict[str, float], recomputed: bool
    ) -> None:
        self.empty_loss.check(index, lines)
        self.flat_rewards.check(index, lines[-1])
        self.on_policy_clip.check(index, clip, recomputed)


class FlatRewardWarning:
    """One line on stderr, once per run, when every group of :data:`FLAT_BATCHES` rollout
    batches in a row (or of every batch of a shorter run) got one reward for all its
    responses (``train/zero_std_fraction`` 1): every advantage is 0 and those batches teach
    nothing, while the run goes on as if it trained (a random or untrained model that never
    earns the reward, a reward that misreads the completions' format)."""

    #: Rollout batches in a row, every group flat, before the warning.
    FLAT_BATCHES = 3

    def __init__(self, dist: Distributed, batches: int):
        self.dist = dist
        self.needed = max(1, min(self.FLAT_BATCHES, batches))
        self.flat: list[float] = []  # the reward means of the batches of the current streak
        self.warned = False

    def check(self, index: int, line: dict[str, float]) -> None:
        if self.warned:
            return
        # (a batch no function scored, no reward mean: the scorer's own line says so)
        if line.get("train/zero_std_fraction") != 1.0 or "train/reward_mean" not in line:
            self.flat = []
            return
        self.flat.append(line.get("train/reward_mean", float("nan")))
        if len(self.flat) < self.needed:
            return
        self.warned = True
        if not self.dist.is_main:
            return
        first = index - len(self.flat) + 1
        batches = f"rollout batch {index}" if first == index else f"rollout batches {first}-{index}"
        means = ", ".join(f"{m:.3g}" for m in self.flat)
        print(
            f"gspo: warning: in {batches} every group's responses got one reward (reward "
            f"mean {means}), so every advantage is 0 and nothing is learned from them: the task is "
            "too hard or too easy for the model as it is, or the reward misreads the "
            "completions (check reward.functions on a few); a cold start "
            "(data.sft with train.cold_start_steps), a larger rollout.group_size or "
            "rollout.temperature make "
            "rewards vary, rollout.filter_groups=true samples other prompts in place of flat "
            "groups (shown once)",
            file=sys.stderr,
            flush=True,
        )


class OnPolicyClipWarning:
    """One line on stderr, once per run, when the on-policy minibatch clips.

    The first minibatch of a batch the current weights sampled has pi_theta = pi_old, so
    every ratio should be 1 and nothing should clip. With pi_old from the sampler
    (``algorithm.old_logprobs=sampler``) what does clip there is the sampler's and the
    trainer's numerics disagreeing (bf16: docs/precision.md), and those responses get no
    gradient; a recomputed pi_old equals the update's forward by construction, so a clip
    there is not expected at all. ``check`` takes the batch's on-policy clip fraction
    over every rank (:func:`gspo.training.metrics.rollout_clip_fractions` of the combined
    lines), so what it says is the batch's, whichever rank's share clipped. The clip
    fraction of that minibatch is in the run summary either way.
    """

    def __init__(self, dist: Distributed, old_logprobs: str = "sampler", logit_noise: float = 0.0):
        self.dist = dist
        self.old_logprobs = old_logprobs  # the setting (auto: what it chose is not said)
        self.logit_noise = logit_noise
        self.warned = False

    def check(self, index: int, clip: dict[str, float], recomputed: bool) -> None:
        clipped = clip.get(CLIP_ON_POLICY, 0.0)
        if self.warned or not clipped > 0:
            return
        self.warned = True
        if not self.dist.is_main:
            return
        if recomputed:
            why = (
                "pi_old, recomputed by the trainer, differs from its update's forward of the "
                "same weights, which is not expected: please report it with the run's config"
            )
        elif self.logit_noise > 0:
            why = (
                f"the sampler's log-probs (algorithm.old_logprobs={self.old_logprobs}) are "
                f"of logits perturbed by rollout.logit_noise={self.logit_noise:g}, by design; "
                "algorithm.old_logprobs=recompute takes pi_old from the trainer"
            )
        else:
            why = (  # (auto takes the sampler's only in float32 with nothing to correct)
                f"the sampler's log-probs (algorithm.old_logprobs={self.old_logprobs}) differ "
                "from the trainer's by more than the clip range; algorithm.old_logprobs="
                "recompute avoids it"
            )
        print(
            f"gspo: warning: the on-policy minibatch of rollout batch {index} clipped "
            f"{clipped:.1%} of its tokens: {why} (shown once)",
            file=sys.stderr,
            flush=True,
        )


class EmptyLossWarning:
    """One line on stderr, once per run, when a rollout batch has no token in the loss.

    ``algorithm.mask_truncated`` with every response cut, or a rollout correction that
    drops every token, leaves ``train/tokens`` at 0: the updates learn nothing, and the
    run goes on as if it trained. ``check`` takes the batch's log lines (combined over
    ranks, so a rank whose share happens to be all masked does not speak for the batch).
    """

    def __init__(self, dist: Distributed):
        self.dist = dist
        self.warned = False

    def check(self, index: int, lines: list[dict[str, float]]) -> None:
        if self.warned or sum(line.get("train/tokens", 0.0) for line in lines) > 0:
            return
        self.warned = True
        if not self.dist.is_main:
            return
        line = lines[-1]
        if line.get("train/masked_truncated_fraction") == 1.0:
            why = (
                "every response reached rollout.max_new_tokens and "
                "algorithm.mask_truncated=true leaves cut responses out (raise "
                "rollout.max_new_tokens or set algorithm.mask_truncated=false)"
            )
        elif "correction/masked_token_fraction" in line:
            why = (
                "the rollout correction (algorithm.rollout_correction) dropped every token "
                "(widen algorithm.correction_min/correction_max)"
            )
        else:
            why = "every response was left out of the loss"
        print(
            f"gspo: warning: rollout batch {index} has no token in the loss "
            f"(train/tokens 0), so its updates learn nothing from it (AdamW's momentum and "
            f"weight decay still move the weights): {why} (shown once)",
            file=sys.stderr,
            flush=True,
        )


class ExpertChurn(Hook):
    """``moe/expert_change_fraction`` after each optimizer step (MoE models).

    A no-grad forward of the minibatch just trained on, with the updated weights and the
    model's own routing, against the routing recorded under pi_old. After the minibatch-k
    step that is ``k + 1`` updates since the rollout. Counted: the response tokens
    (completion tokens under the mask); prompt tokens, padding and packing filler are not.
    With LoRA dropout the forward drops the inputs pi_old's routing was recorded under.
    """

    def __init__(self, policy: Policy):
        self.policy = policy

    def after_update(
        self,
        experience: Experience,
        mb: Minibatch,
        logprobs: torch.Tensor,
        metrics: dict[str, float],
    ) -> dict[str, float]:
        start = time.perf_counter()
        old = experience.routing[mb.k]
        assert old is not None, "a minibatch's routing is recorded by its forward at the latest"
        # LoRA dropout: the masks pi_old's routing was recorded under (those of the update's
        # forward of these rows), or dropped adapter inputs would count as churn
        with self.policy.same_dropout(mb.k):
            churn = self.churn(mb.batch, old)
        churn["time/moe_churn"] = time.perf_counter() - start
        return churn

    @torch.no_grad()
    def churn(self, mb: RolloutBatch, old: torch.Tensor) -> dict[str, float]:
        policy = self.policy
        with capture_routing(policy.module) as recorder:
            policy.logprobs(mb)
        # the probe stops the forward at the input embedding by raising: through the FSDP
        # root that left its weights gathered, and the first checkpoint of a torchrun MoE
        # run failed (KeyError: 0); the bare module lays the tokens out the same way
        response = response_token_mask(
            policy.module,
            lambda p, c: policy.logprobs(
                replace(mb, prompt_ids=p, completion_ids=c), policy.module
            ),
            mb.prompt_ids,
            mb.prompt_mask,
            mb.action_mask,
        )
        overall, per_layer = expert_change_fraction(old, recorder.experts, response)
        # the tokens counted: the weight of this rank's fractions across ranks
        metrics = {"moe/expert_change_fraction": overall, "moe/churn_tokens": int(response.sum())}
        for i, fraction in enumerate(per_layer):
            metrics[f"moe/expert_change_fraction/layer_{i}"] = fraction
        return metrics


class RatioDumps(Hook):
    """``ratios/rollout-NNNNNN.pt`` every ``log.ratio_dump_every`` rollout batches (rank 0).

    Holds the ratios the last minibatch's loss saw (pi_theta before its update over
    pi_old): ``token_log_ratio`` (log w_it of every counted token, flat), ``token_length``
    (its response's length), ``sequence_log_ratio`` (log s_i), ``length`` and ``advantage``
    (A_i: with the ratios, which side of the clip counts) per non-empty response, plus the
    gradient cosines by length of :func:`gradient_cosines`, of the policy loss (not the
    router loss, ``moe.router_aux_loss_coef``), or else ``gradient_noise_skipped``, the
    reason (:func:`gradient_noise_skipped`). ``gspo compare`` draws its ratio
    histograms, length buckets and gradient-noise table from these.
    """

    def __init__(
        self,
        every: int,
        output_dir: Path,
        dist: Distributed,
        policy: Policy,
        objective: Objective,
        reference: Reference,
        seed: int,
        skipped: str | None = None,
    ):
        self.every = every
        self.skipped = skipped  # why no gradient cosines (None: they are measured)
        self.directory = Path(output_dir) / "ratios"
        self.dist = dist
        self.policy = policy
        self.objective = objective
        self.reference = reference
        self.seed = seed
        self.cosines: dict[str, torch.Tensor] = {}

    def due(self, experience: Experience, k: int) -> bool:
        index = experience.index
        return index % self.every == 0 and self.dist.is_main and k == experience.last_minibatch

    def before_update(self, experience: Experience, k: int) -> None:
        self.cosines = {}
        if self.due(experience, k) and self.skipped is None:  # at the weights k sees
            self.cosines = gradient_cosines(
                self.policy,
                self.objective,
                self.reference,
                experience,
                torch.Generator().manual_seed(
                    derive_seed(self.seed, "gradient_halves", experience.index)
                ),
            )

    def after_update(
        self,
        experience: Experience,
        mb: Minibatch,
        logprobs: torch.Tensor,
        metrics: dict[str, float],
    ) -> dict[str, float]:
        if self.due(experience, mb.k):
            # the tokens in the loss: the model's, less any the rollout correction dropped
            self.write(experience.index, logprobs, mb.old_logprobs, mb.mask, mb.advantages)
        return {}

    def write(
        self,
        index: int,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        mask: torch.Tensor,
        advantages: torch.Tensor,
    ) -> Path:
        mask = mask.bool()
        lengths = response_lengths(mask).long()
        rows = lengths > 0
        dump: dict[str, torch.Tensor | str] = {
            "token_log_ratio": token_log_ratio(logprobs, old_logprobs, mask)[mask].cpu(),
            "token_length": lengths.unsqueeze(1).expand_as(mask)[mask].cpu(),
            "sequence_log_ratio": sequence_log_ratio(logprobs, old_logprobs, mask)[rows].cpu(),
            "length": lengths[rows].cpu(),
            "advantage": advantages[rows].float().cpu(),
            **self.cosines,
        }
        if self.skipped is not None:
            dump["gradient_noise_skipped"] = self.skipped
        path = self.directory / f"rollout-{index:06d}.pt"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(dump, tmp)
        tmp.replace(path)
        return path


def gradient_cosines(
    policy: Policy,
    objective: Objective,
    reference: Reference,
    experience: Experience,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Gradient noise by response length, at the current weights, without a step.

    The rollout batch is cut into length buckets and each bucket into two random halves
    (:func:`gspo.gradient_noise.length_halves`); the gradient of the objective over each
    half is taken twice, with the run's ratios and with ratios 1 (old log-probs = current
    ones). The halves partition the batch, so their weighted mean is the full-batch
    gradient. Costs one forward and two backward passes over the rollout batch. Not
    measured where the halves cannot take the run's ratios (:func:`gradient_noise_skipped`).
    """
    batch = experience.batch
    bonus = objective.algorithm.entropy_coef != 0
    params = [p for p in policy.module.parameters() if p.requires_grad]
    halves = length_halves(batch.action_mask.sum(-1).cpu(), generator=generator)
    off, on, counts = [], [], []
    for h in halves:
        pair_off, pair_on, pair_counts = [], [], []
        for rows_cpu in (h.first, h.second):
            if len(rows_cpu) == 0:
                pair_off.append(flatten([None] * len(params), params))
                pair_on.append(pair_off[-1])
                pair_counts.append(0)
                continue
            mb = experience.view(rows_cpu)
            # the run's loss: with an entropy bonus, the entropy (with gradient) too
            lp, entropy = (
                policy.logprobs(mb.batch, with_entropy=True)
                if bonus
                else (policy.logprobs(mb.batch), None)
            )
            mb = replace(mb, ref_logprobs=reference.logprobs(mb.batch))  # on this layout
            grads = []
            for old in (mb.old_logprobs, lp.detach()):
                out = objective.loss(replace(mb, old_logprobs=old), lp, entropy)
                g = torch.autograd.grad(out.loss, params, retain_graph=True, allow_unused=True)
                grads.append(flatten(list(g), params))
            pair_off.append(grads[0])
            pair_on.append(grads[1])
            pair_counts.append(int(mb.mask.any(-1).sum()))
        off.append(tuple(pair_off))
        on.append(tuple(pair_on))
        counts.append(tuple(pair_counts))
    return bucket_cosines(halves, off, on, counts, batch.action_mask.sum(-1).cpu())
