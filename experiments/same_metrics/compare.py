"""Whether two sets of runs from ``run.sh`` logged the same metrics and ratio dumps.

    .venv/bin/python experiments/same_metrics/compare.py BEFORE AFTER [RUN ...]

Times (``time/*``) are left out; every other value must be equal, bit for bit, and so must
every tensor of every ratio dump (NaN equal to NaN). Prints one line per run and exits 1
on the first difference found in any of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

RUNS = ("dense", "cut", "token", "moe_replay", "moe_recompute", "chain", "async", "tools", "ranks")


def records(run: Path, ignore: tuple[str, ...] = ()) -> list[dict]:
    """The run's metric lines without times (and without the keys in ``ignore``)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines if line.strip()]
    return [
        {k: v for k, v in r.items() if not k.startswith("time") and k not in ignore} for r in parsed
    ]


def same_tensor(a: object, b: object) -> bool:
    """Bit for bit, NaNs alike; a dump's other values (why a measure is left out:
    ``gradient_noise_skipped``) by equality."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return type(a) is type(b) and a == b
    return a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True)


def compare(before: Path, after: Path, name: str, ignore: tuple[str, ...] = ()) -> str | None:
    """``None`` when run ``name`` is the same in both, else what differs first."""
    a, b = records(before / name, ignore), records(after / name, ignore)
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} records"
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            keys = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
            return f"record {i} differs in {keys[:4]}"
    dumps_a = sorted((before / name / "ratios").glob("*.pt"))
    dumps_b = sorted((after / name / "ratios").glob("*.pt"))
    if [p.name for p in dumps_a] != [p.name for p in dumps_b]:
        return "different ratio dumps"
    for pa, pb in zip(dumps_a, dumps_b, strict=True):
        da, db = torch.load(pa), torch.load(pb)
        if da.keys() != db.keys() or not all(same_tensor(da[k], db[k]) for k in da):
            return f"{pa.name} differs"
    return None


def main(argv: list[str]) -> int:
    """``compare.py BEFORE AFTER [RUN ...] [--ignore KEY ...]``: ``--ignore`` leaves out
    metrics a change alters by design (``io/checkpoint_bytes`` when checkpoints hold a
    new file), said in the output."""
    ignore: tuple[str, ...] = ()
    if "--ignore" in argv:
        at = argv.index("--ignore")
        argv, ignore = argv[:at], tuple(argv[at + 1 :])
        print(f"ignoring {', '.join(ignore)}")
    before, after, *names = argv
    failed = False
    for name in names or RUNS:
        problem = compare(Path(before), Path(after), name, ignore)
        n = len(records(Path(before) / name))
        print(f"{name}: {'same' if problem is None else problem} ({n} records)")
        failed |= problem is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
