"""The ``train``, ``eval`` and ``log`` sections: the run's length, cold start, seeding,
checkpoints, held-out evaluation and what it records."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from gspo.config.section import Section


class TrainConfig(Section):
    """The run's length, the cold-start SFT stage before RL, seeding and checkpoints."""

    max_steps: int = Field(
        200,
        ge=0,
        description="Optimizer steps of RL, rounded up to whole rollout batches "
        "(algorithm.minibatches steps each)",
    )
    cold_start_steps: int = Field(
        1500,
        ge=0,
        description="SFT steps on the cold-start rows before RL (none without rows); 0 = skip",
    )
    cold_start_lr: float = Field(
        2e-3, gt=0.0, description="Cold-start learning rate, cosine-decayed to 10%"
    )
    cold_start_batch_size: int = Field(
        64,
        ge=1,
        description="Rows per cold-start step, global (must divide by the number of ranks)",
    )
    cold_start_save_every: int = Field(
        250,
        ge=0,
        description="Cold-start steps between its progress checkpoints (a killed cold start "
        "resumes from the last one); 0 = none",
    )
    cold_start_cache: bool = Field(
        True,
        description="Reuse an identical earlier cold start (same model, rows, SFT settings, "
        "seed, ranks and code) from the cache instead of redoing it (CLI: --no-cache = false)",
    )
    cold_start_cache_dir: str | None = Field(
        None,
        description="Where finished cold starts are kept; None = $XDG_CACHE_HOME/gspo/"
        "cold-start (~/.cache/gspo/cold-start)",
    )
    cold_start_cache_max_gb: float | None = Field(
        20.0,
        gt=0,
        description="Most gigabytes the cold-start cache keeps: beyond it the least recently "
        "used entries are removed (never the one this run made or reused); None = no limit",
    )
    seed: int = Field(
        0,
        description="Seed that every random choice (init, task, samples, minibatches, "
        "evaluation) derives from (the built-in task's data: data.seed's, when set)",
    )
    save_every: int = Field(
        100,
        ge=0,
        description="Optimizer steps, taken at the end of the rollout batch that crosses "
        "each multiple; 0 = only at the end",
    )
    max_skipped: int = Field(
        3,
        ge=1,
        description="Updates with a non-finite loss or gradient are skipped (logged as "
        "train/skipped_steps); this many in a row stop the run (float16: not gradients "
        "that overflowed at a loss scale above 1, which the scale's halving remedies)",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest kept, besides the step-0 one")
    save_only_model: bool = Field(
        False,
        description="Checkpoints after step 0 hold the weights (a LoRA run: its adapters), "
        "tokenizer and config, not the optimizer state nor the stale rollout weights (TRL's "
        "save_only_model): a fraction of the bytes, but a run cannot be resumed from them "
        "(start a new one with model.path=CHECKPOINT; a LoRA run's: gspo export --merge "
        "first); gspo export reads them",
    )
    time_limit: float | None = Field(
        None,
        gt=0,
        description="Wall-clock time the run may take (3h50m, 90m, 45s or seconds), counted "
        "from its start: between rollout batches, when the next one and a checkpoint might "
        "not fit in the time left, it writes its checkpoint and stops with exit status 75 "
        "(under torchrun 0) and the file stopped_at_time_limit in the run's directory (run "
        "the same command with --auto-resume to continue); for a job's time limit (SLURM "
        "--time). None = no limit",
    )
    background_checkpoints: bool = Field(
        True,
        description="Write checkpoints in a background thread while training goes on (each "
        "copied to CPU memory at its step, written whole or not at all, one at a time); a "
        "single process only: with several ranks the sharded save is a collective, which "
        "must not run beside the training's own, so it stays synchronous",
    )

    def check_time_limit(self) -> None:
        """A run stopped at its time limit is continued from the checkpoint it stops with,
        which ``save_only_model`` would leave without the optimizer state: unresumable."""
        if self.time_limit is not None and self.save_only_model:
            raise ValueError(
                "train.time_limit with train.save_only_model=true: the checkpoint the run "
                "stops with could not be resumed (no optimizer state); set one of them"
            )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        from gspo.training.time_limit import parse_duration

        return parse_duration(value)


class EvalConfig(Section):
    """Held-out evaluation at the start of RL, every ``eval.every`` steps and at the end."""

    every: int = Field(
        40,
        ge=0,
        description="Optimizer steps, taken at the end of the rollout batch that crosses "
        "each multiple; 0 = only at start and end",
    )
    samples: int = Field(4, ge=1, description="Sampled responses per held-out prompt")
    max_prompts: int = Field(
        500,
        ge=1,
        description="Held-out prompts evaluated (the first N; a longer data.eval is said "
        "at the start)",
    )
    greedy: bool = Field(True, description="Also evaluate greedy decoding (eval/accuracy_greedy)")
    success_threshold: float = Field(
        1.0,
        description="A response counts as correct (eval/accuracy) when its reward, the "
        "weighted sum of reward.functions, is at least this; with several functions each "
        "one's mean is eval/reward/NAME",
    )


class LogConfig(Section):
    """What a run records besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = Field(True, description="Write TensorBoard scalars to tensorboard/")
    plots: bool = Field(
        True,
        description="Draw plots/*.png (reward, accuracy, clip fraction, mismatch, MoE expert "
        "change) at the end, and of the steps taken when a run stops early (Ctrl-C, "
        "SIGTERM, an error)",
    )
    progress: bool = Field(True, description="Progress bar and cold-start lines on stdout")
    ratio_dump_every: int = Field(
        0,
        ge=0,
        description="Save the last minibatch's importance ratios every N rollout batches "
        "(ratios/*.pt, for gspo compare); 0 = never",
    )
    completions_every: int = Field(
        0,
        ge=0,
        description="Write every Nth rollout batch's prompts, completions, rewards (each "
        "function's too), advantages and lengths to completions/rollout-NNNNNN.jsonl (TRL's "
        "log_completions); 0 = never",
    )
    wandb: dict[str, Any] | None = Field(
        None,
        description="Mirror metrics to W&B: keyword arguments of wandb.init "
        "(e.g. {project: my-project}; true = wandb.init's defaults); null = off",
    )
    mlflow: dict[str, Any] | None = Field(
        None,
        description="Mirror metrics to MLflow: tracking_uri and experiment_name, the rest "
        "to mlflow.start_run (true = MLflow's defaults); null = off",
    )

    profile_steps: list[int] = Field(
        [],
        description="Profile the rollout batch that takes each of these optimizer steps "
        "(generation, scoring and its updates) with PyTorch's profiler, 0 = the start-up "
        "(building the trainer; gspo train and gspo.train): profile/steps_A-B/ or "
        "profile/startup/, summary.md (wall and device-busy seconds, host waits, the "
        "stages, the costliest operators and Python functions) and trace.json.gz (Perfetto, "
        "chrome://tracing); "
        "the profiler slows what it records",
    )

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _steps(cls, value: Any) -> Any:
        """One step as a number (``log.profile_steps=8``) is a list of it."""
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("profile_steps")
    @classmethod
    def _positive(cls, value: list[int]) -> list[int]:
        if any(step < 0 for step in value):
            raise ValueError("optimizer steps, counted from 1, or 0 for the start-up")
        return value

    @field_validator("wandb", "mlflow", mode="before")
    @classmethod
    def _switch(cls, value: Any) -> Any:
        """``true`` (TRL's ``report_to="wandb"``) is the tracker with its own defaults."""
        return {} if value is True else None if value is False else value
