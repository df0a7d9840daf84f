"""LoRA against full fine-tuning: per-step time, and the memory of the KL reference.

    flock /tmp/gspo-timing.lock python benchmarks/lora.py [--repeats 3] [--ranks 8 32]
    python benchmarks/lora.py --generation [--repeats 3] [--ranks 8] [--dtype bfloat16]

generation (``--generation``, only it): one rollout batch of the full model and of the
LoRA model, through PEFT's forward and on the fast decoder with the adapters merged for
the call (float32) or beside the matrices (``--dtype bfloat16``: under bf16 autocast, as
a GPU run samples) (:func:`measure_generation`).

time: gspo on the reference workload of ``vs_trl.py`` (``benchmarks/workload.py``: 16
prompts x 8 responses per rollout batch, 4 optimizer steps per rollout batch, 32 new
tokens, 32 optimizer steps, no KL), as full fine-tuning and as LoRA of each rank in
``--ranks`` (lr 1e-4 for all: the lr does not change the cost of a step). Each run is a
process of its own; the variants alternate (full, r=8, r=32, full, ...) so that drift in
the machine's speed hits all of them. Per run: the RL loop's seconds per optimizer step
(step-0 record to the last step's record, over the steps), and its phases from the
metrics: generation and the old-log-prob pass per rollout batch, forward + backward +
optimizer (``time/train``) per optimizer step; and the CPU seconds (user + system) of the
whole process, which a machine shared with other jobs inflates less than wall time.
Medians over the repeats.

memory: the KL reference (``algorithm.kl_coef > 0``) of full fine-tuning is a second
copy of the model loaded from the step-0 checkpoint; LoRA's is the policy with its
adapters switched off. Measured on a larger model than the workload's (``MEMORY_SPEC``,
~25M parameters, so that a copy stands out of the process's noise) built like the
workload's: in a fresh process per variant, a trainer is built, its step-0 checkpoint
written, a small rollout batch (4 prompts x 4, 16 new tokens) sampled and the policy's
log-probs of it computed (so the forward's buffers exist), then the resident set size
(``/proc/self/statm``, after ``malloc_trim``) is read before and after the first
reference log-prob call. Reported: that RSS growth and the
bytes of the reference's own parameters.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import vs_trl  # noqa: E402
import workload  # noqa: E402

from gspo.models import TinyModelSpec  # noqa: E402
from gspo.provenance import code_commit  # noqa: E402

#: The model of the memory measurement: 8 layers, 512 wide (~25M parameters).
MEMORY_SPEC = TinyModelSpec(layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1536)


def variants(ranks: list[int]) -> dict[str, list[str]]:
    out = {"full fine-tuning": []}
    out.update({f"LoRA r={r}": [f"model.lora.r={r}"] for r in ranks})
    return out


def step_times(run: Path) -> dict[str, float]:
    """Seconds per optimizer step of the loop and of its phases, from a run's metrics."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "train/loss" in r]
    firsts = [r for r in train if r["train/minibatch"] == 0]
    return {
        "loop": (lines[-1]["time"] - lines[0]["time"]) / len(train),
        "generate": statistics.fmean(r["time/generate"] for r in firsts),
        "old_logprobs": statistics.fmean(r["time/old_logprobs"] for r in firsts),
        "train": statistics.fmean(r["time/train"] for r in train),
        "trainable": next(r for r in lines if "model/trainable_params" in r)[
            "model/trainable_params"
        ],
    }


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's finished children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure_time(work: Path, ranks: list[int], repeats: int) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in variants(ranks)}
    for rep in range(repeats):
        for i, (name, extra) in enumerate(variants(ranks).items()):
            cpu = children_cpu_seconds()
            _, run = vs_trl.run_gspo(work, name=f"lora_bench_{i}", extra=extra)
            results[name].append({**step_times(run), "cpu": children_cpu_seconds() - cpu})
            print(f"repeat {rep + 1}/{repeats} {name}: {results[name][-1]}", flush=True)
    return results


