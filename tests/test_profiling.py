"""``log.profile_steps``: the profiled rollout batch's trace and summary, and nothing else
about the run changed by it."""

from __future__ import annotations

import gzip
import json

import pytest
from test_trainer import FAST, comparable, run_metrics, train_lines

from gspo.config import ConfigError, load_config
from gspo.telemetry.profiling import profiled_steps, summary_text, trace_figures
from gspo.trainer import Trainer


def test_the_batch_that_takes_a_listed_step_is_profiled():
    assert profiled_steps(0, 4, [1]) == (1, 4)
    assert profiled_steps(1, 4, [8]) == (5, 8)
    assert profiled_steps(1, 4, [4, 9]) is None
    assert profiled_steps(2, 1, [3]) == (3, 3)


def kernel(ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur}


def test_device_busy_is_the_union_of_the_kernels_and_waits_are_counted():
    trace = {
        "traceEvents": [
            kernel(0, 100),
            kernel(50, 100, "gpu_memcpy"),  # overlaps the first: 150 us together
            kernel(400, 50, "gpu_memset"),
            kernel(410, 10),  # inside the one before
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 0,
             "dur": 2000},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
            {"ph": "X", "cat": "user_annotation", "name": "time/train", "ts": 0, "dur": 3e5},
            {"ph": "X", "cat": "user_annotation", "name": "time/train", "ts": 1, "dur": 1e5},
            {"ph": "X", "cat": "user_annotation", "name": "other", "ts": 0, "dur": 1e6},
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
        ]
    }  # fmt: skip
    figures = trace_figures(trace, wall=0.002)
    assert figures.device_busy == pytest.approx(200e-6)
    assert (figures.host_waits, figures.host_wait_seconds) == (1, pytest.approx(2e-3))
    assert figures.stages == {"time/train": pytest.approx(0.4)}
    text = summary_text("t", figures, [("ops", "a table")])
    assert "0.000 s, 10.0% of the wall time" in text and "| time/train | 0.400 |" in text
    cpu = trace_figures({"traceEvents": [trace["traceEvents"][6]]}, wall=1.0)
    assert cpu.device_busy is None and cpu.host_waits is None
    assert "device busy" not in summary_text("t", cpu, [])


def test_a_profiled_run_writes_its_trace_and_summary_and_trains_the_same(
    tmp_path, ones_reward, capsys
):
    common = [*FAST, ones_reward, "train.cold_start_steps=0", "algorithm.minibatches=2",
              "train.max_steps=6"]  # fmt: skip
    Trainer(load_config(None, common), tmp_path / "plain").fit()
    Trainer(load_config(None, [*common, "log.profile_steps=[4]"]), tmp_path / "run").fit()
    # the profiler changes no number the run computes
    plain = [comparable(r) for r in train_lines(run_metrics(tmp_path / "plain"))]
    profiled = [comparable(r) for r in train_lines(run_metrics(tmp_path / "run"))]
    assert profiled == plain and len(plain) == 6
    where = tmp_path / "run" / "profile"
    assert [p.name for p in where.iterdir()] == ["steps_3-4"]  # the batch that takes step 4
    summary = (where / "steps_3-4" / "summary.md").read_text()
    assert summary.startswith("# optimizer steps 3-4")
    for stage in ("time/generate", "time/reward", "time/train"):
        assert f"| {stage} |" in summary
    assert "## self CPU time" in summary and "aten::" in summary
    with gzip.open(where / "steps_3-4" / "trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"time/generate", "time/train"} <= names
    assert not (where / "steps_3-4" / "trace.json").exists()
    err = capsys.readouterr().err
    assert err.count("gspo: profiled steps 3-4:") == 1


def test_profile_steps_are_counted_from_one_and_one_past_the_run_is_warned():
    assert load_config(None, ["log.profile_steps=8"]).log.profile_steps == [8]
    with pytest.raises(ConfigError, match="log.profile_steps"):
        load_config(None, ["log.profile_steps=[0, 2]"])
    config = load_config(None, ["log.profile_steps=[2, 500]", "train.max_steps=8"])
    assert any("log.profile_steps: step 500 is past" in w for w in config.warnings())
    assert not any("profile" in w for w in load_config(None, ["log.profile_steps=2"]).warnings())
