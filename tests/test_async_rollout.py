"""Async rollouts (``rollout.max_staleness``): which weights sample which batch, determinism,
resume, and how it meets the cold start, evaluation and dynamic sampling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_trainer import FAST, comparable, run_metrics, train_lines

from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.models import CompletionLogprobs, load_model
from gspo.trainer import Trainer, latest_checkpoint
from gspo.training.async_rollout import (
    BEHAVIOUR_WEIGHTS,
    AsyncRollouts,
    tensors_in,
)
from gspo.training.checkpoint import checkpoint_dir

ROOT = Path(__file__).resolve().parents[1]
MINIBATCHES = 2
RUN = [
    *FAST,
    "train.max_steps=8",
    f"algorithm.minibatches={MINIBATCHES}",
    "optim.lr=1e-3",
    "eval.every=4",
    "train.save_every=2",
]


def train(tmp_path, name, *overrides, capture=False):
    """Train a run; with ``capture``, also every rollout batch's Experience, in order."""
    trainer = Trainer(load_config(None, [*RUN, *overrides]), tmp_path / name)
    seen = []
    if capture:
        real = trainer.rollout_stage.prepare

        def prepare(sampled):
            seen.append(out := real(sampled))
            return out

        trainer.rollout_stage.prepare = prepare
    trainer.fit()
    return trainer, run_metrics(tmp_path / name), seen


def staleness(records):
    return [r.get("rollout/staleness") for r in train_lines(records)[::MINIBATCHES]]


def test_bad_combinations_are_one_line():
    load_config(None, ["rollout.max_staleness=1", "rollout.engine=vllm"])  # both engines
    with pytest.raises(ConfigError, match="moe.routing_replay needs rollout.max_staleness=0"):
        load_config(
            None,
            ["rollout.max_staleness=2", "model.builtin=qwen3_moe", "moe.routing_replay=true"],
        )
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(None, ["rollout.max_staleness=-1"])


def test_tensors_in_finds_every_tensor_a_sampled_batch_hands_over():
    """What the trainer marks as used on its CUDA stream (``record_stream``) when it takes a
    batch the producer sampled on its own: every tensor, however deeply held."""
    from gspo.engines import RolloutBatch
    from gspo.training.rollout import Sampled, Scored

    t = [torch.zeros(2, 3) for _ in range(5)]
    batch = RolloutBatch(
        prompt_ids=t[0],
        prompt_mask=t[1],
        completion_ids=t[2],
        completion_mask=t[3],
        sampler_logprobs=t[4],
        finish_reasons=["stop", "length"],
        group_size=2,
    )
    rewards, old, extra = torch.ones(2), torch.zeros(2, 3), torch.ones(1)
    scored = Scored(batch=batch, completions=["a", ("b", extra)], rewards=rewards,
                    per_function={"f": [1.0, None]})  # fmt: skip
    sampled = Sampled(index=0, picked=[0], scored=scored, metrics={"x": 1.0}, old_logprobs=old)
    found = {id(x) for x in tensors_in(sampled)}
    assert found == {id(x) for x in [*t, batch.action_mask, rewards, old, extra]}


def test_a_producers_pi_old_in_bf16_is_the_updates_own(tmp_path, varied_reward, capsys):
    """The producer recomputed pi_old in one forward over the whole batch, packed otherwise
    than the update's minibatches: in bf16 that alone moved ratios past GSPO's clip range,
    the on-policy minibatch's included, and nothing was said. With weights that do not
    move (lr 1e-30) every ratio, stale batches' too, must be exactly 1."""
    run = [*FAST, varied_reward, "model.dtype=bfloat16", "rollout.max_staleness=1",
           "algorithm.minibatches=2", "rollout.max_new_tokens=12", "optim.lr=1e-30",
           "train.max_steps=6", "eval.every=0"]  # fmt: skip
    Trainer(load_config(None, run), tmp_path / "run").fit()
    lines = train_lines(run_metrics(tmp_path / "run"))
    assert [r.get("rollout/staleness") for r in lines[::2]] == [0.0, 1.0, 1.0]
    assert all(r["train/ratio_min"] == 1.0 == r["train/ratio_max"] for r in lines)
    assert lines[1]["train/clip_fraction_on_policy"] == 0.0
    assert "on-policy minibatch" not in capsys.readouterr().err


