"""Dynamic sampling (DAPO): groups whose rewards are all equal are replaced by fresh ones.

A group whose responses all got the same reward has zero advantage everywhere and
teaches nothing (so does one with fewer than two scored responses:
:func:`constant_groups`). With ``rollout.filter_groups=true`` such groups are dropped and more
prompts are sampled, in extra rounds of ``rollout.prompts_per_batch`` prompts (this
rank's share), until the rollout batch is full of informative groups again or
``rollout.filter_max_rounds`` extra rounds are spent. If the cap is hit the batch is
topped up with dropped groups (they add nothing to the gradient) so that every rollout
batch keeps its size and its number of optimizer steps.

Every extra round's prompts and sampling seed are pure functions of ``(train.seed,
rollout batch, round)``, so a resumed run samples exactly what an uninterrupted one did.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gspo.engines import RolloutBatch
from gspo.objectives import group_advantages
from gspo.training.seeds import derive_seed


def constant_groups(
    rewards: torch.Tensor, group_size: int, scorable: torch.Tensor | None = None
) -> torch.Tensor:
    """``[groups]`` bool: the groups that teach nothing, by the advantages' own test
    (:func:`gspo.objectives.group_advantages` gives them exactly 0): rewards all equal,
    a spread of rounding noise only, fewer than two completions a reward function scored
    (``scorable``), or the scored ones all equal."""
    advantages = group_advantages(rewards, group_size, scale="none", scorable=scorable)
    return (advantages.view(-1, group_size) == 0).all(dim=1)


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    """One batch of the rows of ``batches`` (prompts left-padded, completions right-padded)."""
    p = max(b.prompt_ids.shape[1] for b in batches)
    t = max(b.completion_ids.shape[1] for b in batches)

    def left(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (p - x.shape[1], 0))

    def right(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, t - x.shape[1]))

    return RolloutBatch(
        prompt_ids=torch.cat([left(b.prompt_ids) for b in batches]),
        prompt_mask=torch.cat([left(b.prompt_mask) for b in batches]),
        completion_ids=torch.cat([right(b.completion_ids) for b in batches]),
        completion_mask=torch.cat([right(b.completion_mask) for b in batches]),
        sampler_logprobs=torch.cat([right(b.sampler_logprobs) for b in batches]),
        finish_reasons=[r for b in batches for r in b.finish_reasons],
        group_size=batches[0].group_size,
        action_mask=torch.cat([right(b.action_mask) for b in batches]),
    )


@dataclass
class Filtered:
    """The groups kept (indices into the rounds' groups, in order) and what it took."""

    groups: list[int]
    dropped: int
    rounds: int


def extra_prompts(seed: int, index: int, round_: int, rows: int, count: int) -> list[int]:
    """Prompt rows of extra round ``round_`` of rollout batch ``index`` (seeded draw)."""
    rng = random.Random(derive_seed(seed, "filter_groups", index, round_))
    return [rng.randrange(rows) for _ in range(count)]


def fill_with_informative_groups(
    first: torch.Tensor,
    wanted: int,
    max_rounds: int,
    sample_round: Callable[[int], torch.Tensor],
) -> Filtered:
    """Which groups make the rollout batch: informative ones first, in sampling order.

    ``first`` is round 0's :func:`constant_groups`; ``sample_round(r)`` samples extra
    round ``r`` (1-based) and returns its own. Rounds stop once ``wanted`` informative
    groups are in hand or after ``max_rounds`` extra rounds; groups are numbered across
    rounds in order. If too few are informative, constant groups fill the rest.
    """
    constant = [first]
    rounds = 0
    while int(sum((~c).sum() for c in constant)) < wanted and rounds < max_rounds:
        rounds += 1
        constant.append(sample_round(rounds))
    flags = torch.cat(constant).tolist()
    informative = [g for g, c in enumerate(flags) if not c]
    kept = informative[:wanted]
    if len(kept) < wanted:  # the cap was hit: top up with the first constant groups
        kept += [g for g, c in enumerate(flags) if c][: wanted - len(kept)]
        kept.sort()
    dropped = sum(flags) - sum(flags[g] for g in kept)
    return Filtered(kept, int(dropped), rounds)
