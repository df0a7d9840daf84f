"""User datasets: where the rows come from and how each row becomes a prompt.

**Sources** (``data.train``, ``data.eval``, ``data.sft``), decided in this order:

1. the value names an existing file or directory: a local file (``.jsonl``, ``.json``,
   ``.parquet``, ``.csv``), a directory written by ``datasets``' ``save_to_disk`` (read
   with ``load_from_disk``) or a directory of data files (read with ``load_dataset``);
2. otherwise it is read as ``SOURCE[:CONFIG[:SPLIT]]`` (``:SPLIT`` alone is ``::SPLIT``).
   ``SOURCE`` is a local directory as in 1 when one exists by that name; a local path
   that does not exist when it ends in one of those suffixes or starts with ``/``,
   ``./``, ``../`` or ``~`` (an error); else a ``datasets`` hub id
   (``openai/gsm8k:main:train``, ``HuggingFaceH4/MATH-500::test``), read with
   ``datasets.load_dataset`` so the user's cache and offline mode (``HF_HUB_OFFLINE=1``)
   apply. A source with several splits and none named is an error listing them.

**Rows to prompts** (:func:`prepare_rows`): the prompt is ``data.prompt_template``
filled from the row's columns, else the ``data.prompt_column`` column; with
``data.system_prompt`` or ``data.chat_template`` a string prompt becomes a user message
(after the system message) for the tokenizer's chat template. ``data.answer_column``
fills the ``answer`` column the built-in rewards read with that column's final answer
(:func:`gspo.rewards.reference_answer`), ``data.completion_column`` the cold start's
``completion``; cold-start rows with a ``messages`` column and neither (TRL's
conversational SFT form) are split before the first assistant message. Every other
column reaches the reward functions by name, as in TRL.
"""

from __future__ import annotations

import contextlib
import json
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gspo.config.data import template_fields
from gspo.plugins import one_line
from gspo.rewards import reference_answer
from gspo.rewards.parsing import cell_text

if TYPE_CHECKING:
    from gspo.config import DataConfig

Row = dict[str, Any]

#: Local file suffixes and the ``datasets`` builder that reads each.
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_LOCAL_PREFIXES = ("/", "./", "../", "~")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class Source:
    """Where ``data.*`` rows come from: ``kind`` is file, saved (``save_to_disk``),
    directory (data files) or hub."""

    kind: str
    location: str
    config: str | None = None
    split: str | None = None


def _local(path: Path, config: str | None = None, split: str | None = None) -> Source:
    if path.is_file():
        return Source("file", str(path), config, split)
    saved = (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    return Source("saved" if saved else "directory", str(path), config, split)


def parse_source(text: str, *, what: str) -> Source:
    """Where ``text`` (the value of the key ``what``) points; the rule in the module doc."""
    whole = Path(text).expanduser()
    if whole.exists():
        return _local(whole)
    if whole.suffix.lower() in FILE_BUILDERS:
        raise FileNotFoundError(f"{what}: file not found: {text}")
    source, *rest = text.split(":")
    if len(rest) > 2:
        raise ValueError(f"{what}: {text!r} has more than SOURCE:CONFIG:SPLIT")
    config, split = ((rest + [""] * 2)[:2]) if rest else ("", "")
    config, split = config or None, split or None
    path = Path(source).expanduser()
    if path.is_dir():
        return _local(path, config, split)
    if path.suffix.lower() in FILE_BUILDERS or source.startswith(_LOCAL_PREFIXES):
        raise FileNotFoundError(f"{what}: file not found: {source}")
    if not _HUB_ID.fullmatch(source):
        raise ValueError(
            f"{what}: {text!r} is neither an existing local path nor a dataset id "
            "(owner/name[:config[:split]])"
        )
    return Source("hub", source, config, split)


@contextlib.contextmanager
def _quiet(datasets) -> Iterator[None]:
    """No progress bars and, inside the block, no log lines from ``datasets``: a file it
    cannot read is one error line of ours, not its logged error and then ours."""
    datasets.disable_progress_bars()
    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)


def _load_dataset(datasets, source: Source) -> Any:
    """A saved dataset (its split if named) or ``datasets.load_dataset`` of ``source``."""
    if source.kind != "saved":
        return datasets.load_dataset(source.location, source.config, split=source.split)
    if source.config is not None:
        raise ValueError(f"a saved dataset has no configs (got {source.config!r})")
    loaded = datasets.load_from_disk(source.location)
    if source.split is None:
        return loaded
    if not isinstance(loaded, datasets.DatasetDict):
        raise ValueError("it holds one split; drop ':SPLIT'")
    if source.split not in loaded:
        raise ValueError(f"no split {source.split!r} (splits: {', '.join(loaded)})")
    return loaded[source.split]


def _read_file(path: Path, *, what: str) -> list[Row]:
    suffix = path.suffix.lower()
    if suffix not in FILE_BUILDERS:
        raise ValueError(f"{what}: {path} must end in {', '.join(FILE_BUILDERS)}")
    if suffix == ".jsonl":  # one json.loads per line: no need to start `datasets` for it
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{what}: {path} line {number} is not JSON: {exc}") from exc
        return rows
    import datasets

    try:
        with _quiet(datasets):
            builder, files = FILE_BUILDERS[suffix], str(path)
            table = datasets.load_dataset(builder, data_files=files, split="train")
    except Exception as exc:  # datasets raises many types for malformed files
        raise ValueError(f"{what}: cannot read {path}: {type(exc).__name__}: {exc}") from exc
    return table.to_list()


