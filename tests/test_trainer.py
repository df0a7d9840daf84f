"""The main job end to end: training, resume, bring-your-own model/data/reward, errors."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU, device_named_in

from gspo.cli import main
from gspo.config import load_config
from gspo.models import save_pretrained_atomic
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer, crossed, derive_seed, latest_checkpoint

# A small, fast setting on the CPU: 1-layer model, short completions, few SFT steps.
FAST = [
    CPU,
    "model.layers=1",
    "model.hidden=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=128",
    "data.eval_size=24",
    "data.sft_size=200",
    "train.cold_start_steps=20",
    "train.cold_start_batch_size=16",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "rollout.max_new_tokens=4",
    "eval.samples=2",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]


def run_metrics(output_dir):
    return read_metrics(output_dir / "metrics.jsonl")


def train_lines(records):
    return [r for r in records if "train/loss" in r]


def comparable(record):
    """A record less what depends on the machine or the paths: timings, and the bytes
    written (``io/``: a sharded checkpoint's metadata holds its directory's name)."""
    return {k: v for k, v in record.items() if not k.startswith(("time", "io/"))}


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(0, "rollout", 3) == derive_seed(0, "rollout", 3)
    assert derive_seed(0, "rollout", 3) != derive_seed(0, "rollout", 4)
    assert derive_seed(0, "rollout", 3) != derive_seed(1, "rollout", 3)


def test_crossed():
    assert crossed(3, 4, 4) and crossed(3, 7, 4) and not crossed(4, 7, 4)
    assert not crossed(0, 100, 0)


@pytest.mark.slow
def test_reward_rises_on_a_trivially_learnable_task(tmp_path, ones_reward):
    overrides = [
        *FAST,
        ones_reward,
        "train.cold_start_steps=0",
        "rollout.temperature=1.0",
        "rollout.prompts_per_batch=8",
        "optim.lr=3e-3",
        "train.max_steps=48",
        "eval.every=0",
        "eval.max_prompts=8",
        "eval.success_threshold=0.5",
    ]
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert len(lines) == 48 and [r["step"] for r in lines] == list(range(1, 49))
    first = sum(r["train/reward_mean"] for r in lines[:8]) / 8
    last = sum(r["train/reward_mean"] for r in lines[-8:]) / 8
    # the rise depends on the samples: 0.18-0.64 over train.seed 0-5 (sampler of 91c3fbb)
    assert last > first + 0.15, (first, last)
    # minibatch 1 of each rollout batch is on-policy: ratio exactly 1, nothing clipped
    on_policy = [r for r in lines if r["train/minibatch"] == 0]
    assert all(r["train/clip_fraction"] == 0.0 for r in on_policy)
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-5 for r in on_policy)
    assert all(r["mismatch/token_abs_max"] < 1e-4 for r in on_policy)


def test_every_rollout_batch_gives_exactly_minibatches_steps(tmp_path, ones_reward, capsys):
    # 6 responses in 4 minibatches: torch's chunk() made 3 parts of 2, so a rollout batch
    # gave 3 steps, the run ended short and a resume restarted at the wrong rollout batch
    common = [*FAST, ones_reward, "train.cold_start_steps=0", "rollout.group_size=2",
              "rollout.prompts_per_batch=3", "algorithm.minibatches=4", "train.max_steps=8",
              "eval.every=0"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "run"), *common]) == 0
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert [r["train/minibatch"] for r in lines] == [0, 1, 2, 3] * 2
    assert [r["train/sequences"] for r in lines] == [2, 2, 1, 1] * 2
    # max_steps is rounded up to whole rollout batches, and the progress says so
    capsys.readouterr()
    assert main(["train", "--output-dir", str(tmp_path / "short"), *common,
                 "train.max_steps=5", "log.progress=true"]) == 0  # fmt: skip
    assert [r["step"] for r in train_lines(run_metrics(tmp_path / "short"))] == list(range(1, 9))
    out = capsys.readouterr().out
    assert "step 8/8 (100%)" in out and "/5 " not in out
    # resuming the finished run trains nothing more
    assert main(["train", "--resume", str(tmp_path / "run"), *common]) == 0
    assert [r["step"] for r in train_lines(run_metrics(tmp_path / "run"))] == list(range(1, 9))


def test_the_progress_lines_show_the_starting_and_final_evaluations(tmp_path, ones_reward, capsys):
    overrides = [*FAST, ones_reward, "train.cold_start_steps=0", "train.max_steps=8",
                 "eval.every=0", "log.progress=true"]  # fmt: skip
    config = load_config(None, overrides)
    trainer = Trainer(config, tmp_path / "run")
    trainer.evaluator.run = lambda step: {"eval/accuracy": 0.25 + step / 100}  # 0.25, then 0.33
    capsys.readouterr()
    trainer.fit()
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert steps[-1].startswith("step 8/8 (100%)") and "eval acc 0.33 " in steps[-1]
    assert "eval acc 0.25 " in steps[0]  # the starting evaluation, from the first line on


def test_resume_past_a_damaged_checkpoint_takes_the_newest_complete_one(
    tmp_path, ones_reward, capsys
):
    common = [*FAST, ones_reward, "train.cold_start_steps=0", "algorithm.minibatches=2",
              "train.max_steps=8", "train.save_every=4", "eval.every=0"]  # fmt: skip
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *common]) == 0
    assert latest_checkpoint(run).name == "step-0000008"
    (run / "checkpoints" / "step-0000008" / "trainer_state.pt").unlink()  # damaged by hand
    capsys.readouterr()
    assert latest_checkpoint(run).name == "step-0000004"
    assert (
        "names step-0000008, which is incomplete (trainer_state.pt is missing); using step-0000004"
    ) in capsys.readouterr().err
    (run / "checkpoints" / "latest").write_text("step-0000099")
    assert latest_checkpoint(run).name == "step-0000004"
    # the resume redoes steps 5-8 from step 4, not the whole run from scratch
    assert main(["train", "--resume", str(run), *common]) == 0
    assert [r["step"] for r in train_lines(run_metrics(run))] == list(range(1, 9))
    assert latest_checkpoint(run).name == "step-0000008"
    # a shard deleted or cut short: that checkpoint is skipped too, said in one line
    capsys.readouterr()
    (run / "checkpoints" / "step-0000008" / "sharded" / "__0_0.distcp").unlink()
    assert latest_checkpoint(run).name == "step-0000004"
    err = capsys.readouterr().err.strip()
    assert (
        err.endswith(
            "names step-0000008, which is incomplete (sharded/__0_0.distcp is missing); "
            "using step-0000004"
        )
        and "\n" not in err
    ), err
    (run / "checkpoints" / "latest").unlink()
    shard = run / "checkpoints" / "step-0000004" / "sharded" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert latest_checkpoint(run).name == "step-0000000"
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "is missing; skipping step-0000008, incomplete (sharded/__0_0.distcp is missing); "
            "skipping step-0000004, incomplete (sharded/__0_0.distcp is cut short); "
            "using step-0000000"
        )
    )
    # a pointer out of the run (another run's checkpoint), or not text: not followed
    other = "../../elsewhere/checkpoints/step-0000012"
    for pointer in (other.encode(), b"\xff\xfe"):
        (run / "checkpoints" / "latest").write_bytes(pointer)
        assert latest_checkpoint(run).name == "step-0000000"
    assert f"names {other}, which is not a checkpoint of this run" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_gives_the_same_metrics_as_an_uninterrupted_run(tmp_path, ones_reward):
    common = [
        *FAST,
        ones_reward,
        "eval.success_threshold=0.25",
        "train.max_steps=8",
        "algorithm.minibatches=2",
        "train.save_every=2",
        "train.keep_checkpoints=2",
        "eval.every=4",
        "optim.lr=1e-3",
    ]
    assert main(["train", "--output-dir", str(tmp_path / "full"), *common]) == 0
    # the same run stopped after step 4 (its checkpoint), then resumed to step 8
    assert main(["train", "--output-dir", str(tmp_path / "cut"), *common, "train.max_steps=4"]) == 0
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000004"
    kept = sorted(p.name for p in (tmp_path / "full" / "checkpoints").glob("step-*"))
    assert kept == ["step-0000000", "step-0000006", "step-0000008"]  # pruned to the newest 2
    assert main(["train", "--resume", str(tmp_path / "cut"), "train.max_steps=8"]) == 0
    full, resumed = run_metrics(tmp_path / "full"), run_metrics(tmp_path / "cut")
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    lines = train_lines(full)
    assert len(lines) == 8
    # the runs really learn something, so a resume that lost state would show
    assert len({round(r["train/reward_mean"], 6) for r in lines}) > 1
    assert any(r["train/clip_fraction"] > 0 for r in lines)


@pytest.mark.slow
def test_bring_your_own_model_data_and_reward(tmp_path, tokenizer):
    from gspo.models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128)
    save_pretrained_atomic(
        build_tiny_model(spec, tokenizer, seed=1), tokenizer, tmp_path / "mymodel"
    )
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "bonus": a % 2} for a in range(20)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:6]))
    (tmp_path / "my_reward.py").write_text(
        "def uses_column(prompts, completions, bonus, **kw):\n"
        "    assert len(bonus) == len(completions)\n"
        "    return [float(b) for b in bonus]\n"
    )
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--output-dir",
            str(out),
            f"model.path={tmp_path / 'mymodel'}",
            CPU,
            f"data.train={tmp_path / 'train.jsonl'}",
            f"data.eval={tmp_path / 'eval.jsonl'}",
            f"reward.functions=[exact_match, {tmp_path / 'my_reward.py'}:uses_column]",
            "reward.weights=[1.0, 0.5]",
            "train.max_steps=4",
            "rollout.group_size=2",
            "rollout.prompts_per_batch=4",
            "rollout.max_new_tokens=3",
            "eval.samples=1",
            "log.progress=false",
        ]
    )
    assert code == 0
    records = run_metrics(out)
    lines = train_lines(records)
    assert len(lines) == 4
    # reward = exact_match (0 for an untrained model) + 0.5 * bonus, bonus is 1 for odd rows
    assert all(0.0 <= r["train/reward_mean"] <= 1.5 for r in lines)
    # each function's mean under its function's name (the whole spec was the key, path and
    # all, and a run of one function logged none)
    for r in lines:  # (every completion scored by both: the sum of the weighted means)
        parts = r["train/reward/exact_match"] + 0.5 * r["train/reward/uses_column"]
        assert r["train/reward_mean"] == pytest.approx(parts, abs=1e-6)
    assert (out / "config.yaml").is_file()
    assert load_config(out / "config.yaml").model.path == str(tmp_path / "mymodel")
    assert (out / "checkpoints" / "step-0000004" / "model.safetensors").is_file()
    assert (out / "plots" / "reward.png").is_file()
    assert any((out / "tensorboard").iterdir())
    assert not (out / "base_model").exists()  # the user's model was used, not a built-in
    assert any("eval/accuracy" in r for r in records)


@pytest.mark.slow
def test_kl_penalty_uses_the_cold_start_model_as_reference(tmp_path, ones_reward):
    overrides = [
        *FAST,
        ones_reward,
        "algorithm.kl_coef=0.1",
        "optim.lr=1e-3",
        "train.max_steps=8",
        "eval.every=0",
    ]
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert lines[0]["train/kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference
    assert lines[-1]["train/kl"] > 1e-6  # it drifts away after updates


def test_step_0_names_an_unchanged_model_and_everything_still_reads_it(
    tmp_path, tokenizer, varied_reward
):
    from gspo.models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128)
    mine = tmp_path / "mymodel"
    save_pretrained_atomic(build_tiny_model(spec, tokenizer, seed=1), tokenizer, mine)
    common = [*FAST, varied_reward, "model.device=cpu", f"model.path={mine}",
              "train.cold_start_steps=0", "algorithm.kl_coef=0.1", "optim.lr=1e-3",
              "algorithm.minibatches=2", "train.max_steps=4", "eval.every=0"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "full"), *common]) == 0
    # step 0 holds no weights: it names the input model
    step0 = tmp_path / "full" / "checkpoints" / "step-0000000"
    held = ["config.yaml", "manifest.json", "model_dir.txt", "model_fingerprint.json"]
    held += ["trainer_state.pt"]
    assert sorted(p.name for p in step0.iterdir()) == held
    assert (step0 / "model_dir.txt").read_text().strip() == str(mine.resolve())
    lines = train_lines(run_metrics(tmp_path / "full"))
    assert lines[0]["train/kl"] == pytest.approx(0.0, abs=1e-9)  # the reference: my model
    assert lines[-1]["train/kl"] > 1e-6
    # resumed from that step 0: the same run
    assert main(["train", "--output-dir", str(tmp_path / "cut"), *common, "train.max_steps=0"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "train.max_steps=4"]) == 0
    full, resumed = run_metrics(tmp_path / "full"), run_metrics(tmp_path / "cut")
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    # exported, and as a model.path, step 0 is the input model
    assert main(["export", str(step0), "--merge", str(tmp_path / "out")]) == 0
    from gspo.models import load_model

    cpu = torch.device("cpu")
    ref, _ = load_model(mine, device=cpu, dtype=torch.float32)
    for path in (tmp_path / "out", step0):
        got, _ = load_model(path, device=cpu, dtype=torch.float32)
        pairs = zip(got.parameters(), ref.parameters(), strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
    # that step 0 as the next run's model.path: its step 0 names my model, not step 0
    again = [*common, f"model.path={step0}", "train.max_steps=0"]
    assert main(["train", "--output-dir", str(tmp_path / "again"), *again]) == 0
    named = tmp_path / "again" / "checkpoints" / "step-0000000" / "model_dir.txt"
    assert named.read_text().strip() == str(mine.resolve())
    # a built-in model: step 0 names the run's base_model relatively (the run may move)
    built = [*FAST, varied_reward, "model.device=cpu", "train.cold_start_steps=0",
             "train.max_steps=0"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "builtin"), *built]) == 0
    step0 = tmp_path / "builtin" / "checkpoints" / "step-0000000"
    assert (step0 / "model_dir.txt").read_text().strip() == "../../base_model"
    (tmp_path / "builtin").rename(tmp_path / "moved")
    assert main(["train", "--resume", str(tmp_path / "moved"), "train.max_steps=2"]) == 0


def test_step_0_naming_a_model_whose_weights_changed_is_one_line(
    tmp_path, tokenizer, varied_reward, capsys
):
    from gspo.models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128)
    mine = tmp_path / "mymodel"
    save_pretrained_atomic(build_tiny_model(spec, tokenizer, seed=1), tokenizer, mine)
    common = [*FAST, varied_reward, "model.device=cpu", f"model.path={mine}",
              "train.cold_start_steps=0", "eval.every=0"]  # fmt: skip
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *common, "train.max_steps=0"]) == 0
    step0 = run / "checkpoints" / "step-0000000"
    # another model saved over mine: the same file names and sizes, other weights
    save_pretrained_atomic(build_tiny_model(spec, tokenizer, seed=2), tokenizer, mine)
    assert (mine / "model.safetensors").stat().st_size == json.loads(
        (step0 / "model_fingerprint.json").read_text()
    )["model.safetensors"][0]
    capsys.readouterr()
    for args in (["train", "--resume", str(run), "train.max_steps=2"],
                 ["export", str(step0), "--merge", str(tmp_path / "out")]):  # fmt: skip
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"names the model {mine.resolve()}, whose weights changed" in err
        assert "(model.safetensors holds other bytes)" in err, err
    assert not (tmp_path / "out").exists()
    # a weight file gone or cut short is said as such
    weights = (mine / "model.safetensors").read_bytes()
    (mine / "model.safetensors").write_bytes(weights[:1000])
    assert main(["train", "--resume", str(run), "train.max_steps=2"]) == 2
    assert f"model.safetensors is 1,000 bytes, was {len(weights):,}" in capsys.readouterr().err
    (mine / "model.safetensors").rename(mine / "other.safetensors")
    assert main(["train", "--resume", str(run), "train.max_steps=2"]) == 2
    err = capsys.readouterr().err
    assert "(model.safetensors is gone; other.safetensors is new)" in err, err
    # a step 0 written before fingerprints follows its pointer as it always did
    (mine / "other.safetensors").rename(mine / "model.safetensors")
    (mine / "model.safetensors").write_bytes(weights)
    (step0 / "model_fingerprint.json").unlink()
    assert main(["train", "--resume", str(run), "train.max_steps=2"]) == 0
    assert train_lines(run_metrics(run))  # it trained from step 0


def test_the_summary_says_what_the_checkpoints_wrote(tmp_path, varied_reward, capsys):
    from gspo.publish import megabytes

    run = tmp_path / "run"
    common = [*FAST, varied_reward, "model.device=cpu", "train.cold_start_steps=0",
              "algorithm.minibatches=2", "train.max_steps=4", "train.save_every=2",
              "train.keep_checkpoints=5", "eval.every=0"]  # fmt: skip
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), *common]) == 0
    lines = [r for r in run_metrics(run) if "io/checkpoint_bytes" in r]
    assert [r["step"] for r in lines] == [0, 2, 4]
    on_disk = [
        sum(f.stat().st_size for f in (run / "checkpoints" / f"step-{s:07d}").rglob("*")
            if f.is_file())
        for s in (0, 2, 4)
    ]  # fmt: skip
    assert [r["io/checkpoint_bytes"] for r in lines] == on_disk
    assert on_disk[0] < 16_384 < on_disk[1] == on_disk[2]  # step 0 names the model
    assert all(r["time/checkpoint"] > 0 and r["time/checkpoint_write"] > 0 for r in lines)
    # the write's parts: the HF files beside the shards (step 0: neither), then the CRC-32s
    parts = [
        sorted(k.removeprefix("time/checkpoint_") for k in r if k.startswith("time/checkpoint_"))
        for r in lines
    ]
    assert parts == [["manifest", "write"]] + [["manifest", "model", "sharded", "write"]] * 2
    for r in lines[1:]:
        assert min(r["time/checkpoint_model"], r["time/checkpoint_sharded"]) > 0
        assert r["time/checkpoint_model"] <= r["time/checkpoint_write"]
        assert (
            r["time/checkpoint_sharded"] + r["time/checkpoint_manifest"]
            <= r["time/checkpoint_write"]
        )
    waited = sum(r["time/checkpoint"] for r in lines)
    writing = sum(r["time/checkpoint_write"] for r in lines)
    out = " ".join(capsys.readouterr().out.split())
    assert (
        f"wrote {megabytes(sum(on_disk))} in 3 checkpoints: {writing:.1f} s writing, "
        f"{waited:.1f} s waited"
    ) in out


def test_bad_reward_function_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.py").write_text("def f(prompts, completions, **kw):\n    return [1.0]\n")
    code = main(
        [
            "train",
            "--output-dir",
            str(tmp_path / "run"),
            *FAST,
            "train.cold_start_steps=0",
            f"reward.functions=[{tmp_path / 'bad.py'}:f]",
            "train.max_steps=4",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("gspo: error:") and "bad.py:f" in err and "\n" not in err


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.train=/no/such/file.jsonl", "data.train: file not found"),
        (  # (a recipe's path before its download: the recipes audit's bare line)
            "model.path=/no/such/model",
            "model.path: /no/such/model is not a directory: no such directory; download the "
            "model there (hf download ORG/NAME --local-dir /no/such/model) or set model.path",
        ),
        ("reward.functions=[nosuch_builtin]", "nosuch_builtin"),
    ],
)
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, override, expected):
    code = main(["train", "--output-dir", str(tmp_path / "run"), *FAST, override])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err


def test_user_data_on_a_random_init_model_without_a_cold_start_warns(tmp_path, capsys):
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(20)]
    for name in ("train.jsonl", "eval.jsonl"):  # (the same file twice is a warning of its own)
        (tmp_path / name).write_text("\n".join(json.dumps(r) for r in rows))
    data = f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'eval.jsonl'}"
    capsys.readouterr()
    Trainer(load_config(None, [*FAST, *data]), tmp_path / "a")  # warned when built
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: warning: data.train with model.path null and no data.sft: ")
    assert "\n" not in err
    sft = f"data.sft={tmp_path / 'sft.jsonl'}"  # with a cold start: nothing to say
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "1+1=", "completion": "2"}))
    assert load_config(None, [*FAST, *data, sft]).warnings() == []
    assert (
        "train.cold_start_steps=0"
        in load_config(None, [*FAST, *data, sft, "train.cold_start_steps=0"]).warnings()[0]
    )
    assert load_config(None, FAST).warnings() == []  # the built-in task has its cold start


def test_a_run_that_fails_before_writing_anything_leaves_no_directory(tmp_path, capsys):
    bad = "reward.functions=[nosuch_builtin]"  # refused after the built-in model is saved
    assert main(["train", "--output-dir", str(tmp_path / "run"), *FAST, bad]) == 2
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made is left alone
    assert main(["train", "--output-dir", str(tmp_path / "mine"), *FAST, bad]) == 2
    assert (tmp_path / "mine").is_dir()


def test_existing_run_needs_resume_or_overwrite(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert main(["train", "--output-dir", str(tmp_path / "run"), *FAST]) == 2
    assert "--resume" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["train", "--resume", str(tmp_path / "empty")]) == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["train", "--resume", str(tmp_path / "other")]) == 2
    assert main(["train", "--resume", str(tmp_path / "nowhere")]) == 2
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["train", "--resume", str(tmp_path / "notes.txt")]) == 2
    assert main(["train", "--resume", str(tmp_path / "run"), "--overwrite"]) == 2
    # --resume as a flag: the next word, a setting, was taken for the run's directory
    assert main(["train", "--output-dir", "x", "--resume", "model.device=cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gspo: error: --resume {tmp_path / 'empty'}: holds no config.yaml (a run stopped as it "
        "started has none yet: start it again without --resume, with --overwrite)",
        f"gspo: error: --resume {tmp_path / 'other'}: is not a gspo run (no config.yaml)",
        f"gspo: error: --resume {tmp_path / 'nowhere'}: does not exist",
        f"gspo: error: --resume {tmp_path / 'notes.txt'}: is a file, not a run's directory",
        "gspo: error: --overwrite starts a run over, --resume continues one: pick one",
        "gspo: error: --resume takes the run's directory, not 'model.device=cpu' (a setting): "
        "gspo train --resume DIR [key=value ...]",
    ]


def test_a_run_records_the_files_it_was_given_by_absolute_path(tmp_path, monkeypatch):
    """reward.functions=[varied.py:varied] given in one directory, resumed from another:
    the file was looked for beside the second (or another varied.py there used)."""
    from conftest import VARIED_REWARD

    here = tmp_path / "here"
    here.mkdir()
    (here / "varied.py").write_text(VARIED_REWARD)
    monkeypatch.chdir(here)
    steps = ["train.max_steps=1", "eval.every=0", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", "run", *FAST, *steps,
                 "reward.functions=[varied.py:varied]"]) == 0  # fmt: skip
    recorded = load_config(here / "run" / "config.yaml")
    assert recorded.reward.functions == [f"{here / 'varied.py'}:varied"]
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--resume", str(here / "run"), "train.max_steps=2"]) == 0
    # a local directory with a split, and a hub id (no such local path): as they were
    from gspo.training.setup import with_absolute_paths

    paths = ["data.train=here::train", "data.eval=openai/gsm8k:main:test"]
    given = with_absolute_paths(load_config(None, paths)).data
    assert (given.train, given.eval) == (f"{here}::train", "openai/gsm8k:main:test")


def test_a_project_moved_whole_resumes_and_exports(tmp_path, monkeypatch, capsys):
    """A project holding a LoRA run, its base model (model.path) and its reward file,
    moved whole (mv proj proj2): the absolute paths the run recorded named the old place,
    and neither --resume (nor model.path= the new place: another model) nor export ran.
    The run's config.yaml records where the run was; a path missing now is found where
    it lies relative to the run."""
    from conftest import VARIED_REWARD

    from gspo.models import TinyModelSpec, build_char_tokenizer, build_tiny_model

    project = tmp_path / "proj"
    project.mkdir()
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1,
                                           intermediate=64), tokenizer, seed=0)  # fmt: skip
    save_pretrained_atomic(model, tokenizer, project / "base")
    (project / "rew.py").write_text(VARIED_REWARD)
    monkeypatch.chdir(project)
    run = ["train.cold_start_steps=0", "eval.every=0", "model.lora.r=4", "model.path=base",
           "reward.functions=[rew.py:varied]"]  # fmt: skip
    assert main(["train", "--output-dir", "a", *FAST, *run, "train.max_steps=4"]) == 0
    # full fine-tuning with a KL reference: its step 0 names the model (model_dir.txt)
    full = [*run[:2], *run[3:], "algorithm.kl_coef=0.05", "train.max_steps=4"]
    assert main(["train", "--output-dir", "b", *FAST, *full]) == 0
    moved = shutil.move(project, tmp_path / "proj2")
    monkeypatch.chdir(moved)
    capsys.readouterr()
    assert main(["train", "--resume", "a", "train.max_steps=8"]) == 0
    assert main(["train", "--resume", "b", "train.max_steps=8"]) == 0
    assert "warning" not in capsys.readouterr().err  # (its paths moved with it: no change)
    assert main(["export", "a", "--merge", "merged"]) == 0
    assert main(["export", "a", "--merge", "base"]) == 2  # the base, where it is now
    recorded = load_config(moved / "a" / "config.yaml")
    assert recorded.model.path == str(moved / "base")
    assert recorded.reward.functions == [f"{moved / 'rew.py'}:varied"]
    assert (
        (moved / "a" / "config.yaml")
        .read_text()
        .startswith(f"# gspo run directory: {moved / 'a'}\n")
    )
    assert [r["step"] for r in train_lines(run_metrics(moved / "a"))] == list(range(1, 9))


def test_a_model_moved_away_from_its_run_is_named_on_resume(tmp_path, monkeypatch, capsys):
    """The model a LoRA run's adapters and a KL run's step 0 build on, moved elsewhere (not
    with the run): the runs could neither resume (model.path=<new place> was refused as
    another model) nor export. A resume may now name its new place, once: its weights
    must be the ones the checkpoints recorded."""
    from safetensors.torch import load_file, save_file

    from gspo.models import TinyModelSpec, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1,
                                           intermediate=64), tokenizer, seed=0)  # fmt: skip
    save_pretrained_atomic(model, tokenizer, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    run = ["train.cold_start_steps=0", "eval.every=0", "model.path=base", "train.max_steps=4"]
    assert main(["train", "--output-dir", "a", *FAST, *run, "model.lora.r=4"]) == 0
    assert main(["train", "--output-dir", "b", *FAST, *run, "algorithm.kl_coef=0.05"]) == 0
    shutil.move(tmp_path / "base", tmp_path / "models")
    capsys.readouterr()
    assert main(["train", "--resume", "a", "train.max_steps=8"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: model.path: {tmp_path / 'base'}, the model a/checkpoints/step-0000004 "
        "builds on, is not a directory (nor where it would lie had it moved with the run); "
        "if it was moved, resume with model.path=ITS_NEW_PLACE"
    )
    shutil.copytree(tmp_path / "models", tmp_path / "other")
    weights = tmp_path / "other" / "model.safetensors"
    save_file({k: v + 1e-3 for k, v in load_file(weights).items()}, weights)
    assert main(["train", "--resume", "b", "train.max_steps=8", "model.path=other"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith(
            f"gspo: error: model.path={tmp_path / 'other'}: not the model {tmp_path / 'base'} that "
            "b/checkpoints/step-0000000 was built on"
        )
    )
    for name in ("a", "b"):  # b's KL reference reads step 0's model where it is now
        assert main(["train", "--resume", name, "train.max_steps=8", "model.path=models"]) == 0
        assert [r["step"] for r in train_lines(run_metrics(tmp_path / name))] == list(range(1, 9))
        assert load_config(tmp_path / name / "config.yaml").model.path == str(tmp_path / "models")
    assert main(["export", "b/checkpoints/step-0000000", "--merge", "zero"]) == 0
    # a finished run records the new place too, so that its export finds the base
    shutil.move(tmp_path / "models", tmp_path / "models2")
    assert main(["export", "a", "--merge", "merged"]) == 2
    assert main(["train", "--resume", "a", "train.max_steps=8", "model.path=models2"]) == 0
    assert main(["export", "a", "--merge", "merged"]) == 0
    assert len(train_lines(run_metrics(tmp_path / "a"))) == 8
    # a copy of it, the model still where the run records it: the same weights, taken
    # (refused before as "another model")
    shutil.copytree(tmp_path / "models2", tmp_path / "copy")
    assert main(["train", "--resume", "a", "train.max_steps=12", "model.path=copy"]) == 0
    assert load_config(tmp_path / "a" / "config.yaml").model.path == str(tmp_path / "copy")
    assert len(train_lines(run_metrics(tmp_path / "a"))) == 12
    # ... but not one whose other files differ (the weights alone were checked)
    shutil.copytree(tmp_path / "copy", tmp_path / "edited")
    (tmp_path / "edited" / "config.json").write_text(
        (tmp_path / "copy" / "config.json").read_text() + "\n"
    )
    capsys.readouterr()
    assert main(["train", "--resume", "a", "train.max_steps=16", "model.path=edited"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: model.path={tmp_path / 'edited'}: not a copy of the run's model "
        f"{tmp_path / 'copy'} (config.json differs); start a new run (--output-dir) to change it"
    )


def test_resume_refuses_another_model_or_another_directory(tmp_path, capsys):
    """Before, these resumed the checkpoints' model while config.yaml named the other one
    (or the run went on in place, --output-dir ignored)."""
    run = tmp_path / "run"
    good = [*FAST, "train.max_steps=1", "eval.every=0", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", str(run), *good]) == 0
    written = (run / "config.yaml").read_text()
    capsys.readouterr()
    (run / "config.yaml").unlink()  # removed by hand: the checkpoints keep theirs
    assert main(["train", "--resume", str(run)]) == 2
    held = run / "checkpoints" / "step-0000004" / "config.yaml"
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: --resume {run}: has lost its config.yaml; each checkpoint holds a copy: "
        f"cp {held} {run}/, then --resume again"
    )
    (run / "config.yaml").write_text(written)
    for override in ("model.hidden=128", "model.lora.r=4", f"model.path={tmp_path}"):
        assert main(["train", "--resume", str(run), override]) == 2
    assert main(["train", "--resume", str(run), "--output-dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "gspo: error: model.hidden=128: --resume continues the checkpoints' model "
        "(model.hidden=64); start a new run (--output-dir) to change it",
        "gspo: error: model.lora.r=4: --resume continues the checkpoints' model "
        "(model.lora.r=0); start a new run (--output-dir) to change it",
        f"gspo: error: model.path={tmp_path}: --resume continues the checkpoints' model "
        "(model.path=None); start a new run (--output-dir) to change it",
        f"gspo: error: --output-dir {tmp_path / 'x'}: --resume continues the run where it is "
        f"({run}); drop --output-dir",
    ]
    assert (run / "config.yaml").read_text() == written
    # a checkpoint's directory (which holds a config.yaml too): a new run was trained
    # into it, over the checkpoint, before
    step = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    held = sorted(p.name for p in step.iterdir())
    assert main(["train", "--resume", str(step), "train.max_steps=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: --resume {step}: is a checkpoint of the run {run}: --resume takes the "
        f"run's directory ({run}), and continues from its newest checkpoint"
    )
    assert sorted(p.name for p in step.iterdir()) == held
    # the same checkpoint copied out of its run (cp -r): a new run was trained into it
    import shutil

    copied = shutil.copytree(step, tmp_path / "best")
    assert main(["train", "--resume", str(copied), "train.max_steps=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: --resume {copied}: is a checkpoint (trainer_state.pt), not a run: "
        "--resume takes a run's directory; start a new run from its model with model.path"
    )
    assert sorted(p.name for p in copied.iterdir()) == held
    # the same settings edited into config.yaml by hand (between a kill and --resume):
    # checked against the checkpoint's own config.yaml (before, resumed and recorded)
    for was, edit in (("hidden: 64", "hidden: 128"), ("minibatches: 4", "minibatches: 2")):
        (run / "config.yaml").write_text(written.replace(f"  {was}\n", f"  {edit}\n", 1))
        assert main(["train", "--resume", str(run)]) == 2
    assert [line.split(":")[2] for line in capsys.readouterr().err.splitlines()] == [
        " model.hidden=128",
        " algorithm.minibatches=2",
    ]
    (run / "config.yaml").write_text(written)
    # another count of steps per rollout batch took rollout batches again (the counter
    # went back), accepted silently before
    assert main(["train", "--resume", str(run), "algorithm.minibatches=2"]) == 2
    assert capsys.readouterr().err.strip() == (
        "gspo: error: algorithm.minibatches=2: --resume continues the run as it was sampled "
        "(algorithm.minibatches=4), so that it ends as the uninterrupted run would; start a "
        "new run (--output-dir) to change it"
    )
    # what computes the same weights may change: the run goes on; optim.* overrides apply
    # (the optimizer state loaded put the saved learning rate back: recorded, ignored)
    on = ["train.max_steps=8", "model.activation_checkpointing=true", "model.cpu_linear=torch",
          "train.keep_checkpoints=3", "train.cold_start_cache=false"]  # fmt: skip
    before = max(r["step"] for r in read_metrics(run / "metrics.jsonl") if "train/lr" in r)
    assert main(["train", "--resume", str(run), *on, "optim.lr=3e-3"]) == 0
    said = capsys.readouterr().err.strip()  # (and said in one line: silent before)
    assert said == (  # (how the same weights are computed is no change of the run)
        "gspo: warning: resumed with settings step-0000004 was not trained with: "
        "optim.lr 0.0001 -> 0.003 (metrics.jsonl goes on as one run)"
    )
    lrs = [r["train/lr"] for r in read_metrics(run / "metrics.jsonl") if "train/lr" in r]
    assert lrs[0] == pytest.approx(1e-4) and lrs[before:] == pytest.approx([3e-3] * 4)
    # (the first step after the resume logged the saved rate, 1e-4, which it did not take)
    capsys.readouterr()
    written = (run / "config.yaml").read_text()
    assert main(["train", "--resume", str(run), "optim.lr=0.5"]) == 0  # finished: nothing
    said = capsys.readouterr().out  # to do, said, and its config.yaml kept (lr 0.5 before)
    assert (run / "config.yaml").read_text() == written
    steps = read_metrics(run / "metrics.jsonl")[-1]["step"]
    assert (
        f"the run already took its {steps} steps (train.max_steps=8 in whole rollout batches "
        f"of 4); resume it with a larger train.max_steps to train on" in said
    )


def test_overwrite_removes_the_old_run_only_once_the_new_one_starts(tmp_path, capsys):
    old = tmp_path / "run"
    (old / "checkpoints").mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "noanswer.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": "2+2="}\n')
    # refused while the trainer is built: a bad spec; a function, built-in or not, needing
    # a column the data lacks (found at the first reward call before: the old run was gone)
    (tmp_path / "rw.py").write_text(
        "def needs_level(prompts, completions, level, **kw):\n    pass\n"
    )
    for bad in (
        ["reward.functions=[nosuch_builtin]"],
        [f"data.train={tmp_path / 'noanswer.jsonl'}"],  # exact_match needs 'answer'
        [f"reward.functions=[{tmp_path / 'rw.py'}:needs_level]"],
    ):
        assert main(["train", "--output-dir", str(old), "--overwrite", *FAST, *bad]) == 2
        assert (old / "metrics.jsonl").read_text() == '{"step": 1}\n'  # the old run, intact
        assert sorted(p.name for p in tmp_path.iterdir()) == ["noanswer.jsonl", "run", "rw.py"]
    said = capsys.readouterr().err.splitlines()
    back = f"; the run that was in {old} is back as it was"
    assert said[1:] == [
        "gspo: error: reward function 'exact_match' needs the column(s) answer, which "
        f"data.train ({tmp_path / 'noanswer.jsonl'}) lacks (its columns: none but the prompt)"
        + back,
        f"gspo: error: reward function '{tmp_path / 'rw.py'}:needs_level' needs the column(s) "
        "level, which data.train (the built-in addition task) lacks (its columns: answer)" + back,
    ]
    tmp_path.joinpath("noanswer.jsonl").unlink()
    tmp_path.joinpath("rw.py").unlink()
    good = [*FAST, "train.max_steps=1", "eval.every=0", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", str(old), "--overwrite", *good]) == 0
    assert '{"step": 1}' not in (old / "metrics.jsonl").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    # a run that never reached a checkpoint: its TensorBoard events went on beside the new
    # run's (one directory, two runs' curves); a directory that holds no run keeps its files
    shutil.rmtree(old / "checkpoints")
    (old / "tensorboard").mkdir(exist_ok=True)
    (old / "tensorboard" / "events.old").write_text("")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    for out in (old, tmp_path / "mine"):
        assert main(["train", "--output-dir", str(out), "--overwrite", *good]) == 0
    assert not (old / "tensorboard" / "events.old").exists()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "kept"


def test_a_reward_failing_at_its_first_call_leaves_the_directory_as_it_was(tmp_path, capsys):
    """--overwrite removed the old run once the trainer was built, and a reward function
    raising at its first call (or returning text) then ended the new one: the old run was
    gone, and a stub run was left (in a new directory too: the fixed command was refused,
    "already holds a run"). An interrupt there still keeps the new run, to be resumed."""
    old, new = tmp_path / "run", tmp_path / "new"
    good = [*FAST, "train.max_steps=4", "eval.every=0", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", str(old), *good]) == 0

    def files(run: Path) -> list[str]:
        return sorted(str(p.relative_to(run)) for p in run.rglob("*"))

    before = files(old)
    (tmp_path / "rw.py").write_text(
        "def raises(prompts, completions, **kw):\n    raise ValueError('no')\n"
        "def text(prompts, completions, **kw):\n    return ['x'] * len(completions)\n"
        "def stop(prompts, completions, **kw):\n    raise KeyboardInterrupt\n"
        # another gspo process's staged write beside the run sweeps unlocked leftovers
        "def swept(prompts, completions, **kw):\n"
        "    from pathlib import Path\n"
        "    from gspo.publish import remove_leftovers\n"
        f"    remove_leftovers(Path({str(tmp_path / 'x')!r}))\n"
        "    raise ValueError('no')\n"
    )
    capsys.readouterr()
    for name in ("raises", "text", "swept"):
        spec = f"reward.functions=[{tmp_path / 'rw.py'}:{name}]"
        assert main(["train", "--output-dir", str(old), "--overwrite", *good, spec]) == 2
        assert files(old) == before
        assert main(["train", "--output-dir", str(new), *good, spec]) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "rw.py"]
    said = capsys.readouterr().err.splitlines()
    assert [line.endswith(f"; the run that was in {old} is back as it was") for line in said] == [
        True, False, True, False, True, False
    ]  # fmt: skip
    assert said[0].startswith(f"gspo: error: reward function '{tmp_path / 'rw.py'}:raises' ")
    # a cold-start row found unusable in the cold start (after the trainer is built)
    (tmp_path / "sft.jsonl").write_text(json.dumps({"prompt": "1" * 2000 + "=", "completion": "2"}))
    sft = [f"data.sft={tmp_path / 'sft.jsonl'}", "train.cold_start_steps=2"]
    assert main(["train", "--output-dir", str(old), "--overwrite", *good, *sft]) == 2
    assert files(old) == before
    assert (
        capsys.readouterr().err.strip().endswith(f"; the run that was in {old} is back as it was")
    )
    # a directory that held no run: the run's own files go, the user's stay
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    spec = f"reward.functions=[{tmp_path / 'rw.py'}:raises]"
    assert main(["train", "--output-dir", str(tmp_path / "mine"), *good, spec]) == 2
    assert files(tmp_path / "mine") == ["notes.txt"]
    assert main(["train", "--output-dir", str(tmp_path / "mine"), *good]) == 0  # (no "holds a run")
    shutil.rmtree(tmp_path / "mine")
    (tmp_path / "sft.jsonl").unlink()
    capsys.readouterr()
    spec = f"reward.functions=[{tmp_path / 'rw.py'}:stop]"
    assert main(["train", "--output-dir", str(old), "--overwrite", *good, spec]) == 130
    assert files(old) != before and (old / "checkpoints" / "step-0000000").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "rw.py"]  # (none aside)
    said = capsys.readouterr().err.strip()
    latest = (old / "checkpoints" / "latest").read_text().strip()
    assert said == f"gspo: interrupted; resume with gspo train --resume {old} (from {latest})"


def test_a_failure_making_the_new_run_directory_puts_the_old_run_back(tmp_path, monkeypatch):
    """The old run was set aside, then making or locking the new directory failed: it was
    left aside, under a leftover's name that the next staged write beside it sweeps."""
    from gspo.distributed import Distributed
    from gspo.runs import RunDirectory, hold_lock

    old = tmp_path / "run"
    (old / "checkpoints").mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    calls = []

    def hold(self, out):  # the old run's lock, then the new directory's fails
        calls.append(out)
        if len(calls) == 2:
            raise ValueError("no lock")
        return hold_lock(out, self.name)

    monkeypatch.setattr(RunDirectory, "hold", hold)
    run = RunDirectory(old, replace=True, dist=Distributed(), name="--output-dir")
    with pytest.raises(ValueError, match="no lock") as err:
        run.__enter__()
    assert (old / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert err.value.__notes__ == [f"the run that was in {old} is back as it was"]


def test_a_run_set_aside_by_a_killed_overwrite_is_kept_and_said(tmp_path, capsys):
    """--overwrite set the old run aside and was killed (kill -9) before its new run
    started: the old run sat under a leftover's name, and the next staged write beside it
    (any run's checkpoint in the same parent) removed it. Now it is never swept, and the
    next run in that directory says where it is."""
    from gspo.distributed import Distributed
    from gspo.publish import remove_leftovers
    from gspo.runs import RunDirectory

    aside = tmp_path / ".run.gspo-0123456789ab.aside"
    (aside / "checkpoints" / "step-0000004").mkdir(parents=True)
    (tmp_path / ".x.gspo-0123456789ab.old").mkdir()  # a leftover: swept
    remove_leftovers(tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == [aside.name]
    with RunDirectory(tmp_path / "run", replace=True, dist=Distributed(), name="--output-dir"):
        pass
    assert capsys.readouterr().err == (
        f"gspo: warning: {aside} holds the run an earlier --overwrite of {tmp_path / 'run'} "
        "set aside and never put back (that process was killed before its new run started): "
        "move it back to keep it, or delete it\n"
    )
    assert (aside / "checkpoints" / "step-0000004").is_dir()


def test_a_run_another_process_is_training_is_one_line(tmp_path, capsys):
    """A resume (or an overwrite) while the run trains: the two processes wrote into one
    directory (a helper saw "model.path: .../step-0000028 is not a directory", or both
    finishing, rc 0). The running process holds a lock on the run directory."""
    import fcntl
    import os

    run = tmp_path / "run"
    good = [*FAST, "train.max_steps=1", "eval.every=0", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", str(run), *good]) == 0
    capsys.readouterr()
    held = os.open(run, os.O_RDONLY)  # as the training process holds it
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        assert main(["train", "--resume", str(run), "train.max_steps=8"]) == 2
        assert main(["train", "--output-dir", str(run), "--overwrite", *good]) == 2
    finally:
        os.close(held)
    said = capsys.readouterr().err.splitlines()
    assert said == [
        f"gspo: error: {flag} {run}: another gspo process is training this run (it holds the "
        "directory's lock); wait for it to finish or stop it"
        for flag in ("--resume", "--output-dir")
    ]
    assert (run / "checkpoints").is_dir()  # the run, untouched
    assert main(["train", "--resume", str(run), "train.max_steps=8"]) == 0  # released: goes on


def test_output_dir_that_cannot_be_a_run_directory_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("not a directory")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main(["train", "--output-dir", "~/afile", *FAST]) == 2  # ~ expanded
    assert main(["train", "--output-dir", str(tmp_path / "afile" / "sub"), *FAST]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"gspo: error: --output-dir {tmp_path / 'afile'}: is a file, not a directory",
        f"gspo: error: --output-dir {tmp_path / 'afile' / 'sub'}: cannot be made (Not a directory)",
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("level", "old_logprobs"),
    [("sequence", "recompute"), ("sequence_token", "sampler"), ("token", "recompute")],
)
def test_every_level_and_old_logprob_source_trains(tmp_path, level, old_logprobs, ones_reward):
    overrides = [
        *FAST,
        ones_reward,
        f"algorithm.level={level}",
        f"algorithm.old_logprobs={old_logprobs}",
        "optim.lr=1e-3",
        "train.max_steps=8",
        "eval.every=0",
    ]
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert len(lines) == 8
    if old_logprobs == "recompute":  # both sources exist on every line: mismatch logged
        assert all(r["mismatch/token_abs_max"] < 1e-4 for r in lines)
    default_high = 0.27 if level == "token" else 4e-4
    clipped = [r for r in lines if r["train/clip_fraction_high"] > 0]
    assert all(r["train/ratio_max"] > 1 + default_high for r in clipped)


def test_python_dash_m_gspo_and_console_script():
    """``python -m gspo`` and the ``gspo`` script that installing the package puts beside
    the interpreter (a source tree on PYTHONPATH, as the lent GPU runs the suite, has no
    script: that part is skipped there)."""
    import importlib.metadata

    out = subprocess.run(
        [sys.executable, "-m", "gspo", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().startswith("gspo ")
    # the quick exit keeps the exit status and flushes what was printed
    bad = subprocess.run(
        [sys.executable, "-m", "gspo", "config", "optim.lrr=1"], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "gspo: error: optim.lrr: unknown key; did you mean 'optim.lr'?"
    ]
    try:
        importlib.metadata.distribution("gspo")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("gspo runs from a source tree here, not installed: no console script")
    script = subprocess.run(
        [str(Path(sys.executable).parent / "gspo"), "config"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "algorithm:" in script.stdout and "level: sequence" in script.stdout


@pytest.mark.slow
def test_the_skipped_steps_of_the_batch_a_stop_ends_are_logged(
    tmp_path, monkeypatch, varied_reward
):
    """Lines are logged at a rollout batch's end: a run that train.max_skipped stopped in
    its second minibatch had lost the first's line (its skipped step) from metrics.jsonl."""
    from gspo.training.update import Objective

    real = Objective.loss
    calls = {"n": 0}

    def poisoning(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] >= 3:  # rollout batch 1's two minibatches
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(Objective, "loss", poisoning)
    overrides = [*FAST, varied_reward, "train.cold_start_steps=0", "eval.every=0"]
    overrides += ["algorithm.minibatches=2", "train.max_steps=6", "train.max_skipped=2"]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    with pytest.raises(ValueError, match=r"train.max_skipped=2: 2 updates in a row .* step 4"):
        trainer.fit()
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[-1]["train/loss"] is None and lines[-1]["train/skipped_steps"] == 1


@pytest.mark.slow
def test_non_finite_updates_are_skipped_then_stop_the_run(tmp_path, monkeypatch, varied_reward):
    from gspo.training.update import Objective

    real = Objective.loss
    calls = {"n": 0}
    poisoned = {2, 5, 6, 7}  # update 2 alone, then 5, 6, 7 in a row

    def poisoning(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] in poisoned:
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(Objective, "loss", poisoning)
    overrides = [*FAST, varied_reward, "train.cold_start_steps=0", "optim.lr=1e-3"]
    overrides += ["train.max_steps=8", "train.save_every=1", "eval.every=0"]
    overrides += ["algorithm.minibatches=1", "train.keep_checkpoints=10"]
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    with pytest.raises(ValueError, match=r"train.max_skipped=3: 3 updates in a row .* step 7"):
        trainer.fit()
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert [r["train/skipped_steps"] for r in lines] == [0, 1, 1, 1, 2, 3]
    # non-finite values are written as null
    assert [r["step"] for r in lines if r["train/loss"] is None] == [2, 5, 6]
    # a skipped update leaves the weights alone: step 2's checkpoint equals step 1's
    from safetensors.torch import load_file

    def weights(step):
        path = tmp_path / "run" / "checkpoints" / f"step-{step:07d}" / "model.safetensors"
        return load_file(path)

    one, two, three = weights(1), weights(2), weights(3)
    assert all(torch.equal(one[k], two[k]) for k in one)
    assert any(not torch.equal(two[k], three[k]) for k in two)
    final = latest_checkpoint(tmp_path / "run")
    assert final is not None and final.name == "step-0000006"
    for tensor in load_file(final / "model.safetensors").values():
        assert torch.isfinite(tensor).all()


@pytest.mark.slow
def test_float16_scales_the_loss_skips_overflowed_steps_and_resumes_its_scale(
    tmp_path, monkeypatch, varied_reward
):
    """model.dtype=float16 (GPUs without bf16) trains through torch's GradScaler: a step
    whose gradients overflow at the scale is skipped and the scale halved, without counting
    toward train.max_skipped (3); the scale is logged and kept in checkpoints, so a resumed
    run goes on as the uninterrupted one."""
    real = torch.amp.GradScaler
    # a first scale far past what float16 gradients hold: the first updates overflow
    monkeypatch.setattr(torch.amp, "GradScaler", lambda device: real(device, init_scale=2.0**24))
    overrides = [*FAST, varied_reward, "model.dtype=float16", "train.cold_start_steps=0"]
    overrides += ["optim.lr=1e-3", "eval.every=0", "algorithm.minibatches=1"]
    with Trainer(load_config(None, [*overrides, "train.max_steps=12"]), tmp_path / "a") as a:
        a.fit()
    lines = train_lines(run_metrics(tmp_path / "a"))
    scales = [r["train/loss_scale"] for r in lines]
    skipped = [r["train/skipped_steps"] for r in lines]
    overflowed = [i for i in range(len(lines)) if r_inf(lines[i]["train/grad_norm"])]
    assert scales[0] == 2.0**24 and len(overflowed) > 3  # more in a row than max_skipped
    assert overflowed == list(range(len(overflowed))) and len(overflowed) < len(lines) - 2
    for i in range(1, len(lines)):  # halved after each overflow, kept after a step taken
        assert scales[i] == scales[i - 1] / (2 if i - 1 in overflowed else 1)
    assert skipped == [min(i + 1, len(overflowed)) for i in range(len(lines))]
    assert all(math.isfinite(r["train/loss"]) for r in lines)
    # stopped after 6 steps, then resumed to 12: the same lines as the run that did not stop
    with Trainer(load_config(None, [*overrides, "train.max_steps=6"]), tmp_path / "b") as b:
        b.fit()
    resumed = load_config(None, [*overrides, "train.max_steps=12"])
    with Trainer(resumed, tmp_path / "b", resume=True) as b:
        b.fit()
    again = train_lines(run_metrics(tmp_path / "b"))
    keys = ("train/loss_scale", "train/loss", "train/grad_norm", "train/skipped_steps")
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in lines]


def r_inf(value):
    """A gradient norm logged as non-finite (null in metrics.jsonl)."""
    return value is None or not math.isfinite(value)


def test_auto_old_logprobs_recompute_below_float32():
    """``algorithm.old_logprobs=auto`` (the default) takes the sampler's log-probs only
    where they are pi_old to rounding: float32 and nothing to correct."""
    from gspo.training.policy import recomputes_old_logprobs

    auto = load_config(None, [])
    assert auto.algorithm.old_logprobs == "auto"
    assert not recomputes_old_logprobs(auto, torch.float32)
    assert recomputes_old_logprobs(auto, torch.bfloat16)
    assert recomputes_old_logprobs(auto, torch.float16)
    corrected = load_config(None, ["algorithm.rollout_correction=token_tis"])
    assert recomputes_old_logprobs(corrected, torch.float32)
    sampler = load_config(None, ["algorithm.old_logprobs=sampler"])
    assert not recomputes_old_logprobs(sampler, torch.bfloat16)
    recompute = load_config(None, ["algorithm.old_logprobs=recompute"])
    assert recompute and recomputes_old_logprobs(recompute, torch.float32)
    # the run's first line says what auto chose (config.yaml keeps "auto")
    from gspo.training.setup import start_line

    sizes = {"model/trainable_params": 8.0, "model/params": 10.0, "optim/state_bytes": 2.0**21}
    said = start_line(sizes, False, torch.bfloat16, recomputes_old_logprobs(auto, torch.bfloat16))
    assert said == (
        "model: 8 of 10 parameters train; AdamW state 2.00 MiB; computes in bfloat16, pi_old "
        "recomputed by the trainer"
    )
    said = start_line(sizes, True, torch.float32, recomputes_old_logprobs(auto, torch.float32))
    assert said.endswith(
        "(LoRA adapters); AdamW state 2.00 MiB; computes in float32, pi_old from the sampler"
    )


def test_bf16_defaults_leave_the_on_policy_minibatch_unclipped(tmp_path, varied_reward, capsys):
    """In bf16 the default recomputes pi_old per minibatch: minibatch 0's ratios are exactly
    1 and nothing clips there. Forcing the sampler's log-probs (made to differ, as a bf16
    engine's can, by logit noise) clips it, and the run says so in one warning line."""
    bf16 = [
        *FAST,
        varied_reward,
        "model.device=cpu",
        "model.dtype=bfloat16",
        "rollout.max_new_tokens=12",
        "train.max_steps=8",
        "eval.every=0",
    ]
    Trainer(load_config(None, bf16), tmp_path / "auto").fit()
    lines = train_lines(run_metrics(tmp_path / "auto"))
    first = [r for r in lines if r["train/minibatch"] == 0]
    assert len(lines) == 8 and len(first) == 2
    assert all(r["train/ratio_min"] == 1.0 == r["train/ratio_max"] for r in first)
    assert all(r["train/clip_fraction"] == 0.0 for r in first)
    assert all("mismatch/token_abs_max" in r for r in lines)  # measured by the recompute
    assert "on-policy minibatch" not in capsys.readouterr().err

    forced = [*bf16, "algorithm.old_logprobs=sampler", "rollout.logit_noise=0.5"]
    Trainer(load_config(None, forced), tmp_path / "sampler").fit()
    first = [r for r in train_lines(run_metrics(tmp_path / "sampler")) if r["train/minibatch"] == 0]
    assert any(r["train/clip_fraction"] > 0 for r in first)
    assert capsys.readouterr().err.count("warning: the on-policy minibatch") == 1


def test_a_recomputed_pi_old_takes_minibatch_0_from_its_own_update(tmp_path, varied_reward):
    """With pi_old recomputed (bf16's default) minibatch 0 gets no no-grad pass: its
    update's forward runs at pi_old's weights, so its log-probs are pi_old's. Metric for
    metric (the loss, the rollout correction's weights, the mismatch, the KL) the run is
    the one whose recompute pass covers minibatch 0 as well, with one forward fewer per
    rollout batch."""
    overrides = [*FAST, varied_reward, "model.dtype=bfloat16", "algorithm.minibatches=2",
                 "algorithm.rollout_correction=token_tis", "algorithm.kl_coef=0.1",
                 "rollout.max_new_tokens=12", "train.max_steps=4", "eval.every=0"]  # fmt: skip
    runs, no_grad = {}, {}
    for reuse in (True, False):
        trainer = Trainer(load_config(None, overrides), tmp_path / f"reuse_{reuse}")
        forward = trainer.update_stage.forward
        assert forward is trainer.rollout_stage.forward and forward.first_from_update
        forward.first_from_update = reuse  # False: the pass before the update as it was
        calls, logprobs = [], trainer.policy.logprobs

        def counted(batch, module=None, calls=calls, logprobs=logprobs, **kwargs):
            if module is None:  # the policy's own (the KL reference passes its module)
                calls.append(torch.is_grad_enabled())
            return logprobs(batch, module, **kwargs)

        trainer.policy.logprobs = counted
        trainer.fit()
        runs[reuse] = [comparable(r) for r in train_lines(run_metrics(tmp_path / f"reuse_{reuse}"))]
        no_grad[reuse] = calls.count(False)
    assert len(runs[True]) == 4 and runs[True] == runs[False]
    assert no_grad == {True: 2, False: 4}  # 2 rollout batches x (2 minibatches less the first)
    first = [r for r in runs[True] if r["train/minibatch"] == 0]
    assert all(r["train/ratio_min"] == 1.0 == r["train/ratio_max"] for r in first)
    assert all(r["correction/weight_max"] != 1.0 for r in first)  # corrected: weights moved


def test_evaluation_leaves_out_what_no_reward_function_scored(tmp_path):
    """Held-out rows whose reward is None (a blank answer) counted as failures: 2 of 4 rows
    scored 1.0 read as accuracy 0.5. Now 1.0 over the scored, and the unscored share said."""
    (tmp_path / "ev.jsonl").write_text(
        '{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
        '{"prompt": "3+3=", "answer": null}\n{"prompt": "4+4=", "answer": null}\n'
    )
    (tmp_path / "rw.py").write_text(
        "def one_or_none(prompts, completions, answer=None, **kw):\n"
        "    return [None if a is None else 1.0 for a in answer]\n"
    )
    overrides = [*FAST, "train.cold_start_steps=0", "train.max_steps=0",
                 f"data.eval={tmp_path / 'ev.jsonl'}",
                 f"reward.functions=[{tmp_path / 'rw.py'}:one_or_none]"]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    line = next(r for r in run_metrics(tmp_path / "run") if "eval/accuracy" in r)
    for suffix in ("", "_greedy"):
        assert line[f"eval/accuracy{suffix}"] == line[f"eval/reward_mean{suffix}"] == 1.0
        assert line[f"eval/unscored_fraction{suffix}"] == 0.5
    # training's rewards too (every rollout batch holds the 4 rows: half unscored): they
    # counted as 0, a mean of 0.5 for rewards all 1.0
    trained = [*overrides[:-3], "train.max_steps=2", "eval.every=0",
               f"data.train={tmp_path / 'ev.jsonl'}", overrides[-1]]  # fmt: skip
    Trainer(load_config(None, trained), tmp_path / "train").fit()
    lines = [r for r in run_metrics(tmp_path / "train") if "train/reward_mean" in r]
    assert lines
    assert all(r["train/reward_mean"] == 1.0 and r["train/reward_std"] == 0.0 for r in lines)
    assert all(r["train/unscored_fraction"] == 0.5 for r in lines)


def test_evaluation_logs_each_reward_functions_mean_beside_the_accuracy(tmp_path):
    """The accuracy counts the weighted sum of the rewards against eval.success_threshold:
    a correctness reward of 1 beside a small penalty never reached 1.0, and every correct
    response read as accuracy 0 with nothing else to show it. Each function's own held-out
    mean is logged now (eval/reward/NAME), as training's is."""
    (tmp_path / "rw.py").write_text(
        "def right(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
        "def short(prompts, completions, **kw):\n    return [-0.01] * len(completions)\n"
    )
    rw = tmp_path / "rw.py"
    overrides = [*FAST, "train.cold_start_steps=0", "train.max_steps=0",
                 f"reward.functions=[{rw}:right, {rw}:short]"]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    line = next(r for r in run_metrics(tmp_path / "run") if "eval/accuracy" in r)
    for suffix in ("", "_greedy"):
        assert line[f"eval/accuracy{suffix}"] == 0.0
        assert line[f"eval/reward_mean{suffix}"] == pytest.approx(0.99)
        assert line[f"eval/reward/right{suffix}"] == 1.0
        assert line[f"eval/reward/short{suffix}"] == pytest.approx(-0.01)


def test_train_lr_is_the_rate_each_step_took(tmp_path, varied_reward, monkeypatch):
    """train/lr was read after the scheduler moved on: the next step's rate, so warm-up
    looked a step shorter (5e-5, 7.5e-5, 1e-4, 1e-4 logged for 2.5e-5 .. 1e-4 taken)."""
    taken: list[float] = []
    step = torch.optim.AdamW.step

    def recorded(self, *args, **kwargs):
        taken.append(self.param_groups[0]["lr"])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recorded)
    overrides = [*FAST, varied_reward, "train.cold_start_steps=0", "train.max_steps=4",
                 "eval.every=0", "optim.lr=1e-4", "optim.warmup_steps=4"]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    logged = [r["train/lr"] for r in train_lines(run_metrics(tmp_path / "run"))]
    assert taken == pytest.approx([2.5e-5, 5e-5, 7.5e-5, 1e-4]) and logged == taken


def test_the_entropy_takes_a_graph_only_for_an_entropy_bonus(tmp_path, varied_reward):
    """The update's entropies are a metric (no graph) unless ``algorithm.entropy_coef`` puts
    them in the loss; either way ``train/entropy`` is logged, and a bonus run trains (its
    loss would refuse an entropy without a gradient)."""
    overrides = [*FAST, varied_reward, "train.cold_start_steps=0", "train.max_steps=2",
                 "algorithm.minibatches=2", "eval.every=0"]  # fmt: skip
    for coef, entropy in ((0.0, "metric"), (0.01, True)):
        run = tmp_path / f"coef_{coef}"
        trainer = Trainer(load_config(None, [*overrides, f"algorithm.entropy_coef={coef}"]), run)
        assert trainer.update_stage.forward.entropy == entropy
        trainer.fit()
        lines = train_lines(run_metrics(run))
        assert len(lines) == 2 and all(r["train/entropy"] > 0 for r in lines)


def test_a_bf16_weight_head_reaches_the_sampler_the_update_and_the_reference(
    tmp_path, varied_reward
):
    """``model.head_precision=bf16_weight`` (CUDA's default below float32, forced here on
    the CPU): the policy and the KL reference both carry it, the run trains, and with pi_old
    recomputed the on-policy ratios are still exactly 1."""
    from gspo.models.kernels import head_precision

    overrides = [*FAST, varied_reward, "model.device=cpu", "model.dtype=bfloat16",
                 "model.head_precision=bf16_weight", "algorithm.kl_coef=0.1",
                 "rollout.max_new_tokens=12", "train.max_steps=4", "eval.every=0"]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    trainer.fit()
    assert head_precision(trainer.policy.module) == "bf16_weight"
    assert head_precision(trainer.reference.module) == "bf16_weight"
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert len(lines) == 4 and all(math.isfinite(r["train/loss"]) for r in lines)
    first = [r for r in lines if r["train/minibatch"] == 0]
    assert all(r["train/ratio_min"] == 1.0 == r["train/ratio_max"] for r in first)
    assert all(r["mismatch/token_abs_max"] < 0.1 for r in lines)  # sampler and trainer close


def test_a_test_run_left_at_model_device_auto_fails_on_any_machine(tmp_path):
    """tests/conftest.py's guard: a test's run that does not name its device would take
    CUDA and bf16 on a GPU machine; it fails on the CPU too, so CI catches it."""
    auto = [a for a in FAST if a != CPU]
    with pytest.raises(pytest.fail.Exception, match=r"model\.device=auto"):
        Trainer(load_config(None, auto), tmp_path / "run")
    with pytest.raises(pytest.fail.Exception, match=r"model\.device=auto"):
        main(["train", "--output-dir", str(tmp_path / "cli"), *auto])
    with pytest.raises(pytest.fail.Exception, match=r"model\.device=auto"):
        device_named_in(["-m", "gspo", "train", "--output-dir", "out", *auto])
    device_named_in(["-m", "gspo", "train", "--resume", "out"])  # its config.yaml names it
    device_named_in(["-m", "gspo", "train", *FAST])


def test_rewards_that_never_apply_are_said_once(tmp_path, capsys):
    """Every function returning None for every completion gave reward 0 and no signal,
    with nothing said."""
    (tmp_path / "rw.py").write_text(
        "def never(prompts, completions, **kw):\n    return [None] * len(completions)\n"
    )
    never = f"reward.functions=[{tmp_path / 'rw.py'}:never]"
    overrides = [*FAST, never, "train.max_steps=2", "eval.every=0", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "returned None" in line]
    assert said == [
        "gspo: warning: every reward function returned None (does not apply) for all 16 "
        f"completions of a batch, so every advantage is 0 and nothing is learned from it "
        "(AdamW's momentum and weight decay still move the weights); check "
        f"reward.functions ({tmp_path / 'rw.py'}:never) against the data's columns (shown once)"
    ]
    lines = train_lines(run_metrics(tmp_path / "run"))  # no reward measured: none logged
    assert lines and all("train/reward_mean" not in r for r in lines)
    assert all(r.get("train/unscored_fraction", 1.0) == 1.0 for r in lines)
    assert any("train/unscored_fraction" in r for r in lines)
    # an environment's get_reward() returning None for all (a forgotten return): said so
    from gspo.training.rollout import Scorer

    scorer = Scorer.__new__(Scorer)
    scorer.warned = False
    scorer.warn_if_unscored({"environment": [None, None]}, 2)
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "against the data's columns; the environment's get_reward() returned None for every "
            "episode (a missing return?) (shown once)"
        )
    )


def test_the_python_train_refuses_what_the_cli_refuses(tmp_path):
    """train() replaced a finished run in place (TensorBoard then held both runs' events),
    and a dict for the config was an AttributeError deep in the trainer."""
    from gspo.runs import train

    good = load_config(None, [*FAST, "train.max_steps=1", "eval.every=0",
                              "train.cold_start_steps=0", "reward.workers=1"])  # fmt: skip
    records = train(good, tmp_path / "run")
    assert any("train/loss" in r for r in records)
    with pytest.raises(ValueError, match=r"already holds a run; resume=True continues it"):
        train(good, tmp_path / "run")
    with pytest.raises(TypeError, match=r"config must be a gspo.config.Config .* got dict"):
        train({"train": {"max_steps": 1}}, tmp_path / "other")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"output_dir .*afile is a file, not a directory"):
        train(good, tmp_path / "afile")
    trainer = Trainer(load_config(None, [*FAST, "reward.workers=1"]), tmp_path / "closed")
    trainer.rewards(["p"], ["1"], {"answer": ["1"]})  # starts the worker process
    assert trainer.rewards.runner._pool is not None
    trainer.close()  # stops it (it lived on until the trainer was collected)
    assert trainer.rewards.runner._pool is None


def test_a_trainer_made_over_a_run_is_refused_unless_resumed(tmp_path):
    """gspo.Trainer(config, dir) over a finished run trained again and replaced its
    metrics, config and checkpoints, unsaid (gspo.train refuses it)."""
    config = load_config(None, [*FAST, "train.max_steps=1", "train.cold_start_steps=0"])
    Trainer(config, tmp_path / "run").fit()
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"already holds a run \(its checkpoints\): resume=True"):
        Trainer(config, tmp_path / "run")
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before
    with pytest.raises(ValueError, match=r"^output_dir: None is no directory path$"):
        Trainer(config, None)
    from gspo.runs import train

    with pytest.raises(ValueError, match=r"^train: output_dir None is no directory path$"):
        train(config, None)  # (a TypeError from pathlib)


def test_a_failed_run_closes_its_logger(tmp_path):
    """A run that raised left its metrics file open and, with TensorBoard, its writer's
    thread running: one more for each failed run of a notebook."""
    import threading

    (tmp_path / "rw.py").write_text(
        "calls = []\n"
        "def breaks(prompts, completions, **kw):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 1:\n"
        "        raise RuntimeError('broken')\n"
        "    return [0.0] * len(completions)\n"
    )
    overrides = [*FAST, "train.cold_start_steps=0", "train.max_steps=4", "eval.every=0",
                 "log.tensorboard=true",
                 f"reward.functions=[{tmp_path / 'rw.py'}:breaks]"]  # fmt: skip
    before = {t for t in threading.enumerate() if "Writer" in type(t).__name__}
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    with pytest.raises(ValueError, match="broken"), trainer:  # (as gspo.train holds it)
        trainer.fit()
    assert trainer.logger._file.closed
    left = {t for t in threading.enumerate() if "Writer" in type(t).__name__} - before
    assert not [t for t in left if t.is_alive()]
    trainer.close()  # (again: nothing left to close)


def test_completions_every_writes_what_each_batch_sampled(tmp_path, varied_reward):
    """log.completions_every=2: batches 0 and 2 of 4 as JSON lines (TRL's log_completions);
    there was no way to see a run's completions but a printing reward function. Each
    line's reward is its functions' sum, the advantages are the group-relative ones, and
    the batch's mean reward is the one its metrics line logs."""
    import json

    overrides = [*FAST, varied_reward, "train.max_steps=8", "algorithm.minibatches=2",
                 "eval.every=0", "log.completions_every=2"]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    written = sorted((tmp_path / "run" / "completions").iterdir())
    assert [p.name for p in written] == ["rollout-000000.jsonl", "rollout-000002.jsonl"]
    lines = [json.loads(t) for t in written[0].read_text().splitlines()]
    assert len(lines) == 16 and [line["group"] for line in lines] == [
        g for g in range(4) for _ in range(4)
    ]
    for line in lines:
        assert set(line) == {"group", "prompt", "answer", "completion", "reward", "rewards",
                             "advantage", "tokens", "finish"}  # fmt: skip
        assert line["reward"] == pytest.approx(sum(line["rewards"].values()))
        assert isinstance(line["completion"], str) and line["finish"] in ("stop", "length")
    # each function by its metric's name (train/reward/NAME), not by its whole spec
    logged = {k for k in train_lines(run_metrics(tmp_path / "run"))[0] if "/reward/" in k}
    assert {f"train/reward/{name}" for name in lines[0]["rewards"]} == logged
    for g in range(4):
        group = [line for line in lines if line["group"] == g]
        assert len({line["prompt"] for line in group}) == 1
        assert sum(line["advantage"] for line in group) == pytest.approx(0, abs=1e-5)
    first = next(r for r in run_metrics(tmp_path / "run") if "train/reward_mean" in r)
    assert first["train/reward_mean"] == pytest.approx(sum(x["reward"] for x in lines) / 16)


def test_a_stopped_run_draws_the_plots_of_what_it_logged(tmp_path, capsys):
    """Ctrl-C (or SIGTERM at a cluster's time limit) after some steps: the plots of the
    steps taken, as a finished run draws them (before: none at all)."""
    (tmp_path / "rw.py").write_text(
        "calls = 0\n"
        "def stops(prompts, completions, **kw):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if calls == 3:\n"  # (the start's evaluation, rollout batch 1, then batch 2)
        "        raise KeyboardInterrupt\n"
        "    return [float(len(c) % 2) for c in completions]\n"
    )
    run = tmp_path / "run"
    stops = f"reward.functions=[{tmp_path / 'rw.py'}:stops]"
    steps = ["train.max_steps=8", "algorithm.minibatches=2", "eval.greedy=false",
             "data.eval_size=8", "log.plots=true", stops]  # fmt: skip
    assert main(["train", "--output-dir", str(run), *FAST, *steps]) == 130
    assert "gspo: interrupted; resume with gspo train --resume" in capsys.readouterr().err
    assert [r["step"] for r in run_metrics(run) if "train/loss" in r] == [1, 2]
    assert sorted(p.name for p in (run / "plots").iterdir()) == [
        "accuracy.png",
        "clip_fraction.png",
        "mismatch.png",
        "reward.png",
    ]
