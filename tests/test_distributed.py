"""Data-parallel training: metric combination, sharding rules, and real 2-rank gloo runs.

The runs name ``model.device=cpu`` (SMALL_RUN, :data:`conftest.CPU`): on a machine with
GPUs they stay on the CPU and gloo too; tests/test_cuda.py has the NCCL run."""

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU, device_named_in
from test_trainer import FAST as SMALL_RUN  # the small, fast run setting (on the CPU)
from test_trainer import comparable

from gspo.cli import main
from gspo.config import load_config
from gspo.distributed import Distributed, combine_metrics, decoder_blocks
from gspo.telemetry import read_metrics
from gspo.trainer import SHARDED, Trainer, latest_checkpoint, metric_reduction

HERE = Path(__file__).parent


def by_level(key):
    return metric_reduction(key, "sequence")


def test_combine_weights_fractions_by_their_counts():
    ranks = [
        {"train/clip_fraction": 0.5, "train/tokens": 30.0, "train/sequences": 3.0},
        {"train/clip_fraction": 0.0, "train/tokens": 10.0, "train/sequences": 5.0},
    ]
    out = combine_metrics(ranks, by_level)
    assert out["train/clip_fraction"] == pytest.approx(15 / 40)  # token-weighted
    assert out["train/tokens"] == 40.0 and out["train/sequences"] == 8.0
    # the cold start's: its loss by tokens, its tokens added up (averaged before: 14.5)
    sft = [{"sft/loss": 2.0, "sft/tokens": 12.0}, {"sft/loss": 1.0, "sft/tokens": 17.0}]
    out = combine_metrics(sft, by_level)
    assert out == {"sft/loss": pytest.approx(41 / 29), "sft/tokens": 29.0}


def test_combine_keeps_the_integers_every_rank_logs_as_integers():
    """train/minibatch and train/rollout read 0.0, 1.0 under torchrun, 0, 1 in one process."""
    ranks = [{"train/minibatch": 1, "train/rollout": 3, "train/tokens": 10.0}] * 2
    out = combine_metrics(ranks, by_level)
    assert out == {"train/minibatch": 1, "train/rollout": 3, "train/tokens": 20.0}
    assert isinstance(out["train/minibatch"], int) and isinstance(out["train/tokens"], float)
    mixed = combine_metrics([{"x": 1}, {"x": 2}], lambda key: ("mean", None))
    assert mixed == {"x": 1.5}  # not whole: a float


def test_combine_extremes_ignore_a_rank_with_nothing_measured():
    ranks = [
        {"train/ratio_min": 0.9, "train/ratio_max": 1.2, "train/sequences": 4.0},
        {"train/ratio_min": math.nan, "train/ratio_max": math.nan, "train/sequences": 0.0},
        {"train/ratio_min": 0.7, "train/ratio_max": 1.1, "train/sequences": 2.0},
    ]
    out = combine_metrics(ranks, by_level)
    assert out["train/ratio_min"] == 0.7 and out["train/ratio_max"] == 1.2


def test_combine_weighted_mean_skips_zero_weight_nan_and_missing_keys():
    ranks = [
        {"train/ratio_mean": 1.1, "train/sequences": 3.0, "moe/x": 0.2, "time/step": 1.0},
        {"train/ratio_mean": math.nan, "train/sequences": 0.0, "time/step": 3.0},
        {"train/ratio_mean": 0.9, "train/sequences": 1.0, "moe/x": 0.4, "time/step": 2.0},
    ]
    out = combine_metrics(ranks, by_level)
    assert out["train/ratio_mean"] == pytest.approx((3 * 1.1 + 0.9) / 4)
    assert out["moe/x"] == pytest.approx(0.3)  # plain mean over the ranks that have it
    assert out["time/step"] == 3.0  # a step lasts as long as its slowest rank


def test_token_level_ratio_mean_is_token_weighted():
    assert metric_reduction("train/ratio_mean", "token") == ("mean", "train/tokens")
    assert metric_reduction("train/ratio_mean", "sequence") == ("mean", "train/sequences")
    assert metric_reduction("train/loss", "token") == ("mean", "train/sequences")


def test_the_correction_weight_mean_is_weighted_by_what_it_averages():
    """10 tokens at weight 1.0 and 2 at 0.5 are 0.917 over the 12 tokens (the ranks' plain
    mean, 0.75, before); sequence_mask's weight is per response."""
    ranks = [
        {"correction/weight_mean": 1.0, "mismatch/tokens": 10, "mismatch/sequences": 1},
        {"correction/weight_mean": 0.5, "mismatch/tokens": 2, "mismatch/sequences": 3},
    ]
    for mode, expected in (("token_tis", 11 / 12), ("token_mask", 11 / 12),
                           ("sequence_mask", 2.5 / 4)):  # fmt: skip
        out = combine_metrics(ranks, lambda key, mode=mode: metric_reduction(key, "sequence", mode))
        assert out["correction/weight_mean"] == pytest.approx(expected)


def test_expert_churn_is_weighted_by_each_ranks_counted_tokens():
    """(8 tokens, 0.25) and (5, 0.10) are 0.192 over the 13 tokens, not the plain 0.175;
    a rank with no token (its fraction 0.0) has no say (before: it pulled toward 0)."""
    ranks = [
        {"moe/expert_change_fraction": 0.25, "moe/expert_change_fraction/layer_0": 0.5,
         "moe/churn_tokens": 8},
        {"moe/expert_change_fraction": 0.10, "moe/expert_change_fraction/layer_0": 0.1,
         "moe/churn_tokens": 5},
        {"moe/expert_change_fraction": 0.0, "moe/expert_change_fraction/layer_0": 0.0,
         "moe/churn_tokens": 0},
    ]  # fmt: skip
    out = combine_metrics(ranks, by_level)
    assert out["moe/expert_change_fraction"] == pytest.approx((8 * 0.25 + 5 * 0.10) / 13)
    assert out["moe/expert_change_fraction/layer_0"] == pytest.approx((8 * 0.5 + 5 * 0.1) / 13)
    assert out["moe/churn_tokens"] == 13


