"""Where the built-ins read a completion's answer: after its leading thinking only
(:func:`gspo.rewards.thinking.answer_text`). Until 2026-11-29 they read after the last
``</think>`` and cut at any ``<think>``: a program that printed either tag scored 0, and
so did a math answer that named ``</think>`` after it."""

from __future__ import annotations

import pytest

from gspo.rewards import BUILTIN_REWARDS
from gspo.rewards.thinking import answer_text

CLOSES = 'def tag():\n    return "</think>"'
OPENS = 'def tag():\n    return "<think>"'
TESTS = {CLOSES: 'assert tag() == "</think>"', OPENS: 'assert tag() == "<think>"'}
R1 = "<｜User｜>Write tag().<｜Assistant｜><think>\n"  # (R1's template opens the thinking)


def fenced(program: str) -> str:
    return f"```python\n{program}\n```"


@pytest.mark.parametrize("program", [CLOSES, OPENS])
def test_a_program_that_writes_a_thinking_tag_is_scored(program: str) -> None:
    code, tests = BUILTIN_REWARDS["code"], [TESTS[program]]
    answers = [
        ("q", fenced(program)),  # (no thinking)
        ("q", f"<think>I return the tag.</think>\n{fenced(program)}"),
        (R1, f"I return the tag.\n</think>\n\n{fenced(program)}"),
        ("q", f"I return the tag.\n</think>\n\n{fenced(program)}"),  # (a chat template's)
        ("q", [{"role": "assistant", "content": f"<think>a</think>{fenced(program)}"}]),
    ]
    for prompt, completion in answers:
        assert code(prompts=[prompt], completions=[completion], tests=tests) == [1.0], completion


@pytest.mark.parametrize("name", ["numeric_match", "math"])
def test_a_math_answer_that_names_a_thinking_tag_is_read(name: str) -> None:
    completions = [
        "<think>6*7</think>The answer is \\boxed{42}; models end thinking with </think>.",
        "<think>6*7</think>The answer is \\boxed{42} (`<think>` opens thinking).",
        "6*7\n</think>\n\nThe answer is \\boxed{42}; models end thinking with </think>.",
    ]
    reward = BUILTIN_REWARDS[name]
    assert reward(prompts=[R1] * 3, completions=completions, answer=["42"] * 3) == [1.0] * 3
    assert reward(prompts=["q"] * 2, completions=completions[:2], answer=["42"] * 2) == [1.0] * 2


def test_only_the_leading_thinking_is_removed() -> None:
    assert answer_text("<think>a</think>b</think>c") == "b</think>c"
    assert answer_text("  <think>a</think>b") == "b"
    assert answer_text("a</think>b</think>c") == "b</think>c"  # (a template opened it)
    assert answer_text("a</think>b", "<think>\n") == "b"
    assert answer_text("<think>a", "q") == ""  # (cut off while thinking)
    assert answer_text("a", "x<think>\n") == ""
    assert answer_text("b <think>c") == "b "  # (thinking again, cut off: kept as before)
    assert answer_text('`print("</think>")` b') == '`print("</think>")` b'
    assert answer_text('```\nx = "<think>"\n```') == '```\nx = "<think>"\n```'
