"""Micro-benchmarks behind the speed choices, on the vs_trl reference model (float32, CPU).

    python benchmarks/levers.py [--workdir runs/bench_vs_trl]

Each lever is timed with its variants interleaved (variant A, B, C, A, B, C, ...) so that
drift in this machine's speed hits all of them alike; figures are medians in ms.

- pack: forward + backward of the packed log-probs of one minibatch (32 completions of
  the reference workload) against the least row length (``pack_tokens``); "one row" packs
  everything into a single row, as a 4096-token budget did.
- share: forward + backward of a minibatch drawn at random from a rollout batch as the
  trainer draws it, with each group's prompt computed once for its rows
  (``share_prompts``, the trainer's setting) or once per row.
- drop: one rollout batch (16 prompts x 8, 32 new tokens) against the share of finished
  rows at which they leave the batch and KV cache (``gspo.engines.torch_engine.DROP_FRACTION``).
- prefill: one rollout batch (16 prompts x 8, 32 new tokens), each prompt run once and
  its KV cache copied to its 8 responses (``TorchEngine``) vs run once per response (the
  same 128 prompts as distinct prompts, n=1: the same samples), for the workload's
  6-token prompts and for the same problems behind 250 tokens of worked examples.
- adamw: gradient clipping + one AdamW step, per-tensor loop vs foreach vs fused.
- decode: one decoding step (KV cache, one new token per row) against the batch size;
  the intercept is the per-call overhead of the transformers forward.
- teardown: a child process imports torch and transformers' Qwen3 model code, then exits
  normally or the way ``gspo.cli.entry`` does (atexit handlers, flush, ``os._exit``); the
  time from its last line to its end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import workload  # noqa: E402

from gspo.chat import encode_prompt  # noqa: E402
from gspo.engines import torch_engine as rollout  # noqa: E402
from gspo.models import load_model, packed_completion_logprobs  # noqa: E402


def interleaved_times(
    variants: dict[str, Callable[[], object]], reps: int
) -> dict[str, list[float]]:
    """Seconds of each variant's ``reps`` runs, round-robin, after one warm-up each."""
    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved(variants: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms of each variant, run round-robin ``reps`` times after one warm-up each."""
    times = interleaved_times(variants, reps)
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def table(title: str, results: dict[str, float]) -> None:
    print(f"\n{title}\n| variant | median ms |\n|---|---|")
    for name, ms in results.items():
        print(f"| {name} | {ms:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/bench_vs_trl"))
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    work = workload.build(args.workdir)
    model, tokenizer = load_model(work / "model", device=torch.device("cpu"), dtype=torch.float32)
    rows = [json.loads(x) for x in (work / "train.jsonl").read_text().splitlines()[:16]]
    prompts = [encode_prompt(r["prompt"], tokenizer) for r in rows]
    engine = rollout.TorchEngine(
        model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    params = rollout.SamplingParams(max_new_tokens=32, temperature=1.0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    # pack: one minibatch of 32 sampled completions
    batch = engine.generate(prompts, n=8, params=params, seed=1).select(torch.arange(32))
    prompt_tokens = int(batch.prompt_mask.sum())
    tokens = prompt_tokens + int(batch.completion_mask.sum())
    width = batch.prompt_ids.shape[1] + int(batch.completion_mask.sum(-1).max())
    print(f"one minibatch padded to its longest row: 32 x {width} = {32 * width} positions")
    model.train()

    def fwd_bwd(mb: rollout.RolloutBatch, **options: Any) -> Callable[[], object]:
        def run() -> None:
            lp = packed_completion_logprobs(
                model,
                mb.prompt_ids,
                mb.prompt_mask,
                mb.completion_ids,
                mb.completion_mask,
                **options,
            )
            lp.sum().backward()
            model.zero_grad()

        return run

    packs = {"one row": 10**6, "256": 256, "128": 128, "64": 64, "longest sequence": 0}
    table(
        f"pack: forward + backward, 32 completions, {tokens} tokens ({prompt_tokens} of "
        "them prompt tokens), by least row length",
        interleaved({k: fwd_bwd(batch, pack_tokens=v) for k, v in packs.items()}, args.reps),
    )

    # share: a minibatch drawn as the trainer draws it (32 of the 128 at random), each
    # group's prompt computed once for its rows in it, or once per row
    rollout_batch = engine.generate(prompts, n=8, params=params, seed=2)
    mb = rollout_batch.select(torch.randperm(128, generator=torch.Generator().manual_seed(0))[:32])
    masks = mb.prompt_mask.bool()
    distinct = len({tuple(r[m].tolist()) for r, m in zip(mb.prompt_ids, masks, strict=True)})

    table(
        f"share: forward + backward of a random minibatch (32 completions of {distinct} "
        f"distinct prompts, {int(mb.completion_mask.sum())} completion tokens)",
        interleaved(
            {
                "prompt once per row": fwd_bwd(mb, share_prompts=False),
                "prompt once per group": fwd_bwd(mb, share_prompts=True),
            },
            args.reps,
        ),
    )
    model.eval()

    # drop: one rollout batch by the share of finished rows that triggers dropping them
    default = rollout.DROP_FRACTION
    seeds = iter(range(10**6))

    def generate(fraction: float) -> Callable[[], object]:
        def run() -> None:
            rollout.DROP_FRACTION = fraction
            engine.generate(prompts, n=8, params=params, seed=next(seeds) // 5)

        return run

    fractions = {"any finished (default)": 0.0, "1/8": 0.125, "1/4": 0.25, "1/2": 0.5, "never": 2.0}
    table(
        "drop: one rollout batch (128 completions, up to 32 tokens), by drop threshold",
        interleaved({k: generate(v) for k, v in fractions.items()}, args.reps),
    )
    rollout.DROP_FRACTION = default

    # prefill: shared per prompt vs once per response, short and long prompts
    preamble = encode_prompt("12+34=46 " * 28, tokenizer)[:250]  # the charset: digits, +, =
    long_prompts = [preamble + p for p in prompts]

    def sample(prompt_ids: list[list[int]], shared: bool) -> Callable[[], object]:
        each = [p for p in prompt_ids for _ in range(8)]

        def run() -> None:
            if shared:
                engine.generate(prompt_ids, n=8, params=params, seed=3)
            else:
                engine.generate(each, n=1, params=params, seed=3)

        return run

    table(
        "prefill: one rollout batch (128 completions, up to 32 tokens), prompt prefill",
        interleaved(
            {
                "6-token prompts, once per prompt": sample(prompts, True),
                "6-token prompts, once per response": sample(prompts, False),
                "256-token prompts, once per prompt": sample(long_prompts, True),
                "256-token prompts, once per response": sample(long_prompts, False),
            },
            args.reps,
        ),
    )

    # adamw: one optimizer step with clipping
    for p in model.parameters():
        p.grad = torch.randn_like(p)

    def step(**kw: bool) -> Callable[[], object]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.99), **kw)

        def run() -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        return run

    table(
        "adamw: clip + step",
        interleaved(
            {"per-tensor loop": step(), "foreach": step(foreach=True), "fused": step(fused=True)},
            args.reps * 2,
        ),
    )
    model.zero_grad(set_to_none=True)

    # decode: one step with a KV cache by batch size
    from transformers import DynamicCache

    from gspo.engines.decoding import cached_forward

    def decode(size: int) -> Callable[[], object]:
        ids = torch.randint(3, 12, (size, 6))
        with torch.no_grad():
            _, kv = cached_forward(model, DynamicCache(), input_ids=ids)

        def run() -> None:
            with torch.no_grad():
                for layer in kv.layers:  # keep the cache at 6 tokens: time one step only
                    layer.keys, layer.values = layer.keys[:, :, :6], layer.values[:, :, :6]
                cached_forward(model, kv, input_ids=ids[:, :1], logits_to_keep=1)

        return run

    table(
        "decode: one step with KV cache, by batch size",
        interleaved({f"batch {b}": decode(b) for b in (1, 16, 64, 128)}, args.reps * 2),
    )

    exits = {"normal exit": "pass", "gspo.cli.entry's exit": "os._exit(0)"}
    child = "import os, time, torch, transformers.models.qwen3.modeling_qwen3\n"
    child += "print(time.time(), flush=True)\n"
    times: dict[str, list[float]] = {name: [] for name in exits}
    for _ in range(3):
        for name, how in exits.items():
            out = subprocess.run(
                [sys.executable, "-c", child + how], capture_output=True, text=True, check=True
            )
            times[name].append(1000 * (time.time() - float(out.stdout.split()[-1])))
    table(
        "teardown: last line to process end, after importing torch + transformers",
        {name: statistics.median(ts) for name, ts in times.items()},
    )


if __name__ == "__main__":
    main()
