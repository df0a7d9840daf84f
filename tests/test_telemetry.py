"""Tests for gspo.telemetry: metrics jsonl/TensorBoard logging, plots, progress, summaries."""

from __future__ import annotations

import ast
import contextlib
import importlib.machinery
import io
import itertools
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from gspo.telemetry import (
    MetricsLogger,
    TrainingProgress,
    json_safe,
    plot_metrics,
    plot_runs,
    plot_series,
    print_summary,
    read_metrics,
    summary_table,
)
from gspo.telemetry.trackers import ENVIRONMENT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(n: int = 20, *, eval_every: int = 5, clip_zero_every: int = 4) -> list[dict]:
    """Training lines of 4 minibatches per rollout batch (the last one carries the batch's
    clip fractions) and an evaluation every ``eval_every`` steps."""
    recs = []
    for s in range(1, n + 1):
        rec = {
            "step": s,
            "time": 1000.0 + 2.0 * s,
            "train/reward_mean": 0.1 + 0.03 * s,
            "train/reward_std": 0.2,
            "train/clip_fraction": 0.0 if s % clip_zero_every == 0 else 1e-3 * s,
            "train/response_length_mean": 300.0 - s,
        }
        if s % 4 == 0:
            rec["train/clip_fraction_off_policy"] = 0.01 * s
            rec["train/clip_fraction_on_policy"] = 1e-4 * s
        if s % eval_every == 0:
            rec["eval/accuracy"] = 0.2 + 0.01 * s
            rec["eval/accuracy_greedy"] = 0.25 + 0.01 * s
        recs.append(rec)
    return recs


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _assert_png(path: Path) -> None:
    assert path.is_file(), path
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 1024, (path, len(data))


def _scalar_events(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    if tag not in acc.Tags()["scalars"]:
        return []
    return [(e.step, e.value) for e in acc.Scalars(tag)]


# ------------------------------------------------------------------ json_safe / logger


def test_json_safe_converts_tensors_numpy_and_non_finite():
    out = json_safe(
        {
            "a": torch.tensor(0.5),
            "b": np.float32(0.25),
            "c": np.int64(7),
            "d": float("nan"),
            "e": float("inf"),
            "f": torch.tensor(float("-inf")),
            "g": torch.tensor(2.0, requires_grad=True),
            "h": True,
            "i": "text",
            "j": [1.0, float("nan")],
        }
    )
    assert out == {
        "a": 0.5,
        "b": 0.25,
        "c": 7,
        "d": None,
        "e": None,
        "f": None,
        "g": 2.0,
        "h": True,
        "i": "text",
        "j": [1.0, None],
    }
    assert type(out["a"]) is float and type(out["c"]) is int
    json.dumps(out, allow_nan=False)  # valid strict JSON


def test_jsonl_lines_valid_with_step_time_nan_null_and_round_trip(tmp_path):
    metrics = [
        {"train/reward_mean": 0.5, "train/loss": float("nan"), "n": torch.tensor(3)},
        {"train/reward_mean": np.float64(0.75), "train/kl": float("inf")},
    ]
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, metrics[0])
        # Flushed after every line: readable while the logger is still open.
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
        logger.log(2, metrics[1])

    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    lines = [json.loads(line) for line in text.splitlines()]  # each line valid JSON
    assert [rec["step"] for rec in lines] == [1, 2]
    assert all(isinstance(rec["time"], float) for rec in lines)
    assert lines[0]["train/loss"] is None and lines[1]["train/kl"] is None
    assert lines[0]["n"] == 3

    records = read_metrics(tmp_path / "metrics.jsonl")
    assert records == lines
    assert records[0]["train/reward_mean"] == 0.5
    assert records[1]["train/reward_mean"] == 0.75
    assert read_metrics(tmp_path) == lines  # a run directory works too


def test_tensorboard_event_files_contain_scalars(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 4):
            logger.log(step, {"train/reward_mean": 0.1 * step, "train/loss": float("nan")})
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    events = _scalar_events(tb_dir, "train/reward_mean")
    assert [s for s, _ in events] == [1, 2, 3]
    assert [v for _, v in events] == pytest.approx([0.1, 0.2, 0.3])
    assert _scalar_events(tb_dir, "train/loss") == []  # non-finite values are skipped


def test_cold_start_curves_go_by_their_own_step_in_tensorboard(tmp_path):
    """Every cold-start line is RL step 0: TensorBoard drew all of sft/loss at step 0."""
    with MetricsLogger(tmp_path) as logger:
        for sft_step in (100, 200, 300):
            logger.log(0, {"sft/step": sft_step, "sft/loss": 1.0 / sft_step, "time/sft": 1.0})
        logger.log(1, {"train/reward_mean": 0.5})
    tb_dir = tmp_path / "tensorboard"
    assert [s for s, _ in _scalar_events(tb_dir, "sft/loss")] == [100, 200, 300]
    assert [s for s, _ in _scalar_events(tb_dir, "time/sft")] == [100, 200, 300]  # (all at 0)
    assert [s for s, _ in _scalar_events(tb_dir, "train/reward_mean")] == [1]
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 0, 0, 1]  # the jsonl as before


def test_resume_step_truncates_then_appends(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in range(1, 6):
            logger.log(step, {"train/reward_mean": float(step)})
    # A crash mid-write leaves a truncated last line; resume must drop it too.
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "train/rew')

    with MetricsLogger(tmp_path, resume_step=3) as logger:
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
        for step in range(4, 7):
            logger.log(step, {"train/reward_mean": 10.0 * step})

    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["train/reward_mean"] for r in records] == [1, 2, 3, 40, 50, 60]
    assert not list(tmp_path.glob("*.tmp"))
    # TensorBoard: the first run's steps 4-5 are purged in favour of the resumed ones.
    events = dict(_scalar_events(tmp_path / "tensorboard", "train/reward_mean"))
    assert events == pytest.approx({1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0, 6: 60.0})


def test_fresh_run_replaces_existing_metrics(tmp_path):
    _write_jsonl(tmp_path / "metrics.jsonl", _records(3))
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"x": 1.0})
    assert [r["x"] for r in read_metrics(tmp_path)] == [1.0]


def test_read_metrics_skips_truncated_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2.0}\n{"step": 3, "a"', "utf-8")
    assert read_metrics(path) == [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}]
    # A corrupt line that is not the last one is an error, not silently dropped.
    path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a\n{"step": 3}\n', "utf-8")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_disabled_logger_writes_nothing(tmp_path):
    out = tmp_path / "run"
    with MetricsLogger(out, enabled=False, wandb={"project": "x"}) as logger:
        logger.log(1, {"train/reward_mean": 1.0})
        logger.close()
    assert not out.exists()


