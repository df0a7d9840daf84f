"""benchmarks/gpu_check.py on a machine without CUDA: it stops at once, and its CPU-side
parts (model size, report) are right. It has not run on a GPU from these tests."""

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert run.stdout == "" and len(run.stderr.strip().splitlines()) == 1
    assert run.stderr.startswith("gpu-check: no CUDA device")
    assert not (tmp_path / "out").exists()
    assert time.perf_counter() - start < 60


def test_the_vs_trl_model_is_about_half_a_billion_parameters(gpu_check):
    total, body = gpu_check.parameters(**gpu_check.HALF_B, vocab=gpu_check.HALF_B_VOCAB)
    assert 0.45e9 < total < 0.55e9 and body > 0.3e9
    # the formula counts what transformers builds (norms aside), on a small Qwen3
    from gspo.models import TinyModelSpec, build_char_tokenizer, build_tiny_model

    spec = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(spec, tokenizer, seed=0)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    counted, _ = gpu_check.parameters(2, 64, 4, 2, 96, len(tokenizer))
    assert counted == sum(p.numel() for p in model.parameters()) - norms


def test_report_lists_every_stage_and_its_figures(gpu_check):
    stages = [
        gpu_check.Stage("tests (CUDA)", "passed", 12.3, 900, "4 passed in 11.0s"),
        gpu_check.Stage("vLLM engine tests", "skipped", detail="vLLM is not installed"),
        gpu_check.Stage("gspo vs TRL", "passed", 250.0, 30000, figures={"ratio TRL / gspo": 2.5}),
    ]
    report = gpu_check.render(stages, {"device": "NVIDIA H100", "commit": "abc1234"})
    assert "- device: NVIDIA H100" in report
    assert "| tests (CUDA) | passed | 12.3 | 900 | 4 passed in 11.0s |" in report
    assert "| vLLM engine tests | skipped | 0.0 | 0 | vLLM is not installed |" in report
    assert "## gspo vs TRL" in report and "| ratio TRL / gspo | 2.5 |" in report
    assert gpu_check.nominal_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.nominal_peak("Some GPU") is None


def test_the_suite_stage_reads_pytests_counts_time_and_failures(gpu_check):
    out = (
        "..F.s\n=========================== short test summary info ===================\n"
        "SKIPPED [1] tests/test_cuda.py:19: needs a CUDA device\n"
        "FAILED tests/test_a.py::test_x - assert 0.99922 == 1\n"
        "ERROR tests/test_b.py::test_y - RuntimeError: boom\n"
        "2 failed, 450 passed, 12 skipped, 1 error in 512.34s (0:08:32)\n"
    )
    summary, figures = gpu_check.pytest_summary(out)
    assert summary == "2 failed, 450 passed, 12 skipped, 1 error in 512.34s (0:08:32)"
    assert (figures["failed"], figures["passed"], figures["skipped"]) == (2, 450, 12)
    assert figures["error"] == 1 and figures["pytest s"] == 512.34
    assert (
        figures["failing tests"] == "FAILED tests/test_a.py::test_x; ERROR tests/test_b.py::test_y"
    )
    assert gpu_check.pytest_command(["tests"], workers=4)[-5:] == [
        "tests", "-n", "4", "--dist", "worksteal"
    ]  # fmt: skip
    assert "-n" not in gpu_check.pytest_command(["tests"])


def test_a_failing_suite_is_detailed_by_pytests_closing_line_and_its_failures(gpu_check, tmp_path):
    """The stage's detail: pytest's counts and the failing tests, not the last lines of
    its output (a warning printed to stderr at the end, say)."""
    tests = tmp_path / "test_two.py"
    tests.write_text(
        "import sys\n\ndef test_good():\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2\n\n"
        "def teardown_module():\n    print('a warning on stderr', file=sys.stderr)\n"
    )
    stage = gpu_check.Stage("suite")
    gpu_check.run_stage(stage, gpu_check.pytest_stage([str(tests)]), 120)
    assert stage.status == "failed"
    assert re.fullmatch(
        r"1 failed, 1 passed in [\d.]+s: FAILED \S*test_two\.py::test_bad", stage.detail
    ), stage.detail
    assert (stage.figures["failed"], stage.figures["passed"]) == (1, 1)


