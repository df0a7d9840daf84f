"""Off-policy features end to end: rollout correction, truncation masking, dynamic sampling.

Trainer runs use the long-response ``chain`` task (as well as a binary toy reward where
groups with constant rewards must occur) with a tiny model.
"""

import re

import pytest
import torch
from conftest import CPU

from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.engines import RolloutBatch
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer, latest_checkpoint
from gspo.training.dynamic_sampling import (
    concat_batches,
    constant_groups,
    extra_prompts,
    fill_with_informative_groups,
)

TINY = [
    CPU,  # the CPU and float32 (conftest)
    "model.layers=1",
    "model.hidden=64",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=128",
    "data.eval_size=8",
    "data.sft_size=200",
    "train.cold_start_steps=10",
    "train.cold_start_batch_size=16",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "eval.samples=1",
    "eval.max_prompts=4",
    "eval.greedy=false",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]
CHAIN = [
    *TINY,
    "data.task=chain",
    "data.terms=4",
    "reward.functions=[numeric_match]",
    "rollout.max_new_tokens=48",
    "optim.lr=1e-4",  # the config default these tests were written at (chain's own: 2e-5)
]
RECOMPUTE_GRPO = ["algorithm.level=token", "algorithm.old_logprobs=recompute"]

HAS_ONE = '''
def has_one(prompts, completions, **kwargs):
    """Binary: whether the completion holds a '1' (groups of equal rewards happen often)."""
    return [float("1" in c) for c in completions]
'''


def train_lines(records):
    return [r for r in records if "train/loss" in r]


