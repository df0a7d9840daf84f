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
# (not when it is a binary minus such as "5-3"), plain fractions "3/4" and LaTeX \frac{3}{4}
# (and \frac34).
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER = re.compile(
    rf"(?P<sign>(?<![\w)\]}}])[-−])?"
    rf"(?:\\[dt]?frac\s*\{{\s*(?P<fn>-?{_UNSIGNED})\s*\}}\s*\{{\s*(?P<fd>-?{_UNSIGNED})\s*\}}"
    r"|\\[dt]?frac\s*(?P<sn>\d)\s*(?P<sd>\d)"  # \frac12: one digit each, as LaTeX reads it
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
    elif m.group("sn") is not None:
        num, den = float(m.group("sn")), float(m.group("sd"))
    else:
        num = _to_float(m.group("n"))
        den = _to_float(m.group("d")) if m.group("d") is not None else 1.0
    if den == 0.0:
        return None
    value = sign * num / den
    return value if math.isfinite(value) else None


def parse_number(text: str) -> float | None:
    """Parse ``text`` as a single number, or return None.

    Accepts ints, decimals, negatives (and a leading ``+``), thousands separators
    (``"1,234"``), exponents, fractions (``"3/4"``, ``"\\frac{3}{4}"``), and ignores
    ``$``, ``%``, whitespace, LaTeX spacing and ``\\(``/``\\)`` delimiters and a trailing
    period. ``"18 apples"`` is not a number.
    """
    s = _LATEX_NOISE.sub("", text)
    s = "".join(s.split()).rstrip(".")
    s = s[1:] if s.startswith("+") and s[1:2].isdigit() else s  # ("+5", as a CSV may say)
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


def cell_text(value: Any) -> str | None:
    """A data cell as text; None when there is none (None, NaN). A whole float is written
    as an integer: a CSV column with one blank cell is read as floats (``58.0``), which
    no completion ``58`` would equal."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def answer_text(completion: Any) -> str:
    """The part of a completion that holds its answer: after the last ``</think>`` (a
    reasoning model's thinking is not its answer), and before a ``<think>`` opened and
    not closed (cut off while thinking: nothing of it is an answer)."""
    text = completion_text(completion)
    _, closed, tail = text.rpartition("</think>")
    answer = tail if closed else text
    return answer.split("<think>", 1)[0]  # (a think block opened again and not closed)


def _gold_text(answer: Any) -> str:
    s = cell_text(answer) or ""
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
