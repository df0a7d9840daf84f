"""The paper's MoE claim at a routing shape closer to the real one (issue 19).

``docs/moe_routing/`` measured 0.3% of the activated experts changing per update on the
built-in MoE (8 experts, top-2), against the paper's ~10% on Qwen3-30B-A3B (128 experts,
top-8, 48 layers). This script asks how that fraction moves with the routing shape:

    python experiments/moe_shape.py churn            # expert change vs shape (docs/moe_shape)
    python experiments/moe_shape.py churn --quick    # a smoke run (its numbers mean nothing)
    python experiments/moe_shape.py claim --experts 128 --top-k 8 --layers 4   # the claim
    python experiments/moe_shape.py claim --quick    # its smoke run

``churn``: for every routing shape (number of experts, top-k, depth) its own cold start by
one recipe (the same SFT steps, learning rate and batch on 2-digit addition), then a few
GRPO rollout batches without Routing Replay at the default learning rate, logging
``moe/expert_change_fraction`` after every optimizer step; and, at one shape, the same RL
from the same cold start (reused from the cold-start cache) at several learning rates.
*After one update* is minibatch 0 of each rollout batch, averaged over the rollout batches.

``claim``: at one shape, on the long-response ``chain`` task, one cold start and then GRPO
and GSPO, each without and with Routing Replay, for every seed, from the same checkpoint
(the paper's minibatching: several optimizer steps per rollout batch); accuracy and reward
curves with seed bands, clip fractions, expert change over training, and a verdict per
claim computed from those numbers (``claim.md``).

Every model has hidden size 64 (2 heads, 1 KV head) and experts 24 wide (Qwen3-30B-A3B's
768 / 2048 ratio), ``norm_topk_prob`` on, no router aux loss, and computes its experts with
``model.experts_implementation=padded``. The runs go to ``--work-dir`` (default
``runs/moe_shape``, not committed); the table, plot and numbers to ``--output-dir``
(default ``docs/moe_shape``; with ``--quick`` ``WORK_DIR/quick/report``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

import torch
from moe_routing import CHURN, mean, train_run

from gspo.experiments import train_lines
from gspo.provenance import code_commit, machine

#: The paper's figure: share of activated experts that change after one update, Qwen3-30B-A3B.
PAPER_CHURN = 0.10


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    layers: int

    @property
    def name(self) -> str:
        return f"E{self.experts}_k{self.top_k}_L{self.layers}"

    def overrides(self) -> list[str]:
        return [
            f"model.experts={self.experts}",
            f"model.experts_per_token={self.top_k}",
            f"model.layers={self.layers}",
        ]


@dataclass(frozen=True)
class ChurnPlan:
    cold_start_steps: int  # SFT steps of every shape's cold start
    rollouts: int  # GRPO rollout batches per point (x algorithm.minibatches optimizer steps)
    seeds: tuple[int, ...]  # RL seeds per point, all from the shape's one cold start (seed 0)
    shapes: tuple[Shape, ...]  # the shape axis points (each its own cold start)
    lr_shape: Shape  # where the learning rate is varied
    lrs: tuple[float, ...]  # RL learning rates at lr_shape (the default 1e-4 is in shapes)


#: The points in the order they run (the most telling first, so that a run stopped early
#: still answers the main question): the real model's routing, the old tiny one, the
#: learning rates at the former, then the rest of the experts and depth axes.
_MAIN = Shape(128, 8, 4)
FULL = ChurnPlan(
    cold_start_steps=600,
    rollouts=3,
    seeds=(0, 1, 2),
    shapes=(
        _MAIN,
        Shape(8, 2, 4),
        Shape(128, 2, 4),
        Shape(32, 8, 4),
        Shape(32, 2, 4),
        Shape(128, 8, 2),
        Shape(128, 8, 8),
        Shape(64, 8, 4),
        Shape(64, 2, 4),
        Shape(128, 8, 16),
    ),
    lr_shape=_MAIN,
    lrs=(1e-5, 1e-3, 1e-2),
)
QUICK = ChurnPlan(
    cold_start_steps=4,
    rollouts=1,
    seeds=(0, 1),
    shapes=(Shape(8, 2, 2), Shape(32, 8, 2)),
    lr_shape=Shape(32, 8, 2),
    lrs=(1e-3,),
)

#: The model every run shares (the routing-shape keys come from :class:`Shape`).
MODEL = [
    "model.builtin=qwen3_moe",
    "model.hidden=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.expert_intermediate=24",
    "model.experts_implementation=padded",
]

#: Every run: no progress bar, plots or TensorBoard, only the checkpoints it must keep.
QUIET = [
    "eval.greedy=false",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
    "train.save_every=0",
    "train.keep_checkpoints=1",
]

#: The model and task every churn point shares.
COMMON = [
    *MODEL,
    *QUIET,
    "train.seed=0",
    "algorithm.level=token",
    "moe.routing_replay=false",
    "eval.max_prompts=1",  # evaluation is not what these runs are for
    "eval.every=0",
    "eval.samples=1",
]
DEFAULT_LR = 1e-4


def summarize(records: list[dict[str, Any]], shape: Shape) -> dict[str, Any]:
    """One RL run's expert change (by updates since the rollout, per rollout batch, per layer)."""
    lines = train_lines(records)
    minibatches = 1 + max((r.get("train/minibatch", 0) for r in lines), default=0)
    by_k = [
        mean([r[CHURN] for r in lines if r.get("train/minibatch") == k and CHURN in r])
        for k in range(minibatches)
    ]
    return {
        "churn_by_updates": by_k,
        "churn_1_per_rollout": [
            r[CHURN] for r in lines if r.get("train/minibatch") == 0 and CHURN in r
        ],
        "churn_1_per_layer": [
            mean([r[f"{CHURN}/layer_{i}"] for r in lines if r.get("train/minibatch") == 0])
            for i in range(shape.layers)
        ],
        "reward": mean([r["train/reward_mean"] for r in lines if r.get("train/minibatch") == 0]),
        "seconds_per_step": mean([r["time/step"] for r in lines if "time/step" in r]),
    }


