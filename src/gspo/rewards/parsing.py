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
import struct
from collections.abc import Mapping, Sequence
from fractions import Fraction
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
_ANSWER_PHRASE = re.compile(r"\banswer[*_]*\s*(?:is\b[*_]*\s*:?|:)", re.IGNORECASE)
_ANSWER_COLON_WELL_FORMED = re.compile(r"\banswer[*_]*\s*:\s*\S", re.IGNORECASE)
#: GSM8K's own marker, as a model trained on its solutions writes it: "#### 72".
#: (A number, perhaps a unit, and nothing more: "#### 1. Understand it" is a heading.)
_HASHES = re.compile(
    r"^[ \t]*####[ \t]*([-−]?\$?[-−]?\d[\d,]*(?:\.\d+)?(?:[ \t]*[A-Za-z%]+)?)[ \t.]*$",
    re.MULTILINE,
)


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


def _boxes(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every well-formed (brace-balanced) ``\\boxed{...}``'s content, in
    order of appearance. (Linear in the text: many boxes left open were a scan each to its
    end.)"""
    starts = list(_BOXED_START.finditer(text))
    if not starts:
        return []
    closing = _closing_braces(text)
    return [(m.end(), closing[m.end() - 1]) for m in starts if m.end() - 1 in closing]


def _boxed_contents(text: str) -> list[str]:
    """Contents of every well-formed (brace-balanced) ``\\boxed{...}``, in order of appearance."""
    return [text[a:b] for a, b in _boxes(text)]


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


def _hashes_line(text: str) -> str | None:
    """The rest of the first line that starts with GSM8K's ``####``, or None (the first:
    a base model goes on to write more questions, with answers of their own)."""
    found = _HASHES.search(text)
    return found.group(1) if found else None


def extract_final_answer(text: str) -> str | None:
    """The final-answer part of ``text``, or None if it has no explicit final-answer marker.

    In order of preference: the content of the last well-formed ``\\boxed{...}``; the content
    of the last ``<answer>...</answer>``; the rest of the first line that starts with
    GSM8K's ``####``; the rest of the line after the last "answer is" / "Answer:"
    (case-insensitive, Markdown emphasis allowed: ``**Answer:**``).
    """
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1]
    tags = _answer_tag_contents(text)
    if tags:
        return tags[-1]
    hashes = _hashes_line(text)
    return hashes if hashes is not None else _answer_phrase_line(text)


# Numbers: ints, decimals, thousands separators ("1,234"), exponents, a leading minus sign
# (not when it is a binary minus such as "5-3"), plain fractions "3/4", mixed numbers
# "1 1/2" and "3\frac{1}{2}", LaTeX \frac{3}{4} (and \frac34) and "6.02 \times 10^{23}".
# Each is read exactly, as a Fraction.
_UNSIGNED = r"(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?"
_FRAC = r"\\[dt]?frac\s*"
_NUMBER = re.compile(
    rf"(?P<sign>(?<![\w)\]}}])[-−])?"
    rf"(?:{_FRAC}\{{\s*(?P<fn>-?{_UNSIGNED})\s*\}}\s*\{{\s*(?P<fd>-?{_UNSIGNED})\s*\}}"
    rf"|{_FRAC}(?P<sn>\d)\s*(?P<sd>\d)"  # \frac12: one digit each, as LaTeX reads it
    rf"|(?P<lw>\d+)\s*{_FRAC}\{{\s*(?P<ln>\d+)\s*\}}\s*\{{\s*(?P<ld>\d+)\s*\}}"  # 3\frac{1}{2}
    rf"|(?P<m>{_UNSIGNED})\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*(?:\{{\s*(?P<e>[-+−]?\d+)\s*\}}"
    r"|(?P<e1>\d))"  # 6.02 \times 10^{23}
    r"|(?P<w>\d+)[ \t]+(?P<wn>\d+)\s*/\s*(?P<wd>\d+)(?![\d/]|[.,]\d)"  # 1 1/2
    rf"|(?P<n>{_UNSIGNED})(?:\s*/\s*(?P<d>{_UNSIGNED}))?)"
)
_LATEX_NOISE = re.compile(
    r"\\[,;:! ]|\\left|\\right|\\\(|\\\)|\\\[|\\\]|\{,\}|\\?\$|\\?%"
    r"|\^\s*\{?\s*\\circ\s*\}?|°"  # (45^\circ: degrees, no power)
)
_SPACE = re.compile(r"\s+")
#: Thousands grouped by spaces ("1 000 000", also no-break and thin spaces): one number
#: where it is the whole answer (in running text two numbers may stand so).
_SPACED_THOUSANDS = re.compile(r"[-−]?\d{1,3}(?: \d{3})+(?:\.\d+)?")
#: A number that is the first term of an expression, not an answer: 2\sqrt{3}, 3\pi, 2^5.
_EXPRESSION_AFTER = re.compile(
    r"\s*(?:\\sqrt|\\pi|\\times|\\cdot|\^|\*\s*[\d(]|×|·|\+\s*[\d(\\]|\\log|\\ln)"
)
#: Markdown emphasis around an answer (**18**, *18*): no multiplication.
_EMPHASIS = re.compile(r"\*\*+|(?<![\w)])\*(?=[-\d$\\])|(?<=[\d.%$}])\*(?!\s*[\d(\\])")
#: What stands between two numbers given as alternatives ("18 or 20", "18 (or 20)",
#: "x = 2 or x = 3")...
_OR = r"[,;]?\s*\(?\s*(?:or(?:\s+[A-Za-z]\s*=)?|\\text\s*\{\s*or\s*\}|\\lor|\\vee)"
#: ... or as a range ("18 to 20", "18-20", "18 \pm 2"), said where the range ends the
#: answer (at most a word after it: "18-20 apples"; "18 - 2 more than ...", "3.14 to 2
#: decimal places" are no range): such an answer names no one number.
_RANGE = r"[,;]?\s*(?:to|\\text\s*\{\s*to\s*\}|\\pm|±|[-–—])"
_RANGE_END = re.compile(r"\s*(?:[A-Za-z]+\.?)?\s*[.,;:!)]*\s*")
_ALTERNATIVES = re.compile(rf"\s*(?:{_OR})\s*", re.IGNORECASE)
_RANGES = re.compile(rf"\s*(?:{_RANGE})\s*", re.IGNORECASE)
#: ... and, inside a box or answer tag (the whole answer), a list: "1, 2", "3 and 4".
_LISTED = re.compile(
    r"\s*(?:[,;]\s*(?:and\b)?|and|\\text\s*\{\s*(?:and|,)\s*\}|\\q?quad)\s*",
    re.IGNORECASE,
)
_BETWEEN = re.compile(r"\bbetween\s*\$?\s*$", re.IGNORECASE)
#: A parenthesised aside after an answer ("49 (since 2 x 3 = 6)"), not "(or 20)".
_ASIDE = re.compile(r"\((?!\s*or\b)[^()]*\)")
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
    den: Fraction | None = Fraction(1)
    if m.group("fn") is not None:
        num, den = _exact(m.group("fn")), _exact(m.group("fd"))
    elif m.group("sn") is not None:
        num, den = Fraction(int(m.group("sn"))), Fraction(int(m.group("sd")))
    elif m.group("w") is not None or m.group("lw") is not None:
        keys = ("w", "wn", "wd") if m.group("w") is not None else ("lw", "ln", "ld")
        whole, num, den = (_exact(m.group(k)) for k in keys)
        if whole is None or num is None or den is None or not num < den:
            return None  # (1 3/2 is no mixed number)
        num += whole * den
    elif m.group("m") is not None:
        power = (m.group("e") or m.group("e1")).replace("−", "-")
        num = _exact(f"{m.group('m')}e{int(power)}")
    else:
        num = _exact(m.group("n"))
        if m.group("d") is not None:
            den = _exact(m.group("d"))
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
    if _SPACED_THOUSANDS.fullmatch(s):
        s = s.replace(" ", "")
    m = _NUMBER.fullmatch(s)
    return _match_value(m) if m else None


def _between_digits(m: re.Match[str]) -> bool:
    s, a, b = m.string, m.start(), m.end()
    return a > 0 and b < len(s) and s[a - 1] in "0123456789,." and s[b].isdigit()


def parse_number(text: str) -> float | None:
    """Parse ``text`` as a single number, or return None.

    Accepts ints, decimals, negatives (and a leading ``+``), thousands separators
    (``"1,234"``, ``"1 234"``), exponents (``"6.02 \\times 10^{23}"`` too), fractions
    (``"3/4"``, ``"\\frac{3}{4}"``), mixed numbers (``"1 1/2"``, ``"1\\frac{1}{2}"``),
    and ignores ``$``, ``%``, whitespace, LaTeX spacing and ``\\(``/``\\)`` delimiters and
    a trailing period. ``"18 apples"`` and ``"1, 2"`` are not a number.
    (:func:`exact_number` gives it without rounding.)
    """
    value = exact_number(text)
    if value is None:
        return None
    try:
        return float(value)
    except OverflowError:
        return None


class _NoAnswer(Exception):
    """An answer that names no one number: several as alternatives, a range, a list in
    a box ("18 or 20", "18-20", "\\boxed{1, 2}")."""


class _Expression(_NoAnswer):
    """An answer that is an expression (``2\\sqrt{3}``, ``2+3``), not a number."""


def _first_numbers(text: str) -> list[tuple[Fraction, re.Match[str]]]:
    """The first two numbers of ``text``, with their matches."""
    out = []
    for m in _NUMBER.finditer(text):
        value = _match_value(m)
        if value is not None:
            out.append((value, m))
            if len(out) == 2:
                break
    return out


def _last_numbers(text: str) -> list[tuple[Fraction, re.Match[str]]]:
    """The last two numbers of ``text`` (each read only once found among the last)."""
    matches: list[re.Match[str]] = []
    for m in _NUMBER.finditer(text):
        matches = [*matches[-3:], m]
    found = [(v, m) for v, m in ((_match_value(m), m) for m in matches) if v is not None]
    return found[-2:]


def _check_one(
    text: str, found: list[tuple[Fraction, re.Match[str]]], *, listed: bool, ranges: bool = True
) -> None:
    """:class:`_NoAnswer` where the first two of ``found`` (numbers in ``text``) are
    joined as alternatives, a range (``ranges``: ending the text, or "between 18 and 20")
    or, ``listed``, a list, and differ ("1/2 or 0.5" is one number, said twice)."""
    if len(found) > 1:
        (first, a), (second, b) = found[0], found[1]
        between = text[a.end() : b.start()]
        joined = _ALTERNATIVES.fullmatch(between) or (listed and _LISTED.fullmatch(between))
        if ranges and _RANGES.fullmatch(between) and _RANGE_END.fullmatch(text, b.end()):
            joined = True
        if ranges and re.fullmatch(r"\s*and\s*", between) and _BETWEEN.search(text, 0, a.start()):
            joined = True
        if joined and first != second:
            raise _NoAnswer


def _first_sentence(line: str) -> str:
    """``line`` up to the first full stop ("The answer is 41. Check: 6*7=42." -> its 41)."""
    return re.split(r"\.(?=\s|$)", line, maxsplit=1)[0]


def _equation_answer(segment: str) -> str:
    """Of ``a = b = c``, the part that holds the answer: ``a`` where it is a number
    (``18 = 20 - 2``), ``b`` where ``a`` is a variable (``x = 49, y = 3``), else the last
    (``10 + 8 = 18``)."""
    parts = segment.split("=")
    if len(parts) == 1:
        return segment
    if exact_number(parts[0]) is not None:
        return parts[0]
    if not any(c.isdigit() for c in parts[0]):
        if len(parts) > 2 and re.search(r"\bor\b", parts[1], re.IGNORECASE):
            raise _NoAnswer  # x = 2 or x = 3
        return parts[1]
    return parts[-1]


def _segment_number(segment: str, *, whole: bool) -> Fraction | None:
    """The number ``segment`` answers with: a box's or answer tag's content (``whole``:
    the answer and nothing else, so a list in it names no one number), or the line after
    "answer is" (its first sentence, asides in parentheses left out: what follows may be
    comments with numbers of their own). Of an equation, the part that holds the answer
    (:func:`_equation_answer`)."""
    segment = _EMPHASIS.sub("", segment)
    if not whole:
        segment = _ASIDE.sub("", _first_sentence(segment))
    value = exact_number(segment)
    if value is not None:
        return value
    segment = _LATEX_NOISE.sub("", _equation_answer(segment))  # ("$18 or $20": 18 or 20)
    if re.match(r"\s*(?:\\pm|±)", segment):
        raise _NoAnswer  # (\pm 3: two numbers)
    value = exact_number(segment)
    if value is not None:
        return value
    found = _first_numbers(segment)
    _check_one(segment, found, listed=whole)
    if found and _EXPRESSION_AFTER.match(segment, found[0][1].end()):
        raise _Expression
    return found[0][0] if found else None


def _answer_number(text: str) -> Fraction | None:
    """The number ``text`` gives as its answer, or None; :class:`_NoAnswer` where it gives
    several as alternatives (or a range, or an expression)."""
    boxes = _boxes(text)
    if boxes:
        if len(boxes) > 1:  # \boxed{18} or \boxed{20}
            end, start = boxes[-2][1] + 1, boxes[-1][0]  # (between: "} or \\boxed{")
            between = _LATEX_NOISE.sub("", _BOXED_START.sub("", text[end:start]))
            if _ALTERNATIVES.fullmatch(between) or _RANGES.fullmatch(between):
                first, last = (_segment_number(text[x:y], whole=True) for x, y in boxes[-2:])
                if first != last:
                    raise _NoAnswer
        return _segment_number(text[slice(*boxes[-1])], whole=True)
    tags = _answer_tag_contents(text)
    if tags:
        return _segment_number(tags[-1], whole=True)
    for line in (_hashes_line(text), _answer_phrase_line(text)):
        if line is not None:
            value = _segment_number(line, whole=False)
            if value is not None:
                return value
    cleaned = _LATEX_NOISE.sub("", text)
    found = _last_numbers(cleaned)  # (no range: "rose from $20 to $25" is no hedge)
    _check_one(cleaned, found, listed=False, ranges=False)
    return found[-1][0] if found else None


def _predicted_number(text: str) -> Fraction | None:
    """The number a completion gives as its answer (:func:`numeric_match_reward`); None
    when it gives none, or several as alternatives."""
    try:
        return _answer_number(text)
    except _NoAnswer:
        return None


def _hedged(text: str) -> bool:
    """``text`` answers with several numbers as alternatives or a list (``18 or 20``); an
    expression (``2+3``) is no hedge (math-verify evaluates it)."""
    try:
        _answer_number(text)
    except _Expression:
        return False
    except _NoAnswer:
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


def has_value(value: Any) -> bool:
    """Whether a cell holds something to score against: text (:func:`cell_text`: not None,
    NaN or blank), a non-empty list of answers, or a mapping, even an empty one (which the
    built-ins read as it is: the code reward refuses ``{}`` tests)."""
    if isinstance(value, (list, tuple)):
        return bool(value)
    return cell_text(value) is not None


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


#: A gold answer's trailing unit ("9 (apples)", "10 apples", MATH's "5\text{ inches}",
#: "4\text{ m}^2"): not part of its number.
_UNIT = r"[A-Za-z][A-Za-z .'/-]*"
_LATEX_UNIT = rf"\\(?:text|mbox|textrm|mathrm)\s*\{{\s*{_UNIT}\}}(?:\s*\^\s*\{{?\s*[23]\s*\}}?)?"
_UNIT_SUFFIX = re.compile(rf"\s*(?:\({_UNIT}\)|{_UNIT}|{_LATEX_UNIT})\s*$")
#: ... in parentheses only (math-verify reads "10 apples", not "9 (apples)").
PARENTHESISED_UNIT = re.compile(rf"(?<=\S)\s*\({_UNIT}\)\s*$")
#: Significant digits from which a decimal is a binary float written out (repr(1/3) has
#: 16, a float32 cell's double 17): compared to within FLOAT_RELATIVE, not exactly.
FLOAT_DIGITS = 13
FLOAT_RELATIVE = 1e-9


def _float_written(text: str) -> bool:
    """A decimal point or an exponent, and a float's many digits (an int has neither)."""
    text = text.strip().lstrip("+-−")
    mantissa = re.split(r"[eE]", text, maxsplit=1)[0]
    digits = len(mantissa.replace(".", "").replace(",", "").lstrip("0"))
    return digits >= FLOAT_DIGITS and ("." in text or "e" in text.lower())


