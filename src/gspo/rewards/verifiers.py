"""The built-in reward functions (:data:`BUILTIN_REWARDS`), by spec name.

``exact_match``, ``numeric_match``, ``math`` (math-verify, imported lazily), ``format``,
``code`` (the sandbox of :mod:`gspo.rewards.sandbox`, imported lazily) and
``environment`` (a multi-turn environment's own reward).
"""

from __future__ import annotations

import decimal
import functools
import inspect
import math
import re
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gspo.plugins import awaited, missing_arguments
from gspo.rewards.contract import RewardError, RewardFunction
from gspo.rewards.parsing import (
    _ANSWER_COLON_WELL_FORMED,
    PARENTHESISED_UNIT,
    _answer_tag_contents,
    _boxed_contents,
    _gold_number,
    _gold_text,
    _hashes_line,
    _hedged,
    _predicted_number,
    cell_text,
    same_number,
)
from gspo.rewards.thinking import THINKING_OPENED, aligned_prompts, answer_text

MATH_VERIFY_TIMEOUT_S = 5
"""Per-parse / per-comparison timeout given to math-verify when it can use one (see math_reward)."""


def _require_answer(name: str, answer: Sequence[Any] | None, n: int) -> Sequence[Any]:
    if answer is None:
        raise RewardError(f"built-in reward {name!r} needs a dataset column named 'answer'")
    if isinstance(answer, str) or len(answer) != n:
        count = "a string" if isinstance(answer, str) else f"{len(answer)} values"
        raise RewardError(
            f"built-in reward {name!r}: column 'answer' has {count} for {n} completions"
        )
    return answer


def any_of_answers(function: RewardFunction) -> RewardFunction:
    """``function``, a built-in scored against the ``answer`` column, where an answer may
    also be a list of answers any of which is right (TriviaQA's aliases): the best score
    over them, None where none scores (an empty list). It was scored against the list's
    repr (``"['2']"``), which nothing equals."""

    @functools.wraps(function)
    def scored(
        prompts: Sequence[Any], completions: Sequence[Any], answer: Any = None, **columns: Any
    ) -> list[float | None]:
        if (
            answer is None
            or isinstance(answer, str)
            or not any(isinstance(gold, (list, tuple)) for gold in answer)
        ):
            return function(prompts=prompts, completions=completions, answer=answer, **columns)
        n = len(completions)
        of = [i for i, gold in enumerate(answer) for _ in _golds(gold)]  # row of each gold

        def spread(values: Any) -> Any:  # (a column not aligned with the rows: as it is)
            aligned = isinstance(values, (list, tuple)) and len(values) == n
            return [values[i] for i in of] if aligned else values

        flat = function(
            prompts=spread(prompts),
            completions=[completions[i] for i in of],
            answer=[g for gold in answer for g in _golds(gold)],
            **{key: spread(values) for key, values in columns.items()},
        )
        best: list[float | None] = [None] * n
        for i, value in zip(of, flat, strict=True):
            if value is not None and (best[i] is None or value > best[i]):
                best[i] = value
        return best

    return scored


def _answer_texts(
    prompts: Sequence[Any], completions: Sequence[Any], columns: dict[str, Any]
) -> list[str]:
    """Each completion's :func:`~gspo.rewards.thinking.answer_text`, read after its prompt
    (one that opened the thinking, or whose chat template did, ``thinking_opened``: nothing
    before ``</think>`` is an answer); prompts not aligned with the completions (a direct
    call's) are not read."""
    opened = aligned_prompts(prompts, len(completions), columns.get(THINKING_OPENED))
    return [answer_text(c, p) for c, p in zip(completions, opened, strict=True)]


def _golds(gold: Any) -> list[Any]:
    return list(gold) if isinstance(gold, (list, tuple)) else [gold]


