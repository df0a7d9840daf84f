"""Reward functions: built-in verifiers and loading of user reward functions.

Reward functions follow TRL's convention, so a TRL reward function works here unchanged.
A reward function is called with keyword arguments only::

    rewards = f(prompts=prompts, completions=completions, **columns)

* ``prompts``: one prompt per completion (a string, or a list of chat messages).
* ``completions``: one completion per prompt. A string when prompts are strings; when prompts
  are chat message lists, a TRL conversational completion ``[{"role": "assistant",
  "content": text}]`` (use :func:`completion_text` to get the text of either form).
* ``columns``: the dataset's other columns (e.g. ``answer``), each a list aligned with
  ``completions``.

It returns a list with one ``float`` or ``None`` per completion; ``None`` means "not
applicable to this sample" and is skipped when rewards are combined (TRL's nansum).

Functions are named by a spec string (:func:`load_reward_function`): a built-in name from
:data:`BUILTIN_REWARDS`, ``path/to/file.py:function`` or ``package.module:function``.
:class:`RewardFunctions` loads several, calls them and combines them with weights.

This module imports only the standard library; math-verify is imported lazily by the
``"math"`` verifier.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import multiprocessing
import numbers
import pickle
import re
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFunction",
    "RewardFunctions",
    "RewardResult",
    "code_reward",
    "completion_text",
    "exact_match_reward",
    "extract_final_answer",
    "format_reward",
    "load_reward_function",
    "math_reward",
    "numeric_match_reward",
    "parse_number",
    "reference_answer",
]

RewardFunction = Callable[..., Sequence[float | None]]
"""A TRL-style reward function: ``f(prompts=..., completions=..., **columns) -> list``."""

MATH_VERIFY_TIMEOUT_S = 5
"""Per-parse / per-comparison timeout given to math-verify when it can use one (see math_reward)."""

NUMERIC_REL_TOL = 1e-6
NUMERIC_ABS_TOL = 1e-12


class RewardError(ValueError):
    """A reward function could not be loaded, called, or returned an invalid result.

    Messages are one line and name the reward function (its spec) at fault.
    """


def one_line(exc: BaseException, limit: int = 500) -> str:
    """An exception's message on one line, at most ``limit`` characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def raised(exc: BaseException, limit: int = 500) -> str:
    """``Type: message (at file.py:12; GSPO_DEBUG=1 shows the traceback)``: a raising
    user function's error on one line, with the place of the frame that raised it."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"at {frames[-1].filename}:{frames[-1].lineno}; " if frames else ""
    return f"{type(exc).__name__}: {one_line(exc, limit)} ({where}GSPO_DEBUG=1 shows the traceback)"


# --------------------------------------------------------------------------------------------
# Completion text and answer extraction
# --------------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # multimodal parts: [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    raise TypeError(f"unsupported message content of type {type(content).__name__}")


def completion_text(completion: Any) -> str:
    """Return the text of a completion in either TRL form.

    ``completion`` is a string (returned as is), a single chat message ``{"role": ...,
    "content": ...}``, or a conversational completion (a list of messages, usually one
    ``{"role": "assistant", "content": text}``); for a list, the content of the last assistant
    message is returned (the last message if none has role ``"assistant"``). ``None`` and an
    empty list give ``""``. Anything else raises ``TypeError``.
    """
    if isinstance(completion, str):
        return completion
    if completion is None:
        return ""
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, Sequence):
        messages = [m for m in completion if isinstance(m, Mapping)]
        if len(messages) != len(completion):
            raise TypeError("a conversational completion must be a list of message dicts")
        if not messages:
            return ""
        assistant = [m for m in messages if m.get("role") == "assistant"]
        return _content_text((assistant or messages)[-1].get("content"))
    raise TypeError(
        f"a completion must be a string or a list of chat messages, got {type(completion).__name__}"
    )


_BOXED_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_ANSWER_PHRASE = re.compile(r"\banswer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_ANSWER_COLON_WELL_FORMED = re.compile(r"\banswer\s*:\s*\S", re.IGNORECASE)


def _balanced_group(text: str, start: int) -> str | None:
    """Content from ``start`` (just after an opening brace) to its matching close, or None."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip escaped characters such as \{ and \}
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def _boxed_contents(text: str) -> list[str]:
    """Contents of every well-formed (brace-balanced) ``\\boxed{...}``, in order of appearance."""
    found = []
    for m in _BOXED_START.finditer(text):
        content = _balanced_group(text, m.end())
        if content is not None:
            found.append(content)
    return found


