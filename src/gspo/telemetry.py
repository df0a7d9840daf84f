"""Run telemetry: metrics logging, plots, progress display and run summaries.

Everything a training run records goes through :class:`MetricsLogger`, whose primary
sink is ``output_dir/metrics.jsonl``: one JSON object per line,
``{"step": ..., "time": ..., **metrics}``, flushed after every line. TensorBoard event
files (``output_dir/tensorboard/``) and optional Weights & Biases / MLflow runs are
secondary sinks fed the same numbers. :func:`read_metrics` reads the jsonl back
(tolerating a line cut short by a crash) and :func:`plot_metrics`, :func:`plot_runs`
and :func:`summary_table` turn it into PNGs and tables.

Layering: this module imports only the standard library at import time. matplotlib,
rich, ``torch.utils.tensorboard``, wandb and mlflow are imported lazily, where used,
so ``import gspo.telemetry`` stays cheap and never drags in transformers.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console
    from rich.table import Table

__all__ = [
    "METRICS_FILE",
    "STEP_TIME_KEYS",
    "SUMMARY_KEYS",
    "TENSORBOARD_DIR",
    "MetricsLogger",
    "TrainingProgress",
    "json_safe",
    "plot_metrics",
    "plot_runs",
    "plot_series",
    "print_summary",
    "read_metrics",
    "summary_table",
]

#: File name of the jsonl metrics log inside a run's output directory.
METRICS_FILE = "metrics.jsonl"
#: Sub-directory of a run's output directory that holds TensorBoard event files.
TENSORBOARD_DIR = "tensorboard"

#: Keys a trainer may use for the duration of one optimizer step, in seconds; the first
#: one present is used by :func:`summary_table`. Without any, seconds/step is derived
#: from the ``"time"`` wall-clock column.
STEP_TIME_KEYS: tuple[str, ...] = (
    "time/step_seconds",
    "time/step",
    "perf/step_seconds",
    "perf/step_time",
    "train/step_seconds",
    "train/step_time",
    "step_time",
)

#: Metrics shown by :func:`summary_table` (whichever are present), with display labels.
#: The clip fractions are per rollout batch (:func:`gspo.training.metrics.rollout_clip_fractions`):
#: its on-policy first minibatch apart from the others (``train/clip_fraction`` is one
#: minibatch's, and minibatch 0, on-policy, clips nothing up to numerics).
SUMMARY_KEYS: tuple[tuple[str, str], ...] = (
    ("train/reward_mean", "reward (train)"),
    ("eval/accuracy", "accuracy (eval)"),
    ("eval/accuracy_greedy", "accuracy (eval, greedy)"),
    ("train/clip_fraction_off_policy", "clip fraction, off-policy"),
    ("train/clip_fraction_on_policy", "clip fraction, on-policy"),
    ("train/response_length_mean", "response length"),
)

_FIGSIZE = (6.0, 4.0)
_DPI = 100
#: Title characters that fit the figure's width at the default title size (longer titles
#: are set smaller and wrapped at 1.25 times this).
_TITLE_CHARS = 56


# --------------------------------------------------------------------------- helpers


def _safe_value(value: Any) -> Any:
    """One value made JSON-safe; see :func:`json_safe`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):  # includes numpy.float64, a float subclass
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _safe_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe_value(v) for v in value]
    # torch tensors and numpy scalars/arrays: .tolist() gives a Python scalar for a
    # 0-d / one-element value and nested lists otherwise, without importing either.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        detach = getattr(value, "detach", None)
        if callable(detach):
            value = detach()
        return _safe_value(value.tolist())
    try:
        return _safe_value(float(value))  # Decimal, Fraction, ...
    except (TypeError, ValueError):
        return str(value)


