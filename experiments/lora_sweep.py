"""LoRA vs full fine-tuning on the built-in task, from one shared cold start.

    python experiments/lora_sweep.py [--out runs/lora_sweep] [--seeds 0 1 2] [--jobs 2]

1. the demo's cold start once (``gspo train train.max_steps=0``; its step-0 checkpoint;
   1,500 SFT steps, about 3.5 minutes on an idle 2-core CPU; an interrupted one is
   resumed from its progress checkpoints, and a finished one with the same content hash
   is taken from gspo's cold-start cache, see ``train.cold_start_cache``);
2. from it (``model.path=<step-0>``, ``train.cold_start_steps=0``), 200 GSPO steps each of
   full fine-tuning at the demo's lr and LoRA r in ``--ranks`` at every lr in ``--lrs``,
   every seed; each run is a process of its own, its peak resident memory (ru_maxrss)
   and wall time recorded beside it; finished runs are reused;
3. a Markdown table (mean and sd over seeds) to ``--table``, with the command and commit,
   and the training-reward curves of every setting (mean ± sd over seeds, a moving
   average over ``--smooth`` steps) to ``--plot``.

Held-out accuracy is ``eval/accuracy`` (pass@1 sampled at temperature 1) and
``eval/accuracy_greedy`` at step 0 (the cold start) and at the last step; the training
reward is ``train/reward_mean`` of the rollout batches, averaged over the first and the
last ``--smooth`` steps. The held-out prompts of a seed are that seed's
split of the task; the cold start was trained on seed 0's rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["log.plots=false", "log.tensorboard=false", "log.progress=false"]

# One run in a process of its own; prints its peak resident memory after the run.
RUNNER = """
import json, resource, sys
from gspo.cli import main
code = main(sys.argv[2:])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
open(sys.argv[1], "w").write(json.dumps({"code": code, "peak_rss_bytes": peak}))
sys.exit(code)
"""


def env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finished(run: Path, steps: int) -> bool:
    return (run / "peak.json").is_file() and any(
        r.get("step") == steps and "eval/accuracy" in r for r in records(run)
    )


def train(run: Path, overrides: list[str], log: Path, *, resume: bool = False) -> None:
    """``gspo train`` into ``run`` (``resume``: continue it from its checkpoints)."""
    run.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    where = ["--resume", str(run)] if resume else ["--overwrite", "--output-dir", str(run)]
    with open(log, "a" if resume else "w") as out:
        subprocess.run(
            [sys.executable, "-c", RUNNER, str(run) + ".peak.json", "train", *where, *overrides],
            check=True, env=env(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    peak = json.loads(Path(str(run) + ".peak.json").read_text())
    peak["wall_seconds"] = time.time() - start
    (run / "peak.json").write_text(json.dumps(peak))


def configs(args) -> list[tuple[str, int, float]]:
    """(name, rank, lr): full fine-tuning first, then every rank x lr."""
    out = [("full", 0, args.full_lr)]
    out += [(f"lora_r{r}_lr{lr:g}", r, lr) for r in args.ranks for lr in args.lrs]
    return out


def summarise(args, out: Path) -> list[dict]:
    rows = []
    for name, rank, lr in configs(args):
        per_seed = []
        for seed in args.seeds:
            run = out / "runs" / f"{name}_s{seed}"
            if not finished(run, args.steps):
                continue
            recs = records(run)
            final = next(r for r in recs if r.get("step") == args.steps and "eval/accuracy" in r)
            start = next(r for r in recs if r.get("step") == 0 and "eval/accuracy" in r)
            summary = next(r for r in recs if "model/trainable_params" in r)
            peak = json.loads((run / "peak.json").read_text())
            steps = [r["time/step"] for r in recs if "time/step" in r]
            rewards = [r["train/reward_mean"] for r in recs if "train/reward_mean" in r]
            k = min(args.smooth, len(rewards))
            per_seed.append({
                "seed": seed,
                "start": start["eval/accuracy"],
                "start_greedy": start.get("eval/accuracy_greedy", math.nan),
                "reward_first": statistics.fmean(rewards[:k]),
                "reward_last": statistics.fmean(rewards[-k:]),
                "acc": final["eval/accuracy"],
                "greedy": final.get("eval/accuracy_greedy", math.nan),
                "wall": peak["wall_seconds"],
                "step_s": statistics.median(steps),
                "peak": peak["peak_rss_bytes"],
                "state": summary["optim/state_bytes"],
                "trainable": summary["model/trainable_params"],
            })  # fmt: skip
        if per_seed:
            rows.append({"name": name, "rank": rank, "lr": lr, "seeds": per_seed})
    return rows


def mean_sd(values: list[float], fmt: str) -> str:
    m = statistics.fmean(values)
    if len(values) < 2:
        return format(m, fmt)
    return f"{format(m, fmt)} ± {format(statistics.stdev(values), fmt)}"


def table(rows: list[dict], args, argv: list[str]) -> str:
    lines = [
        f"Produced by `python experiments/lora_sweep.py {' '.join(argv)}` on commit "
        f"{commit()}, {machine()}; {args.steps} GSPO steps per run from one cold start "
        f"({args.cold_start_steps} SFT steps); mean ± sd over the seeds listed.",
        "",
        "| setting | lr | seeds | trainable params | AdamW state | held-out acc. start -> end "
        f"| greedy start -> end | train reward, first -> last {args.smooth} steps "
        "| wall time (s) | median s/step | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s = row["seeds"]
        label = "full fine-tuning" if row["rank"] == 0 else f"LoRA r={row['rank']}"
        lines.append(
            f"| {label} | {row['lr']:g} | {','.join(str(x['seed']) for x in s)} "
            f"| {s[0]['trainable']:,.0f} | {s[0]['state'] / 2**20:.2f} MiB "
            f"| {statistics.fmean(x['start'] for x in s):.3f} -> "
            f"{mean_sd([x['acc'] for x in s], '.3f')} "
            f"| {statistics.fmean(x['start_greedy'] for x in s):.3f} -> "
            f"{mean_sd([x['greedy'] for x in s], '.3f')} "
            f"| {mean_sd([x['reward_first'] for x in s], '.3f')} -> "
            f"{mean_sd([x['reward_last'] for x in s], '.3f')} "
            f"| {mean_sd([x['wall'] for x in s], '.0f')} "
            f"| {mean_sd([x['step_s'] for x in s], '.3f')} "
            f"| {mean_sd([x['peak'] / 2**20 for x in s], '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def smoothed(recs: list[dict], window: int) -> list[dict]:
    """``train/reward_mean`` per step as a trailing moving average over ``window`` steps."""
    points = [(r["step"], r["train/reward_mean"]) for r in recs if "train/reward_mean" in r]
    out = []
    for i, (step, _) in enumerate(points):
        recent = [v for _, v in points[max(0, i + 1 - window) : i + 1]]
        out.append({"step": step, "train/reward_mean": statistics.fmean(recent)})
    return out


def commit() -> str:
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's gspo, as the runs use
    from gspo.provenance import code_commit

    return code_commit()


def machine() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from gspo.provenance import machine

    return machine()


def plot(rows: list[dict], args, out: Path, path: Path) -> Path | None:
    """Training-reward curves, one line (± sd over seeds) per setting."""
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's gspo, as the runs use
    from gspo.telemetry import plot_bands

    groups = {}
    for row in rows:
        label = "full" if row["rank"] == 0 else f"LoRA r={row['rank']}"
        runs = [out / "runs" / f"{row['name']}_s{x['seed']}" for x in row["seeds"]]
        groups[f"{label} lr={row['lr']:g}"] = [smoothed(records(r), args.smooth) for r in runs]
    title = f"training reward, {args.smooth}-step moving average (commit {commit()})"
    return plot_bands(groups, "train/reward_mean", path, title=title)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "lora_sweep")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-4, 3e-4, 1e-3])
    p.add_argument("--full-lr", type=float, default=1e-4, help="the demo's optim.lr")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--cold-start-steps", type=int, default=1500, help="the demo's")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time")
    p.add_argument("--only", nargs="*", default=None, help="setting names to run (default all)")
    p.add_argument("--extra", nargs="*", default=[], help="overrides for every run")
    p.add_argument("--table", type=Path, default=None, help="also write the table here")
    p.add_argument("--plot", type=Path, default=None, help="also draw reward curves here")
    p.add_argument("--smooth", type=int, default=20, help="steps averaged in reward figures")
    args = p.parse_args(argv)
    out = args.out.resolve()
    cold = out / "cold_start"
    step0 = cold / "checkpoints" / "step-0000000"
    if not (step0 / "trainer_state.pt").is_file():
        # an interrupted cold start continues from its progress checkpoints
        resume = (cold / "config.yaml").is_file()
        print(f"cold start -> {cold}{' (resumed)' if resume else ''}", flush=True)
        overrides = [] if resume else ["train.max_steps=0",
                                       f"train.cold_start_steps={args.cold_start_steps}",
                                       *QUIET, *args.extra]  # fmt: skip
        train(cold, overrides, out / "cold_start.log", resume=resume)
    jobs = []
    for seed in args.seeds:  # seed-major: a partial sweep covers every setting once first
        for name, rank, lr in configs(args):
            if args.only is not None and name not in args.only:
                continue
            run = out / "runs" / f"{name}_s{seed}"
            if finished(run, args.steps):
                continue
            overrides = [
                f"model.path={step0}", "train.cold_start_steps=0", f"train.seed={seed}",
                "data.seed=0",  # the cold start's data: its held-out prompts, not its rows
                f"train.max_steps={args.steps}", f"optim.lr={lr}", f"model.lora.r={rank}",
                "train.save_every=0", "eval.every=0", *QUIET, *args.extra,
            ]  # fmt: skip
            jobs.append((run, overrides))

    def one(job):
        run, overrides = job
        t = time.time()
        train(run, overrides, Path(str(run) + ".log"))
        print(f"{run.name}: {time.time() - t:.0f} s", flush=True)

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        list(pool.map(one, jobs))
    rows = summarise(args, out)
    text = table(rows, args, argv)
    (out / "table.md").write_text(text)
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text)
    if args.plot is not None and rows:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot(rows, args, out, args.plot)
    print(text)


if __name__ == "__main__":
    main()
