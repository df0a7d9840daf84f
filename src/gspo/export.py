"""``gspo export RUN_OR_CHECKPOINT [--step N] [--merge OUT [--dtype D]]``: one HF model.

A LoRA checkpoint holds only the adapter (PEFT format) and names its base model; export
loads the base, loads the adapter onto it with ``PeftModel.from_pretrained`` and writes
``merge_and_unload()``'s model with the tokenizer, atomically, so that serving stacks that
know nothing of adapters (vLLM, transformers, llama.cpp converters) can load it. A full
fine-tuning checkpoint is already a whole model: it is written out as it is, or, without
``--merge``, named (:func:`plain_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch

from gspo.models import (
    MODEL_POINTER,
    is_model_file,
    load_model,
    model_files,
    save_pretrained_atomic,
)
from gspo.moved import in_checkpoint
from gspo.publish import DiskFull, check_manifest
from gspo.training.checkpoint import (
    CHECKPOINTS,
    TRAINER_STATE,
    checkpoint_dir,
    latest_checkpoint,
    latest_named,
    trainer_state,
)
from gspo.training.lora import ADAPTER_CONFIG, base_model_path, is_lora_checkpoint, quiet_peft

#: The file that marks a directory as a ``gspo export --merge`` output (what it came
#: from): the only non-empty directory an export may replace.
EXPORT_MARK = "gspo_export.json"


def resolve_checkpoint(source: Path, command: str = "export", step: int | None = None) -> Path:
    """``source`` itself if it is a checkpoint, else the latest checkpoint of the run in it,
    or its checkpoint of RL step ``step`` (``--step``; errors begin with ``command``:
    ``gspo export``'s, ``gspo eval``'s).

    A run whose ``latest`` names a damaged checkpoint is refused: a run resumes from the
    newest whole one instead, but an export of an older model, said on stderr with
    status 0, would be deployed as the run's."""
    source = Path(source)
    if (source / TRAINER_STATE).is_file():
        if step is not None:
            raise ValueError(
                f"{command}: --step with the checkpoint {source}: pass its run instead"
            )
        return source
    if step is not None and ((source / CHECKPOINTS).is_dir() or (source / "config.yaml").is_file()):
        chosen = checkpoint_dir(source, step)
        if not (chosen / TRAINER_STATE).is_file():
            steps = sorted(
                int(p.name.removeprefix("step-"))
                for p in (source / CHECKPOINTS).glob("step-*")
                if (p / TRAINER_STATE).is_file()
            )
            held = ", ".join(map(str, steps)) or "none"
            raise FileNotFoundError(
                f"{command}: --step {step}: {source} holds no checkpoint of that step "
                f"(steps: {held})"
            )
        return chosen
    named, problem = latest_named(source)
    if problem not in (None, "missing"):  # (deleted: the one before it, as a resume)
        raise ValueError(
            f"{command}: the latest checkpoint of {source}, {named}, is {problem}; {command} "
            f"a whole one by its step (gspo {command} {source} --step N)"
        )
    checkpoint = latest_checkpoint(source)
    if checkpoint is None:
        said = "is neither a checkpoint nor a run with one" if source.exists() else "does not exist"
        # where a checkpoint's name was mistyped, those beside it; a compare's, its runs
        there = [
            p.name for p in sorted(source.parent.glob("step-*")) if (p / TRAINER_STATE).is_file()
        ]
        runs = [str(p.parent) for p in sorted(source.glob("runs/*/checkpoints"))]
        if there:
            said += f" ({source.parent} holds {', '.join(there)})"
        elif runs:
            said += f" (runs inside it: {', '.join(runs)})"
        raise FileNotFoundError(f"{command}: {source} {said}")
    return checkpoint


def models_read(checkpoint: Path) -> list[Path]:
    """The model directories that the checkpoints of ``checkpoint``'s run read their
    weights from: a LoRA adapter's base, a step 0's :data:`MODEL_POINTER` target."""
    run = checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None
    steps = sorted(run.joinpath(CHECKPOINTS).glob("step-*")) if run else [checkpoint]
    found = []
    for step in steps:
        pointer, adapter = step / MODEL_POINTER, step / ADAPTER_CONFIG
        if pointer.is_file():
            found.append((step, step / pointer.read_text().strip()))
        if adapter.is_file():  # (a damaged adapter says so when it is read)
            with contextlib.suppress(OSError, ValueError, KeyError):
                base = json.loads(adapter.read_text())["base_model_name_or_path"]
                found.append((step, Path(base)))
    # as the run reads them: where they are now, if the run moved together with them
    return [in_checkpoint(path, step).resolve() for step, path in found]


def is_run(path: Path) -> bool:
    """Whether ``path`` is a gspo run's directory (its config and checkpoints)."""
    return (path / "config.yaml").is_file() and (path / CHECKPOINTS).is_dir()


