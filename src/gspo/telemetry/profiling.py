"""``log.profile_steps``: where one rollout batch's time goes, from PyTorch's profiler.

The rollout batch that takes each listed optimizer step (generation, scoring, the pass
before the update and its ``algorithm.minibatches`` updates) runs under
:class:`torch.profiler.profile` (the CPU, and CUDA's kernels on a GPU) and
:mod:`cProfile`; step 0 is the start-up (building the trainer). Written beside the run,
one directory per profile (``profile/steps_A-B/``, ``profile/startup/``; a ``rank_R``
level under torchrun):

- ``trace.json.gz``: the timeline (Perfetto, ``chrome://tracing``, TensorBoard's
  profiler plugin), with the loop's stages marked (``time/generate``, ``time/reward``,
  ... as :func:`gspo.training.metrics.timed` names them);
- ``summary.md``: the wall seconds; on CUDA the share of them some kernel ran (the union
  of kernel, copy and fill intervals), the host's waits for the device (the runtime's
  ``*Synchronize`` calls: count and seconds); each stage's seconds (on CUDA beside the
  device seconds of the kernels it launched: a stage whose kernels take far less than
  its seconds waits on the host); the kernels taking the most device time (CUDA), in
  all and launched by each stage, the operators taking the most self time on the CPU,
  and the Python functions taking the most cumulative time (the thread that trains).

Every thread's operators are recorded (:func:`experimental_config`): with
``rollout.max_staleness > 0`` the producer thread's sampling of the batch ahead.
One line says where it is. The profiler's own overhead lengthens that batch (its
``time/*`` metrics included), so profile a batch whose timings you do not compare.
"""

from __future__ import annotations

import contextlib
import cProfile
import gzip
import io
import json
import pstats
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Rows of each operator table in ``summary.md``.
TOP_OPS = 20

#: Rows of each stage's kernel table.
STAGE_OPS = 8

#: A stage marked in the trace: what :func:`gspo.training.metrics.timed` records.
STAGE_PREFIX = "time/"


def profiled_steps(index: int, minibatches: int, steps: list[int]) -> tuple[int, int] | None:
    """The optimizer steps (first, last) rollout batch ``index`` takes, if one of them is
    in ``steps``; else None."""
    first, last = index * minibatches + 1, (index + 1) * minibatches
    return (first, last) if any(first <= s <= last for s in steps) else None


@dataclass
class Profile:
    """What ``summary.md`` says of one profiled rollout batch (seconds; device figures
    None where no kernel was recorded: the CPU)."""

    wall: float
    device_busy: float | None
    host_waits: int | None
    host_wait_seconds: float | None
    stages: dict[str, float]
    #: each stage's kernel seconds (:func:`stage_kernels`), where the device recorded any
    stage_device: dict[str, float] = field(default_factory=dict)


def trace_figures(trace: dict[str, Any], wall: float) -> Profile:
    """:class:`Profile` of a Chrome trace as :meth:`torch.profiler.profile.
    export_chrome_trace` writes it (times in microseconds)."""
    spans: list[tuple[float, float]] = []
    waits, waited = 0, 0.0
    stages: dict[str, float] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        cat, name = event.get("cat", ""), event.get("name", "")
        start, dur = float(event.get("ts", 0.0)), float(event.get("dur", 0.0))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            spans.append((start, start + dur))
        elif cat == "cuda_runtime" and name.endswith("Synchronize"):
            waits, waited = waits + 1, waited + dur
        elif cat == "user_annotation" and name.startswith(STAGE_PREFIX):
            stages[name] = stages.get(name, 0.0) + dur / 1e6
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):  # the union of the intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    has_device = bool(spans)
    return Profile(
        wall=wall,
        device_busy=busy / 1e6 if has_device else None,
        host_waits=waits if has_device else None,
        host_wait_seconds=waited / 1e6 if has_device else None,
        stages=stages,
    )


def op_tables(trace: dict[str, Any], rows: int = TOP_OPS) -> list[tuple[str, str]]:
    """The trace's costliest work as ``(heading, table)``: on a device the kernels (and
    copies, fills) by their summed device time; on the host the operators by self time
    (their time less that of the operators they called, per thread). Read from the
    exported trace rather than from the profiler's Python events, whose building takes
    minutes for the million events of a GPU batch."""
    device = device_totals(trace)
    threads: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        cat, name = event.get("cat", ""), str(event.get("name", ""))
        dur = float(event.get("dur", 0.0))
        if cat == "cpu_op":
            key = (event.get("pid"), event.get("tid"))
            threads.setdefault(key, []).append((float(event.get("ts", 0.0)), dur, name))
    host: dict[str, list[float]] = {}
    for events in threads.values():
        events.sort(key=lambda e: (e[0], -e[1]))
        stack: list[list[Any]] = []  # [end, name, self time] of the open operators
        for start, dur, name in events:
            while stack and stack[-1][0] <= start:
                close(stack.pop(), host)
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, name, dur])
        while stack:
            close(stack.pop(), host)
    tables = []
    if device:
        tables.append(("device time by kernel", table(device, "device ms", rows)))
    tables.append(("self CPU time", table(host, "self CPU ms", rows)))
    return tables