def _answer_tag_contents(text: str) -> list[str]:
    return [m.group(1) for m in _ANSWER_TAG.finditer(text)]


def _answer_phrase_line(text: str) -> str | None:
    """The line following the last "answer is" / "Answer:" marker, or None."""
    last = None
    for m in _ANSWER_PHRASE.finditer(text):
        last = m
    if last is None:
        return None
    rest = text[last.end() :].lstrip()
    return rest.split("\n", 1)[0]


def extract_final_answer(text: str) -> str | None:
    """The final-answer part of ``text``, or None if it has no explicit final-answer marker.

    In order of preference: the content of the last well-formed ``\\boxed{...}``; the content
    of the last ``<answer>...</answer>``; the rest of the line after the last "answer is" /
    "Answer:" (case-insensitive).
    """
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1]
    tags = _answer_tag_contents(text)
    if tags:
        return tags[-1]
    return _answer_phrase_line(text)


# Numbers: ints, decimals, thousands separators ("1,234"), exponents, a leading minus sign
# (not when it is a binary minus such as "5-3"), plain fractions "3/4" and LaTeX \frac{3}{4}.
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(
    rf"(?P<sign>(?<![\w)\]}}])[-−])?"
    rf"(?:\\[dt]?frac\s*\{{\s*(?P<fn>-?{_UNSIGNED})\s*\}}\s*\{{\s*(?P<fd>-?{_UNSIGNED})\s*\}}"
    rf"|(?P<n>{_UNSIGNED})(?:\s*/\s*(?P<d>{_UNSIGNED}))?)"
)
_LATEX_NOISE = re.compile(r"\\[,;:! ]|\\left|\\right|\\\(|\\\)|\\\[|\\\]|\{,\}|\\?\$|\\?%")
_LEADING_LHS = re.compile(r"^\s*\\?[A-Za-z][\w{}^\\]*\s*=")


def _to_float(s: str) -> float:
    return float(s.replace(",", "").replace("−", "-"))


def _match_value(m: re.Match[str]) -> float | None:
    sign = -1.0 if m.group("sign") else 1.0
    if m.group("fn") is not None:
        num, den = _to_float(m.group("fn")), _to_float(m.group("fd"))
    else:
        num = _to_float(m.group("n"))
        den = _to_float(m.group("d")) if m.group("d") is not None else 1.0
    if den == 0.0:
        return None
    value = sign * num / den
    return value if math.isfinite(value) else None


def parse_number(text: str) -> float | None:
    """Parse ``text`` as a single number, or return None.

    Accepts ints, decimals, negatives, thousands separators (``"1,234"``), exponents, fractions
    (``"3/4"``, ``"\\frac{3}{4}"``), and ignores ``$``, ``%``, whitespace, LaTeX spacing and
    ``\\(``/``\\)`` delimiters and a trailing period. ``"18 apples"`` is not a number.
    """
    s = _LATEX_NOISE.sub("", text)
    s = "".join(s.split()).rstrip(".")
    m = _NUMBER.fullmatch(s)
    return _match_value(m) if m else None


def _numbers_in(text: str) -> list[float]:
    values = (_match_value(m) for m in _NUMBER.finditer(text))
    return [v for v in values if v is not None]


def _segment_number(segment: str, *, after_last_equals: bool) -> float | None:
    value = parse_number(segment)
    if value is not None:
        return value
    if after_last_equals:
        segment = segment.rsplit("=", 1)[-1]
        value = parse_number(segment)
        if value is not None:
            return value
    else:
        segment = _LEADING_LHS.sub("", segment)
    found = _numbers_in(segment)
    return found[0] if found else None


