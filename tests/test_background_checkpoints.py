"""Checkpoints written in a background thread (``train.background_checkpoints``): the same
run and the same files as written at once, a snapshot of the step, errors in one line."""

from __future__ import annotations

import errno
import json
import re
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from test_trainer import FAST

import gspo.training.checkpoint as ckpt
from gspo.cli import main
from gspo.config import load_config
from gspo.publish import MANIFEST, check_manifest
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer

RUN = [
    *FAST,
    "train.cold_start_steps=10",
    "train.max_steps=6",
    "algorithm.minibatches=2",
    "algorithm.kl_coef=0.01",  # the KL reference reads step 0 from disk
    "train.save_every=1",
    "train.keep_checkpoints=10",
    "eval.every=2",
    "optim.lr=1e-3",
]


def writer_threads(monkeypatch) -> list[str]:
    """The names of the threads that write checkpoints, in order (filled as they write)."""
    names: list[str] = []
    real = ckpt.write_checkpoint

    def write(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_checkpoint", write)
    return names


def untokened(data: bytes) -> bytes:
    """``data`` less the random token of a temporary directory's name and DCP's save id."""
    data = re.sub(rb"\.gspo-[0-9a-f]{12}\.", b".gspo-TOKEN.", data)
    return re.sub(rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", b"UUID", data)


def files(checkpoint):
    return {
        str(f.relative_to(checkpoint)): f.read_bytes()
        for f in sorted(checkpoint.rglob("*"))
        if f.is_file()
    }


@pytest.mark.parametrize("lora", [0, 4], ids=["full", "lora"])
def test_background_checkpoints_give_the_same_run_and_the_same_files(
    tmp_path, monkeypatch, varied_reward, lora
):
    names = writer_threads(monkeypatch)
    runs = {}
    for setting in ("true", "false"):
        names.clear()
        run = tmp_path / "run"  # (the shards' metadata and a LoRA's base name it)
        args = [*RUN, varied_reward, f"model.lora.r={lora}"]
        args += ["train.cold_start_steps=0"] if lora else []
        args.append(f"train.background_checkpoints={setting}")
        assert main(["train", "--output-dir", str(run), *args]) == 0
        background = setting == "true"
        assert len(names) == 4  # steps 0, 2, 4, 6
        # the run's last is written at once, from the live tensors: nothing trains after it
        writers = [n == "gspo checkpoint writer" for n in names]
        assert writers == [background] * 3 + [False], names
        runs[setting] = run.rename(tmp_path / setting)

    on, off = (read_metrics(runs[s] / "metrics.jsonl") for s in ("true", "false"))
    assert [sorted(r) for r in on] == [sorted(r) for r in off]  # same lines, same keys, in order
    for a, b in zip(on, off, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith(("time", "io/"))} == {
            k: v for k, v in b.items() if not k.startswith(("time", "io/"))
        }
        if "io/checkpoint_bytes" in a:  # its config.yaml says "true" for "false": one byte
            assert b["io/checkpoint_bytes"] - a["io/checkpoint_bytes"] == 1
    written = [r for r in on if "io/checkpoint_bytes" in r]
    assert [r["step"] for r in written] == [0, 2, 4, 6]
    assert all(r["time/checkpoint_write"] > 0 for r in written)
    at_once = [r for r in off if "io/checkpoint_bytes" in r]  # the run waited for all of it
    assert all(r["time/checkpoint"] >= r["time/checkpoint_write"] > 0 for r in at_once)

    steps = sorted(p.name for p in (runs["true"] / "checkpoints").glob("step-*"))
    assert steps == ["step-0000000", "step-0000002", "step-0000004", "step-0000006"]
    for name in steps:  # the weights, the optimizer state, the scheduler: byte for byte
        got, want = (files(runs[s] / "checkpoints" / name) for s in ("true", "false"))
        assert sorted(got) == sorted(want)
        weights = "adapter_model.safetensors" if lora else "model.safetensors"
        assert "sharded/__0_0.distcp" in got and weights in got
        for path in want:  # (the shards' metadata name the temporary directory, an id)
            if path == MANIFEST:  # (and so its CRC-32 differs)
                got_crcs, want_crcs = (json.loads(f[path])["crc32"] for f in (got, want))
                assert sorted(got_crcs) == sorted(set(want) - {MANIFEST}) == sorted(want_crcs)
                got_crcs.pop("sharded/.metadata"), want_crcs.pop("sharded/.metadata")
                got_crcs.pop("config.yaml"), want_crcs.pop("config.yaml")  # (below)
                assert got_crcs == want_crcs, name
            elif path == "config.yaml":  # the run's settings: this one setting apart
                on = got[path].replace(b"background_checkpoints: true", b"X")
                assert on == want[path].replace(b"background_checkpoints: false", b"X")
            else:
                assert untokened(got[path]) == untokened(want[path]), (name, path)
        for s in ("true", "false"):  # every file's bytes are the ones its manifest records
            check_manifest(runs[s] / "checkpoints" / name)
    latest = (runs["true"] / "checkpoints" / "latest").read_text().strip()
    assert latest == "step-0000006"


def test_a_background_checkpoint_is_the_step_it_was_taken_at(tmp_path, monkeypatch):
    """Training that changes the weights and the optimizer state while the checkpoint is
    being written does not change what is written."""
    release = threading.Event()
    real = ckpt.write_sharded

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "write_sharded", held)
    config = load_config(None, [*FAST, "train.cold_start_steps=0", "train.keep_checkpoints=5"])
    trainer = Trainer(config, tmp_path / "run")
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    for p in params:  # one optimizer step: AdamW holds state
        p.grad = torch.randn_like(p)
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.policy_update.step = 3
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    moments = [trainer.optimizer.state[p]["exp_avg"].clone() for p in params]
    lr = trainer.scheduler.get_last_lr()

    path = trainer.save_checkpoint()
    assert trainer.checkpoints.pending is not None and not path.exists()  # in flight
    with torch.no_grad():  # the next steps, while the write waits
        for p in params:
            p.add_(1.0)
            trainer.optimizer.state[p]["exp_avg"].mul_(-2.0)
    trainer.scheduler.step()
    trainer.policy_update.step = 4
    release.set()
    trainer.close()
    assert (path.parent / "latest").read_text().strip() == path.name == "step-0000003"

    on_disk = load_file(path / "model.safetensors")
    assert on_disk and set(on_disk) <= set(weights)
    for name, tensor in on_disk.items():
        torch.testing.assert_close(tensor, weights[name], rtol=0, atol=0)
    resumed = Trainer(config, tmp_path / "run", resume=True)  # the weights from the HF files
    assert resumed.step == 3
    for (name, p), moment in zip(resumed.model.named_parameters(), moments, strict=True):
        torch.testing.assert_close(p.detach(), weights[name], rtol=0, atol=0)
        torch.testing.assert_close(resumed.optimizer.state[p]["exp_avg"], moment, rtol=0, atol=0)
    assert resumed.scheduler.get_last_lr() == lr
    resumed.close()


def test_a_failed_background_write_ends_the_run_in_one_line(
    tmp_path, capsys, monkeypatch, varied_reward
):
    """A full disk in the writer thread is raised in the main thread at its next wait:
    the run stops with the one line, the previous checkpoint stays the latest."""
    names = writer_threads(monkeypatch)
    real = ckpt.write_sharded

    def full(path, *args, **kwargs):
        if "step-0000002" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt, "write_sharded", full)
    run = tmp_path / "run"
    args = [*FAST, varied_reward, "train.cold_start_steps=10", "algorithm.minibatches=2",
            "train.max_steps=8", "train.save_every=2", "eval.every=0"]  # fmt: skip
    capsys.readouterr()
    assert main(["train", "--output-dir", str(run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    final = run / "checkpoints" / "step-0000002"
    assert err.startswith(f"gspo: error: No space left on device writing {final}: it needs ")
    assert names[1:] == ["gspo checkpoint writer"]  # step 2's, after step 0's: none after it
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000000"
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000008"


def test_an_exception_waits_for_the_write_in_flight(tmp_path, monkeypatch, varied_reward):
    """A run stopped by an exception (here Ctrl-C) while a checkpoint is being written
    finishes that checkpoint first: ``latest`` names it and its line is logged."""
    real = Trainer.rl_step
    calls = [0]

    def interrupted(self, index):
        calls[0] += 1
        if calls[0] == 2:  # after step 2's checkpoint was handed to the writer
            raise KeyboardInterrupt
        return real(self, index)

    monkeypatch.setattr(Trainer, "rl_step", interrupted)
    run = tmp_path / "run"
    args = [*FAST, varied_reward, "train.cold_start_steps=0", "algorithm.minibatches=2",
            "train.max_steps=8", "train.save_every=2", "eval.every=0"]  # fmt: skip
    assert main(["train", "--output-dir", str(run), *args]) == 130
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    lines = [r for r in read_metrics(run / "metrics.jsonl") if "io/checkpoint_bytes" in r]
    assert [r["step"] for r in lines] == [0, 2]


def test_the_run_goes_on_while_a_checkpoint_is_written(tmp_path, monkeypatch, varied_reward):
    """A write still in flight a whole step later costs the run only its snapshot
    (``time/checkpoint``; ``time/checkpoint_write`` is the write's own seconds), and the
    lines logged meanwhile come after the checkpoint's, as in a synchronous run."""
    release = threading.Event()
    real_write, real_step = ckpt.write_sharded, Trainer.rl_step

    def slow(path, *args, **kwargs):
        if "step-0000002" in str(path):
            assert release.wait(60)
            time.sleep(0.5)
        return real_write(path, *args, **kwargs)

    def step(self, index):
        if index == 3:  # step 3 trained and logged while step 2's checkpoint is written
            assert self.checkpoints.pending.thread.is_alive()
            release.set()
            self.checkpoints.pending.thread.join()
        return real_step(self, index)

    monkeypatch.setattr(ckpt, "write_sharded", slow)
    monkeypatch.setattr(Trainer, "rl_step", step)
    run = tmp_path / "run"
    args = [*FAST, varied_reward, "train.cold_start_steps=0", "algorithm.minibatches=1",
            "train.max_steps=4", "train.save_every=2", "eval.every=0"]  # fmt: skip
    assert main(["train", "--output-dir", str(run), *args]) == 0
    records = read_metrics(run / "metrics.jsonl")
    lines = {r["step"]: r for r in records if "io/checkpoint_bytes" in r}
    assert sorted(lines) == [0, 2, 4]
    assert lines[2]["time/checkpoint_write"] >= 0.5 > lines[2]["time/checkpoint"]
    steps = [r["step"] for r in records if "train/loss" in r or "io/checkpoint_bytes" in r]
    assert steps == [0, 1, 2, 2, 3, 4, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_a_nan_or_an_infinity_anywhere(dtype):
    """One NaN, +inf or -inf at any place of any tensor, in any float dtype, is found; empty
    tensors and finite extremes (the dtype's largest and smallest values) are finite."""
    info = torch.finfo(dtype)
    extremes = torch.tensor([info.max, info.min, info.tiny, -0.0], dtype=dtype)
    tensors = [torch.randn(7, 3).to(dtype), torch.empty(0, dtype=dtype), extremes]
    assert ckpt.all_finite(tensors) and ckpt.all_finite([]) and ckpt.all_finite(tensors[1:2])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for which in (0, 2):
            for place in range(tensors[which].numel()):
                spoiled = [t.clone() for t in tensors]
                spoiled[which].view(-1)[place] = bad
                assert not ckpt.all_finite(spoiled), (bad, which, place)
    big = torch.randn(1 << 20).to(dtype)  # (vectorised reductions: a place in every lane)
    for place in (0, 17, (1 << 19) + 5, (1 << 20) - 1):
        spoiled = big.clone()
        spoiled[place] = float("nan")
        assert not ckpt.all_finite([spoiled])


def test_weights_that_are_not_finite_are_not_checkpointed(tmp_path):
    """A NaN or an infinity in any weight: the checkpoint is refused in one line, and the
    one before it stays the latest."""
    config = load_config(None, [*FAST, "train.cold_start_steps=0", "train.keep_checkpoints=5"])
    trainer = Trainer(config, tmp_path / "run")
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    for p in params:  # one optimizer step: the checkpoint holds the weights, not a pointer
        p.grad = torch.randn_like(p)
    trainer.optimizer.step()
    trainer.policy_update.step = 1
    good = trainer.save_checkpoint(last=True)
    for bad in (float("nan"), float("inf"), float("-inf")):
        with torch.no_grad():
            saved = params[-1].view(-1)[-1].item()
            params[-1].view(-1)[-1] = bad
        trainer.policy_update.step += 1
        with pytest.raises(ValueError, match=r"not written: the weights hold NaN or inf"):
            trainer.save_checkpoint(last=True)
        with torch.no_grad():
            params[-1].view(-1)[-1] = saved
        assert (good.parent / "latest").read_text().strip() == good.name
        assert not (good.parent / f"step-{trainer.step:07d}").exists()
    trainer.close()


def test_a_wait_cut_by_a_signal_waits_again_for_the_whole_write(tmp_path, monkeypatch):
    """A second SIGTERM while a stopped run waits for its checkpoint interrupts the wait;
    waiting again (the way out of the run does) still waits for the write. Python 3.11's
    interrupted ``Thread.join`` marked the writer ended, the next join returned at once:
    ``latest`` named a step not on disk, logged as 0 bytes."""
    import signal

    release = threading.Event()
    real = ckpt.write_sharded

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    class Cut(Exception):
        pass

    def cut(*_):
        raise Cut

    monkeypatch.setattr(ckpt, "write_sharded", held)
    config = load_config(None, [*FAST, "train.cold_start_steps=0", "train.keep_checkpoints=5"])
    trainer = Trainer(config, tmp_path / "run")
    trainer.policy_update.step = 3
    path = trainer.save_checkpoint()
    previous = signal.signal(signal.SIGALRM, cut)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Cut):
            trainer.checkpoints.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert trainer.checkpoints.pending is not None and not path.exists()
    threading.Timer(0.5, release.set).start()
    trainer.checkpoints.wait()
    assert path.is_dir() and (path / MANIFEST).is_file()
    assert (path.parent / "latest").read_text().strip() == path.name == "step-0000003"
    line = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 3]
    assert line and line[-1]["io/checkpoint_bytes"] > 0
    trainer.close()


def test_the_writers_tokenizer_copy_is_in_the_checkpoints_time(tmp_path, monkeypatch):
    """The first background checkpoint copies the tokenizer for the writer thread, in the
    run's time (``time/checkpoint``, and the longest checkpoint the time limit keeps room
    for): moved from the trainer's ``take`` into Checkpoints.save, it was left out."""
    from types import SimpleNamespace

    from gspo.distributed import Distributed
    from gspo.training import checkpoint_writes

    class SlowToCopy:
        def __deepcopy__(self, memo):
            time.sleep(0.3)
            return SlowToCopy()

    logged: list[tuple[int, dict]] = []
    logger = SimpleNamespace(log=lambda step, metrics: logged.append((step, dict(metrics))))
    monkeypatch.setattr(ckpt, "write_checkpoint", lambda state, dist: (0, 0.0, {}))
    monkeypatch.setattr(checkpoint_writes, "finish_checkpoint", lambda *a, **k: None)
    tokenizer = SlowToCopy()
    checkpoints = checkpoint_writes.Checkpoints(
        tmp_path, logger, keep=1, dist=Distributed(), background=True, tokenizer=tokenizer
    )
    given = []

    def take(copy, tok):
        given.append((copy, tok))
        return SimpleNamespace(step=1, final=tmp_path / "step-0000001")

    checkpoints.save(take)
    checkpoints.wait()
    ((copy, tok),) = given
    assert copy and isinstance(tok, SlowToCopy) and tok is not tokenizer
    ((step, line),) = logged
    assert step == 1 and line["time/checkpoint"] >= 0.3
    assert checkpoints.longest_s >= 0.3