def comparable(record):
    return {k: v for k, v in record.items() if not k.startswith(("time", "io/"))}


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["algorithm.old_logprobs=sampler", "algorithm.rollout_correction=token_tis"],
            "nothing to correct",
        ),
        (
            ["algorithm.old_logprobs=recompute", "algorithm.correction_max=3"],
            "algorithm.correction_max is set but algorithm.rollout_correction=none",
        ),
        (
            [
                "algorithm.old_logprobs=recompute",
                "algorithm.rollout_correction=token_tis",
                "algorithm.correction_min=0.5",
            ],
            "algorithm.correction_min: token_tis only truncates from above",
        ),
        (
            [
                "algorithm.old_logprobs=recompute",
                "algorithm.rollout_correction=token_mask",
                "algorithm.correction_min=2",
                "algorithm.correction_max=1",
            ],
            "algorithm.correction_min (2.0) must be below algorithm.correction_max (1.0): "
            "every token would be dropped",
        ),
        # pi_old under the update's dropout masks against a sampler without: the weights
        # were dropout's noise (a helper's vLLM run masked 87% of a rollout batch)
        (
            [
                "algorithm.rollout_correction=sequence_mask",
                "model.lora.r=4",
                "model.lora.dropout=0.1",
            ],
            "algorithm.rollout_correction=sequence_mask with model.lora.dropout=0.1: pi_old is "
            "computed with the update's dropout masks",
        ),
        # one bound set past the mode's other, default, bound: every token dropped
        (
            [
                "algorithm.old_logprobs=recompute",
                "algorithm.rollout_correction=token_mask",
                "algorithm.correction_max=0.4",
            ],
            "algorithm.correction_min (0.5, token_mask's own bound) must be below "
            "algorithm.correction_max (0.4)",
        ),
        (
            [
                "algorithm.old_logprobs=recompute",
                "algorithm.rollout_correction=sequence_mask",
                "algorithm.correction_min=1.5",
            ],
            "algorithm.correction_min (1.5) must be below algorithm.correction_max (1.001, "
            "sequence_mask's own bound): every response would be dropped",
        ),
        # a band without 1 (found at run time before: every batch dropped every token)
        (
            ["algorithm.rollout_correction=token_mask", "algorithm.correction_max=0.9"],
            "algorithm.correction_min (0.5, token_mask's own bound) to algorithm.correction_max "
            "(0.9): the band must hold 1 (a weight of 1 is no mismatch), else token_mask drops "
            "what agrees exactly",
        ),
        (
            ["algorithm.rollout_correction=sequence_mask", "algorithm.correction_min=1.0005"],
            "algorithm.correction_min (1.0005) to algorithm.correction_max (1.001, "
            "sequence_mask's own bound): the band must hold 1",
        ),
        (["rollout.filter_max_rounds=0"], "rollout.filter_max_rounds"),
    ],
)
def test_bad_offpolicy_keys_are_one_line_errors(overrides, expected, tmp_path, capsys):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        load_config(None, overrides)
    code = main(["train", "--output-dir", str(tmp_path / "run"), *TINY, *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err


# ------------------------------------------------------------------ rollout correction
@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "bounds"),
    [
        ("token_tis", ["algorithm.correction_max=1.2"]),
        ("token_mask", ["algorithm.correction_min=0.8", "algorithm.correction_max=1.25"]),
        ("sequence_mask", ["algorithm.correction_min=0.6", "algorithm.correction_max=2.0"]),
    ],
)
def test_correction_on_the_chain_task_drops_and_weights_what_it_says(tmp_path, mode, bounds):
    """Under injected mismatch the loss counts exactly the tokens the correction kept:
    summed over a rollout batch's minibatches, train/tokens = mismatch/tokens x (1 -
    masked_token_fraction); token_tis caps its weights at correction_max."""
    overrides = [
        *CHAIN, *RECOMPUTE_GRPO, "rollout.logit_noise=1.0",
        f"algorithm.rollout_correction={mode}", *bounds,
        "train.max_steps=4", "algorithm.minibatches=2", "eval.every=0",
    ]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    lines = train_lines(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert len(lines) == 4
    for rollout in (lines[0:2], lines[2:4]):
        first = rollout[0]
        assert first["mismatch/k3_kl"] > 0.01  # the noise is there
        assert first["mismatch/log_ppl_gap"] != 0.0
        kept = first["mismatch/tokens"] * (1.0 - first["correction/masked_token_fraction"])
        assert sum(r["train/tokens"] for r in rollout) == pytest.approx(kept, abs=1e-6)
    fractions = [r["correction/masked_token_fraction"] for r in lines]
    if mode == "token_tis":
        assert all(f == 0.0 for f in fractions)
        assert all(r["correction/weight_max"] <= 1.2 + 1e-6 for r in lines)
        assert any(r["correction/weight_max"] == pytest.approx(1.2) for r in lines)
    else:
        assert all(0.0 < f < 1.0 for f in fractions)
        assert all(r["correction/masked_sequence_fraction"] > 0.0 for r in lines)


@pytest.mark.parametrize("minibatches", [2, 1])
def test_ratio_dumps_count_the_tokens_the_correction_kept(tmp_path, minibatches):
    """The ratio dumps (and gradient cosines) see the loss's tokens: the model's, less the
    ones the rollout correction dropped. With one minibatch the gradient cosines need all
    of pi_old before its forward, so the recompute pass covers minibatch 0 too."""
    overrides = [
        *CHAIN, *RECOMPUTE_GRPO, "rollout.logit_noise=1.0",
        "algorithm.rollout_correction=token_mask", "algorithm.correction_min=0.8",
        "algorithm.correction_max=1.25", "train.max_steps=2",
        f"algorithm.minibatches={minibatches}", "eval.every=0", "log.ratio_dump_every=1",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    assert trainer.update_stage.forward.first_from_update == (minibatches > 1)
    experience = trainer.rollout_stage.experience(0)
    for k in range(minibatches):
        trainer.update_stage.train(experience, k)
    last = experience.minibatches[-1]
    kept, sampled = experience.loss_mask[last], experience.batch.action_mask[last]
    assert kept.sum() < sampled.sum()  # the correction dropped some tokens
    dump = torch.load(tmp_path / "run" / "ratios" / "rollout-000000.pt")
    assert dump["token_log_ratio"].numel() == kept.sum()
    assert dump["cosine_halves"].numel() > 0  # the gradient cosines, at the weights k saw


@pytest.mark.slow
def test_correction_without_mismatch_changes_nothing(tmp_path):
    """No noise: the sampler and the trainer agree, so every correction keeps every token
    with weight ~1 and the run's losses equal the uncorrected run's."""
    common = [*CHAIN, *RECOMPUTE_GRPO, "train.max_steps=2", "algorithm.minibatches=2"]
    Trainer(load_config(None, common), tmp_path / "none").fit()
    base = train_lines(read_metrics(tmp_path / "none" / "metrics.jsonl"))
    for mode in ("token_tis", "token_mask", "sequence_mask"):
        config = load_config(None, [*common, f"algorithm.rollout_correction={mode}"])
        Trainer(config, tmp_path / mode).fit()
        lines = train_lines(read_metrics(tmp_path / mode / "metrics.jsonl"))
        for a, b in zip(base, lines, strict=True):
            assert b["correction/masked_token_fraction"] == 0.0
            assert a["train/tokens"] == b["train/tokens"]
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_mask_truncated_leaves_cut_responses_out(tmp_path):
    """chain completions are 20+ tokens: cut at 12 most responses are truncated, and
    exactly the others stay in the loss (one minibatch of 16 responses per step)."""
    overrides = [
        *CHAIN, "rollout.max_new_tokens=12", "algorithm.mask_truncated=true",
        "train.max_steps=2", "algorithm.minibatches=1", "eval.every=0",
    ]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    lines = train_lines(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert lines and any(r["train/truncated_fraction"] > 0.5 for r in lines)
    for r in lines:
        assert r["train/masked_truncated_fraction"] == r["train/truncated_fraction"]
        assert r["train/sequences"] == round(16 * (1 - r["train/truncated_fraction"]))
        assert r["train/loss"] == r["train/loss"]  # finite, no NaN


@pytest.mark.slow
def test_a_batch_with_no_token_in_the_loss_is_one_warning(tmp_path, capsys):
    """Cut at 2 tokens every chain response of the first rollout batch is truncated:
    mask_truncated leaves nothing in the loss, which is said once, naming why."""
    overrides = [
        *CHAIN, "rollout.max_new_tokens=2", "algorithm.mask_truncated=true",
        "train.max_steps=2", "algorithm.minibatches=1", "eval.every=0",
    ]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    lines = train_lines(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert lines[0]["train/tokens"] == 0.0
    warned = [x for x in capsys.readouterr().err.splitlines() if "no token in the loss" in x]
    assert len(warned) == 1
    assert "rollout batch 0" in warned[0] and "algorithm.mask_truncated=true" in warned[0]


def test_the_empty_loss_warning_names_the_rollout_correction(capsys):
    from gspo.distributed import Distributed
    from gspo.training.hooks import EmptyLossWarning

    warning = EmptyLossWarning(Distributed())
    warning.check(3, [{"train/tokens": 5.0}])  # tokens in the loss: nothing said
    assert capsys.readouterr().err == ""
    warning.check(4, [{"train/tokens": 0.0, "correction/masked_token_fraction": 1.0}])
    err = capsys.readouterr().err
    assert "rollout batch 4" in err and "algorithm.rollout_correction" in err
    warning.check(5, [{"train/tokens": 0.0}])  # once per run
    assert capsys.readouterr().err == ""


def test_rewards_that_never_vary_within_a_group_are_said_once(capsys):
    """A run whose every group got one reward (a model that never earns it, a reward that
    misreads the completions) logged train/zero_std_fraction 1 and loss 0 at every step,
    and said nothing."""
    from gspo.distributed import Distributed
    from gspo.training.hooks import FlatRewardWarning

    flat = {"train/zero_std_fraction": 1.0, "train/reward_mean": 0.0}
    warning = FlatRewardWarning(Distributed(), batches=10)
    for index, line in enumerate([flat, flat, {"train/zero_std_fraction": 0.5}, flat, flat]):
        warning.check(index, line)  # a streak of 2, broken; then 2 again
    assert capsys.readouterr().err == ""
    warning.check(5, {**flat, "train/reward_mean": 1.0})
    assert capsys.readouterr().err == (
        "gspo: warning: in rollout batches 3-5 every group's responses got one reward "
        "(reward mean 0, 0, 1), so every advantage is 0 and nothing is learned from them: "
        "the task is too hard or too easy for the model as it is, or the reward misreads the "
        "completions (check reward.functions on a few); a cold start "
        "(data.sft with train.cold_start_steps), a larger rollout.group_size or "
        "rollout.temperature make rewards vary, rollout.filter_groups=true samples other "
        "prompts in place of flat groups (shown once)\n"
    )
    warning.check(6, flat)  # once per run
    assert capsys.readouterr().err == ""
    short = FlatRewardWarning(Distributed(), batches=1)  # a run of one batch: at once
    short.check(0, flat)
    assert capsys.readouterr().err.startswith("gspo: warning: in rollout batch 0 every group")
    # every reward None (does not apply): the scorer's warning says so, not this one's
    # ("reward mean nan")
    unscored = FlatRewardWarning(Distributed(), batches=1)
    unscored.check(0, {"train/zero_std_fraction": 1.0, "train/unscored_fraction": 1.0})
    assert capsys.readouterr().err == ""


def test_a_run_whose_rewards_never_vary_says_so(tmp_path, capsys):
    (tmp_path / "rw.py").write_text(
        "def same(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
        "def length(prompts, completions, **kw):\n    return [float(len(c)) for c in completions]\n"
    )
    run = [*TINY, "train.cold_start_steps=0", "train.max_steps=8", "eval.every=0"]
    capsys.readouterr()
    for name in ("same", "length"):
        spec = f"reward.functions=[{tmp_path / 'rw.py'}:{name}]"
        Trainer(load_config(None, [*run, spec]), tmp_path / name).fit()
        warned = [x for x in capsys.readouterr().err.splitlines() if "got one reward" in x]
        if name == "same":  # two batches of 4 minibatches, both flat
            assert len(warned) == 1 and "in rollout batches 0-1 " in warned[0]
            assert "(reward mean 1, 1)" in warned[0]
        else:
            assert warned == []


def test_the_on_policy_clip_warning_reads_the_whole_batchs_clip_fraction(capsys):
    """It read the update's own line, this rank's share alone: under torchrun a clip in
    rank 1's share was never said, and what rank 0 said was its share's figure."""
    from gspo.distributed import Distributed
    from gspo.training.hooks import OnPolicyClipWarning
    from gspo.training.metrics import CLIP_ON_POLICY, rollout_clip_fractions

    lines = [  # two ranks' minibatch-0 lines, rank 0's unclipped, as combined they read
        {"train/minibatch": 0, "train/tokens": 10.0, "train/clip_fraction": 0.0},
        {"train/minibatch": 0, "train/tokens": 30.0, "train/clip_fraction": 0.2},
    ]
    clip = rollout_clip_fractions(lines)
    assert clip[CLIP_ON_POLICY] == pytest.approx(0.15)
    warning = OnPolicyClipWarning(Distributed())
    warning.check(2, {CLIP_ON_POLICY: 0.0}, recomputed=False)
    assert capsys.readouterr().err == ""
    warning.check(3, clip, recomputed=False)
    err = capsys.readouterr().err
    assert err.startswith("gspo: warning: the on-policy minibatch of rollout batch 3 clipped 15.0%")
    assert "algorithm.old_logprobs=sampler" in err and err.count("\n") == 1
    warning.check(4, clip, recomputed=False)  # once per run
    assert capsys.readouterr().err == ""
    recomputed = OnPolicyClipWarning(Distributed())
    recomputed.check(5, clip, recomputed=True)
    assert "recomputed by the trainer, differs from its update's forward" in capsys.readouterr().err
    # auto already in use: recompute is the way out (before: "auto or recompute avoids it")
    OnPolicyClipWarning(Distributed(), "auto").check(6, clip, recomputed=False)
    err = capsys.readouterr().err
    assert "(algorithm.old_logprobs=auto)" in err and "old_logprobs=recompute avoids it" in err
    OnPolicyClipWarning(Distributed(), "auto", 0.3).check(7, clip, recomputed=False)
    assert "perturbed by rollout.logit_noise=0.3, by design" in capsys.readouterr().err


# ------------------------------------------------------------------ dynamic sampling
def test_fill_keeps_informative_groups_and_stops_at_the_cap():
    g = 2
    rounds = {
        1: torch.tensor([1.0, 1.0, 0.0, 1.0]),  # constant, informative
        2: torch.tensor([0.0, 1.0, 1.0, 0.0]),  # informative, informative
    }
    first = torch.tensor([0.0, 0.0, 1.0, 0.0])  # constant, informative
    calls = []

    def sample_round(r):
        calls.append(r)
        return constant_groups(rounds[r], g)

    first = constant_groups(first, g)
    out = fill_with_informative_groups(first, 2, max_rounds=3, sample_round=sample_round)
    assert calls == [1] and out.groups == [1, 3] and out.rounds == 1 and out.dropped == 2
    calls.clear()
    out = fill_with_informative_groups(first, 2, max_rounds=0, sample_round=sample_round)
    assert calls == [] and out.groups == [0, 1] and out.dropped == 0  # topped up


def test_constant_groups_and_extra_prompts_are_deterministic():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    assert constant_groups(rewards, 2).tolist() == [True, False, True]
    # what the advantages zero too (before, these counted as informative): one scored
    # completion, the scored ones equal, a spread of float32 rounding only
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0 + 1e-7])
    scorable = torch.tensor([True, True, False, True, False, False, True, True, True])
    assert constant_groups(rewards, 3, scorable).tolist() == [True, True, True]
    scorable[2] = True
    assert constant_groups(rewards, 3, scorable).tolist() == [False, True, True]
    assert extra_prompts(0, 3, 1, 100, 8) == extra_prompts(0, 3, 1, 100, 8)
    assert extra_prompts(0, 3, 1, 100, 8) != extra_prompts(0, 3, 2, 100, 8)


def test_concat_batches_pads_and_keeps_rows():
    def batch(p, t, value):
        return RolloutBatch(
            prompt_ids=torch.full((2, p), value), prompt_mask=torch.ones(2, p, dtype=torch.long),
            completion_ids=torch.full((2, t), value),
            completion_mask=torch.ones(2, t, dtype=torch.long),
            sampler_logprobs=torch.full((2, t), -float(value)),
            finish_reasons=["stop", "length"], group_size=2,
        )  # fmt: skip

    out = concat_batches([batch(3, 5, 1), batch(4, 2, 2)])
    assert out.prompt_ids.shape == (4, 4) and out.completion_ids.shape == (4, 5)
    assert out.prompt_mask[:2, 0].tolist() == [0, 0]  # left padding
    assert out.completion_mask[2:, 2:].sum() == 0  # right padding
    assert out.finish_reasons == ["stop", "length", "stop", "length"]
    assert out.select(torch.tensor([2, 3])).completion_ids.shape == (2, 2)


@pytest.mark.slow
def test_filter_groups_fills_the_batch_and_resumes_exactly(tmp_path):
    """A binary reward gives constant groups; with filter_groups they are replaced (no
    constant group is left unless the cap was hit) and a resumed run replays the same
    extra rounds."""
    reward = tmp_path / "has_one.py"
    reward.write_text(HAS_ONE)
    common = [
        *TINY, f"reward.functions=[{reward}:has_one]", "rollout.max_new_tokens=3",
        "rollout.filter_groups=true", "rollout.filter_max_rounds=2",
        "train.max_steps=8", "algorithm.minibatches=2", "train.save_every=4",
        "eval.every=4", "optim.lr=1e-3",
    ]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "full"), *common]) == 0
    cut = ["train", "--output-dir", str(tmp_path / "cut"), *common, "train.max_steps=4"]
    assert main(cut) == 0
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000004"
    assert main(["train", "--resume", str(tmp_path / "cut"), "train.max_steps=8"]) == 0
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    lines = train_lines(full)
    assert sum(r["rollout/groups_dropped"] for r in lines) > 0
    for r in lines:
        if r["rollout/extra_rounds"] < 2:  # the batch filled up before the cap
            assert r["train/zero_std_fraction"] == 0.0
        assert r["train/sequences"] > 0


