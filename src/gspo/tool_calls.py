"""Tool calls as models write them, and what a tool's result becomes.

:func:`parse_tool_calls` reads the Hermes/Qwen format (``<tool_call>{json}</tool_call>``)
out of a model's turn; :func:`tool_result_text` turns what a tool returned into the text
of its ``tool`` message. Used by :mod:`gspo.environments`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call; ``error`` is set (and ``name`` may be empty) when it did not parse."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text``, in order (Hermes/Qwen format):
    JSON ``{"name": str, "arguments": {...}}`` (``arguments`` may be a JSON string of an
    object, as some models write it); one unterminated, not JSON or of another shape comes
    back with ``error`` set."""
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall("", error="unterminated <tool_call> (no </tool_call>)"))
            continue
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
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):  # (JSONDecodeError is a ValueError)
                arguments = None
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
