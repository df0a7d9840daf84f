"""Cold start: progress checkpoints and exact resume, and the content-addressed cache."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial

import pytest
import torch
from test_trainer import FAST, comparable

import gspo.training.cold_start as cs
from gspo.cli import main
from gspo.config import load_config
from gspo.distributed import Distributed
from gspo.models.kernels import onednn_available
from gspo.publish import tree_bytes
from gspo.sharded import sharded_problem
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer, latest_checkpoint

COMMON = [
    *FAST,
    "train.cold_start_steps=120",
    "train.cold_start_save_every=50",
    "train.max_steps=4",
    "algorithm.minibatches=2",
    "eval.every=0",
]


def records(run):
    return [comparable(r) for r in read_metrics(run / "metrics.jsonl")]


class Killed(Exception):
    """Stands in for a SIGKILL at a chosen cold-start step (the subprocess test kills)."""


def kill_at(monkeypatch, step: int) -> None:
    calls = {"n": 0}
    real = torch.nn.utils.clip_grad_norm_

    def clip(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > step:
            raise Killed
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)


def test_a_resumed_run_drops_the_cold_starts_progress_left_behind(tmp_path, capsys):
    """A run stopped in its step-0 evaluation kept its cold-start progress checkpoints
    (model and AdamW state) for good: only the process that ran the cold start dropped
    them. The resumed run says where it goes on from (max_steps=2: one whole rollout batch
    of 4 minibatches)."""
    overrides = [*FAST, "train.cold_start_steps=10", "train.max_steps=2", "eval.every=0"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) == 0
    left = tmp_path / "run" / "checkpoints" / f"{cs.PROGRESS_PREFIX}0000005"
    left.mkdir()  # as a stop between step 0 and its removal leaves it
    (left / "state.pt").write_bytes(b"x")
    capsys.readouterr()
    resume = ["train", "--resume", str(tmp_path / "run"), "train.max_steps=4", "log.progress=true"]
    assert main(resume) == 0
    assert not left.exists()
    said = capsys.readouterr().out
    assert f"resumed at step 4 from {tmp_path / 'run' / 'checkpoints' / 'step-0000004'}\n" in said


@pytest.mark.slow
def test_cold_start_resumes_exactly_after_a_kill(tmp_path, monkeypatch, varied_reward):
    overrides = [*COMMON, varied_reward, "train.cold_start_cache=false"]
    assert main(["train", "--output-dir", str(tmp_path / "full"), *overrides]) == 0
    kill_at(monkeypatch, 110)  # after the step-100 progress checkpoint, before the end
    with pytest.raises(Killed):
        Trainer(load_config(None, overrides), tmp_path / "cut").fit()
    monkeypatch.undo()
    saved = cs.progress_checkpoints(tmp_path / "cut" / "checkpoints")
    assert [p.name for p in saved] == ["cold-start-0000100"]  # older one pruned
    assert latest_checkpoint(tmp_path / "cut") is None
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    full, resumed = records(tmp_path / "full"), records(tmp_path / "cut")
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    assert [r["sft/step"] for r in resumed if "sft/step" in r] == [100, 120]
    # the step-0 checkpoint supersedes the progress checkpoints
    assert cs.progress_checkpoints(tmp_path / "cut" / "checkpoints") == []


@pytest.mark.slow
def test_resume_before_any_checkpoint_starts_again(tmp_path, monkeypatch, varied_reward):
    overrides = [*COMMON, varied_reward, "train.cold_start_cache=false"]
    assert main(["train", "--output-dir", str(tmp_path / "full"), *overrides]) == 0
    kill_at(monkeypatch, 30)  # before the first progress checkpoint
    with pytest.raises(Killed):
        Trainer(load_config(None, overrides), tmp_path / "cut").fit()
    monkeypatch.undo()
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert records(tmp_path / "full") == records(tmp_path / "cut")


@pytest.mark.slow
def test_identical_cold_start_comes_from_the_cache(
    tmp_path, monkeypatch, varied_reward, cold_start_cache
):
    overrides = [*COMMON, varied_reward]
    assert main(["train", "--output-dir", str(tmp_path / "first"), *overrides]) == 0
    assert len(list(cold_start_cache.iterdir())) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("the cold start trained instead of using the cache")

    monkeypatch.setattr(cs, "adamw", no_training)
    # RL settings are not part of the key: another run with other RL settings reuses it
    assert main(["train", "--output-dir", str(tmp_path / "again"), *overrides]) == 0
    assert records(tmp_path / "first") == records(tmp_path / "again")
    other_rl = [*overrides, "optim.lr=3e-3"]
    assert main(["train", "--output-dir", str(tmp_path / "other"), *other_rl]) == 0
    # --no-cache, and any setting of the cold start itself, trains again
    with pytest.raises(AssertionError, match="trained instead"):
        main(["train", "--output-dir", str(tmp_path / "nc"), *overrides, "--no-cache"])
    with pytest.raises(AssertionError, match="trained instead"):
        main(["train", "--output-dir", str(tmp_path / "lr"), *overrides, "train.seed=1"])


def test_cache_key_covers_what_decides_the_cold_start(tmp_path, monkeypatch):
    rows = [{"prompt": "1+1=", "completion": "2"}]
    one = Distributed()

    def key(*overrides, rows=rows):
        return cs.cold_start_key(load_config(None, list(overrides)), rows, one)

    base = key()
    assert key() == base
    assert key("optim.lr=1e-2", "train.max_steps=7", "algorithm.level=token") == base
    assert key("train.cold_start_save_every=3", "log.plots=false") == base
    assert key("model.activation_checkpointing=true") == base  # the same sums, recomputed
    for changed in (
        "train.seed=1",
        "train.cold_start_lr=1e-3",
        "train.cold_start_steps=3",
        "train.cold_start_batch_size=8",
        "model.hidden=32",
        "rollout.temperature=0.7",
    ):
        assert key(changed) != base, changed
    assert key(rows=[{"prompt": "1+1=", "completion": "3"}]) != base
    # a cache made where the CPU takes other kernels (no oneDNN, another ISA) is not reused
    with monkeypatch.context() as m:
        m.setattr(cs, "onednn_available", lambda: not onednn_available())
        assert key() != base
    with monkeypatch.context() as m:
        m.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "NO AVX")
        assert key() != base
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with_model = key(f"model.path={model}")
    (model / "config.json").write_text('{"a": 1}')
    assert key(f"model.path={model}") != with_model
    # an environment file edited (a tool renamed: its schema is in the SFT prompts); the
    # key held its spec's text alone, and the old cold start was reused
    env = tmp_path / "env.py"
    env.write_text("class Wallet:\n    def deposit(self, n: int) -> str:\n        return 'ok'\n")
    spec = f"rollout.environment={env}:Wallet"
    with_env = key(spec, "reward.functions=[exact_match]")
    assert key(spec, "reward.functions=[exact_match]") == with_env
    env.write_text(env.read_text().replace("deposit", "put_money"))
    assert key(spec, "reward.functions=[exact_match]") != with_env
    assert cs.environment_key("gspo.environments:Calculator").startswith(
        "gspo.environments:Calculator "
    )  # (a module's file: its digest too)


def test_cache_key_covers_the_file_a_package_re_exports_its_environment_from(tmp_path, monkeypatch):
    """``mypkg:Wallet``, a class defined in mypkg/wallet.py and imported by the package's
    __init__.py: the key digested __init__.py alone, and a tool renamed in wallet.py
    reused the old cold start (the tool's schema is in the SFT prompts)."""
    package = tmp_path / "walletpkg"
    package.mkdir()
    (package / "__init__.py").write_text("from walletpkg.wallet import Wallet\n")
    wallet = package / "wallet.py"
    wallet.write_text("class Wallet:\n    def deposit(self, n: int) -> str:\n        return 'ok'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = cs.environment_key("walletpkg:Wallet")
    assert before.startswith("walletpkg:Wallet ")
    assert cs.environment_key("walletpkg:Wallet") == before
    wallet.write_text(wallet.read_text().replace("deposit", "put_money"))
    assert cs.environment_key("walletpkg:Wallet") != before


def test_cache_dir_follows_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cs.cache_dir(load_config(None, [])) == tmp_path / "x" / "gspo" / "cold-start"
    custom = load_config(None, [f"train.cold_start_cache_dir={tmp_path / 'c'}"])
    assert cs.cache_dir(custom) == tmp_path / "c"
    assert cs.cache_dir(load_config(None, ["train.cold_start_cache=false"])) is None


CACHED = [*FAST, "train.max_steps=2", "eval.every=0", "model.device=cpu"]


def only_entry(cache):
    """The cache's one entry; nothing else in it (no temporary directory left)."""
    entries = sorted(cache.iterdir())
    assert len(entries) == 1 and not entries[0].name.startswith("."), entries
    return entries[0]


@pytest.mark.slow
def test_damaged_cache_entry_is_said_once_and_rebuilt(
    tmp_path, monkeypatch, capsys, varied_reward, cold_start_cache
):
    overrides = [*CACHED, varied_reward]
    assert main(["train", "--output-dir", str(tmp_path / "first"), *overrides]) == 0
    entry = only_entry(cold_start_cache)
    shard = entry / "sharded" / "__0_0.distcp"
    shard.unlink()  # damaged by hand, or by a crash of an older gspo
    (cold_start_cache / f".{entry.name}.4242.tmp").mkdir()  # an older gspo's leftover
    capsys.readouterr()
    trained, adamw = [], cs.adamw
    monkeypatch.setattr(cs, "adamw", lambda *a, **k: trained.append(1) or adamw(*a, **k))
    assert main(["train", "--output-dir", str(tmp_path / "again"), *overrides]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "cold start" in line]
    assert said == [
        f"cold start: ignoring the damaged cache entry {entry} "
        "(sharded/__0_0.distcp is missing); training it again"
    ]
    assert trained == [1]  # trained again, not loaded
    assert only_entry(cold_start_cache) == entry and shard.is_file()  # rebuilt whole
    assert records(tmp_path / "first") == records(tmp_path / "again")
    # a byte changed in place (same size): its manifest's CRC-32 (before: loaded as it was)
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--output-dir", str(tmp_path / "third"), *overrides]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "cold start" in line]
    assert len(said) == 1 and said[0].startswith(
        f"cold start: ignoring the damaged cache entry {entry} (sharded/__0_0.distcp holds "
        "other bytes (CRC-32 "
    )
    assert trained == [1, 1] and records(tmp_path / "third") == records(tmp_path / "first")
    # and replaced by the whole one it trained (kept before: every later run trained again)
    assert main(["train", "--output-dir", str(tmp_path / "loads"), *overrides]) == 0
    assert "ignoring the damaged" not in capsys.readouterr().out and trained == [1, 1]
    # an entry from before entries had a manifest: trained again quietly, not "damaged"
    (entry / "manifest.json").unlink()
    assert main(["train", "--output-dir", str(tmp_path / "fourth"), *overrides]) == 0
    assert "ignoring the damaged" not in capsys.readouterr().out and trained == [1, 1, 1]
    assert (entry / "manifest.json").is_file()  # replaced by a whole one


@pytest.mark.slow
def test_two_identical_runs_started_together_share_one_whole_entry(
    tmp_path, varied_reward, cold_start_cache
):
    overrides = [*CACHED, varied_reward]
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "gspo", "train", "--output-dir", tmp_path / name, *overrides],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in ("one", "two")
    ]
    outs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outs
    assert not any("Traceback" in out for out in outs)
    entry = only_entry(cold_start_cache)
    assert sharded_problem(entry / "sharded") is None and (entry / cs._LINES).is_file()
    assert records(tmp_path / "one") == records(tmp_path / "two")