def _one_split(loaded: Any, text: str, *, what: str) -> Any:
    """The only split of a ``DatasetDict``, or a one-line error naming the splits."""
    import datasets

    if not isinstance(loaded, datasets.DatasetDict):
        return loaded
    if len(loaded) == 1:
        return next(iter(loaded.values()))
    source, _, config = text.partition(":")
    raise ValueError(
        f"{what}: {text} has splits {', '.join(loaded)}; name one as "
        f"{source}:{config.split(':')[0]}:SPLIT"
    )


def load_rows(text: str | Path, *, what: str) -> list[Row]:
    """The rows ``text`` points to (see the module doc), as dicts; one-line errors.

    ``what`` names the config key in error messages (e.g. ``data.train``).
    """
    text = str(text)
    source = parse_source(text, what=what)
    if source.kind == "file":
        if source.config or source.split:
            raise ValueError(f"{what}: {text}: a file has no configs or splits")
        rows = _read_file(Path(source.location), what=what)
    else:
        import datasets

        try:
            with _quiet(datasets):
                loaded = _load_dataset(datasets, source)
        except Exception as exc:  # datasets raises many types: one line, naming the key
            kind = "dataset id" if source.kind == "hub" else "local dataset"
            hint = ""
            if source.kind == "hub" and isinstance(exc, ConnectionError):
                hint = (
                    " (offline, the dataset must be in the datasets cache; "
                    "HF_HUB_OFFLINE=1 skips the network)"
                )
            if source.kind == "directory":
                hint = (
                    " (a directory must hold a datasets.save_to_disk dataset, or data files "
                    f"of one kind: {', '.join(FILE_BUILDERS)})"
                )
            if source.kind != "hub" and source.config and not source.split:
                split = f"{text.partition(':')[0]}::{source.config}"
                hint += f"; for the split {source.config!r} write {split} (SOURCE:CONFIG:SPLIT)"
            raise ValueError(
                f"{what}: cannot load {kind} {text!r}: "
                f"{type(exc).__name__}: {one_line(exc, 300)}{hint}"
            ) from None
        rows = _one_split(loaded, text, what=what).to_list()
    if not rows:
        raise ValueError(f"{what}: {text} has no rows")
    if not isinstance(rows[0], dict):
        raise ValueError(f"{what}: {text} rows are {type(rows[0]).__name__}, not records")
    return rows


# --------------------------------------------------------------------------------------------
# Rows to prompts
# --------------------------------------------------------------------------------------------


def _columns(rows: list[Row]) -> str:
    return ", ".join(rows[0]) if rows else "none"


def prepare_rows(rows: list[Row], data: DataConfig, *, what: str, sft: bool = False) -> list[Row]:
    """``rows`` with ``prompt`` (and ``answer``, and for ``sft`` rows ``completion``) set
    from the ``data.*`` keys; see the module doc. One-line errors name the key, the
    source and the columns that exist.
    """
    if not rows:
        return rows
    source = getattr(data, what.removeprefix("data."), None) or "the built-in task"
    where = f"{what} ({source}; columns: {_columns(rows)})"
    if sft and data.prompt_template is None and _messages_only(rows, data):
        rows = [_split_messages(row, data, f"{what} row {i}") for i, row in enumerate(rows)]

    def need(column: str, key: str) -> None:
        missing = next((i for i, row in enumerate(rows) if column not in row), None)
        if missing is not None:
            row = "" if missing == 0 else f" in row {missing}"
            raise ValueError(f"{key}: no column {column!r}{row} of {where}")

    template = data.prompt_template
    if template is not None:
        for field in template_fields(template):
            need(field, "data.prompt_template")
    else:
        need(data.prompt_column, "data.prompt_column")
    if data.answer_column is not None:
        need(data.answer_column, "data.answer_column")
    if sft:
        need(data.completion_column, "data.completion_column")
    chat = data.chat_template or data.system_prompt is not None

    if template is not None and rows:
        _check_template_values(template, rows[0])
    out = []
    for row in rows:
        prompt = template.format_map(row) if template else row[data.prompt_column]
        if chat:
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            has_system = bool(prompt) and prompt[0].get("role") == "system"
            if data.system_prompt is not None and not has_system:
                prompt = [{"role": "system", "content": data.system_prompt}, *prompt]
        new = {**row, "prompt": prompt}
        if data.answer_column is not None:
            gold = cell_text(row[data.answer_column])  # (58.0 of a float column: "58")
            new["answer"] = None if gold is None else reference_answer(gold)
        if sft:
            new["completion"] = _completion(row[data.completion_column], data, what, len(out))
        out.append(new)
    return out


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
    if isinstance(value, list):
        _check_tool_calls(value, where)
        return value
    if isinstance(value, str):
        return value
    number = isinstance(value, int | float) and not isinstance(value, bool)
    text = cell_text(value) if number else None  # (None for NaN: a blank cell)
    if text is None:
        raise ValueError(
            f"{where}: the completion (column {data.completion_column!r}) is {value!r:.80}; "
            "a cold-start completion is text or a list of messages"
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


def _check_template_values(template: str, row: dict[str, Any]) -> None:
    """A field of ``data.prompt_template`` that names a method (``{question.upper}``)
    would put its repr (``<built-in method upper ...>``) into every prompt: one line."""
    formatter = string.Formatter()
    for _, field, _, _ in formatter.parse(template):
        if field:
            value, _ = formatter.get_field(field, (), row)
            if callable(value):
                raise ValueError(
                    f"data.prompt_template: {{{field}}} is a method of the column's value, "
                    "which would be written into the prompt as its repr; name a value"
                )
