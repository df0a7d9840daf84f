"""The rollout stage: prompts -> rollout -> scores -> advantages -> the pass before the
first update (old and reference log-probs, MoE routing).

:class:`RolloutStage` turns a rollout batch index into an
:class:`~gspo.training.update.Experience`, the one object the update stage consumes, by
way of two records of its own: :class:`Scored` (sampled and scored) and :class:`Sampled`
(with its prompt rows and sampling metrics: what an async producer hands over).
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from gspo.chat import stop_token_ids
from gspo.config import AlgorithmConfig, Config
from gspo.config.rollout import RolloutConfig
from gspo.distributed import Distributed, rank_said
from gspo.engines import RolloutBatch, SamplingParams
from gspo.objectives import group_advantages, rollout_correction
from gspo.rewards import RewardFunctions, overlong_penalty
from gspo.rewards.functions import metric_labels, split_names
from gspo.rewards.thinking import THINKING_OPENED, template_opened
from gspo.tasks import as_completion
from gspo.training.dynamic_sampling import (
    concat_batches,
    constant_groups,
    extra_prompts,
    fill_with_informative_groups,
)
from gspo.training.memory import out_of_memory
from gspo.training.metrics import combine, env_metrics, logprob_mismatch, timed
from gspo.training.policy import PlainForward, RoutedForward
from gspo.training.reference import Reference
from gspo.training.sampler import Generated, Generator, Sampler
from gspo.training.seeds import derive_seed, rank_seed
from gspo.training.update import Experience


def sampling_params(
    rollout: RolloutConfig, tokenizer, model: torch.nn.Module, chat_template_kwargs: dict
) -> SamplingParams:
    """What every generation of the run samples with (training rollouts and evaluation):
    ``rollout``'s settings, and the stop tokens the chat template ends a turn with."""
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        stop_token_ids=stop_token_ids(tokenizer, model, **chat_template_kwargs),
    )


def column_batch(rows: list[dict[str, Any]], repeat: int) -> dict[str, list[Any]]:
    """Dataset columns other than ``prompt``, each repeated ``repeat`` times per row."""
    keys = [k for k in rows[0] if k != "prompt"] if rows else []
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in keys}


@dataclass
class Scored:
    """A rollout batch with its decoded completions and rewards.

    ``scorable`` ``[N]`` bool: False where every reward function returned None (the
    completion's reward, 0, is then no evidence: it stays out of its group's baseline and
    gets advantage 0, as in TRL); None when every completion was scored. ``prompts``: an
    episode's first messages, ``counts`` its turns and tool calls (:class:`Generated`'s),
    for the completions log and the ``env/*`` metrics.
    """

    batch: RolloutBatch
    completions: list[Any]
    rewards: torch.Tensor  # [N] float32
    per_function: dict[str, list[float | None]]
    scorable: torch.Tensor | None = None
    prompts: list[Any] | None = None
    counts: dict[str, list[int]] | None = None


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