def fake_entry(root, key: str, size: int, used: float):
    """A cache entry of ``size`` bytes last used at ``used`` (seconds since the epoch)."""
    entry = root / key
    (entry / "sharded").mkdir(parents=True)
    (entry / "sharded" / "__0_0.distcp").write_bytes(b"x" * size)
    (entry / "entry.json").write_text(f'{{"key": "{key}"}}')
    os.utime(entry / "entry.json", (used, used))
    return entry


def test_the_cache_is_trimmed_least_recently_used_first(tmp_path):
    root = tmp_path / "cache"
    keys = [f"{i:032x}" for i in range(5)]
    now = time.time()
    # entry i last used i hours ago; 1,000 bytes each (plus its record)
    entries = [fake_entry(root, k, 1000, now - 3600 * i) for i, k in enumerate(keys)]
    record = len(entries[0].joinpath("entry.json").read_bytes())
    unrelated = root / "notes"  # not a key: not the cache's to remove
    unrelated.mkdir()
    old_temp = root / f".{keys[4]}.4242.tmp"  # an earlier gspo's leftover, a day old
    old_temp.mkdir()
    os.utime(old_temp, (now - 86400, now - 86400))
    young_temp = root / f".{keys[3]}.4243.tmp"  # may still be written
    young_temp.mkdir()
    # keep the oldest (the run's own entry); room for it and the two most recent others
    removed, freed = cs.trim_cache(root, entries[4], 3 * (1000 + record))
    assert (removed, freed) == (2, 2 * (1000 + record))
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [keys[0], keys[1], keys[4], "notes", young_temp.name]
    )
    # a kept entry over the limit on its own stays; every other goes
    assert cs.trim_cache(root, entries[4], 1) == (2, 2 * (1000 + record))
    assert sorted(p.name for p in root.iterdir()) == sorted([keys[4], "notes", young_temp.name])