def test_log_after_close_raises(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.close()
    logger.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(1, {"a": 1.0})


@pytest.mark.parametrize(("sink", "extra"), [("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_optional_sink_gives_one_line_error(tmp_path, monkeypatch, sink, extra):
    # A None entry in sys.modules makes any import of the package raise ImportError,
    # whether or not it is installed here.
    monkeypatch.setitem(sys.modules, sink, None)
    out = tmp_path / "run"
    with pytest.raises(ValueError) as info:  # (gspo train says it in one line)
        MetricsLogger(out, **{sink: {"project": "p"}})
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"log.{extra}: ")
    assert f"pip install 'gspo[{extra}]'" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert not out.exists()  # failed before creating any file


def test_fake_wandb_sink_receives_finite_scalars_by_their_own_step(tmp_path, monkeypatch):
    """Each line is one W&B row with train/step; the cold start's lines (all RL step 0)
    are drawn by sft/step: logged with step=0 each, W&B merged them into one point."""
    calls = []

    class FakeRun:
        def define_metric(self, name, **kw):
            calls.append(("define", name, kw))

        def log(self, data, **kw):
            calls.append(("log", data, kw))

        def finish(self, exit_code=None):
            calls.append(("finish",))

    class FakeWandb:
        @staticmethod
        def init(**cfg):
            calls.append(("init", cfg))
            return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    with MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "p"}) as logger:
        logger.log(0, {"sft/step": 10, "sft/loss": 2.0})
        logger.log(0, {"sft/step": 20, "sft/loss": 1.5})
        logger.log(2, {"a": 1.0, "b": float("nan"), "s": "text"})
    assert calls[0] == ("init", {"project": "p", "config": {}}) and calls[-1] == ("finish",)
    rows = [c[1:] for c in calls if c[0] == "log"]
    assert rows == [
        ({"train/step": 0, "sft/step": 10, "sft/loss": 2.0}, {}),
        ({"train/step": 0, "sft/step": 20, "sft/loss": 1.5}, {}),
        ({"train/step": 2, "a": 1.0}, {}),
    ]
    defined = {c[1]: c[2] for c in calls if c[0] == "define"}
    assert defined == {
        "train/step": {"hidden": True},
        "sft/step": {"hidden": True},
        "sft/loss": {"step_metric": "sft/step"},
        "a": {"step_metric": "train/step"},
    }
    assert len(defined) == sum(c[0] == "define" for c in calls)  # each declared once


def test_fake_mlflow_gets_the_cold_starts_lines_by_sft_step(tmp_path, monkeypatch):
    logged = []

    class FakeMlflow:
        @staticmethod
        def start_run(**cfg):
            pass

        @staticmethod
        def log_metrics(metrics, step):
            logged.append((step, metrics))

        @staticmethod
        def end_run(status="FINISHED"):
            pass

    monkeypatch.setitem(sys.modules, "mlflow", FakeMlflow)
    with MetricsLogger(tmp_path, tensorboard=False, mlflow={}) as logger:
        logger.log(0, {"sft/step": 10, "sft/loss": 2.0})
        logger.log(3, {"train/loss": 0.5, "eval/accuracy": 0.25})
        logger.log(4, {"s": "text"})  # no finite scalar: nothing sent
    assert logged == [
        (10, {"sft/step": 10, "sft/loss": 2.0}),
        (3, {"train/loss": 0.5, "eval/accuracy": 0.25}),
    ]


class FakeTrackers:
    """Fake ``wandb`` and ``mlflow`` modules recording their calls; ``fail`` names the
    calls that raise (a server gone mid-run)."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple] = []
        self.fail: set[str] = set()
        self.ids = iter(["run-a", "run-b", "run-c", "run-d", "run-e"])
        self.gone: set[str] = set()  # MLflow runs deleted
        # (W&B runs' file directories: removed with the fake, not left in the temp dir)
        self.files = tempfile.TemporaryDirectory(prefix="fake-wandb-files-")
        for name in ENVIRONMENT.values():  # (recorded where a setting is not given)
            monkeypatch.delenv(name, raising=False)
        tracker = self

        class Run:
            def __init__(self, settings):
                self.id = settings.get("id") or next(tracker.ids)
                self.dir = tempfile.mkdtemp(dir=tracker.files.name)

            def define_metric(self, name, **kw):
                pass

            def log(self, row):
                tracker.record("wandb.log", row)

            def save(self, path, base_path, policy):
                tracker.record("wandb.save", Path(path).relative_to(base_path).as_posix())

            def finish(self, exit_code=None):
                tracker.record("wandb.finish", exit_code)

        class Wandb:
            @staticmethod
            def init(**settings):
                tracker.record("wandb.init", settings)
                return Run(settings)

        class Info:
            def __init__(self, run_id):
                self.run_id = run_id

        class Active:
            def __init__(self, run_id):
                self.info = Info(run_id)

        class Mlflow:
            @staticmethod
            def set_experiment(name):
                tracker.record("mlflow.set_experiment", name)

            @staticmethod
            def start_run(**cfg):
                tracker.record("mlflow.start_run", cfg)
                if cfg.get("run_id") in tracker.gone:
                    raise LookupError(f"Run '{cfg['run_id']}' not found")
                return Active(cfg.get("run_id") or next(tracker.ids))

            @staticmethod
            def log_params(params):
                tracker.record("mlflow.log_params", params)

            @staticmethod
            def log_metrics(metrics, step):
                tracker.record("mlflow.log_metrics", (step, metrics))

            @staticmethod
            def log_artifact(path, artifact_path=None):
                tracker.record("mlflow.log_artifact", (Path(path).name, artifact_path))

            @staticmethod
            def end_run(status="FINISHED"):
                tracker.record("mlflow.end_run", status)

        for name, module in (("wandb", Wandb), ("mlflow", Mlflow)):
            # (a spec, as a module's: transformers asks find_spec which are installed)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="fake")
            monkeypatch.setitem(sys.modules, name, module)

    def record(self, name, *args):
        if name in self.fail:
            raise ConnectionError(f"{name}: the server went away")
        self.calls.append((name, *args))

    def of(self, name):
        return [c[1:] for c in self.calls if c[0] == name]


def test_trackers_get_the_settings_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    """No tracker had the run's config (W&B's config, MLflow's parameters, TensorBoard);
    a resume started new tracker runs (MLflow: a second run holding steps twice)."""
    fake = FakeTrackers(monkeypatch)
    params = {"optim.lr": 1e-5, "reward.functions": ["math", "format"], "model.path": None}
    sinks = {"wandb": {"project": "p", "name": "mine"},
             "mlflow": {"experiment_name": "e", "run_name": "mine"}}  # fmt: skip
    with MetricsLogger(tmp_path, tensorboard=False, params=params, **sinks) as logger:
        logger.log(1, {"train/loss": 0.5})
    assert fake.of("wandb.init") == [({"project": "p", "name": "mine", "config": params},)]
    assert fake.of("mlflow.start_run") == [({"run_name": "mine"},)]
    assert fake.of("mlflow.log_params") == [
        ({"optim.lr": "1e-05", "reward.functions": '["math", "format"]', "model.path": "null"},)
    ]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {
        "wandb": {"id": "run-a", "project": "p", "entity": None, "environment": True},
        "mlflow": {
            "id": "run-b",
            "tracking_uri": None,
            "experiment_name": "e",
            "environment": True,
        },
    }
    fake.calls.clear()
    with MetricsLogger(tmp_path, tensorboard=False, params=params, resume_step=1, **sinks) as log:
        log.log(2, {"train/loss": 0.25})
    (init,) = fake.of("wandb.init")
    assert init[0]["id"] == "run-a" and init[0]["resume"] == "allow"
    assert fake.of("mlflow.start_run") == [({"run_id": "run-b"},)]  # (its name is the run's)
    assert fake.of("mlflow.log_params") == []  # (MLflow refuses a parameter changed)
    assert fake.of("mlflow.log_metrics") == [((2, {"train/loss": 0.25}),)]
    # names MLflow refuses (a reward.sources prefix key, a data_source's '+'): '_' for the rest
    fake.calls.clear()
    odd = {"reward.sources.my_code*": "code"}
    with MetricsLogger(tmp_path / "odd", tensorboard=False, params=odd, mlflow={}) as log:
        log.log(1, {"train/reward/by_source/a+b(c)": 1.0, "train/reward/by_source/aime:24": 0.5})
    assert fake.of("mlflow.log_params") == [({"reward.sources.my_code_": "code"},)]
    assert fake.of("mlflow.log_metrics") == [
        ((1, {"train/reward/by_source/a_b_c_": 1.0, "train/reward/by_source/aime:24": 0.5}),)
    ]
    # the user's own id wins; a fresh run in the directory starts new tracker runs
    fake.calls.clear()
    own = {"wandb": {"project": "p", "id": "mine"}}
    MetricsLogger(tmp_path, tensorboard=False, resume_step=2, **own).close()
    assert "resume" not in fake.of("wandb.init")[0][0]
    MetricsLogger(tmp_path, tensorboard=False, wandb={"project": "p"}).close()
    assert "id" not in fake.of("wandb.init")[1][0]


def test_a_tracker_off_at_one_resume_goes_on_in_its_run_at_the_next(tmp_path, monkeypatch):
    """trackers.json was written from the trackers on at each resume: W&B off at one, its
    run's id was gone and the next resume with it on started a second W&B run."""
    fake = FakeTrackers(monkeypatch)
    MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}).close()
    MetricsLogger(tmp_path, tensorboard=False, resume_step=0, mlflow={}).close()
    MetricsLogger(tmp_path, tensorboard=False, resume_step=0).close()
    fake.calls.clear()
    MetricsLogger(tmp_path, tensorboard=False, resume_step=0, wandb={}, mlflow={}).close()
    assert fake.of("wandb.init")[0][0]["id"] == "run-a"
    assert fake.of("mlflow.start_run") == [({"run_id": "run-b"},)]
    # a fresh run in the directory with no tracker: no ids left for a later resume
    MetricsLogger(tmp_path, tensorboard=False).close()
    assert not (tmp_path / "trackers.json").exists()


