"""Tool calls as models write them, and what a tool's result becomes.

:func:`parse_tool_calls` reads the Hermes/Qwen format (``<tool_call>{json}</tool_call>``)
out of a model's turn; :func:`tool_result_text` turns what a tool returned into the text
of its ``tool`` message. Used by :mod:`gspo.environments.episodes`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
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


#: A JSON schema type's name in a message, and whether a value read from JSON is of it.
_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "string": ("a string", lambda v: isinstance(v, str)),
    "boolean": ("a boolean", lambda v: isinstance(v, bool)),
    "array": ("an array", lambda v: isinstance(v, list)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "null": ("null", lambda v: v is None),
}


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _kind(value: Any) -> str:
    """What ``value`` (read from JSON) is, as a message says it: ``a string``."""
    for kind in ("boolean", "integer", "number", "string", "array", "object", "null"):
        said, fits = _TYPES[kind]
        if fits(value):
            return said
    return type(value).__name__


def argument_error(
    schema: dict[str, Any], arguments: dict[str, Any], defaults: dict[str, Any]
) -> str | None:
    """Why ``arguments`` do not fit the tool's JSON ``schema`` (its ``parameters``, from
    ``get_json_schema``), or None: an argument, or an item of one (a list's, a dict's
    values), whose ``type``, ``enum`` or ``anyOf`` it does not meet (null is also allowed
    for a ``nullable`` one or an argument whose default, in ``defaults``, is None).
    Nothing is converted: a tool gets what the model wrote, as in TRL and verl, or the
    model gets this error (a tool given "3" for an int raised in itself, or took "false"
    for true)."""
    properties = schema.get("properties") or {}
    for name, value in arguments.items():
        if said := _misfit(properties.get(name), value, name, defaults.get(name, ...) is None):
            return said
    return None


def _misfit(spec: Any, value: Any, where: str, nullable: bool = False) -> str | None:
    """Why ``value`` (``where`` in the arguments) does not fit ``spec``, or None."""
    if not isinstance(spec, dict):
        return None
    nullable = nullable or bool(spec.get("nullable"))
    if value is None and nullable:
        return None
    forms = spec.get("anyOf")
    if isinstance(forms, list) and forms:
        if all(_misfit(form, value, where) for form in forms):
            return f"{where} fits none of the forms its schema allows, got {_shown(value)}"
        return None
    enum = spec.get("enum")
    if isinstance(enum, list) and not any(
        type(value) is type(choice) and value == choice for choice in enum
    ):
        choices = ", ".join(_shown(choice) for choice in enum)
        return f"{where} must be one of {choices}, got {_shown(value)}"
    kinds = spec.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or not all(kind in _TYPES for kind in kinds):
        return None  # (no type, or one JSON has no value of: "image")
    if not any(_TYPES[kind][1](value) for kind in kinds):
        wanted = " or ".join(_TYPES[kind][0] for kind in [*kinds, *["null"][:nullable]])
        return f"{where} must be {wanted}, got {_shown(value)} ({_kind(value)})"
    if isinstance(value, list):
        shapes = spec.get("prefixItems")
        shapes = shapes if isinstance(shapes, list) else [spec.get("items")] * len(value)
        for k, (shape, item) in enumerate(zip(shapes, value, strict=False)):
            if said := _misfit(shape, item, f"{where}[{k}]"):
                return said
    if isinstance(value, dict):
        for key, item in value.items():
            if said := _misfit(spec.get("additionalProperties"), item, f"{where}[{_shown(key)}]"):
                return said
    return None
