"""The experiments' reports name the commit and the machine their runs were trained on
(a figure copied into the docs says where it ran), with the runs' own records faked."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(name: str) -> ModuleType:
    path = ROOT / "experiments" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_exp_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def fake_records() -> list[dict]:
    line = {
        "step": 1,
        "train/loss": 0.1,
        "train/tokens": 10,
        "train/minibatch": 0,
        "train/clip_fraction": 0.25,
        "mismatch/token_abs_mean": 1e-2,
        "mismatch/sequence_mean_delta_abs_mean": 1e-2,
        "time/step": 0.1,
        "time/old_logprobs": 0.5,
    }
    return [{"step": 0, "eval/accuracy": 0.5}, line, {"step": 1, "eval/accuracy": 0.9}]


def test_inference_logprobs_report_names_the_runs_commit_and_machine(tmp_path, monkeypatch):
    module = load("inference_logprobs")
    from gspo.experiments.runs import PROVENANCE

    def run_or_reuse(config, run_dir, log):
        run_dir.mkdir(parents=True)
        made = {"commit": "abc1234", "machine": "Fake CPU (x86_64), 2 cores, torch 9"}
        (run_dir / PROVENANCE).write_text(json.dumps(made) + "\n")
        return fake_records()

    monkeypatch.setattr(module, "cold_start_checkpoint", lambda *a: tmp_path / "cs")
    monkeypatch.setattr(module, "load_config", lambda *a: None)
    monkeypatch.setattr(module, "run_or_reuse", run_or_reuse)
    monkeypatch.setattr(module, "plot_runs", lambda *a, **k: None)
    out = tmp_path / "out"
    argv = ["x", "--work-dir", str(tmp_path / "w"), "--output-dir", str(out)]
    monkeypatch.setattr(sys, "argv", [*argv, "--cold-start", str(tmp_path / "compare")])
    module.main()
    first = (out / "report.md").read_text().splitlines()[2]
    assert "commit abc1234 on Fake CPU (x86_64), 2 cores, torch 9" in first
    # the cold start, with no record of its own, is said to be unknown, not left out
    assert "commit unknown on unknown" in first


def test_moe_routing_report_names_commit_and_machine(tmp_path, monkeypatch):
    module = load("moe_routing")
    monkeypatch.setattr(module, "code_commit", lambda: "def5678", raising=False)
    monkeypatch.setattr(module, "machine", lambda: "Fake CPU, 2 cores", raising=False)
    variant = {
        "accuracy": 0.9, "accuracy_start": 0.5, "accuracy_greedy": 0.9, "reward_tail": 0.9,
        "churn_1": 0.01, "churn": 0.02, "churn_m": 0.02, "minibatches": 4,
        "clip_fraction": 0.1, "seconds_per_step": 0.2,
    }  # fmt: skip
    variants = {name: dict(variant) for name in module.VARIANTS}
    path = tmp_path / "report.md"
    module.write_report(path, module.QUICK, True, variants, [], {"seconds": 1.0}, 60.0, None)
    assert "at commit def5678 on Fake CPU, 2 cores" in path.read_text().splitlines()[2]


def test_lora_sweep_table_names_the_machine(monkeypatch):
    module = load("lora_sweep")
    import gspo.provenance

    monkeypatch.setattr(gspo.provenance, "code_commit", lambda: "0123abc")
    monkeypatch.setattr(gspo.provenance, "machine", lambda: "Fake CPU, 2 cores")
    args = argparse.Namespace(steps=200, cold_start_steps=1500, smooth=20)
    first = module.table([], args, ["--jobs", "2"]).splitlines()[0]
    assert "on commit 0123abc, Fake CPU, 2 cores;" in first
