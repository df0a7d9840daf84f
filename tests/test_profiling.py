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


def test_the_tables_take_kernels_by_device_time_and_operators_by_self_time():
    """``op_tables`` reads the exported trace: kernels summed by name; an operator's self
    time is its own less the operators it called, on its own thread (a second thread's
    operator at the same time is not its child)."""
    from gspo.telemetry.profiling import op_tables

    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 0,
                "tid": tid}  # fmt: skip

    events = [
        op("aten::linear", 0, 100), op("aten::matmul", 10, 60), op("aten::mm", 20, 40),
        op("aten::add", 80, 10), op("aten::linear", 200, 50), op("aten::mm", 20, 30, tid=2),
        kernel(0, 30), kernel(40, 10), {**kernel(60, 5, "gpu_memcpy"), "name": "copy"},
    ]  # fmt: skip
    (device_head, device), (host_head, host) = op_tables({"traceEvents": events})
    assert device_head == "device time by kernel" and host_head == "self CPU time"
    rows = [line.split() for line in device.splitlines()[1:]]
    assert rows == [["0.040", "88.9%", "2", "k"], ["0.005", "11.1%", "1", "copy"]]
    rows = {line.split()[3]: line.split()[:3] for line in host.splitlines()[1:]}
    # linear: 100 - 60 - 10 + 50; matmul: 60 - 40; mm: 40 + 30 (the other thread's)
    assert rows == {
        "aten::linear": ["0.080", "44.4%", "2"], "aten::mm": ["0.070", "38.9%", "2"],
        "aten::matmul": ["0.020", "11.1%", "1"], "aten::add": ["0.010", "5.6%", "1"],
    }  # fmt: skip
    cpu_only = op_tables({"traceEvents": events[:6]})
    assert [head for head, _ in cpu_only] == ["self CPU time"]


def test_each_stage_owns_the_kernels_its_thread_launched_inside_its_mark():
    """``stage_kernels``: a kernel goes to the innermost ``time/*`` mark holding, on the
    launching thread, its launch (same ``correlation``; a runtime or a driver call),
    wherever the kernel itself ran (asynchronously, later); a launch from a thread without
    marks (autograd's, backward on CUDA) to the training thread's marks, not to a shorter
    one of another thread (an async producer's); unlaunched ones by their own start;
    others left out. The summary's stage table then says each stage's kernel seconds."""
    from gspo.telemetry.profiling import stage_kernels

    def mark(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur,
                "pid": 0, "tid": tid}  # fmt: skip

    def launch(ts, corr, tid=1, cat="cuda_runtime"):
        return {"ph": "X", "cat": cat, "name": "cudaLaunchKernel", "ts": ts,
                "dur": 1, "pid": 0, "tid": tid, "args": {"correlation": corr}}  # fmt: skip

    def ran(name, ts, dur, corr=None):
        args = {} if corr is None else {"correlation": corr}
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 1,
                "tid": 7, "args": args}  # fmt: skip

    events = [
        mark("time/generate", 0, 100), mark("time/train", 100, 100),
        mark("time/old_logprobs", 110, 20),  # inside time/train: the innermost wins
        mark("time/reward", 0, 300, tid=2),  # another thread's: its launches only
        launch(10, 1), ran("decode", 50, 30, 1), launch(90, 2), ran("decode", 120, 40, 2),
        launch(115, 3), ran("head", 125, 5, 3), launch(150, 4), ran("mm", 400, 10, 4),
        launch(20, 5, tid=2), ran("score", 60, 2, 5),
        ran("fill", 105, 3),  # no launch recorded: by its own start (time/train, tid 1 or 2)
        launch(250, 6), ran("late", 260, 1, 6),  # launched outside every mark of thread 1
        mark("time/generate", 155, 20, tid=2),  # a producer sampling ahead, meanwhile
        launch(160, 7, tid=3), ran("backward", 165, 4, 7),  # autograd's thread: no marks
        launch(170, 8, cat="cuda_driver"), ran("triton_fused", 171, 6, 8),  # (cuLaunchKernel)
    ]  # fmt: skip
    got = stage_kernels({"traceEvents": events})
    assert got == {
        "time/generate": {"decode": [2, 70.0]},
        "time/old_logprobs": {"head": [1, 5.0]},
        "time/train": {
            "mm": [1, 10.0],
            "fill": [1, 3.0],
            "backward": [1, 4.0],
            "triton_fused": [1, 6.0],
        },
        "time/reward": {"score": [1, 2.0]},
    }
    figures = trace_figures({"traceEvents": events}, wall=1.0)
    figures.stages, figures.stage_device = {"time/generate": 2.5}, {"time/generate": 1.25}
    assert "| time/generate | 2.500 | 1.250 |" in summary_text("t", figures, [])
    figures.stage_device = {}  # (the CPU: no kernels)
    assert "| time/generate | 2.500 |\n" in summary_text("t", figures, [])


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
    assert "(rl_step)" in summary.split("## Python functions by cumulative time")[1]
    with gzip.open(where / "steps_3-4" / "trace.json.gz") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"time/generate", "time/train"} <= names
    assert not (where / "steps_3-4" / "trace.json").exists()
    err = capsys.readouterr().err
    assert err.count("gspo: profiled optimizer steps 3-4:") == 1


