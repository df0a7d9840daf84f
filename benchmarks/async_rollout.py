"""Async rollouts: wall time of ``rollout.max_staleness`` 0 (synchronous) vs 1 and more.

    python benchmarks/async_rollout.py [--repeats 3]            # the reference workload
    python benchmarks/async_rollout.py --long [--repeats 3]     # the long workload

The gspo side of ``vs_trl.py`` (same model, prompts, reward and schedule: 16 prompts x 8
responses, 4 minibatches per rollout batch; ``--long``: the 520-token vocabulary, 256 new
tokens, 8 optimizer steps), run as whole processes with each ``--staleness`` in turn,
alternating (A, B, A, B, ...) so drift in the machine's speed hits every variant. Printed
per variant: the median whole-process and training-loop wall time, the time the trainer
waited for its rollout batches (``time/rollout_wait``, async only), the generation and
training time summed over the run (under async they overlap), and the mean clip fraction
of the first minibatch of each rollout batch (on-policy in the synchronous run, stale in
the async one). ``--steps`` overrides the schedule's optimizer steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import vs_trl
import workload

from gspo.provenance import code_commit, machine


def measure(work: Path, schedule: vs_trl.Schedule, staleness: list[int], repeats: int) -> dict:
    runs: dict[int, list[dict]] = {k: [] for k in staleness}
    for r in range(repeats):
        for k in staleness:
            seconds, out = vs_trl.run_gspo(
                work, name=f"async_k{k}", schedule=schedule, extra=(f"rollout.max_staleness={k}",)
            )
            lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
            train = [x for x in lines if "train/loss" in x]
            firsts = [x for x in train if x["train/minibatch"] == 0]
            summary = vs_trl.gspo_summary(out)
            runs[k].append(
                {
                    "process_s": seconds,
                    "loop_s": summary["loop_s"],
                    "rollout_wait_s": sum(x.get("time/rollout_wait", 0.0) for x in firsts),
                    "generate_s": sum(x["time/generate"] for x in firsts),
                    "train_s": sum(x["time/train"] for x in train),
                    "first_minibatch_clip": statistics.mean(
                        x["train/clip_fraction"] for x in firsts
                    ),
                    "reward_last": firsts[-1]["train/reward_mean"],
                    "mean_length": statistics.mean(x["train/response_length_mean"] for x in firsts),
                }
            )
            print(f"repeat {r + 1} k={k}: {seconds:.2f} s", flush=True)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="the long-response workload")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    schedule = vs_trl.LONG if args.long else vs_trl.REFERENCE
    if args.steps is not None:
        schedule = replace(schedule, steps=args.steps)
    default = "runs/bench_async_long" if args.long else "runs/bench_async"
    work = workload.build(
        args.workdir or Path(default), vocab=workload.LONG_VOCAB if args.long else None
    )
    print(
        f"gspo at {code_commit()}; {'long' if args.long else 'reference'} workload, "
        f"{schedule.steps} steps, {schedule.max_new_tokens} new tokens; machine: "
        f"{machine()}",
        flush=True,
    )
    runs = measure(work, schedule, args.staleness, args.repeats)
    (work / "async_results.json").write_text(json.dumps({str(k): v for k, v in runs.items()}))
    base = statistics.median(x["process_s"] for x in runs[args.staleness[0]])
    print(
        "\n| max_staleness | whole process s, median (each run) | vs first | training loop s "
        "| waited for rollouts s | generation s | forward/backward/optimizer s | first "
        "minibatch clip fraction | mean length |\n|---|---|---|---|---|---|---|---|---|"
    )
    for k, rs in runs.items():
        med = statistics.median(x["process_s"] for x in rs)
        each = ", ".join(f"{x['process_s']:.2f}" for x in rs)

        def m(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(x[key] for x in rs)

        print(
            f"| {k} | {med:.2f} ({each}) | {base / med:.2f}x | {m('loop_s'):.2f} | "
            f"{m('rollout_wait_s'):.2f} | {m('generate_s'):.2f} | {m('train_s'):.2f} | "
            f"{m('first_minibatch_clip'):.3f} | {m('mean_length'):.1f} |"
        )


if __name__ == "__main__":
    main()