def test_minibatch_parts_have_one_process_sizes_over_the_ranks():
    """6 rows a rank, 2 ranks, 4 minibatches: 3 + 3 + 3 + 3 as one process splits 12
    (before: each rank split its own 6, 2 + 2 + 1 + 1, so 4, 4, 2, 2 rows a minibatch)."""
    for local, world, parts in [(6, 2, 4), (6, 2, 3), (8, 2, 4), (5, 3, 4), (4, 4, 4)]:
        shares = [Distributed(r, world).part_shares(local, parts) for r in range(world)]
        for mine in shares:  # each rank's parts cover its rows in order, none empty
            assert mine[0][0] == 0 and mine[-1][1] == local
            assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
            assert all(end > start for start, end in mine)
        sizes = [sum(end - start for start, end in part) for part in zip(*shares, strict=True)]
        assert sizes == [len(p) for p in torch.arange(local * world).tensor_split(parts)]
    for rows in range(1, 12):  # one process: tensor_split's own parts
        for parts in range(1, rows + 1):
            got = [torch.arange(rows)[a:b] for a, b in Distributed().part_shares(rows, parts)]
            want = torch.arange(rows).tensor_split(parts)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_a_warning_about_one_ranks_share_names_the_rank(monkeypatch, capsys):
    """Said by each rank that saw it, so two identical lines read as two ranks' (before:
    the same line twice, each with one rank's counts)."""
    from gspo.distributed import rank_said
    from gspo.training.rollout import Scorer

    assert rank_said() == ""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert rank_said() == " (rank 1 of 2)"
    Scorer(None, None).warn_if_unscored({"f": [None, None]}, 2)
    assert capsys.readouterr().err.startswith(
        "gspo: warning (rank 1 of 2): every reward function returned None"
    )


def test_single_process_combines_nothing():
    single = Distributed()
    assert not single.enabled and single.is_main
    assert single.gather_objects({"a": 1}) == [{"a": 1}]
    assert single.mean_scale(7) == 1.0


def test_a_ranks_router_loss_is_averaged_over_ranks_whatever_it_counted(tiny_model):
    """The policy loss is scaled by the rank's share of the counted responses; a MoE
    router loss (over the rank's own tokens) is not: a rank that counted no response this
    minibatch still balances its experts (before: its router loss was scaled to 0)."""
    from types import SimpleNamespace

    from gspo.training.policy import Policy

    policy = Policy(tiny_model, Distributed(), compute_dtype=torch.float32, temperature=1.0)

    def scale(n):  # (a float64 tensor, as mean_scale's)
        return torch.tensor(2 * n / (n + 3), dtype=torch.float64)

    policy.dist = SimpleNamespace(enabled=True, mean_scale=scale)
    weight = next(p for p in tiny_model.parameters() if p.dim() == 2)
    policy.backward(weight.sum() * 0.0, 0, own=weight.square().sum())
    torch.testing.assert_close(weight.grad, 2 * weight.detach())
    weight.grad = None
    policy.backward(weight.sum(), 3, own=weight.square().sum())
    torch.testing.assert_close(weight.grad, 1 + 2 * weight.detach())


def test_batch_sizes_must_divide_over_the_ranks(tmp_path):
    config = load_config(None, SMALL_RUN)
    with pytest.raises(ValueError, match=r"rollout\.prompts_per_batch=4 is not divisible by the 3"):
        Trainer(config, tmp_path, dist=Distributed(rank=0, world_size=3))
    # the ranks of every node (it named --nproc-per-node alone: 2 nodes of 8 are 16 ranks)
    with pytest.raises(ValueError, match=r"the 16 ranks \(torchrun's --nnodes times --nproc-per"):
        Distributed(rank=0, world_size=16).shard(12, "rollout.prompts_per_batch")
    too_many = load_config(None, [*SMALL_RUN, "algorithm.minibatches=16"])
    with pytest.raises(ValueError, match="algorithm.minibatches=16 exceeds the 8 responses"):
        Trainer(too_many, tmp_path, dist=Distributed(rank=0, world_size=2))
    # the cold start's batch only where a cold start runs (it refused 3 ranks to every
    # recipe, none of which runs one)
    from gspo.training.setup import local_shares

    three = Distributed(rank=0, world_size=3)
    sft = load_config(None, ["rollout.prompts_per_batch=6", "train.cold_start_batch_size=16"])
    with pytest.raises(ValueError, match=r"train\.cold_start_batch_size=16 is not divisible"):
        local_shares(sft, three)
    none = load_config(None, ["rollout.prompts_per_batch=6", "train.cold_start_steps=0"])
    assert local_shares(none, three)[0] == 2


@pytest.mark.slow
def test_launcher_settings_set_by_hand_are_one_line_and_a_lone_rank_says_it_waits(
    monkeypatch, capsys
):
    """WORLD_SIZE=2 without RANK was a traceback (KeyError: 'RANK'); with RANK=0 the rank
    waited gloo's 30 minutes for the other without a word."""
    import time

    import gspo.distributed as distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    for rank in (None, "2", "first"):
        if rank is not None:
            monkeypatch.setenv("RANK", rank)
        with pytest.raises(
            ValueError, match=r"^RANK is .* beside WORLD_SIZE=2: a run of several"
        ) as e:
            distributed.setup_distributed("cpu")
        assert "unset" in str(e.value) if rank is None else repr(rank) in str(e.value)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29533")
    monkeypatch.setattr(distributed, "JOIN_SAY_S", 0.1)
    monkeypatch.setattr(distributed, "JOIN_POLL_S", 0.1)  # (a line said again would show)

    said: list[str] = []

    def never_joined(backend):
        # the waiting thread's line, however late a loaded machine runs it (a fixed 0.5 s
        # wait saw nothing where the thread ran 0.4 s late), then time to say it again
        deadline = time.monotonic() + 30
        while "still waiting" not in "".join(said) and time.monotonic() < deadline:
            time.sleep(0.05)
            said.append(capsys.readouterr().err)
        time.sleep(0.5)
        raise RuntimeError("timed out")

    monkeypatch.setattr(torch.distributed, "init_process_group", never_joined)
    with pytest.raises(RuntimeError):
        distributed.setup_distributed("cpu")
    assert "".join(said) + capsys.readouterr().err == (
        "gspo: rank 0 of 2: still waiting at 127.0.0.1:29533 for the other ranks to join "
        "(started by torchrun, each with its RANK?)\n"
    )


def test_a_setup_error_under_torchrun_is_said_once(tmp_path):
    """Every rank finds the same bad input while setting up: rank 0 alone says it (each
    rank printed it before, interleaved)."""
    for bad in ("rollout.prompts_per_batch=3", "optim.lrr=1"):
        done = torchrun(
            "-m", "gspo", "train", "--output-dir", str(tmp_path / "run"), CPU, bad, check=False
        )
        said = [line for line in done.stderr.splitlines() if line.startswith("gspo: error:")]
        assert done.returncode != 0 and len(said) == 1, done.stderr[-2000:]
        assert bad.split("=")[0] in said[0]
        assert not (tmp_path / "run").exists()  # rank 1 made it again after rank 0 removed it


