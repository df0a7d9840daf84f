"""APPS/TACO/LeetCode call-based tests of the ``code`` reward (``fn_name``): the sandbox
calls the function, or ``Solution().fn_name``, with each input's arguments, and the
trainer compares the JSON of what it returned with the expected output. Such rows were
refused at the start until 2026-11-29."""

from __future__ import annotations

import json
import time

import pytest
from conftest import CPU

from gspo.cli import main
from gspo.rewards import load_reward_function, sandbox
from gspo.rewards.code_tests import CodeTest, parse_tests, same_value
from gspo.rewards.sandbox import Limits, score_code

FAST = Limits(wall_s=4.0, cpu_s=2, memory_mb=512, max_procs=16, test_cpu_s=0.5)
HAS_BWRAP = sandbox.isolation()[0] == "bwrap"
ADD = {"fn_name": "add", "inputs": [[1, 2], [2, 2], [10, 1]], "outputs": [[3], [4], [11]]}


def score(program: str, tests: object = ADD, limits: Limits = FAST) -> float:
    return score_code(program, parse_tests(tests), limits)


def test_parse_call_based_tests() -> None:
    cases = parse_tests(ADD)
    assert cases[0] == CodeTest(fn_name="add", args="[1, 2]", expected="[3]")
    assert parse_tests(json.dumps(ADD)) == cases  # (the JSON string APPS stores)
    assert len(parse_tests({**ADD, "inputs": [(1, 2), (2, 2), (10, 1)]})) == 3
    for bad, said in [
        ({**ADD, "fn_name": "not a name"}, r"fn_name 'not a name' is not a Python name"),
        ({**ADD, "inputs": [[1, 2], 3, [4, 5]]}, r"inputs\[1\] is int 3, not the list"),
        ({**ADD, "outputs": [[3]]}, r"3 inputs but 1 outputs"),
        ({"fn_name": "f", "inputs": [], "outputs": []}, r"no tests"),
        ({"fn_name": "f", "inputs": [[1]]}, r"need lists 'inputs'"),
        ({"fn_name": "f", "inputs": [[{1}]], "outputs": [1]}, r"inputs\[0\] is not JSON"),
    ]:
        with pytest.raises(ValueError, match=rf"^row 2: .*{said}"):
            parse_tests(bad, where="row 2")


def test_same_value_normalises_as_apps_stores_outputs() -> None:
    assert same_value(3, [3]) and same_value(3, 3) and same_value([1, 2], [[1, 2]])
    assert same_value([1, 2], [1, 2]) and not same_value([1, 2], [[1, 2], [3]])
    assert same_value(2.5, 2.5 + 1e-12) and same_value(3, 3.0) and not same_value(2.5, 2.6)
    assert not same_value("3", [3]) and not same_value(True, [1]) and not same_value(1, True)
    assert same_value({"a": [1, 2]}, [{"a": [1, 2]}]) and not same_value({"a": 1}, {"b": 1})
    assert not same_value(10**400, 1.0) and same_value(None, [None])


def test_call_based_scores_the_pass_fraction(sandbox_mode: str) -> None:
    assert score("def add(a, b):\n    return a + b") == 1.0
    assert score("def add(a, b):\n    return a - b") == 0.0
    assert score("def add(a, b):\n    return a + b if a < 10 else 0") == pytest.approx(2 / 3)
    assert score("def add(a, b):\n    return (a + b,)") == 1.0  # (a tuple is a JSON list)
    assert score("def add(a, b):\n    return str(a + b)") == 0.0  # (the type counts)
    assert score("def add(a, b):\n    return {a + b}") == 0.0  # (a set is not JSON)
    assert score("def plus(a, b):\n    return a + b") == 0.0  # (no function of that name)
    assert score("raise SystemExit(0)\ndef add(a, b):\n    return a + b") == 0.0
    print_forged = "def add(a, b):\n    print('0 ok [3]')\n    return 0"
    assert score(print_forged) == 0.0


def test_leetcode_solution_class(sandbox_mode: str) -> None:
    two_sum = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]],
               "outputs": [[0, 1], [1, 2]]}  # fmt: skip
    program = (
        "from typing import List\n"
        "class Solution:\n"
        "    def __init__(self):\n"
        "        self.calls = 0\n"
        "    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        self.calls += 1  # (a new instance per test: state does not leak)\n"
        "        assert self.calls == 1\n"
        "        seen = {}\n"
        "        for i, n in enumerate(nums):\n"
        "            if target - n in seen:\n"
        "                return [seen[target - n], i]\n"
        "            seen[n] = i\n"
    )
    assert score(program, two_sum) == 1.0
    assert score(program.replace("[seen[target - n], i]", "[i, i]"), two_sum) == 0.0