class Scorer:
    """Decodes completions and scores them with the run's reward functions."""

    def __init__(self, tokenizer, rewards: RewardFunctions):
        self.tokenizer = tokenizer
        self.rewards = rewards
        # one batch at a time: evaluation (main thread) and an async rollout producer
        # (:mod:`gspo.training.async_rollout`) may score at once
        self.lock = threading.Lock()
        self.warned = False  # the all-None warning: once a run

    def score(
        self,
        rows: list[dict[str, Any]],
        generated: Generated,
        penalty: Callable[[list[int]], list[float]] | None = None,
    ) -> Scored:
        """The rows' completions decoded and scored (one batch at a time), plus a training
        rollout's ``penalty`` of each completion's length (logged as ``overlong_penalty``)."""
        with self.lock:
            batch = generated.batch
            group = batch.group_size
            prompts = [row["prompt"] for row in rows for _ in range(group)]
            completions = generated.completions
            columns = {**column_batch(rows, group), **generated.columns}
            offer = self.rewards.take("completion_ids")  # (TRL's keyword)
            # the batch's ids and masks on the CPU: one copy from a GPU (not one wait per
            # row), which the update's minibatches then cut without waiting
            host = batch.on_host()
            if self.rewards.take(THINKING_OPENED):  # (the prompts' ends: left-padded)
                tails = self.tokenizer.batch_decode(host.prompt_ids[:, -16:].tolist())
                columns[THINKING_OPENED] = template_opened(tails)
            if completions is None or offer:
                tokens, masks = host.completion_ids, host.completion_mask.bool()
                ids = [row[m].tolist() for row, m in zip(tokens, masks, strict=True)]
                if offer:
                    columns["completion_ids"] = ids
            if completions is None:
                texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
                completions = [as_completion(t, p) for t, p in zip(texts, prompts, strict=True)]
            result = self.rewards(prompts, completions, columns)
            for episode in generated.episodes:
                episode.close()
            rewards = torch.tensor(result.rewards, dtype=torch.float32)
            per_function = result.per_function
            self.warn_if_unscored(per_function, len(completions))
            scored = [
                any(v[i] is not None for v in per_function.values()) for i in range(len(rewards))
            ]
            scorable = None if all(scored) else torch.tensor(scored)
            if penalty is not None:
                values = penalty(host.completion_mask.sum(-1).tolist())
                rewards = rewards + torch.tensor(values, dtype=torch.float32)
                per_function["overlong_penalty"] = values
            return Scored(
                batch, completions, rewards, per_function, scorable, generated.prompts,
                generated.counts,
            )  # fmt: skip

    def warn_if_unscored(self, per_function: dict[str, list[float | None]], n: int) -> None:
        """One line on stderr (once a run) when every function returned None (does not
        apply) for every completion of a batch: every advantage is 0, nothing is learned."""
        if self.warned or not per_function or n == 0:
            return
        if all(v is None for values in per_function.values() for v in values):
            self.warned = True  # (by_source's NAME/SOURCE: not a function of its own)
            split = split_names(list(per_function))
            functions = [n for n in per_function if n not in split]
            env = (  # (the environment's own reward: a get_reward() without its return?)
                "; the environment's get_reward() returned None for every episode (a missing "
                "return?)"
                if "environment" in per_function
                else ""
            )
            print(
                f"gspo: warning{rank_said()}: every reward function returned None (does not "
                f"apply) for all {n} completions of a batch, so every advantage is 0 and "
                f"nothing is learned from it (AdamW's momentum and weight decay still move the "
                f"weights); check reward.functions ({', '.join(functions)}) "
                f"against the data's columns{env} (shown once)",
                file=sys.stderr,
                flush=True,
            )


@dataclass
class LossTokens:
    """``mask`` ``[N, T]`` bool: the tokens in the loss; ``weights`` ``[N, T]`` or None."""

    mask: torch.Tensor
    weights: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class LossMask:
    """``loss_mask.tokens(batch, old_logprobs) -> LossTokens``: which tokens of a rollout
    batch the loss counts, and with what weight, for the run's ``algorithm.*``; applied
    once per rollout batch, once pi_old's log-probs are known (:meth:`RolloutStage.finish`).

    It starts from the rollout's ``action_mask`` (the tokens the model sampled; in a
    multi-turn episode the environment's tokens are left out), then:
    ``algorithm.rollout_correction`` (:func:`gspo.objectives.rollout_correction`: the
    trainer's pi_old against the sampler's log-probs, as weights ``c_{i,t}`` and dropped
    tokens or responses, ``docs/algorithm.md``, "Rollout correction") and
    ``algorithm.mask_truncated`` (responses cut off by ``rollout.max_new_tokens`` leave the
    loss: DAPO's overlong filtering). The update hands the result to
    :func:`gspo.objectives.policy_loss` as its ``mask`` and ``weights``; the rollout's own
    ``completion_mask`` (what the forward computes) is left alone.
    """

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


def merge_groups(rounds: list[Scored], groups: list[int]) -> Scored:
    """The given groups (numbered across ``rounds`` in order) as one :class:`Scored`."""
    group = rounds[0].batch.group_size
    batch = concat_batches([s.batch for s in rounds])
    rows = torch.tensor([g * group + j for g in groups for j in range(group)])
    completions = [c for s in rounds for c in s.completions]
    per_function = {  # (a name one round lacks, by_source's SOURCE of none of its rows: None)
        name: [v for s in rounds for v in s.per_function.get(name, [None] * len(s.rewards))]
        for name in dict.fromkeys(n for s in rounds for n in s.per_function)
    }
    scorable = prompts = None
    if rounds[0].prompts is not None:
        prompts = [p for s in rounds for p in s.prompts or []]
    if any(s.scorable is not None for s in rounds):
        every = [
            s.scorable if s.scorable is not None else torch.ones(len(s.rewards), dtype=torch.bool)
            for s in rounds
        ]
        scorable = torch.cat(every)[rows]
    counts = None
    if rounds[0].counts is not None:  # (each round's episodes, then the rows kept)
        every = {k: [v for s in rounds for v in s.counts[k]] for k in rounds[0].counts}
        counts = {k: [values[i] for i in rows.tolist()] for k, values in every.items()}
    return Scored(
        batch.select(rows),
        [completions[i] for i in rows.tolist()],
        torch.cat([s.rewards for s in rounds])[rows],
        {name: [values[i] for i in rows.tolist()] for name, values in per_function.items()},
        None if scorable is None or bool(scorable.all()) else scorable,
        None if prompts is None else [prompts[i] for i in rows.tolist()],
        counts,
    )


