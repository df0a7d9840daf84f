"""Tests for gspo.rewards: built-in verifiers, loading specs, combining rewards."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from gspo.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    RewardFunctions,
    RewardResult,
    completion_text,
    extract_final_answer,
    load_reward_function,
    parse_number,
    reference_answer,
)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def score(name: str, completions: list, answers: list, prompts: list | None = None) -> list:
    prompts = prompts if prompts is not None else ["q"] * len(completions)
    return BUILTIN_REWARDS[name](prompts=prompts, completions=completions, answer=answers)


# ---------------------------------------------------------------------------- helpers


def test_builtin_names() -> None:
    assert set(BUILTIN_REWARDS) == {
        "by_source",
        "code",
        "environment",
        "exact_match",
        "numeric_match",
        "math",
        "format",
    }


@pytest.mark.parametrize(
    ("completion", "text"),
    [
        ("plain", "plain"),
        (chat("hello"), "hello"),
        ({"role": "assistant", "content": "one"}, "one"),
        (
            [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}],
            "a",
        ),
        ([{"role": "assistant", "content": [{"type": "text", "text": "parts"}]}], "parts"),
        ([], ""),
        (None, ""),
    ],
)
def test_completion_text(completion: object, text: str) -> None:
    assert completion_text(completion) == text


def test_completion_text_rejects_other_types() -> None:
    with pytest.raises(TypeError):
        completion_text(42)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", 12.0),
        ("-3.5", -3.5),
        ("1,234", 1234.0),
        ("1,234,567.25", 1234567.25),
        ("3/4", 0.75),
        ("-3/4", -0.75),
        ("\\frac{3}{4}", 0.75),
        ("-\\dfrac{1}{2}", -0.5),
        ("\\frac12", 0.5),  # LaTeX's one-digit shorthand (MATH writes it)
        ("\\dfrac34", 0.75),
        ("\\frac123", None),  # \frac{1}{2}3: no single number
        ("$1,234", 1234.0),
        ("50\\%", 50.0),
        ("7.", 7.0),
        (".5", 0.5),
        ("18 apples", None),
        ("1 1/2", 1.5),
        ("-1 1/2", -1.5),
        ("1 3/2", None),  # (no mixed number)
        ("1 000", 1000.0),  # thousands grouped by spaces, as the whole text
        ("1\u202f000\u00a0000", 1000000.0),  # (narrow and no-break spaces)
        ("1 00", None),  # (two numbers, not 100: whitespace between digits is kept)
        ("3\\frac{1}{2}", 3.5),
        ("6.02 \\times 10^{23}", 6.02e23),
        ("1, 234", None),
        ("3 / 4", 0.75),
        ("1e400", None),  # (past a float)
        ("x", None),
        ("1/0", None),
        ("", None),
    ],
)
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


def test_extract_final_answer_priority() -> None:
    assert extract_final_answer("Answer: 3 and \\boxed{4} then \\boxed{5}") == "5"
    assert extract_final_answer("<answer> 7 </answer> Answer: 8") == " 7 "
    assert extract_final_answer("blah. The answer is 9\nmore") == "9"
    assert extract_final_answer("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_final_answer("no marker 12") is None


# ---------------------------------------------------------------------------- exact_match


def test_exact_match() -> None:
    completions = ["  Paris\n", "paris", chat(" Paris "), "Paris is the capital", chat("Rome")]
    assert score("exact_match", completions, ["Paris"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_exact_match_stringifies_gold_and_none_is_not_applicable() -> None:
    assert score("exact_match", ["42", "42", "x"], [42, " 42 ", None]) == [1.0, 1.0, None]
    # a blank answer is none (an empty completion matched it: 1.0)
    assert score("exact_match", ["", " "], ["", "  "]) == [None, None]


def test_exact_match_and_format_read_what_follows_the_thinking() -> None:
    completions = ["<think>maybe 41</think>42", "<think>\\boxed{42}</think>", "42<think>no"]
    assert score("exact_match", completions, ["42"] * 3) == [1.0, 0.0, 1.0]
    formatted = BUILTIN_REWARDS["format"](prompts=["p"] * 2, completions=completions[1:])
    assert formatted == [0.0, 0.0]  # (a box inside the thinking is no answer)


def test_a_prompt_that_opens_the_thinking_leaves_no_answer_before_its_close() -> None:
    # DeepSeek-R1's (QwQ's, Qwen3-Thinking's) template ends the prompt with "<think>\n": the
    # completion holds only </think>, and one cut off while thinking scored its steps
    rendered = "<｜User｜>What is 3+4?<｜Assistant｜><think>\n"
    completions = ["3+4=7, so \\boxed{7}? Let me check", "3+4=7\n</think>\n\n\\boxed{7}"]
    for name in ("numeric_match", "math", "exact_match"):
        expected = [0.0, 1.0] if name != "exact_match" else [0.0, 0.0]
        assert score(name, completions, ["7", "7"], [rendered] * 2) == expected, name
        assert score(name, completions[:1], ["7"])[0] == float(name != "exact_match")
    formatted = BUILTIN_REWARDS["format"](prompts=[rendered] * 2, completions=completions)
    assert formatted == [0.0, 1.0]
    prefilled = [{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": "<think>"}]
    assert score("numeric_match", [chat(completions[0])], ["7"], [prefilled]) == [0.0]
    asked = [{"role": "user", "content": "Think in <think> tags"}]  # (not opened: asked)
    assert score("numeric_match", [chat(completions[0])], ["7"], [asked]) == [1.0]


def test_answers_left_open_are_read_in_linear_time() -> None:
    # each \boxed{ or <answer> left open was a scan to the end: 20,000 of them took minutes
    text = "\\boxed{" * 20_000 + "<answer>" * 20_000 + " so \\boxed{7}"
    started = time.monotonic()
    assert extract_final_answer(text) == "7"
    assert score("numeric_match", [text], ["7"]) == [1.0]
    assert time.monotonic() - started < 5


# ---------------------------------------------------------------------------- numeric_match


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("so the total is \\boxed{12}", "12", 1.0),
        ("so the total is \\boxed{13}", "12", 0.0),
        ("Adding up, 5 + 7 = \\boxed{12}. Then 99.", "12", 1.0),
        ("The answer is -3.5", "-3.5", 1.0),
        ("The answer is -3.5", "3.5", 0.0),
        ("The answer is 3.5", "-3.5", 0.0),
        ("We count 1,234 apples", "1234", 1.0),
        ("We count 1,234 apples", "1,234", 1.0),
        ("We count 1,235 apples", "1234", 0.0),
        ("Half of it: 3/4", "0.75", 1.0),
        ("\\boxed{\\frac{3}{4}}", "3/4", 1.0),
        ("\\boxed{\\frac{3}{5}}", "3/4", 0.0),
        ("<think>2+2=4, then 7</think><answer>18</answer>", "18", 1.0),
        ("<think>18 is tempting</think><answer>17</answer>", "18", 0.0),
        ("Answer: x = 5", "5", 1.0),
        ("The answer is 42. Check: 6*7=42.", "42", 1.0),
        ("The answer is 41. Check: 6*7=42.", "42", 0.0),
        ("first 3 then 5 - 2 and finally 8", "8", 1.0),
        ("5-3", "-3", 0.0),
        ("no number at all", "3", 0.0),
        ("value 2.0000001", "2", 0.0),  # numbers are equal exactly (was within 1e-6)
        ("value 2.0001", "2", 0.0),
        ("value 2.000", "2", 1.0),
        ("\\boxed{1000001}", "1,000,000", 0.0),  # (1e-6 of a million: it matched)
        ("\\boxed{0}", "6.626e-34", 0.0),  # (within 1e-12 of 0: it matched)
        ("\\boxed{1/3}", 1 / 3, 1.0),  # a float gold: its nearest float
        ("\\boxed{0.333333}", 1 / 3, 0.0),
        ("\\boxed{2}", 10**400, 0.0),  # (an int past a float's range: OverflowError)
        ("\\boxed{" + "9" * 400 + "}", "9" * 400, 1.0),
        ("\\boxed{1e999999999}", "1", 0.0),  # (an exponent past 4300: no answer, at once)
        # several numbers as alternatives or a list name no answer (the first one counted)
        ("\\boxed{1, 2, 3}", "1", 0.0),
        ("\\boxed{1,5}", "1", 0.0),
        ("\\boxed{1,500}", "1500", 1.0),
        ("\\boxed{3 \\text{ or } 4}", "3", 0.0),
        ("The answer is 18 or 20.", "18", 0.0),
        ("The answer is 18 or 20.", "20", 0.0),  # (not the text's last number either)
        ("The answer is 18 apples, 3 more than 15.", "18", 1.0),
        ("so it is 7 or 8", "8", 0.0),
        ("\\boxed{5 \\text{ cm}^2}", "5", 1.0),
        ("\\boxed{1 1/2}", "1.5", 1.0),  # a mixed number (whitespace was dropped: 11/2)
        ("\\boxed{1 1/2}", "5.5", 0.0),
        ("The answer is 3 1/2 hours", "7/2", 1.0),
        ("\\boxed{-2 3/4}", "-2.75", 1.0),
        ("\\boxed{72}", "Add them.\n#### 72\n", 1.0),
        ("\\boxed{3}", "#### Step 1\nAdd: \\boxed{3}", 1.0),  # a heading is no GSM8K answer
        ("she pays $18.", "Natalia ... so 72 - 54 = 18.\n#### 18", 1.0),
        ("\\boxed{18}", 18, 1.0),
        ("\\boxed{0.5}", 0.5, 1.0),
        ("\\boxed{\\frac12}", "0.5", 1.0),  # was read as 12
        ("\\boxed{\\frac12}", "12", 0.0),
        ("The answer is \\dfrac34.", "0.75", 1.0),
        ("<think>Maybe the answer is 41</think>\n42", "42", 1.0),  # thinking is not the answer
        ("<think>so \\boxed{42}", "42", 0.0),  # cut off while thinking: no answer yet
        ("<think>a</think>The answer is 41<think>no, \\boxed{42}", "42", 0.0),  # reopened
        ("The answer is 42 <think>or 41", "42", 1.0),
    ],
)
def test_numeric_match(completion: str, gold: object, expected: float) -> None:
    assert score("numeric_match", [completion], [gold]) == [expected]
    assert score("numeric_match", [chat(completion)], [gold], prompts=[[]]) == [expected]


def test_numeric_match_non_numeric_gold_is_not_applicable() -> None:
    assert score("numeric_match", ["\\boxed{5}"] * 4, ["Paris", "x^2", None, float("nan")]) == [
        None,
        None,
        None,
        None,
    ]


def test_numeric_match_leaves_out_a_gold_answers_latex_unit() -> None:
    # MATH's "5\text{ inches}": the row went unscored (None) while a completion's own
    # \boxed{5 \text{ inches}} was read as 5
    golds = ["5\\text{ inches}", "4\\text{ m}^2", "18.90\\mbox{ dollars}", "5\\text{ inches}"]
    completions = ["\\boxed{5}", "\\boxed{4 \\text{ m}^2}", "\\boxed{18.9}", "\\boxed{6}"]
    assert score("numeric_match", completions, golds) == [1.0, 1.0, 1.0, 0.0]
    assert score("numeric_match", ["\\boxed{2}"] * 2, ["\\text{2 cm}", "2\\text{ or }3"]) == [
        None,
        None,
    ]


def test_builtin_without_answer_column_names_itself() -> None:
    with pytest.raises(RewardError, match=r"numeric_match.*'answer'"):
        BUILTIN_REWARDS["numeric_match"](prompts=["q"], completions=["1"])


# ---------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so \\boxed{12}", 1.0),
        ("so \\boxed{\\frac{1}{2}}", 1.0),
        ("<think>hmm</think><answer>12</answer>", 1.0),
        ("Final Answer: 12", 1.0),
        ("answer:\n 12", 1.0),
        ("so \\boxed{12", 0.0),
        ("so \\boxed{}", 0.0),
        ("<answer>  </answer>", 0.0),
        ("<answer>12", 0.0),
        ("Answer:", 0.0),
        ("I think it is 12", 0.0),
        ("", 0.0),
    ],
)
def test_format(completion: str, expected: float) -> None:
    f = BUILTIN_REWARDS["format"]
    assert f(prompts=["q"], completions=[completion]) == [expected]
    assert f(prompts=[[]], completions=[chat(completion)], answer=["unused"]) == [expected]


# ---------------------------------------------------------------------------- math


def test_math_equivalent_forms() -> None:
    cases = [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is $0.5$", "\\frac{1}{2}", 1.0),
        ("So \\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("So \\boxed{\\frac{\\sqrt{2}}{2}}", "$\\frac{1}{\\sqrt{2}}$", 1.0),
        ("We get \\boxed{12}", "12", 1.0),
        ("We get \\boxed{13}", "12", 0.0),
        ("The answer is -3.5", "-3.5", 1.0),
        ("<think>first 7</think><answer>3/4</answer>", "0.75", 1.0),
        ("<think>first 0.75</think><answer>7</answer>", "0.75", 0.0),
        ("total is 1,234", "1234", 1.0),
        ("nothing to see", "5", 0.0),
        ("", "5", 0.0),
        ("\\boxed{12}", "Natalia sold 48/2 = 24 clips... \n#### 12", 1.0),
        ("<think>\\boxed{41}</think> so \\boxed{42}", "42", 1.0),
        ("<think>so \\boxed{42}", "42", 0.0),
        ("The answer is 18 or 20", "18", 0.0),  # (math-verify took the first: 1.0)
        ("\\boxed{1, 2}", "1", 0.0),
        ("\\boxed{(1, 2)}", "(1, 2)", 1.0),  # (a pair asked: a pair is no hedge)
        ("\\boxed{1,000}", "1000", 1.0),
    ]
    completions = [c for c, _, _ in cases]
    golds = [g for _, g, _ in cases]
    expected = [e for _, _, e in cases]
    assert score("math", completions, golds) == expected
    assert score("math", [chat(c) for c in completions], golds, prompts=[[]] * len(cases)) == (
        expected
    )


def test_math_reads_an_escaped_dollar_in_the_gold_as_a_dollar_sign() -> None:
    """MATH's "$\\boxed{\\$18.90}$": the gold \\$18.90 was taken as already delimited, not
    parsed, and every row with a dollar amount scored None."""
    gold = reference_answer("The total is $\\boxed{\\$18.90}$.")
    completions = ["\\boxed{18.90}", "\\boxed{\\$18.90}", "\\boxed{17}"]
    assert score("math", completions, [gold] * 3) == [1.0, 1.0, 0.0]


def test_math_reads_thin_spaces_and_escaped_dollars_in_numbers() -> None:
    """math-verify read 1\\,000 as 0: a gold 1\\,000 took a completion 0 as right."""
    completions = ["\\boxed{0}", "\\boxed{1000}", "\\boxed{1\\,000}", "The answer is \\$5.00"]
    assert score("math", completions, ["1\\,000", "1\\,000", "1000", "5"]) == [0.0, 1.0, 1.0, 1.0]


def test_math_reads_the_answer_marks_numeric_match_and_format_read() -> None:
    """math-verify read neither GSM8K's "#### 72" (a base model going on to its own next
    question scored that one's answer) nor an \\fbox (format and numeric_match do)."""
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    completions = [
        "48+24=72\n#### 72\n\nQuestion: Tom has 5 apples.\nAnswer: 5\n#### 5",
        "48+24=72\n#### 72\n\n#### 5",
        "So 48 + 24 = 72.\n#### 72",
        "\\fbox{72}",
        "#### 1. Count the clips: 48 + 24 = 71",
    ]
    for name in ("math", "numeric_match"):
        assert score(name, completions, [gsm8k] * 5) == [1.0, 1.0, 1.0, 1.0, 0.0], name