def check_target(out: Path, source: Path, checkpoint: Path) -> None:
    """Refuse an ``out`` whose replacement would lose anything but an earlier export.

    The export replaces ``out`` whole (atomically), so ``out`` may be new, empty, or an
    earlier export (it holds :data:`EXPORT_MARK`); never the run or checkpoint being
    exported, a directory holding them, a model its checkpoints read (an earlier export
    may be the base a LoRA run trained on), a place inside a run, nor any other directory
    or file (a model directory without the mark may be the user's own model).
    """
    out = Path(out)
    target = out.resolve()
    for kept in (Path(source).resolve(), checkpoint.resolve()):
        if kept == target or kept.is_relative_to(target):
            raise ValueError(f"export: --merge {out} would overwrite {kept}, which is exported")
    for model in models_read(checkpoint):
        if model == target or model.is_relative_to(target):
            raise ValueError(
                f"export: --merge {out} would overwrite {model}, the model the checkpoints of "
                f"{source} are built on; name a new or empty directory"
            )
    run = next((p for p in target.parents if is_run(p)), None)
    if run is not None:
        raise ValueError(
            f"export: --merge {out} is inside the run {run}, whose checkpoints it would mix "
            "with; name a directory outside it"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"export: --merge {out} is a file; name a new or empty directory")
    # (a file on the way: its mkdir failed with "File exists")
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ValueError(f"export: --merge {out}: {above} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        earlier = (
            (out / EXPORT_MARK).is_file()
            and not (out / TRAINER_STATE).exists()
            and not (out / "checkpoints").exists()
        )
        if not earlier:
            raise ValueError(
                f"export: --merge {out} exists and is not an earlier export (no {EXPORT_MARK}: "
                "it may be a model of yours); name a new or empty directory"
            )


def plain_checkpoint(source: Path, step: int | None = None) -> Path:
    """The checkpoint of ``source`` (``step``'s) when it is a whole HF model already (full
    fine-tuning); a one-line error saying to pass ``--merge OUT`` for a LoRA adapter."""
    checkpoint = resolve_checkpoint(source, step=step)
    model = model_files(checkpoint)
    if model != checkpoint:  # a step 0 that names its model instead of holding a copy
        model = Path(os.path.normpath(model))
        if not model.is_dir():  # (it was named all the same, gone: the audit)
            raise ValueError(
                f"export: {checkpoint} holds no copy of its model, and the one it names, "
                f"{model}, is gone (moved or removed); put it back there"
            )
        return model
    if is_lora_checkpoint(checkpoint):
        raise ValueError(
            f"export: {checkpoint} holds a LoRA adapter, not a whole model; pass --merge OUT "
            "to write the base with the adapter merged in to the directory OUT"
        )
    check_manifest(checkpoint, is_model_file)  # the files named are the files written
    return checkpoint


def kept_until(checkpoint: Path) -> str:
    """What ``gspo export`` without ``--merge`` adds to a step checkpoint's path: its run
    removes it once it has ``train.keep_checkpoints`` newer ones (it named a directory a
    resumed run removed, unsaid); "" for anything else (step 0 stays)."""
    run = checkpoint.parent.parent
    if checkpoint.parent.name != CHECKPOINTS or checkpoint == checkpoint_dir(run, 0):
        return ""
    return (
        "; its run removes it once it has train.keep_checkpoints newer ones (a resume): "
        "--merge OUT writes a copy of its own"
    )


def trained_model(run: Path) -> str:
    """Where a run's trained model is, for the line a finished ``gspo train`` ends with
    (TRL writes its model into output_dir: where gspo's was, the docs alone said): its
    latest checkpoint, a Hugging Face model directory (a LoRA run's: its adapters, which
    ``gspo export --merge`` makes one model); "" where it has none."""
    checkpoint = latest_checkpoint(run)
    if checkpoint is None:
        return ""
    if is_lora_checkpoint(checkpoint):
        return f"; its adapters: {checkpoint} (gspo export {run} --merge OUT writes one model)"
    try:  # (its files' sizes, not their bytes: a 70B model was read back to print a path)
        model = Path(os.path.normpath(model_files(checkpoint)))
    except ValueError:  # (a step 0's model changed or gone: gspo export says so)
        return ""
    return f"; its model: {model} (a Hugging Face model directory: from_pretrained loads it)"


