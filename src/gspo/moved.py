"""A run directory moved together with the files it names.

A run records the files it was given by absolute path (``config.yaml``; a LoRA
checkpoint's ``adapter_config.json`` names its base model), so a resume from another
working directory reads the same ones. A project moved as a whole (``mv proj proj2``)
would then name the old place: its run's ``config.yaml`` starts with the line
``# gspo run directory: DIR``, the run's own place when it was written, and a recorded
path that no longer exists is looked for where it now lies relative to the run, as it
did relative to ``DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

#: The first line of a run's ``config.yaml`` (and of its checkpoints' copies).
RUN_DIR_LINE = "# gspo run directory: "


def with_run_dir(config_text: str, run_dir: Path) -> str:
    """``config_text`` (a run's YAML) headed by the line naming ``run_dir``."""
    return f"{RUN_DIR_LINE}{Path(run_dir).resolve()}\n{config_text}"


def recorded_run_dir(config_file: Path) -> Path | None:
    """Where the run was when it wrote ``config_file`` (its config.yaml, or a checkpoint's
    copy); None for a file without the line (written before it was recorded, or by hand)."""
    try:
        with open(config_file, encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    if not first.startswith(RUN_DIR_LINE):
        return None
    return Path(first[len(RUN_DIR_LINE) :].strip())


def moved_path(path: str | Path, run_dir: Path, config_file: Path | None = None) -> Path | None:
    """Where ``path`` (recorded absolute in ``config_file``, by default the config.yaml of
    the run now in ``run_dir``; missing now) lies, if the run moved together with it: the
    same place relative to the run; None if the run did not move or nothing is there."""
    path = Path(path)
    if not path.is_absolute() or path.exists():
        return None
    recorded = recorded_run_dir(config_file or Path(run_dir) / "config.yaml")
    here = Path(run_dir).resolve()
    if recorded is None or recorded == here:
        return None
    candidate = here / os.path.relpath(path, recorded)
    return candidate.resolve() if candidate.exists() else None


def model_path_of(run_dir: Path) -> Path | None:
    """Where the model that ``run_dir``'s config.yaml names (``model.path``) lies now: as
    named, or where it moved with the run; None for the built-in model (or no such file)."""
    try:
        text = (Path(run_dir) / "config.yaml").read_text(encoding="utf-8")
        path = yaml.safe_load(text)["model"]["path"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    if not isinstance(path, str) or not path:
        return None
    return moved_path(path, run_dir) or Path(path)


def model_not_found(model_dir: Path, checkpoint: Path) -> FileNotFoundError:
    """The one-line error for a model that ``checkpoint`` builds on (a LoRA adapter's base,
    a step 0's model) and that :func:`in_checkpoint` did not find at ``model_dir``."""
    return FileNotFoundError(
        f"model.path: {model_dir}, the model {checkpoint} builds on, is not a directory "
        "(nor where it would lie had it moved with the run); if it was moved, resume with "
        "model.path=ITS_NEW_PLACE"
    )


def in_checkpoint(path: str | Path, checkpoint: Path, model_path: str | Path | None = None) -> Path:
    """``path``, the run's model as ``checkpoint`` (``RUN/checkpoints/step-N``) recorded it
    (a LoRA adapter's base, a step 0's model), where it lies now: itself; where it moved
    with the run (:func:`moved_path`, from the checkpoint's own config.yaml); else, the
    model having been moved elsewhere, where the run's ``model.path`` names it now:
    ``model_path`` (a resume's, ``model.path=NEW``), by default the run's config.yaml's
    (which that resume recorded). The callers check that its weights are the recorded ones.
    """
    checkpoint, path = Path(checkpoint), Path(path)
    moved = moved_path(path, checkpoint.parent.parent, checkpoint / "config.yaml")
    if moved is not None:
        return moved
    if path.exists():
        return path
    now = model_path_of(checkpoint.parent.parent) if model_path is None else Path(model_path)
    return now if now is not None and now.is_dir() else path
