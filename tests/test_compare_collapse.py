"""`gspo compare` where a run collapses (non-finite updates), a seed has no final accuracy,
the cold start comes from the cache, and the preset is typed in another case."""

from __future__ import annotations

import json
import math

import pytest
from test_compare import TINY, summary

from gspo.cli import main
from gspo.experiments import compare
from gspo.experiments.claims import INCONCLUSIVE, NOT_REPRODUCED, REPRODUCED, verdicts
from gspo.experiments.report import write_report
from gspo.experiments.summary import Run


@pytest.fixture
def tiny(varied_reward):
    """test_compare's tiny runs, with a reward that is never flat."""
    return [*TINY, varied_reward]


def test_a_collapsed_run_is_reported_and_the_others_go_on(tmp_path, tiny):
    """A run that train.max_skipped stopped (here a learning rate of 1e10: NaN gradients
    from the second step) stopped the whole compare with its error line: no other run,
    no report, the collapse in no table. Now each run is said collapsed, at its step, and
    the compare goes on; a later compare reuses it as collapsed."""
    out = tmp_path / "cmp"
    messages: list[str] = []
    args = [*tiny, "optim.lr=1e10", "train.max_skipped=2"]
    result = compare(None, args, out, seeds=(0,), log=messages.append, algorithms=("GSPO", "GRPO"))
    assert sum("training" in m for m in messages) == 2  # GRPO trained after GSPO collapsed
    said = [m for m in messages if "collapsed at step" in m]
    assert len(said) == 2 and "train.max_skipped=2" in said[0]
    for name in ("GSPO", "GRPO"):
        (fell,) = result["algorithms"][name]["collapsed"]
        assert fell["seed"] == 0 and fell["step"] == 3  # steps 2 and 3 skipped
        assert "non-finite" in fell["reason"]
        assert math.isnan(result["algorithms"][name]["accuracy"])  # (none: it never ended)
    md = (out / "report.md").read_text()
    assert "## Collapsed runs" in md and "| GRPO | 0 | 3 | train.max_skipped=2:" in md
    assert "| GSPO (1 of 1 collapsed) |" in md
    again: list[str] = []
    compare(None, args, out, seeds=(0,), log=again.append, algorithms=("GSPO", "GRPO"))
    assert not any("training" in m for m in again)
    assert sum("(collapsed at step 3)" in m for m in again) == 2
    # run_or_reuse for the experiments' scripts still raises (they judge no collapse)
    from gspo.experiments import run_configs, run_or_reuse
    from gspo.experiments.runs import cold_start_path
    from gspo.training.update import NonFiniteTraining

    configs = run_configs(None, args, checkpoint=cold_start_path(out), seeds=[0], preset="default")
    with pytest.raises(NonFiniteTraining):
        run_or_reuse(configs["GRPO", 0], tmp_path / "alone", again.append)
    # ... and where they are given a run the compare recorded as collapsed (it was reused,
    # its records returned as a finished run's)
    import shutil

    shutil.copytree(out / "runs" / "grpo-seed0", tmp_path / "copied")
    (tmp_path / "copied" / "compare_request.yaml").unlink()  # (asked with root=out)
    with pytest.raises(NonFiniteTraining, match=r"copied collapsed at step 3 \(a gspo compare"):
        run_or_reuse(configs["GRPO", 0], tmp_path / "copied", again.append)


def test_claim_c_counts_a_collapsed_seed():
    """A GRPO seed stopped on non-finite updates is the collapse claim (c) is about; its
    end was taken from its last evaluation before, and (c) said "not reproduced"."""
    stress = summary(0.15, 0.001, 0.9, 0.9, start=0.5)
    stress["GRPO"]["collapsed"] = [{"seed": 1, "step": 40, "reason": "train.max_skipped=3"}]
    c = verdicts(stress, "stress")[2]
    assert c["verdict"] == REPRODUCED
    assert "GRPO: 1 of 3 seeds collapsed (non-finite updates, train.max_skipped: seed 1 at step 40)" in c["figures"]  # fmt: skip # noqa: E501
    # every GRPO seed collapsed: no final accuracy ("nan" in the figures before)
    stress["GRPO"].update(accuracy=math.nan, seeds=[1])
    c = verdicts(stress, "stress")[2]
    assert c["verdict"] == REPRODUCED and "final accuracy GRPO n/a (start 0.500)" in c["figures"]


def test_claim_a_is_not_reproduced_where_gspo_collapsed_more_often():
    """GSPO's mean end accuracy is over the seeds that did not collapse: (a) said "trains
    as well" (reproduced) of a GSPO that collapsed on a seed where GRPO did not."""
    runs = summary(0.15, 0.001, 0.9, 0.9, start=0.5)
    assert verdicts(runs, "default")[0]["verdict"] == REPRODUCED
    runs["GSPO"]["collapsed"] = [{"seed": 2, "step": 9, "reason": "train.max_skipped=3"}]
    a = verdicts(runs, "default")[0]
    assert a["verdict"] == NOT_REPRODUCED
    assert (
        "GSPO: 1 of 3 seeds collapsed" in a["figures"] and "did not train as well" in a["figures"]
    )