def json_safe(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``metrics`` that :func:`json.dumps` accepts with ``allow_nan=False``.

    NaN and ±inf become ``None`` (JSON ``null``); torch tensors and numpy scalars become
    Python ``float``/``int``/``bool`` (multi-element ones become lists); nested mappings
    and sequences are converted recursively; anything else is tried as ``float`` and
    otherwise stored as its ``str``. Keys are converted to ``str``.
    """
    return {str(k): _safe_value(v) for k, v in metrics.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a json-safe record (bools as 0/1)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or (_is_number(value) and math.isfinite(value)):
            out[key] = float(value)
    return out


def _metrics_file(path: str | Path) -> Path:
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def _parse_lines(text: str, source: Path) -> list[dict]:
    lines = text.splitlines()
    # Index of the last non-blank line: only that one may be a crash's truncated write.
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:
                break  # truncated final line (crash mid-write): ignore it
            raise ValueError(f"{source}:{i + 1}: corrupt metrics line: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{source}:{i + 1}: expected a JSON object, got {record!r}")
        records.append(record)
    return records


def read_metrics(path: str | Path) -> list[dict]:
    """Read a ``metrics.jsonl`` file (or the one inside a run directory).

    Returns one dict per line, in file order. A truncated last line (the process died
    while writing it) is skipped; a corrupt line anywhere else raises ``ValueError``.
    ``null`` values (non-finite numbers at write time) come back as ``None``.
    """
    path = _metrics_file(path)
    return _parse_lines(path.read_text(encoding="utf-8"), path)


# ---------------------------------------------------------------------------- logger


@contextlib.contextmanager
def _tracker_settings(key: str, name: str) -> Iterator[None]:
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
        RuntimeError: W&B or MLflow was requested but its package is not installed
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
        self._wandb_run: Any = None
        self._mlflow: Any = None
        self._closed = False
        if not enabled:
            return

        # Import optional sinks first so a missing package fails before any file exists.
        wandb_mod = _import_optional("wandb", "W&B", "wandb") if wandb is not None else None
        mlflow_mod = _import_optional("mlflow", "MLflow", "mlflow") if mlflow is not None else None

        self.output_dir.mkdir(parents=True, exist_ok=True)
        try:
            if resume_step is not None:
                _truncate_metrics(self.path, resume_step)
                self._file = self.path.open("a", encoding="utf-8")
            else:
                self._file = self.path.open("w", encoding="utf-8")
            if tensorboard:
                self._tb = _tensorboard_writer(
                    self.output_dir / TENSORBOARD_DIR,
                    purge_step=0 if resume_step is None else resume_step + 1,
                )
            if wandb_mod is not None:
                with _tracker_settings("log.wandb", "W&B"):
                    self._wandb_run = wandb_mod.init(**wandb)
            if mlflow_mod is not None:
                cfg = dict(mlflow or {})
                uri = cfg.pop("tracking_uri", None)
                experiment = cfg.pop("experiment_name", None)
                with _tracker_settings("log.mlflow", "MLflow"):
                    if uri is not None:
                        mlflow_mod.set_tracking_uri(uri)
                    if experiment is not None:
                        mlflow_mod.set_experiment(experiment)
                    mlflow_mod.start_run(**cfg)
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
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)
        if self._mlflow is not None and scalars:
            self._mlflow.log_metrics(scalars, step=step)

    def close(self) -> None:
        """Flush and close every sink. Idempotent."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb_run is not None:
            self._wandb_run.finish()
        if self._mlflow is not None:
            self._mlflow.end_run()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _import_optional(module: str, name: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RuntimeError(
            f"{name} logging was requested but the '{module}' package is not installed; "
            f"install it with: pip install 'gspo[{extra}]'"
        ) from None


def _tensorboard_writer(log_dir: Path, purge_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RuntimeError(
            "TensorBoard logging needs the 'tensorboard' package (pip install tensorboard); "
            "or pass tensorboard=False"
        ) from None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


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


# ----------------------------------------------------------------------------- plots


def _series(
    records: Iterable[Mapping[str, Any]], key: str, x: str = "step"
) -> tuple[list[float], list[float]]:
    """``(xs, ys)`` of the records that have ``key`` and ``x``, sorted by x.

    ``None`` (a non-finite value at write time) becomes NaN, which matplotlib draws as
    a gap. Returns empty lists when no record has a finite value for ``key``.
    """
    points = []
    for rec in records:
        if key not in rec or not _is_number(rec.get(x)):
            continue
        value = rec[key]
        if isinstance(value, bool):
            value = float(value)
        if value is None:
            value = math.nan
        if not _is_number(value):
            continue
        points.append((float(rec[x]), float(value)))
    if not any(math.isfinite(v) for _, v in points):
        return [], []
    points.sort(key=lambda p: p[0])
    return [p[0] for p in points], [p[1] for p in points]


def _new_figure() -> tuple[Any, Any]:
    # A bare Figure (no pyplot): no global backend state, safe in threads and headless.
    from matplotlib.figure import Figure

    fig = Figure(figsize=_FIGSIZE, dpi=_DPI, layout="tight")
    return fig, fig.add_subplot()


def _set_title(ax: Any, title: str) -> None:
    """The axes' title, wrapped to the figure's width (a long one, such as the command
    that made the plot, would otherwise run off both edges)."""
    import textwrap

    width = _TITLE_CHARS if len(title) <= _TITLE_CHARS else int(_TITLE_CHARS * 1.25)
    wrapped = "\n".join(textwrap.wrap(title, width, break_long_words=False)) or title
    ax.set_title(wrapped, fontsize=None if len(title) <= _TITLE_CHARS else "small")


def _set_log_scale(ax: Any, ys: Sequence[float]) -> None:
    """Log y-axis; if some values are 0, a symlog axis whose linear part holds the zeros."""
    finite = [v for v in ys if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    if not positive:
        return  # all zero (or negative): a log axis would be empty
    if all(v > 0 for v in finite):
        ax.set_yscale("log")
    else:
        # Linear part [0, linthresh] spans one decade's height, one decade below the data.
        linthresh = 10.0 ** math.floor(math.log10(min(positive)))
        ax.set_yscale("symlog", linthresh=linthresh, linscale=1.0)
        ax.set_ylim(bottom=min(0.0, *finite))


def _draw(
    lines: Sequence[tuple[str, list[float], list[float], list[float] | None]],
    path: str | Path,
    *,
    title: str | None,
    xlabel: str,
    ylabel: str | None,
    logy: bool,
) -> Path:
    """Draw ``(label, xs, ys, band_halfwidths | None)`` lines into one PNG at ``path``."""
    fig, ax = _new_figure()
    all_y: list[float] = []
    for label, xs, ys, band in lines:
        marker = "o" if len(xs) <= 30 else None
        (line,) = ax.plot(xs, ys, label=label, marker=marker, markersize=3, linewidth=1.5)
        all_y.extend(ys)
        if band is not None:
            lo = [y - b for y, b in zip(ys, band, strict=True)]
            if logy and all(y >= 0 for y in ys):  # a spread of non-negative values stays >= 0
                lo = [max(v, 0.0) for v in lo]
            hi = [y + b for y, b in zip(ys, band, strict=True)]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            all_y.extend(lo + hi)
    if logy:
        _set_log_scale(ax, all_y)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        _set_title(ax, title)
    ax.grid(True, alpha=0.3, which="major")
    if len(lines) > 1 or (lines and lines[0][0]):
        ax.legend(fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    return path


def plot_series(
    records: Sequence[Mapping[str, Any]],
    keys: Sequence[str],
    path: str | Path,
    *,
    title: str,
    ylabel: str,
    logy: bool = False,
    band: Mapping[str, str] | None = None,
    x: str = "step",
) -> Path | None:
    """Plot each of ``keys`` against ``x`` from one run's records into a PNG.

    Keys absent from every record are left out; if none is present nothing is written
    and ``None`` is returned. ``band`` maps a key to another key holding a spread
    (e.g. ``{"train/reward_mean": "train/reward_std"}``) drawn as a ±band around it.
    ``logy`` uses a log y-axis (symlog when some values are 0). Returns the path.
    """
    band = band or {}
    lines = []
    for key in keys:
        xs, ys = _series(records, key, x)
        if not xs:
            continue
        spread = None
        if key in band:
            by_x = dict(zip(*_series(records, band[key], x), strict=True))
            if by_x:
                spread = [by_x.get(xv, math.nan) for xv in xs]
                spread = [s if math.isfinite(s) else 0.0 for s in spread]
        lines.append((key, xs, ys, spread))
    if not lines:
        return None
    return _draw(lines, path, title=title, xlabel=x, ylabel=ylabel, logy=logy)


def plot_runs(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    key: str,
    path: str | Path,
    *,
    x: str = "step",
    logy: bool = False,
    title: str | None = None,
) -> Path | None:
    """Overlay ``key`` from several runs (``{run name: records}``), one line per run.

    Runs lacking ``key`` are left out; returns ``None`` (and writes nothing) if no run
    has it, else the path written.
    """
    lines = []
    for name, records in runs.items():
        xs, ys = _series(records, key, x)
        if xs:
            lines.append((str(name), xs, ys, None))
    if not lines:
        return None
    return _draw(lines, path, title=title or key, xlabel=x, ylabel=key, logy=logy)


def band_lines(
    groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]], key: str, x: str = "step"
) -> list[tuple[str, list[float], list[float], list[float] | None]]:
    """Per group: ``(name, xs, means, stds)`` of ``key`` over the group's runs.

    Only the steps every run of the group has count; ``x`` is averaged over the runs at
    each step (e.g. ``elapsed`` seconds), the spread is the population standard deviation
    (``None`` for a group of one run). Groups without ``key`` are left out.
    """
    lines = []
    for name, runs in groups.items():
        per_run = []  # per run: step -> (x, value)
        for records in runs:
            points = {
                float(r["step"]): (float(r[x]), float(r[key]))
                for r in records
                if _is_number(r.get(key)) and _is_number(r.get("step")) and _is_number(r.get(x))
            }
            if points:
                per_run.append(points)
        if not per_run:
            continue
        shared = sorted(set.intersection(*(set(r) for r in per_run)))
        if not shared:
            continue
        xs = [statistics.fmean(r[s][0] for r in per_run) for s in shared]
        values = [[r[s][1] for r in per_run] for s in shared]
        means = [statistics.fmean(v) for v in values]
        band = [statistics.pstdev(v) for v in values] if len(per_run) > 1 else None
        lines.append((str(name), xs, means, band))
    return lines


def plot_bands(
    groups: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]],
    key: str,
    path: str | Path,
    *,
    x: str = "step",
    logy: bool = False,
    title: str | None = None,
    xlabel: str | None = None,
) -> Path | None:
    """One line per group (e.g. an algorithm) with a ±1 sd band over its runs (e.g.
    seeds): :func:`band_lines` drawn. Returns ``None`` (and writes nothing) when no
    group has ``key``.
    """
    lines = band_lines(groups, key, x)
    if not lines:
        return None
    label = xlabel or ("wall-clock seconds" if x == "elapsed" else x)
    return _draw(lines, path, title=title or key, xlabel=label, ylabel=key, logy=logy)


def plot_histograms(
    series: Mapping[str, Any], path: str | Path, *, title: str, bins: int = 60
) -> Path | None:
    """Overlaid density histograms of log importance ratios (``{label: 1-D tensor}``).

    The x axis is ``log ratio`` (0 = on-policy); a narrow spike is a tight ratio, a wide
    one a noisy ratio. Returns ``None`` when no series has values.
    """
    data = {k: [float(v) for v in values] for k, values in series.items() if len(values)}
    if not data:
        return None
    everything = [v for vs in data.values() for v in vs if math.isfinite(v)]
    lo, hi = min(everything), max(everything)
    if hi <= lo:
        lo, hi = lo - 1e-6, hi + 1e-6
    fig, ax = _new_figure()
    for label, values in data.items():
        ax.hist(values, bins=bins, range=(lo, hi), density=True, histtype="step", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("log importance ratio (log w_it per token, log s_i per response)")
    ax.set_ylabel("density (log)")
    _set_title(ax, title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=_DPI)
    return path


def plot_metrics(metrics_path: str | Path, output_dir: str | Path) -> list[Path]:
    """Standard plots of one run's ``metrics.jsonl`` (or run directory) into ``output_dir``.

    Writes whichever of these have data: ``reward.png`` (``train/reward_mean`` with a
    ±``train/reward_std`` band), ``accuracy.png`` (``eval/accuracy``,
    ``eval/accuracy_greedy``) and ``clip_fraction.png`` (per rollout batch,
    ``train/clip_fraction_off_policy`` and ``train/clip_fraction_on_policy``, linear
    y-axis). Returns the paths written.
    """
    records = read_metrics(metrics_path)
    out = Path(output_dir)
    written = [
        plot_series(
            records,
            ["train/reward_mean"],
            out / "reward.png",
            title="Training reward",
            ylabel="reward (mean ± std over rollouts)",
            band={"train/reward_mean": "train/reward_std"},
        ),
        plot_series(
            records,
            ["eval/accuracy", "eval/accuracy_greedy"],
            out / "accuracy.png",
            title="Evaluation accuracy",
            ylabel="accuracy",
        ),
        plot_series(
            records,
            ["train/clip_fraction_off_policy", "train/clip_fraction_on_policy"],
            out / "clip_fraction.png",
            title="Clipped token fraction per rollout batch",
            ylabel="fraction of tokens clipped",
        ),
    ]
    return [p for p in written if p is not None]


# -------------------------------------------------------------------------- summary


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool) or not _is_number(value):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-4):
        return f"{value:.3g}"
    return f"{value:.4g}"


