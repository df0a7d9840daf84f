"""A data file's rows: JSON Lines, JSON and CSV read here, values as written (``datasets``'
readers infer types: a CSV answer ``007`` became 7); Parquet, which holds its own types, by
``pyarrow``. Errors are one line naming the config key, the file and where in it. A row's
field by a dotted path (verl's ``reward_model.ground_truth``): :func:`field_of`."""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

from gspo.plugins import one_line

Row = dict[str, Any]

#: The suffixes of the data files read (:func:`read_file`).
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


def _text(path: Path, *, what: str) -> str:
    """``path`` as text: UTF-8, a byte-order mark dropped; one line naming where it is not."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(
            f"{what}: {path} is not UTF-8 text (byte {data[exc.start]:#04x} on line {line}); "
            "save it as UTF-8"
        ) from None


def _not_a_record(row: Any, where: str) -> ValueError:
    return ValueError(f"{where} is {type(row).__name__} {row!r:.60}, not an object of columns")


def _repeated(names: list[str]) -> str | None:
    """The first of ``names`` that appears twice, or None."""
    return next((name for name in names if names.count(name) > 1), None)


def _twice(where: str, column: str) -> ValueError:
    return ValueError(
        f"{where} names the column {column!r} twice; JSON readers keep one of the two "
        "silently: write it once"
    )


def _json_value(text: str) -> tuple[Any, dict[int, tuple[str, Any]]]:
    """``json.loads``, with ``NaN``/``Infinity`` (not JSON, which Python writes) as None,
    as ``datasets`` reads them: a gold answer ``Infinity`` was the text ``"inf"``; and, by
    ``id()``, each object written with a key twice (``json.loads`` keeps the last), with
    that key (and the object, alive, so that no other object takes its id): a record's
    columns are checked (:func:`_twice`), nested values kept as JSON reads them."""
    repeated: dict[int, tuple[str, Any]] = {}

    def checked(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(pairs)
        if len(value) < len(pairs):
            repeated[id(value)] = (_repeated([k for k, _ in pairs]) or "", value)
        return value

    value = json.loads(text, parse_constant=lambda _: None, object_pairs_hook=checked)
    return value, repeated


def _json_lines(text: str, path: Path, *, what: str) -> list[Row]:
    rows = []
    # (split at newlines only: str.splitlines also splits at U+2028, which a JSON string
    # may hold as it is: json.dumps(..., ensure_ascii=False) writes it so)
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row, repeated = _json_value(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what}: {path} line {number} is not JSON: {exc}") from exc
        if not isinstance(row, dict):
            raise _not_a_record(row, f"{what}: {path} line {number}")
        if id(row) in repeated:
            raise _twice(f"{what}: {path} line {number}", repeated[id(row)][0])
        rows.append(row)
    return rows


def _json(text: str, path: Path, *, what: str) -> list[Row]:
    """A ``.json`` file: an array of objects, one object of equal-length column lists, or
    JSON Lines; values as written (``"007"`` stays text)."""
    try:
        whole, repeated = _json_value(text) if text.strip() else ([], {})
    except json.JSONDecodeError as exc:
        if text.lstrip().startswith("["):  # an array, broken where it says
            raise ValueError(f"{what}: {path} is not JSON: {exc}") from None
        return _json_lines(text, path, what=what)  # (JSON Lines in a .json file)
    if id(whole) in repeated:  # (one object of column lists)
        raise _twice(f"{what}: {path}", repeated[id(whole)][0])
    if isinstance(whole, dict):
        lengths = {k: len(v) if isinstance(v, list) else -1 for k, v in whole.items()}
        if -1 in lengths.values() or not lengths:
            raise ValueError(
                f"{what}: {path} holds one object, not records: write an array of objects "
                "(or JSON Lines)"
            )
        if len(set(lengths.values())) > 1:  # (columns as lists: one list per column)
            said = ", ".join(f"{k!r} {n}" for k, n in list(lengths.items())[:6])
            raise ValueError(
                f"{what}: {path} holds one object of column lists of unequal lengths "
                f"({said}{' ...' if len(lengths) > 6 else ''}): give each column one value a row"
            )
        whole = [dict(zip(whole, row, strict=True)) for row in zip(*whole.values(), strict=True)]
    if not isinstance(whole, list):
        raise ValueError(f"{what}: {path} holds {type(whole).__name__}, not an array of objects")
    for number, row in enumerate(whole, start=1):
        if not isinstance(row, dict):
            raise _not_a_record(row, f"{what}: {path} record {number}")
        if id(row) in repeated:
            raise _twice(f"{what}: {path} record {number}", repeated[id(row)][0])
    return whole


def _csv(text: str, path: Path, *, what: str) -> list[Row]:
    """A ``.csv`` file's rows, each cell as :func:`_cell` reads it."""
    csv.field_size_limit(2**31 - 1)  # (its default, 128 KiB, refused a long cell)
    reader = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    rows = []
    try:
        # an unnamed column (a spreadsheet's trailing empty ones) is named as pandas names it
        header = [h or f"Unnamed: {i}" for i, h in enumerate(reader.fieldnames or [])]
        reader.fieldnames = header
        repeated = _repeated(header)
        if repeated is not None:
            raise ValueError(f"{what}: {path} names the column {repeated!r} twice in its header")
        for row in reader:
            if None in row:  # (the fields past the header's)
                raise ValueError(
                    f"{what}: {path} line {reader.line_num} has more fields than its header's "
                    f"{len(header)} ({', '.join(header)}); quote fields that hold commas"
                )
            rows.append({k: _cell(v) for k, v in row.items()})
    except csv.Error as exc:  # (a quote left open: the rest of the file one field)
        said = "a quote opened and never closed" if "end of data" in str(exc) else exc
        raise ValueError(
            f"{what}: {path} is not CSV after line {reader.line_num}: {said}"
        ) from None
    return rows