def test_math_none_gold_and_garbage_do_not_crash() -> None:
    completions = ["\\boxed{1}", "\\boxed{" * 50 + "}", "$\\frac{$", "\\boxed{1}"]
    assert score("math", completions, [None, "1", "1", 1]) == [None, 0.0, 0.0, 1.0]


def test_math_errors_inside_math_verify_count_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify

    def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(math_verify, "verify", broken)
    assert score("math", ["\\boxed{1}"], ["1"]) == [0.0]


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="POSIX only")
def test_a_math_verify_time_out_does_not_log_the_completion(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # math-verify's parse logged "Timeout during parsing: <the whole completion>": a line of
    # 100,000 characters for each completion that ran past its limit
    import gspo.rewards.verifiers as verifiers

    monkeypatch.setattr(verifiers, "MATH_VERIFY_TIMEOUT_S", 1)
    caplog.set_level("WARNING")
    assert score("math", ["1 " * 50_000, "\\boxed{5}"], ["5", "5"]) == [0.0, 1.0]
    assert max((len(r.getMessage()) for r in caplog.records), default=0) < 1000


def test_math_works_outside_the_main_thread() -> None:
    # math-verify's default signal.alarm timeouts raise ValueError off the main thread.
    result: list = []
    thread = threading.Thread(
        target=lambda: result.append(score("math", ["\\boxed{\\frac{1}{2}}", "3"], ["0.5", "4"]))
    )
    thread.start()
    thread.join()
    assert result == [[1.0, 0.0]]


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="POSIX only")
def test_math_off_the_main_thread_keeps_its_time_limit() -> None:
    # math-verify's limits are signal alarms, main thread only: in the rollout thread of
    # async rollouts (or reward.timeout's thread) 9^{9^{9^9}} ran forever. It runs in a
    # worker process of its own there, whose limits hold: 0.0, and the other row scored.
    rewards = RewardFunctions.from_specs(["math"])
    result: list = []
    completions = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{5}"]
    thread = threading.Thread(
        target=lambda: result.append(rewards(["p"] * 2, completions, {"answer": ["5", "5"]})),
        daemon=True,
    )
    try:
        thread.start()
        thread.join(120)
        assert not thread.is_alive()
        assert result[0].per_function["math"] == [0.0, 1.0]
        timed = RewardFunctions.from_specs(["math"], timeout=60)  # (in the main thread)
        assert timed(["p"], completions[:1], {"answer": ["5"]}).rewards == [0.0]
        timed.close()
    finally:
        rewards.close()