def _points(records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[Any, float]]:
    """``(step, value)`` of the records with a finite ``key``, in order."""
    return [
        (r.get("step"), r[key]) for r in records if _is_number(r.get(key)) and math.isfinite(r[key])
    ]


def _wall_step_times(records: Sequence[Mapping[str, Any]]) -> list[tuple[Any, float]]:
    """``(step, seconds/step)`` between consecutive records with increasing steps."""
    out = []
    prev: tuple[float, float] | None = None
    for r in records:
        step, t = r.get("step"), r.get("time")
        if not (_is_number(step) and _is_number(t)):
            continue
        if prev is not None and step > prev[0] and t >= prev[1]:
            out.append((step, (t - prev[1]) / (step - prev[0])))
        if prev is None or step > prev[0]:
            prev = (step, t)
    return out


def summary_table(records: Sequence[Mapping[str, Any]], *, title: str = "Run summary") -> Table:
    """A rich table with the first, last and mean value of each key metric present.

    Rows (whichever exist): train reward, eval accuracy (sampled and greedy), clip
    fraction (off-policy minibatches, on-policy minibatch), response length, and
    seconds per step (from one of :data:`STEP_TIME_KEYS`, else derived from the
    ``"time"`` column). The mean is over the records that have the metric (for the clip
    fractions, one per rollout batch), so what happened between first and last shows.
    Its caption: what the checkpoints took, bytes and seconds (:func:`checkpoint_writes`).
    """
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    table.add_column("first", justify="right")
    table.add_column("last", justify="right")
    table.add_column("mean", justify="right")
    table.add_column("steps", justify="right", style="dim")

    def add(label: str, points: list[tuple[Any, float]]) -> bool:
        if not points:
            return False
        (s0, v0), (s1, v1) = points[0], points[-1]
        mean = statistics.fmean(v for _, v in points)
        table.add_row(label, _fmt(v0), _fmt(v1), _fmt(mean), f"{_fmt(s0)} → {_fmt(s1)}")
        return True

    for key, label in SUMMARY_KEYS:
        add(label, _points(records, key))
    if not any(add("seconds / step", _points(records, key)) for key in STEP_TIME_KEYS):
        add("seconds / step (wall)", _wall_step_times(records))
    if not table.rows:
        table.caption = "no metrics recorded"
    else:
        table.caption = checkpoint_writes(records)
    return table


