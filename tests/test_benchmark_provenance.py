"""Benchmarks that print figures print first where they ran: the commit and the machine
(a figure copied from their output into the docs can say both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.provenance import measured_at

ROOT = Path(__file__).resolve().parents[1]

#: Each script with arguments small enough for a test.
SMALL = {
    "profiler_tables.py": ["20"],
    "cdf_inversion.py": ["--rows", "2", "--reps", "1"],
    "reward_workers.py": ["--n", "4", "--workers", "0", "--repeats", "1"],
    "moe_experts.py": ["--experts", "8", "--reps", "1"],
}


@pytest.mark.parametrize("script", sorted(SMALL))
def test_a_benchmark_says_first_its_commit_and_machine(script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *SMALL[script]],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines[0] == measured_at()
