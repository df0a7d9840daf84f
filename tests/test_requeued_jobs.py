"""Jobs a scheduler stops and requeues. ``gspo train --auto-resume`` (``gspo.train(...,
resume="auto")``): the same command again starts the run the first time and continues it
from its last checkpoint afterwards, with the same metrics as a run never stopped.
``train.time_limit``: a run that would pass its job's time stops itself with a checkpoint
(status 75) instead of being killed after its last one."""

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


def test_a_finished_run_with_model_only_checkpoints_is_finished_again(
    tmp_path, varied_reward, capsys
):
    """The requeued job of a run that finished with train.save_only_model=true: its last
    checkpoint, model only, could not be resumed (status 2), though nothing was left to
    do. Now it says it took its steps, as any finished run does; more steps are still
    refused with the way to go on."""
    import gspo

    run = tmp_path / "run"
    only = "train.save_only_model=true"
    common = [*RUN, varied_reward, "train.max_steps=2", "eval.every=0", only]
    args = ["train", "--output-dir", str(run), "--auto-resume", *common]
    assert main(args) == 0
    lines = run_metrics(run)
    capsys.readouterr()
    assert main(args) == 0
    assert capsys.readouterr().out.startswith(
        "the run already took its 2 steps (train.max_steps=2 in whole rollout batches of 2); "
        "its checkpoints hold only the model: start a new run with model.path="
        f"{run / 'checkpoints' / 'step-0000002'} to train on"
    )
    assert run_metrics(run) == lines
    assert gspo.train(load_config(None, common), run, resume="auto") == lines
    assert main([*args, "train.max_steps=4"]) == 2
    assert "holds only the model" in capsys.readouterr().err


