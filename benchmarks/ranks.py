"""One process vs two torchrun ranks (FSDP2, gloo) on the reference workload, this CPU.

    python benchmarks/ranks.py [--repeats 3] [--workdir DIR]

The gspo side of ``vs_trl.py`` (same model, prompts, reward and schedule: 32 optimizer
steps, 128 completions per rollout batch) run three ways, alternating, each a fresh
process: one process with every core's thread; ``torchrun --nproc-per-node 2`` (each rank
half of every rollout batch, one thread each, as torchrun sets); and one process with one
thread, the per-rank baseline. Printed per way: median whole-process seconds, the RL
loop (first to last step record), gspo's phases and the last rollout batch's reward, so
the cost of the ranks' communication and duplicated work is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402
from vs_trl import gspo_summary, run_gspo  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
WAYS = {
    "1 process, all threads": None,
    "2 ranks (torchrun, 1 thread each)": [*TORCHRUN, "2"],
    "1 process, 1 thread": [*TORCHRUN, "1"],  # torchrun sets OMP_NUM_THREADS=1
}


def last_reward(run: Path) -> float:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "train/reward_mean" in r][-1]["train/reward_mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_ranks"))
    args = parser.parse_args()
    work = workload.build(args.workdir)
    results: dict[str, list[dict]] = {way: [] for way in WAYS}
    for i in range(args.repeats):
        order = list(WAYS) if i % 2 == 0 else list(reversed(WAYS))
        for way in order:
            seconds, run = run_gspo(work, WAYS[way], name=f"run-{list(WAYS).index(way)}")
            summary = gspo_summary(run)
            summary.update(seconds=seconds, reward=last_reward(run))
            results[way].append(summary)
            print(f"repeat {i + 1}, {way}: {seconds:.2f} s", flush=True)
    print(f"\n{len(os.sched_getaffinity(0))} cores; medians over {args.repeats} repeats")
    print("| way | whole process (s) | RL loop (s) | generation (s) | train (s) | reward |")
    print("|---|---|---|---|---|---|")
    for way, rows in results.items():
        figures = [
            statistics.median(r["seconds"] for r in rows),
            statistics.median(r["loop_s"] for r in rows),
            statistics.median(r["phases"]["generation"] for r in rows),
            statistics.median(r["phases"]["forward/backward/optimizer"] for r in rows),
        ]
        reward = statistics.median(r["reward"] for r in rows)
        print(f"| {way} | " + " | ".join(f"{x:.2f}" for x in figures) + f" | {reward:.3f} |")


if __name__ == "__main__":
    main()
