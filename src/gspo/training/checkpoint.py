"""Checkpoints: their names, writing them atomically, finding and loading the latest.

``checkpoints/step-NNNNNNN`` holds the whole model in HF format with its tokenizer
(``load_model`` and serving read it; rank 0 writes it from the gathered weights),
``sharded/`` (model and optimizer state by ``torch.distributed.checkpoint``, each rank
its shards; loadable by any number of ranks) and ``trainer_state.pt`` (step, scheduler).
``checkpoints/latest`` names the newest. Step 0 is the cold-start model; when no cold
start changed the model it holds no weights, only ``model_dir.txt`` naming the input model
(``model.path`` or the built-in ``base_model``: :func:`gspo.models.model_files`), which
every reader of step 0 (:func:`gspo.models.load_model`, resume, the KL reference, export)
follows.

A LoRA run's checkpoints hold the adapter in PEFT's format instead of the whole model
(``adapter_config.json``, which names the base model directory, and
``adapter_model.safetensors``: ``PeftModel.from_pretrained`` loads them), and ``sharded/``
holds the adapters and their optimizer state only.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from gspo.distributed import SHARDED, Distributed, load_sharded, save_sharded, sharded_problem
from gspo.models import MODEL_POINTER, save_pretrained
from gspo.publish import staged
from gspo.training.lora import optimizer_state_bytes
from gspo.training.policy import Policy

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"

__all__ = ["CHECKPOINTS", "LATEST", "SHARDED", "TRAINER_STATE"]


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:07d}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def checkpoint_bytes(policy: Policy, optimizer: torch.optim.Optimizer, dist: Distributed) -> int:
    """About what a checkpoint of the run takes on disk: the trained weights twice (the HF
    files and the shards; a LoRA run's adapters only) and the optimizer state."""
    trained = (p for p in policy.parameters() if p.requires_grad or not policy.adapters)
    weights = sum(p.numel() * p.element_size() for p in trained)  # (DTensor: the whole)
    return 2 * weights + optimizer_state_bytes(optimizer) * dist.world_size


def checkpoint_problem(path: Path) -> str | None:
    """Why a run cannot resume from the checkpoint ``path``, or None when it is whole: its
    trainer state, and its shards (:func:`gspo.distributed.sharded_problem`) unless it
    names its model. Reads no tensors."""
    if not path.is_dir():
        return "missing"
    if not (path / TRAINER_STATE).is_file():
        return f"incomplete ({TRAINER_STATE} is missing)"
    if (path / MODEL_POINTER).is_file():
        return None
    problem = sharded_problem(path / SHARDED)
    return None if problem is None else f"incomplete ({problem})"


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, or ``None`` when the run has none.

    If the pointer is missing, or names a checkpoint that is gone or incomplete (damaged
    by hand, since gspo writes the pointer only after the whole checkpoint: a file
    deleted, a shard cut short), the newest whole ``step-*`` is taken instead, and said in
    one line on stderr: a resume then loses the steps after it, not the whole run.
    """
    root = Path(output_dir) / CHECKPOINTS
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    problem = checkpoint_problem(root / named) if named else None
    if named and problem is None:
        return root / named
    found, skipped = None, []
    for path in sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True):
        why = checkpoint_problem(path) if path.name != named else problem
        if why is None:
            found = path
            break
        if path.name != named:
            skipped.append(f"{path.name}, {why}")
    if found is None and not skipped and not named:
        return None  # no checkpoint at all (a run killed before its step 0)
    said = f"names {named}, which is {problem}" if named else "is missing"
    said += "".join(f"; skipping {s}" for s in skipped)
    using = f"using {found.name}" if found else "no whole checkpoint: starting again"
    print(f"gspo: {pointer} {said}; {using}", file=sys.stderr)
    return found


def save_checkpoint(
    output_dir: Path,
    step: int,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokenizer,
    *,
    keep: int,
    dist: Distributed,
    extra: Mapping[str, Any] | None = None,
    model_dir: Path | None = None,
    written: Callable[[], None] | None = None,
) -> Path:
    """Write ``checkpoints/step-NNNNNNN`` atomically: a reader sees all of it or none.

    Keeps the ``keep`` newest besides step 0. Every rank calls this at the same step.
    ``extra``: more files, ``{name: object}`` written with ``torch.save`` by rank 0 (the
    stale weights of async rollouts, :mod:`gspo.training.async_rollout`). ``model_dir``:
    the directory the policy's weights are still exactly (a full fine-tuning run before
    its first step, no cold start): the checkpoint names it instead of copying it.
    ``written()`` is called once the checkpoint is in place, before ``latest`` names it (a
    run killed in between resumes from the one before, so what it logs is redone).
    """
    final = checkpoint_dir(output_dir, step)
    root = final.parent
    if model_dir is not None:
        if policy.adapters or optimizer.state:
            raise ValueError(f"checkpoint at step {step}: only an untrained full model is named")
        model_dir = Path(model_dir).resolve()
        inside = model_dir.is_relative_to(Path(output_dir).resolve())
        pointer = os.path.relpath(model_dir, final.resolve()) if inside else str(model_dir)
    finite = all(  # this rank's shards (DTensor.to_local under FSDP)
        bool(torch.isfinite(getattr(p, "to_local", lambda p=p: p)()).all())
        for p in policy.parameters()
    )
    if not all(dist.gather_objects(finite)):
        raise ValueError(
            f"checkpoint at step {step} not written: the weights hold NaN or inf "
            f"(the previous checkpoint under {root} is intact)"
        )
    needs = checkpoint_bytes(policy, optimizer, dist) if model_dir is None else None
    # every rank's shards and rank 0's files, or nothing; a full disk is one line
    with staged(final, dist, needs=needs) as tmp:
        if model_dir is None:
            save_sharded(tmp / SHARDED, policy.forward, optimizer, trainable_only=policy.adapters)
            replica = policy.replica()
            if dist.is_main:
                save_pretrained(replica, tokenizer, tmp)
        elif dist.is_main:
            (tmp / MODEL_POINTER).write_text(pointer + "\n")
        if dist.is_main:
            for name, obj in (extra or {}).items():
                torch.save(obj, tmp / name)
            torch.save({"scheduler": scheduler.state_dict(), "step": step}, tmp / TRAINER_STATE)
    if written is not None:
        written()
    if dist.is_main:
        write_atomic(root / LATEST, final.name)
        # step 0 (the cold-start model) stays: the KL reference and RL's starting point
        start = checkpoint_dir(output_dir, 0).name
        older = sorted(p for p in root.glob("step-*") if p.name != start)
        for stale in older[:-keep]:
            shutil.rmtree(stale)
    dist.barrier()
    return final


def load_checkpoint(
    path: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restore model, optimizer and scheduler state from ``path``; its step.

    A checkpoint naming its model (``model_dir.txt``) has nothing to restore but the
    scheduler: the policy was loaded from that model, and the optimizer had not stepped.
    """
    if not (path / MODEL_POINTER).is_file():
        load_sharded(path / SHARDED, policy.forward, optimizer, trainable_only=policy.adapters)
    if policy.adapters:
        policy.stepped()  # the adapters just changed: engines and the replica must resync
    state = torch.load(path / TRAINER_STATE, map_location=policy.device, weights_only=True)
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])