def prompts_for_batch(index: int, rows: int, per_batch: int, seed: int) -> list[int]:
    """Row indices of rollout batch ``index``: epochs of seeded permutations of ``rows``."""
    picked: list[int] = []
    position = index * per_batch
    while len(picked) < per_batch:
        epoch, offset = divmod(position, rows)
        order = list(range(rows))
        random.Random(derive_seed(seed, "data", epoch)).shuffle(order)
        take = order[offset : offset + per_batch - len(picked)]
        picked.extend(take)
        position += len(take)
    return picked


class RolloutStage:
    """``stage.experience(index) -> Experience``: everything before the first update of a
    rollout batch.

    In two halves: :meth:`sample` (generate, score, dynamic sampling: no collective but the
    weight sync, so an async producer may run it in its own thread with its own sampler)
    and :meth:`prepare` (advantages, minibatches, the pass before the first update: pi_old,
    MoE routing and the KL reference's log-probs) with :meth:`finish` (the loss mask,
    metrics over ranks: at once, or when minibatch 0's forward has given its pi_old).
    """

    def __init__(
        self,
        config: Config,
        dist: Distributed,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        generate: Generator,
        scorer: Scorer,
        forward: PlainForward | RoutedForward,
        reference: Reference,
        sampling: SamplingParams,
        *,
        local_prompts: int,
        completions: Any = None,
    ):
        self.config = config
        self.completions = completions  # log.completions_every's (training/completions.py)
        self.dist = dist
        self.rows = rows
        self.prompt_ids = prompt_ids
        self.generator = generate
        self.scorer = scorer
        self.forward = forward
        self.reference = reference
        # evaluation samples without the testing-only logit noise; rollouts with it
        self.sampling = replace(sampling, logit_noise=config.rollout.logit_noise)
        self.local_prompts = local_prompts  # this rank's share of rollout.prompts_per_batch
        self.loss_mask = LossMask(config.algorithm)
        # reward.overlong_penalty: training rollouts only (evaluation scores without)
        self.penalty = None
        if config.reward.overlong_penalty > 0:
            self.penalty = partial(
                overlong_penalty, max_tokens=config.response_limit,
                buffer=config.overlong_buffer, penalty=config.reward.overlong_penalty,
            )  # fmt: skip

    def scored_round(
        self, generator: Generator, picked: list[int], seed: int, local: dict[str, float]
    ) -> Scored:
        """``rollout.group_size`` responses (or episodes) for each of the ``picked`` rows,
        scored: the rows' reward functions and the overlong penalty. Into ``local``: the
        generation's metrics, ``time/generate`` and ``time/reward``."""
        rows = [self.rows[i] for i in picked]
        with timed(local, "time/generate"), out_of_memory("generation", self.config):
            generated = generator.generate(
                rows, [self.prompt_ids[i] for i in picked],
                n=self.config.rollout.group_size, params=self.sampling, seed=seed,
            )  # fmt: skip
        local.update(generated.metrics)
        with timed(local, "time/reward"):
            return self.scorer.score(rows, generated, self.penalty)

    def refill(
        self,
        index: int,
        picked: list[int],
        first: Scored,
        local: dict[str, float],
        generator: Generator,
    ) -> tuple[Scored, list[int]]:
        """``rollout.filter_groups``: replace constant-reward groups by fresh ones
        (:mod:`gspo.training.dynamic_sampling`); the scored batch and its prompt rows."""
        cfg = self.config
        rounds, prompts = [first], [list(picked)]

        def constant(scored: Scored) -> torch.Tensor:
            return constant_groups(scored.rewards, cfg.rollout.group_size, scored.scorable)

        def sample_round(r: int) -> torch.Tensor:
            more = extra_prompts(cfg.train.seed, index, r, len(self.rows), len(picked))
            seed = rank_seed(cfg.train.seed, self.dist, "rollout", index, "extra", r)
            # (its times and generation metrics: not logged, inside time/filter_groups)
            rounds.append(self.scored_round(generator, more, seed, {}))
            prompts.append(more)
            return constant(rounds[-1])

        kept = fill_with_informative_groups(
            constant(first), len(picked), cfg.rollout.filter_max_rounds, sample_round
        )
        local["rollout/groups_dropped"] = float(kept.dropped)
        local["rollout/extra_rounds"] = float(kept.rounds)
        every_prompt = [i for p in prompts for i in p]
        scored = merge_groups(rounds, kept.groups)
        if scored.counts is not None:  # env/*: the episodes kept, not round 0's
            for key in [k for k in local if k.startswith("env/")]:
                del local[key]
            batch = scored.batch
            local.update(env_metrics(scored.counts, batch.completion_mask, batch.action_mask))
        return scored, [every_prompt[g] for g in kept.groups]

    # ``rollout.max_staleness=0``: the stage is the loop's rollouts itself (the async
    # schedule with the same four methods: gspo.training.async_rollout.AsyncRollouts)
    def experience(self, index: int) -> Experience:
        """Rollout batch ``index``, sampled now by the run's own sampler, ready to update."""
        return self.prepare(self.sample(index))

    def trained(self, index: int) -> None:
        """Nothing to do once a batch is trained: the next is sampled when asked for."""

    @contextlib.contextmanager
    def running(self, first: int, end: int) -> Iterator[None]:
        yield

    def checkpoint_files(self) -> dict[str, object]:
        return {}

    def sample(self, index: int, sampler: Sampler | None = None) -> Sampled:
        """Rollout batch ``index`` sampled (by ``sampler``, the run's own by default) and
        scored, with the extra rounds of ``rollout.filter_groups``."""
        cfg, dist = self.config, self.dist
        generator = self.generator if sampler is None else self.generator.using(sampler)
        seed = cfg.train.seed
        local: dict[str, float] = {}
        with timed(local, "time/weight_sync"):
            generator.sampler.sync()
        # this rank's share of the rollout batch's prompts (all of them in one process)
        share = self.local_prompts
        picked = prompts_for_batch(index, len(self.rows), cfg.rollout.prompts_per_batch, seed)
        picked = picked[dist.rank * share : (dist.rank + 1) * share]
        scored = self.scored_round(
            generator, picked, rank_seed(seed, dist, "rollout", index), local
        )
        if cfg.rollout.filter_groups:
            with timed(local, "time/filter_groups"):  # extra rounds: sampled and scored
                scored, picked = self.refill(index, picked, scored, local, generator)
        return Sampled(index, picked, scored, local)

    def minibatch_rows(self, index: int, rows: int) -> list[torch.Tensor]:
        """Rollout batch ``index``'s split of its ``rows`` into ``algorithm.minibatches``
        parts (row indices in CPU memory: what cuts a minibatch reads them there, and a
        copy to the device is made without waiting), seeded by the batch's index: the same
        wherever it is asked (the update; an async producer's pi_old on the same layout).
        Under torchrun each part's rows over all ranks are as many as one process's part
        of the whole batch (:meth:`gspo.distributed.Distributed.part_shares`)."""
        seed = rank_seed(self.config.train.seed, self.dist, "minibatch", index)
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
        # exactly `minibatches` parts (chunk() may give fewer: 6 rows in 4 -> 3 parts)
        shares = self.dist.part_shares(rows, self.config.algorithm.minibatches)
        return [order[start:end] for start, end in shares]

    def prepare(self, sampled: Sampled) -> Experience:
        """Advantages, the minibatch split, the pass before the first update (pi_old, MoE
        routing, the KL reference's log-probs) and the loss mask of a sampled batch (the
        loss mask once minibatch 0's pi_old is known: see ``Experience.unsettled``)."""
        cfg, dist = self.config, self.dist
        device = self.forward.policy.device
        index, scored, local = sampled.index, sampled.scored, dict(sampled.metrics)
        start = time.perf_counter()
        batch_std = None
        if cfg.algorithm.advantage_scale == "batch" and dist.enabled:  # the whole batch's
            mine = scored.rewards if scored.scorable is None else scored.rewards[scored.scorable]
            every = torch.cat(dist.gather_objects(mine.cpu()))
            batch_std = every.std() if every.numel() > 1 else torch.zeros(())
        advantages = group_advantages(
            scored.rewards, cfg.rollout.group_size, scale=cfg.algorithm.advantage_scale,
            batch_std=batch_std, scorable=scored.scorable,
        ).to(device)  # fmt: skip
        local["time/reward"] += time.perf_counter() - start  # scoring and advantages
        if self.completions is not None:
            self.completions.write(
                index, [self.rows[i] for i in sampled.picked], scored, advantages
            )
        batch = scored.batch
        with timed(local, "time/old_logprobs"):
            minibatches = self.minibatch_rows(index, len(batch))
            recomputed, routing = sampled.old_logprobs, []
            # minibatch 0's pi_old from its update's forward (forward.first_from_update)
            later = recomputed is None and self.forward.first_from_update
            if recomputed is None:
                recomputed, routing = self.forward.old_logprobs(batch, minibatches)
        if self.reference.enabled:
            with timed(local, "time/ref_logprobs"):
                ref_logprobs = self.reference.per_minibatch(batch, minibatches)
        else:
            ref_logprobs = None
        experience = Experience(
            index=index,
            batch=batch,
            advantages=advantages,
            old_logprobs=batch.sampler_logprobs if recomputed is None else recomputed,
            recomputed=recomputed is not None,
            minibatches=minibatches,
            # over all ranks: rewards and lengths gathered (times and mismatch: finish)
            metrics=rollout_metrics(dist, scored, advantages),
            loss_mask=None,
            ref_logprobs=ref_logprobs,
            routing=routing,
        )
        finish = partial(self.finish, local=local)
        if later:
            experience.unsettled = finish
        else:
            finish(experience)
        return experience

    def finish(self, experience: Experience, local: dict[str, float]) -> None:
        """What needs every row's pi_old: the sampler-trainer mismatch (pi_old
        recomputed), the loss mask, and this rank's metrics combined over all ranks."""
        batch = experience.batch
        if experience.recomputed:
            local.update(
                logprob_mismatch(batch.sampler_logprobs, experience.old_logprobs, batch.action_mask)
            )
        tokens = self.loss_mask.tokens(batch, experience.old_logprobs)
        local.update(tokens.metrics)
        experience.loss_mask, experience.loss_weights = tokens.mask, tokens.weights
        algorithm = self.config.algorithm
        experience.metrics.update(
            combine(self.dist, algorithm.level, local, algorithm.rollout_correction)
        )


