"""The RL loop: cold-start SFT, then GSPO (or GRPO / GSPO-token), with eval and checkpoints.

One rollout batch flows through :meth:`Trainer.rl_step` in two stages::

    prompts --RolloutStage--> Experience --UpdateStage per minibatch--> metrics
             sample, score,      rewards, advantages,   log-probs -> loss
             advantages, the     old and reference       -> optimizer step -> hooks
             pre-update pass     log-probs, routing

Each stage and everything optional (MoE routing, the KL reference, ratio dumps, expert
churn, FSDP) lives in :mod:`gspo.training`; this module only builds them and runs them.
The rollout stage runs when the loop asks for a batch, or ahead of it in a producer
thread on stale weights (``rollout.max_staleness``, :mod:`gspo.training.async_rollout`).

Randomness is derived, not carried: the prompts of rollout batch ``b``, the sampling seed
of ``b``, the minibatch split of ``b`` and the eval seed at step ``s`` are all pure
functions of ``(train.seed, b or s)``. A resumed run therefore replays exactly what an
uninterrupted run would have done, with only the model and optimizer state to restore.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, checked_config, dump_config_text, flat_settings
from gspo.distributed import Distributed, rank_device
from gspo.models import resolve_dtype
from gspo.moved import moved_path, with_run_dir
from gspo.plugins import counted
from gspo.rewards.runner import leave_if_starting_a_worker
from gspo.telemetry import (
    MetricsLogger,
    StepProfiler,
    TrainingProgress,
    plot_metrics,
    plots_so_far,
    print_summary,
    read_metrics,
)
from gspo.telemetry.trackers import check_installed, run_status
from gspo.training.async_rollout import build_rollouts
from gspo.training.checkpoint import (
    CHECKPOINTS,
    SHARDED,
    latest_checkpoint,
    resumable_checkpoint,
    run_path,
    same_on_every_rank,
    take_checkpoint,
)
from gspo.training.checkpoint_writes import Checkpoints
from gspo.training.cold_start import cold_start, drop_progress
from gspo.training.cold_start_checks import check_cold_start
from gspo.training.completions import CompletionLog
from gspo.training.episodes import build_generator
from gspo.training.evaluation import Evaluator, evaluated_at_start
from gspo.training.hooks import BatchWarnings, build_hooks
from gspo.training.lora import adapter_dropout_seed
from gspo.training.memory import loading_model, out_of_memory
from gspo.training.metrics import combine, crossed, metric_reduction, rollout_clip_fractions
from gspo.training.policy import Policy, build_forward, loss_scaler
from gspo.training.prompts import sft_encoder, task_prompt_ids
from gspo.training.reference import Reference
from gspo.training.rollout import RolloutStage, Scorer, sampling_params
from gspo.training.sampler import PolicySampler, build_engine
from gspo.training.seeds import derive_seed
from gspo.training.setup import (
    build_policy_model,
    check_eval_row,
    load_task_data,
    local_shares,
    model_summary,
    record_config,
    resume_changes,
    reward_functions,
    rl_optimizer,
    start_line,
    start_warnings,
    with_absolute_paths,
    with_environment_reward,
)
from gspo.training.time_limit import TimeLimit
from gspo.training.update import Objective, PolicyUpdate, UpdateStage, logged_if_stopped

__all__ = [
    "CHECKPOINTS",
    "SHARDED",
    "Trainer",
    "crossed",
    "derive_seed",
    "latest_checkpoint",
    "metric_reduction",
]


def took_its_steps(
    step: int, config: Config, on: str = "resume it with a larger train.max_steps"
) -> str | None:
    """What a run resumed after its ``train.max_steps`` says, and how it trains ``on``
    (None: it has steps to take)."""
    minibatches = config.algorithm.minibatches
    if step == 0 or step // minibatches < config.rollout_batches:
        return None
    return (
        f"the run already took its {counted(step, 'step')} (train.max_steps="
        f"{config.train.max_steps} in whole rollout batches of {minibatches}); {on} to train on"
    )


class Trainer:
    """Builds one run's stages from its config; :meth:`fit` runs them.

    ``dist`` is this process's rank under ``torchrun`` (:func:`gspo.distributed.
    setup_distributed`); by default the single process, which runs exactly as it would
    without any distributed code.
    """

    def __init__(
        self,
        config: Config,
        output_dir: str | Path,
        *,
        resume: bool = False,
        dist: Distributed | None = None,
    ):
        leave_if_starting_a_worker()  # a reward worker importing an unguarded script
        checked_config(config, "Trainer")  # (keys assigned from Python were checked alone)
        self.output_dir = out = run_path(output_dir, resume)
        # (a resumed run moved with the files it names finds them where they are now)
        moved = (lambda path: moved_path(path, out)) if resume else None
        self.config = config = with_absolute_paths(config, moved)
        self.dist = dist = dist or Distributed()
        self.time_limit = TimeLimit(config.train.time_limit, dist)  # (from here on)
        if dist.is_main:  # (a rank making it after rank 0 removed a failed start's left it)
            check_installed(config.log.wandb, config.log.mlflow)  # (before the model loads)
            out.mkdir(parents=True, exist_ok=True)
            TimeLimit.going_on(out)
        device = rank_device(config.model.device, dist)
        # batch sizes are global: this rank's shares (one-line errors if they do not divide)
        local_prompts, self.local_sft_batch = local_shares(config, dist)
        self.data = load_task_data(config)
        if not self.data.train:
            raise ValueError("data.train: no training prompts")
        # the model: the latest checkpoint, the user's, or a built-in (a run killed before
        # step 0 resumes in its cold start from its progress checkpoints, or starts again)
        checkpoint = same_on_every_rank(resumable_checkpoint(out) if resume else None, dist)
        check_cold_start(config, self.data.sft, out / CHECKPOINTS, resumed=checkpoint)
        compute_dtype = resolve_dtype(config.model.dtype, device, builtin=not config.model.path)
        # (out of memory loading it, attaching adapters, sharding it: one line naming it)
        named = checkpoint or config.model.path or out / "base_model"
        with loading_model(named, dtype=torch.float32, device=device):
            model, self.tokenizer, model_dir = build_policy_model(
                config, out, device, dist, checkpoint, compute_dtype
            )
            self.model_dir = model_dir  # the weights the run starts from
            summary = model_summary(model)
            self.policy = Policy(
                model, dist, compute_dtype=compute_dtype, temperature=config.rollout.temperature
            )
        forward = build_forward(config, self.policy)
        self.sampler = PolicySampler(
            build_engine(config, self.policy, self.tokenizer, model_dir), self.policy
        )
        self.generator = build_generator(config, self.sampler, self.tokenizer, self.data.train[0])
        environment = getattr(self.generator, "environment", None)
        check_eval_row(environment, self.data.eval)
        self.config = config = with_environment_reward(config, environment)
        self.rewards = rewards = reward_functions(config)
        self.train_prompt_ids, eval_prompt_ids = task_prompt_ids(  # (the rows warned of: kept)
            config, self.generator, self.tokenizer, self.policy.module, self.data, say=dist.is_main
        )
        said = start_warnings(config, rewards, self.data, environment, out)
        self.optimizer, self.scheduler = rl_optimizer(config, self.policy.forward)
        self.reference = Reference(config.algorithm.kl_coef, out, self.policy, config.model.path)
        objective = Objective(config.algorithm)
        self.policy_update = PolicyUpdate(
            self.policy, self.optimizer, self.scheduler, config.optim.grad_clip,
            max_skipped=config.train.max_skipped, scaler=loss_scaler(self.policy),
        )  # fmt: skip
        if checkpoint is not None:
            self.policy_update.resume(checkpoint, config.optim)
        self.cold_start_done = checkpoint is not None  # (a checkpoint is past it)

        # the stages, and the hooks attached to the update stage
        sampling = sampling_params(
            config.rollout, self.tokenizer, self.policy.module, config.data.chat_template_kwargs
        )
        scorer = Scorer(self.tokenizer, rewards)
        self.rollout_stage = RolloutStage(
            config, dist, self.data.train, self.train_prompt_ids, self.generator, scorer, forward,
            self.reference, sampling, local_prompts=local_prompts,
            completions=CompletionLog.of_run(config, out, dist),
        )  # fmt: skip
        # rollout.max_staleness: sampled in step, or ahead by a producer thread
        self.rollouts = build_rollouts(
            config, self.rollout_stage, self.policy, self.tokenizer, checkpoint
        )
        hooks = build_hooks(config, out, dist, forward, objective, self.reference)
        self.update_stage = UpdateStage(forward, objective, self.policy_update, hooks)
        self.warnings = BatchWarnings(config, dist)
        self.evaluator = Evaluator(
            config, dist, self.data.eval, eval_prompt_ids, self.generator, scorer, sampling
        )
        self.logger = MetricsLogger(
            out, enabled=dist.is_main, tensorboard=config.log.tensorboard,
            resume_step=self.step if checkpoint is not None else None, continues=resume,
            wandb=config.log.wandb, mlflow=config.log.mlflow, params=flat_settings(config),
        )  # fmt: skip
        # one process writes its checkpoints in the background (several ranks: at once)
        self.checkpoints = Checkpoints(
            out, self.logger, keep=config.train.keep_checkpoints, dist=dist,
            background=config.train.background_checkpoints and not dist.enabled,
            tokenizer=self.tokenizer,
        )  # fmt: skip
        self.profiler = StepProfiler.of_run(config, out, dist)
        if dist.is_main:  # (rank 0 alone: a finished run's is read, then written)
            record_config(config, out, self.finished, moved)
        if checkpoint is None:  # (resumed in its cold start: its tracker runs have it)
            self.logger.log(0, summary, replayed=resume)
        else:  # (its start's warnings were said then; what the resume changes now)
            changed = None if self.finished else resume_changes(config, checkpoint)
            said = [changed] if changed else []
        for line in said if dist.is_main else []:
            print(f"gspo: warning: {line}", file=sys.stderr, flush=True)
        if config.log.progress and dist.is_main:  # (and where a resumed run goes on from)
            line = start_line(summary, self.policy.adapters, compute_dtype, forward.recompute)
            resumed = f"\nresumed at step {self.step} from {checkpoint}" if checkpoint else ""
            print(line + resumed, flush=True)
        # a run resumed from its step-0 checkpoint may already hold the starting evaluation
        resumed_at_0 = self.step == 0 and checkpoint is not None
        self.start_evaluated = evaluated_at_start(out / "metrics.jsonl", resumed_at_0, dist)

    @property
    def step(self) -> int:
        """RL optimizer steps taken so far."""
        return self.policy_update.step

    @property
    def model(self) -> torch.nn.Module:
        return self.policy.module

    def combine(self, metrics: dict[str, float]) -> dict[str, float]:
        """This rank's metrics combined with every other rank's (the identity in one process)."""
        return combine(self.dist, self.config.algorithm.level, metrics)

    # ------------------------------------------------------------------ the loop
    @property
    def finished(self) -> bool:
        """Whether a resumed run already took its ``train.max_steps`` (nothing to do)."""
        return took_its_steps(self.step, self.config) is not None

    def rl_step(self, rollout_index: int) -> list[tuple[int, dict[str, float]]]:
        """One rollout batch: sample, score, ``algorithm.minibatches`` updates; log lines.

        The last line also carries the batch's on- and off-policy clip fractions.
        """
        start = time.perf_counter()
        self.policy.dropout_seed = adapter_dropout_seed(self.config, self.dist, rollout_index)
        # generation names its own settings (RolloutStage.scored_round); the rest is pi_old
        with out_of_memory("rollout", self.config):
            experience = self.rollouts.experience(rollout_index)
        lines = []
        for k in range(len(experience.minibatches)):
            with out_of_memory("update", self.config), logged_if_stopped(lines, self.checkpoints):
                line = self.update_stage.train(experience, k)
            line = self.combine(line)
            lines.append((self.step, {**line, **experience.metrics}))
        self.rollouts.trained(rollout_index)
        clip = rollout_clip_fractions([line for _, line in lines], experience.staleness)
        lines[-1][1].update(clip)
        self.warnings.check(rollout_index, [line for _, line in lines], clip, experience.recomputed)
        step_time = time.perf_counter() - start
        for _, line in lines:
            line["time/step"] = step_time / len(lines)
        return lines

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(quiet=exc_type is not None, status=run_status(exc_type))

    def close(self, *, quiet: bool = False, status: str = "FINISHED") -> None:
        """Finish the checkpoint being written (its error raised; with ``quiet``, on the way
        out of another exception, said on stderr), then close the logger (its tracker runs
        ended with ``status``: :func:`~gspo.telemetry.trackers.run_status`), the reward workers and
        the rollout engine (after the run's last collective, before its process group
        goes: vLLM's shuts down here; the torch engine holds nothing)."""
        try:
            self.checkpoints.wait(quiet=quiet)
        finally:  # (a failed run left TensorBoard's thread, the metrics file, W&B's run open)
            try:
                self.logger.close(status)
            finally:
                self.rewards.close()  # the reward.workers processes, if any
                self.sampler.close()  # (vLLM's engine; the torch engine holds nothing)
                if quiet and self.step > 0 and self.dist.is_main and self.config.log.plots:
                    plots_so_far(self.output_dir)  # (once the workers and engine are gone)

    def fit(self, started: Callable[[], None] | None = None) -> list[dict[str, Any]]:
        """The run to its end: the cold start, evaluations, rollout batches, checkpoints;
        its metric records. ``started`` is called once the first rollout batch is trained
        (its reward functions and environment ran on the data: ``gspo train --overwrite``
        removes the run it replaces then)."""
        try:
            cfg = self.config
            fresh = False
            if not self.cold_start_done:
                with out_of_memory("cold_start", cfg):
                    changed = cold_start(
                        cfg, self.policy, self.tokenizer, self.data.sft, self.logger, self.dist,
                        local_batch=self.local_sft_batch, checkpoints=self.output_dir / CHECKPOINTS,
                        encode=sft_encoder(cfg, self.tokenizer, self.generator),
                        time_limit=self.time_limit,
                    )  # fmt: skip
                if self.time_limit.stopped is not None:  # (its progress checkpoint written)
                    return self._ended()
                self.cold_start_done = True
                # step 0: the cold-start model; RL resumes from here. A model no cold start
                # changed is named, not copied (a LoRA run's adapters are small: written)
                unchanged = not changed and not self.policy.adapters and self.policy.version == 0
                self.save_checkpoint(model_dir=self.model_dir if unchanged else None)
                fresh = True
            start: dict[str, float] = {}
            if self.step == 0 and not self.start_evaluated:
                start = self.evaluator.run(self.step)
                self.checkpoints.log(0, start)
            if fresh:  # step 0 on disk before RL (the KL reference reads it)
                self.checkpoints.wait()
            # then no cold-start progress: also what a run stopped in its step-0 evaluation left
            drop_progress(self.output_dir / CHECKPOINTS, self.dist)
            show = cfg.log.progress and self.dist.is_main
            first = self.step // cfg.algorithm.minibatches
            if self.finished and self.dist.is_main:
                print(took_its_steps(self.step, cfg), flush=True)
            with (
                TrainingProgress(cfg.total_steps, enabled=show, start_step=self.step) as bar,
                self.rollouts.running(first, cfg.rollout_batches),
            ):
                bar.record(start)  # the first lines show the starting accuracy
                for rollout_index in range(first, cfg.rollout_batches):
                    before, began = self.step, time.perf_counter()
                    with self.profiler.around(rollout_index):  # (log.profile_steps)
                        lines = self.rl_step(rollout_index)
                    if started is not None:
                        started()
                        started = None
                    for step, line in lines:
                        self.checkpoints.log(step, line)
                    last = rollout_index == cfg.rollout_batches - 1
                    if crossed(before, self.step, cfg.eval.every) or last:
                        metrics = self.evaluator.run(self.step)
                        self.checkpoints.log(self.step, metrics)
                        line = {**line, **metrics}  # the progress line shows this evaluation
                    bar.update(self.step, line)
                    saved = crossed(before, self.step, cfg.train.save_every) or last
                    if saved:
                        self.save_checkpoint(last=last)
                    self.time_limit.took(time.perf_counter() - began)
                    if not last and self.time_limit.reached(self.checkpoints.longest_s):
                        if not saved:
                            self.save_checkpoint(last=True)
                        self.time_limit.stopped = f"after step {self.step} of {cfg.total_steps}"
                        break
            return self._ended()
        except BaseException:
            self.checkpoints.wait(quiet=True)  # the checkpoint in flight is finished first
            raise

    def _ended(self) -> list[dict[str, Any]]:
        """The run's end (a time limit's stop too): its last checkpoint waited for, its
        plots, trackers closed, its summary; its metric records (rank 0)."""
        cfg = self.config
        self.checkpoints.wait()
        plots = []
        if cfg.log.plots and self.dist.is_main:
            plots = plot_metrics(self.output_dir / "metrics.jsonl", self.output_dir / "plots")
        self.logger.attach([*plots, self.output_dir / "config.yaml"])  # (to W&B, MLflow)
        self.logger.close()
        if not self.dist.is_main:
            return []
        records = read_metrics(self.output_dir / "metrics.jsonl")
        print_summary(records)
        if self.time_limit.stopped is not None:
            self.time_limit.record(self.output_dir)
        return records

    def save_checkpoint(self, model_dir: Path | None = None, *, last: bool = False) -> Path:
        """Take this step's checkpoint and write it (in the background: :class:`gspo.
        training.checkpoint_writes.Checkpoints`, which logs ``io/checkpoint_bytes``,
        ``time/checkpoint``, the seconds the run waited for it, and
        ``time/checkpoint_write``; ``self.checkpoints.wait()`` or :meth:`close` waits for
        it; the run's ``last``: at once); its directory."""
        step = self.step

        def take(copy: bool, tokenizer):
            # beside weights and optimizer: async rollouts' stale weights, skip counts, scale
            extra = {**self.rollouts.checkpoint_files(), **self.policy_update.checkpoint_files()}
            return take_checkpoint(
                self.output_dir, step, self.policy, self.optimizer, self.scheduler,
                tokenizer, dist=self.dist, extra=extra,
                model_dir=model_dir, copy=copy, model_only=self.config.train.save_only_model,
                config=with_run_dir(dump_config_text(self.config), self.output_dir),
            )  # fmt: skip

        return self.checkpoints.save(take, last=last)
