"""Measuring in a fresh process: :func:`run_child`, shared by the benchmarks that do.

Light on purpose (no torch, no gspo): a child imports it before it measures anything.
"""

from __future__ import annotations

import json
import subprocess
import sys


def run_child(script: str, argv: list[str]) -> dict:
    """Run ``script`` (a benchmark's ``__file__``) with ``argv`` in a fresh Python; its last
    stdout line, as JSON (a measurement free of the parent's allocations and caches)."""
    out = subprocess.run(
        [sys.executable, script, *argv], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