def checkpoint_writes(records: Sequence[Mapping[str, Any]]) -> str | None:
    """``wrote 12.3 MB in 3 checkpoints: 0.4 s writing, 0.1 s waited``: the writes' own
    seconds (``time/checkpoint_write``), and the run's seconds waiting for them
    (``time/checkpoint``: taking each, and any wait for a background write); None when
    none are logged."""
    from gspo.publish import megabytes

    lines = [r for r in records if "io/checkpoint_bytes" in r]
    if not lines:
        return None
    size = sum(r["io/checkpoint_bytes"] for r in lines)
    waited = sum(r.get("time/checkpoint", 0.0) for r in lines)
    writing = sum(r.get("time/checkpoint_write", r.get("time/checkpoint", 0.0)) for r in lines)
    n = len(lines)
    return (
        f"wrote {megabytes(size)} in {n} checkpoint{'s' * (n != 1)}: {writing:.1f} s "
        f"writing, {waited:.1f} s waited"
    )


def print_summary(records: Sequence[Mapping[str, Any]], console: Console | None = None) -> None:
    """Print :func:`summary_table` of ``records`` to ``console`` (default: stdout)."""
    if console is None:
        from rich.console import Console

        console = Console()
    console.print(summary_table(records))


# ------------------------------------------------------------------------- progress


