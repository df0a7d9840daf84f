"""The training progress display: a live rich bar on a terminal, plain lines otherwise.

rich is imported lazily, when the display starts.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gspo.telemetry.records import _fmt, _is_number, json_safe

if TYPE_CHECKING:  # pragma: no cover - typing only
    from rich.console import Console


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
    printed each time the step count reaches or passes a multiple of
    ``max(1, total_steps // 20)`` (about 20 lines a run, whatever the steps per rollout
    batch), and at the last step, instead.
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
        self.accuracy_step = 0  # (the step that evaluation ran at)
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
            from rich.table import Column

            # a narrow terminal wraps the figures onto a second line: the bar, the step
            # count and the times keep their width (they were cut to "…" before)
            bar = max(10, min(40, self._console.width - 110))
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(bar_width=bar),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=False, ratio=1)),
                console=self._console,
                expand=True,
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

    def record(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Keep the figures the display shows from ``metrics`` (e.g. the evaluation before
        the first step), those of ``step`` (default: the current one), without showing
        anything yet."""
        safe = json_safe(metrics)
        if _is_number(safe.get("eval/accuracy")):
            self.accuracy_step = self.step if step is None else int(step)
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
        # a rollout batch of stale weights (rollout.max_staleness) has no on-policy
        # minibatch: an earlier batch's figure stayed on the line, as if this batch's
        if "train/clip_fraction_off_policy" in safe and "train/clip_fraction_on_policy" not in safe:
            self.clip_on_policy = None

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record that ``step`` steps are complete, with that step's ``metrics``."""
        if not self.enabled:
            return
        if not self._started:
            self.start()
        step = int(step)
        self.record(metrics, step)
        previous = self.step
        self.step = step
        if step > (self._times[-1][0] if self._times else previous):
            self._times.append((step, time.monotonic()))

        if self._live:
            self._progress.update(self._task, completed=step, stats=self.stats_text())
        elif step != previous and (
            # a multiple of `every` reached or passed: steps come `minibatches` at a time
            not self._printed or step // self.every > previous // self.every
            or step >= self.total_steps
        ):  # fmt: skip
            self._printed = True
            self._console.file.write(self.plain_line() + "\n")
            self._console.file.flush()

    def stats_text(self) -> str:
        """``"reward 0.512 | eval acc 0.430 | clip off-policy 0.38, on-policy 0 |
        3.21 s/step"`` (the parts known)."""
        parts = []
        if self.reward is not None:
            parts.append(f"reward {_fmt(self.reward)}")
        if self.accuracy is not None:  # (an earlier evaluation's: said, it read as this step's)
            at = f" (step {self.accuracy_step})" if self.accuracy_step != self.step else ""
            parts.append(f"eval acc {_fmt(self.accuracy)}{at}")
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
