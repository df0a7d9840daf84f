"""The ``rollout`` section (with ``rollout.vllm``): how rollout batches are sampled."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator

from gspo.config.section import Section
from gspo.plugins import ENVIRONMENT_FORMS, PYTHON_OBJECT, object_spec, spec_form

#: The ``max_lora_rank`` values vLLM takes (adapter sync uses the smallest >= model.lora.r).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMConfig(Section):
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


class RolloutConfig(Section):
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
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="Torch engine, fast decoder (Llama/Qwen families): decode with a "
        "static-shape step (fixed buffers, no host value changing between steps, "
        "finished rows read every 8 steps) captured as one CUDA graph per batch-size "
        "bucket, kept with its buffers (the KV cache) for the next rollout batch; "
        "auto = on CUDA for dense models (not MoE), off elsewhere; true = the "
        "static step wherever the fast decoder runs (captured on CUDA, eager on the CPU, "
        "where it only serves tests); false = the per-step Python loop (docs/engines.md)",
    )
    compile: bool = Field(
        False,
        description="Torch engine, fast decoder, dense models: run each layer's work "
        "around attention (norms, products, rotary embedding, MLP) through torch.compile, "
        "which fuses its small elementwise kernels; compiling costs seconds at the first "
        "rollout batch (and once more at a new batch size); on the CPU only with "
        "model.cpu_linear=torch (docs/engines.md)",
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
    environment: str | Callable[..., Any] | None = Field(
        None,
        description="Multi-turn, tool-using episodes: an environment class, "
        "path/to/env.py:Factory or package.module:Factory (docs/environments.md; from Python "
        "also the class itself); null = single-turn responses (data.task=calculator's "
        "default: gspo.environments:Calculator)",
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
    env_timeout: float | None = Field(
        None,
        gt=0,
        le=1e7,  # (a timer's longest wait is ~9e9 s: "no limit" is null)
        description="environment: seconds one call into it (constructor, reset, step, a "
        "tool, close) may take; past it the run stops with one line naming the call, "
        "checkpoints intact (from Python an EnvError; in async rollouts' thread, where "
        "nothing can interrupt it, the process exits); null = no limit (a call still "
        "running after 120 s is said once on stderr)",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="Async rollouts: rollout batch b is sampled by the weights of b - k rollout "
        "batches ago (b+1..b+k sampled while b trains, on a copy of the weights, in a "
        "thread; with vLLM the run's engine, shared with evaluation); 0 = synchronous",
    )
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    @field_validator("environment", mode="before")
    @classmethod
    def _a_factory(cls, value: Any) -> Any:
        text = isinstance(value, str) and not value.startswith(PYTHON_OBJECT)  # (read alone)
        if text and (problem := spec_form(value.strip(), "environment", ENVIRONMENT_FORMS)):
            raise ValueError(problem)
        if value is None or isinstance(value, str) or callable(value):
            return value
        raise ValueError(
            f"a spec string or the class itself (a factory: one environment per episode), "
            f"not one {type(value).__name__} object"
        )

    @field_serializer("environment")
    def _as_spec(self, environment: str | Callable[..., Any] | None) -> str | None:
        """A class given as a Python object is written as the spec that loads it (see
        ``reward.functions``)."""
        if environment is None or isinstance(environment, str):
            return environment
        return object_spec(environment)

    def check_group_size(self) -> None:
        """Group-relative advantages need groups of two or more."""
        if self.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.group_size}: GSPO, GRPO and GSPO-token "
                "are group-relative (a response's advantage is its reward minus its group's "
                "mean), so a group of one never learns; use 2 or more (default 8)"
            )

    def check_logit_noise(self) -> None:
        """Logit noise, compiled layers and captured graphs are the torch engine's (vLLM
        took compile and cuda_graphs and ignored them, unsaid)."""
        if self.engine == "vllm" and self.logit_noise > 0:
            raise ValueError("rollout.logit_noise is for the torch engine (rollout.engine=torch)")
        if self.engine == "vllm" and (self.compile or self.cuda_graphs is True):
            key = "rollout.compile" if self.compile else "rollout.cuda_graphs"
            raise ValueError(
                f"{key} is for the torch engine (rollout.engine=torch); vLLM compiles and "
                "captures its own unless rollout.vllm.enforce_eager=true (its default)"
            )