class FakeClock:
    """``time.monotonic`` advancing ``tick`` seconds at each reading."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_the_next_rollout_batch_and_a_checkpoint_must_fit_with_a_margin():
    from gspo.distributed import Distributed
    from gspo.training.time_limit import MARGIN, TimeLimit

    clock = FakeClock(0.0)
    limit = TimeLimit(1000.0, Distributed(), clock=clock)
    assert not limit.reached(checkpoint_s=0.0)
    limit.took(100.0)
    limit.took(60.0)  # (the longest counts)
    limit.took(300.0, "sft")  # (another kind's)
    need = MARGIN * (100.0 + 20.0)
    clock.now = 1000.0 - need - 1.0
    assert not limit.reached(checkpoint_s=20.0)
    assert limit.reached(checkpoint_s=20.0, kind="sft")
    clock.now = 1000.0 - need + 1.0
    assert limit.reached(checkpoint_s=20.0)
    assert not TimeLimit(None, Distributed(), clock=clock).reached(checkpoint_s=1e9)


DURATIONS = [("3h50m", 13800.0), ("90m", 5400.0), ("45s", 45.0), ("1d", 86400.0),
             ("1.5h", 5400.0), ("7200", 7200.0)]  # fmt: skip


@pytest.mark.parametrize(("value", "seconds"), DURATIONS)
def test_time_limits_are_read_with_their_units(value, seconds):
    from gspo.training.time_limit import said

    assert load_config(None, [f"train.time_limit={value}"]).train.time_limit == seconds
    assert said(13800.0) == "3h50m" and said(45.0) == "45s" and said(0.4) == "0.4s"


@pytest.mark.parametrize("value", ["abc", "3x", "h", "-5", "0"])
def test_a_bad_time_limit_is_one_line_naming_the_key(value):
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"^train\.time_limit: ") as err:
        load_config(None, [f"train.time_limit={value}"])
    assert "\n" not in str(err.value)


def test_a_run_at_its_time_limit_stops_with_a_checkpoint_then_continues(
    tmp_path, varied_reward, monkeypatch, capsys
):
    """Each reading of the clock 100 s later, a limit of 350 s: after 4 rollout batches
    (400 s) the next might not fit: the run writes step 4's checkpoint (save_every=3 had
    written step 3's only), says so and ends with status 75; the same command with
    --auto-resume then finishes it, with the metrics of a run never stopped."""
    import time

    import gspo.training.time_limit as time_limit

    full, cut = tmp_path / "full", tmp_path / "cut"
    common = [*RUN, varied_reward, "train.max_steps=8", "train.save_every=3", "eval.every=0"]
    clock = FakeClock(100.0)
    monkeypatch.setattr(time_limit, "time", type("T", (), {"monotonic": staticmethod(clock)}))
    again = ["train", "--output-dir", str(cut), "--auto-resume", *common,
             "train.time_limit=350", "algorithm.minibatches=1"]  # fmt: skip
    again.remove("algorithm.minibatches=2")
    capsys.readouterr()
    assert main(again) == time_limit.OUT_OF_TIME
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "gspo: train.time_limit=5m50s: stopped after step 4 of 8, its checkpoint written "
        "(the next stretch might not have fit); the same command with --auto-resume "
        "(or gspo train --resume on the run) continues it"
    )
    assert latest_checkpoint(cut).name == "step-0000004"
    assert [r["step"] for r in train_lines(run_metrics(cut))] == [1, 2, 3, 4]
    # what a job script under torchrun requeues on (torchrun's status is 1 for a 75)
    said = (cut / time_limit.STOPPED_FILE).read_text()
    assert said == err[-1] + "\n"
    monkeypatch.setattr(time_limit, "time", time)
    assert main(again) == 0
    assert not (cut / time_limit.STOPPED_FILE).exists()
    baseline = [a for a in again if a not in ("--auto-resume", "train.time_limit=350")]
    baseline[baseline.index(str(cut))] = str(full)
    assert main(baseline) == 0
    # (the same lines but the checkpoints', at steps 3, 4 (the stop's), 6, 8 against 3, 6, 8)
    a, b = ([r for r in run_metrics(run) if "io/checkpoint_bytes" not in r] for run in (full, cut))
    assert [r["step"] for r in run_metrics(cut) if "io/checkpoint_bytes" in r] == [0, 3, 4, 6, 8]
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert comparable(x) == pytest.approx(comparable(y), rel=1e-6, abs=1e-7)


def test_a_stop_says_how_to_go_on_and_from_which_checkpoint(tmp_path, monkeypatch, capsys):
    """The stop's line names the checkpoint the run goes on from, says the same command
    where it was --auto-resume, and says nothing of resuming where there is nothing to
    resume (a directory removed; gspo eval: it named gspo train --resume runs/gspo)."""
    import gspo.cli

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gspo.cli, "run_train", interrupted)
    monkeypatch.setattr("gspo.checkpoint_eval.eval_command", interrupted)
    run = tmp_path / "a run"
    (run / "checkpoints" / "step-0000006").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "checkpoints" / "latest").write_text("step-0000006")
    monkeypatch.setattr("gspo.training.checkpoint.checkpoint_problem", lambda path: None)
    assert main(["train", "--resume", str(run)]) == 130
    assert main(["train", "--output-dir", str(run), "--auto-resume"]) == 130
    assert main(["train", "--output-dir", str(tmp_path / "none")]) == 130
    assert main(["eval", str(run)]) == 130
    assert capsys.readouterr().err.splitlines() == [
        f"gspo: interrupted; resume with gspo train --resume '{run}' (from step-0000006)",
        "gspo: interrupted; the same command continues it (from step-0000006) (--auto-resume)",
        "gspo: interrupted; it had written nothing to resume from: the same command starts it "
        "again",
        "gspo: interrupted",
    ]


def test_a_run_stopped_before_any_checkpoint_is_not_offered_a_resume(tmp_path, monkeypatch, capsys):
    """A new run stopped in its cold start before any checkpoint keeps its config.yaml and
    first metric line (the model's size): there is nothing to resume from, and the line
    says the same command starts it again (it said 'resume with gspo train --resume')."""
    import gspo.cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gspo.cli, "run_train", interrupted)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 0, "model/params": 3174144.0}\n')
    assert main(["train", "--output-dir", str(run)]) == 130
    assert main(["train", "--resume", str(run)]) == 130
    nothing = (
        "gspo: interrupted; it had written nothing to resume from: the same command starts it again"
    )
    assert capsys.readouterr().err.splitlines() == [nothing, nothing]
    (run / "checkpoints" / "cold-start-0000010").mkdir(parents=True)  # (a progress one)
    (run / "checkpoints" / "cold-start-0000010" / "state.pt").write_bytes(b"")
    assert main(["train", "--resume", str(run)]) == 130
    assert capsys.readouterr().err == f"gspo: interrupted; resume with gspo train --resume {run}\n"


def test_a_run_stopped_in_its_cold_start_continues_it(tmp_path, varied_reward, monkeypatch, capsys):
    """Stopped after a cold-start progress checkpoint (no step-0 checkpoint yet): the same
    command continues the cold start from it (it was taken for no run, and started over),
    in the same W&B and MLflow runs (it started new ones), which get no line twice."""
    from test_telemetry import FakeTrackers

    import gspo.training.cold_start as cold

    fake = FakeTrackers(monkeypatch)

    real = cold._save_progress

    def saved_then_stopped(*args, **kwargs):
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(cold, "_save_progress", saved_then_stopped)
    run = tmp_path / "run"
    args = ["train", "--output-dir", str(run), "--auto-resume", *RUN, varied_reward,
            "train.cold_start_steps=20", "train.cold_start_save_every=10", "train.max_steps=2",
            "log.progress=true", "--no-cache", "log.wandb={}", "log.mlflow={}"]  # fmt: skip
    assert main(args) == 130
    monkeypatch.setattr(cold, "_save_progress", real)
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"cold start: resumed at step 10 from {run / 'checkpoints'}" in out, out
    assert [r["step"] for r in train_lines(run_metrics(run))] == [1, 2]
    assert [c[0].get("id") for c in fake.of("wandb.init")] == [None, "run-a"]
    assert fake.of("mlflow.start_run") == [({},), ({"run_id": "run-b"},)]
    assert fake.of("mlflow.end_run") == [("KILLED",), ("FINISHED",)]
    # (the first process logged the run's settings line: not again)
    assert len(fake.of("wandb.log")) == len(run_metrics(run))


def test_a_cold_start_at_its_time_limit_stops_with_its_progress_then_goes_on(
    tmp_path, varied_reward, monkeypatch, capsys
):
    """The clock 100 s later at each reading, a limit of 250 s: the cold start looks at it
    every 10 steps (100, 200, 300 s since the start) and stops after step 30 with its
    progress written; the same command goes on from there, and ends as a run never
    stopped."""
    import time

    import gspo.training.time_limit as time_limit

    full, cut = tmp_path / "full", tmp_path / "cut"
    common = [*RUN, varied_reward, "train.cold_start_steps=40", "train.cold_start_save_every=0",
              "train.max_steps=2", "eval.every=0", "--no-cache"]  # fmt: skip
    assert main(["train", "--output-dir", str(full), *common]) == 0
    monkeypatch.setattr(
        time_limit, "time", type("T", (), {"monotonic": staticmethod(FakeClock(100.0))})
    )
    again = ["train", "--output-dir", str(cut), "--auto-resume", *common, "train.time_limit=250"]
    capsys.readouterr()
    assert main(again) == time_limit.OUT_OF_TIME
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .startswith(
            "gspo: train.time_limit=4m10s: stopped in its cold start, after step 30 of 40, its "
            "checkpoint written"
        )
    )
    assert [p.name for p in (cut / "checkpoints").iterdir()] == ["cold-start-0000030"]
    monkeypatch.setattr(time_limit, "time", time)
    capsys.readouterr()
    assert main([*again, "log.progress=true"]) == 0
    assert "cold start: resumed at step 30" in capsys.readouterr().out
    a, b = run_metrics(full), run_metrics(cut)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b, strict=True):
        assert comparable(x) == pytest.approx(comparable(y), rel=1e-6, abs=1e-7)


def test_a_time_limit_with_model_only_checkpoints_is_refused(tmp_path):
    """The checkpoint a time limit stops with, written model-only, could not be resumed:
    the requeued job failed after the first (found by a review)."""
    from gspo.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.time_limit=1h", "train.save_only_model=true"])
    assert str(err.value) == (
        "train.time_limit with train.save_only_model=true: the checkpoint the run stops with "
        "could not be resumed (no optimizer state); set one of them"
    )


def test_python_resume_auto_errors_name_resume_auto(tmp_path):
    import gspo

    run = tmp_path / "run"
    (run / "checkpoints" / "step-0000002").mkdir(parents=True)  # (its config.yaml lost)
    with pytest.raises(ValueError, match=r"^train: resume='auto', but .* is not a gspo run"):
        gspo.train(load_config(None, [*RUN, "train.max_steps=2"]), run, resume="auto")
