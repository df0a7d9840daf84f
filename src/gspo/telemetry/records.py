"""Metric records: JSON-safe values, reading ``metrics.jsonl``, value tests and formatting.

A record is one line of ``output_dir/metrics.jsonl``: ``{"step": ..., "time": ...,
**metrics}``. :func:`json_safe` makes the values of a record writable as strict JSON,
:func:`read_metrics` reads the file back (tolerating a line cut short by a crash). The
small value helpers here (``_is_number``, ``_finite_scalars``, ``_fmt``) are shared by
the other telemetry modules.

Imports only the standard library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: File name of the jsonl metrics log inside a run's output directory.
METRICS_FILE = "metrics.jsonl"


def _safe_value(value: Any) -> Any:
    """One value made JSON-safe; see :func:`json_safe`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):  # includes numpy.float64, a float subclass
        return float(value) if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _safe_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_safe_value(v) for v in value]
    # torch tensors and numpy scalars/arrays: .tolist() gives a Python scalar for a
    # 0-d / one-element value and nested lists otherwise, without importing either.
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        detach = getattr(value, "detach", None)
        if callable(detach):
            value = detach()
        return _safe_value(value.tolist())
    try:
        return _safe_value(float(value))  # Decimal, Fraction, ...
    except (TypeError, ValueError):
        return str(value)


def json_safe(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``metrics`` that :func:`json.dumps` accepts with ``allow_nan=False``.

    NaN and ±inf become ``None`` (JSON ``null``); torch tensors and numpy scalars become
    Python ``float``/``int``/``bool`` (multi-element ones become lists); nested mappings
    and sequences are converted recursively; anything else is tried as ``float`` and
    otherwise stored as its ``str``. Keys are converted to ``str``.
    """
    return {str(k): _safe_value(v) for k, v in metrics.items()}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a json-safe record (bools as 0/1)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or (_is_number(value) and math.isfinite(value)):
            out[key] = float(value)
    return out


def _metrics_file(path: str | Path) -> Path:
    path = Path(path)
    return path / METRICS_FILE if path.is_dir() else path


def _parse_lines(text: str, source: Path) -> list[dict]:
    lines = text.splitlines()
    # Index of the last non-blank line: only that one may be a crash's truncated write.
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:
                break  # truncated final line (crash mid-write): ignore it
            raise ValueError(f"{source}:{i + 1}: corrupt metrics line: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{source}:{i + 1}: expected a JSON object, got {record!r}")
        records.append(record)
    return records


def read_metrics(path: str | Path) -> list[dict]:
    """Read a ``metrics.jsonl`` file (or the one inside a run directory).

    Returns one dict per line, in file order. A truncated last line (the process died
    while writing it) is skipped; a corrupt line anywhere else raises ``ValueError``.
    ``null`` values (non-finite numbers at write time) come back as ``None``.
    """
    path = _metrics_file(path)
    return _parse_lines(path.read_text(encoding="utf-8"), path)


def _fmt(value: Any) -> str:
    """A metric value as the summary table and the progress line show it."""
    if value is None:
        return "–"
    if isinstance(value, bool) or not _is_number(value):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-4):
        return f"{value:.3g}"
    return f"{value:.4g}"
