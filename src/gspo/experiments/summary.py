"""Numbers from finished ``gspo compare`` runs: their records, ratio dumps and gradient
cosines, reduced to one summary per algorithm (means and spreads over seeds)."""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.gradient_noise import length_buckets
from gspo.telemetry import read_metrics
from gspo.telemetry.records import _is_number
from gspo.telemetry.summary import CHURN, churn_updates

#: Episode metrics reported when the runs have an environment (start -> end of training).
EPISODE_METRICS = {
    "eval/turns_mean": "turns per episode",
    "eval/tool_calls_mean": "tool calls per episode",
    "eval/tool_call_valid_fraction": "valid tool calls",
    "eval/env_token_fraction": "environment-token share",
}


@dataclass
class Run:
    algorithm: str
    seed: int
    path: Path
    records: list[dict[str, Any]]

    @functools.cached_property
    def collapse(self) -> dict[str, Any] | None:
        """How the run stopped on ``train.max_skipped`` (:func:`collapse`), or None."""
        return collapse(self.path)


#: Beside a compared run that ``train.max_skipped`` stopped: its step and the error line.
COLLAPSED = "collapsed.json"


def collapse(run_dir: Path) -> dict[str, Any] | None:
    """``{"step": ..., "reason": ...}`` where ``train.max_skipped`` stopped the run in
    ``run_dir`` (non-finite updates in a row: its compare went on without it), else None."""
    path = run_dir / COLLAPSED
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text())
    except ValueError:  # (cut short, edited by hand: still a collapsed run)
        found = {}
    return {"step": found.get("step"), "reason": str(found.get("reason") or "unknown")}


def record_collapse(run_dir: Path, step: int | None, reason: str) -> None:
    (run_dir / COLLAPSED).write_text(json.dumps({"step": step, "reason": reason}) + "\n")


def ended(run: Run) -> float:
    """The run's final held-out accuracy; none (NaN) for a collapsed run, which never
    reached the end (its last evaluation was before the collapse)."""
    return math.nan if run.collapse else final_eval(run.records)


def _finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def train_lines(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if "train/loss" in r]


def cold_start_seconds(run_dir: Path) -> float:
    """The cold start's own time, from its metrics: SFT (``time/sft``) plus evaluation."""
    records = read_metrics(run_dir / "metrics.jsonl") if run_dir.is_dir() else []
    sft = max((r["time/sft"] for r in records if "time/sft" in r), default=0.0)
    return sft + sum(r["time/eval"] for r in records if "time/eval" in r)


#: In a compare's cold-start directory: the cache entry its cold start was taken from.
CACHED_FROM = "cached_from.txt"


def cold_start_cached(run_dir: Path) -> str | None:
    """The cache entry the cold start in ``run_dir`` was taken from (its ``time/sft`` is
    then the run's that trained it: ``CACHED_FROM``, written by the compare that ran it),
    or None where it trained here."""
    path = run_dir / CACHED_FROM
    return path.read_text() if path.is_file() else None


#: The seconds a record accounts for: its training step, its evaluation, its checkpoint.
RUN_SECONDS = ("time/step", "time/eval", "time/checkpoint")


