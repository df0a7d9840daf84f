"""What only a CUDA device can check: the engines, the packed forward and training on it.

Skipped without CUDA; ``make gpu-check`` (benchmarks/gpu_check.py) runs this file first.
"""

import pytest
import torch

from gspo.config import load_config
from gspo.models import completion_logprobs, packed_completion_logprobs
from gspo.rollout import SamplingParams, TorchEngine
from gspo.trainer import Trainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TEXTS = ("12+34=", "5+6=", "123+456=")


def encode(tokenizer):
    return [tokenizer(t)["input_ids"] for t in TEXTS]


def engines(model, tokenizer):
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return TorchEngine(model, **ids), TorchEngine(model, fast=False, **ids)


def test_fast_decoder_on_cuda_samples_what_the_reference_samples(tokenizer, tiny_model):
    model = tiny_model.to("cuda")
    fast, ref = engines(model, tokenizer)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95)
    a = fast.generate(encode(tokenizer), n=4, params=params, seed=0)
    b = ref.generate(encode(tokenizer), n=4, params=params, seed=0)
    assert a.completion_ids.is_cuda and torch.equal(a.completion_ids, b.completion_ids)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-4
    with torch.no_grad():
        lp = completion_logprobs(
            model, a.prompt_ids, a.prompt_mask, a.completion_ids, a.completion_mask,
            temperature=0.9,
        )  # fmt: skip
    assert (lp - a.sampler_logprobs).abs()[a.completion_mask].max() < 1e-3


def test_bf16_autocast_sampling_stays_near_a_bf16_recompute(tokenizer, tiny_model):
    model = tiny_model.to("cuda")
    fast, _ = engines(model, tokenizer)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        batch = fast.generate(encode(tokenizer), n=8, params=SamplingParams(12), seed=1)
        with torch.no_grad():
            lp = completion_logprobs(
                model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                batch.completion_mask,
            )  # fmt: skip
    delta = (lp - batch.sampler_logprobs).abs()[batch.completion_mask]
    assert delta.mean() < 0.05  # bf16 rounding, two different computations


def test_packed_logprobs_on_cuda_equal_the_cpu_ones(tokenizer, tiny_model):
    batch = engines(tiny_model, tokenizer)[0].generate(
        encode(tokenizer), n=4, params=SamplingParams(10), seed=2
    )
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    with torch.no_grad():
        cpu = packed_completion_logprobs(tiny_model, *args, share_prompts="auto")
        model = tiny_model.to("cuda")
        gpu = packed_completion_logprobs(model, *(a.cuda() for a in args), share_prompts="auto")
    assert (gpu.cpu() - cpu).abs().max() < 1e-4


@pytest.mark.slow
def test_gspo_trains_on_cuda_in_bf16(tmp_path, ones_reward):
    overrides = [
        "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
        "model.intermediate=128", "data.eval_size=16", "data.sft_size=64",
        "train.cold_start_steps=4", "rollout.group_size=4", "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=8", "train.max_steps=4", "eval.every=0", "eval.samples=2",
        "log.progress=false", "log.plots=false", "log.tensorboard=false",
        "model.device=cuda", "model.dtype=bfloat16", ones_reward,
    ]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    import json

    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "train/loss" in r]
    assert len(train) == 4
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in train)


def async_run_overrides(device: str, reward: str) -> list[str]:
    """A small run with rollouts sampled one batch ahead and pi_old recomputed by the
    producer on the weights that sampled (float32: no autocast)."""
    return [
        "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
        "model.intermediate=128", "data.eval_size=16", "data.sft_size=64",
        "train.cold_start_steps=4", "rollout.group_size=4", "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=8", "train.max_steps=8", "algorithm.minibatches=2",
        "eval.every=0", "eval.samples=2", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", f"model.device={device}", "model.dtype=float32",
        "rollout.max_staleness=1", "algorithm.old_logprobs=recompute", reward,
    ]  # fmt: skip


def first_minibatch_records(run) -> list[dict]:
    import json

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "train/loss" in r and r["train/minibatch"] == 0]


@pytest.mark.slow
def test_async_rollouts_on_cuda_stay_on_policy(tmp_path, varied_reward):
    """``rollout.max_staleness=1`` on CUDA: the producer samples on a stream of its own and
    hands its tensors to the trainer's stream. pi_old recomputed on the producer's weights
    equals the sampler's log-probs to float32 rounding, which a race on the batch's or the
    weights' memory between the two streams would break."""
    Trainer(load_config(None, async_run_overrides("cuda", varied_reward)), tmp_path / "run").fit()
    firsts = first_minibatch_records(tmp_path / "run")
    assert [r["rollout/staleness"] for r in firsts] == [0.0, 1.0, 1.0, 1.0]
    assert max(r["mismatch/token_abs_max"] for r in firsts) < 1e-3