def test_profile_steps_are_counted_from_one_and_one_past_the_run_is_warned():
    assert load_config(None, ["log.profile_steps=8"]).log.profile_steps == [8]
    with pytest.raises(ConfigError, match="log.profile_steps"):
        load_config(None, ["log.profile_steps=[-1, 2]"])
    config = load_config(None, ["log.profile_steps=[2, 500]", "train.max_steps=8"])
    assert any("log.profile_steps: step 500 is past" in w for w in config.warnings())
    assert not any("profile" in w for w in load_config(None, ["log.profile_steps=2"]).warnings())


def test_step_0_profiles_the_start_up_from_the_command_line_and_from_python(
    tmp_path, ones_reward, capsys
):
    import gspo
    from gspo.cli import main

    common = [*FAST, ones_reward, "train.cold_start_steps=0", "algorithm.minibatches=2",
              "train.max_steps=2", "log.profile_steps=[0]"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "cli"), *common]) == 0
    gspo.train(load_config(None, common), tmp_path / "api")
    for run in ("cli", "api"):
        where = tmp_path / run / "profile"
        assert [p.name for p in where.iterdir()] == ["startup"]  # (no rollout batch)
        summary = (where / "startup" / "summary.md").read_text()
        assert summary.startswith("# the start-up: building the trainer")
        assert "## self CPU time" in summary and "| time/" not in summary  # no stage yet
        python = summary.split("## Python functions by cumulative time (this thread)")[1]
        assert "trainer.py" in python and "(__init__)" in python
    assert capsys.readouterr().err.count("gspo: profiled the start-up") == 2


@pytest.mark.slow
def test_under_torchrun_each_rank_profiles_its_share_and_rank_0_says_so(tmp_path, ones_reward):
    from test_distributed import torchrun

    done = torchrun(
        "-m", "gspo", "train", "--output-dir", str(tmp_path / "run"), *FAST, ones_reward,
        "train.cold_start_steps=0", "algorithm.minibatches=2", "train.max_steps=2",
        "log.profile_steps=[0,2]",
    )  # fmt: skip
    where = tmp_path / "run" / "profile"
    for name, title in (
        ("startup", "# the start-up: building the trainer"),
        ("steps_1-2", "# optimizer steps 1-2"),
    ):
        for rank in (0, 1):
            summary = (where / name / f"rank_{rank}" / "summary.md").read_text()
            assert summary.startswith(f"{title}, rank {rank}\n")
    assert done.stderr.count("gspo: profiled ") == 2


def test_with_async_rollouts_the_producer_threads_sampling_is_profiled_too(
    tmp_path, ones_reward, monkeypatch
):
    """rollout.max_staleness=1: a producer thread samples batch b + 1 while the training
    thread updates on batch b; the profile records both threads, not the updates alone.
    (The updates are slowed so that the producer's sampling falls inside the profiled
    batch whatever the machine's pace: at full speed it may end before the batch starts,
    or start after it ends.)"""
    import time

    from gspo.training.update import UpdateStage

    train = UpdateStage.train

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return train(self, *args, **kwargs)

    monkeypatch.setattr(UpdateStage, "train", slow)
    Trainer(
        load_config(None, [*FAST, ones_reward, "train.cold_start_steps=0",
                           "algorithm.minibatches=2", "train.max_steps=6",
                           "rollout.max_staleness=1", "log.profile_steps=[4]"]),
        tmp_path / "run",
    ).fit()  # fmt: skip
    where = tmp_path / "run" / "profile" / "steps_3-4"
    with gzip.open(where / "trace.json.gz") as f:
        events = json.load(f)["traceEvents"]
    training = {e.get("tid") for e in events if e.get("name") == "time/train"}
    operators = {e.get("tid") for e in events if e.get("cat") == "cpu_op"}
    assert len(training) == 1 and len(operators - training) >= 1  # the producer's too
