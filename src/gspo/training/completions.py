"""``log.completions_every``: what a rollout batch sampled, as text, to read.

Every Nth rollout batch, one JSON line per response in ``completions/rollout-NNNNNN.jsonl``:
the prompt (an episode's first messages, the environment's ``reset`` text included; the
row's ``answer``, when it has one), the completion (text, or an episode's messages), the
reward, each reward function's value, the advantage, its length in tokens (an episode's:
the model's and the environment's; ``model_tokens`` the model's alone) and why it ended
(``stop``, ``length``). TRL's ``log_completions``, verl's
``rollout_data_dir``: the quickest way to see what a reward function or an environment
makes of the model's output. Under torchrun the ranks' shares are gathered and rank 0
writes the whole batch, in the order of its groups.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config
from gspo.distributed import Distributed
from gspo.publish import write_atomic
from gspo.rewards.functions import metric_labels, split_names
from gspo.training.rollout import Scored

#: The directory in the run's output directory.
COMPLETIONS = "completions"


class CompletionLog:
    """``log.write(index, rows, scored, advantages)`` after a batch's advantages: writes
    every ``every``-th rollout batch (index 0 included), nothing otherwise."""

    def __init__(self, every: int, output_dir: Path, dist: Distributed):
        self.every, self.dir, self.dist = every, Path(output_dir) / COMPLETIONS, dist

    @classmethod
    def of_run(cls, config: Config, output_dir: Path, dist: Distributed) -> CompletionLog | None:
        every = config.log.completions_every
        return cls(every, output_dir, dist) if every > 0 else None

    def write(
        self, index: int, rows: list[dict[str, Any]], scored: Scored, advantages: torch.Tensor
    ) -> None:
        if index % self.every:
            return
        group = scored.batch.group_size
        lengths = scored.batch.completion_lengths.tolist()
        reasons, values = scored.batch.finish_reasons, advantages.tolist()
        # an episode's: what its model saw first (reset's text too), the tokens it sampled
        prompts, sampled = scored.prompts, scored.batch.action_mask.sum(-1).tolist()
        labels = metric_labels(list(scored.per_function))  # (as train/reward/NAME names them)
        functions = scored.per_function
        split = split_names(list(functions))
        mine = []
        for i, completion in enumerate(scored.completions):
            row = rows[i // group]
            line = {"group": i // group, "prompt": row["prompt"] if prompts is None else prompts[i]}
            if "answer" in row:
                line["answer"] = row["answer"]
            line |= {
                "completion": completion,
                "reward": float(scored.rewards[i]),
                "rewards": {  # (by_source's NAME/SOURCE: the row's own source only)
                    labels[name]: v[i]
                    for name, v in functions.items()
                    if v[i] is not None or name not in split
                },
                "advantage": values[i],
                "tokens": int(lengths[i]),
                **({} if prompts is None else {"model_tokens": int(sampled[i])}),
                "finish": reasons[i],
            }
            mine.append(line)
        every_rank = self.dist.gather_objects(mine)  # (a collective: every rank is here)
        if not self.dist.is_main:
            return
        lines, groups = [], 0
        for part in every_rank:  # (group numbers over the whole batch)
            lines += [{**line, "group": line["group"] + groups} for line in part]
            groups += len({line["group"] for line in part})
        self.dir.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(line, default=str) + "\n" for line in lines)
        # (a resumed run writes the same batch's again, whole)
        write_atomic(self.dir / f"rollout-{index:06d}.jsonl", text)
