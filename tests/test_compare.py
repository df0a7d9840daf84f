"""`gspo compare`: the numbers it plots, its verdict rules, and the report on tiny runs."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CPU

from gspo.cli import main
from gspo.config import load_config
from gspo.experiments import compare, run_configs
from gspo.experiments.claims import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    first_divergence,
    gradient_noise_notes,
    notes,
    verdicts,
)
from gspo.experiments.summary import (
    Run,
    cosines_by_length,
    length_buckets,
    per_rollout,
    spread_by_length,
    token_weighted,
    with_elapsed,
)
from gspo.objectives import DEFAULT_CLIP
from gspo.telemetry import band_lines, plot_histograms
from gspo.trainer import Trainer
from gspo.training.setup import load_task_data

TINY = [
    CPU,  # the CPU and float32 (conftest)
    "model.layers=1",
    "model.hidden=32",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=64",
    "data.sft_size=64",
    "data.eval_size=8",
    "train.cold_start_steps=4",
    "train.cold_start_batch_size=8",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=2",
    "rollout.max_new_tokens=4",
    "algorithm.minibatches=2",
    "train.max_steps=4",
    "eval.samples=2",
    "eval.every=2",
    "log.tensorboard=false",
]


@pytest.fixture
def tiny(varied_reward):
    """TINY plus a reward that is never flat, so that advantages are not all zero."""
    return [*TINY, varied_reward]


def test_band_lines_average_the_runs_at_shared_steps():
    runs = [
        [{"step": 0, "acc": 0.2, "elapsed": 0.0}, {"step": 2, "acc": 0.6, "elapsed": 10.0}],
        [{"step": 0, "acc": 0.4, "elapsed": 0.0}, {"step": 2, "acc": 1.0, "elapsed": 14.0}],
        [{"step": 0, "acc": 0.3, "elapsed": 0.0}],  # lacks step 2: only step 0 is shared
    ]
    ((name, xs, means, sds),) = band_lines({"GSPO": runs[:2]}, "acc")
    assert name == "GSPO" and xs == [0.0, 2.0]
    assert means == pytest.approx([0.3, 0.8])
    assert sds == pytest.approx([0.1 * math.sqrt(2), 0.2 * math.sqrt(2)])  # sample sds
    ((_, xs, _, _),) = band_lines({"GSPO": runs[:2]}, "acc", x="elapsed")
    assert xs == [0.0, 12.0]  # the runs' mean elapsed seconds at each step
    ((_, xs, means, _),) = band_lines({"x": runs}, "acc")
    assert xs == [0.0] and means == pytest.approx([0.3])
    ((_, _, _, sds),) = band_lines({"one": runs[:1]}, "acc")
    assert sds is None  # one run: no band
    assert band_lines({"GSPO": runs}, "missing") == []
    # NaN values (gradient cosines none could compute) are no points: no line at all
    nan = [[{"step": 0, "acc": math.nan, "elapsed": 0.0}, {"step": 2, "acc": 0.5, "elapsed": 1.0}]]
    ((_, xs, means, _),) = band_lines({"x": nan}, "acc")
    assert xs == [2.0] and means == [0.5]
    assert band_lines({"x": [nan[0][:1]]}, "acc") == []


def test_the_plots_band_is_the_tables_sd_over_seeds(tmp_path):
    """The report's table gives the final accuracy ± its sample sd over seeds, the plot's
    band drew the population sd around the same mean: 0.71x as wide from 2 seeds."""
    from gspo.experiments.summary import algorithm_summary

    finals = [0.5, 0.7, 0.9]
    runs = [
        Run("GSPO", seed, tmp_path / str(seed),
            [{"step": 0, "eval/accuracy": 0.4}, {"step": 8, "eval/accuracy": acc}])
        for seed, acc in enumerate(finals)
    ]  # fmt: skip
    table = algorithm_summary(runs)
    ((_, xs, means, band),) = band_lines({"GSPO": [r.records for r in runs]}, "eval/accuracy")
    assert xs == [0.0, 8.0] and means[-1] == pytest.approx(table["accuracy"])
    assert band[-1] == pytest.approx(table["accuracy_sd"]) == pytest.approx(0.2)


def test_elapsed_and_token_weighted_means():
    # the run's own seconds: a day between a kill and its resume is not the run's
    recs = with_elapsed([
        {"step": 0, "time": 100.0, "time/eval": 1.0},
        {"step": 1, "time": 103.5, "time/step": 2.5},
        {"step": 2, "time": 86_503.5, "time/step": 2.0, "time/checkpoint": 0.5},
    ])  # fmt: skip
    assert [r["elapsed"] for r in recs] == [1.0, 3.5, 6.0]
    lines = [
        {"train/clip_fraction": 0.5, "train/tokens": 30},
        {"train/clip_fraction": 0.0, "train/tokens": 10},
    ]
    assert token_weighted(lines, "train/clip_fraction") == pytest.approx(15 / 40)


def test_clip_fraction_per_rollout_batch_is_token_weighted():
    lines = [
        {"step": 1, "train/rollout": 0, "train/clip_fraction": 0.0, "train/tokens": 10},
        {"step": 2, "train/rollout": 0, "train/clip_fraction": 0.5, "train/tokens": 30},
        {"step": 3, "train/rollout": 1, "train/clip_fraction": 0.2, "train/tokens": 5},
    ]
    assert per_rollout(lines, "train/clip_fraction") == [
        {"step": 2, "train/clip_fraction": pytest.approx(15 / 40)},
        {"step": 3, "train/clip_fraction": pytest.approx(0.2)},
    ]


def test_gspo_token_divergence_note_names_the_first_differing_step(tmp_path):
    def lines(values):
        return [{"step": i + 1, "train/loss": 0.0, "train/objective": v}
                for i, v in enumerate(values)]  # fmt: skip

    a, b = lines([0.1, 0.2, 0.3, 0.4]), lines([0.1, 0.20001, 0.35, 0.5])
    assert first_divergence(a, b) == 3  # 1e-5 at step 2 is within tolerance
    assert first_divergence(a, a) is None
    algo = {"seeds": [0], "accuracy": 0.9, "accuracy_per_seed": [0.9],
            "clip_fraction_per_seed": [0.3]}  # fmt: skip
    same = notes({"GSPO": algo, "GSPO-token": dict(algo)})
    assert same[0].startswith("GSPO-token matched GSPO exactly")
    other = {**algo, "accuracy": 0.8, "accuracy_per_seed": [0.8]}
    runs = [Run("GSPO", 0, tmp_path, a), Run("GSPO-token", 0, tmp_path, b)]
    (note,) = notes({"GSPO": algo, "GSPO-token": other}, runs)
    assert "differed" in note and "per seed: step 3" in note


def test_length_buckets_and_ratio_variance_of_a_known_batch():
    # two responses of length 1 and two of length 3; log ratios chosen by hand
    token = torch.tensor([0.1, -0.1, 0.2, -0.2, 0.0, 0.3, -0.3, 0.0])
    token_length = torch.tensor([1, 1, 3, 3, 3, 3, 3, 3])
    seq = torch.tensor([0.1, -0.1, 0.0, 0.0])
    length = torch.tensor([1, 1, 3, 3])
    assert length_buckets(length, buckets=2) == [(1, 1), (2, 3)]
    assert length_buckets(torch.tensor([4, 4, 4])) == [(4, 4)]
    rows = spread_by_length(
        {
            "token_log_ratio": token,
            "token_length": token_length,
            "sequence_log_ratio": seq,
            "length": length,
        }
    )
    assert [r["lengths"] for r in rows] == ["1", "2-3"]
    assert [r["responses"] for r in rows] == [2, 2]
    short_w = torch.tensor([0.1, -0.1]).exp()
    long_w = torch.tensor([0.2, -0.2, 0.0, 0.3, -0.3, 0.0]).exp()
    assert rows[0]["token_ratio_var"] == pytest.approx(short_w.var().item())
    assert rows[1]["token_ratio_var"] == pytest.approx(long_w.var().item())
    assert rows[1]["sequence_ratio_var"] == pytest.approx(0.0)
    assert rows[0]["sequence_ratio_var"] == pytest.approx(short_w.var().item())


def test_gradient_cosines_pool_buckets_by_rank():
    def dump(to_full, length_mean):
        n = len(to_full)
        return {"cosine_to_full": torch.tensor(to_full), "cosine_halves": torch.zeros(n),
                "cosine_to_on_policy": torch.ones(n),
                "cosine_length_mean": torch.tensor(length_mean)}  # fmt: skip

    dumps = [
        dump([0.8, 0.4], [20.0, 100.0]),
        dump([0.6, float("nan")], [30.0, 110.0]),  # a NaN (zero gradient) is skipped
        dump([0.1, 0.1, 0.1], [5.0, 6.0, 7.0]),  # a different bucket count: left out
    ]
    rows = cosines_by_length(dumps)
    assert [r["bucket"] for r in rows] == [0, 1] and rows[0]["dumps"] == 2
    assert rows[0]["to_full"] == pytest.approx(0.7) and rows[1]["to_full"] == pytest.approx(0.4)
    assert rows[0]["to_full_se"] == pytest.approx(0.1)  # sd 0.1414 over 2 dumps / sqrt(2)
    assert math.isnan(rows[1]["to_full_se"])  # one finite value: no spread
    assert rows[1]["length_mean"] == pytest.approx(105.0)
    assert rows[0]["to_on_policy"] == 1.0 and cosines_by_length([]) == []
    # as many dumps with 3 buckets as with 2: the 3 kept, in either order
    tie = [*dumps, dump([0.2, 0.2, 0.2], [5.0, 6.0, 7.0])]
    assert len(cosines_by_length(tie)) == len(cosines_by_length(tie[::-1])) == 3


def test_a_dump_whose_gradient_was_zero_is_not_counted_in_the_gradient_noise_table():
    """A rollout batch of flat rewards (every advantage 0) has no gradient: its cosines
    are NaN. The table's row still counted it ("dumps 2" beside a mean of one dump with no
    standard error) and averaged its lengths into the bucket's mean length."""
    nan = float("nan")

    def dump(cosine, length_mean):
        return {"cosine_to_full": torch.tensor([cosine]), "cosine_halves": torch.tensor([cosine]),
                "cosine_to_on_policy": torch.tensor([cosine]),
                "cosine_length_mean": torch.tensor([length_mean])}  # fmt: skip

    (row,) = cosines_by_length([dump(nan, 3.75), dump(0.84, 3.1875)])
    assert row["dumps"] == 1 and row["to_full"] == pytest.approx(0.84)
    assert row["length_mean"] == pytest.approx(3.1875)
    (row,) = cosines_by_length([dump(nan, 3.75), dump(nan, 3.25)])  # none measured
    assert row["dumps"] == 0 and math.isnan(row["to_full"])
    assert row["length_mean"] == pytest.approx(3.5)