def test_one_seed_with_a_final_accuracy_has_no_spread(tmp_path):
    """Two seeds, one without a final evaluation: the table said "± 0.000" and claim (a)
    took two seeds' error bar (an sd of 0 over one value) and said "reproduced"."""

    def records(evals: bool) -> list[dict]:
        line = {"train/loss": 0.1, "train/tokens": 10.0, "train/clip_fraction": 0.1,
                "train/reward_mean": 0.5, "train/rollout": 0, "time/step": 1.0}  # fmt: skip
        out = [{"step": 0, "eval/accuracy": 0.4}] if evals else []
        out += [{"step": 1, **line}]
        return out + ([{"step": 1, "eval/accuracy": 0.6}] if evals else [])

    runs = [Run("GSPO", seed, tmp_path / f"s{seed}", records(seed == 0)) for seed in (0, 1)]
    result = write_report(runs, tmp_path)
    gspo = result["algorithms"]["GSPO"]
    assert gspo["accuracy"] == 0.6 and math.isnan(gspo["accuracy_sd"])
    assert (
        json.loads((tmp_path / "summary.json").read_text())["algorithms"]["GSPO"]["accuracy_sd"]
        is None
    )
    assert "| GSPO | 0.400 -> 0.600 |" in (tmp_path / "report.md").read_text()
    # (a) with one GSPO seed's end: no error bar, inconclusive ("reproduced" before)
    half = summary(0.15, 0.001, 0.9, 0.9, start=0.5)
    half["GSPO"].update(accuracy_per_seed=[0.9, math.nan, math.nan], accuracy_sd=0.0)
    half["GRPO"]["accuracy_per_seed"] = [0.89, 0.9, 0.91]
    a = verdicts(half, "default")[0]
    assert a["verdict"] == INCONCLUSIVE and "1 and 3 seeds with a final accuracy" in a["figures"]


def test_a_collapsed_seed_does_not_end_its_algorithms_curves(tmp_path, monkeypatch):
    """The plots' bands are over the steps every seed reached: one seed collapsed at step 2
    ended GRPO's accuracy curve there, though its other seed went on to step 4."""
    import gspo.experiments.report as report
    from gspo.telemetry import band_lines

    drawn: dict[str, list[float]] = {}

    def bands(groups, key, path, **kwargs):
        if key == "eval/accuracy" and kwargs.get("x") is None:
            drawn.update({name: xs for name, xs, _, _ in band_lines(groups, key)})

    monkeypatch.setattr(report, "plot_bands", bands)
    line = {"train/loss": 0.1, "train/tokens": 10.0, "train/clip_fraction": 0.1,
            "train/reward_mean": 0.5, "train/rollout": 0}  # fmt: skip
    evals = [{"step": s, "eval/accuracy": 0.5} for s in (0, 2, 4)]
    whole = [*evals, *({"step": s, **line} for s in (1, 2, 3, 4))]
    cut = [r for r in whole if r["step"] <= 2]
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "collapsed.json").write_text('{"step": 3, "reason": "train.max_skipped"}')
    runs = [Run("GRPO", 0, tmp_path / "a", whole), Run("GRPO", 1, tmp_path / "b", cut)]
    report.write_report(runs, tmp_path)
    assert drawn == {"GRPO": [0, 2, 4]}  # the seed that went on (both collapsed: both drawn)


def test_a_cached_cold_start_is_said(tmp_path, tiny, cold_start_cache):
    """A compare whose cold start the cache gave said nothing of it, and its report gave
    the cold start the minutes of the run that trained it as this one's."""
    first: list[str] = []
    compare(None, tiny, tmp_path / "a", seeds=(0,), log=first.append, algorithms=("GSPO",))
    assert not any("taken from the cache" in m for m in first)
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["cold_start_cached"] is None
    second: list[str] = []
    compare(None, tiny, tmp_path / "b", seeds=(0,), log=second.append, algorithms=("GSPO",))
    (said,) = [m for m in second if "taken from the cache" in m]
    entry = json.loads((tmp_path / "b" / "summary.json").read_text())["cold_start_cached"]
    assert entry.startswith(str(cold_start_cache)) and entry in said
    assert "--no-cache redoes it" in said and "the run that trained it took" in said
    assert (
        f"(taken from the cold-start cache, `{entry}`" in (tmp_path / "b" / "report.md").read_text()
    )


def test_the_preset_in_any_case(tmp_path, capsys):
    """``--preset Stress`` was refused ("expected one of default, stress, ...")."""
    out = ["compare", "--output-dir", str(tmp_path / "out"), "train.max_steps=0"]
    assert main([*out, "--preset", "Stress"]) == 2  # (past the preset: max_steps)
    assert main([*out, "--preset", "GSPO-vs-GRPO"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: train.max_steps=0: the runs would train nothing to compare",
        "gspo: error: --preset 'GSPO-vs-GRPO': expected one of default, stress, long, tools",
    ]
