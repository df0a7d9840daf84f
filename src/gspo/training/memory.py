"""Out of memory: one line that names the stage and the settings that lower it.

An out-of-memory error (:func:`is_out_of_memory`: CUDA's, the CPU allocator's, Python's
``MemoryError``) raised inside a stage of the run (generation, pi_old's recompute, the
policy update, the cold start) becomes :class:`OutOfMemory`, whose message says what ran
out, in which stage, and which settings to lower there (with their current values); the
``gspo`` command prints it as one line, like bad input, instead of a traceback. Loading
the model (:func:`gspo.models.load_model`, building the policy) says the same way which
model, in which dtype, onto which device, and what lowers it
(:func:`gspo.models.loading.loading_model`).
Set ``GSPO_DEBUG=1`` for torch's own error and traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from gspo.config import Config
from gspo.models.loading import loading_model
from gspo.models.memory import OutOfMemory, is_out_of_memory, what_ran_out

__all__ = ["OutOfMemory", "is_out_of_memory", "loading_model", "out_of_memory"]


def _generation(config: Config) -> str:
    r = config.rollout
    lower = [
        f"rollout.prompts_per_batch ({r.prompts_per_batch})",
        f"rollout.group_size ({r.group_size})",
        f"rollout.max_new_tokens ({r.max_new_tokens})",
    ]
    if r.environment is not None:
        lower.append(f"rollout.max_episode_tokens ({r.max_episode_tokens or 'unset'})")
    advice = f"lower {', '.join(lower[:-1])} or {lower[-1]}: the sampled batch holds them all"
    return advice + _static_decoder(config)


def _static_decoder(config: Config) -> str:
    """The advice where the torch engine may keep its static decode step's buffers (the
    KV cache of a whole rollout batch, the graphs' memory) from one rollout batch to the
    next, the update included: ``rollout.cuda_graphs`` off frees them after each call."""
    r = config.rollout
    auto = r.cuda_graphs == "auto"  # on CUDA only (the loop elsewhere, which keeps nothing)
    off = auto and (config.model.device == "cpu" or not torch.cuda.is_available())
    if r.engine != "torch" or r.cuda_graphs is False or off:
        return ""
    return (
        f"; rollout.cuda_graphs ({str(r.cuda_graphs).lower()}) keeps the decode step's KV "
        f"cache and graphs between rollout batches{' for a dense model' if auto else ''}: "
        "false frees them after each"
    )


def _per_minibatch(config: Config) -> str:
    a, r = config.algorithm, config.rollout
    advice = (
        f"raise algorithm.minibatches ({a.minibatches}) so that each forward holds fewer "
        f"responses, or lower rollout.max_new_tokens ({r.max_new_tokens}) or "
        f"rollout.prompts_per_batch ({r.prompts_per_batch})"
    )
    if config.model.lora.r == 0:
        advice += "; LoRA adapters (model.lora.r) train with far less optimizer state"
    if r.engine == "vllm":
        advice += (
            f"; vLLM holds rollout.vllm.gpu_memory_utilization "
            f"({r.vllm.gpu_memory_utilization}) of the GPU"
        )
    return advice


def _checkpointing(config: Config) -> str:
    """The advice for a stage with gradients: activation checkpointing, if it is off."""
    if config.model.activation_checkpointing:
        return ""
    return (
        "; model.activation_checkpointing=true keeps one transformer block's activations "
        "instead of all of them"
    )


def _update(config: Config) -> str:
    return _per_minibatch(config) + _checkpointing(config) + _static_decoder(config)


def _cold_start(config: Config) -> str:
    advice = f"lower train.cold_start_batch_size ({config.train.cold_start_batch_size})"
    return advice + _checkpointing(config)


#: stage -> (what it was doing, the settings that lower its memory)
STAGES: dict[str, tuple[str, Callable[[Config], str]]] = {
    "generation": ("while sampling rollouts", _generation),
    "evaluation": (
        "while sampling the held-out evaluation (in rollout-batch-sized chunks)",
        _generation,
    ),
    "rollout": ("while computing the rollout batch's pi_old log-probs", _per_minibatch),
    "update": ("in the policy update", _update),
    "cold_start": ("in the cold-start SFT", _cold_start),
}


def out_of_memory_message(stage: str, config: Config, error: BaseException) -> str:
    """One line: what ran out (torch's first sentence and the allocation), in which stage,
    and what to lower."""
    what, advice = STAGES[stage]
    return f"{what_ran_out(error)} {what}: {advice(config)}"


@contextmanager
def out_of_memory(stage: str, config: Config) -> Iterator[None]:
    """Turn an out-of-memory error inside the block into :class:`OutOfMemory`."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemory(out_of_memory_message(stage, config, exc)) from exc
