"""Typed configuration: YAML file plus dotted ``key.sub=value`` overrides, one loader.

Every batch size is per optimizer step (global), never per process.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from gspo.data import template_fields
from gspo.tasks import TASK_DEFAULTS


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line naming it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(_Section):
    """LoRA adapters (PEFT) on the policy: RL trains only them, the base stays frozen.

    ``r = 0`` trains every weight (full fine-tuning). With ``r > 0`` only the adapters
    have gradients and optimizer state, the KL reference is the same module with its
    adapters switched off, and checkpoints hold the adapter in PEFT's format.
    """

    r: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning (no adapters)")
    alpha: float = Field(
        32.0, gt=0.0, description="LoRA alpha: the adapter's update is scaled by alpha / r"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: all-linear (every linear layer but the "
        "output head), a list of module names (q_proj, v_proj, ...) or one regex",
    )


class ModelConfig(_Section):
    """The policy: a local Hugging Face causal LM (``model.path``) or a built-in tiny one.

    The ``layers`` .. ``norm_topk_prob`` keys size the built-in model (a real
    transformers architecture, random init, character tokenizer) and are ignored when
    ``model.path`` is set.
    """

    path: str | None = Field(None, description="Local HF causal-LM directory; None = built-in")
    builtin: Literal["qwen3", "qwen3_moe"] = Field(
        "qwen3",
        description="Built-in architecture when model.path is null: qwen3 (dense) or "
        "qwen3_moe (Mixture-of-Experts)",
    )
    layers: int = Field(4, ge=1, description="Built-in: transformer layers")
    hidden: int = Field(256, ge=8, description="Built-in: hidden size (head dim = hidden / heads)")
    heads: int = Field(4, ge=1, description="Built-in: attention heads")
    kv_heads: int = Field(
        2, ge=1, description="Built-in: key/value heads (grouped-query attention)"
    )
    intermediate: int = Field(
        768,
        ge=8,
        description="Built-in qwen3: MLP width (qwen3_moe's experts use model.expert_intermediate)",
    )
    experts: int = Field(8, ge=1, description="Built-in qwen3_moe: experts per layer")
    experts_per_token: int = Field(
        2, ge=1, description="Built-in qwen3_moe: experts activated per token (top-k)"
    )
    expert_intermediate: int = Field(
        256,
        ge=1,
        description="Built-in qwen3_moe: each expert's MLP width (moe_intermediate_size; "
        "Qwen3-30B-A3B: 768 at hidden 2048)",
    )
    norm_topk_prob: bool = Field(
        True,
        description="Built-in qwen3_moe: renormalise the top-k routing weights to sum to 1 "
        "(Qwen3-MoE's setting); false = the raw softmax probabilities",
    )
    experts_implementation: Literal["auto", "eager", "grouped_mm", "batched_mm", "padded"] = Field(
        "auto",
        description="How MoE experts compute (any MoE model; the same sums up to "
        "rounding): auto = as transformers sets the model up (grouped_mm in "
        "transformers 5.24); eager, grouped_mm, batched_mm = transformers' own (eager: "
        "its loop over experts); padded = gspo's three batched matmuls (faster than the "
        "eager loop with many experts on CPU, slower than grouped_mm: "
        "benchmarks/moe_experts.py)",
    )
    cpu_linear: Literal["onednn", "torch"] = Field(
        "onednn",
        description="Float32 linear layers on the CPU: onednn = oneDNN's matrix products "
        "(about 2x torch's default MKL on AMD CPUs; the same sums up to rounding), torch = "
        "F.linear as shipped. Ignored on CUDA and where this torch has no oneDNN",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype of the forward passes (autocast; trained weights and "
        "optimizer stay float32, a LoRA run's frozen base is held in it on CUDA) and of "
        "vLLM; auto = bfloat16 on CUDA, float32 on CPU",
    )
    device: str = Field(
        "auto",
        description="torch device (cpu, cuda, cuda:1); auto = CUDA if available, else CPU. "
        "Under torchrun, cuda means GPU LOCAL_RANK",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)


class DataConfig(_Section):
    """Prompts for RL, held-out prompts for evaluation, rows for the cold-start SFT.

    With ``data.train`` null a built-in task generates all three (the ``digits`` ..
    ``label_noise`` keys shape it). Otherwise each of ``data.train`` / ``data.eval`` /
    ``data.sft`` is a local file (JSONL, JSON, Parquet, CSV), a local dataset directory
    (``save_to_disk`` output or data files) or a ``datasets`` hub id
    ``owner/name[:config[:split]]``; an existing local path always wins, and ``./``
    marks a relative one. The prompt comes from ``data.prompt_column`` (a string or chat
    messages) or ``data.prompt_template``; every other column reaches the reward
    functions as a keyword argument.
    """

    task: Literal["addition", "chain", "calculator"] = Field(
        "addition",
        description="Built-in task: addition (a+b=, 2-4 tokens), chain (step-by-step "
        "multi-term addition, ~20-130 tokens; score it with reward.functions=[numeric_match]) "
        "or calculator (a+b= with an add tool, multi-turn; set data.digits=5 or more)",
    )
    train: str | None = Field(
        None,
        description="RL prompts: a local .jsonl/.json/.parquet/.csv file or dataset "
        "directory, or a datasets hub id owner/name[:config[:split]] "
        "(openai/gsm8k:main:train); null = the built-in task",
    )
    eval: str | None = Field(
        None,
        description="Held-out prompts, same forms (openai/gsm8k:main:test); with a built-in "
        "task it replaces the generated held-out split",
    )
    sft: str | None = Field(
        None, description="Cold-start SFT rows, same forms: a prompt and a completion column"
    )
    prompt_column: str = Field(
        "prompt",
        description="Column holding the prompt (a string or a list of chat messages)",
    )
    prompt_template: str | None = Field(
        None,
        description="Prompt as a Python format string over the row's columns, e.g. "
        "'Solve: {question}' (literal braces doubled: \\boxed{{}}); replaces "
        "data.prompt_column",
    )
    system_prompt: str | None = Field(
        None,
        description="System message put before each prompt (the prompt becomes chat "
        "messages, so the tokenizer needs a chat template); a prompt that has one keeps it",
    )
    chat_template: bool = Field(
        False,
        description="Send string prompts through the tokenizer's chat template as one user "
        "message (implied by data.system_prompt); message-list prompts always are",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {enable_thinking: false} "
        "for Qwen3",
    )
    answer_column: str | None = Field(
        None,
        description="Column whose final answer (GSM8K '#### 42' -> 42, the last \\boxed{} "
        "-> its content) becomes the answer column the built-in rewards read; "
        "null = use the answer column as it is",
    )
    completion_column: str = Field(
        "completion", description="data.sft: column holding the cold-start completion"
    )
    digits: int = Field(2, ge=1, le=6, description="Built-in tasks: digits per operand")
    terms: int = Field(12, ge=2, le=40, description="chain: most operands per prompt")
    min_terms: int = Field(2, ge=2, description="chain: fewest operands per prompt")
    eval_size: int = Field(
        500,
        ge=1,
        description="Built-in tasks: held-out prompts (at most a fifth of the distinct prompts)",
    )
    sft_size: int = Field(8000, ge=1, description="Built-in tasks: cold-start SFT rows")
    label_noise: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Built-in tasks: probability that a cold-start row is wrong (addition: "
        "a random last digit; chain: one slipped partial sum)",
    )


class RewardConfig(_Section):
    """Reward functions, called on every rollout batch and combined into one scalar reward.

    They follow TRL's convention (``prompts``, ``completions`` and every dataset column as
    keyword arguments, one float or ``None`` per completion), so TRL reward functions work
    unchanged; ``None`` is left out of the weighted sum.
    """

    functions: list[str] = Field(
        default_factory=lambda: ["exact_match"],
        description="Built-ins (exact_match, numeric_match, math, format, code) or "
        "path/to/file.py:function / package.module:function; one name alone is a list of one",
    )
    weights: list[float] | None = Field(
        None, description="One weight per function for the weighted sum; null = 1.0 each"
    )
    workers: int = Field(
        0,
        ge=0,
        description="Worker processes that score each rollout batch in parallel chunks; "
        "0 = in the trainer process",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds the reward functions may take per rollout batch before the run "
        "stops with one line naming the function; null = no limit",
    )
    overlong_penalty: float = Field(
        0.0,
        ge=0.0,
        description="DAPO's soft overlong punishment on training rewards (not evaluation): "
        "0 up to rollout.max_new_tokens (with an environment: max_episode_tokens) - "
        "overlong_buffer tokens, then falling linearly to "
        "-overlong_penalty at the limit; 0 = off (DAPO: 1.0)",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="Tokens before rollout.max_new_tokens where the overlong penalty "
        "ramps; null = a fifth of max_new_tokens (DAPO: 4096 of 20480)",
    )

    @field_validator("functions", mode="before")
    @classmethod
    def _one_function(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


#: The ``max_lora_rank`` values vLLM takes (adapter sync uses the smallest >= model.lora.r).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMConfig(_Section):
    """The colocated vLLM engine (``rollout.engine=vllm``); ignored by the torch engine."""

    gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0, description="CUDA: share of GPU memory vLLM may take"
    )
    cpu_kv_cache_gb: int = Field(
        1, ge=1, description="CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)"
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Longest prompt + completion; None = the model's own"
    )
    enforce_eager: bool = Field(True, description="No CUDA graphs / compilation (fast start)")
    lora_sync: Literal["merged", "adapter"] = Field(
        "merged",
        description="LoRA runs: what vLLM gets at a weight sync: merged (base + adapters merged "
        "into a copy, every weight copied in) or adapter (only the adapters, through vLLM's "
        "LoRA support; the base is loaded once)",
    )


class RolloutConfig(_Section):
    """Sampling the rollout batches: ``prompts_per_batch`` prompts, ``group_size`` each."""

    engine: Literal["torch", "vllm"] = Field(
        "torch",
        description="Sampler: torch (built-in PyTorch sampler) or vllm (colocated vLLM, "
        "see rollout.vllm)",
    )
    group_size: int = Field(8, ge=1, description="Responses per prompt (G)")
    prompts_per_batch: int = Field(
        16,
        ge=1,
        description="Prompts per rollout batch, global (must divide by the number of ranks)",
    )
    max_new_tokens: int = Field(
        8, ge=1, description="Longest response in tokens; longer ones are cut off"
    )
    temperature: float = Field(
        1.0,
        gt=0.0,
        description="Sampling temperature; the trainer's log-probs are taken under it too",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Nucleus sampling; below 1 with engine=vllm needs "
        "algorithm.old_logprobs=recompute",
    )
    logit_noise: float = Field(
        0.0,
        ge=0.0,
        description="Testing: noise (sd) on the sampler's logits, emulating an inference "
        "engine whose probabilities differ from the trainer's (torch engine only)",
    )
    filter_groups: bool = Field(
        False,
        description="Dynamic sampling (DAPO): drop groups whose rewards are all equal and "
        "sample more prompts until the rollout batch is full again",
    )
    filter_max_rounds: int = Field(
        3,
        ge=1,
        description="filter_groups: most extra sampling rounds per rollout batch (each of "
        "prompts_per_batch prompts); past it constant groups fill the batch",
    )
    environment: str | None = Field(
        None,
        description="Multi-turn, tool-using episodes: an environment class, "
        "path/to/env.py:Factory or package.module:Factory (docs/environments.md); null = "
        "single-turn responses (data.task=calculator's default: gspo.environments:Calculator)",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="environment: most model turns per episode (each at most max_new_tokens)",
    )
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        description="environment: most tokens after the prompt per episode, the model's and "
        "the environment's; null = max_turns * max_new_tokens",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Async rollouts: rollout batch b is sampled by the weights of b - k rollout "
        "batches ago (b+1..b+k sampled while b trains, on a copy of the weights, in a "
        "thread; with vLLM the run's engine, shared with evaluation); 0 = synchronous",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


#: The algorithms' names, accepted for ``algorithm.level`` (as TRL, verl and the papers
#: name them); each level brings its paper's clip range unless clip_low/high are set.
ALGORITHM_NAMES = {
    "gspo": "sequence",
    "gspo_token": "sequence_token",
    "gspo-token": "sequence_token",
    "grpo": "token",
}


class AlgorithmConfig(_Section):
    """The policy-gradient objective: GSPO, GSPO-token or GRPO, and how each batch is used.

    Defaults are the GSPO paper's settings (clip 3e-4 / 4e-4, 4 minibatches per rollout
    batch, no KL penalty).
    """

    level: Literal["sequence", "sequence_token", "token"] = Field(
        "sequence",
        description="Importance ratio: sequence (GSPO), sequence_token (GSPO-token), token "
        "(GRPO); the names gspo, gspo_token and grpo are accepted for them",
    )
    clip_low: float | None = Field(
        None,
        ge=0.0,
        description="Clip epsilon below 1; null = the level's paper value (3e-4 for the "
        "sequence levels, 0.2 for token)",
    )
    clip_high: float | None = Field(
        None,
        ge=0.0,
        description="Clip epsilon above 1; null = the level's paper value (4e-4 for the "
        "sequence levels, 0.27 for token)",
    )
    minibatches: int = Field(
        4,
        ge=1,
        description="Optimizer steps per rollout batch, one per minibatch (at most "
        "rollout.group_size * rollout.prompts_per_batch); the first is on-policy",
    )
    old_logprobs: Literal["auto", "sampler", "recompute"] = Field(
        "auto",
        description="pi_old's log-probs: sampler (the rollout engine's, no extra pass), "
        "recompute (a no-grad trainer forward, per minibatch) or auto: the sampler's when "
        "the forward runs in float32, recomputed in bfloat16/float16 (where the two differ "
        "by more than GSPO's clip range: docs/precision.md), with a rollout_correction, and "
        "for vLLM with top_p < 1",
    )
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide group-centred rewards by the group's std (group), the rollout "
        "batch's (batch) or nothing (none, Dr. GRPO)",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of a k3 KL penalty against the cold-start (step-0) model; "
        "0 = off, no reference model loaded",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of an entropy bonus (loss -= entropy_coef * mean token entropy "
        "of pi_theta); 0 = off (train/entropy is logged either way)",
    )
    mask_truncated: bool = Field(
        False,
        description="Leave responses cut off by rollout.max_new_tokens out of the loss "
        "(DAPO's overlong filtering)",
    )
    rollout_correction: Literal["none", "token_tis", "token_mask", "sequence_mask"] = Field(
        "none",
        description="Correct for the sampler's log-probs differing from pi_old's (needs "
        "old_logprobs=recompute): token_tis (weight min(rho, max)), token_mask (IcePop: "
        "tokens with rho outside [min, max] dropped), sequence_mask (responses whose "
        "geometric-mean rho leaves [min, max] dropped); rho = pi_old / pi_sampler",
    )
    correction_min: float | None = Field(
        None,
        ge=0.0,
        description="Lower bound of rho; null = the mode's literature value (token_mask "
        "0.5, sequence_mask 0.999; token_tis has none)",
    )
    correction_max: float | None = Field(
        None,
        gt=0.0,
        description="Upper bound of rho; null = the mode's literature value (token_tis 2.0, "
        "token_mask 5.0, sequence_mask 1.001)",
    )

    @field_validator("level", mode="before")
    @classmethod
    def _algorithm_name(cls, value: Any) -> Any:
        if isinstance(value, str):
            return ALGORITHM_NAMES.get(value.strip().lower(), value)
        return value


class OptimConfig(_Section):
    """AdamW for the RL stage (the cold start has its own ``train.cold_start_*`` keys)."""

    lr: float = Field(1e-4, gt=0.0, description="RL learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas")
    grad_clip: float = Field(
        1.0, ge=0.0, description="Largest global gradient norm per step; 0 = no clipping"
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over this many steps; 0 = none"
    )


class TrainConfig(_Section):
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
    seed: int = Field(
        0,
        description="Seed that every random choice (init, task, samples, minibatches, "
        "evaluation) derives from",
    )
    save_every: int = Field(100, ge=0, description="Optimizer steps; 0 = only at the end")
    max_skipped: int = Field(
        3,
        ge=1,
        description="Updates with a non-finite loss or gradient are skipped (logged as "
        "train/skipped_steps); this many in a row stop the run",
    )
    keep_checkpoints: int = Field(2, ge=1, description="Newest kept, besides the step-0 one")
    background_checkpoints: bool = Field(
        True,
        description="Write checkpoints in a background thread while training goes on (each "
        "copied to CPU memory at its step, written whole or not at all, one at a time); a "
        "single process only: with several ranks the sharded save is a collective, which "
        "must not run beside the training's own, so it stays synchronous",
    )


class EvalConfig(_Section):
    """Held-out evaluation at the start of RL, every ``eval.every`` steps and at the end."""

    every: int = Field(40, ge=0, description="Optimizer steps; 0 = only at start and end")
    samples: int = Field(4, ge=1, description="Sampled responses per held-out prompt")
    max_prompts: int = Field(500, ge=1, description="Held-out prompts evaluated (the first N)")
    greedy: bool = Field(True, description="Also evaluate greedy decoding (eval/accuracy_greedy)")
    success_threshold: float = Field(
        1.0, description="A response counts as correct when its reward is at least this"
    )


class MoEConfig(_Section):
    """Mixture-of-Experts diagnostics and Routing Replay (MoE models only)."""

    routing_replay: bool = Field(
        False, description="Compute pi_theta for the ratio through the experts pi_old chose"
    )
    measure_churn: bool | None = Field(
        None,
        description="Log moe/expert_change_fraction after each optimizer step; "
        "None = on for MoE models",
    )
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the routers' load-balancing loss (Switch Transformer, over "
        "the response tokens) added to the RL loss; 0 = off. Qwen3-MoE configs use 0.001",
    )


class LogConfig(_Section):
    """What a run records besides ``metrics.jsonl`` (always written)."""

    tensorboard: bool = Field(True, description="Write TensorBoard scalars to tensorboard/")
    plots: bool = Field(
        True, description="Draw plots/*.png (reward, accuracy, clip fraction) at the end"
    )
    progress: bool = Field(True, description="Progress bar and cold-start lines on stdout")
    ratio_dump_every: int = Field(
        0,
        ge=0,
        description="Save the last minibatch's importance ratios every N rollout batches "
        "(ratios/*.pt, for gspo compare); 0 = never",
    )
    wandb: dict[str, Any] | None = Field(
        None,
        description="Mirror metrics to W&B: keyword arguments of wandb.init "
        "(e.g. {project: my-project}); null = off",
    )
    mlflow: dict[str, Any] | None = Field(
        None,
        description="Mirror metrics to MLflow: tracking_uri and experiment_name, the rest "
        "to mlflow.start_run; null = off",
    )


class Config(_Section):
    """The whole run configuration: one YAML file, every section optional.

    Every batch size is per optimizer step (global), never per process.
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        model = self.model
        if model.path is None:  # the built-in's sizes (a model.path brings its own)
            if model.hidden % model.heads or (model.hidden // model.heads) % 2:
                raise ValueError(
                    f"model.hidden={model.hidden} must be model.heads={model.heads} times an "
                    "even head size (rotary embeddings rotate pairs of dimensions)"
                )
            if model.heads % model.kv_heads:
                raise ValueError(
                    f"model.kv_heads={model.kv_heads} must divide model.heads={model.heads}"
                )
            if model.builtin == "qwen3_moe" and model.experts_per_token > model.experts:
                raise ValueError(
                    f"model.experts_per_token={model.experts_per_token} exceeds "
                    f"model.experts={model.experts}"
                )
        if self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: GSPO, GRPO and GSPO-token "
                "are group-relative (a response's advantage is its reward minus its group's "
                "mean), so a group of one never learns; use 2 or more (default 8)"
            )
        batch = self.rollout.group_size * self.rollout.prompts_per_batch
        if self.algorithm.minibatches > batch:
            raise ValueError(
                f"algorithm.minibatches={self.algorithm.minibatches} exceeds the rollout batch "
                f"of {batch} responses (rollout.group_size * rollout.prompts_per_batch)"
            )
        if self.reward.weights is not None and len(self.reward.weights) != len(
            self.reward.functions
        ):
            raise ValueError(
                f"reward.weights has {len(self.reward.weights)} entries for "
                f"{len(self.reward.functions)} reward.functions"
            )
        if (
            self.rollout.engine == "vllm"
            and self.rollout.top_p < 1.0
            and self.algorithm.old_logprobs == "sampler"
        ):
            # vLLM reports log-probs of the nucleus-renormalised distribution, the trainer
            # recomputes the untruncated one: the ratio would be off by the nucleus mass.
            raise ValueError(
                "rollout.top_p < 1 with rollout.engine=vllm needs "
                "algorithm.old_logprobs=recompute (vLLM's log-probs are of the truncated "
                "distribution)"
            )
        if self.data.prompt_template is not None:
            if "prompt_column" in self.data.model_fields_set and (
                self.data.prompt_column != "prompt"
            ):
                raise ValueError("set one of data.prompt_column and data.prompt_template")
            try:
                template_fields(self.data.prompt_template)
            except ValueError as exc:
                raise ValueError(f"data.prompt_template: {exc}") from None
        if self.data.task == "chain" and self.data.train is None:
            if self.data.min_terms > self.data.terms:
                raise ValueError("data.min_terms exceeds data.terms")
            if self.reward.functions == ["exact_match"]:
                # the answer column holds the total; the completion is the whole chain
                raise ValueError("data.task=chain needs reward.functions=[numeric_match]")
        if self.environment is not None and self.reward.workers > 0:
            raise ValueError(
                "reward.workers > 0 cannot be used with rollout.environment (the reward "
                "functions get the environments, which stay in the trainer process)"
            )
        if self.reward.overlong_buffer is not None and (
            self.reward.overlong_buffer > self.response_limit
        ):
            limit = "max_episode_tokens" if self.environment else "max_new_tokens"
            raise ValueError(
                f"reward.overlong_buffer={self.reward.overlong_buffer} exceeds "
                f"rollout.{limit}={self.response_limit}"
            )
        algo = self.algorithm
        if algo.rollout_correction != "none" and algo.old_logprobs == "sampler":
            raise ValueError(
                f"algorithm.rollout_correction={algo.rollout_correction} needs "
                "algorithm.old_logprobs=recompute: with old_logprobs=sampler pi_old is the "
                "sampler's own log-probs and there is nothing to correct"
            )
        bounds = {"correction_min": algo.correction_min, "correction_max": algo.correction_max}
        for key, value in bounds.items():
            if value is not None and algo.rollout_correction == "none":
                raise ValueError(f"algorithm.{key} is set but algorithm.rollout_correction=none")
        if algo.correction_min is not None and algo.rollout_correction == "token_tis":
            raise ValueError(
                "algorithm.correction_min: token_tis only truncates from above "
                "(use token_mask to drop tokens below a bound)"
            )
        if (
            algo.correction_min is not None
            and algo.correction_max is not None
            and algo.correction_min >= algo.correction_max
        ):
            raise ValueError("algorithm.correction_min must be below algorithm.correction_max")
        staleness = self.rollout.max_staleness
        if staleness > 0 and (self.moe.routing_replay or self.moe.measure_churn):
            key = "moe.routing_replay" if self.moe.routing_replay else "moe.measure_churn"
            raise ValueError(
                f"{key} needs rollout.max_staleness=0 (pi_old's routing would be recorded "
                "under the trainer's weights, not the stale ones that sampled the batch)"
            )
        if self.rollout.engine == "vllm" and self.rollout.logit_noise > 0:
            raise ValueError("rollout.logit_noise is for the torch engine (rollout.engine=torch)")
        lora = self.model.lora
        sft_rows = self.data.train is None or self.data.sft is not None
        if lora.r > 0 and self.train.cold_start_steps > 0 and sft_rows:
            raise ValueError(
                f"model.lora.r={lora.r} needs train.cold_start_steps=0: LoRA trains RL "
                "only; run the cold start without LoRA and pass its step-0 checkpoint as "
                "model.path"
            )
        if self.rollout.vllm.lora_sync == "adapter" and self.rollout.engine == "vllm":
            if lora.r == 0:
                raise ValueError(
                    "rollout.vllm.lora_sync=adapter needs LoRA adapters (model.lora.r > 0)"
                )
            if lora.r > VLLM_LORA_RANKS[-1]:
                raise ValueError(
                    f"rollout.vllm.lora_sync=adapter: model.lora.r={lora.r} is above vLLM's "
                    f"largest LoRA rank {VLLM_LORA_RANKS[-1]} (use lora_sync=merged)"
                )
        if lora.r > 0 and isinstance(lora.target_modules, list) and not lora.target_modules:
            raise ValueError("model.lora.target_modules: empty list (use all-linear)")
        dense_builtin = self.model.path is None and self.model.builtin == "qwen3"
        moe_keys = {
            "moe.routing_replay": self.moe.routing_replay,
            "moe.measure_churn": self.moe.measure_churn,
            "moe.router_aux_loss_coef": self.moe.router_aux_loss_coef > 0,
        }
        wanted = [key for key, value in moe_keys.items() if value]
        if dense_builtin and wanted:
            key = wanted[0]
            raise ValueError(
                f"{key} needs a MoE model (model.builtin=qwen3_moe or a MoE model.path); "
                "model.builtin=qwen3 is dense"
            )
        return self

    def warnings(self) -> list[str]:
        """One line per setting that is valid but leaves the run unable to learn."""
        lines = []
        data = self.data
        cold = data.sft is not None and self.train.cold_start_steps > 0
        if data.train is not None and self.model.path is None and not cold:
            why = "no data.sft" if data.sft is None else "train.cold_start_steps=0"
            lines.append(
                f"data.train with model.path null and {why}: RL starts from the built-in "
                "model's random initialisation with no cold start, which rarely earns any "
                "reward (set model.path to a trained model, or data.sft for a cold start)"
            )
        return lines

    @property
    def environment(self) -> str | None:
        """``rollout.environment`` (the calculator task's default: its built-in one)."""
        return self.rollout.environment

    @property
    def max_episode_tokens(self) -> int:
        """``rollout.max_episode_tokens``, or ``max_turns * max_new_tokens``."""
        r = self.rollout
        return r.max_episode_tokens or r.max_turns * r.max_new_tokens

    @property
    def response_limit(self) -> int:
        """The longest response: ``rollout.max_new_tokens``, or with an environment the
        episode's ``max_episode_tokens`` (the overlong penalty ramps up to it)."""
        return self.max_episode_tokens if self.environment else self.rollout.max_new_tokens

    @property
    def overlong_buffer(self) -> int:
        """``reward.overlong_buffer``, or a fifth of :attr:`response_limit` (at least 1)."""
        buffer = self.reward.overlong_buffer
        return max(self.response_limit // 5, 1) if buffer is None else buffer

    @property
    def rollout_batches(self) -> int:
        """Rollout batches needed for ``train.max_steps`` optimizer steps."""
        return -(-self.train.max_steps // self.algorithm.minibatches)

    @property
    def total_steps(self) -> int:
        """Optimizer steps a run takes: ``train.max_steps`` rounded up to whole rollout
        batches (each gives ``algorithm.minibatches`` steps)."""
        return self.rollout_batches * self.algorithm.minibatches


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree['a']['b'] = value`` for ``dotted = 'a.b'``, creating sections as needed."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {key} is a value, not a section")
        node = child
    node[leaf] = value


def _is_text(annotation: Any) -> bool:
    """Whether a field holds text: ``str``, ``str | None`` or a ``Literal`` of strings."""
    if annotation is str:
        return True
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in args)
    if get_origin(annotation) in (Union, UnionType):
        others = [a for a in args if a is not type(None)]
        return len(others) == 1 and _is_text(others[0])
    return False


