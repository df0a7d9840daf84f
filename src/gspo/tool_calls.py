"""Tool calls as models write them, and what a tool's result becomes.

:func:`parse_tool_calls` reads the Hermes/Qwen format (``<tool_call>{json}</tool_call>``)
out of a model's turn; :func:`tool_result_text` turns what a tool returned into the text
of its ``tool`` message. Used by :mod:`gspo.environments`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_JSON, _SPACE = json.JSONDecoder(), re.compile(r"\s*")


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set (and ``name`` may be empty) when it did not parse."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _blocks(text: str) -> Iterator[tuple[str | None, Any]]:
    """Each ``<tool_call>`` block of ``text``: ``(body, None)``, its text up to the first
    ``</tool_call>`` (None: there is none), or ``("", value)`` where a JSON value starts the
    block and ``</tool_call>`` follows it (a ``</tool_call>`` inside one of its strings,
    code or a quoted transcript, cut such a call there: "not valid JSON")."""
    at = 0
    while (start := text.find(_OPEN, at)) != -1:
        inner = start + len(_OPEN)
        try:
            value, end = _JSON.raw_decode(text, _SPACE.match(text, inner).end())
            end = _SPACE.match(text, end).end()
        except (ValueError, RecursionError):  # (read again below, its error said there)
            end = -1
        if end >= 0 and text.startswith(_CLOSE, end):
            at = end + len(_CLOSE)
            yield "", value
            continue
        close = text.find(_CLOSE, inner)
        if close == -1:
            yield None, None
            return
        at = close + len(_CLOSE)
        yield text[inner:close].strip(), None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order (Hermes/Qwen format):
    JSON ``{"name": str, "arguments": {...}}`` (``arguments`` may be a JSON string of an
    object, as some models write it, or null or empty: none); one unterminated, not JSON
    or of another shape comes back with ``error`` set."""
    calls = []
    for body, data in _blocks(text):
        if body is None:
            calls.append(ToolCall("", error="unterminated <tool_call> (no </tool_call>)"))
            continue
        if body:
            try:
                data = json.loads(body)
            except json.JSONDecodeError as e:
                calls.append(ToolCall("", error=f"tool call is not valid JSON ({e.msg})"))
                continue
            except (ValueError, RecursionError):  # an integer past 4300 digits, deep nesting
                calls.append(ToolCall("", error="tool call JSON too large or too deeply nested"))
                continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall("", error='tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else None
            except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
                arguments = []  # (not an object)
        if arguments is None:  # (null, "": a call without arguments)
            arguments = {}
        if not isinstance(arguments, dict):
            calls.append(ToolCall(data["name"], error="tool call arguments must be an object"))
            continue
        calls.append(ToolCall(data["name"], arguments))
    return calls


def tool_result_text(value: Any) -> str:
    """A tool's return value as the text of its ``tool`` message."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        kind = type(value)
        if kind.__str__ is object.__str__ and kind.__repr__ is object.__repr__:
            # "<Result object at 0x7f...>": an address, other in every run
            raise NoText(
                f"an object of type {kind.__name__}, which has no text of its own; return a "
                "str, a number, or lists and dicts of them"
            ) from None
        return str(value)


class NoText(TypeError):
    """What a tool returned has no text of its own (:func:`tool_result_text`)."""
