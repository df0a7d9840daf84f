"""How much of GSPO's clipping is numerics? The sampler's vs the trainer's log-probs in bf16.

GSPO clips the length-normalised sequence ratio at 1 - 3e-4 / 1 + 4e-4. On the on-policy
minibatch pi_theta = pi_old, so every ratio should be exactly 1; whatever the sampler's
log-probs (pi_old with ``algorithm.old_logprobs=sampler``) and the trainer's forward
disagree by shows up there as a ratio != 1, and past 3e-4 on a sequence's mean as a clip.

``probe``: one rollout batch per setting, sampled by the torch engine and recomputed by the
trainer's forward (per minibatch, as the update runs it), from the same float32 cold start:
the per-token and per-sequence gaps, and the share of sequences whose mean gap leaves
GSPO's clip band, for float32, bf16 as it was (logits and decode attention in bf16), and
bf16 with each agreement fix (the head's logits in float32; SDPA in the decoder):

    python experiments/precision.py probe [--preset long] [--batches 4]

``runs``: whole RL runs from that cold start, GSPO and GRPO, each with old log-probs from
the sampler in bf16 as it was / with the fixes / recomputed (the default in bf16) / in
float32: on-policy (minibatch 0) and off-policy clip fractions, ratio spread, accuracy.

    python experiments/precision.py runs [--preset long] [--steps 32]

Writes ``report.md`` and ``summary.json`` into ``--output-dir`` (docs/precision).
``--device cuda``: the probe's sampling and recompute, and the runs, on CUDA (the cold
start is a float32 one, on the CPU unless ``--set model.device=cuda``, the same for every
setting); ``make gpu-check``'s
``precision`` stage runs the probe so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch

from gspo.chat import encode_prompt
from gspo.config import load_config
from gspo.engines import SamplingParams, TorchEngine, decoding
from gspo.experiments import PRESETS, cold_start_checkpoint
from gspo.models import completion_logprobs, kernels, load_model
from gspo.models import logprobs as models
from gspo.provenance import code_commit, machine
from gspo.training.seeds import derive_seed
from gspo.training.setup import load_task_data

#: GSPO's clip band on the mean log-ratio: log(1 - 3e-4), log(1 + 4e-4).
CLIP_LOW, CLIP_HIGH = math.log1p(-3e-4), math.log1p(4e-4)

#: name -> (compute dtype, head in float32, decoder attention, head precision: float32,
#: bf16_weight, or "bf16 inputs": bf16_weight with the hidden states rounded to bf16 too)
SETTINGS = {
    "float32": (torch.float32, True, None, "float32"),
    "bf16, as before (bf16 logits, products attention)": (
        torch.bfloat16, False, "products", "float32",
    ),
    "bf16, float32 head only": (torch.bfloat16, True, "products", "float32"),
    "bf16, SDPA decode only": (torch.bfloat16, False, "sdpa", "float32"),
    "bf16, both fixes (the CPU's default)": (torch.bfloat16, True, None, "float32"),
    "bf16, both fixes, bf16_weight head (CUDA's default)": (
        torch.bfloat16, True, None, "bf16_weight",
    ),
    "bf16, both fixes, head inputs rounded to bf16 (not used)": (
        torch.bfloat16, True, None, "bf16 inputs",
    ),
}  # fmt: skip


def _hi_only(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels._split`` without its low term: the hidden states rounded to bf16."""
    hi = x.reshape(-1, x.shape[-1]).bfloat16()
    return hi, torch.zeros_like(hi)


QUIET = ["log.progress=false", "log.plots=false", "log.tensorboard=false"]


#: the code a report ran on, read when the script starts (not when it writes the report)
COMMIT = code_commit()


def base_overrides(preset: str, extra: list[str]) -> list[str]:
    return [*PRESETS[preset], "model.device=cpu", "model.dtype=float32", *QUIET, *extra]