def exact_match_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where the stripped completion text equals ``str(answer).strip()``, else 0.0.

    Called TRL-style as ``f(prompts=..., completions=..., answer=..., **other_columns)``;
    completions are strings or conversational ``[{"role": "assistant", "content": ...}]``.
    The text compared is what follows a reasoning model's ``</think>``
    (:func:`~gspo.rewards.thinking.answer_text`). A sample whose answer is None or blank
    gets None (not applicable).
    """
    answer = _require_answer("exact_match", answer, len(completions))
    out: list[float | None] = []
    for completion, gold in zip(_answer_texts(prompts, completions, kwargs), answer, strict=True):
        text = cell_text(gold)
        out.append(None if text is None else float(completion.strip() == text))
    return out


def numeric_match_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where the completion's final number equals the gold answer numerically, else 0.0.

    Called TRL-style as ``f(prompts=..., completions=..., answer=..., **other_columns)``;
    completions are strings or conversational ``[{"role": "assistant", "content": ...}]``.

    The predicted answer is the number in the last ``\\boxed{...}``, else in the last
    ``<answer>...</answer>``, else on the first line starting with ``####``, else on the
    line after the last "answer is"/"Answer:" (its first sentence), else the last number in
    the text (ints, decimals, negatives, ``1,234``, ``3/4``, ``\\frac{3}{4}``, ``1 1/2``).
    Of an equation, the part that holds the answer (``\\boxed{x = 5}``, ``10 + 8 = 18``;
    docs/training.md has the rules). The gold answer may be a
    number, a numeric string, a ``\\boxed{}`` or a GSM8K solution ending in
    ``#### <answer>``. Numbers are compared exactly, as fractions (``0.5`` is ``1/2``;
    ``1000001`` is not ``1,000,000``); a gold answer that is a float written out
    (``0.30000000000000004``) within a relative 1e-9 (or as the same float32). An answer
    that names two different numbers as alternatives or a range (``18 or 20``, ``18-20``),
    a list inside a box (``\\boxed{1, 2}``) or an expression (``2\\sqrt{3}``) gets 0.0. A
    sample whose gold answer is not numeric gets None (not applicable).
    """
    answer = _require_answer("numeric_match", answer, len(completions))
    out: list[float | None] = []
    for completion, gold in zip(_answer_texts(prompts, completions, kwargs), answer, strict=True):
        gold_value = _gold_number(gold)
        if gold_value is None:
            out.append(None)
            continue
        predicted = _predicted_number(completion)
        out.append(float(same_number(predicted, gold_value)))
    return out


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion states a well-formed final answer, else 0.0.

    Called TRL-style as ``f(prompts=..., completions=..., **columns)`` (no column needed);
    completions are strings or conversational ``[{"role": "assistant", "content": ...}]``.
    Well-formed means any of: a brace-balanced non-empty ``\\boxed{...}``, a non-empty
    ``<answer>...</answer>``, or "Answer:" followed by some text (case-insensitive), after
    a reasoning model's ``</think>`` (a box inside the thinking is no answer).
    """
    out: list[float | None] = []
    for text in _answer_texts(prompts, completions, kwargs):
        ok = (
            any(c.strip() for c in _boxed_contents(text))
            or any(c.strip() for c in _answer_tag_contents(text))
            or _ANSWER_COLON_WELL_FORMED.search(text) is not None
        )
        out.append(float(ok))
    return out


@functools.cache
def _accepts_keyword(func: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


def _math_verify_timeout() -> int | None:
    """The timeout math-verify may use here, or None to disable its timeouts.

    math-verify implements timeouts with ``signal.alarm`` (POSIX) which only works in the main
    thread (elsewhere it raises ValueError) and cancels any alarm the caller had pending; on
    other platforms it forks a process per call. So timeouts are used only in the main thread
    of a POSIX process with no pending ``ITIMER_REAL`` alarm.
    """
    if not hasattr(signal, "SIGALRM") or not hasattr(signal, "getitimer"):
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        return None
    return MATH_VERIFY_TIMEOUT_S


_E_NOTATION = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d{1,2}")  # (|e| < 100)
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")
_DIGIT_SPACE = re.compile(r"(?<=\d)\\,(?=\d)")
_FBOX = re.compile(r"\\fbox(?=\s*\{)")


def _plain_math(text: str) -> str:
    """``1\\,000`` as ``1000``, ``\\$5`` as ``5`` and ``\\fbox{7}`` as ``\\boxed{7}``:
    math-verify reads the first as 0 (a gold answer of 1\\,000 then took a completion 0 as
    right) and misses the others (``format`` and ``numeric_match`` read an ``\\fbox``)."""
    return _FBOX.sub(r"\\boxed", _DIGIT_SPACE.sub("", text).replace("\\$", ""))


def _math_gold_text(answer: Any) -> str:
    # (ASDiv's "9 (apples)": math-verify reads no number in it)
    s = PARENTHESISED_UNIT.sub("", _plain_math(_gold_text(answer)))
    if _E_NOTATION.fullmatch(s.strip()):  # (1e3, as a CSV may say: math-verify misreads it)
        s = format(decimal.Decimal(s.strip()), "f")
    # (an escaped \$, as in MATH's "\$18.90", is a dollar sign, not a delimiter)
    if not (_MATH_DELIMITER.search(s) or any(m in s for m in ("\\boxed", "\\(", "\\["))):
        s = f"${s}$"
    return s


def math_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where math-verify judges the completion equivalent to the gold answer, else 0.0.

    Called TRL-style as ``f(prompts=..., completions=..., answer=..., **other_columns)``;
    completions are strings or conversational ``[{"role": "assistant", "content": ...}]``.

    The gold answer is parsed with ``math_verify.parse`` (wrapped in ``$...$`` when it has no
    ``$``/``\\boxed``/``\\(``/``\\[``; a GSM8K ``#### x`` suffix is used if present) and the
    completion with default extraction; when the completion has ``<answer>...</answer>`` but no
    ``\\boxed``, only the last tag's content is parsed (math-verify ignores the tags), and
    with neither, only the number on its first line that is GSM8K's ``#### 72`` if it has
    one (math-verify read the text's last number: a base model's next question's).
    ``math_verify.verify`` compares them symbolically (``\\frac{1}{2}`` equals ``0.5``).
    Both are read after :func:`_plain_math`: a thin space between digits (``1\\,000``,
    which math-verify reads as 0) and an escaped dollar sign are dropped first, and an
    ``\\fbox`` is read as a ``\\boxed``.
    Errors and timeouts inside math-verify give 0.0, and so does a completion that answers
    a one-number gold answer with several numbers as alternatives or a list (``18 or 20``,
    which math-verify reads as 18). A sample whose answer is None, or whose gold answer
    math-verify cannot parse, gets None.
    """
    answer = _require_answer("math", answer, len(completions))
    from math_verify import parse, verify

    try:
        from math_verify.errors import TimeoutException
    except ImportError:  # pragma: no cover - older math-verify
        TimeoutException = Exception

    timeout = _math_verify_timeout()
    parse_kwargs: dict[str, Any] = {}
    verify_kwargs: dict[str, Any] = {}
    if _accepts_keyword(parse, "parsing_timeout"):
        parse_kwargs["parsing_timeout"] = timeout
    if _accepts_keyword(parse, "raise_on_error"):  # (else a timeout logs the whole text)
        parse_kwargs["raise_on_error"] = True
    if _accepts_keyword(verify, "timeout_seconds"):
        verify_kwargs["timeout_seconds"] = timeout

    gold_cache: dict[str, list[Any]] = {}
    out: list[float | None] = []
    for completion, gold in zip(_answer_texts(prompts, completions, kwargs), answer, strict=True):
        if gold is None:
            out.append(None)
            continue
        gold_str = _math_gold_text(gold)
        if gold_str not in gold_cache:
            try:
                gold_cache[gold_str] = parse(gold_str, **parse_kwargs)
            except (Exception, TimeoutException):
                gold_cache[gold_str] = []
        gold_parsed = gold_cache[gold_str]
        if not gold_parsed:
            out.append(None)
            continue
        text = _plain_math(completion)
        if _gold_number(gold) is not None and _hedged(text):  # (math-verify took "18 or 20"
            out.append(0.0)  # as 18, the first; one number asked, several given)
            continue
        if "\\boxed" not in text:
            tags = _answer_tag_contents(text)
            hashes = _hashes_line(text)  # (GSM8K's "#### 72": its first, as numeric_match)
            if tags or hashes is not None:
                text = tags[-1] if tags else str(hashes)
        try:
            predicted = parse(text, **parse_kwargs)
            ok = bool(predicted) and bool(verify(gold_parsed, predicted, **verify_kwargs))
        except (Exception, TimeoutException):
            ok = False
        out.append(float(ok))
    return out


