"""``model.activation_checkpointing``: the update's forward keeps each transformer block's
input only and backward runs the block again; the loss, the gradients and every no-grad
forward (pi_old, generation, evaluation) are what they are without it.

The two-rank FSDP2 run with it on is tests/test_distributed.py's
``test_two_ranks_with_activation_checkpointing_take_the_one_process_step``."""

import contextlib
from pathlib import Path

import pytest
import torch
from conftest import CPU
from distributed_worker import count_layer_runs
from test_trainer import FAST, comparable

import gspo.models.logprobs
from gspo.cli import main
from gspo.config import load_config
from gspo.distributed import Distributed, rank_device
from gspo.engines import RolloutBatch
from gspo.models import resolve_dtype
from gspo.moe import capture_router_logits, find_routers, is_moe, load_balancing_loss
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer
from gspo.training.policy import Policy
from gspo.training.setup import build_policy_model

ON = "model.activation_checkpointing=true"
SHAPE = [
    "model.layers=2",
    "model.hidden=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=128",
    "train.cold_start_steps=0",
]
LAYERS = 2


def build_policy(out: Path, *overrides: str, device: str = CPU) -> Policy:
    """The policy a run of ``SHAPE`` and ``overrides`` trains, on ``device`` (an override),
    in the compute dtype its ``model.dtype`` resolves to there."""
    config = load_config(None, [device, *SHAPE, *overrides])
    dist = Distributed()
    at = rank_device(config.model.device, dist)
    dtype = resolve_dtype(config.model.dtype, at, builtin=not config.model.path)
    model, _, _ = build_policy_model(config, out, at, dist, None, dtype)
    return Policy(model, dist, compute_dtype=dtype, temperature=1.0)


def fixed_batch(
    n: int = 8, prompt: int = 6, length: int = 12, device: str | torch.device = "cpu"
) -> RolloutBatch:
    """Left-padded prompts and responses of unequal lengths (one empty), two per group,
    drawn on the CPU and moved to ``device``."""
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(n, prompt, dtype=torch.bool)
    prompt_mask[::2, :2] = False
    lengths = torch.randint(1, length + 1, (n, 1), generator=g)
    lengths[3] = 0
    return RolloutBatch(
        prompt_ids=torch.randint(3, 60, (n, prompt), generator=g).to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=torch.randint(3, 60, (n, length), generator=g).to(device),
        completion_mask=(torch.arange(length).unsqueeze(0) < lengths).to(device),
        sampler_logprobs=torch.zeros(n, length, device=device),
        finish_reasons=["stop"] * n,
        group_size=2,
    )


def one_update(policy: Policy, batch: RolloutBatch):
    """The loss of one training forward (log-probs and entropies, as the update takes
    them; a MoE model's router load-balancing loss too, whose logits leave the
    checkpointed blocks through hooks), every trained parameter's gradient, and the blocks'
    runs in forward and in backward."""
    policy.train()
    moe = is_moe(policy.module)
    with count_layer_runs(policy.module) as runs:
        with capture_router_logits(policy.module) if moe else contextlib.nullcontext() as calls:
            logprobs, entropy = policy.logprobs(batch, with_entropy=True)
        mask = batch.completion_mask
        loss = -(logprobs * mask).sum() / mask.sum() - 0.01 * (entropy * mask).sum() / mask.sum()
        if moe:
            top_k = find_routers(policy.module)[0].top_k
            loss = loss + 0.01 * load_balancing_loss([c[0] for c in calls], top_k)
        forward = runs[0]
        policy.backward(loss, len(batch))
    grads = {n: p.grad for n, p in policy.module.named_parameters() if p.requires_grad}
    return loss.detach(), grads, forward, runs[0] - forward