def test_gradient_noise_notes_compare_the_length_trend():
    def algo(short, long, se=0.02):
        def row(value, length):
            return {"halves": value, "halves_se": se, "to_full": 0.5, "to_full_se": se,
                    "to_on_policy": 0.9, "to_on_policy_se": se, "length_mean": length}  # fmt: skip

        return {"gradient_cosines_by_length": [row(short, 30.0), row(long, 95.0)]}

    halves, to_full, turn, _ = gradient_noise_notes(
        {"GRPO": algo(0.6, 0.3), "GSPO": algo(0.6, 0.5)}
    )
    assert "GRPO 0.60 ± 0.02 -> 0.30 ± 0.02; GSPO 0.60 ± 0.02 -> 0.50 ± 0.02" in halves
    assert (
        "(lengths 30 -> 95" in halves and "minus GSPO's -0.20 (two standard errors 0.08)" in halves
    )
    assert "falls more with length for GRPO than for GSPO" in halves
    assert "change alike" in to_full and "change alike" in turn
    # the same drop with noisy estimates (standard error 0.1 each): not told apart
    (noisy, *_) = gradient_noise_notes(
        {"GRPO": algo(0.6, 0.3, se=0.1), "GSPO": algo(0.6, 0.5, se=0.1)}
    )
    assert "change alike with length, within two standard errors" in noisy
    # a bucket of one dump has no standard error (NaN): "alike" was said of any difference
    (one, *_) = gradient_noise_notes(
        {"GRPO": algo(0.95, 0.05, se=math.nan), "GSPO": algo(0.95, 0.95)}
    )
    assert "cannot tell: a bucket has too few dumps" in one and "alike" not in one
    assert "nan" not in one and "GRPO 0.95 -> 0.05; GSPO 0.95 ± " in one  # (it said nan ± nan)
    (missing, *_) = gradient_noise_notes(  # no halves in a bucket (the table's n/a)
        {"GRPO": algo(math.nan, 0.05), "GSPO": algo(0.95, 0.95)}
    )
    assert "GRPO n/a -> 0.05 ± " in missing and "nan" not in missing
    (rises, *_) = gradient_noise_notes({"GRPO": algo(0.3, 0.6), "GSPO": algo(0.6, 0.5)})
    assert "rises more with length for GRPO" in rises
    assert gradient_noise_notes({"GRPO": algo(0.6, 0.5)}) == []