def rollout_batch(
    engine, prompts: list, params, tokens: list[int], dtype=None
) -> Callable[[], object]:
    """A run of one rollout batch (16 prompts x 8) that appends its completion tokens to
    ``tokens``; seeds 0, 1, 2, 0, ... in turn; under a CPU autocast to ``dtype`` if given."""
    import torch

    def run() -> None:
        autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
        with autocast:
            out = engine.generate(prompts, n=8, params=params, seed=len(tokens) % 3)
        tokens.append(int(out.completion_mask.sum()))

    return run


def measure_generation(workdir: Path, rank: int, repeats: int, dtype: str = "float32") -> list[str]:
    """One rollout batch (16 prompts x 8) by ``TorchEngine``: the full model on the fast
    decoder, the LoRA model (rank ``rank``, all-linear, the adapters' B random so that
    they count) through PEFT's forward (the reference decoder, what LoRA runs took before
    the fast decoder merged adapters) and on the fast decoder with its adapters merged;
    at 32 new tokens on the reference workload and 256 on the long one (the 520-token
    vocabulary of ``vs_trl.py --long``). Linear layers on ``model.cpu_linear``'s default,
    as ``gspo train`` has them; variants interleaved, medians in seconds. With ``dtype``
    bfloat16 every variant samples under bf16 autocast (float32 parameters, as the
    trainer holds them), where the fast decoder keeps the adapters beside the matrices."""
    import copy

    import torch
    from levers import interleaved_times
    from long_levers import setup

    from gspo.config import LoraSettings
    from gspo.engines import SamplingParams, TorchEngine
    from gspo.models.kernels import set_linear_kernel
    from gspo.training.lora import attach_lora

    fast = "merged" if dtype == "float32" else "adapters beside"
    autocast = None if dtype == "float32" else getattr(torch, dtype)
    lines = [
        f"| workload ({dtype}) | full model, fast decoder | LoRA r={rank}, PEFT forward | "
        f"LoRA r={rank}, fast decoder ({fast}) | LoRA speed-up | fast LoRA / full | "
        "completion tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    cases = [("reference, 32 new tokens", workdir / "gen_reference", None, 32)]
    cases.append(("long, 256 new tokens", workdir / "gen_long", workload.LONG_VOCAB, 256))
    for label, folder, vocab, new_tokens in cases:
        _, full, prompts, ids = setup(folder, vocab)
        lora = attach_lora(copy.deepcopy(full), LoraSettings(r=rank), seed=0)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, param in lora.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.01)
        for model in (full, lora):
            set_linear_kernel(model)
            model.eval()
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
        engines = {
            "full": TorchEngine(full, **ids),
            "peft": TorchEngine(lora, fast=False, **ids),
            "merged": TorchEngine(lora, **ids),
        }
        tokens: dict[str, list[int]] = {name: [] for name in engines}
        runs = {
            k: rollout_batch(e, prompts, params, tokens[k], autocast) for k, e in engines.items()
        }
        times = interleaved_times(runs, repeats)
        f, p, m = (statistics.median(times[k]) for k in engines)
        counts = " / ".join(f"{statistics.median(tokens[k]):,.0f}" for k in engines)
        lines.append(
            f"| {label} | {f:.2f} | {p:.2f} | {m:.2f} | {p / m:.2f}x | {m / f:.2f}x | {counts} |"
        )
        print(lines[-1], flush=True)
    return lines