def _cell(text: str | None) -> Any:
    """A CSV cell: None when empty; a number where the number's own text is the cell
    (``7``, ``0.5``, ``12345678901234567``); else the text as written (``007``, ``0.50``,
    ``1e3``, ``+5``, ``12.0``), which reading it as a number would change (a gold answer
    ``007`` was 7, ``12345678901234567`` beside a blank cell ``...568``, and ``12.0`` the
    answer ``12``: a whole float is written as an integer, see ``cell_text``). ``nan``
    (``NaN``: Python's csv writes a float NaN so) is None, as JSON's ``NaN`` and Parquet's
    are read: its text was the gold answer (exact_match and math scored every completion
    against 'nan', where the same row from JSON or Parquet was left unscored)."""
    if not text or text.strip().lower().lstrip("+-") == "nan":
        return None
    for kind in (int, float):
        try:
            number = kind(text)
        except ValueError:
            continue
        exact = str(number) == text if kind is int else repr(number) == text
        whole = kind is float and math.isfinite(number) and float(number).is_integer()
        return number if exact and math.isfinite(number) and not whole else text
    return text


def read_file(path: Path, *, what: str) -> list[Row]:
    """A data file's rows. JSON Lines, JSON and CSV are read here, values as written
    (``datasets``' readers infer types: a CSV answer ``007`` became 7); Parquet, which
    holds its own types, by ``pyarrow``."""
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise ValueError(f"{what}: {path} must end in {', '.join(DATA_SUFFIXES)}")
    if suffix != ".parquet":
        reader = {".jsonl": _json_lines, ".json": _json, ".csv": _csv}[suffix]
        return reader(_text(path, what=what), path, what=what)
    import pyarrow.parquet  # (what datasets reads Parquet with)

    try:
        repeated = _repeated(pyarrow.parquet.read_schema(path).names)
        if repeated is None:
            return pyarrow.parquet.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several types for malformed files
        raise ValueError(
            f"{what}: cannot read {path}: {type(exc).__name__}: {one_line(exc, 300)}"
        ) from None
    raise ValueError(f"{what}: {path} names the column {repeated!r} twice; rename one")