@pytest.mark.slow
def test_staleness_schedule_and_the_weights_that_sampled_each_batch(tmp_path, varied_reward):
    """k=1: batch 0 by the start weights, batch b+1 by the weights after batch b-1's updates
    (checked by recomputing log-probs with the checkpoint of each rollout batch)."""
    trainer, sync, _ = train(tmp_path, "sync", varied_reward)
    assert trainer.rollouts is trainer.rollout_stage  # k=0: the stage itself
    assert staleness(sync) == [None] * 4  # k=0 logs nothing new
    trainer, records, seen = train(
        tmp_path,
        "k1",
        varied_reward,
        "rollout.max_staleness=1",
        "algorithm.old_logprobs=recompute",
        "train.keep_checkpoints=10",
        capture=True,
    )
    assert isinstance(trainer.rollouts, AsyncRollouts)
    assert staleness(records) == [0.0, 1.0, 1.0, 1.0]
    assert [e.staleness for e in seen] == [0, 1, 1, 1]
    # batch 0 is sampled by the cold-start model, as in the synchronous run: same samples
    for a, b in zip(train_lines(sync)[:1], train_lines(records)[:1], strict=True):
        for key in ("train/reward_mean", "train/response_length_mean"):
            assert a[key] == b[key], key
        # on-policy either way: 1 up to the rounding between sampler and trainer kernels
        assert b["train/ratio_mean"] == 1.0
        assert a["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    # evaluation measures the trained weights: at step 0 those of the synchronous run
    start = [
        [r for r in rs if r["step"] == 0 and "eval/reward_mean" in r] for rs in (sync, records)
    ]
    assert comparable(start[0][0]) == comparable(start[1][0])

    def logprobs(j, batch):  # under W_j, the weights after j rollout batches of updates
        model, _ = load_model(
            checkpoint_dir(tmp_path / "k1", j * MINIBATCHES),
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        with torch.no_grad():
            return CompletionLogprobs(model)(
                batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
            )

    for b, experience in enumerate(seen):
        batch, mask = experience.batch, experience.batch.completion_mask.bool()
        source = max(0, b - 1)
        # pi_old (recomputed on the producer's copy) and the sampler's are W_source's
        expected = logprobs(source, batch)
        assert torch.allclose(experience.old_logprobs[mask], expected[mask], atol=1e-5)
        assert torch.allclose(batch.sampler_logprobs[mask], expected[mask], atol=1e-4)
        if b > 0:  # and not the trainer's current weights, which moved on
            current = logprobs(b, batch)
            assert (current[mask] - expected[mask]).abs().max() > 1e-3


@pytest.mark.slow
def test_k2_staleness_and_first_batch_off_policy(tmp_path, varied_reward):
    _, records, _ = train(
        tmp_path, "k2", varied_reward, "rollout.max_staleness=2", "train.max_steps=10"
    )
    assert staleness(records) == [0.0, 1.0, 2.0, 2.0, 2.0]
    lines = train_lines(records)
    # the first minibatch of a stale batch is off-policy: its ratio moved from 1
    stale_first = [r for r in lines if r["rollout/staleness"] > 0 and r["train/minibatch"] == 0]
    assert any(abs(r["train/ratio_mean"] - 1) > 1e-4 for r in stale_first)
    # the free sampler/trainer mismatch is measured only where the batch is on-policy
    assert "mismatch/k3_kl" in lines[0]
    assert not any("mismatch/k3_kl" in r for r in stale_first)
    # so a stale batch has no on-policy clip fraction: all its minibatches count off-policy
    last = lines[MINIBATCHES - 1 :: MINIBATCHES]
    assert ["train/clip_fraction_on_policy" in r for r in last] == [True] + [False] * 4
    for r, first in zip(last[1:], stale_first, strict=True):
        batch = [x for x in lines if x["train/rollout"] == r["train/rollout"]]
        assert batch[0] is first
        clipped = sum(x["train/clip_fraction"] * x["train/tokens"] for x in batch)
        off = clipped / sum(x["train/tokens"] for x in batch)
        assert r["train/clip_fraction_off_policy"] == pytest.approx(off)


@pytest.mark.slow
def test_k1_is_deterministic_run_to_run(tmp_path, varied_reward):
    _, a, _ = train(tmp_path, "a", varied_reward, "rollout.max_staleness=1")
    _, b, _ = train(tmp_path, "b", varied_reward, "rollout.max_staleness=1")
    assert [comparable(r) for r in a] == [comparable(r) for r in b]  # bit for bit
    assert len({round(r["train/reward_mean"], 6) for r in train_lines(a)}) > 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        ["rollout.max_staleness=1"],
        [
            "rollout.max_staleness=2",
            "algorithm.old_logprobs=recompute",
            "rollout.filter_groups=true",
        ],
    ],
    ids=["k1", "k2-recompute-filter_groups"],
)
def test_resume_regenerates_what_was_sampled_ahead(tmp_path, varied_reward, extra):
    common = [*RUN, varied_reward, *extra]
    assert main(["train", "--output-dir", str(tmp_path / "full"), *common]) == 0
    assert main(["train", "--output-dir", str(tmp_path / "cut"), *common, "train.max_steps=4"]) == 0
    cut = latest_checkpoint(tmp_path / "cut")
    assert cut.name == "step-0000004" and (cut / BEHAVIOUR_WEIGHTS).is_file()
    assert main(["train", "--resume", str(tmp_path / "cut"), "train.max_steps=8"]) == 0
    full, resumed = run_metrics(tmp_path / "full"), run_metrics(tmp_path / "cut")
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    assert staleness(resumed)[2:] == staleness(full)[2:]


