"""Reading completions: their text, their final answer, the numbers in them.

:func:`completion_text` (either TRL form of a completion), :func:`extract_final_answer`
(``\\boxed{}``, ``<answer>`` or "answer is"), :func:`parse_number` and
:func:`reference_answer` (a reference solution's final answer), and the helpers the
built-in verifiers share.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from itertools import pairwise
from typing import Any


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
_ANSWER_PHRASE = re.compile(r"\banswer\s*(?:is\b\s*:?|:)", re.IGNORECASE)
_ANSWER_COLON_WELL_FORMED = re.compile(r"\banswer\s*:\s*\S", re.IGNORECASE)


def _closing_braces(text: str) -> dict[int, int]:
    """The index of each brace that is closed -> the index of its closing brace, in one
    pass (escaped braces such as ``\\{`` skipped)."""
    opened: list[int] = []
    closing: dict[int, int] = {}
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            opened.append(i)
        elif ch == "}" and opened:
            closing[opened.pop()] = i
        i += 1
    return closing


def _boxed_contents(text: str) -> list[str]:
    """Contents of every well-formed (brace-balanced) ``\\boxed{...}``, in order of appearance.
    (Linear in the text: many boxes left open were a scan each to its end.)"""
    starts = list(_BOXED_START.finditer(text))
    if not starts:
        return []
    closing = _closing_braces(text)
    return [text[m.end() : closing[m.end() - 1]] for m in starts if m.end() - 1 in closing]


def _answer_tag_contents(text: str) -> list[str]:
    """Contents of every ``<answer>...</answer>`` (case-insensitive), in order; linear in
    the text (a regex scanned to the end from each tag left open)."""
    found = []
    lower = text.lower()
    at = lower.find("<answer>")
    while at >= 0:
        end = lower.find("</answer>", at + 8)
        if end < 0:
            break
        found.append(text[at + 8 : end])
        at = lower.find("<answer>", end + 9)
    return found


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
# (not when it is a binary minus such as "5-3"), plain fractions "3/4", mixed numbers
# "1 1/2" and LaTeX \frac{3}{4} (and \frac34). Each is read exactly, as a Fraction.
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(
    rf"(?P<sign>(?<![\w)\]}}])[-−])?"
    rf"(?:\\[dt]?frac\s*\{{\s*(?P<fn>-?{_UNSIGNED})\s*\}}\s*\{{\s*(?P<fd>-?{_UNSIGNED})\s*\}}"
    r"|\\[dt]?frac\s*(?P<sn>\d)\s*(?P<sd>\d)"  # \frac12: one digit each, as LaTeX reads it
    r"|(?P<w>\d+)[ \t]+(?P<wn>\d+)\s*/\s*(?P<wd>\d+)(?![\d.,/])"  # 1 1/2
    rf"|(?P<n>{_UNSIGNED})(?:\s*/\s*(?P<d>{_UNSIGNED}))?)"
)
_LATEX_NOISE = re.compile(r"\\[,;:! ]|\\left|\\right|\\\(|\\\)|\\\[|\\\]|\{,\}|\\?\$|\\?%")
_SPACE = re.compile(r"\s+")
_LEADING_LHS = re.compile(r"^\s*\\?[A-Za-z][\w{}^\\]*\s*=")
#: What stands between two numbers given as alternatives or a list ("18 or 20", "1, 2",
#: "3 \text{ and } 4"): such an answer names no one number.
_LIST_SEPARATOR = re.compile(
    r"\s*(?:[,;]\s*(?:(?:or|and)\b)?|\b(?:or|and)\b|\\text\s*\{\s*(?:or|and|,)\s*\}"
    r"|\\(?:q?quad|lor|vee)\b)\s*",
    re.IGNORECASE,
)
#: Exponents past this are no answer (10**4300 is the longest int Python writes as text;
#: a completion's 1e999999999 would take minutes to expand).
_MAX_EXPONENT = 4300


def _exact(s: str) -> Fraction | None:
    """An unsigned number's text (``_UNSIGNED``) as an exact Fraction; None past the
    limits of a sensible answer (4300 digits, an exponent past 4300)."""
    s = s.replace(",", "").replace("−", "-")
    exponent = s.lower().partition("e")[2]
    try:
        if exponent and abs(int(exponent)) > _MAX_EXPONENT:
            return None
        return Fraction(s)
    except ValueError:  # (more digits than Python turns into an int)
        return None


def _match_value(m: re.Match[str]) -> Fraction | None:
    if m.group("fn") is not None:
        num, den = _exact(m.group("fn")), _exact(m.group("fd"))
    elif m.group("sn") is not None:
        num, den = Fraction(int(m.group("sn"))), Fraction(int(m.group("sd")))
    elif m.group("w") is not None:
        whole, num, den = (_exact(m.group(k)) for k in ("w", "wn", "wd"))
        if whole is None or num is None or den is None or not num < den:
            return None  # (1 3/2 is no mixed number)
        num += whole * den
    else:
        num = _exact(m.group("n"))
        den = _exact(m.group("d")) if m.group("d") is not None else Fraction(1)
    if num is None or den is None or den == 0:
        return None
    return -num / den if m.group("sign") else num / den


def exact_number(text: str) -> Fraction | None:
    """``text`` as a single number, exactly (a Fraction), or None: what
    :func:`parse_number` reads, without rounding to a float."""
    s = _LATEX_NOISE.sub("", text)
    # whitespace goes, but not between two numbers' digits ("1 1/2" is not 11/2)
    s = _SPACE.sub(lambda m: " " if _between_digits(m) else "", s).rstrip(".")
    s = s[1:] if s.startswith("+") and s[1:2].isdigit() else s  # ("+5", as a CSV may say)
    m = _NUMBER.fullmatch(s)
    return _match_value(m) if m else None


def _between_digits(m: re.Match[str]) -> bool:
    s, a, b = m.string, m.start(), m.end()
    return a > 0 and b < len(s) and s[a - 1] in "0123456789,." and s[b].isdigit()


def parse_number(text: str) -> float | None:
    """Parse ``text`` as a single number, or return None.

    Accepts ints, decimals, negatives (and a leading ``+``), thousands separators
    (``"1,234"``), exponents, fractions (``"3/4"``, ``"\\frac{3}{4}"``), mixed numbers
    (``"1 1/2"``), and ignores ``$``, ``%``, whitespace, LaTeX spacing and ``\\(``/``\\)``
    delimiters and a trailing period. ``"18 apples"`` and ``"1, 2"`` are not a number.
    (:func:`exact_number` gives it without rounding.)
    """
    value = exact_number(text)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return None


class _Hedged(Exception):
    """An answer that names several numbers as alternatives or a list ("18 or 20")."""


def _numbers_in(text: str) -> list[tuple[Fraction, re.Match[str]]]:
    found = ((_match_value(m), m) for m in _NUMBER.finditer(text))
    return [(v, m) for v, m in found if v is not None]


def _check_not_hedged(text: str, found: list[tuple[Fraction, re.Match[str]]]) -> None:
    for (_, a), (_, b) in pairwise(found):
        if _LIST_SEPARATOR.fullmatch(text[a.end() : b.start()]):
            raise _Hedged


def _segment_number(segment: str, *, after_last_equals: bool) -> Fraction | None:
    value = exact_number(segment)
    if value is not None:
        return value
    if after_last_equals:
        segment = segment.rsplit("=", 1)[-1]
        value = exact_number(segment)
        if value is not None:
            return value
    else:
        segment = _LEADING_LHS.sub("", segment)
    found = _numbers_in(segment)
    _check_not_hedged(segment, found)
    return found[0][0] if found else None


def _answer_number(text: str) -> Fraction | None:
    """The number ``text`` gives as its answer, or None; :class:`_Hedged` where it gives
    several as alternatives."""
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
    _check_not_hedged(text, found[-2:])
    return found[-1][0] if found else None


def _predicted_number(text: str) -> Fraction | None:
    """The number a completion gives as its answer (:func:`numeric_match_reward`); None
    when it gives none, or several as alternatives."""
    try:
        return _answer_number(text)
    except _Hedged:
        return None


def _hedged(text: str) -> bool:
    """``text`` answers with several numbers as alternatives or a list (``18 or 20``)."""
    try:
        _answer_number(text)
    except _Hedged:
        return True
    return False


def cell_text(value: Any) -> str | None:
    """A data cell as text; None when there is none (None, NaN, blank). A whole float is written
    as an integer: a CSV column with one blank cell is read as floats (``58.0``), which
    no completion ``58`` would equal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip() or None  # (a blank cell: no answer, not the empty one)


def answer_text(completion: Any) -> str:
    """The part of a completion that holds its answer: after the last ``</think>`` (a
    reasoning model's thinking is not its answer), and before a ``<think>`` opened and
    not closed (cut off while thinking: nothing of it is an answer)."""
    text = completion_text(completion)
    _, closed, tail = text.rpartition("</think>")
    answer = tail if closed else text
    return answer.split("<think>", 1)[0]  # (a think block opened again and not closed)


#: GSM8K's solutions end with a line "#### <answer>" (a Markdown heading "#### Step 1"
#: with more after it is no answer).
_GSM8K_ANSWER = re.compile(r"####[ \t]*([^\n]*?)\s*\Z")


def _gold_text(answer: Any) -> str:
    s = cell_text(answer) or ""
    found = _GSM8K_ANSWER.search(s)
    return found.group(1) if found else s


def reference_answer(solution: Any) -> str:
    """The final answer of a reference solution, as text.

    GSM8K's ``... #### 72`` gives ``72``; a MATH solution's last ``\\boxed{...}`` gives
    its content (``\\frac{1}{2}``); anything else is returned stripped. ``data.answer_column``
    fills the ``answer`` column with this.
    """
    s = _gold_text(solution)
    boxed = _boxed_contents(s)
    return boxed[-1].strip() if boxed else s


def _gold_number(answer: Any) -> Fraction | float | None:
    """A gold answer as a number: exact (a Fraction) from text or an int; a float as it
    is (a binary float is compared at its own precision: 1/3 is the float 0.333...)."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Integral):
        return Fraction(int(answer))
    if isinstance(answer, numbers.Real):
        value = float(answer)
        return value if math.isfinite(value) else None
    return exact_number(reference_answer(answer))


def same_number(predicted: Fraction | None, gold: Fraction | float) -> bool:
    """``predicted`` is ``gold``: exactly, or for a float gold the float nearest to it."""
    if predicted is None:
        return False
    if isinstance(gold, float):
        try:
            return float(predicted) == gold
        except OverflowError:
            return False
    return predicted == gold
