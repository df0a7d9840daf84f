"""One optimizer step on a fixed rollout batch, as one process or as a rank of torchrun.

    python tests/distributed_worker.py OUT_DIR [key=value ...]            # whole batch
    torchrun --standalone --nproc-per-node 2 tests/distributed_worker.py OUT_DIR [key=value ...]

Extra ``key=value`` arguments are config overrides (``model.lora.r=4``: a LoRA policy);
they name ``model.device`` (cpu: gloo; cuda: NCCL, one GPU per rank), and the fixed batch
lives on the policy's device.

Each rank takes its contiguous share of the batch's groups (as the trainer does) and
takes the step through the trainer's loss and ``Trainer.policy_update`` (a
:class:`gspo.training.update.PolicyUpdate`); rank 0 saves the combined metrics,
the whole updated weights and how many times the blocks ran in the step (forward and
backward) to ``OUT_DIR/<level>.pt`` for ``test_distributed.py`` to compare.
The batch has responses of unequal lengths and two empty ones, all in rank 0's half, so
the ranks hold different token and response counts: a wrong loss normalisation shows.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from gspo.cli import quick_exit
from gspo.config import load_config
from gspo.distributed import full_state_dict, setup_distributed, teardown_distributed
from gspo.engines import RolloutBatch, pad_batch
from gspo.objectives import group_advantages
from gspo.trainer import Trainer
from gspo.training.update import Minibatch

GROUPS, GROUP_SIZE, LENGTH = 4, 4, 6
CONFIG = [
    "model.layers=2",
    "model.hidden=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=128",
    "data.eval_size=8",
    "data.sft_size=8",
    "train.cold_start_steps=0",
    f"rollout.group_size={GROUP_SIZE}",
    f"rollout.prompts_per_batch={GROUPS}",
    "algorithm.minibatches=1",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]
#: level -> clip range wide enough that some responses (or tokens) clip and some do not
LEVELS = {"sequence": (0.02, 0.02), "token": (0.2, 0.27)}


def fixed_batch(trainer: Trainer) -> tuple[RolloutBatch, torch.Tensor]:
    """The same rollout batch and advantages in every process (seeded, no sampling)."""
    g = torch.Generator().manual_seed(1234)  # drawn on the CPU, then moved: any device
    device = trainer.policy.device
    n = GROUPS * GROUP_SIZE
    prompts = [trainer.train_prompt_ids[i] for i in range(GROUPS) for _ in range(GROUP_SIZE)]
    prompt_ids, prompt_mask = pad_batch(prompts, trainer.tokenizer.pad_token_id, device)
    lengths = torch.randint(1, LENGTH + 1, (n,), generator=g)
    lengths[[1, 5]] = 0  # two empty responses, both in rank 0's half
    lengths[: n // 2] = torch.where(lengths[: n // 2] > 0, LENGTH, 0)  # rank 0: long ones
    completion_ids = torch.randint(4, 30, (n, LENGTH), generator=g)
    completion_mask = torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)
    batch = RolloutBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        sampler_logprobs=torch.zeros(n, LENGTH, device=device),
        finish_reasons=["stop"] * n,
        group_size=GROUP_SIZE,
    )
    with torch.no_grad():
        exact = trainer.policy.logprobs(batch)
    # pi_old differs from pi_theta by a seeded perturbation, so ratios are not all 1
    noise = 0.05 * torch.randn(n, LENGTH, generator=g)
    batch.sampler_logprobs = torch.where(batch.completion_mask, exact + noise.to(device), 0.0)
    advantages = group_advantages(torch.rand(n, generator=g), GROUP_SIZE).to(device)
    return batch, advantages


@contextlib.contextmanager
def count_layer_runs(model: torch.nn.Module) -> Iterator[list[int]]:
    """``[runs]``: how many times the blocks' MLPs started inside the block, in forward
    and backward: a block under activation checkpointing runs again in backward (a
    pre-hook: that recompute stops once it has what backward needs, inside the MLP)."""
    runs = [0]

    def count(*args) -> None:
        runs[0] += 1

    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    handles = [mlp.register_forward_pre_hook(count) for mlp in mlps]
    try:
        yield runs
    finally:
        for handle in handles:
            handle.remove()


def main(out: Path, extra: list[str]) -> None:
    # cpu: gloo; cuda: NCCL with GPU LOCAL_RANK per rank (as `gspo train` joins)
    dist = setup_distributed(load_config(None, [*CONFIG, *extra]).model.device)
    try:
        for level, (low, high) in LEVELS.items():
            overrides = [
                *CONFIG,
                f"algorithm.level={level}",
                f"algorithm.clip_low={low}",
                f"algorithm.clip_high={high}",
                *extra,
            ]
            trainer = Trainer(load_config(None, overrides), out / f"run-{level}", dist=dist)
            batch, advantages = fixed_batch(trainer)
            share = len(batch) // dist.world_size
            rows = torch.arange(
                dist.rank * share, (dist.rank + 1) * share, device=trainer.policy.device
            )
            mb = batch.select(rows)
            trainer.policy.train()  # as the update stage does
            with count_layer_runs(trainer.model) as layer_runs:
                logprobs = trainer.policy.logprobs(mb)
                old = batch.sampler_logprobs[rows][:, : logprobs.shape[1]]
                share = Minibatch(0, rows, mb, old, advantages[rows], mb.action_mask, None, None)
                loss = trainer.update_stage.objective.loss(share, logprobs)
                metrics = trainer.combine(trainer.policy_update.apply(loss))
            # a LoRA policy: its adapters (the frozen base cannot move)
            weights = full_state_dict(trainer.model, dist, trainable_only=trainer.policy.adapters)
            if dist.is_main:
                backend = torch.distributed.get_backend() if dist.enabled else None
                saved = {
                    "metrics": metrics,
                    "weights": weights,
                    "backend": backend,
                    "layer_runs": layer_runs[0],
                }
                torch.save(saved, out / f"{level}.pt")
            dist.barrier()
    finally:
        teardown_distributed(dist)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
    quick_exit(0)  # as `gspo train` leaves (a failure above exits through its traceback)