def perturb_adapters(policy: Policy) -> None:
    """lora_B starts at zero (lora_A's gradient too): seeded values, the same in each run."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


VARIANTS = {
    "full": [],
    "padded": [],  # the model's own forward (an architecture the packed path does not take)
    "lora": ["model.lora.r=4"],
    "moe": ["model.builtin=qwen3_moe", "model.experts=4", "model.expert_intermediate=32"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpointing_recomputes_each_block_and_keeps_the_loss_and_gradients(
    tmp_path, monkeypatch, variant
):
    extra = VARIANTS[variant]
    if variant == "padded":
        monkeypatch.setattr(gspo.models.logprobs, "PLAIN_LM_HEAD", frozenset())
    batch, out = fixed_batch(), []
    for overrides in ([*extra], [*extra, ON]):
        policy = build_policy(tmp_path / str(len(out)), *overrides)
        packed = gspo.models.logprobs.plain_lm_head(policy.module)
        assert packed == (variant != "padded"), packed
        if variant == "lora":
            perturb_adapters(policy)
        out.append(one_update(policy, batch))
    (loss_off, grads_off, fwd_off, bwd_off), (loss_on, grads_on, fwd_on, bwd_on) = out
    # each block once in forward; in backward again only with checkpointing
    assert (fwd_off, bwd_off) == (LAYERS, 0)
    assert (fwd_on, bwd_on) == (LAYERS, LAYERS)
    # the same to float32 rounding: the BLAS's kernels may round by data alignment (the CI
    # machine's loss once differed in its 7th digit, 4.5415306 against 4.5415292)
    torch.testing.assert_close(loss_on, loss_off, rtol=2e-6, atol=0)
    assert grads_on.keys() == grads_off.keys()
    assert all("lora_" in n for n in grads_on) == (variant == "lora")
    for name, grad in grads_off.items():
        # every trained weight has a gradient to compare (a MoE's unchosen expert may not)
        assert grad.abs().max() > 0 or ".experts." in name, name
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    if variant == "moe":
        routers = [n for n in grads_off if "gate" in n and "proj" not in n]
        assert routers and all(grads_off[n].abs().max() > 0 for n in routers)


def test_no_grad_forwards_run_each_block_once(tmp_path):
    """pi_old and the reference are no-grad forwards of the module in training mode: no
    checkpoint, no recompute, the same log-probs."""
    batch = fixed_batch()
    off, on = build_policy(tmp_path / "off"), build_policy(tmp_path / "on", ON)
    on.train()
    with torch.no_grad(), count_layer_runs(on.module) as runs:
        logprobs = on.logprobs(batch)
    assert runs[0] == LAYERS and not logprobs.requires_grad
    with torch.no_grad():
        # (two modules built apart: the same to float32 rounding, as the loss above)
        torch.testing.assert_close(logprobs, off.logprobs(batch), rtol=2e-6, atol=1e-6)


def test_a_run_with_checkpointing_samples_and_trains_the_same(tmp_path):
    """Generation (the torch engine), pi_old, the update and the evaluation: the same
    metrics with the setting on, and its updates ran the blocks again in backward."""
    overrides = [*FAST, "train.cold_start_steps=0", "train.max_steps=2", "algorithm.minibatches=2"]
    runs, records = [], []
    for name, extra in (("off", []), ("on", [ON])):
        trainer = Trainer(load_config(None, [*overrides, *extra]), tmp_path / name)
        with count_layer_runs(trainer.policy.module) as counted:
            trainer.fit()
        runs.append(counted[0])
        records.append([comparable(r) for r in read_metrics(tmp_path / name / "metrics.jsonl")])
    assert records[1] == records[0]
    assert runs[1] > runs[0]  # the same forwards, and the updates' blocks again in backward


def test_a_model_without_support_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from transformers import Qwen3ForCausalLM

    monkeypatch.setattr(Qwen3ForCausalLM, "supports_gradient_checkpointing", False)
    code = main(["train", "--output-dir", str(tmp_path / "run"), *FAST, ON])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err == (
        "gspo: error: model.activation_checkpointing: Qwen3ForCausalLM does not support "
        "activation checkpointing (transformers' supports_gradient_checkpointing is False)"
    )
