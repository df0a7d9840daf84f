"""Checkpoints: their names, writing them atomically, finding and loading the latest.

``checkpoints/step-NNNNNNN`` holds the whole model in HF format with its tokenizer
(``load_model`` and serving read it; rank 0 writes it from the gathered weights),
``sharded/`` (the optimizer state, and a LoRA run's adapters, by ``torch.distributed.
checkpoint``, each rank its shards; loadable by any number of ranks; none in a
``train.save_only_model`` checkpoint) and ``trainer_state.pt`` (step, scheduler).
``config.yaml`` is the run's config as it trained up to that step (a resume compares its
settings with it, whatever the run's own ``config.yaml`` says since: :func:`gspo.runs.
check_same_model`). ``manifest.json`` records every file's size and CRC-32 (:func:`gspo.publish.
write_manifest`, in the writer's thread): whoever reads a checkpoint checks the files it
reads first (:func:`gspo.models.load_model` the model's, :func:`load_checkpoint` the rest),
so bytes changed after writing are one line naming the file.
``checkpoints/latest`` names the newest. Step 0 is the cold-start model; when no cold
start changed the model it holds no weights, only ``model_dir.txt`` naming the input model
(``model.path`` or the built-in ``base_model``: :func:`gspo.models.model_files`), which
every reader of step 0 (:func:`gspo.models.load_model`, resume, the KL reference, export)
follows, and ``model_fingerprint.json``, what that model's weight files were then, which
they check first (weights changed or gone since: a one-line error, never other weights).

A LoRA run's checkpoints hold the adapter in PEFT's format instead of the whole model
(``adapter_config.json``, which names the base model directory, and
``adapter_model.safetensors``: ``PeftModel.from_pretrained`` loads them), and ``sharded/``
holds the adapters and their optimizer state only.

A single process writes its checkpoints in a background thread (``train.
background_checkpoints``, :mod:`gspo.training.checkpoint_writes`): each is copied to CPU
memory at its step (:func:`take_checkpoint`) and written (:func:`write_checkpoint`) while
training goes on, one at a time; ``latest`` names it once it is whole (:func:`finish_checkpoint`).

With ``train.save_only_model`` a checkpoint taken once the optimizer has state holds no
``sharded/`` (the optimizer state; a LoRA run's adapters are in the PEFT files) nor the
async rollouts' stale weights, and :data:`MODEL_ONLY` says so: ``gspo export`` and
:func:`gspo.models.load_model` read it as any other; a resume from it is refused
(:func:`resume_problem`). Step 0 has no optimizer state yet and is written whole.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import zlib
from collections.abc import Callable, Container, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy
import torch

from gspo.distributed import Distributed
from gspo.models import (
    MODEL_FINGERPRINT,
    MODEL_POINTER,
    is_model_file,
    model_fingerprint,
    save_pretrained,
)
from gspo.publish import (
    WRITTEN,
    DamagedFile,
    check_manifest,
    manifest_changes,
    staged,
    write_atomic,
    write_manifest,
)
from gspo.sharded import SHARDED, load_sharded, sharded_problem, sharded_state, write_sharded
from gspo.training.lora import base_path_of, optimizer_state_bytes
from gspo.training.policy import Policy

CHECKPOINTS = "checkpoints"
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
CONFIG = "config.yaml"
#: In a checkpoint written with ``train.save_only_model``: it holds the model, not the
#: optimizer state a resume needs.
MODEL_ONLY = "model_only.txt"

__all__ = ["CHECKPOINTS", "LATEST", "SHARDED", "TRAINER_STATE"]


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return Path(output_dir) / CHECKPOINTS / f"step-{step:07d}"


def checkpoint_bytes(
    policy: Policy, optimizer: torch.optim.Optimizer, dist: Distributed, *, model_only: bool = False
) -> int:
    """About what a checkpoint of the run takes on disk: the weights once (the HF files; a
    LoRA run's adapters twice, in the shards too) and the optimizer state; ``model_only``:
    the HF files alone."""
    trained = (p for p in policy.parameters() if p.requires_grad or not policy.adapters)
    weights = sum(p.numel() * p.element_size() for p in trained)  # (DTensor: the whole)
    if model_only:
        return weights
    copies = 2 if policy.adapters else 1
    return copies * weights + optimizer_state_bytes(optimizer) * dist.world_size


def checkpoint_problem(path: Path) -> str | None:
    """Why a run cannot resume from the checkpoint ``path``, or None when it is whole: its
    trainer state, its shards (:func:`gspo.sharded.sharded_problem`) unless it names
    its model, and every file at the size its manifest records. Reads no tensors (the
    bytes themselves are checked as they are loaded)."""
    if not path.is_dir():
        return "missing"
    if not (path / TRAINER_STATE).is_file():
        return f"incomplete ({TRAINER_STATE} is missing)"
    whole = (path / MODEL_POINTER).is_file() or (path / MODEL_ONLY).is_file()
    problem = None if whole else sharded_problem(path / SHARDED)
    if problem is None:
        changes = manifest_changes(path, contents=False, required=True)
        problem = next((f"{n} {w}" for n, w in changes), None)
    return None if problem is None else f"incomplete ({problem})"


def resume_problem(path: Path) -> str | None:
    """Why a run cannot continue from the whole checkpoint ``path`` (one line), or None:
    it holds only the model (:data:`MODEL_ONLY`, ``train.save_only_model``)."""
    if not (path / MODEL_ONLY).is_file():
        return None
    return (
        f"{path} holds only the model (written with train.save_only_model=true: no optimizer "
        f"state), so the run cannot be resumed from it; start {new_run_from(path)} (its "
        "optimizer starts afresh)"
    )


def new_run_from(path: Path) -> str:
    """How a new run starts from the model-only checkpoint ``path`` (a LoRA run's exported
    first: model.path takes no adapter)."""
    if (path / "adapter_config.json").is_file():
        return f"gspo export {path} --merge OUT, then a new run with model.path=OUT"
    return f"a new run with model.path={path}"


def resumable_checkpoint(output_dir: Path) -> Path | None:
    """:func:`latest_checkpoint`, a one-line ``ValueError`` where the run cannot continue
    from it (:func:`resume_problem`), said before any model is loaded."""
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None and (problem := resume_problem(checkpoint)) is not None:
        raise ValueError(f"resume: {problem}")
    return checkpoint


def same_on_every_rank(checkpoint: Path | None, dist: Distributed) -> Path | None:
    """``checkpoint`` (the one a resume starts from, :func:`resumable_checkpoint`), once
    every rank found the same one (its name and manifest); else a one-line ``ValueError``
    naming each rank's. Each rank reads the run under its own ``--output-dir``: a node
    whose copy was not the others' (no filesystem shared, a stale copy) loaded other
    weights and step, trained on with wrong numbers logged, then aborted (SIGABRT) once
    its collectives no longer matched."""
    if not dist.enabled:
        return checkpoint
    manifest = None if checkpoint is None else checkpoint / "manifest.json"
    seen = (
        None if checkpoint is None else checkpoint.name,
        zlib.crc32(manifest.read_bytes()) if manifest is not None and manifest.is_file() else None,
    )
    found = dist.gather_objects((seen, str(checkpoint) if checkpoint else "no checkpoint"))
    if len({views for views, _ in found}) > 1:
        each = ", ".join(f"rank {r}: {where}" for r, (_, where) in enumerate(found))
        raise ValueError(
            f"resume: the ranks found different checkpoints ({each}): every rank resumes the "
            "same run, so its directory must be the same for all (under torchrun on several "
            "nodes, on a filesystem every node shares)"
        )
    return checkpoint


def latest_named(output_dir: Path) -> tuple[str | None, str | None]:
    """``(name, problem)``: the checkpoint ``checkpoints/latest`` names (None: no pointer)
    and what is wrong with it (:func:`checkpoint_problem`; None: it is whole)."""
    root = Path(output_dir) / CHECKPOINTS
    pointer = root / LATEST
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
    if named is not None and (Path(named).name != named or not named.startswith("step-")):
        return named, "not a checkpoint of this run"  # ("../../other/checkpoints/step-12")
    return named, checkpoint_problem(root / named) if named else None


def run_path(output_dir: Any, resume: bool) -> Path:
    """``Trainer``'s ``output_dir`` as a Path: one that holds a run's checkpoints is
    refused unless resumed (a Trainer made there from Python replaced the run's metrics,
    config and checkpoints, unsaid: ``gspo.train`` refuses it, or with ``overwrite=True``
    sets the old run aside before the trainer is made)."""
    if not isinstance(output_dir, str | os.PathLike) or not str(output_dir):
        raise ValueError(f"output_dir: {output_dir!r} is no directory path")
    out = Path(output_dir)
    if not resume and any((out / CHECKPOINTS).glob("step-*")):
        raise ValueError(
            f"output_dir {out} already holds a run (its checkpoints): resume=True continues "
            "it; gspo.train(config, output_dir, overwrite=True) replaces it"
        )
    return out


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, or ``None`` when the run has none.

    If the pointer is missing, or names a checkpoint that is gone or incomplete (damaged
    by hand, since gspo writes the pointer only after the whole checkpoint: a file
    deleted, a shard cut short), the newest whole ``step-*`` is taken instead, and said in
    one line on stderr: a resume then loses the steps after it, not the whole run.
    """
    root = Path(output_dir) / CHECKPOINTS
    pointer = root / LATEST
    named, problem = latest_named(output_dir)
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


@dataclass
class CheckpointState:
    """What one checkpoint writes, taken at its step (:func:`take_checkpoint`): the live
    tensors, or copies in CPU memory that :func:`write_checkpoint` may write while
    training changes the live ones."""

    final: Path
    step: int
    needs: int | None  # the bytes it is expected to take (None: a pointer only)
    pointer: str | None  # ``model_dir.txt``'s line, for a checkpoint naming its model
    fingerprint: dict[str, Any] | None  # that model's weight files (rank 0)
    sharded: dict[str, Any] | None  # model and optimizer state for ``sharded/``
    replica: torch.nn.Module | None  # the HF module whose config and class are written
    weights: dict[str, Any] | None  # its weights (rank 0)
    tokenizer: Any
    files: dict[str, Any]  # name -> object for ``torch.save`` (rank 0)
    config: str = ""  # the run's config as YAML text (:data:`CONFIG`; rank 0)
    model_only: bool = False  # no ``sharded/``, no extra files: :data:`MODEL_ONLY`


def take_checkpoint(
    output_dir: Path,
    step: int,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokenizer,
    *,
    dist: Distributed,
    extra: Mapping[str, Any] | None = None,
    model_dir: Path | None = None,
    copy: bool = False,
    config: str = "",
    model_only: bool = False,
) -> CheckpointState:
    """The checkpoint of this step, to be written by :func:`write_checkpoint`.

    Every rank calls it at the same step (a collective under torchrun: the finite check,
    the gathered replica). ``copy``: the tensors are copied to CPU memory (a snapshot,
    see :func:`snapshot`), else the live ones are referenced and must be written before
    training goes on. ``extra`` is taken as it is: the async rollouts' stale weights are
    CPU copies that nothing changes (:meth:`gspo.training.async_rollout.AsyncRollouts.
    checkpoint_files`). ``config``: the run's config as YAML text, written as
    :data:`CONFIG`. ``model_only`` (``train.save_only_model``): once the optimizer has
    state, neither it nor ``extra`` is written, and :data:`MODEL_ONLY` says so (before,
    there is nothing to leave out: the checkpoint stays resumable). A non-finite weight is
    a one-line ``ValueError``.
    """
    final = checkpoint_dir(output_dir, step)
    pointer = fingerprint = None
    if model_dir is not None:
        if policy.adapters or optimizer.state:
            raise ValueError(f"checkpoint at step {step}: only an untrained full model is named")
        model_dir = Path(model_dir).resolve()
        inside = model_dir.is_relative_to(Path(output_dir).resolve())
        pointer = os.path.relpath(model_dir, final.resolve()) if inside else str(model_dir)
        fingerprint = model_fingerprint(model_dir) if dist.is_main else None
    model_only = model_only and bool(optimizer.state) and model_dir is None
    trainer_state = {"scheduler": deepcopy(scheduler.state_dict()), "step": step}
    extra = {} if model_only else extra or {}
    files = {**extra, TRAINER_STATE: trainer_state} if dist.is_main else {}
    state = CheckpointState(
        final, step, None, pointer, fingerprint, None, None, None, tokenizer, files, config,
        model_only,
    )  # fmt: skip
    if model_dir is not None:  # no weights written: none to check
        return state
    # this rank's shards (DTensor.to_local under FSDP)
    finite = all_finite(getattr(p, "to_local", lambda p=p: p)() for p in policy.parameters())
    if not all(dist.gather_objects(finite)):
        raise ValueError(
            f"checkpoint at step {step} not written: the weights hold NaN or inf "
            f"(the previous checkpoint under {final.parent} is intact)"
        )
    state.needs = checkpoint_bytes(policy, optimizer, dist, model_only=model_only)
    # the shards: the optimizer state (and a LoRA run's adapters); a full model's weights
    # are in the HF files alone, which a resumed run loads the model from (whatever ranks)
    adapters = policy.adapters
    if not model_only:
        state.sharded = sharded_state(
            policy.forward, optimizer, trainable_only=adapters, weights=adapters
        )
    state.replica = policy.replica()
    if dist.is_main:
        state.weights = state.replica.state_dict()
        if adapters:  # the base the adapters were trained on (checked by base_model_path)
            state.fingerprint = model_fingerprint(base_path_of(policy.module))
    if copy:
        # the frozen weights (a LoRA run's base) never change: referenced, not copied
        frozen = {p.untyped_storage().data_ptr() for p in policy.parameters()}
        frozen -= {p.untyped_storage().data_ptr() for p in policy.parameters() if p.requires_grad}
        state.sharded, state.weights = snapshot((state.sharded, state.weights), skip=frozen)
    return state


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite: each one's least and greatest value are
    (``torch.aminmax`` propagates NaN), read in one pass without a mask the size of the
    weights (with ``torch.isfinite(p).all()`` taking a ~0.5B model's checkpoint took 0.5-2.0 s
    on a 2-core CPU, 0.07-0.08 s with this: docs/training.md), and waited for once."""
    finite = [torch.isfinite(torch.stack(torch.aminmax(t))).all() for t in tensors if t.numel()]
    return not finite or bool(torch.stack(finite).all())


def snapshot(obj: Any, *, skip: Container[int] = ()) -> Any:
    """``obj`` (nested dicts, lists and tuples) with every tensor copied to CPU memory.

    Tensors that share memory share it in the copy too (tied weights stay tied, so the
    files written from it are the ones written from the live tensors). Tensors whose
    storage's address is in ``skip`` are kept as they are. CPU memory is copied by numpy,
    one plain copy in this thread (torch's copy wakes its thread pool for every tensor,
    ~10 ms each on a busy 2-core machine); CUDA memory asynchronously into pinned memory.
    """
    memo: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    cuda = False

    def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def copied(t: torch.Tensor) -> torch.Tensor:
        nonlocal cuda
        storage = t.untyped_storage()
        if storage.data_ptr() in skip:
            return t
        key = (t.device, storage.data_ptr())
        if key not in memo:
            source = as_bytes(storage)
            buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=t.is_cuda)
            if t.is_cuda:
                cuda = True
                buffer.copy_(source, non_blocking=True)
            else:
                numpy.copyto(buffer.numpy(), source.numpy())
            memo[key] = buffer.untyped_storage()
        view = torch.empty(0, dtype=t.dtype)
        return view.set_(memo[key], t.storage_offset(), t.size(), t.stride())

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return copied(x.detach())
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(walk(v) for v in x)
        return deepcopy(x)

    result = walk(obj)
    if cuda:
        torch.cuda.synchronize()  # the non-blocking copies are done before anyone reads them
    return result


def write_checkpoint(
    state: CheckpointState, dist: Distributed
) -> tuple[int, float, dict[str, float]]:
    """Write ``state`` to ``checkpoints/step-NNNNNNN`` atomically: a reader sees all of it or
    none; a full disk is one :class:`gspo.publish.DiskFull` line. Every rank calls it
    together, in any thread (a single process's may be a background one). Its bytes (rank 0's
    count), seconds, and the seconds of its parts (this rank's): ``model`` (the HF files,
    written beside the shards), ``sharded`` (the shards: the optimizer state, a LoRA run's
    adapters) and ``manifest`` (the files' CRC-32s, read back), each where there is one."""
    start, before = time.perf_counter(), WRITTEN.bytes
    parts: dict[str, float] = {}

    def part(name: str, fn: Callable[..., Any], *args, **kwargs) -> None:
        begin = time.perf_counter()
        fn(*args, **kwargs)
        parts[name] = time.perf_counter() - begin

    # every rank's shards and rank 0's files, or nothing
    with staged(state.final, dist, needs=state.needs) as tmp, ThreadPoolExecutor(1) as pool:
        # the HF weights (rank 0) written beside the shards (every rank's collective)
        weights = None
        if dist.is_main and state.replica is not None:
            weights = pool.submit(
                part, "model", save_pretrained, state.replica, state.tokenizer, tmp,
                state_dict=state.weights,
            )  # fmt: skip
        if state.sharded is not None:
            # not synced: no other file is, and the manifest finds a torn one when read
            part("sharded", write_sharded, tmp / SHARDED, state.sharded, sync=False)
        if weights is not None:
            weights.result()
        if dist.is_main:
            if state.replica is None:
                (tmp / MODEL_POINTER).write_text(f"{state.pointer}\n")
            if state.fingerprint is not None:  # the model named, or a LoRA run's base
                (tmp / MODEL_FINGERPRINT).write_text(json.dumps(state.fingerprint) + "\n")
            for name, obj in state.files.items():
                torch.save(obj, tmp / name)
            if state.config:
                (tmp / CONFIG).write_text(state.config)
            if state.model_only:
                (tmp / MODEL_ONLY).write_text(
                    "written with train.save_only_model=true: the model only, no optimizer "
                    "state; gspo export reads it, a resume cannot continue from it\n"
                )
            # (last: every rank's shards are written, dcp.save waits)
            part("manifest", write_manifest, tmp)
    return WRITTEN.bytes - before, time.perf_counter() - start, parts


def finish_checkpoint(output_dir: Path, final: Path, *, keep: int, dist: Distributed) -> None:
    """``checkpoints/latest`` names the checkpoint ``final``, written whole; the ``keep``
    newest besides step 0 stay. Every rank calls this together."""
    root = final.parent
    if dist.is_main:
        write_atomic(root / LATEST, final.name)
        # step 0 (the cold-start model) stays: the KL reference and RL's starting point
        start = checkpoint_dir(output_dir, 0).name
        older = sorted(p for p in root.glob("step-*") if p.name != start)
        for stale in older[:-keep]:
            shutil.rmtree(stale)
    dist.barrier()


def trainer_state(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint's ``trainer_state.pt`` (its step, the scheduler's state, ...); a file
    that cannot be read is a one-line :class:`gspo.publish.DamagedFile`."""
    try:
        state = torch.load(path / TRAINER_STATE, map_location=map_location, weights_only=True)
        int(state["step"])
    except Exception as exc:  # any unpickling failure: one line
        raise DamagedFile(
            f"{path / TRAINER_STATE} is unreadable ({type(exc).__name__}): {path} was damaged "
            "after it was written; delete it to go back to the checkpoint before it"
        ) from None
    return state


def load_checkpoint(
    path: Path,
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restore the optimizer and scheduler state (and a LoRA run's adapters) from ``path``
    into a policy built from it; its step.

    A full model's weights are not restored here: ``policy`` was loaded from the
    checkpoint's HF files (older checkpoints' shards hold them too, and are loaded). A
    checkpoint naming its model (``model_dir.txt``) has nothing to restore but the
    scheduler: the policy was loaded from that model, and the optimizer had not stepped.
    Its files are checked against its manifest first (the HF model's were, when it was
    loaded): a damaged one is a one-line :class:`gspo.publish.DamagedFile`.
    """
    if (problem := resume_problem(path)) is not None:
        raise ValueError(problem)
    check_manifest(path, lambda name: not is_model_file(name))
    if not (path / MODEL_POINTER).is_file():
        load_sharded(path / SHARDED, policy.forward, optimizer, trainable_only=policy.adapters)
    if policy.adapters:
        policy.stepped()  # the adapters just changed: engines and the replica must resync
    state = trainer_state(path, policy.device)  # (checked above unless its manifest went too)
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])