def rollout_metrics(
    dist: Distributed, scored: Scored, advantages: torch.Tensor
) -> dict[str, float]:
    """Rewards, advantages and lengths of the rollout batch, over every rank's share.

    The per-response values are gathered (groups stay whole and contiguous), so the
    figures are those of the whole rollout batch, standard deviation included.
    """
    batch = scored.batch
    scorable = scored.scorable
    if scorable is None:
        scorable = torch.ones(len(scored.rewards), dtype=torch.bool)
    mine = (
        scored.rewards.cpu(),
        advantages.cpu(),
        batch.completion_lengths.float().cpu(),
        batch.finish_reasons,
        scored.per_function,
        scorable.cpu(),
    )
    parts = dist.gather_objects(mine)
    rewards = torch.cat([p[0] for p in parts])
    advantages = torch.cat([p[1] for p in parts])
    lengths = torch.cat([p[2] for p in parts])
    finish_reasons = [r for p in parts for r in p[3]]
    per_function = {  # (a name one rank lacks, by_source's SOURCE of none of its rows: None)
        name: [v for p in parts for v in p[4].get(name, [None] * len(p[0]))]
        for name in dict.fromkeys(n for p in parts for n in p[4])
    }
    # a completion no reward function scored is out of the advantages' means: out of these
    # too (it was a reward of 0), as in evaluation and TRL; none scored, no reward logged
    kept = rewards[torch.cat([p[5] for p in parts])]
    # group_advantages zeroes exactly the groups that teach nothing (constant_groups)
    flat = (advantages.view(-1, batch.group_size) == 0).all(dim=1)
    metrics = {}
    if len(kept):
        metrics["train/reward_mean"] = kept.mean().item()
        metrics["train/reward_std"] = kept.std().item() if len(kept) > 1 else 0.0
    if len(kept) < len(rewards):
        metrics["train/unscored_fraction"] = 1.0 - len(kept) / len(rewards)
    metrics |= {
        "train/zero_std_fraction": flat.float().mean().item(),
        "train/advantage_abs_mean": advantages.abs().mean().item(),
        "train/response_length_mean": lengths.mean().item(),
        "train/response_length_max": lengths.max().item(),
        "train/truncated_fraction": sum(r == "length" for r in finish_reasons)
        / len(finish_reasons),
    }
    return metrics | reward_means(per_function, "train/reward/")


def reward_means(
    per_function: dict[str, list[float | None]], prefix: str, suffix: str = ""
) -> dict[str, float]:
    """Each reward function's mean over the completions it scored, as
    ``{prefix}NAME{suffix}`` (TRL's ``rewards/NAME/mean``); a function that scored none
    has no mean."""
    labels = metric_labels(list(per_function))
    out = {}
    for name, values in per_function.items():
        numbers = [v for v in values if v is not None]
        if numbers:
            out[f"{prefix}{labels[name]}{suffix}"] = sum(numbers) / len(numbers)
    return out