def probe(args) -> dict:
    overrides = base_overrides(args.preset, args.set)
    checkpoint = cold_start_checkpoint(overrides, None, args.work_dir / args.preset, print)
    config = load_config(None, overrides)
    device = torch.device(args.device)
    model, tokenizer = load_model(checkpoint, device=device, dtype=torch.float32)
    if args.lora:
        model = with_lora(model, args.lora)
    model.eval()
    rows = load_task_data(config).train
    rollout, minibatches = config.rollout, config.algorithm.minibatches
    params = SamplingParams(
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        stop_token_ids=(tokenizer.eos_token_id,),
    )
    # the per-step loop (the CUDA default is the captured step, whose kept graphs would
    # replay the first setting's patched attention and head in every later one; its gap is
    # tests/test_cuda.py's test_cuda_graphs_in_bf16_stay_near_a_bf16_recompute)
    engine = TorchEngine(
        model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        cuda_graphs=False,
    )  # fmt: skip
    results = {}
    split = kernels._split
    for name, (dtype, head32, attention, head) in SETTINGS.items():
        models.HEAD_IN_FLOAT32 = head32
        decoding.KVDecoder.attention = attention
        kernels.set_linear_kernel(model, "torch", "float32" if head == "float32" else "bf16_weight")
        kernels._split = _hi_only if head == "bf16 inputs" else split
        token_abs, token_max, seq_abs, outside, lengths = [], 0.0, [], 0, []
        start = time.perf_counter()
        for b in range(args.batches):
            picked = rows[b * rollout.prompts_per_batch : (b + 1) * rollout.prompts_per_batch]
            prompts = [encode_prompt(r["prompt"], tokenizer) for r in picked]
            autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
            with torch.no_grad(), autocast:
                seed = derive_seed(config.train.seed, "probe", b)
                batch = engine.generate(prompts, n=rollout.group_size, params=params, seed=seed)
                n = len(batch)
                order = torch.randperm(n, generator=torch.Generator().manual_seed(b))
                for part in order.chunk(minibatches):
                    mb = batch.select(part.sort().values)
                    lp = completion_logprobs(
                        model,
                        mb.prompt_ids,
                        mb.prompt_mask,
                        mb.completion_ids,
                        mb.completion_mask,
                        temperature=rollout.temperature,
                        share_prompts="auto",
                        with_entropy=True,
                    )[0]
                    mask = mb.completion_mask.bool()
                    delta = (lp - mb.sampler_logprobs)[mask]
                    token_abs.append(delta.abs())
                    token_max = max(token_max, float(delta.abs().max()))
                    count = mask.sum(-1).clamp(min=1)
                    mean = ((lp - mb.sampler_logprobs) * mask).sum(-1) / count
                    seq_abs.append(mean.abs())
                    outside += int(((mean < CLIP_LOW) | (mean > CLIP_HIGH)).sum())
                    lengths.append(count.float())
        tokens = torch.cat(token_abs)
        seqs = torch.cat(seq_abs)
        results[name] = {
            "token_abs_mean": float(tokens.mean()),
            "token_abs_max": token_max,
            "sequence_mean_delta_abs_mean": float(seqs.mean()),
            "sequences_outside_clip_band": outside / len(seqs),
            "sequences": len(seqs),
            "mean_length": float(torch.cat(lengths).mean()),
            "seconds": time.perf_counter() - start,
        }
        print(name, json.dumps(results[name]))
    models.HEAD_IN_FLOAT32, decoding.KVDecoder.attention = True, None
    kernels._split = split
    return results