@pytest.mark.skipif(not hasattr(__import__("signal"), "setitimer"), reason="POSIX only")
def test_math_keeps_a_pending_alarm() -> None:
    import signal

    fired: list[int] = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 100.0)
    try:
        assert score("math", ["\\boxed{2}"], ["2"]) == [1.0]
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert remaining > 50
    assert not fired


# ---------------------------------------------------------------------------- loading


def write(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source))
    return path


def test_load_builtin() -> None:
    assert load_reward_function("math") is BUILTIN_REWARDS["math"]
    assert load_reward_function(" exact_match ") is BUILTIN_REWARDS["exact_match"]


def test_load_from_file_absolute_and_relative(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "helper_mod_for_rewards.py", "BONUS = 0.5\n")
    write(
        tmp_path / "my_rewards.py",
        """
        from dataclasses import dataclass

        from helper_mod_for_rewards import BONUS

        @dataclass
        class Cfg:
            scale: float = 2.0

        def length(prompts, completions, **kwargs):
            return [Cfg().scale * len(c) + BONUS for c in completions]

        def later(prompts, completions, **kwargs):
            import lazy_helper_for_rewards  # (at call time: it failed, the file's directory gone)

            return [lazy_helper_for_rewards.VALUE] * len(completions)
        """,
    )
    write(tmp_path / "lazy_helper_for_rewards.py", "VALUE = 7.0\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # (this test's additions undone)
    f = load_reward_function(f"{tmp_path / 'my_rewards.py'}:length")
    assert f(prompts=["p", "p"], completions=["ab", "abc"]) == [4.5, 6.5]
    assert sys.path[-1] == str(tmp_path) and sys.path.count(str(tmp_path)) == 1  # last only
    later = load_reward_function(f"{tmp_path / 'my_rewards.py'}:later")
    assert later(prompts=["p"], completions=["a"]) == [7.0]

    monkeypatch.chdir(tmp_path.parent)
    g = load_reward_function(f"{tmp_path.name}/my_rewards.py:length")
    assert g(prompts=["p"], completions=["a"]) == [2.5]
    monkeypatch.chdir(tmp_path)
    h = load_reward_function("my_rewards.py:length")
    assert h(prompts=["p"], completions=[""]) == [0.5]


def test_files_with_the_same_name_do_not_collide(tmp_path: Path) -> None:
    for sub, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / sub).mkdir()
        write(tmp_path / sub / "rewards.py", f"def f(**kw):\n    return [{value}]\n")
    fa = load_reward_function(f"{tmp_path / 'a' / 'rewards.py'}:f")
    fb = load_reward_function(f"{tmp_path / 'b' / 'rewards.py'}:f")
    assert fa(prompts=[1], completions=[1]) == [1.0]
    assert fb(prompts=[1], completions=[1]) == [2.0]
    assert fa.__module__ != fb.__module__
    assert fa.__module__ not in {"rewards", "gspo.rewards"}


def test_load_from_module_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "rewardpkg_for_tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(
        pkg / "scoring.py",
        """
        def shout(prompts, completions, **kwargs):
            return [1.0 if c.isupper() else 0.0 for c in completions]

        class Holder:
            @staticmethod
            def nested(prompts, completions, **kwargs):
                return [None] * len(completions)
        """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    f = load_reward_function("rewardpkg_for_tests.scoring:shout")
    assert f(prompts=["p", "p"], completions=["HI", "hi"]) == [1.0, 0.0]
    g = load_reward_function("rewardpkg_for_tests.scoring:Holder.nested")
    assert g(prompts=["p"], completions=["x"]) == [None]


@pytest.mark.parametrize(
    ("spec", "pattern"),
    [
        (
            "exact",
            r"'exact'.*built-in name \(by_source, code, environment, exact_match, format, math, "
            r"numeric_match\)",
        ),
        ("", r"invalid reward function spec ''"),
        ("mod:", r"'mod:'.*not a Python name"),
        (":f", r"':f'.*missing the file or module"),
        ("mod:not-valid", r"'mod:not-valid'"),
        ("a b.c:f", r"'a b.c:f'.*neither a \.py file nor a module name"),
    ],
)
def test_malformed_specs(spec: str, pattern: str) -> None:
    with pytest.raises(RewardError, match=pattern):
        load_reward_function(spec)


