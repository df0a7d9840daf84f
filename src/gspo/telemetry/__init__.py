"""Run telemetry: metrics logging, plots, progress display and run summaries.

==================  ==================================================================
module              what lives there
==================  ==================================================================
:mod:`.records`     ``metrics.jsonl`` records: JSON-safe values, :func:`read_metrics`
:mod:`.logger`      :class:`MetricsLogger`: jsonl, TensorBoard, W&B and MLflow sinks
:mod:`.trackers`    TensorBoard, W&B and MLflow: lazy imports, starting a run
:mod:`.plots`       PNGs of one run, of several runs, of bands over seeds
:mod:`.summary`     the run summary table
:mod:`.progress`    :class:`TrainingProgress`: the live bar or plain progress lines
:mod:`.profiling`   :class:`StepProfiler`: ``log.profile_steps``' traces and summaries
==================  ==================================================================

Each module imports only the standard library at import time; matplotlib, rich,
``torch.utils.tensorboard``, wandb and mlflow are imported lazily, where used, so
``import gspo.telemetry`` stays cheap and never drags in transformers.
"""

from gspo.telemetry.logger import MetricsLogger
from gspo.telemetry.plots import (
    band_lines,
    per_rollout_batch,
    plot_bands,
    plot_histograms,
    plot_metrics,
    plot_runs,
    plot_series,
    plots_so_far,
)
from gspo.telemetry.profiling import StepProfiler
from gspo.telemetry.progress import TrainingProgress
from gspo.telemetry.records import METRICS_FILE, json_safe, read_metrics
from gspo.telemetry.summary import STEP_TIME_KEYS, SUMMARY_KEYS, print_summary, summary_table
from gspo.telemetry.trackers import TENSORBOARD_DIR

# fmt: off
__all__ = [
    "METRICS_FILE", "STEP_TIME_KEYS", "SUMMARY_KEYS", "TENSORBOARD_DIR", "MetricsLogger",
    "StepProfiler", "TrainingProgress", "band_lines", "json_safe", "per_rollout_batch",
    "plot_bands", "plot_histograms", "plot_metrics", "plot_runs", "plot_series", "plots_so_far",
    "print_summary", "read_metrics", "summary_table",
]
# fmt: on