# ------------------------------------------------------------------ overlong penalty
def test_overlong_penalty_values():
    from gspo.rewards import overlong_penalty

    # limit 20, buffer 5: free up to 15 tokens, then -0.2 per token to -1 at 20
    got = overlong_penalty([3, 15, 16, 18, 20], 20, 5, 1.0)
    assert got == pytest.approx([0.0, 0.0, -0.2, -0.6, -1.0])
    assert overlong_penalty([20], 20, 5, 0.5) == [-0.5]
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty([1], 20, 21, 1.0)
    with pytest.raises(ConfigError, match="reward.overlong_buffer"):
        load_config(None, ["rollout.max_new_tokens=8", "reward.overlong_buffer=9"])


@pytest.mark.slow
def test_overlong_penalty_shapes_training_rewards_not_evaluation(tmp_path):
    """On chain cut at 24 tokens (buffer 8) the training reward is the task's reward plus
    the logged penalty, which is -1 exactly for truncated responses; evaluation is not
    penalised."""
    overrides = [
        *CHAIN, "rollout.max_new_tokens=24", "reward.overlong_penalty=1.0",
        "reward.overlong_buffer=8", "train.max_steps=2", "algorithm.minibatches=1",
    ]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for r in train_lines(records):
        penalty = r["train/reward/overlong_penalty"]
        assert -1.0 <= penalty < 0.0
        assert penalty <= -r["train/truncated_fraction"] + 1e-6  # truncated ones give -1
        assert r["train/reward_mean"] == pytest.approx(
            r["train/reward/numeric_match"] + penalty, abs=1e-5
        )
    evals = [r for r in records if "eval/reward_mean" in r]
    assert evals and all(r["eval/reward_mean"] >= 0.0 for r in evals)


