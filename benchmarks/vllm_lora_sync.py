"""LoRA runs on vLLM: merged-weight sync against adapter-only sync (``rollout.vllm.lora_sync``).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_lora_sync.py \
        [--repeats 5] [--ranks 8 32] [--spec workload|large]

Needs vLLM (``make install-vllm``). For each LoRA rank, two colocated engines over the same
base model: one plain (``lora_sync=merged``: at every sync the policy's adapters are merged
into a copy and every weight is copied into vLLM) and one started with vLLM's LoRA support
(``lora_sync=adapter``: only the adapter is handed over). Per repeat the adapters move (as
an optimizer step would move them), then each engine is synced through the trainer's own
:class:`~gspo.training.sampler.PolicySampler` and samples one rollout batch of the reference
workload's shape (16 prompts x 8 responses, 32 new tokens); the two engines alternate.
Reported, medians over the repeats: seconds per sync, seconds per rollout batch, and the
largest gap between vLLM's sampled log-probs and the trainer's recompute through the
adapters (the float32 level is ~1e-6).

``--spec workload`` is the benchmark model of ``vs_trl.py`` (4 layers, 256 wide, ~3M
parameters); ``large`` is 8 layers, 512 wide (~25M), where a whole-weights copy costs more.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402

from gspo.config import LoraSettings  # noqa: E402
from gspo.distributed import Distributed  # noqa: E402
from gspo.engines import SamplingParams  # noqa: E402
from gspo.engines.vllm_engine import VLLMEngine  # noqa: E402
from gspo.models import (  # noqa: E402
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    save_pretrained_atomic,
)
from gspo.provenance import code_commit  # noqa: E402
from gspo.training.lora import attach_lora  # noqa: E402
from gspo.training.policy import Policy  # noqa: E402
from gspo.training.sampler import PolicySampler  # noqa: E402

SPECS = {
    "workload": workload.SPEC,
    "large": TinyModelSpec(layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1536),
}


def lora_policy(model_dir: Path, rank: int) -> Policy:
    base, _ = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    module = attach_lora(base, LoraSettings(r=rank), seed=0, base_path=model_dir)
    return Policy(module, Distributed(), compute_dtype=torch.float32, temperature=1.0)


def move_adapters(policy: Policy, rng: torch.Generator) -> None:
    """What an optimizer step does to the adapters, as far as a sync can tell."""
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if "lora_B" in name:
                p.add_(0.01 * torch.randn(p.shape, generator=rng))
    policy.stepped()


def measure(model_dir: Path, rank: int, repeats: int, tokenizer) -> dict[str, dict[str, float]]:
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    device = torch.device("cpu")
    engines = {
        "merged": VLLMEngine(model_dir, pad_token_id=pad, eos_token_id=eos, device=device),
        "adapter": VLLMEngine(
            model_dir, pad_token_id=pad, eos_token_id=eos, device=device, lora_rank=rank
        ),
    }
    policy = lora_policy(model_dir, rank)
    samplers = {mode: PolicySampler(engine, policy) for mode, engine in engines.items()}
    rng = random.Random(0)
    prompts = [
        tokenizer(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=")["input_ids"] for _ in range(16)
    ]
    params = SamplingParams(max_new_tokens=32)
    noise = torch.Generator().manual_seed(0)
    rows: dict[str, dict[str, list[float]]] = {
        mode: {"sync": [], "generate": [], "mismatch": []} for mode in engines
    }
    for i in range(repeats + 1):  # the first round warms both engines up and is dropped
        move_adapters(policy, noise)
        for mode in engines if i % 2 == 0 else reversed(list(engines)):
            start = time.perf_counter()
            samplers[mode].sync()
            sync = time.perf_counter() - start
            batch = samplers[mode].generate(prompts, n=8, params=params, seed=i)
            total = time.perf_counter() - start
            with torch.no_grad():
                lp = policy.logprobs(batch)
            gap = (lp - batch.sampler_logprobs).abs()[batch.completion_mask.bool()].max()
            if i > 0:
                rows[mode]["sync"].append(sync)
                rows[mode]["generate"].append(total - sync)
                rows[mode]["mismatch"].append(gap.item())
    return {
        mode: {k: statistics.median(v) if k != "mismatch" else max(v) for k, v in r.items()}
        for mode, r in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--spec", choices=sorted(SPECS), default="workload")
    args = parser.parse_args()
    commit = code_commit()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_char_tokenizer(workload.CHARSET)
        model = build_tiny_model(SPECS[args.spec], tokenizer, seed=0)
        params = sum(p.numel() for p in model.parameters())
        model_dir = save_pretrained_atomic(model, tokenizer, Path(tmp) / "model")
        print(
            f"vLLM LoRA sync, model {args.spec} ({params / 1e6:.1f}M parameters), "
            f"{args.repeats} repeats, commit {commit}, torch threads {torch.get_num_threads()}"
        )
        print(
            "| LoRA rank | sync | seconds per sync | seconds per rollout batch | max log-prob gap |"
        )
        print("|---|---|---|---|---|")
        for rank in args.ranks:
            result = measure(model_dir, rank, args.repeats, tokenizer)
            for mode, r in result.items():
                print(
                    f"| {rank} | {mode} | {r['sync']:.4f} | {r['generate']:.3f} | "
                    f"{r['mismatch']:.1e} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