def _gold_number(answer: Any) -> Fraction | float | None:
    """A gold answer as a number: exact (a Fraction) from an int or a decimal as written
    (``0.1``, ``1,000``, ``3/4``); a float where it is one (a float, or a decimal written
    with a float's digits, ``0.30000000000000004``), compared within
    :data:`FLOAT_RELATIVE`; a trailing unit left out (``9 (apples)``)."""
    if answer is None or isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Integral):
        return Fraction(int(answer))
    if isinstance(answer, numbers.Real):
        value = float(answer)
        if not math.isfinite(value):
            return None
        if _float_written(repr(value)):
            return value
        answer = repr(value)  # (a short float, 8.33, as the text it is: as a CSV cell says it)
    text = reference_answer(answer)
    value = exact_number(text)
    if value is None and len(text) <= 100 and _UNIT_SUFFIX.search(text):
        text = _UNIT_SUFFIX.sub("", text, count=1)
        value = exact_number(text) if text.strip() else None
    written = _LATEX_NOISE.sub("", text).strip()
    if value is not None and _float_written(written):
        try:
            return float(value)
        except OverflowError:  # (1.234567890123e400: past a float, compared exactly)
            return value
    places = re.fullmatch(r"[-−+]?[\d,]*\.(\d{2,})", written)
    digits = len(written.replace(".", "").replace(",", "").lstrip("-−+0"))
    if value is not None and places and digits >= 3:  # (8.33, which 25/3 rounds to)
        rounded = _Rounded(value)
        rounded.places = len(places.group(1))
        return rounded
    return value