def test_presets_come_before_the_users_overrides():
    configs = run_configs(None, ["model.hidden=64"], checkpoint=Path("ckpt"), seeds=[0],
                          preset="long")  # fmt: skip
    config = configs["GRPO", 0]
    assert config.data.task == "chain" and config.reward.functions == ["numeric_match"]
    assert config.model.hidden == 64  # the user's override wins over the preset's 128
    assert config.algorithm.level == "token" and config.log.ratio_dump_every > 0
    # the long preset's completions fit its token budget (EOS included), and their lengths
    # spread enough for claim (b): longest quartile at least twice the shortest
    completions = [len(r["completion"]) + 1 for r in load_task_data(config).sft]
    assert max(completions) <= config.rollout.max_new_tokens
    buckets = length_buckets(torch.tensor(completions))
    assert buckets[-1][0] >= 2 * buckets[0][1]
    stress = run_configs(None, ["optim.lr=1e-3"], checkpoint=Path("c"), seeds=[0],
                         preset="stress")  # fmt: skip
    assert stress["GSPO", 0].optim.lr == pytest.approx(3e-3)
    assert stress["GSPO", 0].algorithm.minibatches == 16
    # ratios dumped every 5 rollout batches, or often enough that the second half of a
    # short run has dumps (an 8-step run's only one was batch 0's, before any update)
    every = {
        steps: run_configs(None, [f"train.max_steps={steps}"], checkpoint=Path("c"),
                           seeds=[0], preset="default")["GSPO", 0].log.ratio_dump_every
        for steps in (8, 12, 40, 44, 200)
    }  # fmt: skip
    assert every == {8: 1, 12: 1, 40: 2, 44: 5, 200: 5}
    assert stress["GSPO", 0].log.ratio_dump_every == 5  # (13 rollout batches)


def test_every_seeds_runs_are_evaluated_on_the_cold_starts_held_out_prompts():
    """A built-in task's split was drawn from each run's train.seed: seed 1's held-out
    prompts differed from seed 0's, and many of them were rows the shared cold start (made
    at seed 0) had trained on."""
    configs = run_configs(None, [], checkpoint=Path("c"), seeds=[0, 1], preset="default")
    cold = load_task_data(load_config(None, []))  # the cold start's: seed 0

    def prompts(rows):
        return [str(r["prompt"]) for r in rows]

    for (_, seed), config in configs.items():
        assert config.train.seed == seed and config.data.seed == 0
        data = load_task_data(config)
        assert prompts(data.eval) == prompts(cold.eval)
        assert not set(prompts(data.eval)) & set(prompts(cold.sft))
    # without it a seed draws its own split, which overlaps seed 0's training rows
    own = load_task_data(load_config(None, ["train.seed=1"]))
    assert set(prompts(own.eval)) & set(prompts(cold.sft))
    given = run_configs(None, ["data.seed=7"], checkpoint=Path("c"), seeds=[1], preset="default")
    assert given["GSPO", 1].data.seed == 7  # the user's, which the cold start used too


def summary(clip_gspo, clip_grpo, acc_gspo, acc_grpo, *, start=0.5, tok=0.1, seq=0.001,
            spread=((1e-3, "5-9"), (5e-3, "20-40")), sd=0.01, length=20.0):  # fmt: skip
    rows = [
        {
            "token_ratio_var": v,
            "lengths": b,
            "lo": int(b.split("-")[0]),
            "hi": int(b.split("-")[-1]),
        }
        for v, b in spread
    ]

    def algo(clip, acc):
        return {
            "seeds": [0, 1, 2],
            "clip_fraction": clip,
            "accuracy": acc,
            "accuracy_sd": sd,
            "accuracy_start": start,
            "token_log_ratio_sd": tok,
            "sequence_log_ratio_sd": seq,
            "spread_by_length": rows,
            "mean_response_length": length,
        }

    return {"GSPO": algo(clip_gspo, acc_gspo), "GRPO": algo(clip_grpo, acc_grpo)}


def test_verdict_rules():
    a, b, c = verdicts(summary(0.15, 0.0013, 0.90, 0.90), "default")
    assert a["verdict"] == REPRODUCED and "115x" in a["figures"]
    assert b["verdict"] == REPRODUCED
    assert c["verdict"] == INCONCLUSIVE and "--preset stress" in c["figures"]
    # GSPO clips only 2x more: (a) not reproduced; GSPO far worse: not reproduced either
    assert verdicts(summary(0.02, 0.01, 0.9, 0.9), "default")[0]["verdict"] == NOT_REPRODUCED
    assert verdicts(summary(0.15, 0.001, 0.5, 0.9), "default")[0]["verdict"] == NOT_REPRODUCED
    # token noise that does not grow with length, or no spread data
    flat = summary(0.15, 0.001, 0.9, 0.9, spread=((5e-3, "5-9"), (1e-3, "20-40")))
    assert verdicts(flat, "default")[1]["verdict"] == NOT_REPRODUCED
    tight_tokens = summary(0.15, 0.001, 0.9, 0.9, tok=0.002)  # w_it only 2x wider than s_i
    assert verdicts(tight_tokens, "default")[1]["verdict"] == NOT_REPRODUCED
    # too short (the demo's 3-5 tokens) or too uniform in length to test
    short = summary(0.15, 0.001, 0.9, 0.9, length=4.0, spread=((1e-3, "3"), (5e-3, "4-5")))
    assert verdicts(short, "default")[1]["verdict"] == INCONCLUSIVE
    uniform = summary(0.15, 0.001, 0.9, 0.9, spread=((1e-3, "18-20"), (5e-3, "21-30")))
    assert verdicts(uniform, "default")[1]["verdict"] == INCONCLUSIVE
    none = summary(0.15, 0.001, 0.9, 0.9, tok=math.nan, spread=())
    assert verdicts(none, "default")[1]["verdict"] == INCONCLUSIVE
    # stress: GRPO collapses (more than 0.1 under its start) while GSPO does not
    stress = summary(0.15, 0.001, 0.9, 0.2, start=0.5)
    assert verdicts(stress, "stress")[2]["verdict"] == REPRODUCED
    assert verdicts(summary(0.15, 0.001, 0.9, 0.9), "stress")[2]["verdict"] == NOT_REPRODUCED
    assert verdicts(stress, "long")[2]["verdict"] == REPRODUCED  # long responses: judged too
    # neither level clipped anything (a run too short to move): no evidence, not
    # "reproduced" with "infx" as before; GRPO alone clipping none: far more
    idle = verdicts(summary(0.0, 0.0, 0.0, 0.0), "default")[0]
    assert idle["verdict"] == INCONCLUSIVE and "(neither clipped)" in idle["figures"]
    alone = verdicts(summary(0.1, 0.0, 0.9, 0.9), "default")[0]
    assert alone["verdict"] == REPRODUCED and "(GRPO clipped none)" in alone["figures"]
    # both at 0.000 -> 0.000 on every seed: "trains as well" of runs that learned nothing
    # (reproduced before: a gap of 0 within an error bar of 0)
    flat = verdicts(summary(0.15, 0.001, 0.0, 0.0, start=0.0, sd=0.0), "default")[0]
    assert (
        flat["verdict"] == INCONCLUSIVE and "two standard errors (train longer)" in flat["figures"]
    )
    # one held-out answer in 256 down on both (0.008 -> 0.004, an end's two standard errors
    # 0.008 over 2 seeds): "reproduced" before; a fall beyond its noise still counts
    down = summary(0.0136, 0.0005, 0.0039, 0.0039, start=0.0078, sd=0.0055)
    for algo in down.values():
        algo["seeds"] = [0, 1]
    assert verdicts(down, "default")[0]["verdict"] == INCONCLUSIVE
    fell = summary(0.33, 0.0035, 0.644, 0.593, start=0.746, sd=0.045)  # compare_long_lr1e-4
    assert verdicts(fell, "default")[0]["verdict"] == REPRODUCED
    top = verdicts(summary(0.15, 0.001, 1.0, 1.0, start=1.0, sd=0.0), "default")[0]
    assert "(a harder task: both start at the ceiling)" in top["figures"]