def test_reuse_marks_an_entry_as_recently_used(tmp_path):
    root = tmp_path / "cache"
    now = time.time()
    old, new = (fake_entry(root, f"{i:032x}", 100, now - 3600 * (2 - i)) for i in range(2))
    cs._touch(old)  # as a run that reuses it does
    mine, size = fake_entry(root, f"{9:032x}", 100, now), tree_bytes(new)
    assert cs.trim_cache(root, mine, 2 * size + 1) == (1, size)  # the newer but unused one
    assert sorted(p.name for p in root.iterdir()) == sorted([old.name, mine.name])


@pytest.mark.slow
def test_a_run_over_the_cache_limit_removes_older_entries_and_says_so(
    tmp_path, capsys, varied_reward, cold_start_cache
):
    overrides = [*CACHED, varied_reward]
    assert main(["train", "--output-dir", str(tmp_path / "first"), *overrides]) == 0
    first = only_entry(cold_start_cache)
    size = tree_bytes(first)
    capsys.readouterr()
    tiny = [*overrides, "train.seed=1", "train.cold_start_cache_max_gb=1e-9"]
    assert main(["train", "--output-dir", str(tmp_path / "second"), *tiny]) == 0
    second = only_entry(cold_start_cache)  # its own entry stays, over the limit alone
    assert second != first
    said = [line for line in capsys.readouterr().out.splitlines() if "removed" in line]
    assert said == [
        "cold start: cache over train.cold_start_cache_max_gb=1e-09: removed 1 least "
        f"recently used entries ({size / 1e9:.2f} GB) from {cold_start_cache}"
    ]


