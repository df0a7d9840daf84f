"""Loading a config: a YAML file plus dotted ``key.sub=value`` overrides, typed by each
key's field, the built-in task's defaults filled in, and one-line :class:`ConfigError`s
("did you mean" for a misspelt key or choice); dumping the resolved config as YAML."""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import ValidationError

from gspo.config.root import Config
from gspo.config.section import ConfigError, Section, error_line, field_annotation
from gspo.tasks import TASK_DEFAULTS


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with a key written twice in one mapping an error (PyYAML
    keeps the last value silently), merge keys (``<<: *base``) taken as YAML defines them,
    and ``1e3`` read as the number it is (YAML 1.1 wants ``1.0e+3``), as overrides are."""

    def construct_mapping(self, node, deep=False):
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged below, and a key
                continue  # written beside it overrides what it brings, as YAML says
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _Dumper(yaml.SafeDumper):
    """PyYAML's safe dumper that quotes what :class:`_UniqueKeyLoader` reads as a number
    (a string ``1e3`` written bare would come back as 1000.0)."""


for _cls in (_UniqueKeyLoader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
        list("-+0123456789."),
    )


def read_yaml(path: Path) -> Any:
    """The YAML file ``path``; a syntax error or a duplicate key is a one-line
    :class:`ConfigError` naming the file, line and column."""
    try:
        return yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{path}{where}: not valid YAML ({exc.problem})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``tree['a']['b'] = value`` for ``dotted = 'a.b'``, creating sections as needed; a
    mapping set on a section merges into it (``optim={lr: 0.5}`` keeps the file's other
    ``optim`` keys), key by key, as dotted overrides of each would; a setting whose value
    is a mapping (``data.chat_template_kwargs``) is replaced."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: {key} is a value, not a section")
        node = child
    section = field_annotation(Config, dotted)
    if isinstance(value, dict) and isinstance(node.get(leaf), dict) and _is_section(section):
        for key, inner in value.items():
            set_dotted(tree, f"{dotted}.{key}", inner)
        return
    node[leaf] = value  # (a setting that is a mapping, log.wandb: replaced whole)


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def _no_null_sections(tree: dict[Any, Any], prefix: str = "") -> dict[Any, Any]:
    """``tree`` with each section whose keys are all commented out (``optim:``, or
    ``lora:`` under ``model:``: YAML's null) as an empty one: it sets nothing (pydantic
    said "Input should be a valid dictionary")."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if value is None and _is_section(field_annotation(Config, dotted)):
            value = {}
        elif isinstance(value, dict):
            value = _no_null_sections(value, f"{dotted}.")
        out[key] = value
    return out


def _is_text(annotation: Any) -> bool:
    """Whether a field holds text: ``str``, ``str | None`` or a ``Literal`` of strings."""
    if annotation is str:
        return True
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in args)
    if get_origin(annotation) in (Union, UnionType):
        others = [a for a in args if a is not type(None)]
        return len(others) == 1 and _is_text(others[0])
    return False


_NULL = {"null", "Null", "NULL", "~"}