class _Rounded(Fraction):
    """A gold answer written as a decimal of ``places`` places (two or more, three or more
    significant digits): a fraction that no decimal writes out (``25/3``) matches it where
    it rounds to it (``8.33``) and is within a thousandth of it."""

    places: int


def _terminates(value: Fraction) -> bool:
    """Whether a decimal writes ``value`` out (its denominator has no prime but 2 and 5)."""
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def same_number(predicted: Fraction | None, gold: Fraction | float) -> bool:
    """``predicted`` is ``gold``: exactly (a fraction no decimal writes out, ``25/3``, is
    a rounded decimal gold, ``8.33``, where it rounds to it); for a float gold
    (:func:`_gold_number`) within :data:`FLOAT_RELATIVE` of it, or, where the gold is a
    float32 value written out as a double (a float32 column: 0.10000000149011612), the
    same float32."""
    if predicted is None:
        return False
    if isinstance(gold, _Rounded) and not _terminates(predicted):
        close = abs(predicted - gold) <= abs(gold) / 1000  # (0.01 is no 1/150)
        return close and round(predicted, gold.places) == gold
    if not isinstance(gold, float):
        return predicted == gold
    try:
        value = float(predicted)
    except OverflowError:
        return False
    if math.isclose(value, gold, rel_tol=FLOAT_RELATIVE, abs_tol=0.0):
        return True
    single = struct.unpack("f", struct.pack("f", gold))[0] if abs(gold) < 3e38 else None
    if single != gold:
        return False
    return abs(value) < 3e38 and struct.unpack("f", struct.pack("f", value))[0] == gold