class TrainingProgress:
    """Training progress display: a live rich bar on a terminal, plain lines otherwise.

    ``update(step, metrics)`` is called after each optimizer step with ``step`` the
    number of steps completed so far (so ``total_steps`` means done) and the metrics
    just logged. Shown: the latest ``train/reward_mean``, the latest ``eval/accuracy``
    (kept from the last update that had it), the latest rollout batch's clip fractions
    (``train/clip_fraction_off_policy`` and ``_on_policy``; ``train/clip_fraction``
    where neither was ever given) and wall-clock seconds/step (averaged over the last
    few updates).

    When the console is not a terminal (CI, pipes, files), a compact plain line is
    printed every ``max(1, total_steps // 20)`` steps and at the last step instead.
    ``enabled=False`` makes everything a no-op. ``start_step`` is the step a resumed
    run starts from. ``console`` overrides the rich console (default: stdout).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        start_step: int = 0,
        console: Console | None = None,
    ) -> None:
        self.total_steps = int(total_steps)
        self.enabled = enabled
        self.start_step = int(start_step)
        self.every = max(1, self.total_steps // 20)
        self.step = self.start_step
        self.reward: float | None = None
        self.accuracy: float | None = None
        self.clip_fraction: float | None = None
        self.clip_off_policy: float | None = None
        self.clip_on_policy: float | None = None
        self._times: deque[tuple[int, float]] = deque(maxlen=11)
        self._console = console
        self._progress: Any = None
        self._task: Any = None
        self._live = False
        self._started = False
        self._printed = False

    # ---- lifecycle
    def start(self) -> None:
        if not self.enabled or self._started:
            return
        self._started = True
        self._times.append((self.step, time.monotonic()))
        if self._console is None:
            from rich.console import Console

            self._console = Console()
        self._live = self._console.is_terminal and not self._console.is_dumb_terminal
        if self._live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}"),
                console=self._console,
            )
            self._task = self._progress.add_task(
                "train", total=self.total_steps, completed=self.start_step, stats=""
            )
            self._progress.start()

    def close(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> TrainingProgress:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- updates
    @property
    def seconds_per_step(self) -> float | None:
        if len(self._times) < 2:
            return None
        (s0, t0), (s1, t1) = self._times[0], self._times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record that ``step`` steps are complete, with that step's ``metrics``."""
        if not self.enabled:
            return
        if not self._started:
            self.start()
        step = int(step)
        safe = json_safe(metrics)
        for attr, key in (
            ("reward", "train/reward_mean"),
            ("accuracy", "eval/accuracy"),
            ("clip_fraction", "train/clip_fraction"),
            ("clip_off_policy", "train/clip_fraction_off_policy"),
            ("clip_on_policy", "train/clip_fraction_on_policy"),
        ):
            value = safe.get(key)
            if _is_number(value):
                setattr(self, attr, float(value))
        previous = self.step
        self.step = step
        if step > (self._times[-1][0] if self._times else previous):
            self._times.append((step, time.monotonic()))

        if self._live:
            self._progress.update(self._task, completed=step, stats=self.stats_text())
        elif step != previous and (
            not self._printed or step % self.every == 0 or step >= self.total_steps
        ):
            self._printed = True
            self._console.file.write(self.plain_line() + "\n")
            self._console.file.flush()

    def stats_text(self) -> str:
        """``"reward 0.512 | eval acc 0.430 | clip off-policy 0.38, on-policy 0 |
        3.21 s/step"`` (the parts known)."""
        parts = []
        if self.reward is not None:
            parts.append(f"reward {_fmt(self.reward)}")
        if self.accuracy is not None:
            parts.append(f"eval acc {_fmt(self.accuracy)}")
        clip = [
            f"{label} {_fmt(value)}"
            for label, value in (
                ("off-policy", self.clip_off_policy),
                ("on-policy", self.clip_on_policy),
            )
            if value is not None
        ]
        if clip:
            parts.append("clip " + ", ".join(clip))
        elif self.clip_fraction is not None:
            parts.append(f"clip {_fmt(self.clip_fraction)}")
        sps = self.seconds_per_step
        if sps is not None:
            parts.append(f"{sps:.2f} s/step")
        return " | ".join(parts)

    def plain_line(self) -> str:
        """The non-terminal progress line for the current state."""
        total = max(self.total_steps, 1)
        line = f"step {self.step}/{self.total_steps} ({100 * self.step / total:.0f}%)"
        stats = self.stats_text()
        if stats:
            line += " | " + stats
        sps = self.seconds_per_step
        if sps is not None and self.step < self.total_steps:
            line += f" | eta {_fmt_duration(sps * (self.total_steps - self.step))}"
        return line


def _fmt_duration(seconds: float) -> str:
    seconds = round(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"