def stored_dtype(model_dir: Path) -> torch.dtype:
    """The dtype ``model_dir``'s ``config.json`` says its weights are stored in (float32
    where it says none)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def exported_step(model_dir: Path) -> int:
    """The RL step of the checkpoint that ``model_dir``, a ``gspo export --merge`` output,
    was written from (its :data:`EXPORT_MARK`; an export that predates its ``step``, the
    ``step-N`` of its ``exported_from``); 0 for any other model directory."""
    try:
        mark = json.loads((model_dir / EXPORT_MARK).read_text())
        step = mark.get("step")
    except (OSError, ValueError, AttributeError):
        return 0
    if step is None and isinstance(mark.get("exported_from"), str):
        named = re.fullmatch(r"step-(\d+)", Path(mark["exported_from"]).name)
        step = int(named[1]) if named else None
    return step if isinstance(step, int) and step >= 0 else 0


def export_merged(
    source: Path, out: Path, dtype: str | None = None, step: int | None = None
) -> Path:
    """Write the whole model of ``source`` (a checkpoint, or a run's latest or ``step``'s)
    to ``out``, its weights in ``dtype`` (``"bfloat16"``; None: a LoRA merge in its base's
    dtype, a full checkpoint in float32, as trained); the checkpoint."""
    from peft import PeftModel

    checkpoint = resolve_checkpoint(source, step=step)
    check_target(out, source, checkpoint)
    cpu = torch.device("cpu")
    # its step: gspo eval of the export draws that step's evaluation seeds, as the run did
    mark: dict[str, str | int] = {
        "exported_from": str(checkpoint.resolve()),
        "step": int(trainer_state(checkpoint)["step"]),
    }
    if not is_lora_checkpoint(checkpoint):
        model, tokenizer = load_model(checkpoint, device=cpu, dtype=torch.float32)
    else:
        base_dir = base_model_path(checkpoint)
        if not base_dir.is_dir():
            raise FileNotFoundError(
                f"export: the base model {base_dir} named in {checkpoint}/adapter_config.json "
                "is missing; if it was moved, gspo train --resume RUN model.path=ITS_NEW_PLACE "
                "records where it is"
            )
        check_manifest(checkpoint, is_model_file)  # the adapter's files
        base, tokenizer = load_model(base_dir, device=cpu, dtype=torch.float32)
        with quiet_peft():
            model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
        # merged in float32, written in the base's own dtype (a bf16 base: half the bytes)
        model.to(stored_dtype(model_files(base_dir)))
        mark["base_model"] = str(base_dir.resolve())
    if dtype is not None:  # (a bf16 base trained in float32 master weights: half the bytes)
        model.to(getattr(torch, dtype))
    # the mark lets a later export replace this one (and nothing else: check_target)
    try:
        save_pretrained_atomic(
            model, tokenizer, out,
            also=lambda tmp: (tmp / EXPORT_MARK).write_text(json.dumps(mark, indent=1) + "\n"),
        )  # fmt: skip
    except DiskFull:
        raise
    except OSError as exc:  # (it named the temporary directory, and advised a resume)
        raise ValueError(
            f"export: --merge {out}: cannot be written ({exc.strerror or exc})"
        ) from exc
    return checkpoint


def run_export(source: Path, merge: Path | None, dtype: str | None, step: int | None) -> str:
    """``gspo export``: the checkpoint named (a plain HF model already) or written to
    ``merge`` (``--merge OUT``, in ``dtype``); the line said."""
    if merge is None:
        if dtype is not None:
            raise ValueError("--dtype needs --merge OUT, the copy it writes")
        checkpoint = plain_checkpoint(source, step)
        copy = kept_until(checkpoint) or " (or pass --merge OUT for a copy)"
        return f"{checkpoint} is a plain HF model: load it from there{copy}"
    checkpoint = export_merged(source, merge, dtype, step)
    return f"{checkpoint} written to {merge} as one model"


def export_command(source: Path, merge: Path | None, dtype: str | None, step: int | None) -> int:
    """``gspo export``: :func:`run_export`, its line printed; 0.

    Under torchrun rank 0 alone exports and says its line (every rank merged and wrote the
    whole model to the same place, one after another, each saying so); the other ranks
    wait for it, and leave quietly (status 2) with rank 0's error, which rank 0 says."""
    from gspo.distributed import (
        SaidByRankZero,
        setup_distributed,
        teardown_distributed,
        world_size,
    )

    if world_size() <= 1:
        print(run_export(source, merge, dtype, step))
        return 0
    dist = setup_distributed("cpu")  # (gloo: its one collective says how rank 0 did)
    said, error = "", None
    try:
        if dist.is_main:
            try:
                said = run_export(source, merge, dtype, step)
            except Exception as exc:  # (told to the other ranks, then raised)
                error = exc
        failed = dist.gather_objects(None if error is None else str(error))[0]
    finally:
        teardown_distributed(dist)
    if error is not None:
        error.for_every_rank = True  # type: ignore[attr-defined]  # (its line names no rank)
        raise error
    if failed is not None:
        raise SaidByRankZero from ValueError(failed)
    if said:
        print(said)
    return 0