def field_of(row: Row, path: str) -> Any:
    """``row``'s column ``path``, or where no column has that name a field nested in one
    by a dotted path: ``reward_model.ground_truth`` is the key ``ground_truth`` of the
    mapping in the column ``reward_model`` (verl's Parquet layout: a struct column; a CSV
    or JSON Lines file may hold it as the JSON text of an object, read as that object);
    None where a mapping on the way is None (an empty cell, as a null column's). Raises
    ``KeyError`` with the one-line reason where the path leads nowhere."""
    if path in row:
        return row[path]
    parts = path.split(".")
    if len(parts) == 1 or parts[0] not in row:
        raise KeyError(f"no column {parts[0]!r}")
    value = row[parts[0]]
    for k, part in enumerate(parts[1:], start=1):
        held = ".".join(parts[:k])
        if value is None:
            return None
        value = _json_object(value)
        if not isinstance(value, dict):
            raise KeyError(f"{held} is {type(value).__name__} {value!r:.40}, not a mapping")
        if part not in value:
            keys = ", ".join(map(str, value)) or "none"
            raise KeyError(f"{held} has no key {part!r} (its keys: {keys})")
        value = value[part]
    return value


def _json_object(value: Any) -> Any:
    """``value``, or the mapping it is the JSON text of (``'{"ground_truth": "7"}'``, as a
    CSV cell or a stringified column holds a mapping)."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, dict) else value
    return value


_WRITTEN_MESSAGES = re.compile(r"""\s*\[\s*\{\s*['"](?:role|content)['"]\s*:.*\}\s*\]\s*""", re.S)
_MESSAGE_KEY = re.compile(r"""['"](role|content)['"]\s*:""")


def written_messages(text: str) -> bool:
    """Whether ``text`` is a list of chat messages written out (a CSV cell: pandas'
    ``to_csv`` writes their repr; a string column of their JSON), not the messages: the
    whole text one bracketed list of mappings with both keys, not a prompt that opens with
    such data (``[{"role": "admin", ...}] Which users are admins?``)."""
    whole = _WRITTEN_MESSAGES.fullmatch(text)
    return bool(whole) and {"role", "content"} <= set(_MESSAGE_KEY.findall(text))


_SLICE = re.compile(r"(?P<name>[^\[\]]+)\[(?P<start>-?\d+%?)?:(?P<stop>-?\d+%?)?\]")


def source_fields(text: str) -> list[str]:
    """``SOURCE:CONFIG:SPLIT`` at its colons, a split's slice kept whole (``datasets``'
    ``test[:200]``, ``train[10%:]``; its colon split the value in four, refused)."""
    end = re.search(r"\[[^\[\]]*\]$", text)  # (not a directory's run[1]::train)
    fields = text[: end.start() if end else None].split(":")
    fields[-1] += end.group() if end else ""
    return fields


def split_slice(
    split: str | None, *, where: str
) -> tuple[str | None, tuple[str | None, str | None] | None]:
    """``train[:100]`` as ``("train", (None, "100"))``; ``(split, None)`` without a slice.
    A malformed slice is one line starting with ``where``."""
    if split is None or "[" not in split:
        return split, None
    if not (found := _SLICE.fullmatch(split)):
        raise ValueError(
            f"{where}: the split {split!r} is not SPLIT[START:STOP] (test[:200], train[10%:])"
        )
    return found["name"], (found["start"], found["stop"])


def sliced(rows: list[Row], bounds: tuple[str | None, str | None]) -> list[Row]:
    """``rows[START:STOP]``, a bound ``N%`` that share of the rows (rounded, as ``datasets``
    rounds it)."""

    def at(bound: str | None) -> int | None:
        if bound is None or not bound.endswith("%"):
            return None if bound is None else int(bound)
        return round(len(rows) * int(bound[:-1]) / 100)

    return rows[at(bounds[0]) : at(bounds[1])]
