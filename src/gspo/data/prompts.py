"""User datasets: how each row becomes a prompt; where the rows come from (``data.train``,
``data.eval``, ``data.sft``: a file, a directory, a hub id) is :mod:`gspo.data.sources`.

**Rows to prompts** (:func:`prepare_rows`): the prompt is ``data.prompt_template``
filled from the row's columns, else the ``data.prompt_column`` column; with
``data.system_prompt`` or ``data.chat_template`` a string prompt becomes a user message
(after the system message) for the tokenizer's chat template. ``data.answer_column``
fills the ``answer`` column the built-in rewards read with that column's final answer
(:func:`gspo.rewards.reference_answer`; it and ``data.tests_column`` may be a dotted path
into a mapping column, verl's ``reward_model.ground_truth``: :func:`gspo.data.files.field_of`),
``data.completion_column`` the cold start's
``completion``; cold-start rows with a ``messages`` column and neither (TRL's
conversational SFT form) are split before the first assistant message. Every other
column reaches the reward functions by name, as in TRL.
"""

from __future__ import annotations

import string
from difflib import get_close_matches
from typing import TYPE_CHECKING, Any

from gspo.chat import ROLES
from gspo.config.data import template_fields
from gspo.data.files import Row, field_of, written_messages
from gspo.rewards import reference_answer
from gspo.rewards.parsing import cell_text

if TYPE_CHECKING:
    from gspo.config import DataConfig


# --------------------------------------------------------------------------------------------
# Rows to prompts
# --------------------------------------------------------------------------------------------


def _columns(rows: list[Row]) -> str:
    return ", ".join(rows[0]) if rows else "none"


def prepare_rows(
    rows: list[Row], data: DataConfig, *, what: str, sft: bool = False, blank_ok: bool = False
) -> list[Row]:
    """``rows`` with ``prompt`` (and ``answer``, and for ``sft`` rows ``completion``) set
    from the ``data.*`` keys; see the module doc. ``sft`` rows need no answer column
    (nothing scores them: prompt and completion are what a cold start reads). One-line
    errors name the key, the source and the columns that exist; a blank prompt is one
    unless ``blank_ok`` (an environment's reset writes the rest of it).
    """
    if not rows:
        return rows
    source = data.source_of(what)
    where = f"{what} ({source}; columns: {_columns(rows)})"
    named = f"{what} ({source})"  # (a row's errors name the file the user opens)
    if sft and data.prompt_template is None and _messages_only(rows, data):
        rows = [
            _split_messages(row, data, f"{named} row {i}") for i, row in enumerate(rows, start=1)
        ]

    def need(column: str, key: str) -> None:
        missing = next((i for i, row in enumerate(rows, start=1) if column not in row), None)
        if missing is not None:
            row = "" if missing == 1 else f" in row {missing}"
            spaced = [c for c in rows[missing - 1] if str(c).strip() == column.strip()]
            hint = f" (the column {spaced[0]!r} differs by spaces around it)" if spaced else ""
            raise ValueError(f"{key}: no column {column!r}{row} of {where}{hint}")

    template = data.prompt_template
    if template is not None:
        for field in template_fields(template):
            need(field, "data.prompt_template")
    else:
        need(data.prompt_column, "data.prompt_column")
    # each named field's value in every row (a dotted path: a field of a mapping column,
    # verl's reward_model.ground_truth); a cold-start row need not have it (nothing scores it)
    fields: dict[str, list[Any]] = {}
    for name, column in {"answer": data.answer_column, "tests": data.tests_column}.items():
        if column is None:
            fields[name] = [_NONE] * len(rows)
            continue
        key = f"data.{name}_column"
        if not sft and ("." not in column or column in rows[0]):
            need(column, key)
        fields[name] = [_field(row, column, None if sft else f"{key}={column}", i, where)
                        for i, row in enumerate(rows, start=1)]  # fmt: skip
    if sft:
        need(data.completion_column, "data.completion_column")
    chat = data.chat_template or data.system_prompt is not None

    out = []
    for i, row in enumerate(rows, start=1):
        given = (
            _filled(template, row, f"row {i} of {where}", blank_ok)
            if template
            else row[data.prompt_column]
        )
        prompt = _prompt(given, named, i, None if template else data.prompt_column, blank_ok)
        if chat:
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            has_system = bool(prompt) and prompt[0].get("role") == "system"
            if data.system_prompt is not None and not has_system:
                prompt = [{"role": "system", "content": data.system_prompt}, *prompt]
        new = {**row, "prompt": prompt}
        if (value := fields["answer"][i - 1]) is not _NONE:
            if said := not_an_answer(value):  # (its repr was the answer: scored 0, unsaid)
                raise ValueError(
                    f"{named} row {i}: the answer (column {data.answer_column!r}) {said}"
                )
            new["answer"] = _answer(value)
        if (value := fields["tests"][i - 1]) is not _NONE:
            new["tests"] = value
        if sft:
            new["completion"] = _completion(row[data.completion_column], data, named, i)
        out.append(new)
    return out


