"""``gspo train --auto-resume`` and ``gspo.train(..., resume="auto")``: the same command
again, as a scheduler requeues a job, starts the run the first time and continues it from
its last checkpoint afterwards, with the same metrics as a run never stopped."""

from __future__ import annotations

import pytest
from test_trainer import FAST, comparable, run_metrics, train_lines

from gspo.cli import main
from gspo.config import load_config
from gspo.trainer import latest_checkpoint

RUN = [*FAST, "train.cold_start_steps=10", "algorithm.minibatches=2", "train.save_every=2",
       "eval.every=4", "optim.lr=1e-3"]  # fmt: skip


def test_the_same_command_starts_the_run_then_continues_it(tmp_path, varied_reward, capsys):
    full, cut = tmp_path / "full", tmp_path / "cut"
    again = ["train", "--output-dir", str(cut), "--auto-resume", *RUN, varied_reward]
    assert main(["train", "--output-dir", str(full), *RUN, varied_reward,
                 "train.max_steps=8"]) == 0  # fmt: skip
    assert main([*again, "train.max_steps=4"]) == 0  # (no run there: started)
    assert latest_checkpoint(cut).name == "step-0000004"
    capsys.readouterr()
    assert main([*again, "train.max_steps=8"]) == 0  # (a run there: continued)
    assert "resumed with settings" not in capsys.readouterr().err  # (a longer run is free)
    a, b = run_metrics(full), run_metrics(cut)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert comparable(x) == pytest.approx(comparable(y), rel=1e-6, abs=1e-7)
    assert [r["step"] for r in train_lines(b)] == list(range(1, 9))
    # once more, finished: nothing is trained again
    assert main([*again, "train.max_steps=8"]) == 0
    assert run_metrics(cut) == b


def test_a_changed_setting_is_named_and_the_model_must_stay(tmp_path, varied_reward, capsys):
    run = tmp_path / "run"
    again = ["train", "--output-dir", str(run), "--auto-resume", *RUN, varied_reward]
    assert main([*again, "train.max_steps=2"]) == 0
    capsys.readouterr()
    assert main([*again, "train.max_steps=4", "algorithm.level=token"]) == 0
    err = capsys.readouterr().err
    assert "resumed with settings step-0000002 was not trained with: algorithm.level" in err
    assert main([*again, "train.max_steps=6", "model.hidden=32"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "model.hidden" in err and "--auto-resume" in err, err
    assert latest_checkpoint(run).name == "step-0000004"


def test_a_run_stopped_before_its_first_checkpoint_is_started_over(tmp_path, varied_reward):
    """Killed before any checkpoint (a metrics.jsonl, a checkpoint being staged): there is
    nothing to continue, so the same command starts it again instead of refusing."""
    run = tmp_path / "run"
    (run / "checkpoints" / ".step-0000000.gspo-0123456789ab.tmp").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "sft/loss": 1.0}\n')
    args = ["train", "--output-dir", str(run), "--auto-resume", *RUN, varied_reward,
            "train.max_steps=2"]  # fmt: skip
    assert main(args) == 0
    assert latest_checkpoint(run).name == "step-0000002"
    assert [r["step"] for r in train_lines(run_metrics(run))] == [1, 2]


def test_bad_uses_are_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)  # (config.yaml lost)
    assert main(["train", "--auto-resume", "--resume", str(run)]) == 2
    assert main(["train", "--auto-resume", "--overwrite", "--output-dir", str(run)]) == 2
    assert main(["train", "--auto-resume", "--output-dir", str(run), *FAST]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: --auto-resume continues the run in --output-dir; --resume names one: "
        "pick one",
        "gspo: error: --overwrite starts a run over, --auto-resume continues one: pick one",
        f"gspo: error: --output-dir {run}: is not a gspo run (no config.yaml)",
    ]


def test_python_resume_auto(tmp_path, varied_reward):
    import gspo

    run = tmp_path / "run"
    config = load_config(None, [*RUN, varied_reward, "train.max_steps=2", "eval.every=0"])
    gspo.train(config, run, resume="auto")
    longer = load_config(None, [*RUN, varied_reward, "train.max_steps=4", "eval.every=0"])
    gspo.train(longer, run, resume="auto")
    assert [r["step"] for r in train_lines(run_metrics(run))] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=r"^train: resume='yes': True, False or 'auto'$"):
        gspo.train(config, run, resume="yes")
    with pytest.raises(ValueError, match="overwrite=True starts a run over, resume='auto'"):
        gspo.train(config, run, resume="auto", overwrite=True)