def combine_seeds(runs: list[dict[str, Any]], shape: Shape, lr: float) -> dict[str, Any]:
    """A point: the seeds' runs averaged element-wise, with the per-seed figure kept."""

    def columns(key: str) -> list[float]:
        return [mean(list(values)) for values in zip(*(r[key] for r in runs), strict=False)]

    firsts = [r["churn_by_updates"][0] if r["churn_by_updates"] else math.nan for r in runs]
    return {
        **asdict(shape),
        "lr": lr,
        "churn_1": mean(firsts),
        "churn_1_seeds": firsts,
        "churn_1_sd": statistics.stdev(firsts) if len(firsts) > 1 else 0.0,
        "churn_by_updates": columns("churn_by_updates"),
        "churn_1_per_rollout": columns("churn_1_per_rollout"),
        "churn_1_per_layer": columns("churn_1_per_layer"),
        "reward": mean([r["reward"] for r in runs]),
        "seconds_per_step": mean([r["seconds_per_step"] for r in runs]),
    }


def run_point(work: Path, plan: ChurnPlan, shape: Shape, lr: float, cache: Path) -> dict[str, Any]:
    """The shape's cold start (seed 0; from the cache after its first point), then RL at
    ``lr`` for every seed from that one checkpoint."""
    cold = work / f"{shape.name}_cold_start"
    start = time.perf_counter()
    records, _ = train_run(
        cold,
        [
            *COMMON,
            *shape.overrides(),
            f"train.cold_start_steps={plan.cold_start_steps}",
            f"train.cold_start_cache_dir={cache}",
            "train.max_steps=0",
        ],
    )
    sft = [r for r in records if "time/sft" in r]
    runs = []
    for seed in plan.seeds:
        name = shape.name + ("" if lr == DEFAULT_LR else f"_lr{lr:g}") + f"_seed{seed}"
        records, _ = train_run(
            work / name,
            [
                *COMMON,
                *shape.overrides(),
                f"model.path={cold / 'checkpoints' / 'step-0000000'}",
                "train.cold_start_steps=0",
                f"train.seed={seed}",
                "data.seed=0",  # the cold start's data: its held-out prompts, not its rows
                f"train.max_steps={plan.rollouts * 4}",
                "algorithm.minibatches=4",
                f"optim.lr={lr}",
            ],
        )
        runs.append(summarize(records, shape))
    out = combine_seeds(runs, shape, lr)
    out["cold_start_seconds"] = sft[-1]["time/sft"] if sft else math.nan
    out["seconds"] = time.perf_counter() - start
    return out