@pytest.mark.slow
def test_resume_with_another_staleness_is_one_line(tmp_path, varied_reward, capsys):
    """Up (the checkpoint lacks the weights) and down (accepted before, silently: the
    resumed run was then not the uninterrupted one)."""
    common = [*RUN, varied_reward, "train.max_steps=4"]
    for written, resumed in ((0, 1), (1, 0)):
        run = tmp_path / f"run{written}"
        staleness = f"rollout.max_staleness={written}"
        assert main(["train", "--output-dir", str(run), *common, staleness]) == 0
        capsys.readouterr()
        code = main(["train", "--resume", str(run), "train.max_steps=8",
                     f"rollout.max_staleness={resumed}"])  # fmt: skip
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err
        assert err == (
            f"gspo: error: rollout.max_staleness={resumed}: --resume continues the run as it "
            f"was sampled (rollout.max_staleness={written}), so that it ends as the "
            "uninterrupted run would; start a new run (--output-dir) to change it"
        )
    # a config.yaml edited by hand: compared with the checkpoint's own config.yaml
    (tmp_path / "run0" / "config.yaml").write_text(
        (tmp_path / "run0" / "config.yaml")
        .read_text()
        .replace("max_staleness: 0", "max_staleness: 1")
    )
    assert main(["train", "--resume", str(tmp_path / "run0"), "train.max_steps=8"]) == 2
    assert capsys.readouterr().err.startswith(
        "gspo: error: rollout.max_staleness=1: --resume continues the run as it was sampled "
        "(rollout.max_staleness=0)"
    )


@pytest.mark.slow
def test_torchrun_ranks_each_run_a_producer_and_resume_exactly(tmp_path, varied_reward):
    from test_distributed import torchrun

    # --no-cache: each launch does its own cold start (it is what a cached one would load)
    common = [*RUN, varied_reward, "rollout.max_staleness=1", "train.save_every=4", "--no-cache"]
    train = ["-m", "gspo", "train", "--output-dir"]
    torchrun(*train, str(tmp_path / "full"), *common)
    torchrun(*train, str(tmp_path / "cut"), *common, "train.max_steps=4")
    torchrun("-m", "gspo", "train", "--resume", str(tmp_path / "cut"), "train.max_steps=8")
    full, resumed = run_metrics(tmp_path / "full"), run_metrics(tmp_path / "cut")
    assert staleness(full) == [0.0, 1.0, 1.0, 1.0]
    assert all(r["train/sequences"] == 8 for r in train_lines(full))  # 16 responses / 2
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_gives_the_same_run(tmp_path, varied_reward):
    """Killed while the producer is sampling ahead (at an RL step between checkpoints)."""
    from test_faults import RUN as FAULT_RUN
    from test_faults import gspo, killed_and_resumed

    cold = 20
    args = [*FAULT_RUN, f"train.cold_start_steps={cold}", varied_reward,
            "rollout.max_staleness=1", "--no-cache"]  # fmt: skip
    assert gspo(tmp_path, "train", "--output-dir", str(tmp_path / "full"), *args) == 0
    full = [comparable(r) for r in run_metrics(tmp_path / "full")]
    kill = ("step", cold + 4)  # the 4th RL step: after the step-2 checkpoint
    killed_and_resumed(tmp_path, "killed", args, kill, full, rel=1e-6)


