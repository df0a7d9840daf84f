"""vLLM engine vs the PyTorch engine: generation time, weight-sync time, log-prob agreement.

    python experiments/vllm_rollout_timing.py [--tokens 8] [--repeats 5]

Needs vLLM (``make install-vllm``, then run with ``.venv-vllm/bin/python``). The model is
the trainer's default built-in (4-layer, 256-wide Qwen3, character tokenizer), randomly
initialised; one rollout batch is the default 16 prompts x 8 samples = 128 completions.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gspo.chat import encode_prompt
from gspo.engines import SamplingParams, TorchEngine
from gspo.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    completion_logprobs,
    load_model,
    save_pretrained_atomic,
)
from gspo.tasks import BUILTIN_TASKS


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """(first call's seconds, the next ``repeats`` calls' seconds)."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, times


def max_delta(model, batch, temperature: float) -> tuple[float, float]:
    with torch.no_grad():
        lp = completion_logprobs(
            model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            batch.completion_mask,
            temperature=temperature,
        )
    delta = (lp - batch.sampler_logprobs).abs()[batch.completion_mask.bool()]
    return delta.max().item(), delta.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8, help="max new tokens per completion")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from gspo.engines.vllm_engine import VLLMEngine
    from gspo.provenance import code_commit, machine

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    task = BUILTIN_TASKS["addition"](digits=2, eval_size=16, sft_size=1, label_noise=0.0, seed=0)
    prompts = [encode_prompt(r["prompt"], tokenizer) for r in task.train[:16]]
    params = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)
    # never stop early: every completion is `tokens` long, for both engines
    no_eos = {"pad_token_id": tokenizer.pad_token_id, "eos_token_id": None}
    result: dict[str, object] = {"commit": code_commit(), "machine": machine()}
    result.update({"completions": 16 * 8, "max_new_tokens": args.tokens})

    with tempfile.TemporaryDirectory() as tmp:
        base = build_tiny_model(TinyModelSpec(), tokenizer, seed=0)
        model_dir = save_pretrained_atomic(base, tokenizer, Path(tmp) / "model")
        model, _ = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
        result["parameters"] = sum(p.numel() for p in model.parameters())

        start = time.perf_counter()
        engine = VLLMEngine(model_dir, device=torch.device("cpu"), **no_eos)
        result["vllm_start_s"] = round(time.perf_counter() - start, 2)

        seeds = iter(range(10_000))
        first, warm = timed(
            lambda: engine.generate(prompts, n=8, params=params, seed=next(seeds)), args.repeats
        )
        result["vllm_generate_first_s"] = round(first, 3)
        result["vllm_generate_warm_median_s"] = round(statistics.median(warm), 3)

        torch_engine = TorchEngine(model, **no_eos)
        first, warm = timed(
            lambda: torch_engine.generate(prompts, n=8, params=params, seed=next(seeds)),
            args.repeats,
        )
        result["torch_generate_first_s"] = round(first, 3)
        result["torch_generate_warm_median_s"] = round(statistics.median(warm), 3)

        # a policy update: perturb every weight, then sync and compare with a recompute
        with torch.no_grad():
            gen = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        stale = engine.generate(prompts, n=8, params=params, seed=0)
        result["logprob_delta_max_before_sync"] = max_delta(model, stale, 1.0)[0]
        _, syncs = timed(lambda: engine.sync_weights(model), args.repeats)
        result["weight_sync_median_s"] = round(statistics.median(syncs), 4)
        synced = engine.generate(prompts, n=8, params=params, seed=0)
        worst, mean = max_delta(model, synced, 1.0)
        result["logprob_delta_max_after_sync"] = worst
        result["logprob_delta_mean_after_sync"] = mean
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