def test_a_diverged_cold_start_skips_its_non_finite_steps_and_stops_in_one_line(tmp_path, capsys):
    """A cold start whose gradients went non-finite took those steps (NaN weights, then a
    step-0 checkpoint refused for them, naming nothing about the cause). Now each such step
    is skipped on the device, and train.max_skipped of them in a row stop the run at its
    next line, naming the learning rate to lower (1e30: the first step's weights are so
    large that every later gradient overflows)."""
    overrides = [*FAST, "train.cold_start_steps=10", "train.cold_start_lr=1e30"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert "train.max_skipped=3: 9 of the cold start's steps in a row (by step 10)" in err
    assert "Lower train.cold_start_lr (it is 1e+30)" in err


def test_a_row_of_skipped_cold_start_steps_that_ended_before_its_line_still_stops_it(
    tmp_path, monkeypatch, capsys
):
    """Steps 3-5 of 10 non-finite, then finite again: the row was over (and its count
    back at 0) by step 10's line, where the count is read, and the run went on."""
    calls, real = {"n": 0}, torch.nn.utils.clip_grad_norm_

    def clip(*args, **kwargs):
        calls["n"] += 1
        norm = real(*args, **kwargs)
        return norm * float("nan") if 3 <= calls["n"] <= 5 else norm

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    overrides = [*FAST, "train.cold_start_steps=10", "train.cold_start_cache=false"]
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) != 0
    err = capsys.readouterr().err
    assert "train.max_skipped=3: 3 of the cold start's steps in a row (by step 10)" in err
    assert calls["n"] == 10


