"""Cold start: supervised fine-tuning on ``prompt`` -> ``completion`` rows before RL."""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch

from gspo.config import Config
from gspo.distributed import Distributed
from gspo.rollout import pad_batch
from gspo.tasks import encode_prompt
from gspo.telemetry import MetricsLogger
from gspo.training.metrics import combine
from gspo.training.policy import Policy
from gspo.training.setup import adamw, rank_seed


def cold_start(
    config: Config,
    policy: Policy,
    tokenizer,
    rows: list[dict[str, Any]],
    logger: MetricsLogger,
    dist: Distributed,
    *,
    local_batch: int,
) -> None:
    """``train.cold_start_steps`` SFT steps of ``train.cold_start_batch_size`` rows each
    (``local_batch`` of them on this rank).

    AdamW of its own (``train.cold_start_lr``, cosine decay to 10%), completions end with
    EOS, the loss is the mean token NLL of the completions. Logged at step 0 as ``sft/*``
    every 100 steps.
    """
    cfg = config.train
    if cfg.cold_start_steps == 0 or not rows:
        return
    rng = random.Random(rank_seed(cfg.seed, dist, "sft"))
    optimizer = adamw(policy.forward, lr=cfg.cold_start_lr, betas=(0.9, 0.99))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    encoded = [
        (
            encode_prompt(r["prompt"], tokenizer, **config.data.chat_template_kwargs),
            [*tokenizer(r["completion"], add_special_tokens=False)["input_ids"], eos],
        )
        for r in rows
    ]
    policy.train()
    start = time.perf_counter()
    for i in range(cfg.cold_start_steps):
        # cosine decay to 10% keeps the end of SFT from bouncing around
        lr = cfg.cold_start_lr * (0.55 + 0.45 * math.cos(math.pi * i / cfg.cold_start_steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        picked = [encoded[rng.randrange(len(encoded))] for _ in range(local_batch)]
        prompt_ids, prompt_mask = pad_batch([p for p, _ in picked], pad, policy.device)
        completion_ids, completion_mask = pad_batch(
            [c for _, c in picked], pad, policy.device, side="right"
        )
        with policy.autocast():
            lp = policy.forward(prompt_ids, prompt_mask, completion_ids, completion_mask)
        loss = -lp[completion_mask.bool()].mean()
        policy.backward(loss, completion_mask.sum().item())
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        policy.stepped()
        if (i + 1) % 100 == 0 or i + 1 == cfg.cold_start_steps:
            line = combine(
                dist,
                config.algorithm.level,
                {
                    "sft/step": i + 1,
                    "sft/loss": loss.item(),
                    "sft/tokens": float(completion_mask.sum().item()),
                    "time/sft": time.perf_counter() - start,
                },
            )
            logger.log(0, line)
            if config.log.progress and dist.is_main:
                print(
                    f"cold start {i + 1}/{cfg.cold_start_steps} | "
                    f"sft loss {line['sft/loss']:.4f} | {line['time/sft']:.0f}s",
                    flush=True,
                )
