"""User datasets: where the rows come from and how each row becomes a prompt.

**Sources** (``data.train``, ``data.eval``, ``data.sft``), decided in this order:

1. the value names an existing file or directory: a local file (``.jsonl``, ``.json``,
   ``.parquet``, ``.csv``; values as written, a CSV cell a number only where that is
   exact), a directory written by ``datasets``' ``save_to_disk`` (read with
   ``load_from_disk``) or a directory of data files, the files of each split (and
   config) as ``datasets.load_dataset`` finds them, each read as a file (without declared
   configs, a data file that no split takes is an error);
2. otherwise it is read as ``SOURCE[:CONFIG[:SPLIT]]`` (``:SPLIT`` alone is ``::SPLIT``).
   ``SOURCE`` is a local directory as in 1 when one exists by that name; a local path
   that does not exist when it ends in one of those suffixes or starts with ``/``,
   ``./``, ``../`` or ``~`` (an error); else a ``datasets`` hub id
   (``openai/gsm8k:main:train``, ``HuggingFaceH4/MATH-500::test``), read with
   ``datasets.load_dataset`` so the user's cache and offline mode (``HF_HUB_OFFLINE=1``)
   apply. A source with several splits and none named is an error listing them; a split
   may be sliced as ``datasets`` slices it (``test[:200]``, ``train[10%:]``).

**Rows to prompts** (:func:`prepare_rows`): the prompt is ``data.prompt_template``
filled from the row's columns, else the ``data.prompt_column`` column; with
``data.system_prompt`` or ``data.chat_template`` a string prompt becomes a user message
(after the system message) for the tokenizer's chat template. ``data.answer_column``
fills the ``answer`` column the built-in rewards read with that column's final answer
(:func:`gspo.rewards.reference_answer`; it and ``data.tests_column`` may be a dotted path
into a mapping column, verl's ``reward_model.ground_truth``: :func:`gspo.data_files.field_of`),
``data.completion_column`` the cold start's
``completion``; cold-start rows with a ``messages`` column and neither (TRL's
conversational SFT form) are split before the first assistant message. Every other
column reaches the reward functions by name, as in TRL.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import os
import re
import string
from collections.abc import Iterator
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gspo import data_files
from gspo.chat import ROLES
from gspo.config.data import template_fields
from gspo.data_files import DATA_SUFFIXES, Row, field_of, read_file, written_messages
from gspo.plugins import one_line
from gspo.rewards import reference_answer
from gspo.rewards.parsing import cell_text

if TYPE_CHECKING:
    from gspo.config import DataConfig


_LOCAL_PREFIXES = ("/", "./", "../", "~")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_PATTERN = re.compile(r"[*?]")  # (glob's wildcards; not [, which a directory name may hold)


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


def _looked_for(path: Path) -> str:
    """Where a relative ``path`` was looked for (from the current directory), for errors."""
    return "" if path.is_absolute() else f" (looked for {Path.cwd() / path})"


def parse_source(text: str, *, what: str) -> Source:
    """Where ``text`` (the value of the key ``what``) points; the rule in the module doc."""
    whole = Path(text).expanduser()
    if whole.exists():
        return _local(whole)
    if _PATTERN.search(text):  # (a pattern read as a missing file said "file not found")
        matches = sorted(glob.glob(str(whole), recursive=True))
        if not matches:
            raise FileNotFoundError(
                f"{what}: no file matches the pattern {text}{_looked_for(whole)}"
            )
        raise ValueError(
            f"{what}: {text} is a pattern ({len(matches)} match: {_some(matches)}); gspo reads "
            "one file or a directory of them: give the directory"
        )
    if whole.suffix.lower() in DATA_SUFFIXES:
        raise FileNotFoundError(f"{what}: file not found: {text}{_looked_for(whole)}")
    source, *rest = data_files.source_fields(text)
    if len(rest) > 2:
        raise ValueError(f"{what}: {text!r} has more than SOURCE:CONFIG:SPLIT")
    config, split = ((rest + [""] * 2)[:2]) if rest else ("", "")
    config, split = config or None, split or None
    path = Path(source).expanduser()
    if path.is_dir():
        return _local(path, config, split)
    if path.is_file():
        raise ValueError(f"{what}: {text}: a file has no configs or splits")
    if path.suffix.lower() in DATA_SUFFIXES or source.startswith(_LOCAL_PREFIXES):
        raise FileNotFoundError(f"{what}: file not found: {source}{_looked_for(path)}")
    if not _HUB_ID.fullmatch(source):
        raise ValueError(
            f"{what}: {text!r} is neither an existing local path nor a dataset id "
            "(owner/name[:config[:split]])"
        )
    return Source("hub", source, config, split)


@contextlib.contextmanager
def _quiet(datasets) -> Iterator[None]:
    """No progress bars and, inside the block, no log lines from ``datasets`` nor from
    ``huggingface_hub``: a file it cannot read is one error line of ours, not its logged
    error and then ours; no network is five "Retrying in Ns" lines before ours."""
    datasets.disable_progress_bars()
    level = datasets.logging.get_verbosity()
    hub = logging.getLogger("huggingface_hub")
    hub_level = hub.level
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    hub.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        hub.setLevel(hub_level)


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


def _directory_rows(source: Source, text: str, *, what: str) -> list[Row]:
    """The rows of a directory of data files: the files of its split (and config) as
    ``datasets.load_dataset`` finds them (a README's ``configs:``, else splits by file
    name: ``train.jsonl``, ``data/test-00000.parquet``), each read by
    :func:`gspo.data_files.read_file`.
    Without declared configs a data file that no split takes is refused: ``datasets``
    left it out (``part1.jsonl`` beside ``validation.jsonl``; the other kind of a
    directory of two)."""
    import datasets
    from datasets.data_files import FILES_TO_IGNORE

    base = Path(source.location).resolve()
    try:
        with _quiet(datasets):
            builder = datasets.load_dataset_builder(str(base), source.config)
    except yaml.YAMLError as exc:  # (from the dataset card: its file was unnamed)
        raise ValueError(
            f"{what}: {text}: the YAML header of {base / 'README.md'} is malformed: "
            f"{type(exc).__name__}: {one_line(exc, 300)}"
        ) from None
    except Exception as exc:  # datasets raises many types: one line, naming the key
        raise _load_error(exc, source, text, what) from None
    splits = {
        str(split): sorted(Path(f) for f in files)
        for split, files in (builder.config.data_files or {}).items()
    }
    unread = [
        f for files in splits.values() for f in files if f.suffix.lower() not in DATA_SUFFIXES
    ]
    if unread:
        raise ValueError(
            f"{what}: {text}: {unread[0].relative_to(base)} is none of the files gspo reads "
            f"({', '.join(DATA_SUFFIXES)}); convert it"
        )
    if not _declares_configs(base):
        taken = {f.resolve() for files in splits.values() for f in files}
        left = [
            str(p.relative_to(base)) for p in sorted(base.rglob("*"))
            if p.is_file() and p.suffix.lower() in DATA_SUFFIXES and p.resolve() not in taken
            and p.name not in FILES_TO_IGNORE
            and not any(part.startswith((".", "__")) for part in p.relative_to(base).parts)
        ]  # fmt: skip
        if left:
            named = _some([str(f.relative_to(base)) for files in splits.values() for f in files])
            raise ValueError(
                f"{what}: {text}: its files are read as splits by their names ({named}), "
                f"which leaves out {_some(left)}; "
                "name each file by its split (train*.jsonl, test*.jsonl; files of one kind), "
                "or give the files to read a directory of their own"
            )
    if source.split is not None and source.split not in splits:
        raise ValueError(f"{what}: {text}: no split {source.split!r} (splits: {', '.join(splits)})")
    if source.split is None and len(splits) > 1:
        source_config = f"{source.location}:{source.config or ''}"
        raise ValueError(
            f"{what}: {text} has splits {', '.join(splits)}; name one as {source_config}:SPLIT"
        )
    files = splits[source.split] if source.split is not None else next(iter(splits.values()))
    return [row for f in files for row in read_file(f, what=what)]


def _some(names: list[str], most: int = 3) -> str:
    """The first ``most`` of ``names``, then how many more (a directory of 300 shards
    was an error line of 8 kB)."""
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def _declares_configs(base: Path) -> bool:
    """Whether the directory's README.md lists its configs and their files (a hub
    repository's ``configs:``), which then say what is left out."""
    from huggingface_hub.repocard import metadata_load

    readme = base / "README.md"
    try:
        meta = metadata_load(readme) if readme.is_file() else None
    except yaml.YAMLError:  # (datasets has refused it already)
        return False
    return isinstance(meta, dict) and "configs" in meta


