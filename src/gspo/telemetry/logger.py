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

from gspo.telemetry.records import (
    METRICS_FILE,
    _finite_scalars,
    _is_number,
    json_safe,
    read_metrics,
)
from gspo.telemetry.trackers import (
    RL_STEP,
    TENSORBOARD_DIR,
    TRACKERS_FILE,
    MlflowSink,
    WandbSink,
    axis,
    import_optional,
    recorded_trackers,
    run_status,
    tensorboard_writer,
    tracker_failed,
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
            TensorBoard events in the directory are purged from view. (The cold start's
            lines kept whose own step is past ``k`` are written to TensorBoard again: the
            purge hid them.)
        continues: the run goes on from an earlier process, its W&B and MLflow runs with
            it (:data:`~gspo.telemetry.trackers.TRACKERS_FILE`); by default, where
            ``resume_step`` is given (a run resumed inside its cold start has none: its
            lines are logged again, ``replayed``).
        wandb: if given, ``wandb.init(**wandb)`` is called and every ``log`` is mirrored
            to that run (one row a line: :class:`~gspo.telemetry.trackers.WandbSink`).
        mlflow: if given, an MLflow run is started and every ``log`` is mirrored with
            ``mlflow.log_metrics``. The optional keys ``"tracking_uri"`` and
            ``"experiment_name"`` are applied first (``mlflow.set_tracking_uri`` /
            ``mlflow.set_experiment``); the rest are passed to ``mlflow.start_run``.
        params: the run's settings (dotted keys): W&B's config, MLflow's parameters,
            TensorBoard's ``config`` text. A resumed run goes on in the W&B and MLflow
            runs it logged to (``continues``).

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
        continues: bool | None = None,
        wandb: dict | None = None,
        mlflow: dict | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / METRICS_FILE
        self.resume_step = resume_step
        self._file: Any = None
        self._tb: Any = None
        self._trackers: list[Any] = []  # WandbSink, MlflowSink
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
                self._tensorboard_start(params)
            continues = resume_step is not None if continues is None else continues
            recorded = recorded_trackers(self.output_dir) if continues else {}
            if wandb_mod is not None:
                sink = WandbSink(wandb_mod, wandb, params, recorded.get("wandb"))
                self._trackers.append(sink)
            if mlflow_mod is not None:
                sink = MlflowSink(mlflow_mod, mlflow, params, recorded.get("mlflow"))
                self._trackers.append(sink)
            self._record_trackers(recorded)
        except BaseException as exc:  # (the trackers started end as this start did)
            self.close(run_status(type(exc)))
            raise

    def _record_trackers(self, recorded: dict[str, dict]) -> None:
        """:data:`~gspo.telemetry.trackers.TRACKERS_FILE`: the tracker runs this one logs
        to, beside those it recorded before and does not now (a tracker turned off at one
        resume goes on in its run at the next); a fresh run's alone."""
        names = {"log.wandb": "wandb", "log.mlflow": "mlflow"}
        kept = recorded | {names[t.key]: t.entry for t in self._trackers if t.id is not None}
        if not kept:
            (self.output_dir / TRACKERS_FILE).unlink(missing_ok=True)
            return
        from gspo.publish import write_atomic

        write_atomic(self.output_dir / TRACKERS_FILE, json.dumps(kept) + "\n")

    def _tensorboard_start(self, params: Mapping[str, Any] | None) -> None:
        """The run's settings as TensorBoard text; on a resume, the cold start's lines kept
        in metrics.jsonl whose ``sft/step`` is past the checkpoint's step again (the purge
        hid them; those before it are still drawn)."""
        if params:
            table = "\n".join(f"    {key}: {value!r}" for key, value in params.items())
            self._tb.add_text("config", table, global_step=self.resume_step or 0)
        if self.resume_step is None:
            return
        for record in read_metrics(self.path):
            scalars = _finite_scalars(record)
            if "sft/step" in scalars and (at := int(scalars["sft/step"])) > self.resume_step:
                for key, value in scalars.items():
                    if axis(key) == "sft/step" and key != "sft/step":
                        self._tb.add_scalar(key, value, global_step=at)
        self._tb.flush()

    def log(self, step: int, metrics: Mapping[str, Any], *, replayed: bool = False) -> None:
        """Record ``metrics`` at ``step`` in every sink; the jsonl line is flushed.
        ``replayed``: a line an earlier process logged (a cold start resumed from its
        progress logs its lines so far again), not sent again to the tracker runs it
        continues."""
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
        self._each_tracker(
            "logging",
            lambda sink: None if replayed and sink.continued else sink.log(step, scalars, steps),
        )

    def attach(self, files: list[Path]) -> None:
        """Send files of the run (its plots, config.yaml) to W&B and MLflow, as files of
        the run directory."""
        if self.enabled and not self._closed and files:
            self._each_tracker("uploading", lambda sink: sink.attach(files, self.output_dir))

    def _each_tracker(self, doing: str, call: Any) -> None:
        """``call(sink)`` for each tracker; one that fails is said once and dropped."""
        for sink in list(self._trackers):
            try:
                call(sink)
            except Exception as exc:
                self._trackers.remove(sink)
                tracker_failed(sink, exc, doing)
                sink.dropped()

    def close(self, status: str = "FINISHED") -> None:
        """Flush and close every sink; the tracker runs end with ``status``
        (:func:`~gspo.telemetry.trackers.run_status`). Idempotent."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        self._each_tracker("finishing its run", lambda sink: sink.finish(status))
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(run_status(exc_type))


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
