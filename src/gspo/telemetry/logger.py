"""The metrics logger: every number a run records, written to each sink.

:class:`MetricsLogger`'s primary sink is ``output_dir/metrics.jsonl``: one JSON object
per line, ``{"step": ..., "time": ..., **metrics}``, flushed after every line; resuming
keeps the lines up to the checkpoint's step. TensorBoard event files
(``output_dir/tensorboard/``) and optional Weights & Biases / MLflow runs
(:mod:`gspo.telemetry.trackers`) are secondary sinks fed the same numbers.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gspo.telemetry.records import METRICS_FILE, _finite_scalars, _is_number, json_safe
from gspo.telemetry.trackers import (
    RL_STEP,
    TENSORBOARD_DIR,
    WandbSink,
    axis,
    import_optional,
    start_mlflow,
    tensorboard_writer,
)


class MetricsLogger:
    """Log scalar metrics to ``metrics.jsonl``, TensorBoard and optional W&B / MLflow.

    Args:
        output_dir: run directory; created if missing. ``metrics.jsonl`` is written
            there and TensorBoard events under ``tensorboard/``.
        tensorboard: also write TensorBoard scalars (non-finite values are skipped).
        enabled: ``False`` makes every method a no-op and touches no files (use it on
            non-zero ranks of a distributed run).
        resume_step: resuming from a checkpoint taken at step ``k``: lines of an
            existing ``metrics.jsonl`` with ``step <= k`` are kept (the file is rewritten
            atomically, dropping later steps and any truncated line) and new lines are
            appended; TensorBoard is told to purge events at steps ``> k``. With
            ``None`` (a fresh run) an existing ``metrics.jsonl`` is replaced and older
            TensorBoard events in the directory are purged from view.
        wandb: if given, ``wandb.init(**wandb)`` is called and every ``log`` is mirrored
            to that run (``run.log(..., step=step)``).
        mlflow: if given, an MLflow run is started and every ``log`` is mirrored with
            ``mlflow.log_metrics``. The optional keys ``"tracking_uri"`` and
            ``"experiment_name"`` are applied first (``mlflow.set_tracking_uri`` /
            ``mlflow.set_experiment``); the rest are passed to ``mlflow.start_run``.

    Raises:
        ValueError: W&B or MLflow was requested but its package is not installed
            (checked before any file is created).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        tensorboard: bool = True,
        enabled: bool = True,
        resume_step: int | None = None,
        wandb: dict | None = None,
        mlflow: dict | None = None,
    ) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.resume_step = resume_step
        self._file: Any = None
        self._tb: Any = None
        self._wandb: Any = None
        self._mlflow: Any = None
        self._closed = False
        if not enabled:
            return

        # Import optional sinks first so a missing package fails before any file exists.
        wandb_mod = import_optional("wandb", "W&B", "wandb") if wandb is not None else None
        mlflow_mod = import_optional("mlflow", "MLflow", "mlflow") if mlflow is not None else None

        self.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            if resume_step is not None:
                _truncate_metrics(self.path, resume_step)
                self._file = self.path.open("a", encoding="utf-8")
            else:
                self._file = self.path.open("w", encoding="utf-8")
            if tensorboard:
                self._tb = tensorboard_writer(
                    self.output_dir / TENSORBOARD_DIR,
                    purge_step=0 if resume_step is None else resume_step + 1,
                )
            if wandb_mod is not None:
                self._wandb = WandbSink(wandb_mod, wandb)
            if mlflow_mod is not None:
                start_mlflow(mlflow_mod, mlflow)
                self._mlflow = mlflow_mod
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record ``metrics`` at ``step`` in every sink; the jsonl line is flushed."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        step = int(step)
        safe = json_safe(metrics)
        record: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        record.update((k, v) for k, v in safe.items() if k not in record)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

        scalars = _finite_scalars(safe)
        scalars.pop("step", None)
        scalars.pop("time", None)
        # the cold start's lines are all RL step 0: its curves go by their own step
        steps = {RL_STEP: step, "sft/step": int(scalars.get("sft/step", step))}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=steps[axis(key)])
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)
        if self._mlflow is not None:
            for at, part in _by_axis(scalars, steps):
                self._mlflow.log_metrics(part, step=at)

    def close(self) -> None:
        """Flush and close every sink. Idempotent."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _by_axis(
    scalars: dict[str, float], steps: dict[str, int]
) -> list[tuple[int, dict[str, float]]]:
    """``scalars`` split by the step each is drawn against (:func:`axis`), none empty."""
    parts: dict[str, dict[str, float]] = {}
    for key, value in scalars.items():
        parts.setdefault(axis(key), {})[key] = value
    return [(steps[name], part) for name, part in parts.items()]


def _truncate_metrics(path: Path, resume_step: int) -> None:
    """Atomically rewrite ``path`` keeping only well-formed lines with step <= resume_step."""
    if not path.exists():
        return
    kept: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # blank or truncated by a crash
        if not isinstance(record, dict):
            continue
        step = record.get("step")
        if _is_number(step) and step <= resume_step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