@dataclass(frozen=True)
class CodeReward:
    """The built-in ``code`` reward: each completion's Python program run on its row's
    ``tests`` in the sandbox (:func:`gspo.rewards.sandbox.code_scores`), scored as
    ``scoring`` (``reward.code_scoring``) says: ``fraction``, the fraction of the tests it
    passes; ``all``, 1 where it passes every one, else 0. :data:`code_reward` is the one
    ``reward.functions=[code]`` names. Named ``code`` whatever its scoring (its metric
    ``train/reward/code``); a module-level class, so that ``reward.workers`` processes get
    it by pickle. The sandbox is imported when it first scores."""

    scoring: str = "fraction"
    __name__ = "code"
    required_columns = ("tests",)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        tests: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        from gspo.rewards.sandbox import code_scores

        opened = kwargs.get(THINKING_OPENED)
        return code_scores(prompts, completions, tests, self.scoring, opened)


code_reward = CodeReward()
"""The built-in ``code`` reward (``reward.functions=[code]``, or passed from Python): the
fraction of its row's tests each completion's program passes (:class:`CodeReward`)."""


def environment_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    environments: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """The environment's own reward: ``get_reward()`` of each episode's environment.

    For multi-turn runs (``rollout.environment``); None for an environment without
    ``get_reward`` or one that returns None (left out of the weighted sum).
    """
    if environments is None:
        raise ValueError("the 'environment' reward needs rollout.environment (no environments)")
    out: list[float | None] = []
    for env in environments:
        get = getattr(env, "get_reward", None)
        if callable(get) and (needed := missing_arguments(get, [])):  # (gspo's line: named)
            raise ValueError(
                f"the environment's get_reward() ({_class_and_file(env)}) takes "
                f"{', '.join(needed)}, and is called with no arguments: read what it needs "
                "from the environment itself (self)"
            )
        value = awaited(get()) if callable(get) else None  # (async def: awaited)
        try:  # a number, as a reward function's values (a string "1" is not one)
            if isinstance(value, (str, bytes)):
                raise TypeError
            out.append(None if value is None else float(value))
        except (TypeError, ValueError):
            raise ValueError(
                f"the environment's get_reward() ({_class_and_file(env)}) returned "
                f"{value!r:.80} ({type(value).__name__}), not a number or None"
            ) from None
        if not math.isfinite(out[-1] if out[-1] is not None else 0.0):
            raise ValueError(
                f"the environment's get_reward() ({_class_and_file(env)}) returned "
                f"{out[-1]}, not a finite number"
            )
    return out


def _class_and_file(env: Any) -> str:
    """An environment's class and the file that defines it (a line of gspo's is no help)."""
    try:
        where = inspect.getsourcefile(type(env)) or ""
    except (TypeError, OSError):  # (a built-in class; one defined in python -c)
        where = ""
    return f"{type(env).__qualname__}{', ' + where if where else ''}"


# the data columns a built-in cannot do without (a run checks them before it starts)
for _function, _columns in (
    (exact_match_reward, ("answer",)),
    (numeric_match_reward, ("answer",)),
    (math_reward, ("answer",)),
):
    _function.required_columns = _columns  # type: ignore[attr-defined]
# (math-verify's time limits work in a main thread only: see gspo.rewards.runner.Runner)
math_reward.main_thread_spec = "math"  # type: ignore[attr-defined]

BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "code": code_reward,
    "environment": environment_reward,
    "exact_match": any_of_answers(exact_match_reward),
    "numeric_match": any_of_answers(numeric_match_reward),
    "math": any_of_answers(math_reward),
    "format": format_reward,
}
"""Built-in reward functions by spec name."""
