"""``train.save_only_model``: checkpoints of the model alone (TRL's ``save_only_model``):
no optimizer state, a resume refused in one line, a new run and ``gspo export`` from them."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file
from test_trainer import FAST, comparable, run_metrics

import gspo
from gspo.cli import main
from gspo.config import load_config
from gspo.publish import check_manifest
from gspo.training.checkpoint import MODEL_ONLY, SHARDED, TRAINER_STATE

RUN = [
    *FAST,
    "train.max_steps=4",
    "algorithm.minibatches=2",
    "train.save_every=2",
    "train.keep_checkpoints=5",
    "eval.every=0",
    "optim.lr=1e-3",
]


def written(run) -> dict[int, int]:
    return {
        r["step"]: r["io/checkpoint_bytes"] for r in run_metrics(run) if "io/checkpoint_bytes" in r
    }


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_model_only_checkpoints_hold_the_weights_and_not_the_optimizer(
    tmp_path, varied_reward, lora
):
    args = [*RUN, varied_reward, f"model.lora.r={lora}"]
    args += ["train.cold_start_steps=0"] if lora else []
    runs = {}
    for setting in ("false", "true"):
        run = tmp_path / setting
        assert (
            main(["train", "--output-dir", str(run), *args, f"train.save_only_model={setting}"])
            == 0
        )
        runs[setting] = run
    # the same training: only what is written differs
    whole, only = (run_metrics(runs[s]) for s in ("false", "true"))
    assert [comparable(r) for r in whole] == [comparable(r) for r in only]
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    for step in (2, 4):
        name = f"step-{step:07d}"
        full, ckpt = (runs[s] / "checkpoints" / name for s in ("false", "true"))
        assert (full / SHARDED).is_dir() and not (full / MODEL_ONLY).exists()
        assert not (ckpt / SHARDED).exists() and (ckpt / MODEL_ONLY).is_file()
        for kept in (weights, TRAINER_STATE, "config.yaml", "tokenizer_config.json"):
            assert (ckpt / kept).is_file(), kept
        a, b = load_file(full / weights), load_file(ckpt / weights)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)  # the same weights
        check_manifest(ckpt)  # every file written is the one its manifest records
        assert load_config(ckpt / "config.yaml").train.save_only_model is True
    # step 0 has no optimizer state yet: written whole (resumable) either way
    assert (runs["true"] / "checkpoints" / "step-0000000" / TRAINER_STATE).is_file()
    assert not (runs["true"] / "checkpoints" / "step-0000000" / MODEL_ONLY).exists()
    sizes = {s: written(runs[s]) for s in runs}
    # (but for the config's one setting, and the run's name in the shards' metadata)
    assert abs(sizes["true"][0] - sizes["false"][0]) < 16, sizes
    for step in (2, 4):  # Adam's two moments: twice the weights (a LoRA run: its adapters)
        assert sizes["true"][step] < 0.6 * sizes["false"][step], sizes


def test_a_model_only_run_is_not_resumed_but_its_weights_start_a_new_run_and_export(
    tmp_path, varied_reward, capsys
):
    run = tmp_path / "run"
    args = [*RUN, varied_reward, "train.save_only_model=true"]
    assert main(["train", "--output-dir", str(run), *args]) == 0
    last = run / "checkpoints" / "step-0000004"
    capsys.readouterr()
    # the CLI: one line naming the checkpoint, the setting and what to do instead
    assert main(["train", "--resume", str(run), "train.max_steps=6"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert str(last) in err and "train.save_only_model" in err
    assert f"model.path={last}" in err
    # the Python API: the same line
    config = load_config(run / "config.yaml", ["train.max_steps=6"])
    with pytest.raises(ValueError, match="save_only_model") as raised:
        gspo.train(config, run, resume=True)
    assert str(last) in str(raised.value) and "\n" not in str(raised.value)
    # turned off on resume, the checkpoint still lacks the optimizer state: refused too
    off = ["train.save_only_model=false", "train.max_steps=6"]
    assert main(["train", "--resume", str(run), *off]) != 0
    assert "train.save_only_model" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1] == last.name
    # what the line says works: a new run from its weights
    new = [*RUN, varied_reward, "train.cold_start_steps=0", "train.max_steps=2"]
    new.append(f"model.path={last}")
    assert main(["train", "--output-dir", str(tmp_path / "next"), *new]) == 0
    # gspo export reads it: as it is, and merged to a copy
    assert main(["export", str(run)]) == 0
    assert str(last) in capsys.readouterr().out
    assert main(["export", str(run), "--merge", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_lora_model_only_checkpoint_says_export_then_exports(tmp_path, varied_reward, capsys):
    run = tmp_path / "run"
    args = [*RUN, varied_reward, "model.lora.r=4", "train.cold_start_steps=0"]
    assert main(["train", "--output-dir", str(run), *args, "train.save_only_model=true"]) == 0
    last = run / "checkpoints" / "step-0000004"
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.max_steps=6"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"gspo export {last} --merge OUT" in err, err
    out = tmp_path / "merged"
    assert main(["export", str(run), "--merge", str(out)]) == 0
    new = [*RUN, varied_reward, "train.cold_start_steps=0", "train.max_steps=2"]
    assert main(["train", "--output-dir", str(tmp_path / "next"), *new, f"model.path={out}"]) == 0


def test_turned_on_at_resume_the_run_goes_on_exactly_and_then_writes_model_only(
    tmp_path, varied_reward
):
    args = [*RUN, varied_reward, "eval.every=2"]  # (the cut run evaluates at its end)
    assert main(["train", "--output-dir", str(tmp_path / "full"), *args]) == 0
    cut = tmp_path / "cut"
    assert main(["train", "--output-dir", str(cut), *args, "train.max_steps=2"]) == 0
    assert (
        main(["train", "--resume", str(cut), "train.max_steps=4", "train.save_only_model=true"])
        == 0
    )
    full, resumed = run_metrics(tmp_path / "full"), run_metrics(cut)
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    checkpoints = cut / "checkpoints"
    assert (checkpoints / "step-0000002" / SHARDED).is_dir()  # written before: whole
    assert (checkpoints / "step-0000004" / MODEL_ONLY).is_file()
    assert not (checkpoints / "step-0000004" / SHARDED).exists()


def test_async_rollouts_stale_weights_are_left_out_too(tmp_path, varied_reward):
    from gspo.training.async_rollout import BEHAVIOUR_WEIGHTS

    for setting in ("false", "true"):
        run = tmp_path / setting
        args = [*RUN, varied_reward, "rollout.max_staleness=1"]
        assert (
            main(["train", "--output-dir", str(run), *args, f"train.save_only_model={setting}"])
            == 0
        )
        held = (run / "checkpoints" / "step-0000002" / BEHAVIOUR_WEIGHTS).is_file()
        assert held is (setting == "false")


@pytest.mark.parametrize("rank", ["abc", "3"])
def test_a_finished_model_only_run_auto_resumed_with_a_stray_rank_says_it_took_its_steps(
    tmp_path, varied_reward, capsys, monkeypatch, rank
):
    """RANK set without torchrun (no WORLD_SIZE): RANK=abc ended in 'gspo: error: invalid
    literal for int() with base 10: 'abc'', RANK=3 said nothing at all (exit 0)."""
    run = tmp_path / "run"
    args = [*RUN, varied_reward, "train.save_only_model=true"]
    assert main(["train", "--output-dir", str(run), *args]) == 0
    capsys.readouterr()
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--auto-resume", "--output-dir", str(run), *args]) == 0
    said = capsys.readouterr()
    assert said.err == ""
    assert said.out.startswith("the run already took its 4 steps")