def with_lora(model, r: int):
    """``model`` with PEFT LoRA adapters of rank ``r`` on every linear layer but the head,
    their B drawn small and non-zero (fresh adapters add nothing): what the sampler and
    the trainer of a LoRA run compute in bf16 (the decoder beside the bf16 matrices, the
    trainer through PEFT's layers)."""
    from gspo.config import LoraSettings
    from gspo.training.lora import attach_lora

    peft_model = attach_lora(model, LoraSettings(r=r, alpha=2 * r), seed=0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return peft_model


def probe_name(args) -> str:
    return f"probe_{args.preset}" + (f"_lora{args.lora}" if args.lora else "")


def probe_report(results: dict, args) -> str:
    lines = [
        "| setting | token mean abs gap | token max | sequence mean gap (abs, mean) | "
        "sequences outside the clip band | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['token_abs_mean']:.2e} | {r['token_abs_max']:.2e} | "
            f"{r['sequence_mean_delta_abs_mean']:.2e} | {r['sequences_outside_clip_band']:.3f} "
            f"| {r['seconds']:.1f} |"
        )
    any_r = next(iter(results.values()))
    extra = f" --set {' '.join(args.set)}" if args.set else ""
    extra += f" --lora {args.lora}" if args.lora else ""
    extra += f" --device {args.device}" if args.device != "cpu" else ""
    command = f"python experiments/precision.py probe --preset {args.preset}"
    head = (
        f"`{command} --batches {args.batches}{extra}` on {COMMIT}, {machine()} "
        f"({torch.get_num_threads()} threads): "
        f"{any_r['sequences']} sequences per setting, mean length "
        f"{any_r['mean_length']:.1f} tokens."
    )
    return head + "\n\n" + "\n".join(lines) + "\n"


#: run name -> (overrides, head in float32, decoder attention); each for GSPO and GRPO
RUNS = {
    "bf16, sampler, as before": (
        ["model.dtype=bfloat16", "algorithm.old_logprobs=sampler"],
        False,
        "products",
    ),
    "bf16, sampler, agreement fixes": (
        ["model.dtype=bfloat16", "algorithm.old_logprobs=sampler"],
        True,
        None,
    ),
    "bf16, recomputed (default)": (["model.dtype=bfloat16"], True, None),
    "float32, sampler (default)": (["model.dtype=float32"], True, None),
}
LEVELS = {"GSPO": "sequence", "GRPO": "token"}


def weighted(lines: list[dict], key: str) -> float:
    """Token-weighted mean of ``key`` over minibatch lines (``train/tokens`` each)."""
    total = sum(r["train/tokens"] for r in lines)
    return sum(r[key] * r["train/tokens"] for r in lines) / max(total, 1)


def runs(args) -> list[dict]:
    from gspo.experiments import final_eval, run_or_reuse

    overrides = base_overrides(args.preset, args.set)
    checkpoint = cold_start_checkpoint(overrides, None, args.work_dir / args.preset, print)
    rows = []
    for (level_name, level), (name, (extra, head32, attention)) in itertools.product(
        LEVELS.items(), RUNS.items()
    ):
        label = f"{level_name}, {name}"
        models.HEAD_IN_FLOAT32, decoding.KVDecoder.attention = head32, attention
        config = load_config(
            None,
            [
                *overrides,
                *extra,
                f"model.path={checkpoint}",
                "train.cold_start_steps=0",
                f"train.max_steps={args.steps}",
                f"eval.every={args.steps}",
                f"algorithm.level={level}",
                f"model.device={args.device}",
            ],
        )
        slug = label.replace(", ", "-").replace(" ", "_").replace("(", "").replace(")", "")
        records = run_or_reuse(config, args.work_dir / args.preset / slug, print)
        lines = [r for r in records if "train/loss" in r]
        on = [r for r in lines if r["train/minibatch"] == 0]
        off = [r for r in lines if r["train/minibatch"] > 0]
        rows.append(
            {
                "run": label,
                "on_policy_clip_fraction": weighted(on, "train/clip_fraction"),
                "on_policy_clip_per_batch": [round(r["train/clip_fraction"], 4) for r in on],
                "on_policy_ratio_range": [
                    min(r["train/ratio_min"] for r in on),
                    max(r["train/ratio_max"] for r in on),
                ],
                "off_policy_clip_fraction": weighted(off, "train/clip_fraction"),
                "sequence_gap": max(
                    (r.get("mismatch/sequence_mean_delta_abs_mean", 0.0) for r in lines),
                    default=0.0,
                ),
                "accuracy_start": next(r["eval/accuracy"] for r in records if "eval/accuracy" in r),
                "accuracy": final_eval(records),
                "seconds_per_step": sum(r["time/step"] for r in lines) / len(lines),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    models.HEAD_IN_FLOAT32, decoding.KVDecoder.attention = True, None
    return rows


def runs_report(rows: list[dict], args) -> str:
    extra = f" --set {' '.join(args.set)}" if args.set else ""
    extra += f" --device {args.device}" if args.device != "cpu" else ""
    command = f"python experiments/precision.py runs --preset {args.preset}"
    lines = [
        f"`{command} --steps {args.steps}{extra}` on {COMMIT}, {machine()} "
        f"({torch.get_num_threads()} threads); one seed per run, "
        "all from the same float32 cold start.",
        "",
        "| run | on-policy clipped tokens (minibatch 0, per rollout batch) | on-policy ratio "
        "range | off-policy clipped tokens | largest sequence-mean gap | held-out accuracy "
        "| s / step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        low, high = r["on_policy_ratio_range"]
        per_batch = ", ".join(f"{c:.2f}" for c in r["on_policy_clip_per_batch"])
        lines.append(
            f"| {r['run']} | {r['on_policy_clip_fraction']:.3f} ({per_batch}) | "
            f"{low:.5f} - {high:.5f} | {r['off_policy_clip_fraction']:.3f} | "
            f"{r['sequence_gap']:.1e} | {r['accuracy_start']:.3f} -> {r['accuracy']:.3f} | "
            f"{r['seconds_per_step']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["probe", "runs"])
    parser.add_argument("--steps", type=int, default=32, help="runs: RL steps per run")
    parser.add_argument("--preset", default="long", choices=sorted(PRESETS))
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides")
    parser.add_argument(
        "--lora", type=int, default=0, help="probe: LoRA adapters of this rank on the model"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the probe and the runs compute (cpu, cuda)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("runs/precision"))
    parser.add_argument("--output-dir", type=Path, default=Path("docs/precision"))
    args = parser.parse_args()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.what == "runs":
        rows = runs(args)
        summary = args.output_dir / f"runs_{args.preset}.json"
        summary.write_text(json.dumps(rows, indent=1) + "\n")
        (args.output_dir / f"runs_{args.preset}.md").write_text(runs_report(rows, args))
        return
    results = probe(args)
    summary = args.output_dir / f"{probe_name(args)}.json"
    summary.write_text(json.dumps(results, indent=1) + "\n")
    (args.output_dir / f"{probe_name(args)}.md").write_text(probe_report(results, args))


if __name__ == "__main__":
    main()
