"""Where a dataset's rows come from (:func:`load_rows`); what becomes of them:
:mod:`gspo.data.prompts`.

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
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gspo.data import files as data_files
from gspo.data.files import DATA_SUFFIXES, Row, read_file
from gspo.plugins import one_line

if TYPE_CHECKING:
    pass


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
    :func:`gspo.data.files.read_file`.
    Without declared configs a data file that no split takes is refused: ``datasets``
    left it out (``part1.jsonl`` beside ``validation.jsonl``; the other kind of a
    directory of two)."""
    import datasets
    from datasets.data_files import FILES_TO_IGNORE

    base = Path(source.location).resolve()
    try:
        with _quiet(datasets), _unpatterned(base) as looked:
            builder = datasets.load_dataset_builder(str(looked), source.config)
            found = {
                split: [_under(Path(f), looked, base) for f in files]
                for split, files in (builder.config.data_files or {}).items()
            }
    except yaml.YAMLError as exc:  # (from the dataset card: its file was unnamed)
        raise ValueError(
            f"{what}: {text}: the YAML header of {base / 'README.md'} is malformed: "
            f"{type(exc).__name__}: {one_line(exc, 300)}"
        ) from None
    except Exception as exc:  # datasets raises many types: one line, naming the key
        raise _load_error(exc, source, text, what) from None
    splits = {str(split): sorted(files) for split, files in found.items()}
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


@contextlib.contextmanager
def _unpatterned(path: Path) -> Iterator[Path]:
    """``path`` for ``datasets``, which reads ``[``, ``]``, ``*`` and ``?`` in a directory's
    path as a pattern (``run[1]`` "doesn't contain any data files"): where it has one, a
    temporary tree of links to its files, whose path has none."""
    if not glob.has_magic(str(path)):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="gspo-data-") as tmp:
        mirror = Path(tmp)  # (datasets resolves a link to a directory: its files linked)
        for file in path.rglob("*"):
            if file.is_file():
                (mirror / file.relative_to(path)).parent.mkdir(parents=True, exist_ok=True)
                (mirror / file.relative_to(path)).symlink_to(file)
        yield mirror


def _under(file: Path, looked: Path, base: Path) -> Path:
    """``file`` found under ``looked`` (:func:`_unpatterned`) as the same file under ``base``."""
    try:
        return base / file.relative_to(looked)
    except ValueError:
        return file


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