def test_a_resume_with_another_tracker_environment_starts_a_new_run_there(
    tmp_path, monkeypatch, capsys
):
    """WANDB_PROJECT (or MLFLOW_EXPERIMENT_NAME) changed between a run and its resume, no
    log.* key given: the resume continued the recorded id, which W&B took as a run of that
    id in the other project, unsaid. Now the variable's value is recorded and compared."""
    fake = FakeTrackers(monkeypatch)
    monkeypatch.setenv("WANDB_PROJECT", "a")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "e")
    MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}).close()
    assert json.loads((tmp_path / "trackers.json").read_text()) == {
        "wandb": {"id": "run-a", "project": "a", "entity": None, "environment": True},
        "mlflow": {
            "id": "run-b",
            "tracking_uri": None,
            "experiment_name": "e",
            "environment": True,
        },
    }
    capsys.readouterr()
    fake.calls.clear()
    MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}, resume_step=0).close()
    assert fake.of("wandb.init")[0][0]["id"] == "run-a"  # (the same environment: continued)
    assert fake.of("mlflow.start_run") == [({"run_id": "run-b"},)]
    monkeypatch.setenv("WANDB_PROJECT", "b")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    fake.calls.clear()
    MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}, resume_step=0).close()
    assert "id" not in fake.of("wandb.init")[0][0]
    assert fake.of("mlflow.start_run") == [({},)]
    assert capsys.readouterr().err.splitlines() == [
        "gspo: log.wandb: project changed since the run began (project='a'; WANDB_PROJECT='b' "
        "now): the steps from here go to a new W&B run; the earlier ones are in run run-a",
        "gspo: log.mlflow: experiment_name changed since the run began (experiment_name='e'; "
        "neither it nor MLFLOW_EXPERIMENT_NAME now): the steps from here go to a new MLflow "
        "run; the earlier ones are in run run-b",
    ]
    # an entry recorded without the environment's value (None) is continued, as it was
    (tmp_path / "trackers.json").write_text('{"wandb": {"id": "old", "project": null}}')
    fake.calls.clear()
    MetricsLogger(tmp_path, tensorboard=False, wandb={}, resume_step=0).close()
    assert fake.of("wandb.init")[0][0]["id"] == "old"


def test_a_run_begun_without_the_tracker_variable_and_resumed_with_it_starts_a_new_run(
    tmp_path, monkeypatch, capsys
):
    """Begun without WANDB_PROJECT (W&B's default project), resumed with WANDB_PROJECT=b:
    the recorded None was taken for an entry written before the environment was recorded,
    and the resume continued the id, a run of that id in project b, unsaid."""
    fake = FakeTrackers(monkeypatch)
    MetricsLogger(tmp_path, tensorboard=False, wandb={}).close()
    monkeypatch.setenv("WANDB_PROJECT", "b")
    fake.calls.clear()
    capsys.readouterr()
    MetricsLogger(tmp_path, tensorboard=False, wandb={}, resume_step=0).close()
    assert "id" not in fake.of("wandb.init")[0][0]
    assert capsys.readouterr().err.strip() == (
        "gspo: log.wandb: project changed since the run began (project=None; WANDB_PROJECT='b' "
        "now): the steps from here go to a new W&B run; the earlier ones are in run run-a"
    )


