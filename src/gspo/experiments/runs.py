"""``gspo compare``: GSPO, GRPO and GSPO-token from one cold start, several seeds, one report.

The runs share everything but ``algorithm.level`` (each level with its paper clip range)
and ``train.seed``: the same config, task, budget and cold-start checkpoint. Layout under
the output directory::

    cold_start/                the shared cold start (its checkpoints/step-0000000)
    runs/<algorithm>-seed<N>/  one ``gspo train`` run each (reused when finished,
                               resumed from its last checkpoint when interrupted)
    report.md, report.html     the report (the HTML embeds the plots)
    plots/*.png, summary.json

The report states a verdict per claim of the paper (reproduced, not reproduced or
inconclusive) with the figure behind it; :func:`verdicts` holds the rules.
"""

from __future__ import annotations

import base64
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gspo.config import Config, load_config
from gspo.gradient_noise import length_buckets
from gspo.telemetry import plot_bands, plot_histograms, read_metrics

#: name -> overrides; the clip ranges are each level's defaults (the paper's).
ALGORITHMS: dict[str, list[str]] = {
    "GSPO": ["algorithm.level=sequence"],
    "GRPO": ["algorithm.level=token"],
    "GSPO-token": ["algorithm.level=sequence_token"],
}

#: Overrides per preset, applied before the user's (which win), cold start included.
#: "stress" is where the paper predicts GRPO trouble: more off-policy minibatches per
#: rollout batch and a 3x larger learning rate. "long" is the paper's other lever: long
#: responses (the chain task, 20-130 tokens against addition's 3-4) and twice the default
#: minibatches, on a smaller model, sized for about half an hour on 2 CPU cores.
PRESETS: dict[str, list[str]] = {
    "default": [],
    "stress": ["algorithm.minibatches=16", "rollout.prompts_per_batch=64"],
    "long": [
        "data.task=chain",
        "data.terms=12",
        "data.label_noise=0.2",
        "reward.functions=[numeric_match]",
        "rollout.max_new_tokens=144",
        "model.layers=2",
        "model.hidden=128",
        "model.heads=4",
        "model.kv_heads=2",
        "model.intermediate=384",
        "train.cold_start_steps=1000",
        "train.max_steps=128",
        "algorithm.minibatches=8",
        # at the default 1e-4 all three degraded in a trial (held-out 0.72 -> 0.53-0.60)
        "optim.lr=2e-5",
        "eval.every=32",
        "eval.max_prompts=96",
        "log.ratio_dump_every=2",
    ],
    # Multi-turn episodes with a tool (docs/environments.md): 5-digit additions that the
    # small model cannot do by itself, and an add tool the cold start calls unreliably;
    # the task brings its own turns, model and schedule (gspo.tasks.TASK_DEFAULTS).
    "tools": ["data.task=calculator", "log.ratio_dump_every=4"],
}

#: Episode metrics reported when the runs have an environment (start -> end of training).
EPISODE_METRICS = {
    "eval/turns_mean": "turns per episode",
    "eval/tool_calls_mean": "tool calls per episode",
    "eval/tool_call_valid_fraction": "valid tool calls",
    "eval/env_token_fraction": "environment-token share",
}
STRESS_LR_FACTOR = 3.0

#: Presets on which claim (c) is judged: the levers the paper says break GRPO.
UNSTABLE_PRESETS = ("stress", "long")

#: Below this mean response length (tokens) claim (b) cannot be told apart from noise:
#: the spread of a mean of L log-ratios is sqrt(L) times smaller, under the 3x the rule
#: asks for.
MIN_MEAN_LENGTH = 9

#: Rollout batches between ratio dumps (``log.ratio_dump_every``) in compared runs.
RATIO_DUMP_EVERY = 5


@dataclass
class Run:
    algorithm: str
    seed: int
    path: Path
    records: list[dict[str, Any]]


def slug(algorithm: str) -> str:
    return algorithm.lower().replace("-", "_")


def train_lines(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in records if "train/loss" in r]