def test_a_collective_broken_by_another_rank_is_one_line(tmp_path, monkeypatch, capsys):
    """Another rank failed or was killed: this rank's collective breaks (gloo: "Connection
    reset by peer"). The other rank says why; this one says so in one line with the resume
    command (a 60-line gloo traceback before). Outside torchrun the error is not hidden."""
    import gspo.cli

    gloo = (
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:29500: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application. Check the logs of the remote worker."
    )

    def broken(args):
        raise RuntimeError(gloo)

    monkeypatch.setattr(gspo.cli, "run_train", broken)
    (tmp_path / "run" / "checkpoints" / "step-0000000").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("{}\n")  # (a run that has a checkpoint)
    args = ["train", "--output-dir", str(tmp_path / "run"), CPU]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(args) == 2
    assert capsys.readouterr().err == (
        "gspo: error (rank 0 of 2): another rank stopped (the process group broke: Read error "
        "[127.0.0.1]:29500: Connection reset by peer); its "
        "own line, if it printed one (a signal or a kill prints none), says why; resume with "
        f"gspo train --resume {tmp_path / 'run'}\n"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "gspo" / "checkpoints" / "step-0000000").mkdir(parents=True)
    (tmp_path / "runs" / "gspo" / "config.yaml").write_text("{}\n")
    assert main(["train", CPU]) == 2  # the default run directory, not "DIR"
    assert "resume with gspo train --resume runs/gspo" in capsys.readouterr().err
    # a run that wrote nothing (a setup error on another rank): no resume said
    assert main(["train", "--output-dir", str(tmp_path / "new"), CPU]) == 2
    said = capsys.readouterr().err
    assert said.endswith("says why; it had written nothing to resume from: the same command "
                         "starts it again\n"), said  # fmt: skip
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="Connection reset"):
        main(args)


