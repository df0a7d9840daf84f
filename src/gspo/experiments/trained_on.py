"""Where each compared run (and the cold start) was trained: the commit and machine of
each time, kept beside it; the report names them, since finished runs are reused across
commits."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

#: Beside each run and the cold start: the code and machine of each time it was trained
#: (a resume adds a line); the report names them (runs are reused across commits).
PROVENANCE = "trained_on.jsonl"


def record_provenance(run_dir: Path) -> None:
    from gspo.provenance import code_commit, machine

    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / PROVENANCE, "a") as f:
        f.write(json.dumps({"commit": code_commit(), "machine": machine()}) + "\n")


def provenance(dirs: Sequence[Path]) -> str:
    """Where the runs in ``dirs`` were trained: each commit and machine once, in order."""
    seen: dict[str, None] = {}
    for run_dir in dirs:
        path = run_dir / PROVENANCE
        lines = (
            [line for line in path.read_text().splitlines() if line.strip()]
            if path.is_file()
            else []
        )
        for line in lines or ["{}"]:
            try:
                made = json.loads(line)
                said = f"commit {made['commit']} on {made['machine']}"
            except (ValueError, TypeError, KeyError):  # (a line cut short, edited by hand)
                said = "commit unknown on unknown"
            seen[said] = None
    return "; ".join(seen)