def device_totals(trace: dict[str, Any]) -> dict[str, list[float]]:
    """Each kernel's (and copy's, fill's) name in the trace -> [calls, device microseconds]."""
    device: dict[str, list[float]] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            totals = device.setdefault(str(event.get("name", "")), [0, 0.0])
            totals[0], totals[1] = totals[0] + 1, totals[1] + float(event.get("dur", 0.0))
    return device


def stage_kernels(trace: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Each stage's kernels (and copies, fills) as :func:`device_totals` sums them: a
    kernel belongs to the innermost stage mark (``time/*``) that holds, on its thread, the
    runtime or driver call that launched it (the one with its ``correlation`` id: a
    launch, a graph's replay, a Triton kernel's ``cuLaunchKernel``). A launch from a thread
    that sets no marks (autograd's device thread, which runs backward on CUDA) is held by
    the marks of the thread that trains (the one with ``time/train``); a kernel whose launch
    was not recorded, by the marks that hold its own start. Kernels of no stage are left
    out."""
    marks: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    launches: dict[Any, tuple[tuple[Any, Any], float]] = {}
    kernels = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        cat, name = event.get("cat", ""), str(event.get("name", ""))
        start, dur = float(event.get("ts", 0.0)), float(event.get("dur", 0.0))
        thread = (event.get("pid"), event.get("tid"))
        if cat == "user_annotation" and name.startswith(STAGE_PREFIX):
            marks.setdefault(thread, []).append((start, start + dur, name))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in event.get("args", {}):
            launches[event["args"]["correlation"]] = (thread, start)
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append((event.get("args", {}).get("correlation"), start, dur, name))
    anywhere = [mark for spans in marks.values() for mark in spans]
    trains = next((spans for spans in marks.values()
                   if any(m[2] == f"{STAGE_PREFIX}train" for m in spans)), anywhere)  # fmt: skip
    out: dict[str, dict[str, list[float]]] = {}
    for correlation, start, dur, name in kernels:
        if correlation in launches:
            thread, at = launches[correlation]
            candidates = marks.get(thread, trains)
        else:
            at, candidates = start, anywhere
        holding = [m for m in candidates if m[0] <= at <= m[1]]
        if not holding:
            continue
        stage = min(holding, key=lambda m: m[1] - m[0])[2]  # the innermost
        totals = out.setdefault(stage, {}).setdefault(name, [0, 0.0])
        totals[0], totals[1] = totals[0] + 1, totals[1] + dur
    return out


def close(frame: list[Any], totals: dict[str, list[float]]) -> None:
    entry = totals.setdefault(frame[1], [0, 0.0])
    entry[0], entry[1] = entry[0] + 1, entry[1] + max(frame[2], 0.0)


def table(totals: dict[str, list[float]], what: str, rows: int) -> str:
    """The ``rows`` names with the most time (microseconds in ``totals``): calls, ms,
    share of all of it."""
    whole = sum(t for _, t in totals.values()) or 1.0
    lines = [f"{what:>12} {'share':>6} {'calls':>8}  name"]
    for name, (calls, us) in sorted(totals.items(), key=lambda kv: -kv[1][1])[:rows]:
        short = name if len(name) <= 100 else name[:97] + "..."
        lines.append(f"{us / 1e3:12.3f} {us / whole:6.1%} {calls:8d}  {short}")
    return "\n".join(lines)


def summary_text(title: str, profile: Profile, tables: list[tuple[str, str]]) -> str:
    """``summary.md``: the figures, then each ``(heading, table)``."""
    lines = [f"# {title}", "", f"- wall: {profile.wall:.3f} s"]
    if profile.device_busy is not None:
        share = profile.device_busy / profile.wall if profile.wall > 0 else 0.0
        lines.append(
            f"- device busy (some kernel, copy or fill running): {profile.device_busy:.3f} s, "
            f"{share:.1%} of the wall time"
        )
        lines.append(
            f"- host waits for the device (*Synchronize calls): {profile.host_waits}, "
            f"{profile.host_wait_seconds:.3f} s"
        )
    if profile.stages and profile.stage_device:
        lines += ["", "| stage | s | its kernels' device s |", "|---|---|---|"]
        lines += [
            f"| {k} | {v:.3f} | {profile.stage_device.get(k, 0.0):.3f} |"
            for k, v in sorted(profile.stages.items())
        ]
    elif profile.stages:
        lines += ["", "| stage | s |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in sorted(profile.stages.items())]
    for heading, table in tables:
        lines += ["", f"## {heading}", "", "```", table.rstrip(), "```"]
    return "\n".join(lines) + "\n"


def python_table(python: cProfile.Profile, rows: int = TOP_OPS) -> str:
    """The ``rows`` functions of ``python`` with the most cumulative time, as
    :mod:`pstats` prints them (its header lines left out)."""
    out = io.StringIO()
    pstats.Stats(python, stream=out).sort_stats("cumulative").print_stats(rows)
    lines = out.getvalue().splitlines()
    first = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(line for line in lines[first:] if line.strip())


def experimental_config():
    """The profiler's setting that records every thread's operators, not only the one that
    starts it (``rollout.max_staleness > 0``: the producer thread samples and scores while
    the training thread updates), and builds no Python event per recorded one (the tables
    are read from the exported trace) where it can; None where this torch lacks
    ``profile_all_threads``."""
    from torch._C._profiler import _ExperimentalConfig

    for settings in ({"trace_only": True}, {}):
        try:
            return _ExperimentalConfig(profile_all_threads=True, **settings)
        except TypeError:  # (older torch: without trace_only; or the starting thread only)
            continue
    return None


class StepProfiler:
    """Runs the rollout batches that take ``steps`` under the profiler (:meth:`around`),
    and with step 0 the start-up (:meth:`startup`); ``out``: the run's directory;
    ``device``: ``model.device`` (CUDA's kernels are recorded unless it is the CPU);
    ``rank``/``world``: this process's place (every rank profiles its own share; rank 0
    says where)."""

    def __init__(
        self,
        steps: list[int],
        minibatches: int,
        out: Path,
        *,
        device: str = "auto",
        rank: int = 0,
        world: int = 1,
    ):
        self.steps, self.minibatches = sorted(set(steps)), minibatches
        self.out, self.device, self.rank, self.world = out, device, rank, world

    @classmethod
    def of_run(cls, config, out: Path, dist) -> StepProfiler:
        """The profiler a run's config (``log.profile_steps``) asks for, on rank ``dist``."""
        return cls(
            config.log.profile_steps, config.algorithm.minibatches, Path(out),
            device=config.model.device, rank=dist.rank, world=dist.world_size,
        )  # fmt: skip

    def around(self, index: int) -> contextlib.AbstractContextManager[None]:
        """Profile rollout batch ``index`` if it takes one of the steps (else run it as is)."""
        span = profiled_steps(index, self.minibatches, self.steps)
        if span is None:
            return contextlib.nullcontext()
        first, last = span
        return self._profiled(f"steps_{first}-{last}", f"optimizer steps {first}-{last}")

    def startup(self) -> contextlib.AbstractContextManager[None]:
        """Profile building the trainer (the model loaded and placed, the engine, the data,
        the rewards) if step 0 is listed."""
        if 0 not in self.steps:
            return contextlib.nullcontext()
        return self._profiled("startup", "the start-up: building the trainer")

    @contextlib.contextmanager
    def _profiled(self, name: str, title: str) -> Iterator[None]:
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device != "cpu" and torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        python = cProfile.Profile()  # (where the host's time goes between operators)
        with profile(activities=activities, experimental_config=experimental_config()) as prof:
            start = time.perf_counter()
            python.enable()
            try:
                yield
            finally:
                python.disable()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        self.write(prof, python, name, title, wall)

    def write(self, prof, python: cProfile.Profile, name: str, title: str, wall: float) -> None:
        """``trace.json.gz`` and ``summary.md`` in ``profile/NAME/``; one line on rank 0."""
        where = self.out / "profile" / name
        where = where / f"rank_{self.rank}" if self.world > 1 else where
        where.mkdir(parents=True, exist_ok=True)
        raw = where / "trace.json"
        prof.export_chrome_trace(str(raw))
        with (
            raw.open("rb") as source,
            gzip.open(where / "trace.json.gz", "wb", compresslevel=3) as target,  # (9: slow)
        ):
            shutil.copyfileobj(source, target)
        trace = json.loads(raw.read_text())
        raw.unlink()
        figures = trace_figures(trace, wall)
        by_stage = stage_kernels(trace)
        figures.stage_device = {
            k: sum(us for _, us in v.values()) / 1e6 for k, v in by_stage.items()
        }
        tables = op_tables(trace)
        tables[1:1] = [  # after all the device's kernels, each stage's
            (f"device time by kernel, {stage}", table(totals, "device ms", STAGE_OPS))
            for stage, totals in sorted(by_stage.items())
        ]
        tables.append(("Python functions by cumulative time (this thread)", python_table(python)))
        title += f", rank {self.rank}" if self.world > 1 else ""
        (where / "summary.md").write_text(summary_text(title, figures, tables))
        if self.rank == 0:
            busy = (
                f", the device busy {figures.device_busy / wall:.0%} of it"
                if figures.device_busy is not None and wall > 0
                else ""
            )
            print(
                f"gspo: profiled {title}: {wall:.2f} s{busy}; "
                f"{where / 'summary.md'}, {where / 'trace.json.gz'}",
                file=sys.stderr,
                flush=True,
            )
