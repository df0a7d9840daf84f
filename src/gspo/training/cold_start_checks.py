"""Checks of a cold start before its run writes anything, and what they share with it:
the cache's directory, the run's progress checkpoints and the settings each must be
resumed with (:mod:`gspo.training.cold_start`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config

PROGRESS_PREFIX = "cold-start-"
STATE = "state.pt"


def cache_dir(config: Config) -> Path | None:
    """The cold-start cache's directory, or None when the cache is off."""
    if not config.train.cold_start_cache:
        return None
    if config.train.cold_start_cache_dir is not None:
        return Path(config.train.cold_start_cache_dir).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gspo" / "cold-start"


def progress_checkpoints(checkpoints: Path) -> list[Path]:
    """The run's cold-start progress checkpoints, oldest first."""
    found = [p for p in checkpoints.glob(f"{PROGRESS_PREFIX}*") if (p / STATE).is_file()]
    return sorted(found)


def progress_settings(config: Config, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings a cold start's progress checkpoint must be resumed with: those that
    decide its result (its learning-rate schedule spans ``train.cold_start_steps``), and a
    digest of its rows (``data.sft``)."""
    t = config.train
    digest = hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode())
    return {
        "data.sft": digest.hexdigest()[:16],
        "train.cold_start_steps": t.cold_start_steps,
        "train.cold_start_lr": t.cold_start_lr,
        "train.cold_start_batch_size": t.cold_start_batch_size,
        "train.seed": t.seed,
        "rollout.temperature": config.rollout.temperature,
    }


def check_cold_start(
    config: Config, rows: list[dict[str, Any]], checkpoints: Path, resumed: Path | None = None
) -> None:
    """Before a run that has a cold start to do (none ``resumed`` from a checkpoint past
    it) writes anything: a one-line ``ValueError``
    where ``train.cold_start_cache_dir`` (or the default) is, or lies under, a file (its
    cold start was trained, then said ``not cached (...: File exists)``), and where a cold
    start killed midway is resumed with settings its progress checkpoint was not trained
    with (it went on unsaid: more steps than asked for, or another schedule, cached as a
    cold start of the new settings; with ``train.cold_start_steps=0``, dropped unsaid)."""
    if resumed is not None:
        return
    root = cache_dir(config) if config.train.cold_start_steps and rows else None
    for path in () if root is None else (root, *root.parents):
        if path.exists():
            if not path.is_dir():
                set_to = config.train.cold_start_cache_dir
                said = f"={set_to}" if set_to else f" (unset: {root})"
                key = f"train.cold_start_cache_dir{said}"
                where = "" if path == root else f"{path}, above it, "
                raise ValueError(
                    f"{key}: {where}is a file, not a directory; name a directory, or "
                    "train.cold_start_cache=false (--no-cache) to keep no cache"
                )
            break
    saved = progress_checkpoints(checkpoints)
    if not saved:
        return
    state = torch.load(saved[-1] / STATE, weights_only=True)
    was = state.get("settings")  # (none in a checkpoint from before they held them)
    now = progress_settings(config, rows)
    was = was if isinstance(was, dict) else {}
    changed = [
        f"data.sft ({config.data.source_of('data.sft')}) holds other rows" if k == "data.sft"
        else f"{k}={now[k]} (was {was[k]})"
        for k in now
        if k in was and was[k] != now[k]
    ]  # fmt: skip
    if changed:
        raise ValueError(
            f"resume: {'; '.join(changed)}: the run's cold start stopped at step "
            f"{state['step']} ({saved[-1].name}) with the old settings and goes on only "
            "with them: resume without the change, or start the run again with it (--overwrite; "
            "gspo.train(..., overwrite=True))"
        )