def test_non_string_spec() -> None:
    with pytest.raises(RewardError, match="must be a string"):
        load_reward_function(3)  # type: ignore[arg-type]


def test_file_not_found(tmp_path: Path) -> None:
    spec = f"{tmp_path / 'missing.py'}:f"
    with pytest.raises(RewardError, match=r"file not found.*missing\.py") as info:
        load_reward_function(spec)
    assert spec in str(info.value)
    assert "\n" not in str(info.value)


def test_file_import_fails(tmp_path: Path) -> None:
    write(tmp_path / "bad_syntax.py", "def f(:\n    pass\n")
    write(tmp_path / "bad_runtime.py", "raise KeyError('nope')\n")
    with pytest.raises(RewardError, match=r"bad_syntax\.py.*SyntaxError") as info:
        load_reward_function(f"{tmp_path / 'bad_syntax.py'}:f")
    assert "\n" not in str(info.value)
    with pytest.raises(RewardError, match=r"bad_runtime\.py.*KeyError: 'nope'"):
        load_reward_function(f"{tmp_path / 'bad_runtime.py'}:f")
    assert not [m for m in sys.modules if "bad_runtime" in m]


def test_module_import_fails() -> None:
    with pytest.raises(
        RewardError,
        match=r"no_such_pkg_xyz\.mod.*'no_such_pkg_xyz\.mod:f'.*ModuleNotFoundError",
    ):
        load_reward_function("no_such_pkg_xyz.mod:f")


def test_attribute_missing_and_not_callable(tmp_path: Path) -> None:
    path = write(tmp_path / "few.py", "THRESHOLD = 3\n\ndef real(**kw):\n    return []\n")
    with pytest.raises(RewardError, match=r"few\.py:nope'.*no attribute 'nope'.*real"):
        load_reward_function(f"{path}:nope")
    with pytest.raises(RewardError, match=r"few\.py:THRESHOLD'.*not callable.*int"):
        load_reward_function(f"{path}:THRESHOLD")
    with pytest.raises(RewardError, match=r"'math:nope'.*module 'math' has no attribute"):
        load_reward_function("math:nope")
    # a near name is named, and a long list says how many it leaves out
    names = "".join(f"def f{i:02d}(**kw):\n    return []\n" for i in range(25))
    many = write(tmp_path / "many.py", names + "def correct(**kw):\n    return []\n")
    with pytest.raises(RewardError) as raised:
        load_reward_function(f"{many}:corect")
    said = str(raised.value)
    assert "has no attribute 'corect'; did you mean 'correct'? (defined there: " in said
    assert said.endswith(", and 6 more)")


# ---------------------------------------------------------------------------- combining


def const(value: object):
    def f(prompts: list, completions: list, **kwargs: object) -> list:
        return [value] * len(completions)

    return f


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    return write(
        tmp_path / "rw.py",
        """
        import math

        def half(prompts, completions, **kwargs):
            return [0.5] * len(completions)

        def only_even(prompts, completions, **kwargs):
            return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

        def never(prompts, completions, **kwargs):
            return [None] * len(completions)

        def uses_column(prompts, completions, difficulty, answer, **kwargs):
            return [d * (c == a) for c, d, a in zip(completions, difficulty, answer)]

        def echo_kwargs(prompts, completions, **kwargs):
            return [float(len(kwargs))] * len(completions)

        def boom(prompts, completions, **kwargs):
            raise ZeroDivisionError("division by zero\\nsecond line")

        def short(prompts, completions, **kwargs):
            return [1.0, 1.0, 1.0]

        def not_a_list(prompts, completions, **kwargs):
            return 1.0

        def generator(prompts, completions, **kwargs):
            return (1.0 for _ in completions)

        def a_matrix(prompts, completions, **kwargs):
            import torch

            return torch.ones(len(completions), 1)

        def a_string(prompts, completions, **kwargs):
            return [1.0, "high"]

        def a_nan(prompts, completions, **kwargs):
            return [1.0, math.nan]

        def an_inf(prompts, completions, **kwargs):
            return [-math.inf, 1.0]

        def too_big(prompts, completions, **kwargs):
            return [1.0, 1e39]

        def big(prompts, completions, **kwargs):
            return [6e17, 1.0]

        def as_tuple(prompts, completions, **kwargs):
            return tuple(True for _ in completions)
        """,
    )


def test_weights_and_none_handling(reward_file: Path) -> None:
    specs = [f"{reward_file}:half", f"{reward_file}:only_even", f"{reward_file}:never"]
    rf = RewardFunctions.from_specs(specs, weights=[2.0, 3.0, 100.0])
    result = rf(["p"] * 3, ["a", "b", "c"], {})
    assert isinstance(result, RewardResult)
    assert result.rewards == [4.0, 1.0, 4.0]
    assert list(result.per_function) == specs
    assert result.per_function[specs[1]] == [1.0, None, 1.0]
    assert result.per_function[specs[2]] == [None, None, None]