_NONE = object()  # (a field a row does not have; its value may be None: an empty cell)


def _field(row: Row, column: str, key: str | None, index: int, where: str) -> Any:
    """``row``'s column or dotted field ``column`` (:func:`field_of`); where it has none,
    ``_NONE`` (a cold-start row: ``key`` None), else one line naming ``key`` and the row."""
    try:
        return field_of(row, column)
    except KeyError as exc:
        if key is None:
            return _NONE
        raise ValueError(f"{key}: {exc.args[0]} in row {index} of {where}") from None


def _answer(value: Any) -> Any:
    """``data.answer_column``'s cell as the final answer the built-in rewards compare with
    (58.0 of a float column: "58"); a list of answers (any of them right) item by item."""
    if isinstance(value, (list, tuple)):
        answers = [a for a in map(_answer, value) if a is not None]
        return answers or None  # (none: as a blank cell, counted by the run's warning)
    gold = cell_text(value)
    return None if gold is None else reference_answer(gold)


def not_an_answer(value: Any) -> str | None:
    """What is wrong with ``value`` as a gold answer of the built-in rewards (which compare
    its text: a mapping's or bytes' repr matched no completion), or None: text, a number,
    a bool (``True``), or a list of them (any of them right)."""
    items = value if isinstance(value, list | tuple) else [value]
    for item in items:
        if isinstance(item, dict | list | tuple | bytes | bytearray):
            held = "holds" if item is not value else "is"
            return (
                f"{held} {type(item).__name__} {item!r:.60}; a gold answer is text, a number "
                "or a list of them (any of them right)"
            )
    return None


def _messages_only(rows: list[Row], data: DataConfig) -> bool:
    """Cold-start rows in TRL's conversational SFT form: a ``messages`` column, and
    neither ``data.prompt_column`` nor ``data.completion_column``."""
    first = rows[0]
    return (
        "messages" in first
        and data.prompt_column not in first
        and data.completion_column not in first
    )


def _split_messages(row: Row, data: DataConfig, where: str) -> Row:
    """A ``messages`` conversation as a prompt (the messages before the first assistant
    message) and a completion (that message and all after it)."""
    messages = row.get("messages")
    if not isinstance(messages, list):
        raise ValueError(f"{where}: messages is {messages!r:.80}, not a list of messages")
    if _is_messages(messages):  # (asistant: "no assistant message", no hint)
        _check_messages(messages, where)
    first = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        None,
    )
    if not first:  # none, or the conversation opens with the model's turn: no prompt
        said = "no assistant message" if first is None else "no message before the assistant's"
        raise ValueError(f"{where}: messages has {said}, so nothing to learn or no prompt")
    return {
        **row,
        data.prompt_column: messages[:first],
        data.completion_column: messages[first:],
    }


def _completion(value: Any, data: DataConfig, what: str, index: int) -> Any:
    """A cold-start row's completion: text (a number of a CSV column as its text) or a
    conversation; none at all is one line naming the row and the column."""
    where = f"{what} row {index}"
    if _is_messages(value):
        _check_tool_calls(value, where)
        _check_messages(value, where)  # (a turn without content: learnt as an empty one)
        return value
    if isinstance(value, str):
        return value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    text = cell_text(value) if number else None  # (None for NaN: a blank cell)
    if text is None:
        raise ValueError(
            f"{where}: the completion (column {data.completion_column!r}) is {value!r:.80}; "
            "a cold-start completion is text or a list of chat messages (each a mapping "
            "with a 'role' and its 'content')"
        )
    return text


def _check_tool_calls(completion: Any, where: str) -> None:
    """A cold-start conversation trains on each assistant message's content, token for
    token, as the model writes it: structured ``tool_calls`` (OpenAI's and TRL's form) are
    not in it, so the model would learn to end its turn where the call should be."""
    if not isinstance(completion, list):
        return
    for message in completion:
        if isinstance(message, dict) and message.get("tool_calls"):
            raise ValueError(
                f"{where}: an assistant message with tool_calls: write the call into its "
                'content as the model writes it (e.g. <tool_call>{"name": ..., '
                '"arguments": {...}}</tool_call>), which the cold start trains on'
            )