def test_overwrite_under_torchrun_has_every_rank_wait_for_rank_0s_decision(tmp_path):
    """Each rank looked for the old run itself: a rank looking after rank 0 had set it
    aside skipped the barrier, the ranks' collectives no longer matched (a gloo error, the
    old run left hidden beside an empty directory). Rank 0 decides; every rank waits once."""
    from gspo.runs import RunDirectory

    class Recorded(Distributed):
        barriers = 0

        def barrier(self) -> None:
            self.barriers += 1

        def gather_objects(self, obj):  # (a wait too: rank 0's job id, sent to every rank)
            self.barriers += 1
            return [obj] * self.world_size

    old = tmp_path / "run"
    (old / "checkpoints").mkdir(parents=True)
    for rank in (1, 0, 1):  # rank 1 before rank 0 sets the old run aside, then after
        dist = Recorded(rank=rank, world_size=2)
        with RunDirectory(old, replace=True, dist=dist, name="--output-dir") as run:
            assert dist.barriers == 1  # the last one: 0 before
            assert (run.aside is not None) == (rank == 0)
            run.started()  # rank 0: the old run goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_another_rank_stopping_on_its_input_undoes_the_start_on_rank_0_too(tmp_path, monkeypatch):
    """A reward function failing on rank 1 only, before the run started: rank 0 stopped on
    the broken process group (no input error of its own), took it for an interruption and
    removed the old run that --overwrite had set aside (torchrun's SIGTERM then cut the
    removal, leaving half of it hidden); without --overwrite the new directory stayed and
    the fixed command was refused. Rank 1 now leaves a mark, and rank 0 undoes the start."""
    import gspo.runs
    from gspo.rewards.contract import RewardError
    from gspo.runs import UNDONE_MARK, RunDirectory

    class Quiet(Distributed):
        def barrier(self) -> None:
            pass

        def gather_objects(self, obj):
            return [obj] * self.world_size

    def stop_on_rank_1(out: Path, replace: bool) -> RuntimeError:
        zero, one = (
            RunDirectory(
                out, replace=replace, dist=Quiet(rank=r, world_size=2), name="--output-dir"
            )
            for r in (0, 1)
        )
        zero.__enter__(), one.__enter__()
        zero.built(), one.built()
        (out / "checkpoints" / "step-0000000").mkdir(parents=True, exist_ok=True)  # the new run's
        one.__exit__(RewardError, RewardError("raised"), None)
        assert (out / UNDONE_MARK).exists()
        broken = RuntimeError("[../gloo/transport/tcp/pair.cc:537] Connection closed by peer")
        zero.__exit__(RuntimeError, broken, None)
        return broken

    old = tmp_path / "run"
    (old / "checkpoints" / "step-0000004").mkdir(parents=True)
    (old / "metrics.jsonl").write_text('{"step": 4}\n')
    broken = stop_on_rank_1(old, replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step-0000004"]
    assert (old / "metrics.jsonl").read_text() == '{"step": 4}\n'
    assert broken.__notes__ == [f"the run that was in {old} is back as it was"]
    broken = stop_on_rank_1(tmp_path / "new", replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert broken.__notes__ == [
        f"what the run wrote in {tmp_path / 'new'} is removed; the same command runs once "
        "its input is fixed"
    ]
    # every rank failing alike, rank 0 first: rank 1's mark lands in the old run put back.
    # The next job's rank 0 removes it (it undid that job's started run when interrupted)
    zero, one = (
        RunDirectory(old, replace=True, dist=Quiet(rank=r, world_size=2), name="--output-dir")
        for r in (0, 1)
    )
    zero.__enter__(), one.__enter__()
    zero.built(), one.built()
    zero.__exit__(RewardError, RewardError("raised"), None)
    one.__exit__(RewardError, RewardError("raised"), None)
    assert (old / UNDONE_MARK).is_file() and (old / "metrics.jsonl").is_file()
    monkeypatch.setattr(gspo.runs, "job_id", lambda: "another job")
    zero = RunDirectory(old, replace=False, dist=Quiet(rank=0, world_size=2), name="--resume")
    zero.__enter__()
    assert not (old / UNDONE_MARK).exists()
    zero.built(), zero.started()
    (old / UNDONE_MARK).write_text("another job")  # (a mark of a run that started: ignored)
    zero.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
    assert (old / "metrics.jsonl").is_file() and not (old / UNDONE_MARK).exists()
    # rank 0 stopped before it was built, its new directory removed: its line offered
    # "gspo train --resume DIR" of a directory gone
    zero = RunDirectory(tmp_path / "new", replace=False, dist=Quiet(0, 2), name="--output-dir")
    zero.__enter__()
    broken = RuntimeError("Connection closed by peer")
    zero.__exit__(RuntimeError, broken, None)
    assert not (tmp_path / "new").exists()
    assert broken.__notes__ == [f"{tmp_path / 'new'} held nothing to resume from: it is removed"]


def test_words_every_rank_would_say_alike_are_said_by_rank_0(monkeypatch, capsys):
    """A misspelt command or a Ctrl-C under torchrun: every rank printed the same line."""
    import gspo.cli

    waits: list[float] = []
    monkeypatch.setattr(gspo.cli.time, "sleep", waits.append)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gspo.cli, "run_train", interrupted)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            main(["trian"])
        assert info.value.code == 2
        assert main(["train", "--output-dir", "somewhere"]) == 130
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 2 and said[0].startswith("gspo: argument command: invalid choice: 'trian'")
    assert said[1] == (  # (no run there: the monkeypatched run_train wrote none)
        "gspo: interrupted; it had written nothing to resume from: the same command starts it again"
    )
    assert waits == [gspo.cli.RANK_ZERO_GRACE_S]  # (rank 1 let rank 0 print first)


def test_a_stop_arriving_while_the_run_directory_is_tidied_is_dropped():
    """torchrun sends SIGTERM to the other ranks once one failed: one arriving while rank 0
    puts an old run back (or removes a failed start) no longer cuts it, in a process with
    threads as every rank is (a thread's signal mask held back nothing there: the default
    action killed it), and the process's handlers are back after."""
    import signal

    script = (
        "import os, signal, threading, time\n"
        "from gspo.distributed import signals_held\n"
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "seen = []\n"
        "signal.signal(signal.SIGINT, lambda *a: seen.append('int'))\n"
        "with signals_held():\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.2)\n"
        "    print('tidied', seen, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.2)\n"
        "print('after', seen, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.stdout.splitlines() == ["tidied []", "after ['int'] True"], done.stderr
    assert done.returncode == -signal.SIGTERM  # (SIGTERM's default action, restored)


def test_a_rank_other_than_0_waits_for_rank_0_to_say_a_setup_error(tmp_path, monkeypatch, capsys):
    """torchrun stops every rank once one fails: a rank that left at once could stop rank 0
    before it printed (seen in CI). Rank 1 waits first, and says the error itself only if
    rank 0 never did."""
    import gspo.cli

    waits: list[float] = []
    monkeypatch.setattr(gspo.cli.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code = main(["train", "--output-dir", str(tmp_path / "run"), CPU, "optim.lrr=1"])
    assert code == 2 and waits == [gspo.cli.RANK_ZERO_GRACE_S] and waits[0] >= 30
    said = capsys.readouterr().err.strip().splitlines()
    assert (
        len(said) == 1
        and said[0].startswith("gspo: error (rank 1 of 2):")
        and "optim.lrr" in said[0]
    )


def test_fsdp_units_are_the_transformer_blocks(tiny_model):
    blocks = decoder_blocks(tiny_model)
    assert len(blocks) == 2 and {type(b).__name__ for b in blocks} == {"Qwen3DecoderLayer"}
    with pytest.raises(ValueError, match="cannot shard Linear"):
        decoder_blocks(torch.nn.Linear(2, 2))


def torchrun(*args: str, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Two ranks of ``args`` (a script or ``-m gspo train``, which names ``model.device``)."""
    device_named_in(args)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_ranks_stop_once_their_launcher_is_killed(tmp_path):
    """A torchrun launcher killed with SIGKILL cannot stop its ranks: they trained on to the
    end as orphans, holding the run's lock. Each rank now sees its parent go and stops
    within seconds, with one line."""
    import contextlib
    import signal
    import time

    out, log = tmp_path / "run", (tmp_path / "stderr").open("w")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "gspo", "train", "--output-dir", str(out),
               *SMALL_RUN, "train.max_steps=100000"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env)
    children: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("train/loss" in r for r in _lines(out / "metrics.jsonl")):
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        assert len(children) == 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(int(pid)) for pid in children):
            assert time.monotonic() < deadline, "the ranks trained on without their launcher"
            time.sleep(0.2)
    finally:  # whatever is left (torchrun starts its ranks in sessions of their own)
        for pid in [launcher.pid, *map(int, children)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        log.close()
    # each rank one line: its launcher gone, or (if the other rank left first) the group
    said = [line for line in (tmp_path / "stderr").read_text().splitlines()
            if line.startswith("gspo: error (rank ")]  # fmt: skip
    assert len(said) == 2 and any("the launcher (pid" in line for line in said), said
    assert all("is gone" in line or "another rank stopped" in line for line in said), said


def _lines(path: Path) -> list[dict]:
    try:
        return read_metrics(path)
    except (FileNotFoundError, ValueError):
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_two_ranks_with_half_each_take_the_one_process_step(tmp_path):
    """One optimizer step on a fixed batch: same loss, metrics and weights as one process."""
    check_two_ranks_take_the_one_process_step(tmp_path, CPU)


@pytest.mark.slow
def test_two_ranks_take_the_one_process_step_with_lora(tmp_path):
    """The same with LoRA adapters: only they move, identically on 1 and 2 ranks."""
    runs = check_two_ranks_take_the_one_process_step(tmp_path, CPU, "model.lora.r=4")
    weights = runs["sequence"]["weights"]
    moved = [n for n, w in weights.items() if "lora_B" in n and w.abs().max() > 0]
    assert moved  # lora_B starts at zero: the step moved it
    assert all("lora_" in n for n in weights)  # the adapters alone were gathered


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_two_ranks_with_activation_checkpointing_take_the_one_process_step(tmp_path, extra):
    """FSDP2 with activation checkpointing on: each block runs again in backward, and the
    step is the one process's step without it (LoRA adapters too)."""
    on = "model.activation_checkpointing=true"
    runs = check_two_ranks_take_the_one_process_step(tmp_path, CPU, *extra, two_ranks_also=(on,))
    for level in ("sequence", "token"):
        one, two = runs[level]["layer_runs"]
        assert one == 2 and two == 4  # 2 blocks: each once without, twice with checkpointing


def check_two_ranks_take_the_one_process_step(
    tmp_path,
    *extra: str,
    two_ranks_also: tuple[str, ...] = (),
    backend: str = "gloo",
    metric_abs: float = 1e-6,
    weight_atol: float = 2e-6,
) -> dict:
    """``extra`` overrides name the device (cpu: the ranks join over ``backend`` gloo, on
    a machine with GPUs too); the tolerances are float32 rounding on the CPU (a wrong loss
    normalisation over ranks moved weights 2e-4 apart when tried). ``two_ranks_also``:
    overrides for the two ranks only (settings that must not change the step).

    Returns, per level, the one process's weights (``"weights"``) and the blocks' runs of
    the step in each (``"layer_runs"``: one process, rank 0)."""
    worker = str(HERE / "distributed_worker.py")
    device_named_in(extra)
    subprocess.run([sys.executable, worker, str(tmp_path / "one"), *extra], check=True,
                   timeout=300)  # fmt: skip
    torchrun(worker, str(tmp_path / "two"), *extra, *two_ranks_also)
    out = {}
    for level in ("sequence", "token"):
        one = torch.load(tmp_path / "one" / f"{level}.pt", weights_only=True)
        two = torch.load(tmp_path / "two" / f"{level}.pt", weights_only=True)
        assert one["backend"] is None and two["backend"] == backend
        m1, m2 = one["metrics"], two["metrics"]
        assert m2["train/tokens"] == m1["train/tokens"] and m2["train/sequences"] == 14
        assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=metric_abs)
        assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=10 * metric_abs)
        for key in ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "ratio_mean"):
            assert m2[f"train/{key}"] == pytest.approx(m1[f"train/{key}"], abs=metric_abs), key
        if level == "sequence":
            assert 0 < m1["train/clip_fraction"] < 1  # the test batch clips some, not all
        # Adam's first step moves every weight by up to lr = 1e-4; a wrong loss
        # normalisation across ranks changes that direction (2e-4 apart when tried)
        assert one["weights"].keys() == two["weights"].keys()
        for name, weight in one["weights"].items():
            torch.testing.assert_close(two["weights"][name], weight, rtol=0, atol=weight_atol)
        out[level] = {
            "weights": one["weights"],
            "layer_runs": (one["layer_runs"], two["layer_runs"]),
        }
    return out


@pytest.mark.slow
def test_a_moe_run_under_torchrun_writes_checkpoints_between_rollout_batches(tmp_path):
    """The churn measurement's no-grad forward, the last thing of a MoE rollout batch,
    left the FSDP root's weights gathered: the first checkpoint before the run's end died
    with KeyError: 0 in get_optimizer_state_dict (the OLMoE recipe, save_every 100)."""
    out = tmp_path / "run"
    moe = ["model.builtin=qwen3_moe", "model.experts=4", "train.max_steps=8", "train.save_every=4"]
    torchrun("-m", "gspo", "train", "--output-dir", str(out), *SMALL_RUN, *moe)
    held = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert held == ["step-0000000", "step-0000004", "step-0000008"]
    lines = [r for r in read_metrics(out / "metrics.jsonl") if "moe/expert_change_fraction" in r]
    assert len(lines) == 8


@pytest.mark.slow
def test_torchrun_run_logs_once_and_resumes_with_one_rank(tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = tmp_path / "run"
    overrides = [*SMALL_RUN, "train.max_steps=8", "train.save_every=4", "eval.every=4"]
    done = torchrun("-m", "gspo", "train", "--output-dir", str(out), *overrides)
    assert done.stdout.count("run written to") == 1  # rank 0 alone prints
    records = read_metrics(out / "metrics.jsonl")
    steps = [r["step"] for r in records if "train/loss" in r]
    assert steps == list(range(1, 9))  # one line per optimizer step, not one per rank
    assert all(r["train/sequences"] == 4 for r in records if "train/loss" in r)  # 16 / 4
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None and checkpoint.name == "step-0000008"
    assert (checkpoint / "model.safetensors").is_file()  # the HF export
    assert len(list((checkpoint / SHARDED).glob("*.distcp"))) == 2  # one file per rank

    # the sharded state, whole, as the two ranks saved it: the optimizer's (the weights
    # are in the HF export alone)
    dcp_to_torch_save(checkpoint / SHARDED, tmp_path / "whole.pt")
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert sorted(saved) == ["optimizer"]
    resumed = Trainer(load_config(out / "config.yaml"), out, resume=True)
    _, optim_state = get_state_dict(resumed.policy.forward, resumed.optimizer)
    exported = load_file(checkpoint / "model.safetensors")
    module_state = resumed.policy.module.state_dict()
    assert exported
    for name, value in exported.items():
        torch.testing.assert_close(module_state[name], value, rtol=0, atol=0)
    moments = [(n, s) for n, s in optim_state["state"].items()]
    assert moments
    for name, state in moments:
        torch.testing.assert_close(state["exp_avg"], saved["optimizer"]["state"][name]["exp_avg"])
    assert resumed.step == 8
    resumed.logger.close()

    assert main(["train", "--resume", str(out), "train.max_steps=12", "log.progress=false"]) == 0
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert steps == list(range(1, 13))


def test_sharded_checkpoint_of_a_fresh_optimizer_leaves_it_fresh(tmp_path, tiny_model):
    """No state is written for an optimizer that has not stepped, and none is made up.

    Asking DCP for a fresh optimizer's state initialises it with a zero-lr step, which
    Adam counts: the first real step would then get step 2's bias correction.
    """
    from gspo.models import CompletionLogprobs
    from gspo.sharded import load_sharded, save_sharded

    policy = CompletionLogprobs(tiny_model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    save_sharded(tmp_path / "fresh", policy, optimizer)
    assert not optimizer.state
    load_sharded(tmp_path / "fresh", policy, optimizer)
    assert not optimizer.state

    for p in policy.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    save_sharded(tmp_path / "stepped", policy, optimizer)
    expected = {n: p.detach().clone() for n, p in policy.named_parameters()}
    other = CompletionLogprobs(type(tiny_model)(tiny_model.config))
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-3)
    load_sharded(tmp_path / "stepped", other, other_optimizer)
    for name, p in other.named_parameters():
        torch.testing.assert_close(p, expected[name], rtol=0, atol=0)
    steps = {float(s["step"]) for s in other_optimizer.state.values()}
    assert steps == {1.0}  # the saved step, not an extra initialising one


KILL_RANK_1_IN_THE_CACHE = """
import os, signal, sys
import gspo.training.cold_start as cs

real = cs.save_sharded

def save(path, *args, **kwargs):
    real(path, *args, **kwargs)
    if os.environ["RANK"] == "1" and str(path).startswith(os.environ["XDG_CACHE_HOME"]):
        os.kill(os.getpid(), signal.SIGKILL)  # its shard written, the entry not yet whole

cs.save_sharded = save
from gspo.cli import main, quick_exit
quick_exit(main(sys.argv[1:]))  # (as `gspo` leaves)
"""


@pytest.mark.slow
def test_torchrun_cold_start_cache_holds_every_rank_and_is_reused(tmp_path, cold_start_cache):
    """A rank killed while the cache is written leaves nothing trusted; the next run writes
    an entry with both ranks' shards, and the one after takes it, to the same metrics."""
    run = [*SMALL_RUN, "train.max_steps=2", "eval.every=0", "model.device=cpu", "log.progress=true"]
    killer = tmp_path / "killer.py"
    killer.write_text(KILL_RANK_1_IN_THE_CACHE)
    killed = torchrun(str(killer), "train", "--output-dir", str(tmp_path / "killed"), *run,
                      check=False)  # fmt: skip
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr, killed.stderr[-3000:]
    assert [p for p in cold_start_cache.iterdir() if not p.name.startswith(".")] == []

    first = torchrun("-m", "gspo", "train", "--output-dir", str(tmp_path / "first"), *run)
    assert "cold start: reused" not in first.stdout  # trained: nothing was trusted
    [entry] = cold_start_cache.iterdir()  # the killed run's temporary directory is gone
    assert sorted(p.name for p in (entry / "sharded").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    again = torchrun("-m", "gspo", "train", "--output-dir", str(tmp_path / "again"), *run)
    assert f"cold start: reused {entry}" in again.stdout
    assert "Traceback" not in again.stderr
    records = [
        [comparable(r) for r in read_metrics(tmp_path / name / "metrics.jsonl")]
        for name in ("first", "again")
    ]
    assert records[0] == records[1] and any("sft/loss" in r for r in records[0])


BATCH_ADVANTAGES = """
import sys
import torch
from gspo.cli import quick_exit
from gspo.config import load_config
from gspo.distributed import setup_distributed, teardown_distributed
from gspo.trainer import Trainer

out, overrides = sys.argv[1], sys.argv[2:]
config = load_config(None, overrides)
dist = setup_distributed(config.model.device)
with Trainer(config, f"{out}/run", dist=dist) as trainer:
    sampled = trainer.rollout_stage.sample(0)
    advantages = trainer.rollout_stage.prepare(sampled).advantages
    torch.save(
        {"rewards": sampled.scored.rewards, "advantages": advantages.cpu()},
        f"{out}/rank{dist.rank}.pt",
    )
teardown_distributed(dist)
quick_exit(0)
"""


@pytest.mark.slow
def test_batch_scaled_advantages_use_the_whole_rollout_batch_over_ranks(tmp_path):
    """``algorithm.advantage_scale=batch`` divides by the std of the whole rollout batch:
    under torchrun each rank divided by its own share's."""
    from gspo.objectives import group_advantages

    (tmp_path / "script.py").write_text(BATCH_ADVANTAGES)
    (tmp_path / "lengths.py").write_text(
        "def length(prompts, completions, **kwargs):\n"
        "    return [len(c) / 4 + (i % 3) for i, c in enumerate(completions)]\n"
    )
    overrides = [*SMALL_RUN, "algorithm.advantage_scale=batch", "train.cold_start_steps=0",
                 f"reward.functions=[{tmp_path / 'lengths.py'}:length]",
                 "rollout.prompts_per_batch=4", "algorithm.minibatches=2"]  # fmt: skip
    torchrun(str(tmp_path / "script.py"), str(tmp_path), *overrides)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    rewards = torch.cat([r["rewards"] for r in ranks])
    whole = group_advantages(rewards, 4, scale="batch")
    own = torch.cat([group_advantages(r["rewards"], 4, scale="batch") for r in ranks])
    assert not torch.allclose(own, whole)  # the shares' stds differ: the test can fail
    torch.testing.assert_close(torch.cat([r["advantages"] for r in ranks]), whole)


def test_the_launcher_gone_line_names_the_run_to_resume(tmp_path):
    """A rank whose launcher is gone said "gspo train --resume continues from the last",
    naming no run: on a node of a multi-node job, the user had to find it. It names the
    run directory (a name with a space quoted, as a shell wants it)."""
    run = tmp_path / "my run"
    child = (
        "import sys, time\n"
        "from gspo import distributed\n"
        "distributed.LAUNCHER_POLL_S = 0.05\n"
        "distributed.watch_launcher(distributed.Distributed(1, 2), sys.argv[1])\n"
        "print('watching', flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = (  # starts the rank, waits until it watches, and leaves it orphaned
        "import subprocess, sys\n"
        "rank = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]],\n"
        "                        stdout=subprocess.PIPE, stderr=open(sys.argv[3], 'w'))\n"
        "rank.stdout.readline()\n"
        "print(rank.pid)\n"
    )
    log = tmp_path / "rank.err"
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1"}
    done = subprocess.run([sys.executable, "-c", launcher, child, str(run), str(log)],
                          capture_output=True, text=True, timeout=60, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout)
    import time

    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, "the orphaned rank did not stop"
        time.sleep(0.05)
    said = log.read_text().strip().splitlines()
    assert len(said) == 1 and said[0].startswith("gspo: error (rank 1 of 2): the launcher"), said
    assert f"gspo train --resume '{run}' continues from the last" in said[0], said


def two_nodes(*per_rank: list[str], timeout: float = 150) -> list[tuple[int, str]]:
    """``gspo train`` as rank 0 and rank 1 of two nodes, each with its own arguments (a
    node whose --output-dir is not the other's), met at a store this test holds as
    torchrun's agent holds its own: ``(status, stderr)`` of each rank."""
    import contextlib
    import signal
    import time
    from datetime import timedelta

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=30))  # fmt: skip
    ranks = []
    for rank, args in enumerate(per_rank):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0",
               "GROUP_RANK": str(rank), "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1"}  # fmt: skip
        # (through a shell of its own: each node's launcher has its own pid)
        command = ["sh", "-c", '"$@"; exit $?', "sh", sys.executable, "-m", "gspo", "train", *args]
        ranks.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      text=True, env=env, start_new_session=True))  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while any(r.poll() is None for r in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:  # (the shell and its rank: a rank left waiting in a collective ignores SIGTERM)
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.pid, signal.SIGKILL)
    return [(r.wait(), r.stderr.read() if r.stderr else "") for r in ranks]