@pytest.mark.slow
def test_filter_groups_under_two_ranks_fills_every_share_and_resumes_exactly(tmp_path):
    """torchrun, 2 ranks: each rank refills its own share of the rollout batch; the
    groups dropped add up over ranks and the extra rounds are the most any rank needed, so
    a batch with fewer rounds than the cap has no constant group left on any rank; a run
    cut at step 4 and resumed (on 2 ranks) logs what the uncut run logged."""
    from test_distributed import torchrun

    reward = tmp_path / "has_one.py"
    reward.write_text(HAS_ONE)
    common = [
        *TINY, f"reward.functions=[{reward}:has_one]", "rollout.max_new_tokens=3",
        "rollout.filter_groups=true", "rollout.filter_max_rounds=2",
        "train.max_steps=8", "algorithm.minibatches=2", "train.save_every=4",
        "eval.every=4", "optim.lr=1e-3", "--no-cache",
    ]  # fmt: skip
    train = ["-m", "gspo", "train", "--output-dir"]
    torchrun(*train, str(tmp_path / "full"), *common)
    torchrun(*train, str(tmp_path / "cut"), *common, "train.max_steps=4")
    torchrun("-m", "gspo", "train", "--resume", str(tmp_path / "cut"), "train.max_steps=8")
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in full] == [r["step"] for r in resumed]
    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    lines = train_lines(full)
    assert sum(r["rollout/groups_dropped"] for r in lines) > 0
    for r in lines:
        assert r["train/sequences"] == 8  # 4 prompts x 4, half of them per minibatch
        if r["rollout/extra_rounds"] < 2:
            assert r["train/zero_std_fraction"] == 0.0