def test_a_suite_stopped_at_its_limit_still_says_what_ended(gpu_check, tmp_path):
    """GSPO_TEST_LOG (tests/conftest.py TestLog): every phase of every test, written by
    the controller under pytest-xdist (not also by its workers, nor by a pytest a test
    starts); gpu_check's tests_so_far reads it when the suite ran out of time."""
    log = tmp_path / "suite.tests.tsv"
    quick = "tests/test_gpu_check.py::test_the_suite_stage_reads_pytests_counts_time_and_failures"
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") else []
    env = {**os.environ, "GSPO_TEST_LOG": str(log)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", quick, *workers]
    subprocess.run(command, env=env, cwd=SCRIPT.parents[1], check=True, capture_output=True)
    lines = [x.split("\t") for x in log.read_text().splitlines()]
    assert [(x[0], x[2], x[3]) for x in lines] == [
        ("passed", phase, quick) for phase in ("setup", "call", "teardown")
    ]
    assert gpu_check.tests_so_far(log)["tests ended (passed / failed / skipped)"] == "1 / 0 / 0"
    log.write_text(
        "passed\t0.01\tsetup\ttests/a.py::slow\npassed\t30.50\tcall\ttests/a.py::slow\n"
        "passed\t0.00\tteardown\ttests/a.py::slow\npassed\t0.01\tsetup\ttests/a.py::bad\n"
        "failed\t2.00\tcall\ttests/a.py::bad\npassed\t0.00\tteardown\ttests/a.py::bad\n"
        "skipped\t0.00\tsetup\ttests/a.py::cuda\npassed\t0.00\tteardown\ttests/a.py::cuda\n"
        "passed\t0.01\tsetup\ttests/a.py::slow2\npassed\t4"  # cut off by the stop
    )
    figures = gpu_check.tests_so_far(log, slowest=2)
    assert figures["tests ended (passed / failed / skipped)"] == "1 / 1 / 1"
    assert figures["failing tests so far"] == "tests/a.py::bad"
    assert figures["running at the stop"] == "tests/a.py::slow2"
    assert "of them tests/test_cuda.py's" not in figures
    assert gpu_check.tests_so_far(log, file="tests/a.py")["of them tests/a.py's"] == "1 / 1 / 1"
    assert figures["slowest 2 so far (s)"] == "tests/a.py::slow 30.5; tests/a.py::bad 2.0"
    assert gpu_check.tests_so_far(tmp_path / "absent.tsv") == {}


def test_a_failing_stage_is_recorded_not_raised(gpu_check):
    stage = gpu_check.Stage("boom")

    def body(stage, limit):
        raise RuntimeError("out of memory\nmore")

    gpu_check.run_stage(stage, body, 10.0)
    assert stage.status == "failed" and stage.detail.startswith("RuntimeError: out of memory")


def test_smoke_runs_every_stage_on_the_cpu_and_writes_the_report(tmp_path):
    """``--smoke`` goes through every stage at toy sizes where there is no CUDA."""
    import json

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["header"]["mode"].startswith("smoke") and "CPU" in report["header"]["device"]
    stages = {s["name"].split(",")[0]: s for s in report["stages"]}
    # the suite first (here one small file, not the whole suite, which runs this test)
    suite = stages["test suite (smoke: one file)"]
    assert suite["status"] == "passed" and suite["figures"]["passed"] > 0
    assert "failed" not in suite["figures"] and suite["figures"]["under 600 s"] == "yes"
    assert suite["figures"]["pytest-xdist workers"] in ("none: one process", *range(1, 9))
    # the CUDA tests all skip here: the stage says so instead of passing
    assert stages["tests (CUDA)"]["status"] == "skipped"
    probe = stages["sampler vs trainer log-probs per precision setting (the bf16 probe)"]
    assert probe["status"] == "passed", probe["detail"]
    outside, gap = probe["figures"]["float32: sequences outside the clip band / token gap"].split(
        " / "
    )
    assert float(outside) == 0 and 0 < float(gap) < 1e-5  # float32: the two paths agree
    outside, gap = probe["figures"][
        "bf16, as before (bf16 logits, products attention): sequences outside the clip band "
        "/ token gap"
    ].split(" / ")
    assert float(gap) > 1e-4  # bf16 logits: they do not
    assert (tmp_path / "precision.md").read_text().startswith("`python experiments/precision.py")
    assert "skipped" in stages["tests (CUDA)"]["detail"]
    decode = stages["decode"]  # the static step runs eagerly here, "graphs" included
    assert decode["status"] == "passed", decode["detail"]
    for way in ("loop", "static eager", "graphs"):
        assert decode["figures"][f"{way}: tokens/s"] > 0
        assert 0 < decode["figures"][f"{way}: fraction of the floor"] < 1
    assert decode["figures"]["floor ms per step"] > 0
    first, then = decode["figures"]["graphs: first generation s (captures) / next s"].split(" / ")
    assert float(first) > 0 and float(then) > 0
    train = stages["gspo train"]
    assert train["status"] == "passed" and train["figures"]["RL steps"] == 4
    assert train["figures"]["generation s (all rollout batches)"] > 0
    assert train["figures"]["checkpoints, MB written"] > 0
    waited, writing = train["figures"]["checkpoints, s waited / s writing"].split(" / ")
    assert float(waited) >= 0 and float(writing) > 0
    # the last checkpoint's parts: the HF files, the shards, the CRC-32s (each timed)
    parts = train["figures"]["checkpoints, the last one's s model / sharded / manifest"]
    assert all(float(s) > 0 for s in parts.split(" / "))
    vs = stages["gspo vs TRL"]
    if importlib.util.find_spec("trl") is None:
        assert vs["status"] == "skipped" and "TRL is not installed" in vs["detail"]
    else:
        assert vs["status"] == "passed" and vs["figures"]["ratio TRL / gspo"] > 0
    others = stages["the other workloads"]  # the 0.4B, 0.2B and 3M runs, at toy sizes here
    if importlib.util.find_spec("trl") is None:
        assert others["status"] == "skipped" and "TRL is not installed" in others["detail"]
    else:
        assert others["status"] == "passed", others["detail"]
        for label in ("toy 2-layer Qwen3", "the 3M reference model"):
            figures = {k.split(": ")[1]: v for k, v in others["figures"].items() if label in k}
            assert figures["gspo s"] > 0 and figures["TRL s"] > 0
            ratio, less_waits = figures["TRL / gspo (less its checkpoint waits)"].split()
            assert float(ratio) > 0 and float(less_waits.strip("()")) >= float(ratio)
    profile = stages["one rollout batch profiled"]  # the gspo side's second batch
    assert profile["status"] == "passed", profile["detail"]
    assert float(profile["figures"]["wall"].split()[0]) > 0
    assert float(profile["figures"]["time/train s"]) > 0
    assert (tmp_path / "profile.md").read_text().startswith("# optimizer steps 5-8")
    assert (tmp_path / "profile_startup.md").read_text().startswith("# the start-up")
    assert float(profile["figures"]["start-up (building the trainer) s"].split()[0]) > 0
    lora = stages["LoRA generation vs the full model"]
    assert lora["status"] == "passed", lora["detail"]
    assert lora["figures"]["LoRA / full time (target <= 1.25)"] > 0
    async_ = stages["async rollouts"]
    assert async_["status"] == "passed"
    figures = async_["figures"]
    assert figures["k=0 whole process s"] > 0 and figures["k=1 whole process s"] > 0
    assert {"k=0 waited for rollouts s", "k=1 waited for rollouts s"} <= set(figures)
    assert (tmp_path / "report.md").read_text().count("| passed |") >= 2


def test_stages_are_picked_in_the_order_given_and_a_wrong_key_is_one_line(gpu_check, tmp_path):
    assert gpu_check.parse_stages("decode, cuda") == ["decode", "cuda"]
    for wrong in ("decode,bogus", "cuda,cuda", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--stages"):
            gpu_check.parse_stages(wrong)
    for lease in gpu_check.LEASE.values():  # each part of a lease names real stages
        assert gpu_check.parse_stages(lease["stages"])
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--stages", "suite,bogus"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "bogus is not one" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_lease_part_runs_its_stages_in_order_and_reports_into_the_report_dir(gpu_check, tmp_path):
    """``--lease 1`` (the first call of a GPU lease) at toy sizes on the CPU: the suite,
    the CUDA tests in it and counted apart; the report and the suite's log and tests' log
    land in ``--report-dir``, not in ``--out``, the logs packed in one archive (a lent
    GPU's call returns at most 8 files)."""
    import json
    import tarfile

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GSPO_COMMIT": "feedbee"}
    out, reports = tmp_path / "work", tmp_path / "reports"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--lease", "1", "--out", str(out),
         "--report-dir", str(reports)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((reports / "report.json").read_text())
    assert report["header"]["commit"] == "feedbee"
    assert report["header"]["stages"] == "suite in 440 s"  # the lease's
    assert "gspo overrides" not in report["header"]
    (stage,) = report["stages"]
    assert (stage["name"].split(" (")[0], stage["status"]) == ("test suite", "passed")
    assert sorted(p.name for p in reports.iterdir()) == ["logs.tar.gz", "report.json", "report.md"]
    with tarfile.open(reports / "logs.tar.gz") as archive:
        assert sorted(archive.getnames()) == ["suite.log", "suite.tests.tsv"]
        archive.extractall(tmp_path / "logs", filter="data")
    suite = (tmp_path / "logs" / "suite.log").read_text()
    assert "passed" in suite and "slowest" in suite  # --durations lists the slowest tests
    ended = gpu_check.tests_so_far(tmp_path / "logs" / "suite.tests.tsv")
    counts = ended["tests ended (passed / failed / skipped)"]
    passed, failed, skipped = map(int, counts.split(" / "))
    assert passed > 0 and failed == 0 and skipped > 0  # (the CUDA tests skip here)
    cuda = stage["figures"]["of them tests/test_cuda.py's"]
    assert cuda == ended["of them tests/test_cuda.py's"] == f"0 / 0 / {skipped}"
    assert not (out / "report.md").exists()


def test_gspo_set_reaches_the_gspo_runs_and_the_report(tmp_path):
    """``--gspo-set`` (e.g. the CUDA graphs on for the second call of a lease): the train
    stage's run takes the override, and the report's header names it."""
    import json

    import yaml

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--stages", "train", "--out", str(tmp_path),
         "--gspo-set", "rollout.cuda_graphs=true", "--gspo-set", "rollout.temperature=0.7"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["header"]["gspo overrides"] == "rollout.cuda_graphs=true rollout.temperature=0.7"
    config = yaml.safe_load((tmp_path / "train" / "config.yaml").read_text())
    assert config["rollout"]["cuda_graphs"] is True and config["rollout"]["temperature"] == 0.7


def test_a_budget_beside_a_lease_part_bounds_it(tmp_path):
    """Less device time left than a part's budget: ``--budget`` beside ``--lease`` wins,
    and the stages that no longer fit are reported as not run."""
    import json

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--lease", "2", "--budget", "15", "--out",
         str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["header"]["stages"] == "vs_trl,head,workloads,decode in 15 s"
    assert "gspo overrides" not in report["header"]  # (the graphs are the default on CUDA)
    assert [s["status"] for s in report["stages"]] == ["not run"] * 4
    assert run.returncode == 1  # nothing passed: not a green check


def test_a_graphs_steps_kernels_are_sorted_into_families(gpu_check):
    """``decode_graphs.kernel_families``: the H200 profile's kernel names (887befd) by
    family, as ms per step; what no family names is ``other``."""
    import decode_graphs

    totals = {
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7": [28, 1400.0],
        "nvjet_sm90_tst_64x32_64x16_1x2_h_bz_splitK_TNT": [28, 300.0],
        "void at::native::tensor_kernel_scan_innermost_dim<double, std::plus<double> >": [1, 50],
        "void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cu"
        "da(at::TensorIteratorBase&)": [100, 150.0],
        "Memcpy DtoD (Device -> Device)": [2, 10.0],
        "void at::native::vectorized_layer_norm_kernel<float, float, true>": [57, 90.0],
    }
    ms = decode_graphs.kernel_families(totals, steps=2)
    assert ms == {
        "attention": 0.7, "matrix products": 0.15, "sampling (sort, scan, search)": 0.025,
        "copies, fills": 0.08, "other": 0.045,
    }  # fmt: skip


def test_the_profile_stage_reads_the_summary_s_figures_and_stage_rows(gpu_check):
    """``profile_figures``: the bullet lines and each stage's row, with the device seconds
    of its kernels where the summary has them (CUDA), as ``summary_text`` writes them."""
    from gspo.telemetry.profiling import Profile, summary_text

    profile = Profile(wall=5.5, device_busy=4.25, host_waits=3, host_wait_seconds=0.5,
                      stages={"time/generate": 2.5, "time/train": 2.25})  # fmt: skip
    profile.stage_device = {"time/generate": 2.125, "time/train": 1.5}
    figures = gpu_check.profile_figures(summary_text("t", profile, []))
    assert figures["wall"] == "5.500 s" and figures["time/train s"] == "2.250"
    assert figures["time/generate: its kernels' device s"] == "2.125"
    profile.stage_device = {}  # (the CPU)
    figures = gpu_check.profile_figures(summary_text("t", profile, []))
    assert figures["time/generate s"] == "2.500" and not any("device s" in k for k in figures)


def test_the_precision_runs_stage_reports_each_run_s_clipping(tmp_path):
    """``--stages precision_runs``: experiments/precision.py's whole runs (toy sizes here),
    GSPO and GRPO per precision setting, their report beside this one; pi_old recomputed
    or in float32, the on-policy ratios are 1."""
    import json

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--stages", "precision_runs", "--out",
         str(tmp_path / "work"), "--report-dir", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (stage,) = json.loads((tmp_path / "report.json").read_text())["stages"]
    assert stage["status"] == "passed", stage["detail"]
    figures = stage["figures"]
    assert len(figures) == 8  # GSPO and GRPO x four settings
    for run_name in ("GSPO, bf16, recomputed (default)", "GRPO, float32, sampler (default)"):
        value = figures[f"{run_name}: clipped on-policy / off-policy, on-policy ratios"]
        assert value.startswith("0.000 / ") and value.endswith("1.00000 - 1.00000"), value
    report = (tmp_path / "precision_runs.md").read_text()
    assert report.startswith("`python experiments/precision.py runs")