def _gspo_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("gspo: error")]


@pytest.mark.slow
def test_a_setup_error_of_one_node_alone_is_said_by_rank_0_too(tmp_path):
    """A rank other than 0 whose setup failed on its own files (a node whose --output-dir
    is not rank 0's) waited 60 s for rank 0 to say it, and rank 0 never did: before the
    ranks joined, rank 0 waited for it (gloo's 30 minutes); after, rank 0 said "another
    rank stopped" and its launcher's end stopped rank 1 before its line. Rank 0 now says
    rank 1's error, and rank 1, the first of its node, says it at once in its own log."""
    small = [*SMALL_RUN, "train.cold_start_steps=0", "algorithm.minibatches=2"]
    # before joining: node 1's --resume names a directory that is not there
    said = two_nodes(["--output-dir", str(tmp_path / "a"), *small],
                     ["--resume", str(tmp_path / "missing")])  # fmt: skip
    (code0, err0), (code1, err1) = said
    assert code0 == 2 and code1 == 2, said
    missing = f"--resume {tmp_path / 'missing'}: does not exist"
    assert _gspo_lines(err0) == [f"gspo: error: rank 1 of 2 stopped setting up: {missing}"], said
    assert _gspo_lines(err1) == [f"gspo: error (rank 1 of 2): {missing}"], said
    # after joining: rank 1 finds no built-in model under its own --output-dir
    said = two_nodes(["--output-dir", str(tmp_path / "b0"), *small],
                     ["--output-dir", str(tmp_path / "b1"), *small])  # fmt: skip
    (code0, err0), (code1, err1) = said
    assert code0 == 2 and code1 == 2, said
    own = f"model.path: {tmp_path / 'b1' / 'base_model'} is not a directory"
    assert len(_gspo_lines(err0)) == 1 and (
        f"gspo: error (rank 0 of 2): rank 1 of 2 stopped setting up: {own}" in _gspo_lines(err0)[0]
    ), said
    assert len(_gspo_lines(err1)) == 1 and own in _gspo_lines(err1)[0], said


