"""Off-policy experiment: rollout correction and dynamic sampling under injected mismatch.

On the long-response ``chain`` task, the sampler's logits get Gaussian noise
(``rollout.logit_noise``), so the policy that samples differs from the one that trains
by a known amount. From ONE shared cold start, each arm runs a short RL stage on 3 seeds:
GRPO without mismatch (the reference), GRPO with it and no correction, GRPO with each
``algorithm.rollout_correction``, GSPO (pi_old = the sampler's log-probs, the paper's
default), and GSPO with ``rollout.filter_groups``. The report goes to
``docs/offpolicy/report.md`` (figures: means and standard deviations over seeds).

    python experiments/offpolicy/run.py [--out runs/offpolicy] [--seeds 0 1 2] [--arms ...]

Finished runs are reused, interrupted ones resumed; the cold start is made once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gspo.config import load_config
from gspo.experiments import cold_start_checkpoint, run_or_reuse, train_lines
from gspo.provenance import code_commit

#: The task and model, cold start included (a smaller version of ``gspo compare --preset
#: long``: 10 terms, 600 SFT steps).
BASE = [
    "data.task=chain",
    "data.terms=10",
    "data.label_noise=0.2",
    "reward.functions=[numeric_match]",
    "rollout.max_new_tokens=120",
    "model.layers=2",
    "model.hidden=128",
    "model.heads=4",
    "model.kv_heads=2",
    "model.intermediate=384",
    "train.cold_start_steps=600",
    "eval.max_prompts=64",
]

#: The RL stage every arm shares: 8 rollout batches of 8 prompts x 8 responses, 4
#: minibatches (optimizer steps) each, so 3 of every 4 updates are off-policy. Sized for a
#: 2-core machine shared with other jobs: 21 runs in well under an hour.
RL = [
    "train.max_steps=32",
    "rollout.prompts_per_batch=8",
    "algorithm.minibatches=4",
    "optim.lr=1e-4",
    "eval.every=0",
    "eval.samples=2",
    "eval.greedy=false",
    "train.save_every=0",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]

NOISE = "rollout.logit_noise=1.0"
GRPO = ["algorithm.level=token", "algorithm.old_logprobs=recompute"]

ARMS: dict[str, list[str]] = {
    "GRPO, no mismatch": [*GRPO],
    "GRPO": [*GRPO, NOISE],
    "GRPO + token_tis": [*GRPO, NOISE, "algorithm.rollout_correction=token_tis"],
    "GRPO + token_mask": [*GRPO, NOISE, "algorithm.rollout_correction=token_mask"],
    "GRPO + sequence_mask": [*GRPO, NOISE, "algorithm.rollout_correction=sequence_mask"],
    "GSPO": ["algorithm.level=sequence", NOISE],
    "GSPO + filter_groups": ["algorithm.level=sequence", NOISE, "rollout.filter_groups=true"],
}


def slug(name: str) -> str:
    return name.lower().replace(" + ", "+").replace(", ", "-").replace(" ", "_")


def mean_sd(values: list[Any]) -> tuple[float, float]:
    values = [v for v in values if v == v]
    if not values:
        return float("nan"), float("nan")
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), sd


def summarise(records: list[dict[str, Any]]) -> dict[str, float]:
    lines = train_lines(records)
    evals = [r for r in records if "eval/accuracy" in r]
    quarter = lines[-max(len(lines) // 4, 1) :]

    def avg(key: str, rows=lines) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.fmean(values) if values else float("nan")

    times = [r["time"] for r in records if "time" in r and r in lines]
    return {
        "accuracy_start": evals[0]["eval/accuracy"],
        "accuracy_end": evals[-1]["eval/accuracy"],
        "greedy_end": evals[-1].get("eval/accuracy_greedy", float("nan")),
        "reward_last_quarter": avg("train/reward_mean", quarter),
        "clip_fraction": avg("train/clip_fraction"),
        "k3_kl": avg("mismatch/k3_kl"),
        "masked_tokens": avg("correction/masked_token_fraction"),
        "masked_sequences": avg("correction/masked_sequence_fraction"),
        "tokens_in_loss": avg("train/tokens"),
        "entropy": avg("train/entropy"),
        "response_length": avg("train/response_length_mean"),
        "tis_weight_min": avg("correction/weight_min"),
        "groups_dropped": avg("rollout/groups_dropped"),
        "extra_rounds": avg("rollout/extra_rounds"),
        "seconds": sum(r["time/step"] for r in lines),
        "rl_wall_seconds": (times[-1] - times[0]) if len(times) > 1 else float("nan"),
    }


def fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x != x else format(x, spec)


def report(results: dict[str, list[dict[str, float]]], out: Path, meta: dict[str, Any]) -> str:
    rows = [
        "| arm | held-out accuracy, start -> end (± sd) | reward, last quarter "
        "| clipped tokens | masked tokens | masked responses | tokens in loss / minibatch "
        "| k3 KL sampler-trainer | groups dropped / batch | extra rounds / batch "
        "| entropy | response length | RL seconds (sum of steps) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():

        def ms(key: str, runs=runs) -> tuple[float, float]:
            return mean_sd([r[key] for r in runs])

        start, _ = ms("accuracy_start")
        end, end_sd = ms("accuracy_end")
        rows.append(
            f"| {name} | {fmt(start)} -> {fmt(end)} ± {fmt(end_sd)} "
            f"| {fmt(ms('reward_last_quarter')[0])} | {fmt(ms('clip_fraction')[0], '.4f')} "
            f"| {fmt(ms('masked_tokens')[0], '.4f')} | {fmt(ms('masked_sequences')[0], '.3f')} "
            f"| {fmt(ms('tokens_in_loss')[0], '.0f')} | {fmt(ms('k3_kl')[0], '.4f')} "
            f"| {fmt(ms('groups_dropped')[0], '.2f')} | {fmt(ms('extra_rounds')[0], '.2f')} "
            f"| {fmt(ms('entropy')[0], '.3f')} | {fmt(ms('response_length')[0], '.1f')} "
            f"| {fmt(ms('seconds')[0], '.0f')} |"
        )
    table = "\n".join(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=1))
    seeds = ", ".join(str(s) for s in meta["seeds"])
    (out / "results.md").write_text(
        f"Produced by `python experiments/offpolicy/run.py` (runs started on commit(s) "
        f"{', '.join(sorted({r['commit'] for v in results.values() for r in v}))}; "
        f"seeds {seeds}). Means over seeds; ± is the standard deviation over seeds.\n\n"
        + table
        + "\n"
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/offpolicy"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), help="names from ARMS")
    parser.add_argument("--report", type=Path, default=Path("docs/offpolicy"))
    parser.add_argument(
        "--set", nargs="*", default=[], help="overrides for every arm's RL stage (key=value)"
    )
    parser.add_argument(
        "--cold-start", type=Path, default=None, help="reuse the cold start of this --out"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: the machine is shared)"
    )
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    commit = code_commit()
    base = [*BASE, "log.progress=false", "log.plots=false"]
    checkpoint = cold_start_checkpoint(base, None, args.cold_start or out, print)
    torch.set_num_threads(args.threads)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.arms}
    for seed in args.seeds:  # seed-major: an interrupted invocation has whole seeds
        for name in args.arms:
            overrides = [
                *BASE, *RL, *args.set, *ARMS[name],
                f"model.path={checkpoint}", "train.cold_start_steps=0", f"train.seed={seed}",
                "data.seed=0",  # the cold start's data: its held-out prompts, not its rows
            ]  # fmt: skip
            print(f"{name}, seed {seed}", flush=True)
            run_dir = out / "runs" / f"{slug(name)}-seed{seed}"
            stamp = run_dir / "commit.txt"  # the commit the run was first started on
            if not stamp.is_file():
                run_dir.mkdir(parents=True, exist_ok=True)
                stamp.write_text(commit)
            records = run_or_reuse(load_config(None, overrides), run_dir, print)
            results[name].append({**summarise(records), "commit": stamp.read_text()})
    meta = {
        "commit": commit,
        "seeds": args.seeds,
        "base": BASE,
        "rl": [*RL, *args.set],
        "arms": {n: ARMS[n] for n in args.arms},
        "invocation_seconds": time.perf_counter() - start,
    }
    print(report(results, args.report, meta))


if __name__ == "__main__":
    main()
