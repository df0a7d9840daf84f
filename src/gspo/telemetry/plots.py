"""Plots of metric records: one run's curves, several runs overlaid, bands over seeds.

:func:`plot_metrics` writes a run's standard PNGs (reward, accuracy, clip fraction, the
sampler-trainer mismatch, a MoE run's expert change);
:func:`plot_series`, :func:`plot_runs`, :func:`plot_bands` and :func:`plot_histograms`
are the building blocks the comparisons and experiments use. matplotlib is imported
lazily and drawn on a bare ``Figure`` (no pyplot state), so plotting is safe headless.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gspo.telemetry.records import _is_number, read_metrics

_FIGSIZE = (6.0, 4.0)
_DPI = 100
#: Title characters that fit the figure's width at the default title size (longer titles
#: are set smaller and wrapped at 1.25 times this).
_TITLE_CHARS = 56


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
    """Draw ``(label, xs, ys, band_halfwidths | None)`` lines into one PNG at ``path``.

    A line equal to one drawn before it (GSPO-token's to GSPO's, with one advantage per
    response) would hide it: it is dashed over it, labelled ``LABEL (= EARLIER)``."""
    fig, ax = _new_figure()
    all_y: list[float] = []
    drawn: dict[tuple[tuple[float, ...], tuple[float, ...]], str] = {}
    for label, xs, ys, band in lines:
        marker = "o" if len(xs) <= 30 else None
        style: dict[str, Any] = {"marker": marker, "markersize": 3, "linewidth": 1.5}
        same = drawn.setdefault((tuple(xs), tuple(ys)), label)
        if repeated := same != label:  # (its band is the one drawn: not drawn again)
            style |= {"linestyle": (0, (4, 3)), "marker": "x" if marker else None}
            label = f"{label} (= {same})"
        (line,) = ax.plot(xs, ys, label=label, **style)
        all_y.extend(ys)
        if band is not None and not repeated:
            lo = [y - b for y, b in zip(ys, band, strict=True)]
            if logy and all(y >= 0 for y in ys):  # a spread of non-negative values stays >= 0
                lo = [max(v, 0.0) for v in lo]
            hi = [y + b for y, b in zip(ys, band, strict=True)]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
            all_y.extend(lo + hi)
    if logy:
        _set_log_scale(ax, all_y)
    if xlabel == "step":  # (a short run's axis read 0.5, 1.0, 1.5, ... steps)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
    each step (e.g. ``elapsed`` seconds), the spread is the sample standard deviation
    (``None`` for a group of one run). Groups without ``key`` are left out, and so are
    non-finite values (a group of NaN cosines drew a plot with a legend and no line).
    """
    lines = []
    for name, runs in groups.items():
        per_run = []  # per run: step -> (x, value)
        for records in runs:
            points = {
                float(r["step"]): (float(r[x]), float(r[key]))
                for r in records
                if _is_number(r.get(key))
                and _is_number(r.get("step"))
                and _is_number(r.get(x))
                and math.isfinite(float(r[key]))
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
        # (the sample sd, as gspo compare's table gives "± sd over seeds": the population
        # sd drew a band 0.71x the table's from 2 seeds, 0.82x from 3)
        band = [statistics.stdev(v) for v in values] if len(per_run) > 1 else None
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
    label = xlabel or ("run seconds (steps, evaluations, checkpoints)" if x == "elapsed" else x)
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
    drawn: dict[tuple[float, ...], str] = {}
    for label, values in data.items():
        style: dict[str, Any] = {}
        if (same := drawn.setdefault(tuple(values), label)) != label:  # as _draw's lines
            label, style = f"{label} (= {same})", {"linestyle": (0, (4, 3))}
        ax.hist(values, bins=bins, range=(lo, hi), density=True, histtype="step", label=label,
                **style)  # fmt: skip
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
    ``eval/accuracy_greedy``), ``clip_fraction.png`` (per rollout batch,
    ``train/clip_fraction_off_policy`` and ``train/clip_fraction_on_policy``, linear
    y-axis), ``mismatch.png`` (the sampler's and the trainer's log-probs apart, per rollout
    batch: ``mismatch/token_abs_mean``,
    ``mismatch/sequence_mean_delta_abs_mean``, log y-axis) and ``expert_change.png`` (MoE:
    ``moe/expert_change_fraction``). The per-batch figures (reward, clip fractions,
    mismatch) are one point per rollout batch, at its last step. Returns the paths written.
    """
    records = read_metrics(metrics_path)
    batches = per_rollout_batch(records)
    out = Path(output_dir)
    written = [
        plot_series(
            batches,
            ["train/reward_mean"],
            out / "reward.png",
            title="Training reward",
            ylabel="reward (mean ± std over a rollout batch)",
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
            batches,
            ["train/clip_fraction_off_policy", "train/clip_fraction_on_policy"],
            out / "clip_fraction.png",
            title="Clipped token fraction per rollout batch",
            ylabel="fraction of tokens clipped",
        ),
        plot_series(
            batches,
            ["mismatch/token_abs_mean", "mismatch/sequence_mean_delta_abs_mean"],
            out / "mismatch.png",
            # (pi_old recomputed: the whole rollout batch's; else minibatch 0's, on-policy)
            title="Sampler vs trainer log-probs per rollout batch",
            ylabel="|log-prob difference| (mean)",
            logy=True,
        ),
        plot_series(
            records,
            ["moe/expert_change_fraction"],
            out / "expert_change.png",
            title="MoE routing changed since the rollout, after each optimizer step",
            ylabel="fraction of expert choices changed",
        ),
    ]
    return [p for p in written if p is not None]


def per_rollout_batch(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One record per rollout batch (``train/rollout``): its minibatches' lines merged, at
    the step its last update took. A batch's figures (its reward, the mismatch of its
    first minibatch, the clip fractions of its last) were drawn once per minibatch line,
    a staircase of equal points, or at different steps from plot to plot. A line without
    ``train/rollout`` (an evaluation; a file older than it) is kept as it is."""
    merged: dict[float, dict[str, Any]] = {}
    kept: list[dict[str, Any]] = []
    for record in records:
        if _is_number(index := record.get("train/rollout")) and _is_number(record.get("step")):
            batch = merged.setdefault(float(index), {})
            step = max(float(record["step"]), float(batch.get("step", record["step"])))
            batch.update(record)
            batch["step"] = step
        else:
            kept.append(dict(record))
    return [*kept, *merged.values()]


def plots_so_far(run: Path) -> None:
    """A stopped run's plots of what it logged (Ctrl-C, SIGTERM at a cluster's time limit,
    an error): before, only a run that finished drew any. Best effort: a stop's own line
    is what the user reads, so a plot that fails is left out, unsaid."""
    with contextlib.suppress(Exception):
        if (run / "metrics.jsonl").is_file():
            plot_metrics(run / "metrics.jsonl", run / "plots")
