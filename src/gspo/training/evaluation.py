"""Held-out evaluation: pass@1 over sampled responses, and greedy."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config
from gspo.distributed import Distributed
from gspo.engines import SamplingParams
from gspo.telemetry import read_metrics
from gspo.training.memory import out_of_memory
from gspo.training.metrics import episode_metrics
from gspo.training.rollout import Scorer, reward_means
from gspo.training.sampler import Generator
from gspo.training.seeds import derive_seed


class Evaluator:
    """``evaluator.run(step) -> metrics``: ``eval/accuracy``, ``eval/reward_mean``, lengths.

    Accuracy is the mean success (reward >= ``eval.success_threshold``) over
    ``eval.samples`` samples per prompt, and of one greedy response with ``eval.greedy``.
    The prompts go in chunks, each sampled with a seed of its own; under torchrun the
    ranks share the chunks out and gather the results, so N ranks measure exactly what
    one process would.
    """

    def __init__(
        self,
        config: Config,
        dist: Distributed,
        rows: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        generate: Generator,
        scorer: Scorer,
        sampling: SamplingParams,
    ):
        cfg = config.eval
        self.config = config
        self.dist = dist
        self.rows = rows[: cfg.max_prompts]
        self.prompt_ids = prompt_ids[: cfg.max_prompts]
        self.generator = generate
        self.scorer = scorer
        self.modes = [("", cfg.samples, sampling)]
        if cfg.greedy:
            self.modes.append(
                ("_greedy", 1, replace(sampling, temperature=0.0, top_p=1.0, logit_noise=0.0))
            )
        rollout = config.rollout
        self.chunk = max(1, rollout.prompts_per_batch * rollout.group_size // cfg.samples)

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        rows, ids, chunk = self.rows, self.prompt_ids, self.chunk
        if not rows:
            return {}
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        self.generator.sampler.sync()  # a collective under torchrun: before chunks diverge
        starts = range(0, len(rows), chunk)
        for suffix, n, params in self.modes:
            mine = []
            for c in starts[self.dist.rank :: self.dist.world_size]:
                seed = derive_seed(self.config.train.seed, "eval", step, suffix, c)
                with out_of_memory("evaluation", self.config):
                    generated = self.generator.generate(
                        rows[c : c + chunk], ids[c : c + chunk], n=n, params=params, seed=seed
                    )
                scored = self.scorer.score(rows[c : c + chunk], generated)
                lengths = generated.batch.completion_lengths.float().cpu()
                scorable = scored.scorable
                if scorable is None:
                    scorable = torch.ones_like(scored.rewards, dtype=torch.bool)
                mine.append(
                    (
                        c,
                        scored.rewards,
                        lengths,
                        generated.metrics,
                        scorable.cpu(),
                        scored.per_function,
                    )
                )
            every_rank = self.dist.gather_objects(mine)
            done = sorted((part for parts in every_rank for part in parts), key=lambda p: p[0])
            r = torch.cat([part[1] for part in done])
            lengths = torch.cat([part[2] for part in done])
            # environment metrics: those of all the chunks' episodes together
            together = episode_metrics([(len(part[1]), part[3]) for part in done])
            for key, value in together.items():
                metrics[f"eval/{key.removeprefix('env/')}{suffix}"] = value
            # a completion no reward function scored (each returned None) is no evidence:
            # left out of the accuracy and the mean reward, as it is out of training's
            scorable = torch.cat([part[4] for part in done]).to(r.device)
            threshold, kept = self.config.eval.success_threshold, r[scorable]
            if len(kept):
                metrics[f"eval/accuracy{suffix}"] = (kept >= threshold).float().mean().item()
                metrics[f"eval/reward_mean{suffix}"] = kept.mean().item()
            if not bool(scorable.all()):
                unscored = 1.0 - scorable.float().mean().item()
                metrics[f"eval/unscored_fraction{suffix}"] = unscored
            metrics[f"eval/response_length_mean{suffix}"] = lengths.mean().item()
            # several reward functions: each one's mean (the accuracy counts their weighted
            # sum against eval.success_threshold, which a correctness reward beside a
            # penalty may never reach)
            functions = [part[5] for part in done]
            names = dict.fromkeys(k for f in functions for k in f)  # (by_source's NAME/SOURCE)
            if len(names) > 1:
                every = {
                    k: [v for p in done for v in p[5].get(k, [None] * len(p[1]))] for k in names
                }
                metrics |= reward_means(every, "eval/reward/", suffix)
        metrics["time/eval"] = time.perf_counter() - start
        return metrics


def evaluated_at_start(metrics_file: Path, resumed_at_step_0: bool, dist: Distributed) -> bool:
    """Whether a run resumed from its step-0 checkpoint already logged its starting
    evaluation (it was killed after it), on every rank as rank 0 found."""
    logged = resumed_at_step_0 and dist.is_main and metrics_file.is_file()
    logged = logged and any(
        r["step"] == 0 and any(k.startswith("eval/") for k in r) for r in read_metrics(metrics_file)
    )
    return dist.gather_objects(logged)[0]