def _predicted_number(text: str) -> float | None:
    boxed = _boxed_contents(text)
    if boxed:
        return _segment_number(boxed[-1], after_last_equals=True)
    tags = _answer_tag_contents(text)
    if tags:
        return _segment_number(tags[-1], after_last_equals=True)
    line = _answer_phrase_line(text)
    if line is not None:
        value = _segment_number(line, after_last_equals=False)
        if value is not None:
            return value
    found = _numbers_in(text)
    return found[-1] if found else None


def _gold_text(answer: Any) -> str:
    s = str(answer).strip()
    if "####" in s:  # GSM8K-style solutions end with "#### <answer>"
        s = s.rsplit("####", 1)[1].strip()
    return s


def reference_answer(solution: Any) -> str:
    """The final answer of a reference solution, as text.

    GSM8K's ``... #### 72`` gives ``72``; a MATH solution's last ``\\boxed{...}`` gives
    its content (``\\frac{1}{2}``); anything else is returned stripped. ``data.answer_column``
    fills the ``answer`` column with this.
    """
    s = _gold_text(solution)
    boxed = _boxed_contents(s)
    return boxed[-1].strip() if boxed else s


def _gold_number(answer: Any) -> float | None:
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Real):
        value = float(answer)
        return value if math.isfinite(value) else None
    return parse_number(reference_answer(answer))


# --------------------------------------------------------------------------------------------
# Built-in verifiers
# --------------------------------------------------------------------------------------------


def _require_answer(name: str, answer: Sequence[Any] | None, n: int) -> Sequence[Any]:
    if answer is None:
        raise RewardError(f"built-in reward {name!r} needs a dataset column named 'answer'")
    if isinstance(answer, str) or len(answer) != n:
        count = "a string" if isinstance(answer, str) else f"{len(answer)} values"
        raise RewardError(
            f"built-in reward {name!r}: column 'answer' has {count} for {n} completions"
        )
    return answer


def exact_match_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 where the stripped completion text equals ``str(answer).strip()``, else 0.0.

    Called TRL-style as ``f(prompts=..., completions=..., answer=..., **other_columns)``;
    completions are strings or conversational ``[{"role": "assistant", "content": ...}]``.
    A sample whose answer is None gets None (not applicable).
    """
    answer = _require_answer("exact_match", answer, len(completions))
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            out.append(None)
        else:
            out.append(float(completion_text(completion).strip() == str(gold).strip()))
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
    ``<answer>...</answer>``, else on the line after the last "answer is"/"Answer:", else the
    last number in the text (ints, decimals, negatives, ``1,234``, ``3/4``, ``\\frac{3}{4}``).
    Inside a box or answer tag the part after the last ``=`` is used (``\\boxed{x = 5}``).
    The gold answer may be a number, a numeric string, a ``\\boxed{}`` or a GSM8K solution
    ending in ``#### <answer>``. Numbers match within a relative tolerance of 1e-6.
    A sample whose gold answer is not numeric gets None (not applicable).
    """
    answer = _require_answer("numeric_match", answer, len(completions))
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        gold_value = _gold_number(gold)
        if gold_value is None:
            out.append(None)
            continue
        predicted = _predicted_number(completion_text(completion))
        ok = predicted is not None and math.isclose(
            predicted, gold_value, rel_tol=NUMERIC_REL_TOL, abs_tol=NUMERIC_ABS_TOL
        )
        out.append(float(ok))
    return out


def format_reward(
    prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any
) -> list[float | None]:
    """1.0 where the completion states a well-formed final answer, else 0.0.

    Called TRL-style as ``f(prompts=..., completions=..., **columns)`` (no column needed);
    completions are strings or conversational ``[{"role": "assistant", "content": ...}]``.
    Well-formed means any of: a brace-balanced non-empty ``\\boxed{...}``, a non-empty
    ``<answer>...</answer>``, or "Answer:" followed by some text (case-insensitive).
    """
    out: list[float | None] = []
    for completion in completions:
        text = completion_text(completion)
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