def pct(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.2f}%"


def plot(points: list[dict[str, Any]], plan: ChurnPlan, path: Path, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    at_default = [p for p in points if p["lr"] == DEFAULT_LR]
    ax = axes[0]
    for k in sorted({p["top_k"] for p in at_default}):
        row = sorted(
            (p for p in at_default if p["top_k"] == k and p["layers"] == 4),
            key=lambda p: p["experts"],
        )
        ax.plot([p["experts"] for p in row], [p["churn_1"] for p in row], "o-", label=f"top-{k}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("experts per layer (4 layers)")
    ax.set_title("vs number of experts")
    ax = axes[1]
    row = sorted(
        (
            p
            for p in at_default
            if (p["experts"], p["top_k"]) == (plan.lr_shape.experts, plan.lr_shape.top_k)
        ),
        key=lambda p: p["layers"],
    )
    ax.plot([p["layers"] for p in row], [p["churn_1"] for p in row], "o-", label="all layers")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"layers ({plan.lr_shape.experts} experts, top-{plan.lr_shape.top_k})")
    ax.set_title("vs depth")
    ax = axes[2]
    row = sorted(
        (
            p
            for p in points
            if (p["experts"], p["top_k"], p["layers"])
            == (plan.lr_shape.experts, plan.lr_shape.top_k, plan.lr_shape.layers)
        ),
        key=lambda p: p["lr"],
    )
    ax.plot([p["lr"] for p in row], [p["churn_1"] for p in row], "o-", label="GRPO")
    ax.set_xscale("log")
    s = plan.lr_shape
    ax.set_xlabel(f"RL learning rate ({s.experts} experts, top-{s.top_k}, {s.layers} layers)")
    ax.set_title("vs learning rate")
    for ax in axes:
        ax.axhline(PAPER_CHURN, color="grey", linestyle="--", linewidth=1, label="paper ~10%")
        ax.set_yscale("log")
        ax.set_ylabel("expert change after 1 update")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize="small")
    fig.suptitle(caption, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    out: Path, plan: ChurnPlan, points: list[dict[str, Any]], quick: bool, meta: dict[str, Any]
) -> None:
    rows = [
        "| experts | top-k | layers | RL lr | expert change after 1 update (mean ± sd over "
        "seeds) | per seed | after 2 / 3 / 4 updates | per rollout batch (1 update) | reward "
        "| cold start s | RL s / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        later = " / ".join(pct(v) for v in p["churn_by_updates"][1:])
        each = " / ".join(pct(v) for v in p["churn_1_per_rollout"])
        seeds = " / ".join(pct(v) for v in p["churn_1_seeds"])
        rows.append(
            f"| {p['experts']} | {p['top_k']} | {p['layers']} | {p['lr']:g} | "
            f"**{pct(p['churn_1'])}** ± {pct(p['churn_1_sd'])} | {seeds} | {later} | {each} | "
            f"{p['reward']:.3f} | "
            f"{p['cold_start_seconds']:.0f} | {p['seconds_per_step']:.2f} |"
        )
    layer_rows = ["| shape | per layer, 1 update (first → last) |", "|---|---|"]
    for p in points:
        if p["lr"] == DEFAULT_LR:
            per = " / ".join(pct(v) for v in p["churn_1_per_layer"])
            shape = f"{p['experts']} experts, top-{p['top_k']}, {p['layers']} L"
            layer_rows.append(f"| {shape} | {per} |")
    command = meta["command"]
    missing = meta["missing"]
    status = (
        [
            f"**Partial**: {len(missing)} planned points not run yet (experts/top-k/layers@lr): "
            + ", ".join(missing)
            + ".",
            "",
        ]
        if missing
        else []
    )
    text = [
        "# Expert change vs routing shape",
        "",
        f"Produced by `{command}` on commit {meta['commit']} ({meta['machine']}); "
        f"{meta['minutes']:.1f} min in all"
        + (" (a smoke configuration: its numbers mean nothing)." if quick else "."),
        "",
        *status,
        "Every shape: the built-in Qwen3-MoE (hidden 64, experts 24 wide, `norm_topk_prob` "
        f"on, no router aux loss), its own cold start ({plan.cold_start_steps} SFT steps on "
        "2-digit addition at the default SFT settings, seed 0), then "
        f"{plan.rollouts} GRPO rollout batches (16 prompts x 8 responses, 4 minibatches, "
        f"lr {DEFAULT_LR:g} unless the row says otherwise, no Routing Replay) for each of "
        f"{len(plan.seeds)} RL seeds, all from that one checkpoint. The lr rows start from "
        "the same cold start as their shape's default-lr row.",
        "",
        "*Expert change after 1 update*: `moe/expert_change_fraction` of minibatch 0 (the "
        "share of the response tokens' (token, layer, top-k slot) activations whose expert "
        "is not among those the rollout-time policy chose), averaged over the rollout batches; "
        "*after 2 / 3 / 4 updates* are minibatches 1-3. The paper reports about 10% per "
        "update on Qwen3-30B-A3B (128 experts, top-8, 48 layers). Every figure is the mean "
        "over the seeds; *per seed* lists each seed's figure after 1 update.",
        "",
        *rows,
        "",
        "![expert change vs shape](churn_vs_shape.png)",
        "",
        "## Per layer",
        "",
        *layer_rows,
        "",
        "## Observations",
        "",
        *[f"- {note}" for note in observations(points, plan)],
        "",
    ]
    (out / "churn.md").write_text("\n".join(text))


def observations(points: list[dict[str, Any]], plan: ChurnPlan) -> list[str]:
    """Statements computed from the numbers (nothing they do not show)."""
    notes = []
    top = max(points, key=lambda p: p["churn_1"])
    notes.append(
        f"Highest expert change after one update: {pct(top['churn_1'])} at "
        f"{top['experts']} experts, top-{top['top_k']}, {top['layers']} layers, lr "
        f"{top['lr']:g}; the paper's ~10% is "
        + ("reached." if top["churn_1"] >= PAPER_CHURN else "not reached at any point measured.")
    )
    default = [p for p in points if p["lr"] == DEFAULT_LR]
    best_default = max(default, key=lambda p: p["churn_1"])
    notes.append(
        f"At the default RL lr {DEFAULT_LR:g} the highest is {pct(best_default['churn_1'])} "
        f"({best_default['experts']} experts, top-{best_default['top_k']}, "
        f"{best_default['layers']} layers)."
    )
    for k in sorted({p["top_k"] for p in default}):
        row = sorted(
            (p for p in default if p["top_k"] == k and p["layers"] == 4), key=lambda p: p["experts"]
        )
        if len(row) >= 2:
            listed = ", ".join(f"{p['experts']}: {pct(p['churn_1'])}" for p in row)
            ratio = row[-1]["churn_1"] / row[0]["churn_1"] if row[0]["churn_1"] > 0 else math.inf
            notes.append(
                f"Top-{k}, 4 layers, by number of experts ({listed}): "
                f"{row[-1]['experts']} experts change {ratio:.1f}x as much as {row[0]['experts']}."
            )
    s = plan.lr_shape
    depth = sorted(
        (p for p in default if (p["experts"], p["top_k"]) == (s.experts, s.top_k)),
        key=lambda p: p["layers"],
    )
    if len(depth) >= 2:
        listed = ", ".join(f"{p['layers']} layers: {pct(p['churn_1'])}" for p in depth)
        rising = all(b["churn_1"] > a["churn_1"] for a, b in itertools.pairwise(depth))
        notes.append(
            f"{s.experts} experts, top-{s.top_k}, by depth ({listed}): "
            + ("it rises with every added depth." if rising else "it does not rise monotonically.")
        )
    lrs = sorted(
        (p for p in points if (p["experts"], p["top_k"], p["layers"]) == astuple(s)),
        key=lambda p: p["lr"],
    )
    if len(lrs) >= 2:
        listed = ", ".join(f"lr {p['lr']:g}: {pct(p['churn_1'])}" for p in lrs)
        notes.append(f"{s.experts} experts, top-{s.top_k}, {s.layers} layers, by RL lr ({listed}).")
        crossing = [p for p in lrs if p["churn_1"] >= PAPER_CHURN]
        if crossing:
            notes.append(f"Expert change reaches 10% from lr {crossing[0]['lr']:g} at this shape.")
    stalled = [p for p in points if p["reward"] in (0.0, 1.0)]
    if stalled:
        notes.append(
            "Points whose rollout batches all had reward 0 or 1 (no GRPO signal): "
            + ", ".join(f"{p['experts']}/{p['top_k']}/{p['layers']}@{p['lr']:g}" for p in stalled)
            + " (experts/top-k/layers@lr)"
        )
    return notes


def churn_sweep(args: argparse.Namespace) -> None:
    plan = QUICK if args.quick else FULL
    work = args.work_dir / ("quick" if args.quick else "full")
    out = args.output_dir or (work / "report" if args.quick else Path("docs/moe_shape"))
    out.mkdir(parents=True, exist_ok=True)
    cache = args.cache_dir or work / "cold_start_cache"
    commit = code_commit()
    start = time.perf_counter()
    points = []
    todo = [(shape, DEFAULT_LR) for shape in plan.shapes[:2]]
    todo += [(plan.lr_shape, lr) for lr in plan.lrs]
    todo += [(shape, DEFAULT_LR) for shape in plan.shapes[2:]]
    if args.only:
        todo = todo[: args.only]
    if args.select:
        wanted = args.select.split(",")
        todo = [(s, lr) for s, lr in todo if s.name in wanted and lr == DEFAULT_LR]
    for shape, lr in todo:
        print(f"{shape.name} lr {lr:g}", flush=True)
        points.append(run_point(work, plan, shape, lr, cache))
        p = points[-1]
        print(
            f"  churn after 1 update {pct(p['churn_1'])}, by updates "
            + " / ".join(pct(v) for v in p["churn_by_updates"])
            + f", reward {p['reward']:.3f}, {p['seconds']:.0f} s",
            flush=True,
        )
        # the report after every point: a run stopped early leaves a (partial) report
        minutes = (time.perf_counter() - start) / 60
        missing = [f"{s.experts}/{s.top_k}/{s.layers}@{lr:g}" for s, lr in todo[len(points) :]]
        where = f"{machine()}, {torch.get_num_threads()} torch threads, float32"
        meta = {"commit": commit, "machine": where, "minutes": minutes, "missing": missing}
        command = "python experiments/moe_shape.py churn" + (" --quick" if args.quick else "")
        if args.only:
            command += f" --only {args.only}"
        if args.select:
            command += f" --select {args.select}"
        meta["command"] = command
        plot(points, plan, out / "churn_vs_shape.png", f"{command}  (commit {commit})")
        write_report(out, plan, points, args.quick, meta)
        summary = {"plan": asdict(plan), "points": points, **meta}
        (out / "churn.json").write_text(json.dumps(summary, indent=1, allow_nan=True) + "\n")
    print(f"wrote {out / 'churn.md'} in {minutes:.1f} min", flush=True)


# ----------------------------------------------------------------------------- claim


@dataclass(frozen=True)
class ClaimPlan:
    cold_start_steps: int
    rl_steps: int  # optimizer steps per run
    minibatches: tuple[int, ...]  # optimizer steps per rollout batch, one setting each
    eval_every: int
    eval_prompts: int
    terms: int  # chain task: terms per problem (response length grows with it)
    digits: int  # chain task: digits per term
    max_new_tokens: int
    seeds: tuple[int, ...]


CLAIM_FULL = ClaimPlan(
    cold_start_steps=600,
    rl_steps=64,
    minibatches=(4, 8),  # the paper's minibatching, then a more off-policy one
    eval_every=16,
    eval_prompts=64,
    # 1-digit terms: the 64-wide MoE's 600-step cold start gets 2-digit 8-term chains
    # right 0% of the time (tried), 1-digit 6-term ones about 10% after 300 steps
    terms=6,
    digits=1,
    max_new_tokens=64,
    seeds=(0, 1, 2),
)
CLAIM_QUICK = ClaimPlan(
    cold_start_steps=4,
    rl_steps=4,
    minibatches=(2,),
    eval_every=2,
    eval_prompts=4,
    terms=3,
    digits=1,
    max_new_tokens=48,
    seeds=(0,),
)
CLAIM_VARIANTS: dict[str, list[str]] = {
    "GRPO": ["algorithm.level=token", "moe.routing_replay=false"],
    "GRPO + replay": ["algorithm.level=token", "moe.routing_replay=true"],
    "GSPO": ["algorithm.level=sequence", "moe.routing_replay=false"],
    "GSPO + replay": ["algorithm.level=sequence", "moe.routing_replay=true"],
}


def claim_common(plan: ClaimPlan, shape: Shape) -> list[str]:
    return [
        *MODEL,
        *shape.overrides(),
        "data.task=chain",
        f"data.terms={plan.terms}",
        f"data.digits={plan.digits}",
        "reward.functions=[numeric_match]",
        f"rollout.max_new_tokens={plan.max_new_tokens}",
        f"eval.max_prompts={plan.eval_prompts}",
        f"eval.every={plan.eval_every}",
        "eval.samples=2",
        *QUIET,
    ]


def claim_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    lines = train_lines(records)
    evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    tail = lines[-max(1, len(lines) // 4) :]
    return {
        "accuracy_start": evals[0] if evals else math.nan,
        "accuracy": evals[-1] if evals else math.nan,
        "accuracy_best": max(evals) if evals else math.nan,
        "reward_tail": mean([r["train/reward_mean"] for r in tail]),
        "clip_fraction": mean([r["train/clip_fraction"] for r in lines]),
        "churn_1": mean([r[CHURN] for r in lines if r.get("train/minibatch") == 0 and CHURN in r]),
        "churn": mean([r[CHURN] for r in lines if CHURN in r]),
        "length": mean(
            [r["train/response_length_mean"] for r in lines if "train/response_length_mean" in r]
        ),
        "steps": len(lines),
    }


def claim_verdicts(summary: dict[str, list[dict[str, Any]]], margin: float) -> list[str]:
    """One verdict per claim, from the per-seed numbers."""

    def change(name: str) -> list[float]:
        return [s["accuracy"] - s["accuracy_start"] for s in summary.get(name, [])]

    def describe(name: str) -> str:
        values = change(name)
        listed = ", ".join(f"{v:+.3f}" for v in values)
        return f"{name}: held-out accuracy change per seed {listed}"

    notes = []
    grpo, grpo_r, gspo = change("GRPO"), change("GRPO + replay"), change("GSPO")
    churn = [s["churn_1"] for s in summary.get("GRPO", [])]
    notes.append(
        "Expert change after one update under GRPO without replay: "
        + ", ".join(pct(c) for c in churn)
        + " per seed (the paper: ~10%)."
    )
    if grpo and grpo_r:
        worse = all(g < r - margin for g, r in zip(grpo, grpo_r, strict=False))
        fell = all(g < -margin for g in grpo)
        rose = all(g > margin for g in grpo)
        if worse and fell:
            verdict = "reproduced: GRPO without replay lost accuracy and fell behind GRPO + replay"
        elif rose and not worse:
            verdict = "not reproduced: GRPO without replay improved and did not fall behind replay"
        else:
            verdict = "inconclusive: the seeds do not all agree beyond the margin"
        notes.append(
            f"Claim 'GRPO needs Routing Replay on MoE' ({describe('GRPO')}; "
            f"{describe('GRPO + replay')}; margin {margin}): {verdict}."
        )
    if gspo:
        if all(g > margin for g in gspo):
            verdict = "reproduced: GSPO without replay improved on every seed"
        elif all(g < -margin for g in gspo):
            verdict = "not reproduced: GSPO without replay lost accuracy on every seed"
        else:
            verdict = "inconclusive: the seeds do not all move beyond the margin"
        notes.append(
            f"Claim 'GSPO converges without Routing Replay' ({describe('GSPO')}): {verdict}."
        )
    return notes


def claim(args: argparse.Namespace) -> None:
    plan = CLAIM_QUICK if args.quick else CLAIM_FULL
    if args.seeds:
        plan = ClaimPlan(**{**asdict(plan), "seeds": tuple(args.seeds)})
    if args.minibatches:
        plan = ClaimPlan(**{**asdict(plan), "minibatches": tuple(args.minibatches)})
    shape = Shape(args.experts, args.top_k, args.layers)
    work = args.work_dir / ("claim_quick" if args.quick else "claim") / shape.name
    out = args.output_dir or (work / "report" if args.quick else Path("docs/moe_shape/claim"))
    out.mkdir(parents=True, exist_ok=True)
    commit = code_commit()
    start = time.perf_counter()
    common = [*claim_common(plan, shape), f"optim.lr={args.lr}"]
    print(f"cold start: {plan.cold_start_steps} SFT steps on chain", flush=True)
    records, _ = train_run(
        work / "cold_start",
        [
            *common,
            "train.seed=0",
            f"train.cold_start_steps={plan.cold_start_steps}",
            "train.max_steps=0",
        ],
    )
    # the SFT's own time (a cold start reused from the cache re-logs the original's lines,
    # so this is not the seconds a cache hit took)
    sft = [r for r in records if "time/sft" in r]
    cold_seconds = sft[-1]["time/sft"] if sft else math.nan
    checkpoint = work / "cold_start" / "checkpoints" / "step-0000000"
    # {minibatches: {variant: one entry per finished seed}}
    runs: dict[int, dict[str, list[list[dict[str, Any]]]]] = {
        mb: {name: [] for name in CLAIM_VARIANTS} for mb in plan.minibatches
    }
    summary: dict[int, dict[str, list[dict[str, Any]]]] = {
        mb: {name: [] for name in CLAIM_VARIANTS} for mb in plan.minibatches
    }
    # the paper's minibatching first, all seeds, so that a run stopped early has it whole
    for mb in plan.minibatches:
        for seed in plan.seeds:
            for name, overrides in CLAIM_VARIANTS.items():
                print(
                    f"{name}, {mb} minibatches, seed {seed}: {plan.rl_steps} RL steps", flush=True
                )
                slug = name.replace(" + ", "_").lower()
                records, _ = train_run(
                    work / f"{slug}_mb{mb}_seed{seed}",
                    [
                        *common,
                        f"algorithm.minibatches={mb}",
                        f"train.seed={seed}",
                        "data.seed=0",  # the cold start's data (its held-out prompts)
                        f"model.path={checkpoint}",
                        "train.cold_start_steps=0",
                        f"train.max_steps={plan.rl_steps}",
                        *overrides,
                    ],
                )
                runs[mb][name].append(records)
                summary[mb][name].append(claim_summary(records))
                print(f"  {summary[mb][name][-1]}", flush=True)
                write_claim(out, plan, shape, args, runs, summary, commit, start, cold_seconds)
    print(f"wrote {out / 'claim.md'}", flush=True)


def write_claim(out, plan, shape, args, runs, summary, commit, start, cold_seconds) -> None:
    from gspo.telemetry import plot_bands

    command = (
        f"python experiments/moe_shape.py claim --experts {shape.experts} --top-k {shape.top_k} "
        f"--layers {shape.layers} --lr {args.lr:g}"
        + (f" --seeds {' '.join(map(str, args.seeds))}" if args.seeds else "")
        + (f" --minibatches {' '.join(map(str, args.minibatches))}" if args.minibatches else "")
        + (" --quick" if args.quick else "")
    )
    tag = f" ({command}, commit {commit})"
    expected = len(plan.seeds) * len(CLAIM_VARIANTS) * len(plan.minibatches)
    finished = sum(len(v) for per in summary.values() for v in per.values())
    rows = [
        "| minibatches per rollout batch | variant | seeds | held-out accuracy start → end "
        "(mean ± sd over seeds) | best | reward, last quarter | clip fraction | expert change, "
        "1 update | expert change, all updates | response length |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    sections = []
    for mb, per in summary.items():
        done = {name: r for name, r in runs[mb].items() if r}
        if not done:
            continue
        lines = {name: [train_lines(r) for r in rs] for name, rs in done.items()}
        suffix = f"_mb{mb}"
        at = f", {mb} minibatches" + tag
        plot_bands(
            done, "eval/accuracy", out / f"accuracy{suffix}.png", title="Held-out accuracy" + at
        )
        plot_bands(
            lines, "train/reward_mean", out / f"reward{suffix}.png", title="Training reward" + at
        )
        plot_bands(
            lines,
            "train/clip_fraction",
            out / f"clip_fraction{suffix}.png",
            title="Clip fraction" + at,
        )
        plot_bands(lines, CHURN, out / f"expert_change{suffix}.png", title="Expert change" + at)
        for name, ss in per.items():
            if not ss:
                continue
            m = {k: mean([s[k] for s in ss]) for k in ss[0]}
            ends = [s["accuracy"] for s in ss]
            sd = statistics.stdev(ends) if len(ends) > 1 else 0.0
            rows.append(
                f"| {mb} | {name} | {len(ss)} | {m['accuracy_start']:.3f} → {m['accuracy']:.3f} "
                f"± {sd:.3f} | {m['accuracy_best']:.3f} | {m['reward_tail']:.3f} | "
                f"{m['clip_fraction']:.3f} | {pct(m['churn_1'])} | {pct(m['churn'])} | "
                f"{m['length']:.0f} |"
            )
        sections += [
            f"## {mb} minibatches per rollout batch",
            "",
            f"![accuracy](accuracy{suffix}.png) ![reward](reward{suffix}.png)",
            "",
            f"![clip fraction](clip_fraction{suffix}.png) "
            f"![expert change](expert_change{suffix}.png)",
            "",
            "Verdicts:",
            "",
            *[f"- {n}" for n in claim_verdicts(per, args.margin)],
            "",
        ]
    minutes = (time.perf_counter() - start) / 60
    took = f"{minutes:.1f} min so far" if finished < expected else f"{minutes:.1f} min"
    text = [
        "# GRPO vs GSPO, with and without Routing Replay, at a Qwen3-MoE-like routing shape",
        "",
        f"Produced by `{command}` on commit {commit}; {took}"
        + (" (a smoke configuration: its numbers mean nothing)." if args.quick else "."),
        "",
    ]
    if finished < expected:
        text += [f"**Partial**: {finished} of {expected} runs finished.", ""]
    settings = " and ".join(str(mb) for mb in plan.minibatches)
    text += [
        f"Model: the built-in Qwen3-MoE, {shape.layers} layers, hidden 64, {shape.experts} "
        f"experts (24 wide), top-{shape.top_k}. Task: `chain` with up to {plan.terms} "
        f"{plan.digits}-digit terms "
        f"(responses up to {plan.max_new_tokens} tokens), reward `numeric_match`. One cold "
        f"start ({plan.cold_start_steps} SFT steps, {cold_seconds:.0f} s), then each variant "
        f"and seed {plan.rl_steps} optimizer steps from its checkpoint, with {settings} "
        f"minibatches (optimizer steps) per rollout batch of 16 prompts x 8 responses, lr "
        f"{args.lr:g}, the levels' default clip ranges. Held-out accuracy: pass@1 over 2 "
        f"samples of {plan.eval_prompts} prompts. *Expert change*: "
        "`moe/expert_change_fraction`, the share of the response tokens' activated experts "
        "that the policy being trained no longer picks against the rollout-time policy "
        "(measured with or without replay: replay changes what the loss sees, not what the "
        "router would choose).",
        "",
        *rows,
        "",
        *sections,
    ]
    (out / "claim.md").write_text("\n".join(text))
    payload = {
        "plan": asdict(plan),
        "shape": asdict(shape),
        "lr": args.lr,
        "summary": {str(mb): per for mb, per in summary.items()},
        "commit": commit,
    }
    (out / "claim.json").write_text(json.dumps(payload, indent=1, allow_nan=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what",
        choices=["churn", "claim"],
        help="churn: expert change vs routing shape; claim: GRPO/GSPO +- replay at one shape",
    )
    parser.add_argument("--experts", type=int, default=128, help="claim: experts per layer")
    parser.add_argument("--top-k", type=int, default=8, help="claim: experts per token")
    parser.add_argument("--layers", type=int, default=4, help="claim: depth")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help="claim: RL learning rate")
    parser.add_argument("--seeds", type=int, nargs="+", help="claim: training seeds")
    parser.add_argument(
        "--minibatches", type=int, nargs="+", help="claim: optimizer steps per rollout batch"
    )
    parser.add_argument(
        "--margin", type=float, default=0.05, help="claim: accuracy change that counts"
    )
    parser.add_argument("--output-dir", type=Path, help="report and plots")
    parser.add_argument(
        "--work-dir", type=Path, default=Path("runs/moe_shape"), help="the training runs"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny smoke configuration")
    parser.add_argument("--only", type=int, help="churn: only the first N points (run order)")
    parser.add_argument(
        "--select", help="churn: only these shapes at the default lr, e.g. E128_k8_L2,E128_k8_L8"
    )
    parser.add_argument(
        "--cache-dir", type=Path, help="churn: cold-start cache (default WORK_DIR/cold_start_cache)"
    )
    args = parser.parse_args()
    if args.what == "churn":
        churn_sweep(args)
    else:
        claim(args)


if __name__ == "__main__":
    main()