def finished(run_dir: Path, max_steps: int) -> bool:
    """Whether ``run_dir`` holds a run that reached ``max_steps`` (its metrics say so)."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return False
    steps = [r["step"] for r in train_lines(read_metrics(metrics))]
    return bool(steps) and max(steps) >= max_steps


def run_or_reuse(config: Config, run_dir: Path, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Train ``config`` into ``run_dir``; reuse a finished run, resume an interrupted one."""
    from gspo.trainer import Trainer, latest_checkpoint

    if finished(run_dir, config.train.max_steps):
        log(f"  reusing {run_dir}")
        return read_metrics(run_dir / "metrics.jsonl")
    resume = latest_checkpoint(run_dir) is not None and (run_dir / "metrics.jsonl").is_file()
    log(f"  {'resuming' if resume else 'training'} {run_dir}")
    with Trainer(config, run_dir, resume=resume) as trainer:
        return trainer.fit()


def cold_start_checkpoint(
    base: list[str], config_path: Path | None, out: Path, log: Callable[[str], None]
) -> Path:
    """The shared cold start: ``out/cold_start/checkpoints/step-0000000`` (made once)."""
    from gspo.models import model_files
    from gspo.trainer import CHECKPOINTS

    path = out / "cold_start" / CHECKPOINTS / f"step-{0:07d}"
    if (model_files(path) / "config.json").is_file():  # (a step 0 may name its model)
        log(f"cold start: reusing {path}")
        return path
    log("cold start")
    config = load_config(config_path, [*base, "train.max_steps=0"])
    from gspo.trainer import Trainer

    with Trainer(config, out / "cold_start") as trainer:
        trainer.fit()
    return path


def with_preset(preset: str, overrides: Sequence[str]) -> list[str]:
    """The preset's overrides, then the user's (so that the user's win)."""
    return [*PRESETS[preset], *overrides]


def run_configs(
    config_path: Path | None,
    overrides: Sequence[str],
    *,
    checkpoint: Path,
    seeds: Sequence[int],
    preset: str,
    algorithms: Sequence[str] = tuple(ALGORITHMS),
) -> dict[tuple[str, int], Config]:
    """The config of every (algorithm, seed) run."""
    extra = []
    if preset == "stress":
        lr = load_config(config_path, with_preset(preset, overrides)).optim.lr
        extra.append(f"optim.lr={lr * STRESS_LR_FACTOR}")
    configs = {}
    for name in algorithms:
        algo = ALGORITHMS[name]
        for seed in seeds:
            configs[name, seed] = load_config(
                config_path,
                [
                    f"log.ratio_dump_every={RATIO_DUMP_EVERY}",  # a preset may change it
                    *with_preset(preset, overrides),
                    *extra,
                    *algo,
                    f"model.path={checkpoint}",
                    "train.cold_start_steps=0",
                    f"train.seed={seed}",
                    "log.progress=false",
                    "log.plots=false",
                ],
            )
    return configs


def compare(
    config_path: Path | None,
    overrides: Sequence[str],
    out: Path,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    preset: str = "default",
    log: Callable[[str], None] = print,
    algorithms: Sequence[str] = tuple(ALGORITHMS),
) -> dict[str, Any]:
    """Run (or reuse) every run, then write the report; returns the summary."""
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise ValueError(
            f"--algorithms {','.join(algorithms)!r}: expected some of {', '.join(ALGORITHMS)}"
        )
    if not seeds:
        raise ValueError("--seeds: at least one seed")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    base = [*with_preset(preset, overrides), "log.progress=false", "log.plots=false"]
    checkpoint = cold_start_checkpoint(base, config_path, out, log)
    configs = run_configs(
        config_path, overrides, checkpoint=checkpoint, seeds=seeds, preset=preset,
        algorithms=algorithms,
    )  # fmt: skip
    runs = []
    for (name, seed), config in configs.items():
        log(f"{name}, seed {seed}")
        run_dir = out / "runs" / f"{slug(name)}-seed{seed}"
        runs.append(Run(name, seed, run_dir, run_or_reuse(config, run_dir, log)))
    summary = write_report(
        runs,
        out,
        preset=preset,
        seconds=time.perf_counter() - start,
        cold_start_seconds=cold_start_seconds(out / "cold_start"),
        overrides=overrides,
    )
    log(f"report written to {out / 'report.md'} and {out / 'report.html'}")
    return summary