def _field_annotation(dotted: str) -> Any:
    """The annotation of the config field at ``dotted``, or None for a section or unknown key."""
    model: type[BaseModel] = Config
    *parents, leaf = dotted.split(".")
    for key in parents:
        field = model.model_fields.get(key)
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    field = model.model_fields.get(leaf)
    return None if field is None else field.annotation


_NULL = {"null", "Null", "NULL", "~", ""}


def parse_override(text: str) -> tuple[str, Any]:
    """``'optim.lr=3e-4' -> ('optim.lr', 3e-4)``: the value typed by the key's field.

    Text keys (``str``, ``str | None``, a choice of strings) take the value as written,
    colons, braces and quotes included (``data.prompt_template=Q: {question} A:``); for
    an optional one ``null``, ``~`` or nothing means None. Every other value (numbers,
    booleans, lists, mappings) is parsed as YAML.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    annotation = _field_annotation(key)
    if annotation is not None and _is_text(annotation):
        if type(None) in get_args(annotation) and raw.strip() in _NULL:
            return key, None
        # a choice is a word: spaces around it are not part of it
        return key, raw.strip() if get_origin(annotation) is Literal else raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r} as YAML") from exc
    # YAML 1.1 reads "3e-4" (no dot) as a string; numbers written that way are meant.
    if isinstance(value, str) and re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+", value):
        value = float(value)
    return key, value


def _section_keys(dotted: str) -> list[str]:
    """The keys of the config section at ``dotted`` ("" = the top level); [] if none."""
    model: type[BaseModel] = Config
    for key in filter(None, dotted.split(".")):
        field = model.model_fields.get(key)
        annotation = None if field is None else field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _did_you_mean(word: Any, choices: list[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``word``, or ``""``."""
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _error_line(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        parent, _, leaf = where.rpartition(".")
        return f"{where}: unknown key{_did_you_mean(leaf, _section_keys(parent))}"
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, dict) or where == "" else f" (got {value!r})"
    if err["type"] == "literal_error":
        shown += _did_you_mean(value, [str(a) for a in get_args(_field_annotation(where))])
    return f"{where}: {message}{shown}" if where else message


def _get_dotted(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(True, tree['a']['b'])`` for ``dotted = 'a.b'``, or ``(False, None)`` if unset."""
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def with_task_defaults(tree: dict[str, Any]) -> None:
    """Fill in the built-in task's own settings (:data:`gspo.tasks.TASK_DEFAULTS`) for the
    keys the file and overrides leave unset; a run on ``data.train`` gets none of them."""
    task = _get_dotted(tree, "data.task")[1] or "addition"
    if _get_dotted(tree, "data.train")[1] is not None or task not in TASK_DEFAULTS:
        return  # an unknown task is the validation's to report
    for key, value in TASK_DEFAULTS[task].items():
        if not _get_dotted(tree, key)[0]:
            set_dotted(tree, key, value)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The config from an optional YAML file plus overrides; one-line :class:`ConfigError`."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        tree = loaded or {}
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
    with_task_defaults(tree)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_error_line(exc)) from None


def dump_config_text(config: Config) -> str:
    """The resolved config as YAML text (reloadable with :func:`load_config`)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def dump_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML to ``path``."""
    Path(path).write_text(dump_config_text(config))
