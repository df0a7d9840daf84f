"""Sharded checkpoints: the model's and the optimizer's state written and read with
``torch.distributed.checkpoint`` (DCP), each rank its own shards, by several threads, and
checked whole before a run resumes from them (a rank's shard cut short by a crash)."""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

#: Subdirectory of a checkpoint holding the sharded model and optimizer state (DCP).
SHARDED = "sharded"


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """DCP warns on every call made without a process group; one process is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trainable_only: bool = False,
) -> None:
    """Model and optimizer state with ``torch.distributed.checkpoint``: each rank its shards.

    ``trainable_only`` leaves frozen parameters out (a LoRA run writes its adapters only).

    Called by every rank (a single process writes everything). The files can be loaded
    by any number of ranks (:func:`load_sharded` reshards). An optimizer that has not
    stepped yet has no state and none is written: asking ``get_state_dict`` for it would
    initialise it with a zero-learning-rate step, which counts as Adam's first step and
    changes the bias correction of the real one. ``optimizer=None`` writes the model only.
    """
    write_sharded(path, sharded_state(model, optimizer, trainable_only=trainable_only))


def sharded_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trainable_only: bool = False,
    weights: bool = True,
) -> dict[str, Any]:
    """What :func:`save_sharded` writes, as live tensors (:func:`write_sharded` writes it).

    ``weights=False``: the optimizer state only (a training checkpoint whose whole weights
    are in its HF files, which a resumed run loads first; see
    :func:`gspo.training.checkpoint.take_checkpoint`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FSDPModule

    # FSDP keeps the root's weights gathered after a forward, for the backward that
    # follows; after a no-grad forward (a MoE run's churn measurement, the last thing of
    # a rollout batch) none follows, the module's parameters were the gathered ones, not
    # the optimizer's shards, and the first checkpoint failed (KeyError: 0)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    state: dict[str, Any] = {}
    if weights:
        state["model"] = get_model_state_dict(model, options=options)
    if optimizer is not None and optimizer.state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state


#: The most threads (and files, ``__RANK_I.distcp``) a rank writes its shards with, one
#: per :data:`BYTES_PER_WRITE_THREAD` of them: DCP's one thread wrote the ~0.5B model's
#: 4.8 GB of AdamW state, synced, in 7.8-8.2 s on a 2-core CPU, 2 threads in 1.9-2.5 s, 8 in
#: 1.7-2.0 (``benchmarks/checkpoint_write.py``; docs/training.md).
WRITE_THREADS = 8
BYTES_PER_WRITE_THREAD = 256 << 20


def write_sharded(path: Path, state: dict[str, Any], *, sync: bool = True) -> None:
    """Write :func:`sharded_state`'s ``state`` to ``path`` (every rank, together), each
    rank's shards in up to :data:`WRITE_THREADS` files written at once, each synced to the
    disk unless not ``sync``: an RL checkpoint's are not (no other file of it is, nor its
    directory, and its manifest's CRC-32s find a file a machine's crash tore when it is
    read), a cold-start progress checkpoint's are (it has no manifest)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.utils._pytree import tree_leaves

    tensors = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    nbytes = sum(getattr(t, "to_local", lambda t=t: t)().nbytes for t in tensors)
    threads = max(1, min(WRITE_THREADS, len(tensors), nbytes // BYTES_PER_WRITE_THREAD))
    writer = dcp.FileSystemWriter(path, thread_count=threads, sync_files=sync)
    try:
        with single_process_quiet(), WriterThreads() as helpers:
            metadata = dcp.save(
                state, storage_writer=writer, no_dist=not torch.distributed.is_initialized()
            )
    except CheckpointException as exc:  # (a BaseException): the failure itself, e.g. ENOSPC
        raise next(iter(exc.failures.values()))[0] from None
    if helpers.errors:  # (DCP goes on without a helper thread's files)
        raise helpers.errors[0]
    if metadata is not None and metadata.storage_data is None:  # (torch 2.11 returns it bare)
        metadata = dcp.FileSystemReader(path).read_metadata()
    if missing := unwritten(metadata):  # (every rank: the metadata is the whole run's)
        raise OSError(f"{path}: {missing} of the shards were not written (a writer failed)")


class WriterThreads:
    """``with WriterThreads() as helpers:`` around ``dcp.save`` with ``thread_count`` > 1:
    an exception in one of DCP's helper writer threads only ends that thread, and the save
    goes on and writes its metadata without that thread's files. Their exceptions are kept
    in ``helpers.errors`` (the thread's name says its target), and on leaving the block
    the helpers still running are waited for (when the save raised in its own thread it
    does not wait, and they would go on writing into a directory being removed)."""

    TARGET = "_write_files_from_queue"

    def __enter__(self) -> WriterThreads:
        self.errors: list[BaseException] = []
        self.before = set(threading.enumerate())
        self.previous = threading.excepthook

        def hook(args: threading.ExceptHookArgs) -> None:
            if args.thread is not None and self.TARGET in args.thread.name:
                self.errors.append(args.exc_value or RuntimeError(str(args.exc_type)))
            else:
                self.previous(args)

        threading.excepthook = hook
        return self

    def __exit__(self, *exc: object) -> None:
        for thread in set(threading.enumerate()) - self.before:
            if self.TARGET in thread.name and thread is not threading.current_thread():
                thread.join()
        threading.excepthook = self.previous


def unwritten(metadata: Any) -> int:
    """Items of a ``dcp.save``'s ``metadata`` that no file holds (0: all are written)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    if metadata is None:
        return 0
    stored, missing = metadata.storage_data or {}, 0
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            missing += sum(MetadataIndex(fqn, c.offsets) not in stored for c in item.chunks)
        else:
            missing += MetadataIndex(fqn) not in stored
    return missing


def load_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trainable_only: bool = False,
) -> None:
    """Load :func:`save_sharded`'s files into ``model`` and ``optimizer``, whatever the ranks.

    ``trainable_only``: the files hold the trainable parameters only (see :func:`save_sharded`).

    The optimizer is left as it is (fresh) when the checkpoint holds no optimizer state, and
    the model when it holds no weights (:func:`sharded_state`'s ``weights=False``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)
    state: dict[str, Any] = {}
    if any(key.startswith("model.") for key in saved):
        state["model"] = get_model_state_dict(model, options=options)
    if optimizer is not None and any(key.startswith("optimizer.") for key in saved):
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    with single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not torch.distributed.is_initialized())
    if "model" in state:
        set_model_state_dict(model, state["model"], options=options)
    if "optimizer" in state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def sharded_problem(path: Path, model: torch.nn.Module | None = None) -> str | None:
    """Why :func:`save_sharded`'s files in ``path`` cannot be loaded whole, or None.

    Every file its metadata names must be there, at least as long as the data it places
    in it; with ``model``, the files must hold each of its tensors (model only) at its
    shape. Reads the metadata and the files' sizes, not the tensors; no collective.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except FileNotFoundError:
        return f"{Path(path).name}/.metadata is missing"
    except Exception as exc:  # truncated or foreign: unpickling raises anything
        return f"{Path(path).name}/.metadata is unreadable ({type(exc).__name__})"
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = Path(path) / name
        if not file.is_file():
            return f"{Path(path).name}/{name} is missing"
        if file.stat().st_size < end:
            return f"{Path(path).name}/{name} is cut short"
    if model is not None:
        saved = metadata.state_dict_metadata
        for name, tensor in get_model_state_dict(model).items():
            held = saved.get(f"model.{name}")
            if not isinstance(held, TensorStorageMetadata) or held.size != tensor.size():
                return f"it holds no {name} of shape {tuple(tensor.size())}"
    return None