def test_each_call_has_its_own_time_limit(sandbox_mode: str) -> None:
    """A call that loops (or sleeps, or catches the timeout and returns) fails alone: the
    calls after it still run and count."""
    looping = "def add(a, b):\n    while a == 2:\n        pass\n    return a + b"
    sleeping = (
        "import time\ndef add(a, b):\n    if a == 2:\n        time.sleep(60)\n    return a + b"
    )
    catching = (
        "def add(a, b):\n    try:\n        while a == 2:\n            pass\n"
        "    except BaseException:\n        pass\n    return a + b"
    )
    for program in (looping, sleeping, catching):
        start = time.monotonic()
        assert score(program) == pytest.approx(2 / 3), program
        assert time.monotonic() - start < 2 * FAST.test_cpu_s + FAST.wall_s
    assert score("def add(a, b):\n    while True:\n        pass") == 0.0


def test_code_reward_with_call_based_rows() -> None:
    reward = load_reward_function("code")
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a * b\n```"
    out = reward(prompts=["q"] * 3, completions=[right, wrong, "no code"], tests=[ADD] * 3)
    assert out == [1.0, pytest.approx(1 / 3), 0.0]  # (2 * 2 == 2 + 2)


SOLVES_ALL = (
    "def add(a, b):\n    return a + b\n"
    "def sq(x):\n    return x * x\n"
    "class Solution:\n    def twoSum(self, nums, target):\n"
    "        return next([i, j] for i in range(len(nums)) for j in range(i + 1, len(nums))\n"
    "                    if nums[i] + nums[j] == target)\n"
)


@pytest.mark.parametrize("column", ["tests", "input_output"])
def test_gspo_train_on_call_based_rows(tmp_path, monkeypatch, column: str) -> None:
    """A 3-row JSONL of call-based tests (a mapping, a JSON string, a Solution class)
    trains: the rows are no longer refused at the start, and the reward is called on each
    completion. The tiny random model writes no code, so every completion is read as the
    program that solves all three (program_of patched): its reward is 1 on every row. The
    tests in APPS's column ``input_output`` are read with ``data.tests_column``."""
    rows = [
        {"prompt": "Write add(a, b).", column: ADD},
        {"prompt": "Write Solution.twoSum.", column: json.dumps(
            {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9]], "outputs": [[0, 1]]})},
        {"prompt": "Write sq(x).", column: {"fn_name": "sq", "inputs": [[3]], "outputs": [9]}},
    ]  # fmt: skip
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.setattr(sandbox, "program_of", lambda completion, prompt=None: SOLVES_ALL)
    run = tmp_path / "run"
    args = [CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
            "model.intermediate=128", "rollout.group_size=2", "rollout.prompts_per_batch=3",
            "rollout.max_new_tokens=4", "train.max_steps=1", "algorithm.minibatches=1",
            "eval.every=0", "log.progress=false", "log.plots=false", "log.tensorboard=false",
            "log.completions_every=1", f"data.train={data}", "reward.functions=[code]",
            f"data.tests_column={column}"]  # fmt: skip
    assert main(["train", "--output-dir", str(run), *args]) == 0
    logged = [json.loads(line) for line in (run / "completions" / "rollout-000000.jsonl").open()]
    assert sorted({r["prompt"] for r in logged}) == sorted(r["prompt"] for r in rows)
    assert [r["rewards"]["code"] for r in logged] == [1.0] * 6


def test_a_programs_prints_do_not_cost_its_tests(sandbox_mode: str) -> None:
    """Assert and call-based tests ignore what the program prints; its debugging prints
    (100 kB a call here) filled the 1 MB output cap, the process was killed and the tests
    after scored 0: a right program scored 0.5."""
    chatty = "import sys\ndef add(a, b):\n    print('x' * 100000)\n    return a + b"
    calls = {"fn_name": "add", "inputs": [[i, 1] for i in range(20)],
             "outputs": [[i + 1] for i in range(20)]}  # fmt: skip
    asserts = "\n".join(f"assert add({i}, 1) == {i + 1}" for i in range(20))
    assert score(chatty, calls) == 1.0
    assert score(chatty, asserts) == 1.0
    assert score(chatty.replace("print(", "sys.stderr.write("), asserts) == 1.0


def test_the_programs_main_block_does_not_run_under_call_based_tests(sandbox_mode: str) -> None:
    """The program ran as ``__main__``: its ``if __name__ == "__main__":`` block read input
    that is not there, and a right function scored 0. APPS's checker imports it as a
    module; so does this harness now (named ``solution``, in ``sys.modules``, so a
    dataclass under ``from __future__ import annotations`` still works)."""
    with_main = (
        "def add(a, b):\n    return a + b\n"
        "if __name__ == '__main__':\n    a, b = map(int, input().split())\n    print(add(a, b))"
    )
    assert score(with_main) == 1.0
    dataclass = (
        "from __future__ import annotations\nfrom dataclasses import dataclass\n"
        "@dataclass\nclass Sum:\n    x: int\n"
        "def add(a, b):\n    return Sum(a + b).x"
    )
    assert score(dataclass) == 1.0
