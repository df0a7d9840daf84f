"""What ``log.profile_steps``' tables cost for a large trace: torch's ``key_averages``
against reading the exported trace (``gspo.telemetry.profiling.op_tables``).

    .venv/bin/python benchmarks/profiler_tables.py [iterations]   # default 100000

Profiles ``iterations`` rounds of three tiny CPU operators (14 recorded events each, so
the default records about 1.4M, the order of one rollout batch of the ~0.5B model on a
GPU), once as gspo did before (the profiler's Python events, ``key_averages().table``)
and once as it does now (``trace_only`` where torch has it, the tables from the trace's
JSON). Prints each phase's seconds: the run and stop, the trace's export, its JSON parse,
the tables.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from gspo.provenance import measured_at
from gspo.telemetry.profiling import op_tables


def main() -> None:
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    print(measured_at(), flush=True)
    x = torch.ones(4)
    path = Path(tempfile.mkdtemp()) / "trace.json"
    for mode in ("key_averages (before)", "from the trace (now)"):
        now = mode.startswith("from")
        try:
            config = _ExperimentalConfig(profile_all_threads=True, trace_only=now)
        except TypeError:  # (a torch without trace_only)
            config = _ExperimentalConfig(profile_all_threads=True)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            for _ in range(iterations):
                (x + 1).mul(2).sum()
        t1 = time.perf_counter()
        prof.export_chrome_trace(str(path))
        t2 = time.perf_counter()
        trace = json.loads(path.read_text())
        t3 = time.perf_counter()
        if now:
            op_tables(trace)
        else:
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
        t4 = time.perf_counter()
        print(
            f"{mode}: {len(trace['traceEvents']):,} events; run+stop {t1 - t0:.2f} s, "
            f"export {t2 - t1:.2f} s, JSON {t3 - t2:.2f} s, tables {t4 - t3:.2f} s"
        )
    path.unlink()


if __name__ == "__main__":
    main()