@pytest.mark.slow
def test_lora_snapshots_hold_the_adapters_alone(tmp_path, varied_reward):
    _, records, _ = train(
        tmp_path,
        "lora",
        varied_reward,
        "rollout.max_staleness=1",
        "model.lora.r=4",
        "train.cold_start_steps=0",
    )
    assert staleness(records) == [0.0, 1.0, 1.0, 1.0]
    saved = torch.load(latest_checkpoint(tmp_path / "lora") / BEHAVIOUR_WEIGHTS, weights_only=True)
    (weights,) = saved["weights"].values()  # W_3, which the next batch would be sampled by
    assert weights and all("lora_" in name for name in weights)
    # the producer's copy samples through the adapters: they moved, so its log-probs did
    assert any(w.abs().max() > 0 for n, w in weights.items() if "lora_B" in n)


def test_producer_and_evaluation_share_a_vllm_engine_without_mixing_weights():
    """With vLLM the producer samples through the run's own engine, which evaluation also
    loads with the trainer's weights: whoever generates finds its own weights loaded
    (each loads them when the engine holds the other's), and nobody reloads needlessly."""
    from types import SimpleNamespace

    from gspo.training.async_rollout import StaleSampler
    from gspo.training.sampler import PolicySampler

    class Engine:  # records which module's weights it holds and how often it was loaded
        def __init__(self):
            self.holding, self.loads = None, 0

        def sync_weights(self, module):
            self.holding, self.loads = module, self.loads + 1

        def generate(self, prompts, *, n, params, seed):
            return self.holding

    trainer_weights, producer_weights = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    policy = SimpleNamespace(version=0, replica=lambda: trainer_weights)
    engine = Engine()
    sampler = PolicySampler(engine, policy)
    sampler.version = None  # the engine starts from the disk model
    producer = StaleSampler(engine, policy, producer_weights, shared=sampler)

    def generate(s):
        return s.generate([[1]], n=1, params=None, seed=0)

    assert generate(sampler) is trainer_weights and engine.loads == 1
    assert generate(producer) is producer_weights and engine.loads == 2
    assert generate(producer) is producer_weights and engine.loads == 2  # still loaded
    assert generate(sampler) is trainer_weights and engine.loads == 3  # an evaluation
    assert generate(producer) is producer_weights and engine.loads == 4
    producer.load({"weight": torch.full((1, 1), 7.0)})  # W_j+1, copied in at its next sync
    assert producer_weights.weight.item() != 7.0
    assert generate(producer) is producer_weights and engine.loads == 5
    assert producer_weights.weight.item() == 7.0
    policy.version += 1  # an optimizer step
    sampler.sync()
    assert engine.holding is trainer_weights and engine.loads == 6
    assert generate(sampler) is trainer_weights and engine.loads == 6


def test_rl_step_alone_with_a_staleness_says_how_and_runs_inside_the_producer(
    tmp_path, varied_reward
):
    """``Trainer.rl_step`` called on its own (docs/python.md) waited for ever for a
    producer that only ``fit`` started."""
    config = load_config(None, [*RUN, varied_reward, "rollout.max_staleness=1",
                                "train.cold_start_steps=0"])  # fmt: skip
    with Trainer(config, tmp_path / "alone") as trainer:
        with pytest.raises(RuntimeError, match=r"rollout.max_staleness=1: rollout batches come "):
            trainer.rl_step(0)
        with trainer.rollouts.running(0, 2):
            lines = trainer.rl_step(0) + trainer.rl_step(1)
    assert [line["rollout/staleness"] for _, line in lines[::MINIBATCHES]] == [0.0, 1.0]


def test_every_time_metric_of_an_async_run_is_in_the_metrics_table(tmp_path, varied_reward):
    """docs/training.md's metric table names every ``time/*`` an async run logs, and says
    that there pi_old's recompute is the producer's (``time/old_logprobs`` is near 0)."""
    _, records, _ = train(
        tmp_path,
        "k1",
        varied_reward,
        "rollout.max_staleness=1",
        "algorithm.old_logprobs=recompute",
        "train.max_steps=4",
        "eval.every=0",
    )
    logged = {k for r in train_lines(records) for k in r if k.startswith("time/")}
    assert {"time/rollout_wait", "time/old_logprobs_producer"} <= logged
    table = (ROOT / "docs" / "training.md").read_text().split("| metric | meaning |")[1]
    assert [k for k in sorted(logged) if f"`{k}`" not in table] == []