def _fused_step(
    grad: float, scaler=None, init_scale: float = 4.0, fused: bool = True, device: str = "cpu"
):
    """One step of a 2-weight model through step_if_finite on ``device``: its weights
    before and after, the (skipped, counted) flags and the scale after (float16's scaler)."""
    from gspo.training.update import step_if_finite

    layer = torch.nn.Linear(2, 1, bias=False, device=device)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=fused)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale) if scaler else None
    loss = layer(torch.ones(1, 2, device=device)).sum()
    (loss if scaler is None else scaler.scale(loss)).backward()
    layer.weight.grad.fill_(grad)
    if scaler is not None:
        scaler.unscale_(optimizer)
    before = layer.weight.detach().clone()
    norm = torch.nn.utils.clip_grad_norm_(layer.parameters(), 1.0)
    bad, counted = step_if_finite(optimizer, norm, scaler)
    scale = None if scaler is None else scaler.get_scale()
    steps = [s["step"].item() for s in optimizer.state.values()]
    return before, layer.weight.detach(), (bad.item(), counted.item()), scale, steps


def fused_steps_skip_on_the_device(device: str) -> None:
    """Fused AdamW given found_inf takes a finite step and skips a NaN one (its step count
    too); float16's scaler skips an overflow and halves its scale, counting it toward
    train.max_skipped only at a scale of 1 or below (tests/test_cuda.py: on CUDA)."""
    before, after, flags, _, steps = _fused_step(0.5, device=device)
    assert flags == (0.0, 0.0) and not torch.equal(before, after) and steps == [1.0]
    before, after, flags, _, steps = _fused_step(float("nan"), device=device)
    assert flags == (1.0, 1.0) and torch.equal(before, after) and steps == [0.0]
    run = partial(_fused_step, scaler=True, device=device)
    before, after, flags, scale, _ = run(float("inf"), init_scale=4.0)
    assert flags == (1.0, 0.0) and torch.equal(before, after) and scale == 2.0
    before, after, flags, scale, _ = run(float("inf"), init_scale=1.0)
    assert flags == (1.0, 1.0) and torch.equal(before, after) and scale == 0.5
    before, after, flags, scale, _ = run(0.5, init_scale=1.0)
    assert flags == (0.0, 0.0) and not torch.equal(before, after) and scale == 1.0


def test_a_non_finite_step_is_skipped_on_the_device_without_a_read():
    fused_steps_skip_on_the_device("cpu")
    # a non-fused optimizer (no found_inf): the norm is read, the step not taken
    before, after, flags, _, steps = _fused_step(float("nan"), fused=False)
    assert flags == (1.0, 1.0) and torch.equal(before, after) and steps == []
    before, after, flags, _, steps = _fused_step(0.5, fused=False)
    assert flags == (0.0, 0.0) and not torch.equal(before, after) and steps == [1.0]


