"""``train.time_limit``: a run that ends itself, with a checkpoint, before its job's time
runs out (a scheduler's limit: SLURM's ``--time``), instead of being killed there and
redoing the steps since its last checkpoint on resume.

Checked between rollout batches, and every :data:`COLD_START_EVERY` cold-start steps: the
next such stretch (as long as the longest so far) and a checkpoint (as long as the
longest written so far) must fit, :data:`MARGIN` times over, in the time left; if not, the
run writes its checkpoint (a cold start: its progress checkpoint) and stops. Counted from
the trainer's start (the imports before it take seconds). Under ``torchrun`` rank 0's
clock decides for every rank.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gspo.distributed import Distributed

#: How many times over the next stretch of training and a checkpoint must fit in the time
#: left.
MARGIN = 1.5

#: Cold-start steps between two looks at the clock (each one a collective under torchrun).
COLD_START_EVERY = 10

#: Process exit status of a run stopped at its time limit (``EX_TEMPFAIL``: try again
#: later), for a job script to requeue on (``gspo train ... --auto-resume``). Under torchrun
#: the ranks exit 0 instead: torchrun reports any other status as a failure, its own 1
#: after a traceback, and the script reads :data:`STOPPED_FILE`.
OUT_OF_TIME = 75

#: Written in the run's directory when it stops at its time limit (its stop line), removed
#: when the run goes on: what a job script requeues on under torchrun.
STOPPED_FILE = "stopped_at_time_limit"

_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)([dhms]))")


def parse_duration(value: Any) -> Any:
    """Seconds from ``3h50m``, ``90m``, ``45s``, ``1d`` or a number of seconds; anything
    else is returned as it is (for the field's own check to refuse)."""
    if not isinstance(value, str):
        return value
    text = value.strip().lower().replace(" ", "")
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    if not text or _DURATION.sub("", text):
        raise ValueError("no duration: 3h50m, 90m, 45s, 1d or a number of seconds")
    return sum(float(n) * _UNITS[unit] for n, unit in _DURATION.findall(text))


def said(seconds: float) -> str:
    """``3h50m`` for 13800 seconds, ``0.4s`` for 0.4."""
    if seconds < 60:
        return f"{seconds:g}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "",
             f"{secs}s" if secs or not whole else ""]  # fmt: skip
    return "".join(parts)


class TimeLimit:
    """The run's time limit (``seconds``; None: none), with the longest stretch of each
    kind seen (``"rl"``: a rollout batch, evaluation and checkpoint included; ``"sft"``:
    :data:`COLD_START_EVERY` cold-start steps)."""

    def __init__(
        self,
        seconds: float | None,
        dist: Distributed,
        clock: Callable[[], float] | None = None,
    ):
        self.seconds = seconds
        self.dist = dist
        self.clock = clock or time.monotonic
        self.start = self.clock()
        self.longest: dict[str, float] = {}
        # where the run stopped, its checkpoint written ("after step 40 of 200"; None: not)
        self.stopped: str | None = None

    def took(self, seconds: float, kind: str = "rl") -> None:
        """A stretch of ``kind`` took ``seconds``."""
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)

    def reached(self, checkpoint_s: float, kind: str = "rl") -> bool:
        """Whether the next stretch of ``kind`` and a checkpoint of ``checkpoint_s`` seconds
        would not fit in the time left (:data:`MARGIN` times over); every rank the same."""
        if self.seconds is None:
            return False
        left = self.seconds - (self.clock() - self.start)
        stop = left < MARGIN * (self.longest.get(kind, 0.0) + checkpoint_s)
        return bool(self.dist.gather_objects(stop)[0])

    def record(self, run_dir: Path) -> None:
        """Say that the run stopped here: in :data:`STOPPED_FILE` (for a requeued job's
        script) and as the run's last line, on stderr (rank 0)."""
        from gspo.publish import write_atomic

        write_atomic(run_dir / STOPPED_FILE, self.line() + "\n")
        print(self.line(), file=sys.stderr, flush=True)

    @staticmethod
    def going_on(run_dir: Path) -> None:
        """The run goes on: no :data:`STOPPED_FILE` left from its last stop (rank 0)."""
        (run_dir / STOPPED_FILE).unlink(missing_ok=True)

    def line(self) -> str:
        """What the stopped run says, as its last line."""
        return (
            f"gspo: train.time_limit={said(self.seconds or 0)}: stopped {self.stopped}, its "
            "checkpoint written (the next stretch might not have fit); the same command "
            "with --auto-resume (or gspo train --resume on the run) continues it"
        )
