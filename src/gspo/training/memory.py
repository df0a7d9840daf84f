"""Out of memory: one line that names the stage and the settings that lower it.

An out-of-memory error (:func:`is_out_of_memory`: CUDA's, the CPU allocator's, Python's
``MemoryError``) raised inside a stage of the run (generation, pi_old's recompute, the
policy update, the cold start) becomes :class:`OutOfMemory`, whose message says what ran
out, in which stage, and which settings to lower there (with their current values); the
``gspo`` command prints it as one line, like bad input, instead of a traceback. Loading
the model (:func:`gspo.models.load_model`, building the policy) says the same way which
model, in which dtype, onto which device, and what lowers it (:func:`loading_model`).
Set ``GSPO_DEBUG=1`` for torch's own error and traceback.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from gspo.config import Config
from gspo.publish import megabytes


class OutOfMemory(ValueError):
    """The device ran out of memory in one stage of a run; the message names the settings
    that lower that stage's memory. A ``ValueError``, so the CLI ends with it as one line
    (exit status 2)."""


def _generation(config: Config) -> str:
    r = config.rollout
    lower = [
        f"rollout.prompts_per_batch ({r.prompts_per_batch})",
        f"rollout.group_size ({r.group_size})",
        f"rollout.max_new_tokens ({r.max_new_tokens})",
    ]
    if r.environment is not None:
        lower.append(f"rollout.max_episode_tokens ({r.max_episode_tokens or 'unset'})")
    return f"lower {', '.join(lower[:-1])} or {lower[-1]}: the sampled batch holds them all"


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


def _cold_start(config: Config) -> str:
    return f"lower train.cold_start_batch_size ({config.train.cold_start_batch_size})"


#: stage -> (what it was doing, the settings that lower its memory)
STAGES: dict[str, tuple[str, Callable[[Config], str]]] = {
    "generation": ("while sampling rollouts", _generation),
    "evaluation": (
        "while sampling the held-out evaluation (in rollout-batch-sized chunks)",
        _generation,
    ),
    "rollout": ("while computing the rollout batch's pi_old log-probs", _per_minibatch),
    "update": ("in the policy update", _per_minibatch),
    "cold_start": ("in the cold-start SFT", _cold_start),
}


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is running out of memory: torch's ``OutOfMemoryError`` (CUDA), the
    ``RuntimeError`` of its CPU allocator (``DefaultCPUAllocator: can't allocate memory``)
    or Python's ``MemoryError``."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and "DefaultCPUAllocator" in str(error)


def _what_ran_out(error: BaseException) -> str:
    """torch's first sentence (``CUDA out of memory``) and the allocation it tried."""
    text = str(error)
    cpu = re.search(r"tried to allocate (\d+) bytes", text)
    if isinstance(error, MemoryError) or cpu or "DefaultCPUAllocator" in text:
        said = "out of CPU memory"
        return f"{said} (tried to allocate {int(cpu.group(1)) / 2**30:.2f} GiB)" if cpu else said
    said = text.split(".")[0].strip() or "out of memory"
    size = re.search(r"Tried to allocate ([\d.]+ ?[KMGTP]?i?B)", text)
    return f"{said} (tried to allocate {size.group(1)})" if size else said


def out_of_memory_message(stage: str, config: Config, error: BaseException) -> str:
    """One line: what ran out (torch's first sentence and the allocation), in which stage,
    and what to lower."""
    what, advice = STAGES[stage]
    return f"{_what_ran_out(error)} {what}: {advice(config)}"


@contextmanager
def out_of_memory(stage: str, config: Config) -> Iterator[None]:
    """Turn an out-of-memory error inside the block into :class:`OutOfMemory`."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemory(out_of_memory_message(stage, config, exc)) from exc


def _weight_bytes(path: Path) -> int:
    from gspo.models.loading import WEIGHT_SUFFIXES

    files = path.iterdir() if path.is_dir() else ()
    return sum(f.stat().st_size for f in files if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def loading_message(
    path: str | Path, dtype: torch.dtype, device: torch.device, error: BaseException
) -> str:
    """One line: what ran out loading the model ``path`` in ``dtype`` onto ``device`` (and
    how large its weight files are), and what lowers the model's memory."""
    size = _weight_bytes(Path(path))
    files = f", {megabytes(size)} of weight files" if size else ""
    name = str(dtype).removeprefix("torch.")
    why = ""
    if dtype == torch.float32:
        why = " (gspo loads a model in float32 whatever model.dtype, the compute dtype)"
    return (
        f"{_what_ran_out(error)} loading the model {os.path.normpath(path)} "
        f"({name} on {device}{files}){why}: "
        "pick a smaller model (model.path) or a device with more memory (model.device); "
        "full fine-tuning then adds gradients and AdamW's two moments, about 3x the "
        "weights: LoRA adapters (model.lora.r > 0) train far fewer, their frozen base "
        "held in model.dtype on CUDA (bfloat16: half of float32)"
    )


@contextmanager
def loading_model(path: str | Path, *, dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Turn an out-of-memory error inside the block, which loads the model ``path`` in
    ``dtype`` onto ``device`` (or builds the policy from it), into :class:`OutOfMemory`."""
    try:
        yield
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfMemory(loading_message(path, dtype, device, exc)) from exc
