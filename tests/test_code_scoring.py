"""``reward.code_scoring``: the ``code`` reward as the fraction of a row's tests a program
passes (the default), or ``all``, 1 only where it passes every one (PRIME's prime_code,
DeepCoder, Skywork-OR1). Until 2026-11-29 there was the fraction alone: a program that
special-cased the easy tests was rewarded for them."""

from __future__ import annotations

import json
import pickle
import time

import pytest
from conftest import CPU

from gspo.cli import main
from gspo.config import Config
from gspo.rewards import RewardFunctions, code_reward, sandbox
from gspo.rewards.sandbox import Limits, parse_tests, score_code
from gspo.rewards.verifiers import CodeReward

FAST = Limits(wall_s=4.0, cpu_s=2, memory_mb=512, max_procs=16, test_cpu_s=0.5)
ASSERTS = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(10, 1) == 11"
CALLS = {"fn_name": "add", "inputs": [[1, 2], [2, 2], [10, 1]], "outputs": [[3], [4], [11]]}
IO = [{"input": "1 2\n", "output": "3"}, {"input": "2 2\n", "output": "4"},
      {"input": "10 1\n", "output": "11"}]  # fmt: skip
RIGHT = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    pass"
EASY_ONLY = "def add(a, b):\n    return a + b if a < 10 else 0"  # (2 of 3)
READ = "a, b = map(int, input().split())\nprint({})"


@pytest.mark.parametrize("form", ["asserts", "calls", "io"])
def test_all_scores_1_only_where_every_test_passes(sandbox_mode: str, form: str) -> None:
    tests, right, easy = {
        "asserts": (ASSERTS, RIGHT, EASY_ONLY),
        "calls": (CALLS, RIGHT, EASY_ONLY),
        "io": (IO, READ.format("a + b"), READ.format("a + b if a < 10 else 0")),
    }[form]
    cases = parse_tests(tests)
    assert score_code(easy, cases, FAST) == pytest.approx(2 / 3)  # (the default, unchanged)
    assert score_code(easy, cases, FAST, scoring="fraction") == pytest.approx(2 / 3)
    assert score_code(easy, cases, FAST, scoring="all") == 0.0
    assert score_code(right, cases, FAST, scoring="all") == 1.0
    assert score_code(None, cases, FAST, scoring="all") == 0.0
    with pytest.raises(ValueError, match="code scoring 'some': not one of fraction, all"):
        score_code(right, cases, FAST, scoring="some")


def test_all_runs_no_input_output_test_after_one_fails(sandbox_mode: str) -> None:
    """Under ``all`` the input/output tests after a failed one (a process each) are not run:
    ten that each sleep past the wall clock take one wall clock, not ten."""
    slow = Limits(wall_s=1.0, cpu_s=1, memory_mb=512, max_procs=16)
    cases = parse_tests([{"input": "1\n", "output": "2"}] * 10)
    start = time.monotonic()
    assert score_code("import time\ntime.sleep(30)", cases, slow, scoring="all") == 0.0
    assert time.monotonic() - start < 5 * slow.wall_s


def test_code_reward_scored_as_reward_code_scoring() -> None:
    """The config's ``reward.code_scoring`` reaches the built-in, in the trainer process and
    in ``reward.workers`` processes (by pickle), still named ``code`` (its metric
    ``train/reward/code``); the default loads the built-in itself."""
    fenced = "```python\n{}\n```"
    completions = [fenced.format(RIGHT), fenced.format(EASY_ONLY), "no code"]
    kwargs = {"prompts": ["q"] * 3, "completions": completions, "tests": [ASSERTS] * 3}
    assert code_reward(**kwargs) == [1.0, pytest.approx(2 / 3), 0.0]
    assert CodeReward("all")(**kwargs) == [1.0, 0.0, 0.0]
    assert pickle.loads(pickle.dumps(CodeReward("all"))) == CodeReward("all")
    config = Config.model_validate({"reward": {"functions": ["code", "format"]}})
    assert config.reward.specs() == ["code", "format"]
    config = Config.model_validate(
        {"reward": {"functions": ["code", "format"], "code_scoring": "all"}}
    )
    assert config.reward.specs() == [CodeReward("all"), "format"]
    for workers in (0, 1):
        rewards = RewardFunctions.from_specs(config.reward.specs(), workers=workers)
        try:
            assert rewards.names == ["code", "format"]
            result = rewards(kwargs["prompts"], completions, {"tests": kwargs["tests"]})
            assert result.per_function["code"] == [1.0, 0.0, 0.0]
        finally:
            rewards.close()


