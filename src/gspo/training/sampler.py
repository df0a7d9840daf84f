"""The rollout engine, kept in step with the policy's weights."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from gspo.config import Config
from gspo.engines import RolloutBatch, RolloutEngine, SamplingParams, TorchEngine
from gspo.models import model_context
from gspo.training.lora import is_lora, merged_copy
from gspo.training.policy import Policy
from gspo.training.seeds import derive_seed


def build_engine(config: Config, policy: Policy, tokenizer, model_dir: Path) -> RolloutEngine:
    """``rollout.engine``: the torch sampler, or vLLM started from ``model_dir``.

    The torch engine samples the policy's module itself (through its adapters in a LoRA
    run); vLLM starts from ``model_dir``'s whole weights (a LoRA run's base) and is given
    merged weights at every sync.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if config.rollout.engine == "torch":
        return TorchEngine(
            policy.replica(),
            pad_token_id=pad,
            eos_token_id=eos,
            cuda_graphs=config.rollout.cuda_graphs,
            compile=config.rollout.compile,
        )
    from gspo.engines.vllm_engine import VLLMEngine

    v = config.rollout.vllm
    adapter_sync = v.lora_sync == "adapter" and policy.adapters
    return VLLMEngine(
        model_dir,
        pad_token_id=pad,
        eos_token_id=eos,
        device=policy.device,
        dtype=policy.compute_dtype,
        seed=derive_seed(config.train.seed, "vllm") % 2**32,
        gpu_memory_utilization=v.gpu_memory_utilization,
        cpu_kv_cache_gb=v.cpu_kv_cache_gb,
        max_model_len=v.max_model_len,
        enforce_eager=v.enforce_eager,
        lora_rank=config.model.lora.r if adapter_sync else 0,
        ranks=policy.dist.world_size,
    )


#: What bounds a rollout's positions by default: the model's own context.
MODEL_CONTEXT = "max_position_embeddings"


def rollout_context(config: Config, module: torch.nn.Module) -> tuple[int | None, str]:
    """``(positions, key)``: the most positions a prompt and its response may take, and
    the setting that says so: the model's ``max_position_embeddings``, or
    ``rollout.vllm.max_model_len`` where vLLM is given fewer (it cut responses there, and
    failed on longer prompts and episodes, unsaid)."""
    context, _ = model_context(module)
    limit = config.rollout.vllm.max_model_len
    vllm = config.rollout.engine == "vllm" and limit is not None
    if vllm and (context is None or limit < context):
        return limit, "rollout.vllm.max_model_len"
    return context, MODEL_CONTEXT


def said_context(tokens: int | None, key: str) -> str:
    """``the model's context of 512 (max_position_embeddings)``, or vLLM's."""
    whose = "the model's" if key == MODEL_CONTEXT else "vLLM's"
    return f"{whose} context of {tokens} ({key})"


def push_weights(engine: RolloutEngine, module: torch.nn.Module) -> None:
    """Give ``engine`` ``module``'s weights the way it takes them: the torch engine the
    module itself (a LoRA run's adapters included), a vLLM engine started for adapter sync
    the adapters only, any other engine whole weights (a LoRA module's adapters merged into
    a copy, the module itself untouched)."""
    if isinstance(engine, TorchEngine):
        engine.sync_weights(module)
    elif getattr(engine, "takes_adapters", False):
        engine.sync_adapters(module)
    else:
        engine.sync_weights(merged_copy(module) if is_lora(module) else module)


class Sampler(Protocol):
    """Samples token ids through a rollout engine from the weights it stands for.

    ``sync()`` brings the engine to those weights (nothing when it holds them already; the
    rollout stage times it as ``time/weight_sync``), ``generate`` samples (syncing first
    itself if another thread changed the engine in between). Two kinds:
    :class:`PolicySampler`, the policy's current weights, and the async producer's
    :class:`gspo.training.async_rollout.StaleSampler`, a stale copy of them.
    """

    policy: Policy  # whose weights (current or stale) it samples: device and autocast

    def sync(self) -> None: ...

    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch: ...


def engine_dtype(engine: RolloutEngine, policy: Policy) -> contextlib.AbstractContextManager:
    """The torch engine runs under the policy's autocast; vLLM keeps its own dtype."""
    return policy.autocast() if isinstance(engine, TorchEngine) else contextlib.nullcontext()


class PolicySampler:
    """Generates from the policy's current weights through a rollout engine.

    The engine is synced to the policy before it generates whenever an optimizer step
    came after its last sync (the policy's ``version`` moved), or when someone else
    loaded other weights into it (an async producer sharing a vLLM engine sets
    ``version`` to None); :func:`push_weights` says what each engine is given. ``lock``
    makes a sync and the generation after it one step for threads sharing the engine.
    """

    def __init__(self, engine: RolloutEngine, policy: Policy):
        self.engine = engine
        self.policy = policy
        self.version: int | None = policy.version  # the policy version the engine holds
        self.lock = threading.RLock()

    def sync(self) -> None:
        """Give the engine the policy's current weights if it is behind (a collective under
        torchrun when it is: every rank syncs at the same point)."""
        with self.lock:
            if self.version != self.policy.version:
                push_weights(self.engine, self.policy.replica())
                self.version = self.policy.version

    def close(self) -> None:
        """Shut the engine down, if it has processes or memory of its own to let go (vLLM's)."""
        if (close := getattr(self.engine, "close", None)) is not None:
            close()

    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch:
        with self.lock:
            self.sync()
            with engine_dtype(self.engine, self.policy):
                return self.engine.generate(prompts, n=n, params=params, seed=seed)


@dataclass
class Generated:
    """What a generator hands the scorer: the rollout batch and what goes with it.

    ``completions`` (one per row; None: the scorer decodes the batch), ``columns`` (extra
    keyword arguments for the reward functions, e.g. TRL's ``environments``),
    ``metrics`` of the generation, the ``episodes`` to close once scored and what each
    episode's model saw before its first turn (``prompts``: its prompt messages, the
    environment's ``reset`` text included; None: the rows' prompts, as single turns) and
    each episode's ``counts`` (:data:`gspo.training.metrics.EPISODE_COUNTS`; None: single
    turns), from which ``metrics`` can be recomputed over some of the rows.
    """

    batch: RolloutBatch
    completions: list[Any] | None = None
    columns: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    episodes: list[Any] = field(default_factory=list)  # closed once scored
    prompts: list[Any] | None = None
    counts: dict[str, list[int]] | None = None


class Generator(Protocol):
    """Samples responses (:class:`SingleTurn`) or episodes
    (:class:`gspo.training.episodes.MultiTurn`) for rows of a dataset."""

    sampler: Sampler

    def using(self, sampler: Sampler) -> Generator:
        """The same generator sampling through another sampler (an async producer's)."""
        ...

    def generate(
        self,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        *,
        n: int,
        params: SamplingParams,
        seed: int,
    ) -> Generated: ...


class SingleTurn:
    """``generate(rows, prompt_ids, n=, params=, seed=) -> Generated``: one response per
    prompt and sample.

    The multi-turn counterpart is :class:`gspo.training.episodes.MultiTurn`.
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def using(self, sampler: Sampler) -> SingleTurn:
        return SingleTurn(sampler)

    def generate(
        self,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        *,
        n: int,
        params: SamplingParams,
        seed: int,
    ) -> Generated:
        return Generated(self.sampler.generate(prompt_ids, n=n, params=params, seed=seed))