def test_a_resume_with_the_tracker_pointed_elsewhere_starts_a_new_run_there(
    tmp_path, monkeypatch, capsys
):
    """Another MLflow experiment (or tracking URI) at a resume: start_run was given the
    recorded run's id there, which MLflow refused, and the run did not train; a new run
    there gets the settings as its parameters (log.mlflow.run_id=null gave one without)."""
    fake = FakeTrackers(monkeypatch)
    params = {"optim.lr": 1e-5}
    first = {"experiment_name": "e"}
    MetricsLogger(tmp_path, tensorboard=False, params=params, mlflow=first).close()
    fake.calls.clear()
    moved = {"experiment_name": "f", "run_name": "again"}
    MetricsLogger(tmp_path, tensorboard=False, params=params, resume_step=0, mlflow=moved).close()
    assert fake.of("mlflow.start_run") == [({"run_name": "again"},)]
    assert fake.of("mlflow.log_params") == [({"optim.lr": "1e-05"},)]
    assert capsys.readouterr().err.strip() == (
        "gspo: log.mlflow: experiment_name changed since the run began (experiment_name='e'): "
        "the steps from here go to a new MLflow run; the earlier ones are in run run-a"
    )
    recorded = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert recorded == {
        "id": "run-b", "tracking_uri": None, "experiment_name": "f", "environment": True
    }  # fmt: skip
    # run_id=null asks for a new run: it gets the parameters too
    fake.calls.clear()
    fresh = {"experiment_name": "f", "run_id": None}
    MetricsLogger(tmp_path, tensorboard=False, params=params, resume_step=0, mlflow=fresh).close()
    assert fake.of("mlflow.start_run") == [({"run_id": None},)]
    assert fake.of("mlflow.log_params") == [({"optim.lr": "1e-05"},)]
    # the recorded run deleted: a warning and a new run, not a run that cannot resume
    fake.gone.add("run-c")
    fake.calls.clear()
    MetricsLogger(tmp_path, tensorboard=False, params=params, resume_step=0, mlflow=moved).close()
    assert [c[0] for c in fake.of("mlflow.start_run")] == [
        {"run_id": "run-c"},
        {},
    ]
    assert fake.of("mlflow.log_params") == [({"optim.lr": "1e-05"},)]
    assert capsys.readouterr().err.strip() == (
        "gspo: warning: log.mlflow: MLflow failed continuing run run-c (LookupError: Run "
        "'run-c' not found); the steps from here go to a new MLflow run"
    )


def test_a_cold_start_resumed_goes_on_in_its_tracker_runs_without_its_lines_twice(
    tmp_path, monkeypatch
):
    """A run resumed inside its cold start (no checkpoint step: resume_step=None) started
    new W&B and MLflow runs; the lines its cold start logs again are theirs already."""
    fake = FakeTrackers(monkeypatch)
    with MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}) as logger:
        logger.log(0, {"sft/step": 10, "sft/loss": 2.0})
    fake.calls.clear()
    with MetricsLogger(tmp_path, tensorboard=False, continues=True, wandb={}, mlflow={}) as log:
        log.log(0, {"sft/step": 10, "sft/loss": 2.0}, replayed=True)
        log.log(0, {"sft/step": 20, "sft/loss": 1.5})
    assert fake.of("wandb.init")[0][0]["id"] == "run-a"
    assert fake.of("mlflow.start_run") == [({"run_id": "run-b"},)]
    assert [row["sft/step"] for (row,) in fake.of("wandb.log")] == [20]
    assert fake.of("mlflow.log_metrics") == [((20, {"sft/step": 20, "sft/loss": 1.5}),)]
    assert [r["sft/step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [10, 20]
    # the recorded runs named by the settings' own ids, or by an earlier version's file
    # (ids alone): the same runs, which have the lines too
    (tmp_path / "trackers.json").write_text('{"wandb": "run-a", "mlflow": "run-b"}')
    for own in ({}, {"wandb": {"id": "run-a"}, "mlflow": {"run_id": "run-b"}}):
        fake.calls.clear()
        sinks = {"wandb": {}, "mlflow": {}} | own
        with MetricsLogger(tmp_path, tensorboard=False, continues=True, **sinks) as log:
            log.log(0, {"sft/step": 10, "sft/loss": 2.0}, replayed=True)
        assert fake.of("wandb.init")[0][0]["id"] == "run-a"
        assert fake.of("mlflow.start_run") == [({"run_id": "run-b"},)]
        assert fake.of("wandb.log") == fake.of("mlflow.log_metrics") == []


@pytest.mark.parametrize(
    ("stop", "status", "exit_code"),
    [(None, "FINISHED", 0), (KeyboardInterrupt, "KILLED", 1), (OSError, "FAILED", 1)],
)
def test_tracker_runs_end_with_how_the_run_ended(tmp_path, monkeypatch, stop, status, exit_code):
    """A run stopped by Ctrl-C ended its MLflow run FINISHED."""
    fake = FakeTrackers(monkeypatch)
    with (
        contextlib.suppress(KeyboardInterrupt, OSError),
        MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}),
    ):
        if stop is not None:
            raise stop
    assert fake.of("mlflow.end_run") == [(status,)]
    assert fake.of("wandb.finish") == [(exit_code,)]


def test_a_start_that_fails_ends_the_tracker_runs_it_began_as_failed(tmp_path, monkeypatch):
    """W&B started, then MLflow refused its settings: W&B's run ended with exit code 0."""
    fake = FakeTrackers(monkeypatch)
    fake.fail.add("mlflow.start_run")
    with pytest.raises(ValueError, match="^log.mlflow: MLflow refused these settings"):
        MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={})
    assert fake.of("wandb.finish") == [(1,)]


def test_a_tracker_failing_mid_run_is_one_warning_and_the_run_goes_on(
    tmp_path, monkeypatch, capsys
):
    """MLflow's run deleted, W&B's process killed: the run ended with tracebacks."""
    fake = FakeTrackers(monkeypatch)
    with MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}) as logger:
        logger.log(1, {"train/loss": 0.5})
        fake.fail.add("mlflow.log_metrics")
        logger.log(2, {"train/loss": 0.4})
        logger.log(3, {"train/loss": 0.3})
        fake.fail.add("wandb.finish")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "gspo: warning: log.mlflow: MLflow failed logging (ConnectionError: "
        "mlflow.log_metrics: the server went away); the run goes on without it "
        "(metrics.jsonl has every line)",
        "gspo: warning: log.wandb: W&B failed finishing its run (ConnectionError: "
        "wandb.finish: the server went away); the run goes on without it "
        "(metrics.jsonl has every line)",
    ]
    assert [row["train/step"] for (row,) in fake.of("wandb.log")] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    # (dropped: its run ended, so that the next run made in this process can start its own;
    # a gspo compare's next run was refused, MLflow's active run being the process's)
    assert fake.of("mlflow.end_run") == [("FINISHED",)]


def test_the_plots_and_config_go_to_the_trackers(tmp_path, monkeypatch):
    fake = FakeTrackers(monkeypatch)
    (tmp_path / "plots").mkdir()
    files = [tmp_path / "plots" / "reward.png", tmp_path / "config.yaml"]
    for path in files:
        path.write_text("x")
    with MetricsLogger(tmp_path, tensorboard=False, wandb={}, mlflow={}) as logger:
        logger.attach(files)
    # (W&B writes its own config.yaml into the run's files at the end: through the link
    # run.save makes, it would write over the run's, which --resume reads)
    assert fake.of("wandb.save") == [("plots/reward.png",), ("gspo_config.yaml",)]
    assert fake.of("mlflow.log_artifact") == [(("reward.png", "plots"),), (("config.yaml", None),)]