def test_verdicts_on_runs_that_cannot_show_the_claim_are_inconclusive():
    """One seed (no error bar: one held-out answer decided (a)), a policy that never moved
    (flat rewards: (b) judged on 1e-14 variances, (c) on 0.000 -> 0.000), no held-out
    accuracy or a start under 0.1 ((c) 'not reproduced' before anything ran)."""
    one = summary(0.15, 0.001, 0.44, 0.50)
    for algo in one.values():
        algo["seeds"] = [0]
    a = verdicts(one, "default")[0]
    assert a["verdict"] == INCONCLUSIVE and "one seed" in a["figures"]
    assert "1 seed)" in a["figures"]  # ("1 seeds" before)
    assert verdicts(summary(0.02, 0.01, 0.9, 0.9), "default")[0]["verdict"] == NOT_REPRODUCED
    still = verdicts(summary(0.0, 0.0, 0.0, 0.0, tok=3e-7, seq=1e-7), "stress")
    assert [v["verdict"] for v in still] == [INCONCLUSIVE] * 3
    assert "did not move" in still[1]["figures"] and "did not move" in still[2]["figures"]
    blind = verdicts(summary(0.15, 0.001, math.nan, math.nan, start=math.nan), "stress")[2]
    assert blind["verdict"] == INCONCLUSIVE and "no held-out accuracy" in blind["figures"]
    low = verdicts(summary(0.15, 0.001, 0.02, 0.0, start=0.05), "stress")[2]
    assert low["verdict"] == INCONCLUSIVE and "start under 0.1" in low["figures"]
    # no ratio dumps (nothing known about the spread): (c) still judged
    undumped = summary(0.15, 0.001, 0.9, 0.2, start=0.5, tok=math.nan, spread=())
    assert verdicts(undumped, "stress")[2]["verdict"] == REPRODUCED


def test_figures_not_computed_are_null_in_summary_json():
    """A figure that could not be computed was written as a bare NaN (not JSON)."""
    import numpy as np

    from gspo.experiments.report import _finite

    value = {"a": [1.0, math.nan, np.float32("nan"), 3], "b": {"c": math.inf, "d": np.float32(2)}}
    assert _finite(value) == {"a": [1.0, None, None, 3], "b": {"c": None, "d": 2.0}}


def test_report_cells_never_print_nan():
    from gspo.experiments.report import pm

    assert pm(0.5, 0.01) == "0.500 ± 0.010"
    assert pm(0.5, math.nan) == "0.500"  # one seed, one dump: no error to give
    assert pm(math.nan, math.nan) == "n/a"  # before: nan ± nan
    from gspo.experiments.report import cell

    assert (cell(0.12345, ".4f"), cell(math.nan), cell(math.inf, ".2e")) == ("0.1235", "n/a", "n/a")
    from gspo.experiments.report import spread

    assert math.isnan(spread({"accuracy_sd": 0.0, "seeds": [0]}))  # one seed: "± 0.000" before
    assert spread({"accuracy_sd": 0.1, "seeds": [0, 1]}) == 0.1


def test_trainer_dumps_the_ratios_its_loss_saw(tmp_path, tiny):
    config = load_config(None, [*tiny, "log.plots=false", "log.progress=false",
                                "log.ratio_dump_every=1"])  # fmt: skip
    records = Trainer(config, tmp_path / "run").fit()
    dumps = sorted((tmp_path / "run" / "ratios").glob("rollout-*.pt"))
    assert [d.name for d in dumps] == ["rollout-000000.pt", "rollout-000001.pt"]
    # with each response's advantage, the dump alone gives its minibatch's clip test
    low, high = DEFAULT_CLIP[config.algorithm.level]
    for index, path in enumerate(dumps):
        dump = torch.load(path, weights_only=True)
        s, a = dump["sequence_log_ratio"].exp(), dump["advantage"]
        assert a.shape == dump["length"].shape and (a != 0).any()
        clipped = ((s > 1 + high) & (a > 0)) | ((s < 1 - low) & (a < 0))
        line = [r for r in records if r.get("train/rollout") == index][-1]
        assert clipped.float().mean().item() == pytest.approx(
            line["train/clip_fraction_sequences"], abs=1e-6
        )
    dump = torch.load(dumps[-1], weights_only=True)
    n_tokens = int(dump["length"].sum())
    assert dump["token_log_ratio"].shape == (n_tokens,) == dump["token_length"].shape
    # s_i is the mean of its tokens' log w_it: rebuild it from the flat token list
    rebuilt, start = [], 0
    for length in dump["length"].tolist():
        rebuilt.append(dump["token_log_ratio"][start : start + length].mean())
        assert (dump["token_length"][start : start + length] == length).all()
        start += length
    assert torch.allclose(torch.stack(rebuilt), dump["sequence_log_ratio"], atol=1e-6)
    # the last minibatch is off-policy after one update: its ratios are not all 1
    assert dump["token_log_ratio"].abs().max() > 1e-4
    # gradient cosines by length (on the last batch: every sequence of the first one's
    # off-policy minibatch is clipped, its gradient zero): one value per bucket
    last = dump
    assert 1 <= len(last["cosine_to_full"]) <= 4
    assert last["cosine_responses"].sum() == 8  # the halves cover the whole batch
    for key in ("cosine_to_full", "cosine_halves", "cosine_to_on_policy"):
        assert (last[key].isnan() | (last[key].abs() <= 1 + 1e-6)).all()
    assert (last["cosine_length_lo"] <= last["cosine_length_mean"]).all()
    assert (last["cosine_length_mean"] <= last["cosine_length_hi"]).all()
    # after one update the ratios (and the clipping) turn the gradient, not reverse it
    assert 0 < last["cosine_full_to_on_policy"] < 1