def test_recomputed_pi_old_makes_the_first_minibatch_exactly_on_policy_under_bf16(tmp_path):
    # pi_old recomputed in one forward over the whole rollout batch packed its rows
    # differently from the minibatches' training forwards; under bf16 that moved the
    # on-policy minibatch's sequence ratios off 1 (to 0.999987 here; a 9-token response's
    # mean log-ratio by -3.3e-4 in a scratch check, past GSPO's 3e-4 clip)
    config = load_config(None, [*CHAIN, "train.cold_start_steps=0", "model.dtype=bfloat16",
                                "algorithm.old_logprobs=recompute", "algorithm.minibatches=2",
                                "rollout.max_new_tokens=24", "train.max_steps=2",
                                "eval.every=0"])  # fmt: skip
    lines = train_lines(Trainer(config, tmp_path / "run").fit())
    first = lines[0]
    assert first["train/minibatch"] == 0
    assert first["train/ratio_min"] == first["train/ratio_max"] == 1.0, first
    assert first["train/clip_fraction"] == 0.0


def test_ratio_dumps_with_an_entropy_bonus(tmp_path):
    """The gradient cosines of a ratio dump take the run's loss: with
    algorithm.entropy_coef > 0 they called it without the entropy, and the first dump
    stopped the run ("entropy_coef is non-zero but entropy is None") after its cold start."""
    overrides = [
        *CHAIN, *RECOMPUTE_GRPO, "train.max_steps=1", "algorithm.minibatches=1",
        "algorithm.entropy_coef=0.01", "eval.every=0", "log.ratio_dump_every=1",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    experience = trainer.rollout_stage.experience(0)
    trainer.update_stage.train(experience, 0)
    dump = torch.load(tmp_path / "run" / "ratios" / "rollout-000000.pt")
    assert dump["cosine_halves"].numel() > 0
    assert torch.isfinite(dump["cosine_full_to_on_policy"])