def rss_bytes() -> int:
    """Resident bytes now, after freed heap memory went back to the OS (glibc)."""
    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def memory_child(work: Path, out: Path, rank: int) -> dict:
    """In this process: a trainer with the KL on; RSS before and after the reference."""
    import torch

    from gspo.config import load_config
    from gspo.engines import SamplingParams
    from gspo.trainer import Trainer

    config = load_config(
        None,
        [
            f"model.path={work / 'model'}",
            f"data.train={work / 'train.jsonl'}",
            f"reward.functions=[{HERE / 'workload.py'}:dense]",
            "train.cold_start_steps=0",
            "algorithm.kl_coef=0.1",
            f"model.lora.r={rank}",
            "log.progress=false",
            "log.plots=false",
            "log.tensorboard=false",
        ],
    )
    trainer = Trainer(config, out)
    trainer.save_checkpoint()  # step 0: what full fine-tuning's reference loads
    prompts = trainer.train_prompt_ids[:4]
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    batch = trainer.sampler.generate(prompts, n=4, params=params, seed=0)
    with torch.no_grad():
        trainer.policy.logprobs(batch)
    before = rss_bytes()
    trainer.reference.logprobs(batch)
    after = rss_bytes()
    module = trainer.reference.module
    policy_bytes = sum(p.numel() * p.element_size() for p in trainer.policy.module.parameters())
    return {
        "rss_growth": after - before,
        "reference_param_bytes": 0
        if module is None
        else sum(p.numel() * p.element_size() for p in module.parameters()),
        "policy_param_bytes": policy_bytes,
        "params": sum(p.numel() for p in trainer.policy.module.parameters()),
    }


def measure_memory(work: Path, ranks: list[int]) -> dict[str, dict]:
    big = workload.build(work / "memory_workload", spec=MEMORY_SPEC)
    results = {}
    for i, name in enumerate(variants(ranks)):
        rank = 0 if i == 0 else ranks[i - 1]
        out = work / f"lora_memory_{i}"
        result = work / f"lora_memory_{i}.json"
        subprocess.run(
            [sys.executable, __file__, "--memory-child", str(big), str(out), str(rank),
             str(result)],
            check=True,
        )  # fmt: skip
        results[name] = json.loads(result.read_text())
        print(f"memory {name}: {results[name]}", flush=True)
    return results


def report(times: dict[str, list[dict]], memory: dict[str, dict], repeats: int) -> str:
    lines = [
        f"Per optimizer step, median over {repeats} runs of each (ms; CPU: seconds a run):",
        "",
        "| variant | trainable params | loop per step | forward+backward+optimizer "
        "| generation per rollout batch | old-log-prob pass per rollout batch "
        "| CPU seconds of the whole process |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in times.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        lines.append(
            f"| {name} | {med['trainable']:,.0f} | {1000 * med['loop']:.1f} "
            f"| {1000 * med['train']:.1f} | {1000 * med['generate']:.1f} "
            f"| {1000 * med['old_logprobs']:.1f} | {med['cpu']:.1f} |"
        )
    if memory:
        first = next(iter(memory.values()))
        lines += [
            "",
            f"KL reference on a {first['params']:,}-parameter model "
            f"({first['policy_param_bytes'] / 2**20:.1f} MiB of float32 weights), MiB:",
            "",
            "| variant | reference's own parameters | RSS growth at the first reference pass |",
            "|---|---|---|",
        ]
        for name, m in memory.items():
            lines.append(
                f"| {name} | {m['reference_param_bytes'] / 2**20:.1f} "
                f"| {m['rss_growth'] / 2**20:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        work, out, rank, result = sys.argv[2:6]
        data = memory_child(Path(work), Path(out), int(rank))
        Path(result).write_text(json.dumps(data))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_lora"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument(
        "--generation",
        action="store_true",
        help="only the generation lever: one rollout batch, full vs LoRA through PEFT vs "
        "LoRA merged on the fast decoder (rank: the first of --ranks)",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    print(f"commit {code_commit()}", flush=True)
    if args.generation:
        lines = measure_generation(args.workdir, args.ranks[0], args.repeats, args.dtype)
        print("\n".join(lines))
        return
    work = workload.build(args.workdir)
    times = {} if args.skip_time else measure_time(work, args.ranks, args.repeats)
    memory = {} if args.skip_memory else measure_memory(args.workdir, args.ranks)
    text = report(times, memory, args.repeats)
    (args.workdir / "report.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
