"""Secondary metric sinks: TensorBoard, Weights & Biases and MLflow.

:class:`~gspo.telemetry.logger.MetricsLogger` feeds them the numbers it writes to
``metrics.jsonl``. Each tracker's package is imported lazily, where used: a missing one
is one line naming the extra to install, and a tracker refusing its settings is one line
naming the config key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Sub-directory of a run's output directory that holds TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"


@contextlib.contextmanager
def tracker_settings(key: str, name: str) -> Iterator[None]:
    """A tracker that refuses its settings (a retired MLflow store, a bad W&B project)
    ends the run with one line naming the config key, not the tracker's traceback."""
    try:
        yield
    except Exception as exc:
        text = " ".join(str(exc).split())
        text = text if len(text) <= 300 else text[:297] + "..."
        raise ValueError(
            f"{key}: {name} refused these settings ({type(exc).__name__}: {text})"
        ) from exc


#: The x-axis of the RL lines in W&B (``metrics.jsonl``'s ``step``); the cold start's
#: lines (``sft/*``) go by their own ``sft/step``, as in TensorBoard and MLflow.
RL_STEP = "train/step"


def axis(key: str) -> str:
    """The step a metric is drawn against: the cold start's own for ``sft/*`` and its
    ``time/sft`` (its lines are all RL step 0: its time was drawn as one column at 0), the
    RL step for the rest."""
    return "sft/step" if key.startswith("sft/") or key == "time/sft" else RL_STEP


class WandbSink:
    """``wandb.init(**settings)``: the W&B run every ``log`` is mirrored to.

    Each line is its own row (no ``step=``: W&B merges rows logged at one step, and the
    cold start's lines are all RL step 0), carrying ``train/step``; each metric is
    declared once, on first sight, against its axis (``define_metric``), so the RL curves
    are drawn by RL step and the cold start's by ``sft/step``.
    """

    def __init__(self, wandb_mod: Any, settings: dict) -> None:
        with tracker_settings("log.wandb", "W&B"):
            self.run = wandb_mod.init(**settings)
        self.declared: set[str] = set()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        row = {RL_STEP: step, **scalars}
        for key in row.keys() - self.declared:
            if key in ("sft/step", RL_STEP):
                self.run.define_metric(key, hidden=True)
            else:
                self.run.define_metric(key, step_metric=axis(key))
            self.declared.add(key)
        self.run.log(row)

    def finish(self) -> None:
        self.run.finish()


def start_mlflow(mlflow_mod: Any, settings: dict | None) -> None:
    """Start an MLflow run: ``"tracking_uri"`` and ``"experiment_name"`` are applied
    first, the rest of ``settings`` is passed to ``mlflow.start_run``."""
    cfg = dict(settings or {})
    uri = cfg.pop("tracking_uri", None)
    experiment = cfg.pop("experiment_name", None)
    with tracker_settings("log.mlflow", "MLflow"):
        if uri is not None:
            mlflow_mod.set_tracking_uri(uri)
        if experiment is not None:
            mlflow_mod.set_experiment(experiment)
        mlflow_mod.start_run(**cfg)


def import_optional(module: str, name: str, extra: str) -> Any:
    import importlib

    try:
        found = importlib.import_module(module)
        spec = getattr(found, "__spec__", None)  # a folder of that name on sys.path: a
        if spec is not None and spec.origin in (None, "namespace"):  # namespace package
            raise ImportError(module)
        return found
    except ImportError:  # (a setting asked for it: a ValueError, said in one line)
        raise ValueError(
            f"log.{extra}: {name} logging was requested but the '{module}' package is not "
            f"installed; install it with: pip install 'gspo[{extra}]'"
        ) from None


def tensorboard_writer(log_dir: Path, purge_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError(
            "log.tensorboard: TensorBoard logging needs the 'tensorboard' package (pip "
            "install tensorboard); or set log.tensorboard=false"
        ) from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