@pytest.mark.slow
def test_ranks_resuming_different_checkpoints_stop_with_one_line(tmp_path):
    """Each rank resumes the run under its own --output-dir: a node whose copy held
    another checkpoint (no shared filesystem, a stale copy) loaded other weights and
    step, trained on logging wrong numbers, and aborted (SIGABRT) once the ranks'
    collectives no longer matched. The ranks now compare their checkpoints first."""
    import shutil

    small = [*SMALL_RUN, "train.cold_start_steps=0", "train.max_steps=4", "train.save_every=2",
             "algorithm.minibatches=2", "eval.every=0"]  # fmt: skip
    run, stale = tmp_path / "run", tmp_path / "stale"
    assert main(["train", "--output-dir", str(run), *small, "train.max_steps=2"]) == 0
    shutil.copytree(run, stale)
    (stale / "checkpoints" / "latest").write_text("step-0000000")
    metrics = (run / "metrics.jsonl").read_text()
    said = two_nodes(["--resume", str(run), "train.max_steps=4"],
                     ["--resume", str(stale), "train.max_steps=4"])  # fmt: skip
    (code0, err0), (code1, err1) = said
    assert code0 == 2 and code1 == 2, said
    both = (f"rank 0: {run}/checkpoints/step-0000002, "
            f"rank 1: {stale}/checkpoints/step-0000000")  # fmt: skip
    assert _gspo_lines(err0) == [
        f"gspo: error: resume: the ranks found different checkpoints ({both}): every rank "
        "resumes the same run, so its directory must be the same for all (under torchrun on "
        "several nodes, on a filesystem every node shares)"
    ], said
    assert len(_gspo_lines(err1)) == 1 and both in err1, said
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing logged