# ---------------------------------------------------------------- numbers from runs
def cold_start_seconds(run_dir: Path) -> float:
    """The cold start's own time, from its metrics: SFT (``time/sft``) plus evaluation."""
    records = read_metrics(run_dir / "metrics.jsonl") if run_dir.is_dir() else []
    sft = max((r["time/sft"] for r in records if "time/sft" in r), default=0.0)
    return sft + sum(r["time/eval"] for r in records if "time/eval" in r)


def with_elapsed(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Records with ``elapsed``: wall seconds since the run's first record."""
    times = [r["time"] for r in records if isinstance(r.get("time"), int | float)]
    t0 = min(times) if times else 0.0
    return [{**r, "elapsed": r.get("time", t0) - t0} for r in records]


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


def load_gradient_cosines(run_dir: Path, last_fraction: float = 0.5) -> list[dict[str, Any]]:
    """The gradient cosines of the run's dumps in the last ``last_fraction`` (those that have
    them): per dump, ``[buckets]`` tensors of :data:`COSINE_KEYS` and the scalar
    ``cosine_full_to_on_policy``."""
    files = sorted((run_dir / "ratios").glob("rollout-*.pt"))
    files = files[int(len(files) * (1 - last_fraction)) :] if files else []
    out = []
    for f in files:
        dump = torch.load(f, weights_only=True)
        if "cosine_to_full" in dump:
            keep = (*COSINE_KEYS, "cosine_full_to_on_policy")
            out.append({k: dump[k] for k in keep})
    return out


def cosines_by_length(dumps: Sequence[Mapping[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Per length bucket (shortest first), each cosine's mean over dumps (NaNs skipped)
    and, as ``<name>_se``, its standard error (sd over dumps / sqrt of their number).

    A dump's buckets are its own rollout batch's length quartiles, so bucket ``b`` is
    pooled by rank; dumps with fewer buckets than the most common count (ties in length)
    are left out.
    """
    counts = [len(d["cosine_to_full"]) for d in dumps]
    if not counts:
        return []
    n = max(set(counts), key=counts.count)
    kept = [d for d in dumps if len(d["cosine_to_full"]) == n]
    rows = []
    for b in range(n):
        row: dict[str, float] = {"bucket": b, "dumps": len(kept)}
        for key in COSINE_KEYS:
            values = [v for v in (d[key][b].item() for d in kept) if math.isfinite(v)]
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


def algorithm_summary(runs: Sequence[Run]) -> dict[str, Any]:
    """Across the seeds of one algorithm: final accuracies, clip fraction, time, spreads."""
    finals = [final_eval(r.records) for r in runs]
    starts = [next((x["eval/accuracy"] for x in r.records if "eval/accuracy" in x), math.nan)
              for r in runs]  # fmt: skip
    clips = [token_weighted(train_lines(r.records), "train/clip_fraction") for r in runs]
    rewards = []
    for r in runs:
        lines = train_lines(r.records)
        tail = lines[len(lines) * 3 // 4 :]
        rewards.append(statistics.fmean(x["train/reward_mean"] for x in tail) if tail else math.nan)
    seconds = [(with_elapsed(r.records)[-1]["elapsed"] if r.records else math.nan) for r in runs]
    cosine_dumps = [d for r in runs for d in load_gradient_cosines(r.path)]
    dumps = [load_ratio_dumps(r.path) for r in runs]
    pooled = {k: torch.cat([d[k] for d in dumps]) for k in dumps[0]} if dumps else {}
    token_lr, seq_lr = pooled.get("token_log_ratio"), pooled.get("sequence_log_ratio")
    acc, acc_sd = mean_std(finals)
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
        "accuracy_start": mean_std(starts)[0],
        "accuracy": acc,
        "accuracy_sd": acc_sd,
        "accuracy_per_seed": finals,
        "accuracy_greedy": mean_std([final_eval(r.records, "eval/accuracy_greedy") for r in runs])[
            0
        ],
        "reward_tail": mean_std(rewards)[0],
        "clip_fraction": mean_std(clips)[0],
        "clip_fraction_per_seed": clips,
        "seconds": mean_std(seconds)[0],
        "mean_response_length": (
            pooled["length"].float().mean().item()
            if pooled and pooled["length"].numel()
            else math.nan
        ),
        "token_log_ratio_sd": _sd(token_lr),
        "sequence_log_ratio_sd": _sd(seq_lr),
        "spread_by_length": spread_by_length(pooled) if pooled else [],
        "gradient_cosines_by_length": cosines_by_length(cosine_dumps),
        "gradient_cosine_full_to_on_policy": mean_std(
            [d["cosine_full_to_on_policy"].item() for d in cosine_dumps]
        )[0],
        "ratio_dumps": {k: v for k, v in pooled.items()},
    }


def _sd(values: torch.Tensor | None) -> float:
    return values.std().item() if values is not None and values.numel() > 1 else math.nan


# ---------------------------------------------------------------- verdicts
REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE = "reproduced", "not reproduced", "inconclusive"


def verdicts(summary: Mapping[str, Mapping[str, Any]], preset: str) -> list[dict[str, str]]:
    """One verdict per claim, each with the figures behind it.

    (a) GSPO clips far more tokens (>= 10x GRPO's fraction; the paper shows ~100x) yet
        trains at least as well (final accuracy not below GRPO's by more than two standard
        errors of the seed mean).
    (b) Token ratios are noisy, sequence ratios tight (the spread of log w_it at least 3x
        that of log s_i on GRPO's own runs), and the token noise grows with response length
        (variance of w_it higher in the longest length bucket than in the shortest). A mean
        of L independent log-ratios has sqrt(L) times less spread, so below
        :data:`MIN_MEAN_LENGTH` tokens (3x) or with the longest bucket under twice the
        shortest, the test cannot tell and the verdict is inconclusive.
    (c) GRPO unstable where GSPO is not: only judged on the presets that pull the paper's
        levers (:data:`UNSTABLE_PRESETS`); a collapse is a final accuracy more than 0.1
        below the start.
    """
    gspo, grpo = summary["GSPO"], summary["GRPO"]
    out = []

    # (a)
    clip_x = gspo["clip_fraction"] / grpo["clip_fraction"] if grpo["clip_fraction"] else math.inf
    n = len(gspo["seeds"])
    noise = 2 * math.hypot(gspo["accuracy_sd"], grpo["accuracy_sd"]) / math.sqrt(max(n, 1))
    gap = gspo["accuracy"] - grpo["accuracy"]
    figures = (
        f"clip fraction GSPO {gspo['clip_fraction']:.4f} vs GRPO {grpo['clip_fraction']:.4f} "
        f"({clip_x:.0f}x); final accuracy GSPO {gspo['accuracy']:.3f} vs GRPO "
        f"{grpo['accuracy']:.3f} (difference {gap:+.3f}, two standard errors {noise:.3f}, "
        f"{n} seeds)"
    )
    if any(math.isnan(v) for v in (clip_x, gap)):
        verdict = INCONCLUSIVE
    elif clip_x >= 10 and gap >= -noise:
        verdict = REPRODUCED
    elif clip_x < 10 or gap < -noise:
        verdict = NOT_REPRODUCED
    else:  # pragma: no cover - the two branches above are exhaustive
        verdict = INCONCLUSIVE
    out.append({"claim": "(a) GSPO clips far more tokens (paper: ~100x), trains as well",
                "verdict": verdict, "figures": figures})  # fmt: skip

    # (b)
    tok_sd, seq_sd = grpo["token_log_ratio_sd"], grpo["sequence_log_ratio_sd"]
    rows, mean_len = grpo["spread_by_length"], grpo.get("mean_response_length", math.nan)
    if math.isnan(tok_sd) or math.isnan(seq_sd) or len(rows) < 2:
        verdict = INCONCLUSIVE
        figures = (
            f"sd of log w_it {tok_sd:.2e}, of log s_i {seq_sd:.2e}; not enough ratio dumps "
            "or response lengths to compare"
        )
    else:
        wide = tok_sd >= 3 * seq_sd
        grows = rows[-1]["token_ratio_var"] > rows[0]["token_ratio_var"]
        testable = mean_len >= MIN_MEAN_LENGTH and rows[-1]["lo"] >= 2 * rows[0]["hi"]
        figures = (
            f"on GRPO's runs sd of log w_it {tok_sd:.2e} vs log s_i {seq_sd:.2e} "
            f"({tok_sd / seq_sd if seq_sd else math.inf:.1f}x); variance of w_it "
            f"{rows[0]['token_ratio_var']:.2e} for lengths {rows[0]['lengths']} vs "
            f"{rows[-1]['token_ratio_var']:.2e} for {rows[-1]['lengths']}; mean response "
            f"length {mean_len:.1f} tokens"
        )
        if not testable:
            verdict = INCONCLUSIVE
            figures += (
                f" (too short or too uniform to test: needs a mean of {MIN_MEAN_LENGTH}+ "
                "tokens and a longest length bucket at least twice the shortest)"
            )
        else:
            verdict = REPRODUCED if wide and grows else NOT_REPRODUCED
    out.append({"claim": "(b) token ratios noisy and length-dependent, sequence ratios tight",
                "verdict": verdict, "figures": figures})  # fmt: skip

    # (c)
    def collapsed(s: Mapping[str, Any]) -> bool:
        return s["accuracy"] < s["accuracy_start"] - 0.1

    if preset not in UNSTABLE_PRESETS:
        verdict = INCONCLUSIVE
        figures = f"not tested: run gspo compare --preset {' or '.join(UNSTABLE_PRESETS)}"
    else:
        figures = (
            f"final accuracy GRPO {grpo['accuracy']:.3f} (start {grpo['accuracy_start']:.3f}), "
            f"GSPO {gspo['accuracy']:.3f} (start {gspo['accuracy_start']:.3f})"
        )
        if collapsed(grpo) and not collapsed(gspo):
            verdict = REPRODUCED
        elif not collapsed(grpo):
            verdict = NOT_REPRODUCED
        else:
            verdict = INCONCLUSIVE  # both collapsed
    out.append({"claim": "(c) under stress (off-policy updates, long responses) GRPO "
                "becomes unstable, GSPO does not",
                "verdict": verdict, "figures": figures})  # fmt: skip
    return out


# ---------------------------------------------------------------- the report
def write_report(
    runs: Sequence[Run],
    out: Path,
    *,
    preset: str = "default",
    seconds: float = math.nan,
    cold_start_seconds: float = math.nan,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """Plots, ``report.md``, ``report.html`` and ``summary.json`` under ``out``."""
    by_algo: dict[str, list[Run]] = {}
    for r in runs:
        by_algo.setdefault(r.algorithm, []).append(r)
    summary = {name: algorithm_summary(rs) for name, rs in by_algo.items()}
    groups = {name: [with_elapsed(r.records) for r in rs] for name, rs in by_algo.items()}
    trains = {name: [train_lines(x) for x in recs] for name, recs in groups.items()}
    plots = out / "plots"
    figures = [
        ("Held-out accuracy vs optimizer steps", plot_bands(
            groups, "eval/accuracy", plots / "accuracy_steps.png", title="Held-out accuracy")),
        ("Held-out accuracy vs wall clock", plot_bands(
            groups, "eval/accuracy", plots / "accuracy_time.png", x="elapsed",
            title="Held-out accuracy")),
        ("Training reward vs optimizer steps", plot_bands(
            trains, "train/reward_mean", plots / "reward_steps.png", title="Training reward")),
        ("Training reward vs wall clock", plot_bands(
            trains, "train/reward_mean", plots / "reward_time.png", x="elapsed",
            title="Training reward")),
        ("Fraction of clipped tokens per rollout batch (the paper's Figure 2)", plot_bands(
            {name: [per_rollout(x, "train/clip_fraction") for x in recs]
             for name, recs in trains.items()},
            "train/clip_fraction", plots / "clip_fraction.png", logy=True,
            title="Clipped fraction of tokens (per rollout batch)")),
        ("Token ratios w_it and sequence ratios s_i, last minibatch of a rollout batch",
         plot_histograms(
             {f"{name}: {kind}": s["ratio_dumps"][key]
              for name, s in summary.items()
              for kind, key in (("w_it", "token_log_ratio"), ("s_i", "sequence_log_ratio"))
              if s["ratio_dumps"] and s["ratio_dumps"][key].numel()},
             plots / "ratios.png", title="log importance ratios (second half of training)")),
        ("Variance of the ratios by response length", plot_bands(
            {f"{name}: {label}": [[{"step": row["length_mid"], "variance": row[key]}
                                   for row in s["spread_by_length"]]]
             for name, s in summary.items()
             for label, key in (("w_it", "token_ratio_var"), ("s_i", "sequence_ratio_var"))},
            "variance", plots / "ratio_variance_by_length.png", logy=True,
            xlabel="response length (bucket middle)",
            title="Variance of importance ratios by response length")),
        ("Gradient noise by response length: cosine between the gradient of half a "
         "length bucket and the full-batch gradient (to_full), and between the two halves "
         "(halves); last minibatch's weights", plot_bands(
            cosine_lines(summary, "to_full", "halves"), "cosine",
            plots / "gradient_cosine_by_length.png", xlabel="response length (bucket mean)",
            title="cos(half-bucket gradient, full-batch gradient / other half)")),
        ("How far the importance ratios turn the gradient: cosine between a half bucket's "
         "gradient with the run's ratios and with ratios 1", plot_bands(
            cosine_lines(summary, "to_on_policy"), "cosine",
            plots / "gradient_ratio_turn_by_length.png",
            xlabel="response length (bucket mean)",
            title="cos(gradient with ratios, gradient with ratios 1)")),
    ]  # fmt: skip
    claims = verdicts(summary, preset)
    for s in summary.values():
        s.pop("ratio_dumps")
    result = {
        "preset": preset,
        "overrides": list(overrides),
        "seconds": seconds,
        "cold_start_seconds": cold_start_seconds,
        "run_seconds": sum(with_elapsed(r.records)[-1]["elapsed"] for r in runs if r.records),
        "algorithms": summary,
        "verdicts": claims,
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
    md = report_markdown(result, [(t, p) for t, p in figures if p is not None], out, runs)
    (out / "report.md").write_text(md)
    (out / "report.html").write_text(report_html(md, out))
    return result


def cosine_lines(summary: Mapping[str, Mapping[str, Any]], *keys: str) -> dict[str, Any]:
    """``plot_bands`` groups: per algorithm and key, one line against the bucket length."""
    return {
        f"{name}: {key}" if len(keys) > 1 else name: [
            [{"step": row["length_mean"], "cosine": row[key]}
             for row in s["gradient_cosines_by_length"]]]
        for name, s in summary.items() if s["gradient_cosines_by_length"]
        for key in keys
    }  # fmt: skip


def report_markdown(
    result: Mapping[str, Any],
    figures: list[tuple[str, Path]],
    out: Path,
    runs: Sequence[Run] = (),
) -> str:
    summary = result["algorithms"]
    seeds = next(iter(summary.values()))["seeds"] if summary else []
    lines = [
        "# " + " vs ".join(summary),
        "",
        f"Produced by `gspo compare` (preset `{result['preset']}`"
        + "".join(f", override `{o}`" for o in result.get("overrides", []))
        + ", seeds "
        f"{', '.join(map(str, seeds))}). Time: the shared cold start "
        f"{result['cold_start_seconds'] / 60:.1f} min, the {len(result['algorithms']) * len(seeds)}"
        f" runs {result['run_seconds'] / 60:.1f} min together (first to last record of "
        f"each); this invocation {result['seconds'] / 60:.1f} min (reused runs cost nothing). "
        "Every run "
        "starts from the same cold-start checkpoint with the same config but "
        "`algorithm.level` (and its paper clip range) and `train.seed`. Figures are means "
        "over seeds (± one standard deviation in the plots' bands).",
        "",
        "## Verdicts",
        "",
        "| claim | verdict | figures |",
        "|---|---|---|",
        *[f"| {c['claim']} | **{c['verdict']}** | {c['figures']} |" for c in result["verdicts"]],
        "",
        "## Final numbers",
        "",
        "| algorithm | held-out accuracy (start -> end, ± sd over seeds) | greedy (end) "
        "| reward, last quarter | clipped tokens | sd log w_it | sd log s_i | run time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['accuracy_start']:.3f} -> {s['accuracy']:.3f} ± "
            f"{s['accuracy_sd']:.3f} | {s['accuracy_greedy']:.3f} | {s['reward_tail']:.3f} | "
            f"{s['clip_fraction']:.4f} | {s['token_log_ratio_sd']:.2e} | "
            f"{s['sequence_log_ratio_sd']:.2e} | {s['seconds']:.0f} |"
        )
    lines += ["", *[f"- {note}" for note in notes(summary, runs)]]
    if any(s.get("episodes") for s in summary.values()):
        lines += [
            "",
            "## Episodes",
            "",
            "Held-out episodes (sampled), at the first and the last evaluation, means over seeds.",
            "",
            "| algorithm | " + " | ".join(EPISODE_METRICS.values()) + " |",
            "|---|" + "---|" * len(EPISODE_METRICS),
        ]
        for name, s in summary.items():
            cells = [
                f"{s['episodes'][k][0]:.3f} -> {s['episodes'][k][1]:.3f}"
                if k in s.get("episodes", {})
                else "-"
                for k in EPISODE_METRICS
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "## Ratio variance by response length", ""]
    lines += ["| algorithm | lengths | responses | var w_it | var s_i |", "|---|---|---|---|---|"]
    for name, s in summary.items():
        for row in s["spread_by_length"]:
            lines.append(
                f"| {name} | {row['lengths']} | {row['responses']} | "
                f"{row['token_ratio_var']:.2e} | {row['sequence_ratio_var']:.2e} |"
            )
    if any(s["gradient_cosines_by_length"] for s in summary.values()):
        lines += [
            "",
            "## Gradient noise by response length",
            "",
            "On every dumped rollout batch, at the weights its last (most off-policy) "
            "minibatch sees, the batch is cut into four length buckets (its quartiles) and "
            "each bucket into two random halves; the gradient of the policy loss over each "
            "half is compared with the full-batch gradient (*to full*), with the other "
            "half (*halves*), and with the same half's gradient under ratios 1 (*to ratio "
            "1*: how far the importance ratios and the clipping turn it). Means over the "
            "dumps of the second half of training, all seeds, ± their standard error. 1 is "
            "perfect agreement. "
            "*Halves* is the noise measure proper (two independent samples of the same "
            "lengths); *to full* also rises with the bucket's weight in the full-batch "
            "gradient (a bucket whose gradient is larger pulls the full one toward it).",
            "",
            "| algorithm | bucket | mean length | to full | halves | to ratio 1 | dumps |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in summary.items():
            for row in s["gradient_cosines_by_length"]:
                lines.append(
                    f"| {name} | {row['bucket'] + 1} | {row['length_mean']:.0f} | "
                    f"{row['to_full']:.3f} ± {row['to_full_se']:.3f} | "
                    f"{row['halves']:.3f} ± {row['halves_se']:.3f} | "
                    f"{row['to_on_policy']:.3f} ± {row['to_on_policy_se']:.3f} | {row['dumps']} |"
                )
        lines += [""] + [
            f"- {name}: whole-batch gradient with ratios vs with ratios 1, cosine "
            f"{s['gradient_cosine_full_to_on_policy']:.3f}."
            for name, s in summary.items()
            if s["gradient_cosines_by_length"]
        ]
        lines += [f"- {note}" for note in gradient_noise_notes(summary)]
    lines += ["", "## Plots", ""]
    for title, path in figures:
        lines += [f"### {title}", "", f"![{title}]({path.relative_to(out).as_posix()})", ""]
    return "\n".join(lines)


def first_divergence(a: Sequence[Mapping[str, Any]], b: Sequence[Mapping[str, Any]],
                     key: str = "train/objective", tol: float = 1e-4) -> float | None:  # fmt: skip
    """The first step at which two runs' ``key`` differ by more than ``tol`` (or None)."""
    by_step = {r["step"]: r[key] for r in train_lines(b) if key in r}
    for r in train_lines(a):
        other = by_step.get(r["step"])
        if other is not None and key in r and abs(r[key] - other) > tol:
            return r["step"]
    return None


def gradient_noise_notes(summary: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """GRPO against GSPO on the gradient cosines, shortest vs longest length bucket.

    A change with length counts as different between the two when the difference of
    their changes exceeds two standard errors (from the spread over dumps).
    """
    rows = {n: summary[n]["gradient_cosines_by_length"] for n in ("GRPO", "GSPO") if n in summary}
    if len(rows) < 2 or any(len(r) < 2 for r in rows.values()):
        return []

    def trend(name: str, key: str) -> tuple[float, float, str]:
        first, last = rows[name][0], rows[name][-1]
        se = math.hypot(first[f"{key}_se"], last[f"{key}_se"])
        text = (
            f"{name} {first[key]:.2f} ± {first[f'{key}_se']:.2f} -> {last[key]:.2f} ± "
            f"{last[f'{key}_se']:.2f}"
        )
        return last[key] - first[key], se, text

    lengths = (
        f"lengths {rows['GRPO'][0]['length_mean']:.0f} -> {rows['GRPO'][-1]['length_mean']:.0f}"
    )
    out = []
    for key, what in (
        ("halves", "Agreement between the two halves of a length bucket (the noise measure)"),
        ("to_full", "Agreement of a half-bucket gradient with the full-batch gradient"),
        ("to_on_policy", "Cosine of a half-bucket gradient to its ratio-1 gradient"),
    ):
        grpo_change, grpo_se, grpo_text = trend("GRPO", key)
        gspo_change, gspo_se, gspo_text = trend("GSPO", key)
        diff, two_se = grpo_change - gspo_change, 2 * math.hypot(grpo_se, gspo_se)
        if diff < -two_se:
            finding = "it falls more with length for GRPO than for GSPO"
        elif diff > two_se:
            finding = "it rises more with length for GRPO than for GSPO (or falls less)"
        else:
            finding = "the two change alike with length, within two standard errors"
        out.append(
            f"{what}, shortest -> longest bucket ({lengths}; mean ± standard error): "
            f"{grpo_text}; {gspo_text}. GRPO's change minus GSPO's {diff:+.2f} (two "
            f"standard errors {two_se:.2f}): {finding}."
        )
    out.append(
        "The ratio-1 cosine measures how far the ratios turn the gradient: for GSPO it "
        "includes whole responses dropped by its clipping, for GRPO the per-token weights."
    )
    return out


def notes(summary: Mapping[str, Mapping[str, Any]], runs: Sequence[Run] = ()) -> list[str]:
    """Statements computed from the numbers, beside the verdicts."""
    out = []
    gspo, token = summary.get("GSPO"), summary.get("GSPO-token")
    if gspo and token:
        same = all(
            math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
            for key in ("accuracy_per_seed", "clip_fraction_per_seed")
            for a, b in zip(gspo[key], token[key], strict=True)
        )
        if same:
            out.append(
                "GSPO-token matched GSPO exactly on every seed (accuracy and clip fraction): "
                "with one advantage per response the two objectives and gradients are the "
                "same (docs/algorithm.md), so this checks the implementation, it is not a "
                "second result."
            )
        else:
            by = {(r.algorithm, r.seed): r.records for r in runs}
            steps = [
                first_divergence(by[("GSPO", seed)], by[("GSPO-token", seed)])
                for seed in gspo["seeds"]
                if ("GSPO", seed) in by and ("GSPO-token", seed) in by
            ]
            where = ", ".join("never" if s is None else f"step {s:g}" for s in steps)
            out.append(
                "GSPO-token differed from GSPO (final accuracy "
                f"{token['accuracy']:.3f} vs {gspo['accuracy']:.3f}). With one advantage per "
                "response the two have the same objective and gradient in exact arithmetic; "
                "their float rounding differs (the order of sums), and a chaotic run can grow "
                "that into different trajectories. First step where their objectives differ "
                f"by more than 1e-4, per seed: {where}; a late first step means rounding "
                "drift, a difference at step 1 would be a bug."
            )
    return out


def report_html(markdown: str, out: Path) -> str:
    """A self-contained HTML page of the report: tables as tables, plots embedded."""
    import html

    body, table = [], []

    def flush_table() -> None:
        if not table:
            return
        rows = [r.strip("|").split(" | ") for r in table if not set(r) <= set("|-: ")]
        head, *rest = rows
        body.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in head) + "</tr>")
        for r in rest:
            cells = "".join(
                f"<td>{html.escape(c).replace('**', '')}</td>" for c in (x.strip() for x in r)
            )
            body.append(f"<tr>{cells}</tr>")
        body.append("</table>")
        table.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("!["):
            alt, src = line[2:].split("](", 1)
            data = base64.b64encode((out / src.rstrip(")")).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">')
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line:
            body.append(f"<p>{html.escape(line)}</p>")
    flush_table()
    style = "body{font-family:sans-serif;max-width:980px;margin:auto}td,th{border:1px solid #ccc;padding:4px}table{border-collapse:collapse}img{max-width:100%}"  # noqa: E501
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>gspo compare</title>"
        f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n"
    )