def test_compare_writes_the_report_and_reuses_finished_runs(tmp_path, tiny):
    out = tmp_path / "cmp"
    messages: list[str] = []
    result = compare(None, tiny, out, seeds=(0,), log=messages.append)
    assert set(result["algorithms"]) == {"GSPO", "GRPO", "GSPO-token"}
    for name in ("report.md", "report.html", "summary.json"):
        assert (out / name).is_file()
    md = (out / "report.md").read_text()
    assert md.count("| (a)") == 1 and md.count("| (b)") == 1 and md.count("| (c)") == 1
    assert "override `rollout.group_size=4`" in md  # the command is in the report
    from gspo.provenance import code_commit, machine

    # the code and machine the runs were trained on (reports said neither)
    assert f"Trained at commit {code_commit()} on {machine()}." in md
    assert (out / "runs" / "grpo-seed0" / "trained_on.jsonl").read_text().count("\n") == 1
    assert "## Gradient noise by response length" in md
    for png in ("accuracy_steps", "accuracy_time", "reward_steps", "clip_fraction", "ratios",
                "gradient_cosine_by_length", "gradient_ratio_turn_by_length"):  # fmt: skip
        assert f"plots/{png}.png" in md and (out / "plots" / f"{png}.png").is_file()
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == md.count("![")
    # markdown rendered, not shown as text (backticks, emphasis, list dashes, before)
    body = html.split("<body>", 1)[1]
    assert "<table>" in body and "<code>rollout.group_size=4</code>" in body and "<li>" in body
    assert "`" not in body and "**" not in body and "nan ± nan" not in md
    saved = json.loads((out / "summary.json").read_text())
    assert saved["cold_start_seconds"] > 0 and saved["run_seconds"] > 0
    gspo, grpo = saved["algorithms"]["GSPO"], saved["algorithms"]["GRPO"]
    # paper clip ranges: GSPO's 3e-4 band clips far more than GRPO's 0.2
    assert gspo["clip_fraction"] > grpo["clip_fraction"]
    assert all(v["verdict"] in (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE)
               for v in saved["verdicts"])  # fmt: skip
    assert sum("training" in m for m in messages) == 3  # three runs trained
    assert "GSPO-token matched GSPO exactly on every seed" in md
    # a second call trains nothing: the cold start and the runs are reused
    again: list[str] = []
    compare(None, tiny, out, seeds=(0,), log=again.append)
    assert not any("training" in m for m in again)
    assert sum("reusing" in m for m in again) == 4
    assert (out / "runs" / "grpo-seed0" / "trained_on.jsonl").read_text().count("\n") == 1
    # GSPO alone (a KeyError at the report, after every run, before): no verdicts, said
    alone = compare(None, tiny, out, seeds=(0,), log=again.append, algorithms=("GSPO",))
    assert set(alone["algorithms"]) == {"GSPO"} and alone["verdicts"] == []
    md = (out / "report.md").read_text()
    assert "Every claim compares GSPO with GRPO: run both (`--algorithms GSPO,GRPO`)." in md
    assert ", the 1 run " in md  # ("the 1 runs" before)


def test_the_report_names_the_config_file_its_runs_read(tmp_path, tiny):
    """A compare given --config wrote "Produced by gspo compare (preset default, override
    ...)": the report named the overrides alone, as if the rest were the defaults."""
    config = tmp_path / "mine.yaml"
    config.write_text("train:\n  max_steps: 2\n")
    out = tmp_path / "cmp"
    compare(config, tiny, out, seeds=(0,), log=[].append, algorithms=("GSPO",))
    md = (out / "report.md").read_text()
    assert md.count(f"(preset `default`, config `{config}`, override `{CPU}`") == 1
    assert json.loads((out / "summary.json").read_text())["config"] == str(config)
    compare(None, [*tiny, "train.max_steps=2"], tmp_path / "plain", seeds=(0,), log=[].append,
            algorithms=("GSPO",))  # fmt: skip
    assert "config `" not in (tmp_path / "plain" / "report.md").read_text()


def test_a_run_that_lost_its_metrics_is_refused_before_anything_trains(tmp_path, tiny, capsys):
    """A compared run with checkpoints but no metrics.jsonl (its report's records) stopped,
    after the runs before it had trained, with the trainer's advice for Python (resume=True,
    overwrite=True), which gspo compare has not."""
    out = tmp_path / "cmp"
    compare(None, tiny, out, seeds=(0, 1), log=[].append, algorithms=("GSPO",))
    (out / "runs" / "gspo-seed1" / "metrics.jsonl").unlink()
    before = (out / "runs" / "gspo-seed0" / "metrics.jsonl").read_text()
    messages: list[str] = []
    with pytest.raises(ValueError) as error:
        compare(None, tiny, out, seeds=(0, 1), log=messages.append, algorithms=("GSPO",))
    assert str(error.value) == (
        f"{out / 'runs' / 'gspo-seed1'} has checkpoints but no metrics.jsonl, the records its "
        "report is made of: delete it to redo it"
    )
    assert messages == []  # nothing reused, resumed or trained first
    assert (out / "runs" / "gspo-seed0" / "metrics.jsonl").read_text() == before
    shutil.rmtree(out / "runs" / "gspo-seed1")  # as the line says: then it is redone
    compare(None, tiny, out, seeds=(0, 1), log=messages.append, algorithms=("GSPO",))
    assert f"  training {out / 'runs' / 'gspo-seed1'}" in messages


def test_compare_after_bad_input_and_after_edited_files(tmp_path, tiny, monkeypatch):
    """A compare stopped by bad input (a misspelt reward function) recorded its request
    first, and refused the corrected command into the same directory as "made with other
    settings"; a reward file or data edited since was not noticed (the runs made from the
    old ones were reused and their report written as new); the same file named by a
    relative path is the same."""
    monkeypatch.chdir(tmp_path)  # (the fixture's reward file: tmp_path / "varied.py")
    out, log = tmp_path / "cmp", [].append
    asked = [*tiny[:-1], "reward.functions=[varied.py:nosuch]"]
    with pytest.raises(ValueError, match="nosuch"):
        compare(None, asked, out, seeds=(0,), log=log, algorithms=("GSPO",))
    compare(None, tiny, out, seeds=(0,), log=log, algorithms=("GSPO",))  # the absolute path
    relative = [*tiny[:-1], "reward.functions=[varied.py:varied]"]
    messages: list[str] = []
    compare(None, relative, out, seeds=(0,), log=messages.append, algorithms=("GSPO",))
    assert sum("reusing" in m for m in messages) == 2 and not any("training" in m for m in messages)
    with open(tmp_path / "varied.py", "a") as f:
        f.write("# edited\n")
    digest = "'[0-9a-f]{16}'"
    edited = rf"other settings \(cold_start: contents.reward.functions.0 {digest} -> {digest}\)"
    with pytest.raises(ValueError, match=edited):
        compare(None, relative, out, seeds=(0,), log=log, algorithms=("GSPO",))
    # a request recorded before the digests (paths as given, no contents): still the same
    from gspo.experiments.runs import REQUEST, _request, unchanged_requests

    config = load_config(None, relative)
    older = tmp_path / "older"
    older.mkdir()
    (older / REQUEST).write_text(yaml.safe_dump(_request(config, None, older=True)))
    unchanged_requests({older: config}, None)