def _near_local(path: Path) -> Path | None:
    """A data file or directory beside where ``path`` would be, named close to it (a
    local path's typo, taken for a hub id), or None."""
    with contextlib.suppress(OSError):
        places = itertools.islice(path.parent.iterdir(), 1000)
        data = [p.name for p in places if p.is_dir() or p.suffix.lower() in DATA_SUFFIXES]
        if near := get_close_matches(path.name, data, n=1, cutoff=0.75):
            return path.parent / near[0]
    return None


def _load_error(exc: Exception, source: Source, text: str, what: str) -> ValueError:
    """The one line for what ``datasets`` raised loading ``source`` (``text``, the value
    of the key ``what``)."""
    kind = "dataset id" if source.kind == "hub" else "local dataset"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    hint, local = "", Path(source.location)
    if source.kind == "hub" and isinstance(exc, ConnectionError):  # (offline mode's too)
        hint = (  # (the recipes audit: that a local copy works was unsaid)
            " (offline, the dataset must be in the datasets cache, or a local copy given: "
            f"{what}=FILE ({', '.join(DATA_SUFFIXES)}) or a save_to_disk directory"
            + ("" if offline else "; HF_HUB_OFFLINE=1 skips the network")
            + ")"
        )
    if source.kind == "hub" and local.parent.is_dir():  # (data/missing, mydat: local?)
        hint += f"; nor is there a local {local}"
        if near := _near_local(local):
            hint += f" (did you mean ./{near}?)"
        elif local.parent.name:
            hint += f" (write ./{local} for one)"
    if source.kind == "directory":
        hint = (
            " (a directory must hold a datasets.save_to_disk dataset, or data files "
            f"of one kind: {', '.join(DATA_SUFFIXES)})"
        )
    if source.kind != "hub" and source.config and not source.split:
        split = f"{text.partition(':')[0]}::{source.config}"
        hint += f"; for the split {source.config!r} write {split} (SOURCE:CONFIG:SPLIT)"
    return ValueError(
        f"{what}: cannot load {kind} {text!r}: {type(exc).__name__}: {one_line(exc, 300)}{hint}"
    )


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
    local = source.split if source.kind != "hub" else None  # (a hub id's slice: datasets')
    split, bounds = data_files.split_slice(local, where=f"{what}: {text}")
    source = Source(source.kind, source.location, source.config, split or source.split)
    if source.kind == "file":
        if source.config or source.split:
            raise ValueError(f"{what}: {text}: a file has no configs or splits")
        rows = read_file(Path(source.location), what=what)
    elif source.kind == "directory":
        rows = _directory_rows(source, text, what=what)
    else:
        import datasets

        try:
            with _quiet(datasets):
                loaded = _load_dataset(datasets, source)
        except Exception as exc:  # datasets raises many types: one line, naming the key
            raise _load_error(exc, source, text, what) from None
        rows = _one_split(loaded, text, what=what).to_list()
    rows = data_files.sliced(rows, bounds) if bounds else rows
    if not rows:
        raise ValueError(f"{what}: {text} has no rows")
    # every row has every column (None where it lacks one), as a datasets table does
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return [row if len(row) == len(columns) else {k: row.get(k) for k in columns} for row in rows]


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
    fields = {"answer": data.answer_column, "tests": data.tests_column}
    for name, column in fields.items() if not sft else ():  # (nothing scores a cold start)
        if column is not None and ("." not in column or column in rows[0]):
            need(column, f"data.{name}_column")
        for i, row in enumerate(rows, start=1) if column is not None else ():
            try:  # (a dotted path: a field of a mapping column, verl's reward_model.ground_truth)
                field_of(row, column)
            except KeyError as exc:
                raise ValueError(f"data.{name}_column={column}: {exc.args[0]} in row {i} of "
                                 f"{where}") from None  # fmt: skip
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
        if (value := _field(row, data.answer_column)) is not _NONE:
            if said := not_an_answer(value):  # (its repr was the answer: scored 0, unsaid)
                raise ValueError(
                    f"{named} row {i}: the answer (column {data.answer_column!r}) {said}"
                )
            new["answer"] = _answer(value)
        if (value := _field(row, data.tests_column)) is not _NONE:
            new["tests"] = value
        if sft:
            new["completion"] = _completion(row[data.completion_column], data, named, i)
        out.append(new)
    return out


_NONE = object()


def _field(row: Row, column: str | None) -> Any:
    """``row``'s column or dotted field ``column`` (:func:`field_of`); ``_NONE`` where no
    column is named, or a cold-start row (which need not have it) has none."""
    if column is None:
        return _NONE
    try:
        return field_of(row, column)
    except KeyError:
        return _NONE


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