@pytest.mark.slow
def test_an_overwrite_one_node_stops_on_its_input_puts_the_old_run_back(tmp_path):
    """A rank other than 0 that stops on its input before the run started marks it undone
    with the job's id, and rank 0 puts the old run back; the id was each node's launcher
    pid, so on two nodes rank 0 took the mark for another job's: the old run was deleted,
    the failed start kept (and offered for --resume), the mark left behind."""
    (tmp_path / "reward.py").write_text(
        "import os\n"
        "def digits(prompts, completions, **kwargs):\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise KeyError('only rank 1 fails')\n"
        "    return [float(c[:1].isdigit()) for c in completions]\n"
    )
    small = [*SMALL_RUN, "train.cold_start_steps=0", "train.max_steps=2",
             "algorithm.minibatches=2", "eval.every=0"]  # fmt: skip
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *small]) == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    again = ["--output-dir", str(run), "--overwrite", *small,
             f"reward.functions={tmp_path / 'reward.py'}:digits"]  # fmt: skip
    said = two_nodes(again, again)
    (code0, err0), (code1, err1) = said
    assert code0 == 2 and code1 == 2, said
    assert "only rank 1 fails" in err1, said
    assert _gspo_lines(err0)[-1].endswith(f"the run that was in {run} is back as it was"), said
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after == before


