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


def scored(prompt_text: str, completions: list[str]) -> dict[str, list]:
    """A rollout's scores of chat completions whose prompt the template rendered as
    ``prompt_text`` (the row's prompt is its messages, which do not show it)."""
    import torch

    from gspo.engines.batch import RolloutBatch
    from gspo.models.builtin import build_char_tokenizer
    from gspo.rewards import RewardFunctions
    from gspo.training.rollout import Scorer
    from gspo.training.sampler import Generated

    tok = build_char_tokenizer()
    n, prompt = len(completions), tok(prompt_text)["input_ids"]
    ids = [tok(text)["input_ids"] for text in completions]
    width = max(map(len, ids))
    batch = RolloutBatch(
        prompt_ids=torch.tensor([prompt] * n), prompt_mask=torch.ones(n, len(prompt)),
        completion_ids=torch.tensor([row + [0] * (width - len(row)) for row in ids]),
        completion_mask=torch.tensor([[k < len(row) for k in range(width)] for row in ids]),
        sampler_logprobs=torch.zeros(n, width), finish_reasons=["length"] * n, group_size=n,
    )  # fmt: skip
    rewards = RewardFunctions.from_specs(["numeric_match", "code"], None)
    row = {"prompt": [{"role": "user", "content": "3+4?"}], "answer": "7", "tests": TESTS[OPENS]}
    return Scorer(tok, rewards).score([row], Generated(batch)).per_function


def test_a_chat_template_that_opens_the_thinking_leaves_no_answer_before_its_close() -> None:
    """Qwen3-Thinking's (DeepSeek-R1's) chat template ends the generation prompt with
    ``<think>\\n``: a completion cut off while thinking scored its steps (numeric_match 1.0,
    a drafted program run) where the prompt was messages, in training and in evaluation
    (one scorer), as a text prompt ending in ``<think>`` did not."""
    cut_off = ["3+4=7? Let me check", f"Draft:\n{fenced(OPENS)}\nor"]
    closed = ["3+4=7\n</think>\n\n7", f"a\n</think>\n{fenced(OPENS)}"]
    thinks = "user: 3+4?\nassistant: <think>\n"
    assert scored(thinks, cut_off) == {"numeric_match": [0.0, 0.0], "code": [0.0, 0.0]}
    assert scored(thinks, closed) == {"numeric_match": [1.0, 0.0], "code": [0.0, 1.0]}
    assert scored("user: 3+4?\nassistant: ", cut_off) == {
        "numeric_match": [1.0, 0.0], "code": [0.0, 1.0]
    }  # fmt: skip


def test_each_turn_of_an_episode_opens_in_the_thinking_the_template_opened() -> None:
    code = BUILTIN_REWARDS["code"]
    episode = [
        {"role": "assistant", "content": "plan\n</think>\ncalling the tool"},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": f"Draft:\n{fenced(OPENS)}\nbut"},  # (cut off)
    ]
    kwargs = {"prompts": [[{"role": "user", "content": "q"}]], "completions": [episode]}
    assert code(**kwargs, tests=[TESTS[OPENS]]) == [1.0]  # (not opened: the draft is read)
    assert code(**kwargs, tests=[TESTS[OPENS]], thinking_opened=[True]) == [0.0]
    episode[2]["content"] = f"more\n</think>\n{fenced(OPENS)}"
    assert code(**kwargs, tests=[TESTS[OPENS]], thinking_opened=[True]) == [1.0]


def test_tags_in_code_are_skipped_in_linear_time() -> None:
    """A completion looping on a code span with a tag (RL's repetition) took seconds: each
    tag was looked up in every span (20,000 of them: 9 s)."""
    import time

    start = time.monotonic()
    assert answer_text("`</think>` " * 20_000 + "a</think>b") == "b"
    assert answer_text("<think>a</think>" + "`<think>`" * 20_000).endswith("`<think>`")
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("name", ["math", "by_source"])
def test_thinking_opened_reaches_math_run_aside_for_reward_timeout(name: str) -> None:
    # under reward.timeout (and async rollouts) math, and by_source routing to it, run in a
    # process of their own, which got only the answer column: a completion cut off in the
    # thinking a chat template opened was scored on its thinking (1.0, not 0.0)
    from gspo.rewards.functions import RewardFunctions

    columns = {"answer": ["5"], "data_source": ["math"], "thinking_opened": [True]}
    completions = ["Let me think. Maybe the answer is \\boxed{5}"]
    for timeout in (None, 60):
        rewards = RewardFunctions.from_specs([name], timeout=timeout)
        try:
            assert rewards(["What is 2+3?"], completions, columns).rewards == [0.0], timeout
        finally:
            rewards.close()