def test_code_scoring_without_the_code_reward_is_refused_in_one_line() -> None:
    said = r"reward.code_scoring=all scores the built-in code reward, which reward.functions "
    with pytest.raises(ValueError, match=said + r"\(exact_match\) does not name"):
        Config.model_validate({"reward": {"code_scoring": "all"}})
    with pytest.raises(ValueError, match="code_scoring"):
        Config.model_validate({"reward": {"functions": ["code"], "code_scoring": "binary"}})
    from_python = Config.model_validate(
        {"reward": {"functions": [code_reward], "code_scoring": "all"}}
    )
    assert from_python.reward.specs() == [CodeReward("all")]


def test_a_code_reward_passed_as_itself_keeps_its_scoring_beside_by_source() -> None:
    """CodeReward("all") from Python beside by_source (reward.sources set) was scored as
    reward.code_scoring's default, fraction, where alone it was scored all."""
    alone = Config.model_validate({"reward": {"functions": [CodeReward("all")]}})
    assert alone.reward.specs() == [CodeReward("all")]
    beside = Config.model_validate(
        {"reward": {"functions": [CodeReward("all"), "by_source"], "sources": {"mine": "math"}}}
    )
    assert beside.reward.specs()[0] == CodeReward("all")
    # reward.code_scoring, when set, scores every CodeReward (and by_source's code)
    every = Config.model_validate(
        {"reward": {"functions": [CodeReward("fraction"), "code"], "code_scoring": "all"}}
    )
    assert every.reward.specs() == [CodeReward("all"), CodeReward("all")]


def test_gspo_train_with_code_scoring_all(tmp_path, monkeypatch) -> None:
    """``gspo train reward.code_scoring=all``: every completion read as a program that passes
    2 of the row's 3 tests (program_of patched: the tiny model writes no code) gets 0,
    where the default gives it 2/3."""
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"prompt": "Write add(a, b).", "tests": CALLS}) + "\n")
    monkeypatch.setattr(sandbox, "program_of", lambda completion, prompt=None: EASY_ONLY)
    args = [CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
            "model.intermediate=128", "rollout.group_size=2", "rollout.prompts_per_batch=1",
            "rollout.max_new_tokens=4", "train.max_steps=1", "algorithm.minibatches=1",
            "eval.every=0", "log.progress=false", "log.plots=false", "log.tensorboard=false",
            "log.completions_every=1", f"data.train={data}", "reward.functions=[code]",
            "train.cold_start_steps=0"]  # fmt: skip
    for scoring, reward in (("fraction", pytest.approx(2 / 3)), ("all", 0.0)):
        run = tmp_path / scoring
        given = [*args, f"reward.code_scoring={scoring}"]
        assert main(["train", "--output-dir", str(run), *given]) == 0
        logged = (run / "completions" / "rollout-000000.jsonl").read_text().splitlines()
        assert [json.loads(line)["rewards"]["code"] for line in logged] == [reward] * 2


def test_a_code_reward_object_passed_from_python_is_the_code_reward() -> None:
    """``CodeReward("all")`` in reward.functions with ``reward.code_scoring=all`` was refused
    ("which reward.functions (<python object code>) does not name: add code")."""
    config = Config.model_validate(
        {"reward": {"functions": [CodeReward("all")], "code_scoring": "all"}}
    )
    assert config.reward.specs() == [CodeReward("all")]
    config = Config.model_validate({"reward": {"functions": [CodeReward()], "code_scoring": "all"}})
    assert config.reward.specs() == [CodeReward("all")]