def _is_messages(value: Any) -> bool:
    """Whether ``value`` is a list of chat messages (mappings with a ``role``)."""
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


def _check_messages(messages: list[dict], where: str) -> None:
    """Each message has a content (or tool calls) and no role that misspells one of the
    roles every template knows (``usr``, ``asistant``: a template writes nothing for a
    role it does not know); else one line naming the message."""
    for k, message in enumerate(messages, start=1):
        role, keys = message["role"], ", ".join(map(str, message))
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"{where}: message {k} has no 'content' (its keys: {keys})")
        near = role not in ROLES and get_close_matches(str(role), ROLES, n=1, cutoff=0.75)
        if near:  # (the cutoff: not model -> tool)
            raise ValueError(
                f"{where}: message {k} has the role {role!r}; did you mean {near[0]!r}? "
                "(a chat template writes nothing for a role it does not know)"
            )


def _prompt(
    prompt: Any, what: str, index: int, column: str | None = None, blank_ok: bool = False
) -> Any:
    """A row's prompt (from ``column``, or a template): text or a list of chat messages
    (not blank, unless ``blank_ok``); else one line naming the row."""
    if prompt is None and column is not None:  # (a JSONL row without it reads as null)
        raise ValueError(
            f"{what} row {index}: no prompt: its {column!r} is missing or null "
            "(data.prompt_column names the column)"
        )
    if isinstance(prompt, str):
        if prompt and not prompt.strip() and not blank_ok:  # ('': refused when encoded)
            raise ValueError(f"{what} row {index}: the prompt is only whitespace: {prompt!r:.40}")
        if written_messages(prompt):  # (a CSV of message lists: their repr, trained on)
            raise ValueError(f"{what} row {index}: the prompt is chat messages written out as "
                             f"text, {prompt!r:.50}: a CSV cell holds no list; save the rows "
                             "as JSON Lines or Parquet")  # fmt: skip
        return prompt
    if _is_messages(prompt):
        _check_messages(prompt, f"{what} row {index}")
        asked = [m.get("content") for m in prompt if m.get("role") == "user"]
        texts = [c for c in asked if isinstance(c, str)]  # (not a list of parts)
        blank = asked and len(texts) == len(asked) and not any(c.strip() for c in texts)
        if blank and not blank_ok:
            raise ValueError(f"{what} row {index}: every user message is blank")
        return prompt
    number = isinstance(prompt, int | float) and not isinstance(prompt, bool)
    hint = " (a number: data.prompt_template={prompt} writes it as text)" if number else ""
    raise ValueError(
        f"{what} row {index}: the prompt is {prompt!r:.80}{hint}; a prompt is text or a list "
        "of chat messages (each a mapping with a 'role' and its 'content')"
    )


def _filled(template: str, row: dict[str, Any], where: str, blank_ok: bool = False) -> str:
    """``data.prompt_template`` filled from ``row``; one line where a field cannot be: a
    missing key or attribute, a format spec its value does not take, a value that is
    None (it would read "None") or a method (its repr)."""
    formatter = string.Formatter()
    try:
        blank = []  # (every field blank: the prompt was the template's own text, unsaid)
        fields = [field for _, field, _, _ in formatter.parse(template) if field]
        for field in fields:
            value, _ = formatter.get_field(field, (), row)
            if said := _unwritable(value, field):
                raise ValueError(f"{{{field}}} is {said}")
            if isinstance(value, str) and not value.strip():
                blank.append(f"{{{field}}}")
        if fields and len(blank) == len(fields) and not blank_ok:
            raise ValueError(f"{', '.join(blank)} blank: the prompt is the template's text alone")
        return template.format_map(row)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"data.prompt_template: {where}: {type(exc).__name__}: {exc}") from None


def _unwritable(value: Any, field: str) -> str | None:
    """Why a template ``field``'s ``value`` would write garbage into the prompt, or None:
    None and NaN (a missing value: "None", "nan"), a method (its repr), a mapping or chat
    messages (their repr: a verl ``prompt`` column in ``'{prompt} ...'``)."""
    if value is None:
        return "None, which would be written as such"
    if isinstance(value, float) and value != value:
        return "NaN (a missing value), which would be written as 'nan'"
    if callable(value):
        return "a method of the column's value, which would be written as such"
    if _is_messages(value) and value:
        hint = "data.prompt_column takes chat messages as they are"
        return f"chat messages {value!r:.60}, whose repr would be written; {hint}"
    if isinstance(value, dict) and value:
        inside = f"{{{field}[{next(iter(value))}]}}"
        return f"a mapping {value!r:.60}, whose repr would be written; name a field: {inside}"
    return None