def test_a_cache_dir_that_is_a_file_is_one_line_before_anything_trains(
    tmp_path, monkeypatch, capsys
):
    """``train.cold_start_cache_dir`` naming a file (or a path under one): the whole cold
    start trained, then ``cold start: not cached (...: File exists)``, the OS's words."""

    def no_training(*args, **kwargs):
        raise AssertionError("the cold start trained before the cache directory was checked")

    monkeypatch.setattr(cs, "adamw", no_training)
    afile = tmp_path / "afile"
    afile.write_text("")
    out = tmp_path / "run"
    for cache, where in ((afile, ""), (afile / "sub", f"{afile}, above it, ")):
        args = [*FAST, "train.max_steps=2", f"train.cold_start_cache_dir={cache}"]
        assert main(["train", "--output-dir", str(out), *args]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"gspo: error: train.cold_start_cache_dir={cache}: {where}is a file, not a "
            "directory; name a directory, or train.cold_start_cache=false (--no-cache) to "
            "keep no cache\n"
        )
    # without a cold start (or with the cache off) the setting is not used: no error
    config = load_config(
        None, [*FAST, "train.cold_start_steps=0", f"train.cold_start_cache_dir={afile}"]
    )
    Trainer(config, tmp_path / "none").close()
    monkeypatch.setenv("XDG_CACHE_HOME", str(afile))  # the default, under a file
    with pytest.raises(ValueError, match=r"cold_start_cache_dir \(unset: .*afile, above it,"):
        Trainer(load_config(None, FAST), tmp_path / "default")


def test_a_cold_start_resumed_with_other_settings_is_refused_in_one_line(tmp_path, capsys):
    """A run killed in its cold start, resumed with another ``train.cold_start_steps``
    (or lr, batch size, seed, temperature, rows), went on from its progress checkpoint unsaid:
    fewer steps than it had taken ran them all, and more stretched the rest of its
    learning-rate schedule; either was cached as a cold start of the new settings."""
    overrides = [*FAST, "train.cold_start_steps=10", "train.cold_start_save_every=5"]
    with pytest.MonkeyPatch.context() as m:
        kill_at(m, 7)
        with pytest.raises(Killed):
            Trainer(load_config(None, overrides), tmp_path / "cut").fit()
    run = tmp_path / "cut"
    for changed, said in (
        (["train.cold_start_steps=4"], "train.cold_start_steps=4 (was 10)"),
        (["train.cold_start_steps=0"], "train.cold_start_steps=0 (was 10)"),
        (["data.sft_size=150"], "data.sft (the built-in addition task) holds other rows"),
        (
            ["train.cold_start_lr=0.01", "rollout.temperature=0.7"],
            "train.cold_start_lr=0.01 (was 0.002); rollout.temperature=0.7 (was 1.0)",
        ),
    ):
        capsys.readouterr()
        assert main(["train", "--resume", str(run), *changed]) == 2
        assert capsys.readouterr().err == (
            f"gspo: error: resume: {said}: the run's cold start stopped at step 5 "
            "(cold-start-0000005) with the old settings and goes on only with them: resume "
            "without the change, or start the run again with it (--overwrite; "
            "gspo.train(..., overwrite=True))\n"
        )
    assert "cold_start_steps: 10" in (run / "config.yaml").read_text()  # as it was
    assert main(["train", "--resume", str(run), "train.max_steps=2", "eval.every=0"]) == 0
    assert [r["sft/step"] for r in read_metrics(run / "metrics.jsonl") if "sft/step" in r] == [10]


def test_an_overwrite_interrupted_before_its_first_checkpoint_puts_the_old_run_back(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C a few seconds into a ``--overwrite`` run's cold start removed the old run,
    and left a new one with nothing to resume from (no checkpoint of either kind)."""
    old = tmp_path / "run"
    (old / "checkpoints" / "step-0000004").mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 4}\n')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cs, "adamw", interrupted)  # (the cold start's first line)
    args = [*FAST, "train.max_steps=2", "train.cold_start_cache=false"]
    assert main(["train", "--output-dir", str(old), "--overwrite", *args]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"gspo: interrupted; the run that was in {old} is back as it was"
    )
    assert (old / "metrics.jsonl").read_text() == '{"step": 4}\n'
    assert sorted(p.name for p in old.iterdir()) == ["checkpoints", "metrics.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # (nothing left aside)