def test_a_rank_says_one_last_line_when_two_threads_end_it_at_once():
    """The launcher watch's thread and the main thread's broken collective can each end a
    rank at the same moment (the other rank left first): each said its line, three lines
    for two ranks in a full-suite run. ``last_words`` prints the first ender's only."""
    script = (
        "import threading\n"
        "from gspo.distributed import last_words\n"
        "go = threading.Barrier(2)\n"
        "def say(by):\n"
        "    go.wait()\n"
        "    last_words(f'gspo: error (rank 0): {by}', by)\n"
        "threads = [threading.Thread(target=say, args=(b,)) for b in ('watch', 'collective')]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print(last_words('gspo: error (rank 0): again', 'watch'),\n"
        "      last_words('gspo: error (rank 0): again', 'collective'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert sum(line.endswith(("watch", "collective")) for line in lines) == 1, lines
    # the one that spoke may again (cli.main called twice in a process), the other not
    assert sorted(done.stdout.split()) == ["False", "True"] and lines[-1].endswith("again")


def test_the_silent_ender_waits_until_the_other_ones_line_is_out():
    """The watch that finds the collective's line claimed ends the process at once: it
    did so while that line was still being written (a full-suite run read one rank's
    line of two). ``last_words`` returns only once the line claimed is out."""
    script = (
        "import sys, threading\n"
        "from gspo.distributed import last_words\n"
        "claimed, returned, out = threading.Event(), threading.Event(), []\n"
        "class Slow:\n"  # a stderr whose write waits for the other ender (up to 2 s)
        "    def write(self, text):\n"
        "        claimed.set(); returned.wait(2); out.append(text)\n"
        "    def flush(self): pass\n"
        "sys.stderr = Slow()\n"
        "speaker = threading.Thread(target=last_words, args=('line', 'collective'))\n"
        "speaker.start(); claimed.wait()\n"
        "said = last_words('other', 'watch')\n"
        "print(said, ''.join(out).strip() or 'nothing')\n"  # (the watch exits here)
        "returned.set(); speaker.join()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "line"]


def test_large_shards_are_written_by_several_threads_and_read_back_whole(tmp_path, monkeypatch):
    """``write_sharded``: one file per ``BYTES_PER_WRITE_THREAD`` of a rank's shards, at most
    ``WRITE_THREADS`` (written at once: 4x faster on this CPU's disk), one for small ones;
    DCP reads every file back."""
    import torch.distributed.checkpoint as dcp

    from gspo import sharded

    generator = torch.Generator().manual_seed(0)
    state = {"optimizer": {f"m{i}": torch.randn(64, 1024, generator=generator) for i in range(8)}}
    sharded.write_sharded(tmp_path / "small", state)  # 2 MiB: one file
    assert [p.name for p in (tmp_path / "small").glob("*.distcp")] == ["__0_0.distcp"]
    monkeypatch.setattr(sharded, "BYTES_PER_WRITE_THREAD", 512 << 10)
    monkeypatch.setattr(sharded, "WRITE_THREADS", 3)
    sharded.write_sharded(tmp_path / "large", state)  # 2 MiB / 512 KiB: 4, at most 3
    files = sorted(p.name for p in (tmp_path / "large").glob("*.distcp"))
    assert files == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert all((tmp_path / "large" / f).stat().st_size > 256 << 10 for f in files)
    back = {"optimizer": {k: torch.zeros_like(v) for k, v in state["optimizer"].items()}}
    dcp.load(back, checkpoint_id=tmp_path / "large", no_dist=True)
    assert all(torch.equal(back["optimizer"][k], v) for k, v in state["optimizer"].items())


def test_a_failing_writer_thread_fails_the_write(tmp_path, monkeypatch):
    """DCP lets an exception in one of its helper writer threads end that thread alone and
    writes its metadata without that thread's files: ``write_sharded`` raises it (a full
    disk stays a full disk, for the one-line ``DiskFull``), and waits for the others."""
    import errno
    import threading

    import torch.distributed.checkpoint.filesystem as fs

    from gspo import sharded

    real = fs._write_item

    def full_disk_off_the_main_thread(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(fs, "_write_item", full_disk_off_the_main_thread)
    monkeypatch.setattr(sharded, "BYTES_PER_WRITE_THREAD", 512 << 10)
    state = {"optimizer": {f"m{i}": torch.ones(64, 1024) for i in range(8)}}
    with pytest.raises(OSError) as raised:
        sharded.write_sharded(tmp_path / "s", state)
    assert raised.value.errno == errno.ENOSPC
    assert not [t for t in threading.enumerate() if "_write_files_from_queue" in t.name]
    monkeypatch.setattr(fs, "_write_item", real)  # the same write, all threads well: whole
    sharded.write_sharded(tmp_path / "t", state)
    assert sharded.unwritten(fs.FileSystemReader(tmp_path / "t").read_metadata()) == 0


def test_a_save_whose_returned_metadata_has_no_storage_data_is_checked_from_disk(
    tmp_path, monkeypatch
):
    """torch 2.11's ``dcp.save`` (the H200's) returns the metadata without ``storage_data``
    (which file holds each item): ``write_sharded`` reads the written ``.metadata`` back
    instead of calling every item unwritten (every checkpoint of 887befd's lease failed so);
    a shard truly missing is still found."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from gspo import sharded

    real = dcp.save

    def bare(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), storage_data=None)

    monkeypatch.setattr(dcp, "save", bare)
    state = {"optimizer": {f"m{i}": torch.ones(64, 1024) for i in range(4)}, "step": 3}
    sharded.write_sharded(tmp_path / "s", state)  # (before: "6 of the shards were not ...")
    metadata = dcp.FileSystemReader(tmp_path / "s").read_metadata()
    assert sharded.unwritten(metadata) == 0 and len(metadata.storage_data) == 5
    del metadata.storage_data[next(iter(metadata.storage_data))]
    assert sharded.unwritten(metadata) == 1


COUNTED_EXPORT = """
import os, sys
from pathlib import Path
import gspo.export
writes, real = Path(sys.argv[1]), gspo.export.save_pretrained_atomic
def counted(*args, **kwargs):
    with writes.open("a") as f:
        f.write(os.environ["RANK"] + "\\n")
    return real(*args, **kwargs)
gspo.export.save_pretrained_atomic = counted
from gspo.cli import main, quick_exit
quick_exit(main(sys.argv[2:]))  # (as `gspo` leaves: sys.exit's teardown aborted a rank once)
"""


@pytest.mark.slow
def test_export_under_torchrun_is_written_and_said_by_rank_0_alone(tmp_path):
    """``torchrun -m gspo export RUN --merge OUT``: every rank merged the adapter and wrote
    the whole model over the same OUT, each saying so; rank 0 now does, the others wait. A
    bad OUT is one line, rank 0's, and the torchrun fails."""
    config = load_config(None, [*SMALL_RUN, "train.cold_start_steps=0", "model.lora.r=4",
                                "train.max_steps=0"])  # fmt: skip
    Trainer(config, tmp_path / "run").fit()
    (tmp_path / "script.py").write_text(COUNTED_EXPORT)
    writes, out = tmp_path / "writes", tmp_path / "merged"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", str(tmp_path / "script.py"), str(writes), "export"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, str(tmp_path / "run"), "--merge", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert writes.read_text() == "0\n"  # one rank wrote it (both did, before)
    assert done.stdout.count(f"written to {out} as one model") == 1, done.stdout
    assert (out / "model.safetensors").is_file() and (out / "gspo_export.json").is_file()
    # a target the export refuses: rank 0's line, once, and the torchrun fails
    refused = subprocess.run([*command, str(tmp_path / "run"), "--merge", str(tmp_path / "run")],
                             capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    said = [line for line in refused.stderr.splitlines() if line.startswith("gspo: ")]
    assert refused.returncode != 0 and len(said) == 1, refused.stderr[-3000:]
    assert said[0].startswith("gspo: error: export: --merge") and "Traceback" not in said[0]
    assert writes.read_text() == "0\n"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_eval_under_torchrun_has_one_process_figures_said_once(tmp_path, varied_reward, extra):
    """``torchrun -m gspo eval RUN``: each rank evaluates its share of the held-out chunks
    (24 prompts in 3 chunks: 2 and 1), the figures and the report are one process's, said
    by rank 0; a LoRA adapter goes onto FSDP's shards. (It was refused: "gspo eval runs
    in one process".) Bad input is one line, rank 0's."""
    import json

    overrides = [*SMALL_RUN, varied_reward, "train.cold_start_steps=0", "train.max_steps=2",
                 "algorithm.minibatches=2", "optim.lr=1e-2", *extra]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    run, judged = str(tmp_path / "run"), "eval.success_threshold=0.4"
    assert main(["eval", run, judged, "--json", str(tmp_path / "one.json")]) == 0
    done = torchrun("-m", "gspo", "eval", run, judged, "--json", str(tmp_path / "two.json"),
                    "model.device=cpu")  # fmt: skip
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one.pop("time/eval") > 0 and two.pop("time/eval") > 0
    assert two == one and one["prompts"] == 24 and 0 < one["eval/accuracy"] < 1, one
    assert done.stdout.count("evaluated ") == 1 and "eval/reward_mean " in done.stdout
    bad = torchrun("-m", "gspo", "eval", run, "--json", str(tmp_path / "no" / "x.json"),
                   "model.device=cpu", check=False)  # fmt: skip
    said = [line for line in bad.stderr.splitlines() if line.startswith("gspo: ")]
    assert bad.returncode != 0 and said == [
        f"gspo: error: --json {tmp_path / 'no' / 'x.json'}: {tmp_path / 'no'} is no directory"
    ], bad.stderr[-3000:]
