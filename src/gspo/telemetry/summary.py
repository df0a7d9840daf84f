"""The run summary: first, last and mean of each key metric, as a rich table.

:func:`summary_table` builds it from metric records, :func:`print_summary` prints it at
the end of a run; its caption says what the checkpoints took. rich is imported lazily.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gspo.telemetry.records import _fmt, _is_number

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console
    from rich.table import Table

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
    ("env/turns_mean", "turns / episode"),
    ("env/tool_call_valid_fraction", "tool calls valid"),
    ("moe/expert_change_fraction", "expert churn, one update (MoE)"),
)

#: An MoE run's expert churn: after the step on minibatch k, the fraction of its tokens'
#: expert choices that differ from the rollout's (k + 1 updates since pi_old).
CHURN = "moe/expert_change_fraction"


def churn_updates(record: Mapping[str, Any]) -> int:
    """The updates a log line's :data:`CHURN` is over: it is logged after every minibatch's
    step, against the rollout's routing, so minibatch k's is k + 1 updates' and one
    update's is minibatch 0's (a line without ``train/minibatch`` counts as minibatch 0).
    The one place of that rule: the run summary and ``gspo compare`` both read it."""
    return int(record.get("train/minibatch", 0)) + 1


#: Rows whose lines are taken from some records only: one update's expert churn
#: (:func:`churn_updates`).
SUMMARY_ROWS_OF: dict[str, Callable[[Mapping[str, Any]], bool]] = {
    CHURN: lambda record: churn_updates(record) == 1,
}


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
    fraction (off-policy minibatches, on-policy minibatch), response length, an
    environment's turns per episode and share of valid tool calls (training's), a MoE
    model's expert churn (the share of routed choices one update changed: minibatch 0's,
    :data:`SUMMARY_ROWS_OF`), and seconds per step (from one of :data:`STEP_TIME_KEYS`,
    else derived from the ``"time"`` column). The mean is over the records that have the
    metric (for the clip fractions, one per rollout batch), so what happened between first
    and last shows. Its caption: what the checkpoints took, bytes and seconds
    (:func:`checkpoint_writes`).
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
        of = SUMMARY_ROWS_OF.get(key)
        add(label, _points([r for r in records if of(r)] if of else records, key))
    if not any(add("seconds / step (no eval)", _points(records, key)) for key in STEP_TIME_KEYS):
        add("seconds / step (wall)", _wall_step_times(records))
    if not table.rows:
        table.caption = "no metrics recorded"
    else:
        table.caption = checkpoint_writes(records)
    return table


def checkpoint_writes(records: Sequence[Mapping[str, Any]]) -> str | None:
    """``wrote 12.3 MiB in 3 checkpoints: 0.4 s writing, 0.1 s waited``: the writes' own
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