def test_compare_bad_input_is_one_line(tmp_path, capsys):
    assert main(["compare", "--output-dir", str(tmp_path), "--preset", "wild"]) == 2
    assert "--preset 'wild'" in capsys.readouterr().err
    assert main(["compare", "--output-dir", str(tmp_path), "--seeds", "0"]) == 2
    capsys.readouterr()
    for owned in ("algorithm.level=token", "train.seed=3", "algorithm.clip_low=0.2"):
        assert main(["compare", "--output-dir", str(tmp_path), owned]) == 2  # (replaced before)
    assert main(["compare", "--output-dir", str(tmp_path), "model.lora.r=4"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: algorithm.level=token: gspo compare sets algorithm.level per algorithm "
        "(choose them with --algorithms); drop it",
        "gspo: error: train.seed=3: gspo compare sets train.seed per run (choose them with "
        "--seeds); drop it",
        "gspo: error: algorithm.clip_low=0.2: gspo compare sets algorithm.clip_low per "
        "algorithm (each level's paper clip range); drop it",
        "gspo: error: model.lora.r=4: gspo compare runs full fine-tuning only (its shared cold "
        "start and runs take whole weights); compare LoRA runs with gspo train",
    ]
    # the same set by --config or a section's override (run with them before, the report
    # still saying "paper clip range"); LoRA in --config got gspo train's advice
    (tmp_path / "clip.yaml").write_text("algorithm:\n  clip_low: 0.1\n")
    (tmp_path / "lora.yaml").write_text("model:\n  lora:\n    r: 8\n")
    out = ["--output-dir", str(tmp_path / "out")]
    assert main(["compare", *out, "--config", str(tmp_path / "clip.yaml")]) == 2
    assert main(["compare", *out, "algorithm={clip_high: 0.1}"]) == 2
    assert main(["compare", *out, "--config", str(tmp_path / "lora.yaml")]) == 2
    # (train.seed there set the cold start's seed and data while the runs took 0..N-1)
    (tmp_path / "seed.yaml").write_text("train:\n  seed: 7\n")
    assert main(["compare", *out, "--config", str(tmp_path / "seed.yaml")]) == 2
    assert main(["compare", *out, "algorithm={level: token}"]) == 2
    (tmp_path / "afile").write_text("")
    assert main(["compare", "--output-dir", str(tmp_path / "afile")]) == 2
    assert main(["compare", "--output-dir", str(tmp_path / "afile" / "sub")]) == 2
    assert main(["compare", *out, "train.max_steps=0"]) == 2
    assert main(["compare", *out, "train.time_limit=1h"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: algorithm.clip_low=0.1 (--config or a section): gspo compare sets "
        "algorithm.clip_low per algorithm (each level's paper clip range); drop it",
        "gspo: error: algorithm.clip_high=0.1 (--config or a section): gspo compare sets "
        "algorithm.clip_high per algorithm (each level's paper clip range); drop it",
        "gspo: error: model.lora.r=8 (--config or a section): gspo compare runs full "
        "fine-tuning only (its shared cold start and runs take whole weights); compare LoRA "
        "runs with gspo train",
        "gspo: error: train.seed=7 (--config or a section): gspo compare sets train.seed per "
        "run (choose them with --seeds); drop it",
        "gspo: error: algorithm.level=token (--config or a section): gspo compare sets "
        "algorithm.level per algorithm (choose them with --algorithms); drop it",
        f"gspo: error: --output-dir {tmp_path / 'afile'} is a file, not a directory",
        f"gspo: error: --output-dir {tmp_path / 'afile' / 'sub'}: cannot be made (Not a directory)",
        "gspo: error: train.max_steps=0: the runs would train nothing to compare",
        "gspo: error: train.time_limit: gspo compare trains its runs one after another in one "
        "command; give the time limit to gspo train runs",
    ]
    assert not (tmp_path / "out").exists()  # refused before it is made
    # a gspo train run's directory, and a compare's for gspo train: each overwrote the
    # other's plots/clip_fraction.png, unsaid
    (tmp_path / "trained" / "checkpoints").mkdir(parents=True)
    assert main(["compare", "--output-dir", str(tmp_path / "trained")]) == 2
    (tmp_path / "compared" / "runs" / "gspo-seed0").mkdir(parents=True)
    (tmp_path / "compared" / "runs" / "gspo-seed0" / "compare_request.yaml").write_text("{}")
    assert main(["train", "--output-dir", str(tmp_path / "compared"), CPU]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gspo: error: --output-dir {tmp_path / 'trained'} holds a gspo train run; give gspo "
        "compare a directory of its own",
        f"gspo: error: --output-dir {tmp_path / 'compared'} holds a gspo compare; give the "
        "run a directory of its own (its runs are in runs/ there)",
    ]


def test_compare_algorithms_by_any_case_once_each(tmp_path, capsys):
    """``--algorithms gspo,grpo`` (as algorithm.level spells them) was refused, and
    ``GSPO,GSPO`` accepted."""
    from gspo.experiments.runs import ALGORITHMS

    out = ["compare", "--output-dir", str(tmp_path / "out"), "train.max_steps=0"]
    assert main([*out, "--algorithms", "gspo,Grpo"]) == 2  # (past the names: max_steps)
    assert main([*out, "--algorithms", "GSPO,gspo"]) == 2
    assert main([*out, "--algorithms", "gsop"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: train.max_steps=0: the runs would train nothing to compare",
        "gspo: error: --algorithms 'GSPO,gspo': GSPO named twice",
        f"gspo: error: --algorithms 'gsop': expected some of {', '.join(ALGORITHMS)}",
    ]


def test_compare_under_torchrun_is_one_line_from_rank_0(tmp_path, monkeypatch, capsys):
    """Each rank ran a whole compare: rank 1's lock on the directory was said by rank 0 as
    "another gspo process is comparing in this directory"."""
    import gspo.cli

    waits: list[float] = []
    monkeypatch.setattr(gspo.cli.time, "sleep", waits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        assert main(["compare", "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: gspo compare is not for torchrun: it runs its trainings itself, one "
        "after another; run it as a plain command"
    ]
    assert not (tmp_path / "out").exists()
    assert waits == [gspo.cli.RANK_ZERO_GRACE_S]  # rank 1, silent, lets rank 0 say it


def test_compare_checks_every_run_before_training_and_holds_its_directory(tmp_path, capsys):
    """Settings changed between two compares into one directory were found one directory
    at a time, each after the runs before it had trained; two compares at once both
    trained the same runs."""
    from gspo.experiments.runs import REQUEST
    from gspo.runs import hold_lock

    out = tmp_path / "cmp"
    for name in ("cold_start", "runs/gspo-seed0", "runs/grpo-seed0"):
        (out / name).mkdir(parents=True)
        (out / name / REQUEST).write_text("optim:\n  lr: 0.5\n")
    argv = ["compare", "--output-dir", str(out), "--algorithms", "GSPO,GRPO", "--seeds", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"gspo: error: {out}: cold_start, runs/gspo-seed0, runs/grpo-seed0 were made with "
        "other settings (cold_start: "
    ) and err.endswith("use another --output-dir, or delete them to redo them\n")
    assert sorted(p.name for p in out.iterdir()) == ["cold_start", "runs"]  # nothing trained
    lock = hold_lock(out, "elsewhere")  # (another process's lock: flock is per descriptor)
    try:
        assert main(argv) == 2
    finally:
        os.close(lock)
    assert capsys.readouterr().err == (
        f"gspo: error: gspo compare: --output-dir {out}: another gspo process is comparing "
        "in this directory (it holds the directory's lock); wait for it to finish or stop it\n"
    )


def same_request(config, run_dir, root=None):
    """What compare does for a directory: refuse other settings, else record these."""
    from gspo.experiments.runs import unchanged_requests, write_request

    unchanged_requests({run_dir: config}, root)
    write_request(config, run_dir, root)


def test_the_shared_cold_start_is_kept_across_rl_settings(tmp_path):
    """A compare with another RL learning rate into the same directory refused the cold
    start too, which takes no RL step: a sweep of optim.lr had to train it again."""
    out = tmp_path / "cmp"
    same_request(load_config(None, ["optim.lr=1e-4"]), out / "cold_start", out)
    rl = ["optim.lr=3e-4", "optim.warmup_steps=5", "algorithm.level=token"]
    same_request(load_config(None, rl), out / "cold_start", out)  # kept
    same_request(load_config(None, ["optim.lr=1e-4"]), out / "runs" / "gspo-seed0", out)
    refused = r"gspo-seed0 was made with other settings \(algorithm.level"
    with pytest.raises(ValueError, match=refused):
        same_request(load_config(None, rl), out / "runs" / "gspo-seed0", out)  # a run: not
    with pytest.raises(ValueError, match=r"cold_start was made with other settings \(model"):
        same_request(load_config(None, ["model.hidden=128"]), out / "cold_start", out)


def test_runs_recorded_before_data_seed_are_kept_where_their_data_is_the_same(tmp_path):
    """A request recorded before data.seed existed drew its data from train.seed: seed 0's
    run and a run on the user's own data ask the same now, seed 1's does not."""
    from gspo.experiments.runs import REQUEST

    def recorded_before(config, run):
        same_request(config, run)
        old = yaml.safe_load((run / REQUEST).read_text())
        del old["data"]["seed"]
        (run / REQUEST).write_text(yaml.safe_dump(old))

    configs = run_configs(None, [], checkpoint=Path("c"), seeds=[0, 1], preset="default")
    for seed in (0, 1):
        recorded_before(configs["GSPO", seed], tmp_path / f"s{seed}")
    same_request(configs["GSPO", 0], tmp_path / "s0")
    with pytest.raises(ValueError, match=r"other settings \(data.seed 1 -> 0\)"):
        same_request(configs["GSPO", 1], tmp_path / "s1")
    own = ["data.train=x.jsonl", "train.seed=1"]
    recorded_before(load_config(None, own), tmp_path / "own")
    same_request(load_config(None, [*own, "data.seed=0"]), tmp_path / "own")


def test_a_run_made_with_other_settings_is_not_reused_or_resumed(tmp_path):
    """A rerun into the same directory with other overrides (or another preset) reused every
    finished run and resumed an interrupted one under the new settings, while the report
    named the new ones."""
    from gspo.experiments.runs import REQUEST

    run = tmp_path / "runs" / "gspo-seed0"
    same_request(load_config(None, ["optim.lr=1e-4"]), run)  # recorded
    assert (run / REQUEST).is_file()
    same_request(load_config(None, ["optim.lr=1e-4", "log.plots=false"]), run)  # log.*: fine
    same_request(load_config(None, ["optim.lr=1e-4", "train.max_steps=500"]), run)  # longer
    # --no-cache is no other setting (every later run without it was refused)
    uncached = ["optim.lr=1e-4", "train.max_steps=500", "train.cold_start_cache=false"]
    same_request(load_config(None, uncached), run)
    with pytest.raises(ValueError) as err:
        same_request(load_config(None, ["optim.lr=0.5", "model.hidden=128"]), run)
    assert str(err.value) == (
        f"{run} was made with other settings (model.hidden 256 -> 128; optim.lr "
        "0.0001 -> 0.5; train.max_steps 500 -> 200): use another --output-dir, or delete it "
        "to redo it"
    )
    # the output directory's own paths are recorded relative to it: a copy asks the same
    # (every run of a copied directory was refused: its model, the cold start, moved)
    root = tmp_path / "a"
    at = [f"model.path={root}/cold_start/checkpoints/step-0000000"]
    same_request(load_config(None, at), root / "runs" / "r", root)
    shutil.copytree(root, tmp_path / "b")
    copy = tmp_path / "b"
    moved = [f"model.path={copy}/cold_start/checkpoints/step-0000000"]
    same_request(load_config(None, moved), copy / "runs" / "r", copy)
    with pytest.raises(ValueError, match="model.path '<output-dir>/cold_start/checkpoints/st"):
        same_request(load_config(None, at), copy / "runs" / "r", copy)
    # a path beside the output directory whose name starts as its does is not under it
    beside = [*moved, f"data.train={tmp_path}/b2/rows.jsonl"]
    same_request(load_config(None, beside), copy / "runs" / "s", copy)
    recorded = yaml.safe_load((copy / "runs" / "s" / "compare_request.yaml").read_text())
    assert recorded["data"]["train"] == f"{tmp_path}/b2/rows.jsonl"
    # where the runs were trained: each commit and machine once; a damaged line unknown
    from gspo.experiments.runs import provenance

    (root / "x").mkdir()
    (root / "x" / "trained_on.jsonl").write_text(
        '{"commit": "c1", "machine": "m"}\n\n{"commit": "c1", "machine": "m"}\n{"commit": "c2'
    )
    (root / "y").mkdir()
    (root / "y" / "trained_on.jsonl").write_text('{"commit": "c3"}\n')
    assert provenance([root / "x", root / "y", root / "none"]) == (
        "commit c1 on m; commit unknown on unknown"
    )


def test_the_report_gives_moe_expert_churn_and_one_reward_point_per_rollout_batch(
    tmp_path, monkeypatch
):
    """An MoE compare said nothing of the routing (moe/expert_change_fraction was in every
    run's metrics); the reward drew one point per minibatch line of a batch. The churn of
    minibatch k is k + 1 updates' change since the rollout: the report gives minibatch 0's
    (one update) and the last minibatch's, not the mean over every line, which it called
    the change per step (2.5x one update's here, with 4 minibatches)."""
    from gspo.experiments.report import write_report
    from gspo.experiments.summary import Run
    from gspo.telemetry import plots

    drawn: dict[str, list] = {}
    original = plots.plot_bands

    def spy(groups, key, path, **kw):
        drawn[path.name] = plots.band_lines(groups, key, kw.get("x", "step"))
        return original(groups, key, path, **kw)

    monkeypatch.setattr("gspo.experiments.report.plot_bands", spy)

    def records(churn: float | None) -> list[dict]:
        lines = [{"step": 0, "time": 0.0, "eval/accuracy": 0.1}]
        for s in range(1, 9):
            line = {"step": s, "time": float(s), "train/loss": 0.0, "train/rollout": (s - 1) // 4,
                    "train/minibatch": (s - 1) % 4, "train/reward_mean": 0.1 * ((s - 1) // 4),
                    "train/clip_fraction": 0.01, "train/tokens": 10.0}  # fmt: skip
            if churn is not None:
                line["moe/expert_change_fraction"] = churn * s
            lines.append(line)
        return [*lines, {"step": 8, "time": 9.0, "eval/accuracy": 0.5}]

    for moe in (True, False):
        out = tmp_path / f"moe{moe}"
        runs = [Run(name, 0, tmp_path, records(churn if moe else None))
                for name, churn in (("GSPO", 0.01), ("GRPO", 0.02))]  # fmt: skip
        result = write_report(runs, out)
        md = (out / "report.md").read_text()
        if moe:
            # steps 1 and 5 are minibatch 0, steps 4 and 8 minibatch 3: churn x 3 and x 6
            assert result["algorithms"]["GRPO"]["expert_change"] == pytest.approx(0.06)
            assert result["algorithms"]["GRPO"]["expert_change_all"] == pytest.approx(0.12)
            assert "| GSPO | 0.0300 | 0.0600 |" in md and "| GRPO | 0.0600 | 0.1200 |" in md
            assert "plots/expert_change.png" in md and (out / "plots/expert_change.png").is_file()
        else:
            assert "## MoE routing" not in md and "expert_change.png" not in md
        ((_, xs, means, _), _) = drawn["reward_steps.png"]
        assert xs == [4.0, 8.0] and means == pytest.approx([0.0, 0.1])


def test_each_compared_run_is_named_in_the_trackers(tmp_path):
    """Every run (cold start, GSPO seed 0, GRPO seed 0) was a W&B and MLflow run named the
    user's name alone; a fixed W&B id put them all into one."""
    from gspo.config import load_config
    from gspo.experiments.runs import in_trackers

    asked = ["log.wandb={project: p, name: mine, id: x}", "log.mlflow={tags: {a: b}}"]
    config = load_config(None, asked)
    named = in_trackers(config, tmp_path / "cmp" / "runs" / "grpo-seed1", tmp_path / "cmp")
    assert named.log.wandb == {"project": "p", "name": "mine-grpo-seed1", "group": "cmp"}
    assert named.log.mlflow == {"run_name": "grpo-seed1", "tags": {"a": "b", "gspo_compare": "cmp"}}
    assert config.log.wandb["name"] == "mine"  # (the caller's config as it was)
    plain = load_config(None, [])
    assert in_trackers(plain, tmp_path / "r", tmp_path) is plain


def test_histogram_needs_values(tmp_path):
    assert plot_histograms({"w": torch.zeros(0)}, tmp_path / "h.png", title="t") is None
    path = plot_histograms({"w": torch.randn(50), "s": torch.randn(50) * 0.01},
                           tmp_path / "h.png", title="t")  # fmt: skip
    assert path is not None and path.stat().st_size > 0
    # GSPO-token's ratios equal GSPO's (one advantage per response): drawn dashed over
    # them and labelled so (they hid GSPO's curves)
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.hist

    def hist(self, values, **kw):
        drawn.append((kw["label"], kw.get("linestyle")))
        return real(self, values, **kw)

    same = torch.randn(50)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(matplotlib.axes.Axes, "hist", hist)
        plot_histograms({"GSPO: w_it": same, "GSPO-token: w_it": same.clone(),
                         "GRPO: w_it": same * 2}, tmp_path / "h.png", title="t")  # fmt: skip
    assert drawn == [("GSPO: w_it", None), ("GSPO-token: w_it (= GSPO: w_it)", (0, (4, 3))),
                     ("GRPO: w_it", None)]  # fmt: skip


def test_the_report_says_why_the_gradient_noise_was_not_measured(tmp_path):
    """A run whose dumps hold no gradient cosines (LoRA dropout, Routing Replay, torchrun:
    their ``gradient_noise_skipped``) had a report without the gradient-noise section and
    no word of why."""
    from gspo.experiments.report import write_report
    from gspo.experiments.summary import Run

    why = "model.lora.dropout > 0: other dropout masks"
    (tmp_path / "ratios").mkdir()
    dump = {"token_log_ratio": torch.zeros(3), "token_length": torch.full((3,), 3),
            "sequence_log_ratio": torch.zeros(1), "length": torch.tensor([3]),
            "advantage": torch.ones(1), "gradient_noise_skipped": why}  # fmt: skip
    torch.save(dump, tmp_path / "ratios" / "rollout-000000.pt")
    records = [
        {"step": 0, "time": 0.0, "eval/accuracy": 0.1},
        {"step": 1, "time": 1.0, "train/loss": 0.0, "train/rollout": 0, "train/minibatch": 0,
         "train/reward_mean": 0.1, "train/clip_fraction": 0.01, "train/tokens": 3.0},
        {"step": 1, "time": 2.0, "eval/accuracy": 0.2},
    ]  # fmt: skip
    result = write_report([Run("GSPO", 0, tmp_path, records)], tmp_path / "out")
    assert result["algorithms"]["GSPO"]["gradient_noise_skipped"] == [why]
    md = (tmp_path / "out" / "report.md").read_text()
    assert f"## Gradient noise by response length\n\nNot measured: {why}." in md