def parse_override(text: str) -> tuple[str, Any]:
    """``'optim.lr=3e-4' -> ('optim.lr', 3e-4)``: the value typed by the key's field.

    Text keys (``str``, ``str | None``, a choice of strings) take the value as written,
    colons, braces and quotes included (``data.prompt_template=Q: {question} A:``); for
    an optional one ``null`` or ``~`` means None. Every other value (numbers, booleans,
    lists, mappings) is parsed as YAML. Nothing after ``=`` is refused: it is what an unset
    shell variable gives (``model.path=$MODEL`` silently trained the built-in model).
    """
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    if not raw.strip():
        raise ConfigError(f"{key}: no value after '=' (an unset variable?); {key}=null for none")
    annotation = field_annotation(Config, key)
    if annotation is not None and _is_text(annotation):
        if type(None) in get_args(annotation) and raw.strip() in _NULL:
            return key, None
        # a choice is a word: spaces around it are not part of it
        return key, raw.strip() if get_origin(annotation) is Literal else raw
    try:  # (as a file is read: "3e-4" is a number, YAML 1.1 wanting a dot aside)
        value = yaml.load(raw, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        opened = raw.lstrip()[:1] in ("[", "{") and raw.rstrip()[-1:] not in ("]", "}")
        hint = ""
        if opened and raw.rstrip()[-1:] in (",", ":"):  # ('[a,' 'b]', '{k:' 'v}' unquoted)
            hint = f" (the shell split it at a space: quote it whole, '{key}={raw} ...')"
        elif opened:
            hint = f" (no closing '{']' if raw.lstrip()[0] == '[' else '}'}')"
        raise ConfigError(f"{key}: cannot parse value {raw!r} as YAML{hint}") from exc
    return key, value


def _leaves(dotted: str, value: Any) -> list[str]:
    """The dotted keys of every value under ``dotted`` (``value`` a tree of mappings)."""
    if not isinstance(value, dict) or not value:
        return [dotted]
    return [leaf for k, v in value.items() for leaf in _leaves(f"{dotted}.{k}", v)]


def _get_dotted(tree: dict[str, Any], dotted: str) -> tuple[bool, Any]:
    """``(True, tree['a']['b'])`` for ``dotted = 'a.b'``, or ``(False, None)`` if unset."""
    node: Any = tree
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def with_task_defaults(tree: dict[str, Any]) -> None:
    """Fill in the built-in task's own settings (:data:`gspo.tasks.TASK_DEFAULTS`) for the
    keys the file and overrides leave unset; a run on ``data.train`` gets none of them."""
    task = _get_dotted(tree, "data.task")[1] or "addition"
    if _get_dotted(tree, "data.train")[1] is not None or task not in TASK_DEFAULTS:
        return  # an unknown task is the validation's to report
    own_model = _get_dotted(tree, "model.path")[1] is not None
    for key, value in TASK_DEFAULTS[task].items():
        if own_model and key.startswith("model."):
            continue  # the built-in model's sizes: a model.path brings its own
        if not _get_dotted(tree, key)[0]:
            set_dotted(tree, key, value)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The config from an optional YAML file plus overrides; one-line :class:`ConfigError`."""
    if isinstance(overrides, str) or not isinstance(overrides, (list, tuple)):
        raise ConfigError(
            f"overrides must be a list of 'key.sub=value' strings, got {type(overrides).__name__}"
            + (f": [{overrides!r}]?" if isinstance(overrides, str) else "")
        )
    if isinstance(path, Config | dict):
        raise ConfigError(
            f"load_config: path is a YAML file's path, got a {type(path).__name__}; a Config "
            "is used as it is, sections as a dict go to gspo.Config(**sections)"
        )
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path}: is a directory, not a YAML file")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path} (looked for {path.absolute()})")
        loaded = read_yaml(path)
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        if not loaded:  # (gspo train --config of it trained the built-in task, unsaid)
            raise ConfigError(
                f"{path}: sets nothing (empty, or comments only); leave --config out to run "
                "the defaults"
            )
        tree = {}
        for key, value in _no_null_sections(loaded).items():  # (optim.lr: 0.5 as nested)
            twice = next((k for k in _leaves(str(key), value) if _get_dotted(tree, k)[0]), None)
            if twice is not None:  # optim.lr: and optim: {lr:} in one file
                raise ConfigError(
                    f"{path}: {twice} is written twice (the second time under the top-level "
                    f"key '{key}:'); keep one"
                )
            set_dotted(tree, str(key), value)
    from_file = set(flat_settings(tree))  # (before the overrides: the file's own keys)
    given = []
    for text in overrides:
        key, value = parse_override(text)
        set_dotted(tree, key, value)
        from_file.discard(key)
        given.append(key)
    with_task_defaults(tree)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        line = error_line(exc, Config)
        first = re.split(r"[=:\s]", line, maxsplit=1)[0]  # (an unknown section's: its keys)
        ours = any(k == first or k.startswith(f"{first}.") for k in from_file)
        named = (re.search(rf"(?<![\w.]){re.escape(k)}(?![\w.])", line) for k in given)
        if path is not None and ours and not any(named):
            line = f"{path}: {line}"  # (not where the command line set a key it names)
        raise ConfigError(line) from None


def dump_config_text(config: Config) -> str:
    """The resolved config as YAML text (reloadable with :func:`load_config`)."""
    return yaml.dump(config.model_dump(mode="json"), Dumper=_Dumper, sort_keys=False)


def flat_settings(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config's settings (a :class:`Config`, or its dump's mapping) as dotted keys:
    ``{"model.lora.r": 0, ...}``."""
    if isinstance(tree, Config):
        tree = tree.model_dump(mode="json")
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flat_settings(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in out.items()}


def changed_settings(
    before: dict[str, Any], after: dict[str, Any], free: tuple[str, ...] = ()
) -> list[str]:
    """``key was -> now`` for each of the :func:`flat_settings` that differ, sorted, but
    keys beginning with one of ``free`` and a ``train.max_steps`` that grew (a run taken
    further)."""
    return [
        f"{key} {before.get(key)!r} -> {after.get(key)!r}"
        for key in sorted(after.keys() | before.keys())
        if not key.startswith(free)
        and after.get(key) != before.get(key)
        and not (key == "train.max_steps" and after[key] >= before.get(key, 0))
    ]


def dump_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML to ``path``."""
    Path(path).write_text(dump_config_text(config))