def _math_gold_text(answer: Any) -> str:
    s = _gold_text(answer)
    if not any(marker in s for marker in ("$", "\\boxed", "\\(", "\\[")):
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
    ``\\boxed``, only the last tag's content is parsed (math-verify ignores the tags).
    ``math_verify.verify`` compares them symbolically (``\\frac{1}{2}`` equals ``0.5``).
    Errors and timeouts inside math-verify give 0.0. A sample whose answer is None, or whose
    gold answer math-verify cannot parse, gets None.
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
    if _accepts_keyword(verify, "timeout_seconds"):
        verify_kwargs["timeout_seconds"] = timeout

    gold_cache: dict[str, list[Any]] = {}
    out: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
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
        text = completion_text(completion)
        if "\\boxed" not in text:
            tags = _answer_tag_contents(text)
            if tags:
                text = tags[-1]
        try:
            predicted = parse(text, **parse_kwargs)
            ok = bool(predicted) and bool(verify(gold_parsed, predicted, **verify_kwargs))
        except (Exception, TimeoutException):
            ok = False
        out.append(float(ok))
    return out


def code_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    tests: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Pass fraction of the completion's Python program on the row's ``tests`` (sandboxed).

    See :func:`gspo.sandbox.code_reward`: the program is the last fenced Python block, each
    runs in its own isolated, resource-limited process.
    """
    from gspo.sandbox import code_reward as run

    return run(prompts=prompts, completions=completions, tests=tests, **kwargs)


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
        value = get() if callable(get) else None
        out.append(None if value is None else float(value))
    return out


BUILTIN_REWARDS: dict[str, RewardFunction] = {
    "code": code_reward,
    "environment": environment_reward,
    "exact_match": exact_match_reward,
    "numeric_match": numeric_match_reward,
    "math": math_reward,
    "format": format_reward,
}
"""Built-in reward functions by spec name."""


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _builtin_names() -> str:
    return ", ".join(sorted(BUILTIN_REWARDS))


def _import_file(path_text: str, spec: str, kind: str, error: type[Exception]) -> Any:
    path = Path(path_text).expanduser()
    resolved = path if path.is_absolute() else Path.cwd() / path
    if not resolved.is_file():
        raise error(f"{kind} file not found: {path_text!r} (spec {spec!r}, looked for {resolved})")
    resolved = resolved.resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_name = f"_gspo_{kind.split()[0]}_{stem}_{digest}"
    import_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if import_spec is None or import_spec.loader is None:
        raise error(f"cannot import {kind} file {str(resolved)!r} (spec {spec!r})")
    module = importlib.util.module_from_spec(import_spec)
    sys.modules[module_name] = module  # dataclasses, pickling etc. look the module up here
    directory = str(resolved.parent)
    sys.path.insert(0, directory)  # so the file can import its sibling modules
    try:
        import_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise error(
            f"importing {kind} file {path_text!r} (spec {spec!r}) failed: "
            f"{type(e).__name__}: {one_line(e)}"
        ) from e
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)
    return module


def _import_module(module_name: str, spec: str, kind: str, error: type[Exception]) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        raise error(
            f"importing module {module_name!r} for {kind} {spec!r} failed: "
            f"{type(e).__name__}: {one_line(e)}"
        ) from e


def load_object(spec: str, kind: str, error: type[Exception], expected: str) -> Any:
    """The object a ``source:attribute`` spec names (``attribute`` may be dotted).

    ``source`` is a ``.py`` file (relative to the current directory, or absolute; imported
    under a unique module name with its directory on ``sys.path`` while it is imported) or
    a module name. ``kind`` names what is loaded in messages ("reward function"), ``error``
    is the exception raised, ``expected`` describes the accepted forms for a malformed spec.
    The object must be callable.
    """

    def malformed(why: str) -> Exception:
        return error(f"invalid {kind} spec {spec!r}: {why}; expected {expected}")

    if ":" not in spec:
        raise malformed("not a built-in name and no ':name' part")
    source, _, attr_path = spec.rpartition(":")
    source, attr_path = source.strip(), attr_path.strip()
    if not source:
        raise malformed("missing the file or module before ':'")
    if not attr_path or not all(part.isidentifier() for part in attr_path.split(".")):
        raise malformed(f"{attr_path!r} after ':' is not a Python name")
    if source.endswith(".py") or "/" in source or "\\" in source:
        module = _import_file(source, spec, kind, error)
        where = f"file {source!r}"
    else:
        if not all(part.isidentifier() for part in source.split(".")):
            raise malformed(f"{source!r} is neither a .py file nor a module name")
        module = _import_module(source, spec, kind, error)
        where = f"module {source!r}"
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            available = sorted(
                name
                for name, value in vars(module).items()
                if callable(value) and not name.startswith("_")
                and getattr(value, "__module__", None) == module.__name__
            )  # fmt: skip
            hint = f" (defined there: {', '.join(available[:20])})" if available else ""
            raise error(f"{kind} {spec!r}: {where} has no attribute {attr_path!r}{hint}") from None
    if not callable(obj):
        raise error(
            f"{kind} {spec!r}: {attr_path!r} in {where} is not callable "
            f"(it is a {type(obj).__name__})"
        )
    return obj


def load_reward_function(spec: str) -> RewardFunction:
    """Load a reward function from its spec.

    ``spec`` is a built-in name (see :data:`BUILTIN_REWARDS`), ``path/to/file.py:function``
    (relative to the current directory, or absolute; the file is imported as a module under a
    unique name, with its directory on ``sys.path`` while it is imported), or
    ``package.module:function`` (``function`` may be a dotted attribute path).

    The returned function is called TRL-style:
    ``f(prompts=prompts, completions=completions, **columns) -> list[float | None]``.

    Raises :class:`RewardError` (one line, naming the spec) if the spec is malformed, the file
    does not exist, the import fails, the attribute is missing or is not callable.
    """
    if not isinstance(spec, str):
        raise RewardError(
            f"a reward function spec must be a string, got {type(spec).__name__}: {spec!r}"
        )
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
    if close and ":" not in spec:
        raise RewardError(
            f"invalid reward function spec {spec!r}: not a built-in name "
            f"({_builtin_names()}); did you mean {close[0]!r}?"
        )
    expected = (
        f"a built-in name ({_builtin_names()}), 'path/to/file.py:function' or "
        "'package.module:function'"
    )
    return load_object(spec, "reward function", RewardError, expected)


# --------------------------------------------------------------------------------------------
# Calling and combining
# --------------------------------------------------------------------------------------------


@dataclass
class RewardResult:
    """Rewards for one batch of completions.

    ``rewards[i]`` is the combined reward of completion ``i`` (the weighted sum over reward
    functions, skipping None; 0.0 if every function returned None); ``per_function[name][i]``
    is what function ``name`` returned for it (as float, or None).
    """

    rewards: list[float]
    per_function: dict[str, list[float | None]]


def _check_value(name: str, index: int, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, numbers.Real) or hasattr(type(value), "__float__")
    ):
        raise RewardError(
            f"reward function {name!r} returned a non-numeric value at index {index}: "
            f"{one_line(ValueError(repr(value)), 80)}"
        )
    try:
        converted = float(value)
    except (TypeError, ValueError) as e:
        raise RewardError(
            f"reward function {name!r} returned a non-numeric value at index {index}: "
            f"{type(value).__name__} ({type(e).__name__}: {one_line(e, 120)})"
        ) from e
    if not math.isfinite(converted):
        raise RewardError(
            f"reward function {name!r} returned a non-finite value at index {index}: "
            f"{converted} (use None for 'not applicable')"
        )
    return converted


def _spec_name(spec: str | RewardFunction) -> str:
    if isinstance(spec, str):
        return spec.strip()
    return getattr(spec, "__name__", None) or type(spec).__name__


# --------------------------------------------------------------------------------------------
# Calling reward functions: in this process, or in worker processes; with a deadline
# --------------------------------------------------------------------------------------------


def _call_one(
    name: str, function: RewardFunction, prompts: Any, completions: Any, columns: Any
) -> Any:
    try:
        return function(prompts=prompts, completions=completions, **columns)
    except Exception as e:
        raise RewardError(f"reward function {name!r} raised {raised(e)}") from e


@functools.cache
def _worker_function(spec: str) -> RewardFunction:
    return load_reward_function(spec)


def _worker_call(name: str, spec: str | bytes, prompts: Any, completions: Any, columns: Any) -> Any:
    """In a worker process: load the function by its spec (or unpickle it) and call it."""
    function = pickle.loads(spec) if isinstance(spec, bytes) else _worker_function(spec)
    try:
        return _call_one(name, function, prompts, completions, columns)
    except RewardError as e:  # the cause may not pickle; its message is what matters
        raise RewardError(str(e)) from None


def _shippable(name: str, spec: str | RewardFunction) -> str | bytes:
    """What a worker needs to get the function: its spec string, or the pickled callable."""
    if isinstance(spec, str):
        return spec.strip()
    try:
        return pickle.dumps(spec)
    except Exception as e:
        raise RewardError(
            f"reward function {name!r} cannot be sent to reward.workers processes "
            f"({type(e).__name__}: {one_line(e, 120)}); name it by a spec string "
            f"(path/to/file.py:function) or set reward.workers=0"
        ) from None


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    size, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        stop = start + size + (k < extra)
        if stop > start:
            bounds.append((start, stop))
        start = stop
    return bounds


#: Longest wait for a batch's other tasks after one of them failed (see ``Runner._settle``).
SETTLE_SECONDS = 10.0


class Runner:
    """How reward functions are called on a batch.

    ``workers=0`` calls them in this process; ``workers=N`` splits each batch into N
    contiguous chunks scored in parallel by N worker processes (started once, with
    ``spawn``; each loads the functions from their specs). ``timeout`` (seconds for the
    whole batch) turns a function that hangs into a :class:`RewardError` naming it; with
    workers the hung processes are killed, without them the call is abandoned in a daemon
    thread (the run stops anyway).
    """

    def __init__(self, workers: int = 0, timeout: float | None = None):
        if workers < 0:
            raise RewardError(f"reward.workers={workers}: must be >= 0")
        if timeout is not None and not timeout > 0:
            raise RewardError(f"reward.timeout={timeout}: must be > 0 seconds")
        self.workers = workers
        self.timeout = timeout
        self._pool: Any = None
        self._finalizer: Any = None
        self._busy = False  # some task sent to the workers may not have finished

    def start(self) -> Any:
        """Start the worker processes (once) and wait until each is up; the pool."""
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = context.Pool(self.workers)
            self._finalizer = weakref.finalize(self, self._pool.terminate)
            self._pool.map(_worker_function, ["format"] * self.workers)  # all started
        return self._pool

    def close(self) -> None:
        """Stop the worker processes. Idle workers are told to exit and waited for, not
        killed: a worker killed just after sending a result, before it releases the result
        queue's lock, would leave the pool's shutdown waiting on that lock forever. Workers
        that may still be busy (a function past ``timeout``) are killed."""
        if self._pool is not None:
            if self._busy:
                self._finalizer()  # Pool.terminate
            else:
                self._finalizer.detach()
                self._pool.close()
                self._pool.join()
        self._pool = self._finalizer = None
        self._busy = False

    def _late(self, name: str) -> RewardError:
        return RewardError(
            f"reward function {name!r} did not finish within reward.timeout={self.timeout:g} s "
            f"for one rollout batch; the run stops here (its last checkpoint is intact)"
        )

    def run(
        self,
        names: Sequence[str],
        functions: Sequence[RewardFunction],
        specs: Sequence[str | RewardFunction],
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]],
    ) -> list[Any]:
        """Each function's raw output on the whole batch, in order."""
        if self.workers > 0:
            shipped = [_shippable(n, s) for n, s in zip(names, specs, strict=True)]
            pool = self.start()  # start-up is not part of the deadline
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if self.workers == 0:
            return [
                self._in_thread(name, f, prompts, completions, columns, deadline)
                for name, f in zip(names, functions, strict=True)
            ]
        bounds = _chunks(len(completions), self.workers)
        pending = [
            [
                pool.apply_async(
                    _worker_call,
                    (
                        name,
                        spec,
                        prompts[a:b],
                        completions[a:b],
                        {k: v[a:b] for k, v in columns.items()},
                    ),
                )
                for a, b in bounds
            ]
            for name, spec in zip(names, shipped, strict=True)
        ]
        tasks = [part for parts in pending for part in parts]
        self._busy = True
        outputs = []
        for name, parts in zip(names, pending, strict=True):
            merged: list[Any] = []
            for part in parts:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    raw = part.get(timeout=left)
                except multiprocessing.TimeoutError:
                    self.close()  # kills the hung workers; a new pool is made if needed
                    raise self._late(name) from None
                except BaseException:
                    self._settle(tasks, deadline)
                    raise
                if not isinstance(raw, (list, tuple)):
                    merged = raw  # reported by the caller, like an in-process result
                    break
                merged.extend(raw)
            outputs.append(merged)
        self._settle(tasks, deadline)
        return outputs

    def _settle(self, parts: list[Any], deadline: float | None) -> None:
        """Wait for the batch's tasks (after one failed, the others may still run; until
        ``deadline``, and at most ``SETTLE_SECONDS``), so that the workers are idle when
        the pool is closed; a task still running leaves the pool marked busy."""
        limit = time.monotonic() + SETTLE_SECONDS
        if deadline is not None:
            limit = min(limit, deadline)
        for part in parts:
            part.wait(max(0.0, limit - time.monotonic()))
        self._busy = not all(part.ready() for part in parts)

    def _in_thread(
        self,
        name: str,
        function: RewardFunction,
        prompts: Any,
        completions: Any,
        columns: Any,
        deadline: float | None,
    ) -> Any:
        if deadline is None:
            return _call_one(name, function, prompts, completions, columns)
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["out"] = _call_one(name, function, prompts, completions, columns)
            except BaseException as e:  # re-raised in the caller's thread
                box["err"] = e

        thread = threading.Thread(target=target, name=f"reward {name}", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            raise self._late(name)
        if "err" in box:
            raise box["err"]
        return box["out"]


@dataclass
class RewardFunctions:
    """Several reward functions with weights, called together on a batch.

    Build with :meth:`from_specs`. ``names`` are the specs as given (a repeated spec gets a
    ``#2``, ``#3``... suffix), aligned with ``functions`` and ``weights``.
    """

    names: list[str]
    functions: list[RewardFunction]
    weights: list[float]
    specs: list[str | RewardFunction] = field(default_factory=list)
    runner: Runner = field(default_factory=lambda: Runner())

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[str | RewardFunction],
        weights: Sequence[float] | None = None,
        *,
        workers: int = 0,
        timeout: float | None = None,
    ) -> RewardFunctions:
        """Load the reward functions named by ``specs`` (see :func:`load_reward_function`).

        A spec may also be a callable, used as is and named by its ``__name__``. ``weights``
        None means 1.0 each; otherwise it needs one finite number per spec (``reward.weights``).
        ``workers`` and ``timeout`` choose how they are called (:class:`Runner`).
        """
        if isinstance(specs, str):
            specs = [specs]
        specs = list(specs)
        if not specs:
            raise RewardError("no reward functions given: at least one reward spec is needed")
        if weights is None:
            weight_list = [1.0] * len(specs)
        else:
            if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
                raise RewardError(
                    f"reward.weights must be a list of numbers, got {type(weights).__name__}"
                )
            if len(weights) != len(specs):
                raise RewardError(
                    f"reward.weights has {len(weights)} values but there are {len(specs)} "
                    f"reward functions ({', '.join(_spec_name(s) for s in specs)})"
                )
            weight_list = []
            for i, w in enumerate(weights):
                if isinstance(w, bool) or not isinstance(w, numbers.Real):
                    raise RewardError(f"reward.weights[{i}] is not a number: {w!r}")
                if not math.isfinite(float(w)):
                    raise RewardError(f"reward.weights[{i}] is not finite: {w!r}")
                weight_list.append(float(w))

        names: list[str] = []
        functions: list[RewardFunction] = []
        seen: dict[str, int] = {}
        for spec in specs:
            if callable(spec) and not isinstance(spec, str):
                function: RewardFunction = spec
            else:
                function = load_reward_function(spec)
            base = _spec_name(spec)
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}#{seen[base]}"
            while name in names:  # e.g. specs "f" "f" "f#2"
                seen[base] += 1
                name = f"{base}#{seen[base]}"
            names.append(name)
            functions.append(function)
        runner = Runner(workers=workers, timeout=timeout)
        return cls(names, functions, weight_list, specs=specs, runner=runner)

    def __len__(self) -> int:
        return len(self.functions)

    def close(self) -> None:
        """Stop the worker processes, if any (also done when the object is collected)."""
        self.runner.close()

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Score ``completions`` with every function and combine the results.

        Each function is called as ``f(prompts=prompts, completions=completions, **columns)``
        where every column is a list aligned with ``completions``. The combined reward of a
        completion is ``sum(weight * value)`` over the functions whose value is not None (0.0
        if all are None). Raises :class:`RewardError`, naming the function, if one raises,
        returns something other than a list/tuple of the right length, or returns a value
        that is neither None nor a finite number.
        """
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"got {len(prompts)} prompts for {n} completions")
        columns = dict(columns or {})
        for key, values in columns.items():
            if key in ("prompts", "completions"):
                raise RewardError(
                    f"dataset column {key!r} clashes with the reward function argument "
                    f"of the same name; rename the column"
                )
            try:
                count = len(values)
            except TypeError:
                raise RewardError(
                    f"dataset column {key!r} must be a list aligned with completions, "
                    f"got {type(values).__name__}"
                ) from None
            if isinstance(values, (str, bytes)) or count != n:
                raise RewardError(f"dataset column {key!r} has {count} values for {n} completions")

        per_function: dict[str, list[float | None]] = {}
        specs = self.specs or self.functions
        outputs = self.runner.run(self.names, self.functions, specs, prompts, completions, columns)
        for name, raw in zip(self.names, outputs, strict=True):
            if not isinstance(raw, (list, tuple)):
                raise RewardError(
                    f"reward function {name!r} returned {type(raw).__name__}, "
                    f"expected a list of float or None"
                )
            if len(raw) != n:
                raise RewardError(
                    f"reward function {name!r} returned {len(raw)} values for {n} completions"
                )
            per_function[name] = [_check_value(name, i, v) for i, v in enumerate(raw)]

        rewards = []
        for i in range(n):
            total = 0.0
            for name, weight in zip(self.names, self.weights, strict=True):
                value = per_function[name][i]
                if value is not None:
                    total += weight * value
            rewards.append(total)
        return RewardResult(rewards=rewards, per_function=per_function)


def overlong_penalty(
    lengths: Sequence[int], max_tokens: int, buffer: int, penalty: float
) -> list[float]:
    """DAPO's soft overlong punishment, one value per response (0 or negative).

    Responses up to ``max_tokens - buffer`` tokens get 0; inside the buffer the penalty
    grows linearly to ``-penalty`` at ``max_tokens`` (a response cut off at the limit):
    ``-penalty * (length - (max_tokens - buffer)) / buffer``.
    """
    if buffer < 1 or buffer > max_tokens:
        raise ValueError(f"buffer must be in [1, {max_tokens}]; got {buffer}")
    start = max_tokens - buffer
    return [-penalty * min(max(n - start, 0), buffer) / buffer for n in lengths]