def test_a_resumed_runs_tensorboard_keeps_the_cold_start_and_its_settings(tmp_path):
    """The resume's purge (events past the checkpoint's step) hid every sft/* curve, drawn
    by sft/step (20, 40, ... > the step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, params={"optim.lr": 1e-5}) as logger:
        for s in (20, 40):
            logger.log(0, {"sft/step": s, "sft/loss": 2.0 - s / 40})
        for step in range(1, 7):
            logger.log(step, {"train/loss": 1.0 / step})
    with MetricsLogger(tmp_path, resume_step=4, params={"optim.lr": 1e-5}) as logger:
        for step in range(5, 9):
            logger.log(step, {"train/loss": 0.5 / step})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("sft/loss")] == [(20, 1.5), (40, 1.0)]
    train = [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")]
    assert train == [(s, round((1.0 if s <= 4 else 0.5) / s, 4)) for s in range(1, 9)]
    assert "config" in "".join(events.Tags()["tensors"])


def test_a_resume_past_the_cold_starts_steps_draws_each_of_its_points_once(tmp_path):
    """Resumed at step 100 (sft/step 20 and 40 before the purge's step, still drawn):
    written again, TensorBoard drew each of them twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for s in (20, 40, 200):
            logger.log(0, {"sft/step": s, "sft/loss": 1.0 / s})
        for step in (100, 101):
            logger.log(step, {"train/loss": 1.0})
    MetricsLogger(tmp_path, resume_step=100).close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("sft/loss")] == [20, 40, 200]
    assert [e.step for e in events.Scalars("train/loss")] == [100]


def test_a_resumes_event_file_is_read_after_the_runs_opened_the_same_second(tmp_path, monkeypatch):
    """TensorBoard reads event files in name order; a name is its second, host, pid and a
    per-process count as text: the 10th writer (count 9 -> 10) opened in the first's second
    sorted before it ('.10' < '.9'), so the resume's purge hid nothing (CI drew step 101
    twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(9))
    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"train/loss": float(step)})
    with MetricsLogger(tmp_path, resume_step=1) as logger:
        logger.log(2, {"train/loss": 20.0})
    names = sorted(p.name for p in (tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert [name.split(".")[-1] for name in names] == ["9", "10"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.0), (2, 20.0)]


def test_a_tracker_refusing_its_settings_is_one_line_naming_the_key(tmp_path, monkeypatch):
    class RetiredStore(Exception):
        pass

    class FakeMlflow:
        @staticmethod
        def set_tracking_uri(uri):
            raise RetiredStore(f"The filesystem tracking backend ({uri}) is in\nmaintenance mode")

    class FakeWandb:
        @staticmethod
        def init(**cfg):
            raise RuntimeError("project name invalid")

    monkeypatch.setitem(sys.modules, "mlflow", FakeMlflow)
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb)
    with pytest.raises(ValueError) as info:
        MetricsLogger(tmp_path / "a", mlflow={"tracking_uri": "file:/tmp/ml"})
    assert str(info.value) == (
        "log.mlflow: MLflow refused these settings (RetiredStore: The filesystem tracking "
        "backend (file:/tmp/ml) is in maintenance mode)"
    )
    with pytest.raises(ValueError, match=r"^log\.wandb: W&B refused these settings \(Runtime"):
        MetricsLogger(tmp_path / "b", wandb={"project": "?"})


def test_a_trackers_settings_are_checked_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """A key wandb.init or mlflow.start_run does not take (log.wandb.projct), or a project
    name W&B's own settings refuse, was found when the tracker started, after the model
    had loaded (minutes for a large one): now one line before it loads."""
    from gspo.cli import main

    for name in [*ENVIRONMENT.values(), "WANDB_MODE"]:
        monkeypatch.delenv(name, raising=False)

    class Settings:
        def __init__(self, project=None, entity=None, mode=None):
            if project is not None and "/" in project:
                raise ValueError(f"Invalid project name {project!r}: cannot contain '/'")

    class Wandb:
        @staticmethod
        def init(project=None, entity=None, name=None, config=None, id=None, resume=None):
            raise AssertionError("not reached")

    class Mlflow:
        @staticmethod
        def start_run(run_id=None, experiment_id=None, run_name=None, tags=None):
            raise AssertionError("not reached")

    Wandb.Settings = Settings
    for name, module in (("wandb", Wandb), ("mlflow", Mlflow)):
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, origin="fake")
        monkeypatch.setitem(sys.modules, name, module)

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("gspo.trainer.build_policy_model", loaded)
    run = ["train", "--output-dir", str(tmp_path / "run"), "model.device=cpu"]
    assert main([*run, "log.wandb={projct: p}"]) == 2
    assert main([*run, "log.wandb={project: a/b}"]) == 2
    assert main([*run, "log.mlflow={experiment_name: e, run_nam: r}"]) == 2
    monkeypatch.setenv("WANDB_PROJECT", "c/d")  # (what wandb.init reads without one)
    assert main([*run, "log.wandb={name: r}"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: log.wandb.projct: wandb.init takes no such keyword (did you mean "
        "log.wandb.project?)",
        "gspo: error: log.wandb: W&B refused these settings (ValueError: Invalid project name "
        "'a/b': cannot contain '/')",
        "gspo: error: log.mlflow.run_nam: mlflow.start_run takes no such keyword (did you mean "
        "log.mlflow.run_name?)",
        "gspo: error: log.wandb: W&B refused these settings (ValueError: Invalid project name "
        "'c/d': cannot contain '/')",
    ]
    assert not (tmp_path / "run").exists()


def test_an_mlflow_tracking_uri_without_a_store_is_said_before_the_model_loads(
    tmp_path, monkeypatch, capsys
):
    """mlflow-skinny's own default URI (sqlite:///mlflow.db, which it has no store for), or
    a URI of no known scheme, was refused when the tracker started, after the model load,
    as 'Model registry functionality is unavailable'. A fake MLflow package with the
    registry of stores the check looks the scheme up in (MLflow's internal one)."""
    from gspo.cli import main

    package = tmp_path / "fake" / "mlflow"
    (package / "tracking" / "_tracking_service").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import os\n"
        "def get_tracking_uri():\n"
        "    return os.environ.get('MLFLOW_TRACKING_URI') or 'sqlite:///mlflow.db'\n"
        "def start_run(run_id=None, run_name=None):\n"
        "    raise AssertionError('not reached')\n"
    )
    (package / "tracking" / "__init__.py").write_text("")
    (package / "tracking" / "_tracking_service" / "__init__.py").write_text("")
    (package / "tracking" / "_tracking_service" / "utils.py").write_text(
        "class Registry:\n"
        "    def get_store_builder(self, uri):\n"
        "        if uri.split(':')[0] not in ('file', 'http', 'https'):\n"
        "            raise LookupError(f'Model registry functionality is unavailable: {uri}')\n"
        "_tracking_store_registry = Registry()\n"
    )
    for name in [m for m in sys.modules if m == "mlflow" or m.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("gspo.trainer.build_policy_model", loaded)
    run = ["train", "--output-dir", str(tmp_path / "run"), "model.device=cpu"]
    assert main([*run, "log.mlflow=true"]) == 2
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "foo://bar")
    assert main([*run, "log.mlflow=true"]) == 2
    assert main([*run, "log.mlflow={tracking_uri: http://127.0.0.1:1, run_nam: x}"]) == 2
    where = "from log.mlflow.tracking_uri, else MLFLOW_TRACKING_URI, else MLflow's default"
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: log.mlflow: MLflow has no tracking store for the URI "
        f"'sqlite:///mlflow.db' ({where}; a database's needs the mlflow package, not "
        "mlflow-skinny)",
        f"gspo: error: log.mlflow: MLflow has no tracking store for the URI 'foo://bar' ({where})",
        "gspo: error: log.mlflow.run_nam: mlflow.start_run takes no such keyword (did you mean "
        "log.mlflow.run_name?)",
    ]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------ plots


