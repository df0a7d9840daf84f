"""gspo vs TRL on the same GSPO workload: wall time, throughput, gspo's phases.

    python benchmarks/vs_trl.py [--repeats 3] [--workdir DIR]
    python benchmarks/vs_trl.py --long --max-new-tokens 32 128 256 512 --repeats 2 2 2 1
    python benchmarks/vs_trl.py --lora 8 [--long --max-new-tokens 256]

Needs the `bench` extra (TRL) in the running environment: `pip install -e '.[bench]'`.
Both sides run as separate processes of this Python, on the same saved model, tokenizer,
prompts and reward (benchmarks/workload.py), with the same schedule: 16 prompts x 8
responses per rollout batch, 4 minibatches (optimizer steps) per rollout batch, 32 new
tokens at temperature 1, 32 optimizer steps, GSPO clip 3e-4 / 4e-4, no KL. The ratio is
whole-process wall time (imports and model loading included), median over repeats, with
the two sides alternating so that drift in the machine's speed hits both.

``--long`` is the long-response workload: the same model but a 520-token vocabulary (a
random model rarely samples EOS, so completions run to ``max_new_tokens``), 8 optimizer
steps at lr 1e-5. With several ``--max-new-tokens`` (and as many ``--repeats``) every
length is measured in turn in the one invocation and a cost-vs-length table is printed:
whole-process times, ratio, mean completion length of each side, and gspo's generation
and training tokens/s with the share of this machine's matmul peak they reach (FLOPs:
2 x the weights per token, plus attention over the context, x3 for training; peak: a
2048^3 float32 matrix product by MKL or oneDNN, whichever is faster, measured before and
after the runs).

``--lora R`` trains LoRA adapters of rank R instead of the whole model on both sides
(``all-linear``, alpha 32: gspo's ``model.lora.r``, TRL's ``peft_config``), everything
else as above; the FLOP figures still count the whole model's products.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402
from workload import LONG_VOCAB  # noqa: E402

from gspo.provenance import code_commit, machine  # noqa: E402

STEPS = 32
ROLLOUT = 16 * 8


@dataclass(frozen=True)
class Schedule:
    """What both sides run: optimizer steps, learning rate, most new tokens per response,
    the device (``cuda``: bf16 autocast on both sides, gspo's default there) and the LoRA
    rank (0: full fine-tuning)."""

    steps: int = STEPS
    lr: float = 1e-4
    max_new_tokens: int = 32
    device: str = "cpu"
    lora: int = 0  # LoRA rank on both sides (all-linear, alpha 32); 0: full fine-tuning


REFERENCE = Schedule()
LONG = Schedule(steps=8, lr=1e-5, max_new_tokens=256)


def run_gspo(
    work: Path,
    launcher: list[str] | None = None,
    name: str = "gspo_run",
    schedule: Schedule = REFERENCE,
    extra: Sequence[str] = (),
    timeout: float | None = None,
) -> tuple[float, Path]:
    """gspo on the workload as a process of its own (``launcher``: e.g. torchrun's argv;
    ``extra``: more overrides, e.g. ``rollout.max_staleness=1`` or ``model.lora.r=8``;
    ``timeout``: seconds, past which ``subprocess.TimeoutExpired``)."""
    out = work / name
    command = [
        *(launcher or [sys.executable]), "-m", "gspo", "train", "--overwrite",
        "--output-dir", str(out),
        f"model.path={work / 'model'}",
        f"data.train={work / 'train.jsonl'}",
        f"reward.functions=[{HERE / 'workload.py'}:dense]",
        "train.cold_start_steps=0",
        f"train.max_steps={schedule.steps}",
        "train.save_every=0",
        "rollout.group_size=8",
        "rollout.prompts_per_batch=16",
        f"rollout.max_new_tokens={schedule.max_new_tokens}",
        "rollout.temperature=1.0",
        "algorithm.level=sequence",
        "algorithm.minibatches=4",
        f"optim.lr={schedule.lr}",
        "log.progress=false",
        "log.plots=false",
        "log.tensorboard=false",
        f"model.device={schedule.device}",
        *([f"model.lora.r={schedule.lora}"] if schedule.lora else []),
        *extra,
    ]  # fmt: skip
    start, wall_start = time.perf_counter(), time.time()
    run_logged(command, out, timeout, "gspo train")
    seconds = time.perf_counter() - start
    (out / "process_wall.json").write_text(json.dumps({"start": wall_start, "end": time.time()}))
    return seconds, out


def run_logged(command: list[str], out: Path, timeout: float | None, what: str) -> None:
    """``command`` within ``timeout`` seconds, its output in ``OUT.log`` beside ``out``
    (gspo train --overwrite replaces ``out``); a failure raised with the output's last lines
    (the error, not the command line of 30 arguments that ``CalledProcessError`` says). Past
    ``timeout`` its whole process group is killed (torchrun's ranks too) and the output so
    far logged before ``subprocess.TimeoutExpired``."""
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        log.write_text(f"$ {' '.join(command)}\n{stdout}\n{stderr}")
        raise subprocess.TimeoutExpired(what, timeout or 0.0) from None
    log.write_text(f"$ {' '.join(command)}\n{stdout}\n{stderr}")
    if process.returncode != 0:
        tail = " | ".join((stderr or stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{what} exited {process.returncode} ({log}): {tail}")


def run_trl(
    work: Path, schedule: Schedule = REFERENCE, timeout: float | None = None
) -> tuple[float, dict]:
    out = work / "trl_run"
    out.mkdir(exist_ok=True)
    start = time.perf_counter()
    s = schedule
    run_logged(
        [
            sys.executable,
            str(HERE / "trl_side.py"),
            str(work),
            str(out),
            str(s.steps),
            str(s.max_new_tokens),
            str(s.lr),
            s.device,
            str(s.lora),
        ],
        out,
        timeout,
        "trl_side.py",
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


#: Tokens of every prompt of the workload ("ab+cd=").
PROMPT_TOKENS = 6


def model_config(work: Path) -> dict:
    return json.loads((work / "model" / "config.json").read_text())


def flops_per_token(work: Path) -> tuple[float, int]:
    """2 x non-embedding parameters (+ the LM head) per token for a forward pass."""
    config = model_config(work)
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


def completion_flops(work: Path, length: float) -> tuple[float, float]:
    """(generation, training) FLOPs of one completion of ``length`` tokens.

    Generation: the weights (:func:`flops_per_token`) per completion token, plus
    attention over the context so far (``4 x heads x head_dim`` per layer and context
    token); the prompt's prefill is left out. Training: forward and backward (3x) over
    prompt and completion, with causal attention; no padding, no masked blocks counted.
    """
    config = model_config(work)
    per_token, params = flops_per_token(work)
    pair = 4.0 * config["num_hidden_layers"] * config["num_attention_heads"] * config["head_dim"]
    p, t = PROMPT_TOKENS, length
    generation = per_token * t + pair * (t * p + t * t / 2)
    weights = 2.0 * (params - config["vocab_size"] * config["hidden_size"])
    training = 3 * ((p + t) * weights + (per_token - weights) * t + pair * (p + t) ** 2 / 2)
    return generation, training


def matmul_peak(size: int = 2048, reps: int = 5) -> float:
    """This machine's float32 matmul rate, FLOP/s: median of ``reps`` ``size``^3 products,
    the faster of torch's own product (MKL) and oneDNN's (``gspo.models.kernels``, which gspo's
    linear layers use on the CPU; on AMD hosts about twice MKL's rate)."""
    import torch

    from gspo.models.kernels import onednn_available, onednn_linear

    a, b = torch.randn(size, size), torch.randn(size, size)
    products = [torch.mm]
    if onednn_available():
        bt = b.t().contiguous()
        products.append(lambda a, b: onednn_linear(a, bt))
    rates = []
    for product in products:
        product(a, b)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            product(a, b)
            times.append(time.perf_counter() - start)
        rates.append(2 * size**3 / statistics.median(times))
    return max(rates)


def measure(work: Path, schedule: Schedule, repeats: int) -> list[dict]:
    """``repeats`` runs of each side, alternating which goes first; one dict per run."""
    rows = []
    for i in range(repeats):
        order = ["gspo", "trl"] if i % 2 == 0 else ["trl", "gspo"]
        row: dict = {"max_new_tokens": schedule.max_new_tokens}
        for side in order:
            if side == "gspo":
                row["gspo_s"], run = run_gspo(work, schedule=schedule)
                row["gspo"] = gspo_summary(run)
            else:
                row["trl_s"], result = run_trl(work, schedule)
                row["trl"] = trl_summary(result)
        row["ratio"] = row["trl_s"] / row["gspo_s"]
        rows.append(row)
        print(
            f"max_new_tokens {schedule.max_new_tokens}, run {i + 1}: gspo {row['gspo_s']:.2f} s, "
            f"TRL {row['trl_s']:.2f} s, ratio {row['ratio']:.2f}x",
            flush=True,
        )
    return rows


def mean_length(summary: dict) -> float:
    return summary["completion_tokens"] / (summary["steps"] // 4 * ROLLOUT)


def length_row(work: Path, rows: list[dict], peak: float) -> str:
    """One line of the cost-vs-length table from the runs at one length (the median run)."""
    best = sorted(rows, key=lambda r: r["ratio"])[len(rows) // 2]
    g, t = best["gspo"], best["trl"]
    g_len, t_len = mean_length(g), mean_length(t)
    completions = g["steps"] // 4 * ROLLOUT
    gen_flops, train_flops = (completions * f for f in completion_flops(work, g_len))
    gen_s, train_s = g["phases"]["generation"], g["phases"]["forward/backward/optimizer"]
    tokens = g["completion_tokens"]
    ratios = ", ".join(f"{r['ratio']:.2f}" for r in rows)
    return (
        f"| {best['max_new_tokens']} | {best['gspo_s']:.1f} | {best['trl_s']:.1f} | "
        f"**{statistics.median(r['ratio'] for r in rows):.2f}x** ({ratios}) | "
        f"{g_len:.0f} / {t_len:.0f} | {tokens / gen_s:,.0f} ({gen_flops / gen_s / peak:.2f}) | "
        f"{tokens / train_s:,.0f} ({train_flops / train_s / peak:.2f}) |"
    )


def report(work: Path, rows: list[dict]) -> None:
    """The detailed printout of one length's runs (the reference workload's format)."""
    best = sorted(rows, key=lambda r: r["ratio"])[len(rows) // 2]  # the median run
    g, t = best["gspo"], best["trl"]
    per_token, params = flops_per_token(work)
    phases = g["phases"]
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
    print(f"mean completion length (tokens): gspo {mean_length(g):.1f}, TRL {mean_length(t):.1f}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="the long-response workload")
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, nargs="+", default=[3])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="R",
        help="LoRA of rank R on both sides (all-linear, alpha 32; TRL through its peft_config)",
    )
    args = parser.parse_args()
    base = LONG if args.long else REFERENCE
    lengths = args.max_new_tokens or [base.max_new_tokens]
    repeats = args.repeats * len(lengths) if len(args.repeats) == 1 else args.repeats
    if len(repeats) != len(lengths):
        parser.error("give one --repeats, or one per --max-new-tokens")
    default_dir = "runs/bench_vs_trl_long" if args.long else "runs/bench_vs_trl"
    work = workload.build(
        args.workdir or Path(default_dir), vocab=LONG_VOCAB if args.long else None
    )
    print(
        f"gspo at {code_commit()}; machine: {machine()}, python {platform.python_version()}",
        flush=True,
    )
    peak_before = matmul_peak()
    results = {}
    for length, reps in zip(lengths, repeats, strict=True):
        schedule = Schedule(base.steps, base.lr, length, lora=args.lora)
        results[length] = measure(work, schedule, reps)
    peak = min(peak_before, matmul_peak())
    (work / "vs_trl_results.json").write_text(json.dumps({str(k): v for k, v in results.items()}))
    if len(lengths) == 1:
        report(work, results[lengths[0]])
    print(
        f"\nmatmul peak (float32 2048^3): {peak_before / 1e9:.1f} GFLOP/s before the runs, "
        f"{peak / 1e9:.1f} GFLOP/s the lower of before/after (used below)"
    )
    print(
        "\n| max new tokens | gspo (s) | TRL (s) | **ratio**, median (each run) | "
        "mean completion length gspo / TRL | gspo generation tokens/s (of peak) | "
        "gspo training tokens/s (of peak) |\n|---|---|---|---|---|---|---|"
    )
    for length in lengths:
        print(length_row(work, results[length], peak))


if __name__ == "__main__":
    main()