def test_all_none_gives_zero_and_default_weights(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs([f"{reward_file}:never"])
    assert rf.weights == [1.0]
    assert rf(["p", "p"], ["a", "b"], {}).rewards == [0.0, 0.0]
    both = RewardFunctions.from_specs([f"{reward_file}:half", f"{reward_file}:only_even"])
    assert both(["p", "p"], ["a", "b"], {}).rewards == [1.5, 0.5]


def test_builtins_combined_with_columns() -> None:
    rf = RewardFunctions.from_specs(["numeric_match", "format"], weights=[1.0, 0.1])
    result = rf(
        ["q1", "q2", "q3"],
        ["\\boxed{4}", "it is 4", "\\boxed{5}"],
        {"answer": ["4", "4", "Paris"]},
    )
    assert result.per_function["numeric_match"] == [1.0, 1.0, None]
    assert result.per_function["format"] == [1.0, 0.0, 1.0]
    assert [round(r, 9) for r in result.rewards] == [1.1, 1.0, 0.1]


def test_columns_passed_as_keyword_arguments(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs([f"{reward_file}:uses_column", f"{reward_file}:echo_kwargs"])
    columns = {"difficulty": [1, 2, 3], "answer": ["x", "y", "q"], "extra": [0, 0, 0]}
    result = rf(["p"] * 3, ["x", "y", "z"], columns)
    assert result.per_function[f"{reward_file}:uses_column"] == [1.0, 2.0, 0.0]
    assert result.per_function[f"{reward_file}:echo_kwargs"] == [3.0, 3.0, 3.0]


def test_missing_column_is_reported(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs([f"{reward_file}:uses_column"])
    with pytest.raises(RewardError) as err:
        rf(["p"], ["x"], {"answer": ["x"]})
    assert str(err.value) == (
        f"reward function '{reward_file}:uses_column' needs the argument(s) difficulty, which "
        "no data column gives (the columns: answer)"
    )
    with pytest.raises(RewardError, match=r"difficulty, answer, which no data column gives \("
                       r"the columns: none but the prompt\)"):  # fmt: skip
        rf(["p"], ["x"], {})
    # a TypeError raised inside the function is still that function's error
    boom = RewardFunctions.from_specs([lambda prompts, completions, **kw: [1 + "a"]])
    with pytest.raises(RewardError, match=r"raised TypeError: unsupported operand"):
        boom(["p"], ["x"], {})


def test_a_reward_written_for_text_or_in_another_shape_gets_a_hint() -> None:
    """The README's `c.strip()` under chat prompts, and TRL's singular names: the line
    said only the AttributeError, or that the data lacks a column 'completion'."""

    def strip(prompts, completions, **kw):
        return [float(c.strip() == "4") for c in completions]

    rf = RewardFunctions([strip.__name__], [strip], [1.0])
    chat = [[{"role": "assistant", "content": "4"}]]
    with pytest.raises(RewardError) as err:
        rf(["p"], chat, {})
    assert str(err.value).endswith(
        "; with chat prompts each completion is a list of messages: its text is "
        "c[0]['content'], as in TRL"
    ) and "raised AttributeError: 'list' object has no attribute 'strip'" in str(err.value)
    assert rf(["p"], ["4"], {}).per_function["strip"] == [1.0]  # (as text: no hint needed)

    def one(completion, **kw):
        return [1.0]

    with pytest.raises(RewardError) as err:
        RewardFunctions(["one"], [one], [1.0]).check_columns(["answer"], "data.train")
    assert str(err.value) == (
        "reward function 'one' needs the column(s) completion, which data.train lacks (its "
        "columns: answer); a reward function gets completions, a list, not completion: "
        "def f(prompts, completions, **kwargs) -> list[float]"
    )


def test_a_comma_separated_string_says_to_write_a_list() -> None:
    with pytest.raises(RewardError) as err:
        load_reward_function("exact_match, format")
    assert str(err.value) == (
        "invalid reward function spec 'exact_match, format': several functions are a list, "
        "reward.functions='[exact_match, format]'"
    )


def test_chat_prompts_and_completions(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs(["exact_match", "math"])
    prompts = [[{"role": "user", "content": "1/2 as decimal?"}]] * 2
    result = rf(prompts, [chat("0.5"), chat("0.4")], {"answer": ["0.5", "0.5"]})
    assert result.rewards == [2.0, 0.0]


def test_duplicate_specs_are_suffixed(reward_file: Path) -> None:
    spec = f"{reward_file}:half"
    rf = RewardFunctions.from_specs([spec, spec, "format", spec])
    assert rf.names == [spec, f"{spec}#2", "format", f"{spec}#3"]
    assert len(rf) == 4
    result = rf(["p"], ["x"], {})
    assert set(result.per_function) == set(rf.names)
    assert result.rewards == [1.5]


def test_callables_are_accepted_as_specs() -> None:
    rf = RewardFunctions.from_specs([const(0.25), "format"], weights=[4, 1])
    assert rf.names == ["f", "format"]
    assert rf(["p"], ["Answer: 3"], {}).rewards == [2.0]


def test_weights_mismatch_and_invalid() -> None:
    with pytest.raises(RewardError, match=r"reward\.weights has 1 values.*2 reward functions"):
        RewardFunctions.from_specs(["format", "exact_match"], weights=[1.0])
    with pytest.raises(RewardError, match=r"reward\.weights\[1\] is not finite"):
        RewardFunctions.from_specs(["format", "exact_match"], weights=[1.0, math.inf])
    with pytest.raises(RewardError, match=r"reward\.weights\[0\] is not a number"):
        RewardFunctions.from_specs(["format"], weights=["1"])  # type: ignore[list-item]
    with pytest.raises(RewardError, match="at least one"):
        RewardFunctions.from_specs([])


def test_a_weighted_sum_beyond_float32_names_the_functions(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs([f"{reward_file}:big"] * 2)
    with pytest.raises(RewardError, match=r"weighted sum of .* at index 0 is 1.2e\+18: beyond"):
        rf(["p", "p"], ["a", "b"], {})


def test_loading_error_propagates_from_from_specs(tmp_path: Path) -> None:
    with pytest.raises(RewardError, match=r"nope\.py"):
        RewardFunctions.from_specs(["format", f"{tmp_path / 'nope.py'}:f"])


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("boom", r"'{spec}' raised ZeroDivisionError: division by zero second line"),
        ("short", r"'{spec}' returned 3 values for 2 completions"),
        ("not_a_list", r"'{spec}' returned float, expected a list"),
        ("generator", r"'{spec}' returned generator"),
        (
            "a_matrix",
            r"'{spec}' returned Tensor of shape \(2, 1\), expected a list of float or "
            r"None \(or a 1-D array of 2\)",
        ),
        ("a_string", r"'{spec}' returned a non-numeric value at index 1: 'high'"),
        ("a_nan", r"'{spec}' returned a non-finite value at index 1: nan"),
        ("an_inf", r"'{spec}' returned a non-finite value at index 0: -inf"),
        # inf once a float32 tensor: "rewards must be finite", naming nothing, before
        ("too_big", r"'{spec}' returned 1e\+39 at index 1: beyond ±1e\+18, past which"),
    ],
)
def test_bad_reward_function_results(reward_file: Path, name: str, pattern: str) -> None:
    spec = f"{reward_file}:{name}"
    rf = RewardFunctions.from_specs(["format", spec])
    with pytest.raises(RewardError) as info:
        rf(["p", "p"], ["a", "b"], {})
    message = str(info.value)
    assert "\n" not in message
    assert re.search(pattern.replace("{spec}", re.escape(spec)), message), message


def test_a_raising_reward_function_names_the_raising_line(reward_file: Path) -> None:
    line = (
        reward_file.read_text()
        .splitlines()
        .index('    raise ZeroDivisionError("division by zero\\nsecond line")')
    )
    rf = RewardFunctions.from_specs([f"{reward_file}:boom"])
    with pytest.raises(RewardError) as info:
        rf(["p"], ["a"], {})
    message = str(info.value)
    assert f"(at {reward_file}:{line + 1}; GSPO_DEBUG=1 shows the traceback)" in message


def test_tuple_and_bool_values_are_accepted(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs([f"{reward_file}:as_tuple"])
    assert rf(["p", "p"], ["a", "b"], {}).rewards == [1.0, 1.0]


def test_call_validates_batch_shapes(reward_file: Path) -> None:
    rf = RewardFunctions.from_specs(["format"])
    with pytest.raises(RewardError, match="2 prompts for 1 completions"):
        rf(["p", "p"], ["a"], {})
    with pytest.raises(RewardError, match="column 'answer' has 3 values for 2 completions"):
        rf(["p", "p"], ["a", "b"], {"answer": [1, 2, 3]})
    with pytest.raises(RewardError, match="column 'completions' clashes"):
        rf(["p"], ["a"], {"completions": ["x"]})


def test_import_stays_light() -> None:
    # gspo.rewards without gspo's own __init__ (which loads torch): it needs only the
    # standard library, gspo.plugins and its own modules; the sandbox loads on first use
    code = (
        "import sys, types\n"
        "package = types.ModuleType('gspo'); package.__path__ = [sys.argv[1]]\n"
        "sys.modules['gspo'] = package\n"
        "import gspo.rewards\n"
        "heavy = {'torch', 'transformers', 'math_verify', 'sympy'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
        "ours = {m for m in sys.modules if m.startswith('gspo.')}\n"
        "others = {m for m in ours if m != 'gspo.plugins' and not m.startswith('gspo.rewards')}\n"
        "assert not others and 'gspo.rewards.sandbox' not in ours, ours\n"
    )
    import gspo.rewards

    package = str(Path(gspo.rewards.__file__).parents[1])
    subprocess.run([sys.executable, "-c", code, package], check=True)


def test_an_environment_reward_that_is_no_number_says_so() -> None:
    from gspo.rewards.verifiers import environment_reward

    class Env:
        def __init__(self, value):
            self.value = value

        def get_reward(self):
            return self.value

    envs = [Env(1), Env(None), Env(True)]
    assert environment_reward(["p"] * 3, ["c"] * 3, environments=envs) == [1.0, None, 1.0]
    with pytest.raises(ValueError, match=r"returned '1' \(str\), not a number"):
        environment_reward(["p"], ["c"], environments=[Env("1")])  # (taken as 1.0 before)
    with pytest.raises(ValueError) as err:  # was float()'s text, pointing into gspo
        environment_reward(["p"], ["c"], environments=[Env("correct")])
    assert str(err.value) == (  # (naming the environment's class and file, not gspo's)
        "the environment's get_reward() (test_an_environment_reward_that_is_no_number_says_so"
        f".<locals>.Env, {__file__}) returned 'correct' (str), not a number or None"
    )
    # NaN named the function alone ("'environment' returned a non-finite value"); a
    # get_reward taking an argument failed with a TypeError at gspo's line
    with pytest.raises(ValueError, match=r"\.Env, .*\) returned nan, not a finite number$"):
        environment_reward(["p"], ["c"], environments=[Env(float("nan"))])

    class Asks:
        def get_reward(self, completion):
            return 1.0

    with pytest.raises(ValueError) as err:
        environment_reward(["p"], ["c"], environments=[Asks()])
    assert str(err.value).endswith(
        f".<locals>.Asks, {__file__}) takes completion, and is called with no arguments: "
        "read what it needs from the environment itself (self)"
    )


def test_exact_match_reads_a_float_column_as_the_numbers_written() -> None:
    """One blank cell makes datasets read a CSV's answer column as floats (2.0, nan): every
    correct '2' scored 0 and the blank first row, silently."""
    from gspo.rewards.verifiers import exact_match_reward

    got = exact_match_reward(
        prompts=["p"] * 4, completions=["2", "2", "2.5", "7"], answer=[2.0, float("nan"), 2.5, "7"]
    )
    assert got == [1.0, None, 1.0, 1.0]


@pytest.mark.parametrize("name", ["exact_match", "numeric_match", "math"])
def test_an_answer_that_is_a_list_is_right_for_any_of_its_items(name):
    """A list answer (TriviaQA's aliases) was compared as its repr, "['2', '2.0']", which no
    completion equals: every completion scored 0 and the rows taught nothing."""
    from gspo.rewards.verifiers import BUILTIN_REWARDS

    score = BUILTIN_REWARDS[name]
    got = score(
        prompts=["p"] * 4,
        completions=["2", "5", "3", "4"],
        answer=[["7", "2"], ["7", "2"], "3", []],
        level=[1, 2, 3, 4],  # another column, spread with the rows
    )
    assert got == [1.0, 0.0, 1.0, None]
    assert score(prompts=["p"], completions=["2"], answer=["2"]) == [1.0]  # unchanged


def test_the_answer_column_keeps_a_list_of_answers():
    from gspo.config import load_config
    from gspo.data import prepare_rows

    data = load_config(None, ["data.answer_column=gold"]).data
    rows = [{"prompt": "q", "gold": ["x #### 7", 7.0, None]}]
    assert prepare_rows(rows, data, what="data.train")[0]["answer"] == ["7", "7"]


def test_a_function_taking_the_environments_without_one_is_told_to_set_it():
    """TRL's reward_func(environments, **kwargs) read as a missing data column."""
    from gspo.rewards import RewardError, RewardFunctions

    def reward_func(environments, **kwargs):
        return [env.reward for env in environments]

    rewards = RewardFunctions.from_specs([reward_func], None)
    with pytest.raises(RewardError, match="needs 'environments' .* set rollout.environment"):
        rewards.check_columns(["answer"], "data.train (x.jsonl)")
    rewards.check_columns(["answer"], "data.train (x.jsonl)", passed=["environments"])


def test_a_function_needing_what_only_trl_passes_is_told_so():
    """It read as a missing data column ("needs the column(s) trainer_state, which
    data.train lacks")."""
    from gspo.rewards import RewardError, RewardFunctions

    def trl_style(prompts, completions, trainer_state, **kwargs):
        return [0.0] * len(completions)

    rewards = RewardFunctions.from_specs([trl_style], None)
    with pytest.raises(RewardError) as err:
        rewards.check_columns(["answer"], "data.train (x.jsonl)")
    assert str(err.value).endswith(
        "needs 'trainer_state', which TRL passes and gspo does not (docs/from_trl.md: the "
        "run's step reaches no reward function); give the parameter a default (None) to run "
        "without it"
    )  # (it advised computing the trainer's state "from the completions")

    def optional(prompts, completions, trainer_state=None, **kwargs):
        return [0.0] * len(completions)

    assert RewardFunctions.from_specs([optional], None).trl_defaults() == [
        "reward function 'optional' takes 'trainer_state', which TRL passes and gspo does "
        "not (docs/from_trl.md): it always gets its default (None)"
    ]  # (it got None at every call, unsaid)
    assert RewardFunctions.from_specs([trl_style], None).trl_defaults() == []

    def from_kwargs(prompts, completions, **kwargs):  # (TRL's examples read them so)
        return [float(kwargs["trainer_state"].global_step)] * len(completions)

    with pytest.raises(RewardError) as err:  # (it said "raised KeyError: 'trainer_state'")
        RewardFunctions.from_specs([from_kwargs], None)(["p"], ["c"])
    assert str(err.value) == (
        "reward function 'from_kwargs' read 'trainer_state' from its keyword arguments, "
        "which TRL passes and gspo does not (docs/from_trl.md: the run's step reaches no "
        "reward function); read it with kwargs.get('trainer_state') to run without it"
    )


def test_completion_ids_reach_the_functions_that_take_them(tmp_path):
    """TRL passes each completion's token ids as ``completion_ids`` (its docs' length
    reward reads them); gspo refused such a function ("needs 'completion_ids', which TRL
    passes and gspo does not"). A function without ``**kwargs`` is called as before, and a
    data column of that name is refused."""
    import torch

    from gspo.engines.batch import RolloutBatch
    from gspo.models.builtin import build_char_tokenizer
    from gspo.rewards import RewardError, RewardFunctions
    from gspo.training.rollout import Scorer
    from gspo.training.sampler import Generated

    (tmp_path / "rw.py").write_text(
        "def reward_len(completion_ids, **kwargs):\n"  # (TRL's docs' example)
        "    return [float(len(ids)) for ids in completion_ids]\n"
        "def named(prompts, completions, answer):\n"
        "    return [0.5] * len(completions)\n"
        "import functools\n"
        "def logged(f):\n"
        "    @functools.wraps(f)\n"
        "    def wrapper(*args, **kwargs):\n"
        "        return f(*args, **kwargs)\n"
        "    return wrapper\n"
        "decorated = logged(named)\n"  # (its wrapper takes **kwargs, passed on to named)
        "def penalised(f):\n"
        "    @functools.wraps(f)\n"
        "    def wrapper(prompts, completions, completion_ids, **kwargs):\n"
        "        rewards = f(prompts, completions, **kwargs)\n"
        "        return [r - len(i) for r, i in zip(rewards, completion_ids)]\n"
        "    return wrapper\n"
        "shorter = penalised(named)\n"  # (its wrapper names completion_ids: it takes them)
    )
    names = ("reward_len", "named", "decorated", "shorter")
    specs = [f"{tmp_path / 'rw.py'}:{name}" for name in names]
    rewards = RewardFunctions.from_specs(specs, None)
    rewards.check_columns(["answer"], "data.train (x.jsonl)")  # (refused before)
    tok = build_char_tokenizer()
    ids = [[*tok("12")["input_ids"], tok.eos_token_id, 0], [*tok("345")["input_ids"], 0]]
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)  # (the stop token too)
    batch = RolloutBatch(
        prompt_ids=torch.ones(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1),
        completion_ids=torch.tensor(ids), completion_mask=mask,
        sampler_logprobs=torch.zeros(2, 4), finish_reasons=["stop", "length"], group_size=2,
    )  # fmt: skip
    scored = Scorer(tok, rewards).score([{"prompt": "1+1=", "answer": "2"}], Generated(batch))
    length, named, decorated, shorter = scored.per_function.values()
    assert length == [3.0, 3.0] and named == decorated == [0.5, 0.5]
    assert shorter == [-2.5, -2.5]
    assert scored.completions == ["12", "345"]
    mask[1, 2] = False
    scored = Scorer(tok, rewards).score([{"prompt": "1+1=", "answer": "2"}], Generated(batch))
    assert next(iter(scored.per_function.values())) == [3.0, 2.0]
    with pytest.raises(RewardError, match="its column 'completion_ids' clashes"):
        rewards.check_columns(["completion_ids"], "data.train (x.jsonl)")
    # in worker processes too: each function given only what it takes
    pooled = RewardFunctions.from_specs(specs, None, workers=1)
    try:
        got = pooled(
            ["p", "p"], ["12", "3"], {"answer": ["2", "2"], "completion_ids": [[5], [7, 8]]}
        )
    finally:
        pooled.close()
    assert list(got.per_function.values()) == [[1.0, 2.0], [0.5, 0.5], [0.5, 0.5], [-0.5, -1.5]]
    # a data column of that name that no function takes stays the data's (as before)
    named = RewardFunctions.from_specs([f"{tmp_path / 'rw.py'}:named"], None)
    assert not named.take("completion_ids")
    with pytest.raises(RewardError, match="takes no argument 'completion_ids', which data"):
        named.check_columns(["answer", "completion_ids"], "data.train (x.jsonl)")


def test_gold_answers_as_a_csv_writes_them_still_score():
    """CSV cells are text as written now ("+5", "1e3", no longer read as numbers): a gold
    +5 was no number to numeric_match (None), 1e3 no match for \\boxed{1000} under math."""
    from gspo.rewards.verifiers import BUILTIN_REWARDS

    assert BUILTIN_REWARDS["numeric_match"](prompts=["p"], completions=["5"], answer=["+5"]) == [
        1.0
    ]
    boxed = ["\\boxed{1000}", "\\boxed{0.00015}"]
    assert BUILTIN_REWARDS["math"](
        prompts=["p"] * 2, completions=boxed, answer=["1e3", "1.5E-4"]
    ) == [
        1.0,
        1.0,
    ]


def test_metric_labels_name_each_function_as_trl_does() -> None:
    from gspo.rewards.functions import metric_labels

    names = ["numeric_match", "/abs/dir/r.py:bonus", "pkg.mod:style", "pkg.mod:style#2"]
    assert metric_labels(names) == {
        "numeric_match": "numeric_match",
        "/abs/dir/r.py:bonus": "bonus",
        "pkg.mod:style": "style",
        "pkg.mod:style#2": "style#2",
    }
    # two specs of one function name: the whole specs, not one key for both
    assert metric_labels(["a.py:f", "b.py:f"]) == {"a.py:f": "a.py:f", "b.py:f": "b.py:f"}


N, M, F = "numeric_match", "math", "format"


@pytest.mark.parametrize(
    ("verifier", "completion", "gold", "expected"),
    [
        (N, '\\boxed{\\frac{1}{3}}', '0.3333333333333333', 1.0),  # float 1/3 via data.answer_column
        (N, '\\boxed{\\frac{14}{3}}', '4.666666666666667', 1.0),  # SVAMP-style Answer=14/3 via answ
        (N, '\\boxed{0.3}', '0.30000000000000004', 1.0),  # gold computed in Python (0.1*3) via answ
        (N, 'The answer is 0.3.', 0.30000000000000004, 1.0),  # gold computed in Python (0.1*3), kep
        (N, 'The answer is 3.3.', 3.3000000000000003, 1.0),  # gold 3.3000000000000003
        (N, '\\boxed{0.1}', 0.10000000149011612, 1.0),  # float32 Parquet/datasets column: pyarrow g
        (N, '\\boxed{2.7}', '2.700000047683716', 1.0),  # same float32 cell through data.answer_colu
        (N, 'Each friend gets 7 cookies.\nThe answer is 7, and 2 are left over.', 7, 1.0),
        (M, 'Each friend gets 7 cookies.\nThe answer is 7, and 2 are left over.', 7, 1.0),
        (N, 'The answer is 7 and 2 remaining.', 7, 1.0),  # remainder
        (N, 'The answer is 72, and 48 + 24 = 72 confirms it.', 72, 1.0),  # check after the answer
        (M, 'The answer is 72, and 48 + 24 = 72 confirms it.', 72, 1.0),  # same, math
        (N, 'The answer is 15, 3 more than yesterday.', 15, 1.0),  # apposition
        (N, 'The answer is 1/2 or 0.5.', '\\frac{1}{2}', 1.0),  # same number twice
        (M, 'The answer is 1/2 or 0.5.', '\\frac{1}{2}', 1.0),  # same number twice
        (N, '\\boxed{\\frac{1}{2} \\text{ or } 0.5}', '\\frac{1}{2}', 1.0),  # same number
        (M, '\\boxed{\\frac{1}{2} \\text{ or } 0.5}', '\\frac{1}{2}', 1.0),  # same number
        (N, 'The answer is 0.5, or 1/2.', 0.5, 1.0),  # same number
        (N, 'So the answer is 1/2, or 0.5, or 50%.', 0.5, 1.0),  # same number
        (N, 'The answer is 1 000 000.', 1000000, 1.0),  # SI/French grouping (math: 1.0)
        (N, '\\boxed{1 000 000}', 1000000, 1.0),  # read as 1
        (N, 'The answer is 12 345.', 12345, 1.0),  # read as 12
        (N, '<answer>1 200</answer>', 1200, 1.0),  # read as 1 (math: 1.0)
        (N, 'The answer is 1\u202f000\u202f000.', 1000000, 1.0),  # narrow no-break space
        (N, 'The answer is 1\xa0000.', 1000, 1.0),  # no-break space
        (N, 'The sequence is 2, 4, 8, 16', 16, 1.0),  # next-term question
        (M, 'The sequence is 2, 4, 8, 16', 16, 1.0),  # same, math
        (N, 'The next number is 16.\n\nSequence: 2, 4, 8, 16', 16, 1.0),  # same
        (N, 'The pattern is +3 each time: 5, 8, 11, 14', 14, 1.0),  # same
        (N, 'The answer is $18 or $20.', 18, 0.0),  # '$' between defeats _LIST_SEPARATOR
        (M, 'The answer is $18 or $20.', 18, 0.0),  # same under math
        (N, '\\boxed{\\$18 or \\$20}', 18, 0.0),  # escaped dollars
        (N, '\\boxed{18 \\;or\\; 20}', 18, 0.0),  # LaTeX spacing not stripped first
        (N, 'The answer is 18%, or 20%.', 18, 0.0),  # percent signs
        (N, 'The answer is 18 (or 20).', 18, 0.0),  # parenthesised alternative
        (N, 'The answer is 18 to 20.', 18, 0.0),  # range
        (N, 'The answer is 18-20.', 18, 0.0),  # range
        (N, '\\boxed{18 \\pm 2}', 18, 0.0),  # range
        (N, '\\boxed{18} or \\boxed{20}', 20, 0.0),  # two boxes: the last wins
        (N, '\\boxed{2\\sqrt{3}}', 2, 0.0),  # first number of a non-numeric box
        (N, 'The answer is 10 + 8 = 18.', 18, 1.0),  # first number of the line (math: 1.0)
        (N, '**Answer:** 9 × 2 = $18', 18, 1.0),  # same
        (N, 'Therefore she sold 72 clips.\n\nTo double-check the answer: 24 is half of 48, '
            'and 48 + 24 = 72.', 72, 1.0),
        (N, '\\boxed{3\\frac{1}{2}}', 3.5, 1.0),  # read as 3 (math: 1.0)
        (N, 'He needs 3 1/2 cups. \\boxed{3\\tfrac{1}{2}}', 3.5, 1.0),  # read as 3
        (N, '\\boxed{2 \\dfrac{1}{4}}', 2.25, 1.0),  # read as 2 (math: 1.0)
        (N, 'Janet makes $18 every day.\n#### 18\n\nQuestion: A robe takes 2 bolts of blue '
            'fiber', 18, 1.0),  # a base model's own "####", then the next question
        (F, 'So Tom is 12.\n\n**Final Answer**: 12', None, 1.0),  # 'Answer**:' is not 'Answer:'
        (N, '\\boxed{6.02 \\times 10^{23}}', 6.02e+23, 1.0),  # scientific LaTeX read as 6.02
        (M, '\\boxed{9}', '9 (apples)', 1.0),  # ASDiv gold '9 (apples)': math scores the right answ
        # a second sweep (4,761 generated completions, old against new)
        (N, 'The answer is **18**.', 18, 1.0),
        (M, 'The answer is **18**.', 18, 1.0),
        (N, '**Answer: 18**', 18, 1.0),
        (M, '**Answer: 18**', 18, 1.0),
        (N, 'Answer: **18**', 18, 1.0),
        (N, 'The answer is: **18**', 18, 1.0),
        (N, '**The answer is 18**', 18, 1.0),
        (N, 'The final answer is **16**', 16, 1.0),
        (N, 'Final answer: **$18**', 18, 1.0),
        (N, '<answer>**18**</answer>', 18, 1.0),
        (N, '## Final Answer\n\nThe answer is **18** apples.', 18, 1.0),
        (N, 'The answer is *18*.', 18, 1.0),
        (N, '\\boxed{45^\\circ}', '45', 1.0),
        (M, '\\boxed{45^\\circ}', '45', 1.0),
        (N, '\\boxed{120^{\\circ}}', 120, 1.0),
        (M, 'Final Answer: The final answer is $45^\\circ$. I hope it is correct.', '45', 1.0),
        (N, 'The answer is 18 — 6 for each of the 3 friends.', 18, 1.0),
        (M, 'The answer is 18 — 6 for each of the 3 friends.', 18, 1.0),
        (N, '**Answer:** 18 – 2 more than yesterday', 18, 1.0),
        (N, 'The answer is 18 - 2 more than yesterday.', 18, 1.0),
        (N, '#### Step 1: Find the cost per day\nShe pays 3 × 6 = $'
            '18.\n\n#### Step 2: Total\n18 × 4 = 72\n\nThe answer is 72.', 72, 1.0),
        (N, '#### Step 1: Find the cost per day\nShe pays 3 × 6 = $18.\n'
            '\n#### Step 2: Total\n18 × 4 = 72\n\nSo she pays $72 in total.', 72, 1.0),
        (N, '#### 1. Understand the problem\n#### 2. Compute\n4 + 5 = 9\n\n**Answer:** 9', 9, 1.0),
        (N, 'The answer is 49 (since 2 × 3 = 6).', 49, 1.0),
        (N, 'The answer is 40% (0.4 = 40/100).', 40, 1.0),
        (N, 'The answer is 25 (the remaining 75 = 100 - 25).', 25, 1.0),
        (M, 'The answer is 25 (the remaining 75 = 100 - 25).', 25, 1.0),
        (N, 'Answer: 49 marbles (because 4 × 5 = 20 - 2 = 18)', 49, 1.0),
        (N, 'The answer is 5 apples (x = 5 where 2x + 3 = 13).', 5, 1.0),
        (N, 'Answer: x = 49, y = 3', 49, 1.0),
        (N, 'The answer is 18 = 20 - 2.', 18, 1.0),
        (N, 'The answer is 3.14 to 2 decimal places.', 3.14, 1.0),
        (M, 'The answer is 3.14 to 2 decimal places.', 3.14, 1.0),
        (N, 'The answer is 3.33, to 2 decimal places.', 3.33, 1.0),
        (N, 'The answer is 33.3 to 1 decimal place.', '33.3', 1.0),
        (M, '\\boxed{2+3}', 5, 1.0),
        (M, '\\boxed{2^{10}}', 1024, 1.0),
        (M, '\\boxed{3 \\cdot 2}', 6, 1.0),
        (M, 'The answer is $10^6$.', 1000000, 1.0),
        (N, 'The answer is x = 2 or x = 3.', 3, 0.0),
        (N, '\\boxed{\\pm 3}', 3, 0.0),
        (N, 'The answer is 1 1/2, which is 3 more than before.', 1.5, 1.0),
        (N, '**The answer is 1 1/2.**', 1.5, 1.0),
    ],
)  # fmt: skip
def test_answers_as_models_write_them(verifier, completion, gold, expected):
    """A sweep of answers as instruction-tuned models write them (GSM8K, MATH, SVAMP,
    ASDiv), after numeric_match became exact: float gold answers (a float's digits, a
    float32 column's) lost their tolerance, the hedge check fired on comments after the
    answer ("7, and 2 are left over"), on one number said twice ("1/2 or 0.5") and on a
    sequence's last terms, spaced thousands were cut, and hedges with "$", "%" or "(or"
    between, ranges, "\\boxed{18} or \\boxed{20}" and "2\\sqrt{3}" passed. Left as they
    are: "1/4, or 25%" and "$18, or 1800 cents" count as two numbers (0), "either 18 or
    maybe 20" as one (1.0)."""
    function = BUILTIN_REWARDS[verifier]
    if verifier == "format":
        assert function(prompts=[""], completions=[completion]) == [expected]
    else:
        assert function(prompts=[""], completions=[completion], answer=[gold]) == [expected]


def test_kwargs_passed_on_to_a_strict_function_name_the_offered_keyword() -> None:
    # a function that passes its **kwargs on to one without them got thinking_opened (new,
    # gspo's own) and raised a TypeError: the line says where it came from and the fix
    def strict(completions: list, answer: list, completion_ids: list | None = None) -> list:
        return [float(a in c) for c, a in zip(completions, answer, strict=True)]

    def forwarding(prompts: list, completions: list, **kwargs: Any) -> list:
        return strict(completions, **kwargs)

    rewards = RewardFunctions.from_specs([forwarding])
    columns = {"answer": ["5"], "thinking_opened": [False]}
    with pytest.raises(RewardError, match=r"kwargs\.pop\('thinking_opened', None\)"):
        rewards(["p"], ["5"], columns)
    del columns["thinking_opened"]  # (as a function that names its keywords is called)
    assert rewards(["p"], ["5"], columns).rewards == [1.0]


def test_an_error_without_a_message_is_its_type_alone():
    """A message-less exception read "raised TimeoutError:  (at ...)"."""
    from gspo.plugins import raised

    try:
        raise TimeoutError()
    except TimeoutError as e:
        line = raised(e)
    assert line.startswith("TimeoutError (at ")
    assert line.endswith("GSPO_DEBUG=1 shows the traceback)")
    assert raised(ValueError("bad  value\nhere")).startswith("ValueError: bad value here (")