@pytest.fixture
def saved_figures(monkeypatch):
    """The matplotlib figures saved during the test, in order (drawn as usual too)."""
    from matplotlib.figure import Figure

    saved = []
    original = Figure.savefig

    def spy(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return saved


def test_plot_metrics_writes_expected_pngs(tmp_path):
    metrics = _write_jsonl(tmp_path / "metrics.jsonl", _records(20))
    paths = plot_metrics(metrics, tmp_path / "plots")
    names = [p.name for p in paths]
    assert names == ["reward.png", "accuracy.png", "clip_fraction.png"]
    for p in paths:
        _assert_png(p)
    # the mismatch (on each rollout batch's first minibatch) and a MoE run's expert churn
    more = [
        {**r, "mismatch/token_abs_mean": 1e-3, "mismatch/sequence_mean_delta_abs_mean": 2e-4}
        if r["step"] % 4 == 1
        else r
        for r in _records(20)
    ]
    more = [{**r, "moe/expert_change_fraction": 0.01 * r["step"]} for r in more]
    metrics = _write_jsonl(tmp_path / "more.jsonl", more)
    paths = plot_metrics(metrics, tmp_path / "more")
    assert [p.name for p in paths][3:] == ["mismatch.png", "expert_change.png"]
    for p in paths:
        _assert_png(p)


def test_a_rollout_batchs_figures_are_one_point_at_its_last_step(tmp_path, saved_figures):
    """The reward is on each of a batch's 4 minibatch lines (a staircase of 4 equal
    points), the mismatch on the first, the clip fractions on the last: each plot now
    draws one point per rollout batch, all at the batch's last step."""
    lines = []
    for s in range(1, 13):
        batch, k = (s - 1) // 4, (s - 1) % 4
        line = {"step": s, "train/rollout": batch, "train/minibatch": k,
                "train/reward_mean": 0.1 * (batch + 1), "train/reward_std": 0.1}  # fmt: skip
        if k == 0:
            line["mismatch/token_abs_mean"] = 1e-3 * (batch + 1)
        if k == 3:
            line["train/clip_fraction_on_policy"] = 0.01 * batch
        lines.append(line)
    lines.append({"step": 12, "eval/accuracy": 0.5})
    plot_metrics(_write_jsonl(tmp_path / "metrics.jsonl", lines), tmp_path / "plots")
    drawn = {fig.axes[0].get_title(): fig.axes[0].get_lines() for fig in saved_figures}
    reward = drawn["Training reward"][0]
    assert list(reward.get_xdata()) == [4, 8, 12]
    assert list(reward.get_ydata()) == pytest.approx([0.1, 0.2, 0.3])
    (mismatch,) = drawn["Sampler vs trainer log-probs per rollout batch"]
    (clip,) = drawn["Clipped token fraction per rollout batch"]
    assert list(mismatch.get_xdata()) == list(clip.get_xdata()) == [4, 8, 12]
    assert list(drawn["Evaluation accuracy"][0].get_xdata()) == [12]


def test_plot_metrics_skips_missing_keys_and_handles_nulls(tmp_path):
    recs = [
        {
            "step": s,
            "train/reward_mean": None if s == 3 else 0.1 * s,
            "train/clip_fraction_on_policy": 0.0,
        }
        for s in range(1, 8)
    ]
    metrics = _write_jsonl(tmp_path / "metrics.jsonl", recs)
    paths = plot_metrics(metrics, tmp_path / "plots")
    assert [p.name for p in paths] == ["reward.png", "clip_fraction.png"]  # all-zero clip ok
    assert not (tmp_path / "plots" / "accuracy.png").exists()
    for p in paths:
        _assert_png(p)


def test_plot_series_returns_none_without_data(tmp_path):
    out = tmp_path / "none.png"
    assert plot_series(_records(5), ["missing/key"], out, title="t", ylabel="y") is None
    assert not out.exists()
    logy = plot_series(
        _records(5), ["train/clip_fraction"], tmp_path / "c.png", title="t", ylabel="y", logy=True
    )
    _assert_png(logy)


def test_plot_runs_overlays_two_runs(tmp_path, saved_figures):
    runs = {"gspo": _records(10), "grpo": _records(8), "other": [{"step": 1, "x": 1.0}]}
    path = plot_runs(runs, "train/reward_mean", tmp_path / "cmp.png", title="reward")
    _assert_png(path)
    (ax,) = saved_figures[0].axes
    assert [line.get_label() for line in ax.get_lines()] == ["gspo", "grpo"]
    assert len(ax.get_lines()[1].get_xdata()) == 8
    assert plot_runs(runs, "missing", tmp_path / "none.png") is None


def test_a_long_title_is_wrapped_inside_the_figure(tmp_path, saved_figures):
    """A title as long as the command behind a plot stays within the saved figure."""
    title = "Expert change (python experiments/moe_shape.py claim --experts 128 " * 2
    plot_runs({"a": _records(6)}, "train/reward_mean", tmp_path / "t.png", title=title)
    fig = saved_figures[0]
    text = fig.axes[0].title
    assert text.get_text().count("\n") >= 1
    box, frame = text.get_window_extent(), fig.bbox
    assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and box.y1 <= frame.y1


# ------------------------------------------------------------------- summary / progress


def _render(renderable) -> str:
    console = Console(file=io.StringIO(), width=120, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_summary_table_first_last_and_mean_values():
    recs = _records(20, clip_zero_every=3)
    recs[-1]["time/step_seconds"] = 1.5
    recs[0]["time/step_seconds"] = 2.5
    table = summary_table(recs, title="My run")
    text = _render(table)
    assert "My run" in text
    rows = {}
    for line in text.splitlines():
        if "│" in line:
            label, *cells = (c.strip() for c in line.split("│")[1:-1])
            rows[label] = tuple(cells)
    assert rows == {
        "reward (train)": ("0.13", "0.7", "0.415", "1 → 20"),
        "accuracy (eval)": ("0.25", "0.4", "0.325", "5 → 20"),
        "accuracy (eval, greedy)": ("0.3", "0.45", "0.375", "5 → 20"),
        "clip fraction, off-policy": ("0.04", "0.2", "0.12", "4 → 20"),
        "clip fraction, on-policy": ("0.0004", "0.002", "0.0012", "4 → 20"),
        "response length": ("299", "280", "289.5", "1 → 20"),
        "seconds / step (no eval)": ("2.5", "1.5", "2", "1 → 20"),
    }
    assert table.row_count == 7


def test_summary_table_shows_an_environments_turns_valid_tool_calls_and_expert_churn():
    recs = [
        {"step": 1, "env/turns_mean": 1.5, "env/tool_call_valid_fraction": 0.25},
        {"step": 2, "env/turns_mean": 2.5},  # a batch with no tool call: no valid fraction
        {"step": 3, "env/turns_mean": 3.5, "env/tool_call_valid_fraction": 0.75},
        {"step": 3, "moe/expert_change_fraction": 0.02, "moe/expert_change_fraction/layer_0": 1},
        {"step": 4, "moe/expert_change_fraction": 0.04, "train/minibatch": 0},
        # two updates after the rollout: not one update's churn
        {"step": 5, "moe/expert_change_fraction": 0.5, "train/minibatch": 1},
    ]
    rows = {
        cells[0]: tuple(cells[1:])
        for line in _render(summary_table(recs)).splitlines()
        if "│" in line
        for cells in [[c.strip() for c in line.split("│")[1:-1]]]
    }
    assert rows["turns / episode"] == ("1.5", "3.5", "2.5", "1 → 3")
    assert rows["tool calls valid"] == ("0.25", "0.75", "0.5", "1 → 3")
    assert rows["expert churn, one update (MoE)"] == ("0.02", "0.04", "0.03", "3 → 4")


def test_summary_table_derives_step_time_and_skips_absent():
    recs = [{"step": s, "time": 100.0 + 3.0 * s, "train/reward_mean": 1.0} for s in range(1, 4)]
    text = _render(summary_table(recs))
    assert "seconds / step (wall)" in text and "3" in text
    assert "accuracy" not in text and "clip" not in text and "turns" not in text
    assert "no metrics" in _render(summary_table([]))
    console = Console(file=io.StringIO(), width=120)
    print_summary(recs, console=console)
    assert "reward (train)" in console.file.getvalue()


def test_progress_plain_lines_when_not_a_terminal():
    console = Console(file=io.StringIO(), width=200)  # a StringIO is not a terminal
    recs = _records(40, eval_every=10, clip_zero_every=3)
    with TrainingProgress(40, console=console) as progress:
        for rec in recs:
            progress.update(rec["step"], rec)
    lines = console.file.getvalue().splitlines()
    # First step, then every max(1, 40 // 20) = 2 steps, through the last.
    assert [int(line.split()[1].split("/")[0]) for line in lines] == [1, *range(2, 41, 2)]
    assert lines[-1].startswith("step 40/40 (100%)")
    assert "reward 1.3" in lines[-1] and "eval acc 0.6" in lines[-1]
    # the last rollout batch's clip fractions, not the last minibatch's (0.04 at step 40)
    assert "clip off-policy 0.4, on-policy 0.004" in lines[-1] and "s/step" in lines[-1]
    assert "clip 0.001" in lines[0]  # step 1: no rollout batch's yet, the minibatch's
    assert "eval acc" not in lines[1]  # no eval yet at step 2
    # step 12: kept from the step-10 eval line, saying so (it read as step 12's)
    assert "eval acc 0.3 (step 10) |" in lines[6]
    assert "eval acc 0.6 |" in lines[-1]  # (step 40's own: no step named)
    assert progress.accuracy == pytest.approx(0.6)
    # a stale batch (rollout.max_staleness) has no on-policy minibatch: batch 0's figure
    # stayed on every later line as if it were theirs
    progress = TrainingProgress(8, console=Console(file=io.StringIO(), width=200))
    off, on = "train/clip_fraction_off_policy", "train/clip_fraction_on_policy"
    progress.record({off: 0.2, on: 0.09})
    assert progress.stats_text() == "clip off-policy 0.2, on-policy 0.09"
    progress.record({off: 0.3})
    assert progress.stats_text() == "clip off-policy 0.3"


def test_progress_prints_about_twenty_lines_when_steps_come_several_at_a_time():
    """The loop reports once per rollout batch, its minibatches' steps at once (4 here):
    with 384 steps a line every 19 steps would be printed only at multiples of 76. A line
    comes each time a multiple of 19 is reached or passed, and at the end."""
    console = Console(file=io.StringIO(), width=200)
    with TrainingProgress(384, console=console) as progress:
        for step in range(4, 385, 4):
            progress.update(step, {"train/reward_mean": 0.5})
    steps = [int(line.split()[1].split("/")[0]) for line in console.file.getvalue().splitlines()]
    assert steps[0] == 4 and steps[-1] == 384 and len(steps) == len(set(steps))
    assert 19 <= len(steps) <= 22, steps
    assert all(b - a <= 20 for a, b in itertools.pairwise(steps)), steps


def test_progress_shows_the_starting_evaluation_from_the_first_line():
    """The evaluation before the first step is recorded, not shown: the first line (step 4
    here) carries its accuracy until the next evaluation."""
    console = Console(file=io.StringIO(), width=200)
    with TrainingProgress(8, console=console) as progress:
        progress.record({"eval/accuracy": 0.533, "step": 0})
        assert console.file.getvalue() == ""
        progress.update(4, {"train/reward_mean": 0.6})
        progress.update(8, {"train/reward_mean": 0.7, "eval/accuracy": 0.9})
    first, last = console.file.getvalue().splitlines()
    assert "eval acc 0.533" in first and "eval acc 0.9" in last


def test_progress_live_bar_on_terminal_and_disabled():
    console = Console(file=io.StringIO(), force_terminal=True, width=200, color_system=None)
    with TrainingProgress(10, console=console, start_step=5) as progress:
        for step in range(6, 11):
            metrics = {"train/reward_mean": 0.5, "eval/accuracy": 0.75}
            progress.update(step, {**metrics, "train/clip_fraction": 0.25})
    out = console.file.getvalue()
    assert "10/10" in out and "reward 0.5" in out and "eval acc 0.75" in out
    assert "clip 0.25" in out  # lines without the rollout batch's clip fractions
    # a 100-column terminal: the counts, times and figures all shown, the figures wrapped
    # (the step count and times were cut to "…" and the figures' end lost before)
    narrow = Console(file=io.StringIO(), force_terminal=True, width=100, color_system=None)
    with TrainingProgress(200, console=narrow, start_step=43) as progress:
        progress.update(44, {**metrics, "train/clip_fraction_off_policy": 0.3812,
                             "train/clip_fraction_on_policy": 0.0})  # fmt: skip
        progress._progress.refresh()
    last = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", narrow.file.getvalue().split("\r")[-1])
    words = " ".join(last.split())
    assert "…" not in last and "44/200" in words and "eta" in words
    assert "clip off-policy 0.3812, on-policy 0 |" in words and words.endswith("s/step")

    quiet = Console(file=io.StringIO())
    with TrainingProgress(10, enabled=False, console=quiet) as progress:
        progress.update(1, {"train/reward_mean": 1.0})
    assert quiet.file.getvalue() == ""


def test_import_is_cheap():
    # Load the telemetry package on its own (under a bare stand-in for the gspo package,
    # whose __init__ pulls in torch): it must import nothing heavy at import time, and
    # nothing of gspo outside itself.
    import gspo

    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('gspo'); pkg.__path__ = {list(gspo.__path__)!r}\n"
        "sys.modules['gspo'] = pkg\n"
        "import gspo.telemetry\n"
        "heavy = ['torch', 'numpy', 'matplotlib', 'rich', 'transformers', 'wandb']\n"
        "print([m for m in heavy if m in sys.modules])\n"
        "print(sorted(m for m in sys.modules if m.startswith('gspo.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    heavy, loaded = out.stdout.strip().splitlines()
    assert heavy == "[]"
    modules = ast.literal_eval(loaded)
    assert all(m == "gspo.telemetry" or m.startswith("gspo.telemetry.") for m in modules)
    assert "gspo.telemetry.plots" in modules  # the package's own modules did load


def test_nan_in_every_sink_never_breaks_plots(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        for s in range(1, 6):
            logger.log(s, {"train/reward_mean": math.nan if s == 2 else float(s)})
    paths = plot_metrics(tmp_path, tmp_path)
    assert [p.name for p in paths] == ["reward.png"]


# ------------------------------------------------------- clip fraction per rollout batch


@pytest.mark.slow
def test_clip_fraction_per_rollout_batch_in_metrics_progress_summary_and_plot(
    tmp_path, varied_reward, capsys
):
    """Minibatch 0 of each rollout batch is on-policy (ratio 1): one minibatch's clip
    fraction read 0 -> 0 in the summary. Logged per rollout batch now, on its last line:
    the on-policy one is minibatch 0's, the off-policy one the token-weighted mean of
    minibatches 1-3; the progress line and the summary show both, the plot draws both."""
    from test_trainer import FAST, run_metrics, train_lines

    from gspo.cli import main

    overrides = [*FAST, varied_reward, "model.device=cpu", "train.cold_start_steps=0"]
    overrides += ["algorithm.minibatches=4", "train.max_steps=12", "optim.lr=1e-3"]
    overrides += ["eval.every=0", "log.progress=true", "log.plots=true"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) == 0
    out = capsys.readouterr().out
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert [r["train/minibatch"] for r in lines] == [0, 1, 2, 3] * 3
    on_key, off_key = "train/clip_fraction_on_policy", "train/clip_fraction_off_policy"
    batches = [lines[i : i + 4] for i in range(0, 12, 4)]
    for batch in batches:
        assert not any(on_key in r or off_key in r for r in batch[:3])  # on the last line
        last, rest = batch[-1], batch[1:]
        assert last[on_key] == batch[0]["train/clip_fraction"]
        tokens = sum(r["train/tokens"] for r in rest)
        clipped = sum(r["train/clip_fraction"] * r["train/tokens"] for r in rest)
        assert last[off_key] == pytest.approx(clipped / tokens)
    assert all(b[0]["train/clip_fraction"] == 0 for b in batches)  # float32: on-policy
    assert all(b[-1][off_key] > 0.05 for b in batches)  # the clip range acts off-policy
    # the run summary: off-policy first -> last, and on-policy apart
    first, final = batches[0][-1], batches[-1][-1]
    rows = {
        cells[0]: cells[1:4]
        for row in out.splitlines()
        if "│" in row
        for cells in [[c.strip() for c in row.split("│")[1:-1]]]
    }
    off = [b[-1][off_key] for b in batches]
    assert rows["clip fraction, off-policy"] == [
        f"{first[off_key]:.4g}",
        f"{final[off_key]:.4g}",
        f"{sum(off) / len(off):.4g}",  # the mean over the rollout batches
    ]
    assert rows["clip fraction, on-policy"] == ["0", "0", "0"]
    # the progress line: the last rollout batch's clip fractions
    progress = [line for line in out.splitlines() if line.startswith("step 12/12")]
    assert f"clip off-policy {final[off_key]:.4g}, on-policy 0 " in progress[-1]
    _assert_png(tmp_path / "run" / "plots" / "clip_fraction.png")


def test_rollout_clip_fractions_of_a_stale_batch_are_all_off_policy():
    from gspo.training.metrics import rollout_clip_fractions

    lines = [
        {"train/minibatch": k, "train/clip_fraction": c, "train/tokens": t}
        for k, (c, t) in enumerate([(0.1, 10.0), (0.5, 30.0), (0.0, 0.0)])
    ]
    assert rollout_clip_fractions(lines) == {
        "train/clip_fraction_on_policy": pytest.approx(0.1),
        "train/clip_fraction_off_policy": pytest.approx(0.5),  # the empty minibatch weighs 0
    }
    assert rollout_clip_fractions(lines, staleness=1) == {
        "train/clip_fraction_off_policy": pytest.approx(16 / 40)
    }
    assert rollout_clip_fractions(lines[:1]) == {"train/clip_fraction_on_policy": 0.1}


def test_a_line_equal_to_an_earlier_one_is_dashed_and_says_so(tmp_path, saved_figures):
    """gspo compare's GSPO-token line equals GSPO's (one advantage per response) and hid it
    in every plot: the legend listed GSPO, the figure showed no GSPO line."""
    from gspo.telemetry import plot_bands

    seeds = [_records(10), [{**r, "train/reward_mean": 0.5} for r in _records(10)]]
    groups = {"GSPO": seeds, "GRPO": seeds[:1], "GSPO-token": seeds}
    _assert_png(plot_bands(groups, "train/reward_mean", tmp_path / "r.png"))
    (ax,) = saved_figures[0].axes
    labels = [line.get_label() for line in ax.get_lines()]
    assert labels == ["GSPO", "GRPO", "GSPO-token (= GSPO)"]
    styles = [line.get_linestyle() for line in ax.get_lines()]
    assert styles[:2] == ["-", "-"] and styles[2] != "-"
    assert len(ax.collections) == 1  # GSPO's band once (GRPO: one seed, no band)


def test_step_axes_tick_whole_steps(tmp_path, saved_figures):
    """A 3-step run's axis read 1.00, 1.25, 1.50, ...: steps are whole."""
    plot_series(_records(3), ["train/reward_mean"], tmp_path / "r.png", title="t", ylabel="y")
    ticks = saved_figures[0].axes[0].get_xticks()
    assert len(ticks) >= 3 and all(t == int(t) for t in ticks)


def test_a_folder_named_like_an_optional_tracker_is_not_taken_for_it(tmp_path, monkeypatch):
    """A project folder named like a tracker package that is not installed (a `wandb/` of
    run logs) imported as a namespace package once its directory was on sys.path (a reward
    file's is): the run then failed inside the tracker's calls, not with the install hint."""
    from gspo.telemetry.trackers import import_optional

    (tmp_path / "gspo_no_such_tracker").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="'gspo_no_such_tracker' package is not installed"):
        import_optional("gspo_no_such_tracker", "Tracker", "wandb")
    assert import_optional("json", "JSON", "x").__name__ == "json"  # (an installed one)


def test_a_tensorboard_writer_waits_at_most_a_second_for_a_later_dated_event_file(
    tmp_path, monkeypatch
):
    """An event file dated ahead of this host's clock (written on another node, its clock
    ahead) made the writer sleep until that second: an hour ahead, an hour's hang."""
    import time

    from gspo.telemetry import trackers

    slept: list[float] = []
    monkeypatch.setattr(trackers.time, "sleep", slept.append)
    ahead = int(time.time()) + 3600
    (tmp_path / f"events.out.tfevents.{ahead}.othernode.1.0").touch()
    trackers._after_earlier_event_files(tmp_path)
    assert len(slept) == 1 and 0 < slept[0] <= 1.0
