"""gspo vs TRL on the same GSPO workload: wall time, throughput, gspo's phases.

    python benchmarks/vs_trl.py [--repeats 3] [--workdir DIR]

Needs the `bench` extra (TRL) in the running environment: `pip install -e '.[bench]'`.
Both sides run as separate processes of this Python, on the same saved model, tokenizer,
prompts and reward (benchmarks/workload.py), with the same schedule: 16 prompts x 8
responses per rollout batch, 4 minibatches (optimizer steps) per rollout batch, 32 new
tokens at temperature 1, 32 optimizer steps, GSPO clip 3e-4 / 4e-4, no KL. The ratio is
whole-process wall time (imports and model loading included), median over repeats, with
the two sides alternating so that drift in the machine's speed hits both.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402

STEPS = 32
ROLLOUT = 16 * 8


def run_gspo(
    work: Path, launcher: list[str] | None = None, name: str = "gspo_run"
) -> tuple[float, Path]:
    """gspo on the workload as a process of its own (``launcher``: e.g. torchrun's argv)."""
    out = work / name
    command = [
        *(launcher or [sys.executable]), "-m", "gspo", "train", "--overwrite",
        "--output-dir", str(out),
        f"model.path={work / 'model'}",
        f"data.train={work / 'train.jsonl'}",
        f"reward.functions=[{HERE / 'workload.py'}:dense]",
        "train.cold_start_steps=0",
        f"train.max_steps={STEPS}",
        "train.save_every=0",
        "rollout.group_size=8",
        "rollout.prompts_per_batch=16",
        "rollout.max_new_tokens=32",
        "rollout.temperature=1.0",
        "algorithm.level=sequence",
        "algorithm.minibatches=4",
        "optim.lr=1e-4",
        "log.progress=false",
        "log.plots=false",
        "log.tensorboard=false",
    ]  # fmt: skip
    start, wall_start = time.perf_counter(), time.time()
    subprocess.run(command, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    (out / "process_wall.json").write_text(json.dumps({"start": wall_start, "end": time.time()}))
    return seconds, out


def run_trl(work: Path) -> tuple[float, dict]:
    out = work / "trl_run"
    out.mkdir(exist_ok=True)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(HERE / "trl_side.py"), str(work), str(out), str(STEPS)],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - start
    return seconds, json.loads((out / "trl_result.json").read_text())


def gspo_summary(run: Path) -> dict:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "train/loss" in r]
    firsts = [r for r in train if r["train/minibatch"] == 0]
    phases = {
        "generation": sum(r["time/generate"] for r in firsts),
        "reward": sum(r["time/reward"] for r in firsts),
        "old-log-prob pass": sum(r["time/old_logprobs"] for r in firsts),
        "forward/backward/optimizer": sum(r["time/train"] for r in train),
    }
    tokens = sum(r["train/response_length_mean"] * ROLLOUT for r in firsts)
    # the RL loop: from the step-0 record (model loaded, ready) to the last step's record
    loop = lines[-1]["time"] - lines[0]["time"]
    wall = json.loads((run / "process_wall.json").read_text())
    return {
        "steps": len(train),
        "completion_tokens": tokens,
        "phases": phases,
        "loop_s": loop,
        "startup_s": lines[0]["time"] - wall["start"],  # interpreter, imports, model, data
        "exit_s": wall["end"] - lines[-1]["time"],  # final checkpoint, summary, exit
    }


def trl_summary(result: dict) -> dict:
    gens = [h for h in result["log_history"] if "completions/mean_length" in h]
    steps = max(h.get("step", 0) for h in result["log_history"])
    tokens = sum(float(h["completions/mean_length"]) * ROLLOUT for h in gens)
    return {"steps": steps, "completion_tokens": tokens, "loop_s": result["train_seconds"]}


def flops_per_token(work: Path) -> tuple[float, int]:
    """2 x non-embedding parameters (+ the LM head) per token for a forward pass."""
    config = json.loads((work / "model" / "config.json").read_text())
    h, layers, inter = (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["intermediate_size"],
    )
    heads, kv, head_dim = (
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    params = layers * (attn + 3 * h * inter) + config["vocab_size"] * h
    return 2.0 * params, params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_vs_trl"))
    args = parser.parse_args()
    work = workload.build(args.workdir)
    rows = []
    for i in range(args.repeats):
        order = ["gspo", "trl"] if i % 2 == 0 else ["trl", "gspo"]
        row = {}
        for side in order:
            if side == "gspo":
                row["gspo_s"], run = run_gspo(work)
                row["gspo"] = gspo_summary(run)
            else:
                row["trl_s"], result = run_trl(work)
                row["trl"] = trl_summary(result)
        row["ratio"] = row["trl_s"] / row["gspo_s"]
        rows.append(row)
        print(
            f"run {i + 1}: gspo {row['gspo_s']:.2f} s, TRL {row['trl_s']:.2f} s, "
            f"ratio {row['ratio']:.2f}x",
            flush=True,
        )
    best = sorted(rows, key=lambda r: r["ratio"])[len(rows) // 2]  # the median run
    g, t = best["gspo"], best["trl"]
    per_token, params = flops_per_token(work)
    phases = g["phases"]
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, {_cores()} cores, "
        f"python {platform.python_version()}"
    )
    print(f"model: {params / 1e6:.2f}M parameters (non-embedding + LM head)")
    print(f"median ratio over {len(rows)} runs: {statistics.median(r['ratio'] for r in rows):.2f}x")
    print(
        f"median run: gspo {best['gspo_s']:.2f} s, TRL {best['trl_s']:.2f} s; optimizer "
        f"steps {g['steps']} vs {t['steps']}; completions {g['steps'] // 4 * ROLLOUT} vs "
        f"{t['steps'] // 4 * ROLLOUT}"
    )
    print(
        f"completion tokens/s (whole process): gspo {g['completion_tokens'] / best['gspo_s']:.0f}, "
        f"TRL {t['completion_tokens'] / best['trl_s']:.0f}"
    )
    print(
        f"training loop only (trainer.train() for TRL; first to last step record for gspo): "
        f"gspo {g['loop_s']:.2f} s, TRL {t['loop_s']:.2f} s, ratio {t['loop_s'] / g['loop_s']:.2f}x"
    )
    g_len = g["completion_tokens"] / (g["steps"] // 4 * ROLLOUT)
    t_len = t["completion_tokens"] / (t["steps"] // 4 * ROLLOUT)
    print(f"mean completion length (tokens): gspo {g_len:.1f}, TRL {t_len:.1f}")
    print(
        f"gspo outside the loop: {g['startup_s']:.2f} s to the step-0 record, "
        f"{g['exit_s']:.2f} s after the last step"
    )
    print("gspo phases (s):", ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    train_tokens = g["completion_tokens"]  # each completion token is trained on once
    train_flops = 3 * per_token * train_tokens  # forward + backward
    gen_flops = per_token * train_tokens
    busy = phases["generation"] + phases["forward/backward/optimizer"]
    print(
        f"gspo achieved: {(train_flops + gen_flops) / busy / 1e9:.1f} GFLOP/s over generation "
        f"and training (completion tokens only; prompts and attention not counted)"
    )


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    main()