def with_elapsed(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records with ``elapsed``: the run's own seconds up to each one, its steps,
    evaluations and checkpoint waits added up (:data:`RUN_SECONDS`). Wall time since the
    first record counted the time between a kill and its resume as the run's."""
    total, out = 0.0, []
    for r in records:
        total += sum(float(r.get(key) or 0.0) for key in RUN_SECONDS)
        out.append({**r, "elapsed": total})
    return out


def token_weighted(lines: Sequence[Mapping[str, Any]], key: str) -> float:
    """Mean of ``key`` over training lines, weighted by their token counts."""
    pairs = [(r[key], r["train/tokens"]) for r in lines if r.get(key) is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else math.nan


def per_rollout(lines: Sequence[Mapping[str, Any]], key: str) -> list[dict[str, float]]:
    """``key`` per rollout batch: token-weighted over its minibatches, at its last step.

    The first minibatch of a rollout batch is on-policy and clips nothing, so per-step
    clip fractions saw-tooth; the paper's figure is per step of a whole batch.
    """
    groups: dict[Any, list[Mapping[str, Any]]] = {}
    for r in lines:
        groups.setdefault(r.get("train/rollout"), []).append(r)
    return [
        {"step": max(r["step"] for r in rs), key: token_weighted(rs, key)}
        for _, rs in sorted(groups.items(), key=lambda kv: min(r["step"] for r in kv[1]))
    ]


def final_eval(records: Sequence[Mapping[str, Any]], key: str = "eval/accuracy") -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    return values[-1] if values else math.nan


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0


def load_ratio_dumps(run_dir: Path, last_fraction: float = 0.5) -> dict[str, torch.Tensor]:
    """Token and sequence log-ratios of the run's dumps in the last ``last_fraction``.

    A dump (``ratios/rollout-*.pt``, see ``log.ratio_dump_every``) holds the last
    minibatch of a rollout batch: ``token_log_ratio`` (counted tokens, flat),
    ``token_length`` (each token's response length), ``sequence_log_ratio`` and
    ``length`` per response. Empty tensors when the run has no dumps.
    """
    files = sorted((run_dir / "ratios").glob("rollout-*.pt"))
    files = files[int(len(files) * (1 - last_fraction)) :] if files else []
    keys = ("token_log_ratio", "token_length", "sequence_log_ratio", "length")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
    for f in files:
        dump = torch.load(f, weights_only=True)
        for k in keys:
            parts[k].append(dump[k].float())
    return {k: torch.cat(v) if v else torch.zeros(0) for k, v in parts.items()}


#: Per-bucket gradient cosines in a dump (see :func:`gspo.training.hooks.gradient_cosines`).
COSINE_KEYS = ("cosine_to_full", "cosine_halves", "cosine_to_on_policy", "cosine_length_mean")


def load_gradient_cosines(
    run_dir: Path, last_fraction: float = 0.5
) -> tuple[list[dict[str, Any]], set[str]]:
    """The gradient cosines of the run's dumps in the last ``last_fraction`` (those that have
    them): per dump, ``[buckets]`` tensors of :data:`COSINE_KEYS` and the scalar
    ``cosine_full_to_on_policy``; and why those dumps' others hold none (their
    ``gradient_noise_skipped``: :func:`gspo.training.hooks.gradient_noise_skipped`)."""
    files = sorted((run_dir / "ratios").glob("rollout-*.pt"))
    files = files[int(len(files) * (1 - last_fraction)) :] if files else []
    out, skipped = [], set()
    for f in files:
        dump = torch.load(f, weights_only=True)
        if "cosine_to_full" in dump:
            keep = (*COSINE_KEYS, "cosine_full_to_on_policy")
            out.append({k: dump[k] for k in keep})
        elif "gradient_noise_skipped" in dump:
            skipped.add(dump["gradient_noise_skipped"])
    return out, skipped


def cosines_by_length(dumps: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Per length bucket (shortest first), each cosine's mean over dumps (NaNs skipped)
    and, as ``<name>_se``, its standard error (sd over dumps / sqrt of their number).

    A dump's buckets are its own rollout batch's length quartiles, so bucket ``b`` is
    pooled by rank; dumps with another count of buckets than the most common (fewer: ties
    in length) are left out; of two counts as common, the larger is kept (the same
    choice whatever the order of the dumps). ``dumps`` and ``length_mean`` are of the
    dumps that measured the bucket (some cosine computed; none did: every dump's length).
    """
    counts = [len(d["cosine_to_full"]) for d in dumps]
    if not counts:
        return []
    n = max(set(counts), key=lambda c: (counts.count(c), c))
    kept = [d for d in dumps if len(d["cosine_to_full"]) == n]
    rows = []
    for b in range(n):
        # a dump whose bucket no cosine was computed for (a zero gradient: every advantage
        # 0) measured nothing: the row counted it and averaged its length in
        measured = [d for d in kept if any(math.isfinite(d[k][b].item()) for k in COSINE_KEYS[:3])]
        row: dict[str, float] = {"bucket": b, "dumps": len(measured)}
        for key in COSINE_KEYS:
            of = measured or kept  # (none measured: the bucket's length all the same)
            values = [v for v in (d[key][b].item() for d in of) if math.isfinite(v)]
            mean, sd = mean_std(values)
            name = key.removeprefix("cosine_")
            row[name] = mean
            row[f"{name}_se"] = sd / math.sqrt(len(values)) if len(values) > 1 else math.nan
        rows.append(row)
    return rows


def spread_by_length(dumps: Mapping[str, torch.Tensor]) -> list[dict[str, float]]:
    """Per length bucket: the variance of token ratios w_it and of sequence ratios s_i."""
    rows = []
    for lo, hi in length_buckets(dumps["length"]):
        seq = (dumps["length"] >= lo) & (dumps["length"] <= hi)
        tok = (dumps["token_length"] >= lo) & (dumps["token_length"] <= hi)
        if seq.sum() < 2 or tok.sum() < 2:
            continue
        rows.append(
            {
                "lengths": f"{lo}-{hi}" if hi > lo else str(lo),
                "lo": lo,
                "hi": hi,
                "length_mid": (lo + hi) / 2,
                "token_ratio_var": dumps["token_log_ratio"][tok].exp().var().item(),
                "sequence_ratio_var": dumps["sequence_log_ratio"][seq].exp().var().item(),
                "responses": int(seq.sum()),
            }
        )
    return rows


def _churn_after(records: Sequence[Mapping[str, Any]], *, first: bool) -> float:
    """Mean :data:`CHURN` over a run's rollout batches after one update (minibatch 0,
    ``first``) or after all of a batch's updates (its last minibatch); NaN without any."""
    lines = [x for x in train_lines(records) if _finite(x.get(CHURN))]
    updates = 1 if first else max((churn_updates(x) for x in lines), default=1)
    values = [x[CHURN] for x in lines if churn_updates(x) == updates]
    return statistics.fmean(values) if values else math.nan


def algorithm_summary(runs: Sequence[Run]) -> dict[str, Any]:
    """Across the seeds of one algorithm: final accuracies, clip fraction, time, spreads."""
    finals = [ended(r) for r in runs]
    starts = [next((x["eval/accuracy"] for x in r.records if "eval/accuracy" in x), math.nan)
              for r in runs]  # fmt: skip
    clips = [token_weighted(train_lines(r.records), "train/clip_fraction") for r in runs]
    rewards = []
    for r in runs:
        lines = train_lines(r.records)
        tail = [
            x["train/reward_mean"] for x in lines[len(lines) * 3 // 4 :] if "train/reward_mean" in x
        ]
        rewards.append(statistics.fmean(tail) if tail else math.nan)
    seconds = [(with_elapsed(r.records)[-1]["elapsed"] if r.records else math.nan) for r in runs]
    # an MoE model's routing changed by one update (minibatch 0: the paper's expert churn)
    # and by all of a rollout batch's (its last minibatch): each line is the change since
    # the rollout, k + 1 updates on minibatch k, so a mean over every line is neither
    churn = [_churn_after(r.records, first=True) for r in runs]
    churn_all = [_churn_after(r.records, first=False) for r in runs]
    cosines = [load_gradient_cosines(r.path) for r in runs]
    cosine_dumps = [d for dumps, _ in cosines for d in dumps]
    dumps = [load_ratio_dumps(r.path) for r in runs]
    pooled = {k: torch.cat([d[k] for d in dumps]) for k in dumps[0]} if dumps else {}
    token_lr, seq_lr = pooled.get("token_log_ratio"), pooled.get("sequence_log_ratio")
    acc, acc_sd = mean_std(finals)
    if sum(math.isfinite(a) for a in finals) < 2:  # (one value has no spread: "± 0.000")
        acc_sd = math.nan
    episodes = {}
    for key in EPISODE_METRICS:
        evals = [[x[key] for x in r.records if key in x] for r in runs]
        if all(evals):
            episodes[key] = (
                mean_std([e[0] for e in evals])[0],
                mean_std([e[-1] for e in evals])[0],
            )
    return {
        "episodes": episodes,
        "seeds": [r.seed for r in runs],
        "collapsed": [{"seed": r.seed, **r.collapse} for r in runs if r.collapse],
        "accuracy_start": mean_std(starts)[0],
        "accuracy": acc,
        "accuracy_sd": acc_sd,
        "accuracy_per_seed": finals,
        "accuracy_greedy": mean_std(
            [final_eval(r.records, "eval/accuracy_greedy") for r in runs if not r.collapse]
        )[0],
        "reward_tail": mean_std(rewards)[0],
        "clip_fraction": mean_std(clips)[0],
        "clip_fraction_per_seed": clips,
        "seconds": mean_std(seconds)[0],
        "expert_change": mean_std(churn)[0],
        "expert_change_all": mean_std(churn_all)[0],
        "mean_response_length": (
            pooled["length"].float().mean().item()
            if pooled and pooled["length"].numel()
            else math.nan
        ),
        "token_log_ratio_sd": _sd(token_lr),
        "sequence_log_ratio_sd": _sd(seq_lr),
        "spread_by_length": spread_by_length(pooled) if pooled else [],
        "gradient_cosines_by_length": cosines_by_length(cosine_dumps),
        "gradient_noise_skipped": sorted(set().union(*(why for _, why in cosines))),
        "gradient_cosine_full_to_on_policy": mean_std(
            [d["cosine_full_to_on_policy"].item() for d in cosine_dumps]
        )[0],
        "ratio_dumps": {k: v for k, v in pooled.items()},
    }


def _sd(values: torch.Tensor | None) -> float:
    return values.std().item() if values is not None and values.numel() > 1 else math.nan
