"""The base of every config section: unknown keys are errors, assignments are validated,
and a validation error is one line naming the key (:func:`error_line`)."""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from gspo.config.ported import (
    TRL_NAMES,
    TRL_WITHOUT,
    VERL_DATA_WITHOUT,
    VERL_NAMES,
    VERL_WITHOUT,
    ported_hint,
)


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line naming it."""

    __module__ = "gspo.config"  # where it is imported from (a traceback names it so)


class Section(BaseModel):
    """A config section: an unknown key is an error, an assigned value is validated, and a
    float is finite (no inf or NaN).

    Made or assigned from Python (``Config(optim={"lr": -1})``, ``config.optim.lr = -1``),
    a bad value is a one-line :class:`ConfigError` naming the key, as a bad override is.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    #: The section's place in the config (``"optim."``), set by :mod:`gspo.config.root`.
    config_key: ClassVar[str] = ""
    #: The config it is in (its other sections' keys: ``train.eval_every``, ``eval.every``).
    config_root: ClassVar[type[BaseModel] | None] = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(error_line(exc, type(self), self.config_key)) from None

    @field_validator("*", mode="before")
    @classmethod
    def _a_number_is_not_a_boolean(cls, value: Any, info: ValidationInfo) -> Any:
        """pydantic takes ``true`` for the number 1 (``train.max_steps=true``: one step)."""
        field = cls.model_fields.get(info.field_name or "")
        kind = None if field is None else field.annotation
        if isinstance(value, bool) and _takes(kind, float) and not _takes(kind, bool):
            raise ValueError("a number, not true or false")
        if isinstance(value, os.PathLike) and _takes(kind, str):  # (a pathlib.Path)
            return os.fspath(value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            if exc.errors()[0]["type"] == "no_such_attribute":
                keys = list(type(self).model_fields)
                key = f"{self.config_key}{name}"
                root = type(self).config_root
                raise ConfigError(unknown_key(key, keys, type(self), root)) from None
            raise ConfigError(error_line(exc, type(self), self.config_key)) from None


def _takes(annotation: Any, kind: type) -> bool:
    """Whether ``annotation`` admits values of ``kind`` (``float`` also means int)."""
    if annotation is kind or annotation is Any or (kind is float and annotation is int):
        return True
    args = get_args(annotation)
    if get_origin(annotation) is Literal:
        return any(type(a) is kind for a in args)
    return get_origin(annotation) is not tuple and any(_takes(a, kind) for a in args)


def field_annotation(model: type[BaseModel], dotted: str) -> Any:
    """The annotation of ``model``'s field at ``dotted``, or None for a section or an
    unknown key."""
    *parents, leaf = dotted.split(".")
    model_at = _section(model, ".".join(parents))
    field = None if model_at is None else model_at.model_fields.get(leaf)
    return None if field is None else field.annotation


def _section(model: type[BaseModel], dotted: str) -> type[BaseModel] | None:
    """The section of ``model`` at ``dotted`` ("" = ``model``), or None."""
    for key in filter(None, dotted.split(".")):
        field = model.model_fields.get(key)
        annotation = None if field is None else field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _tuples(annotation: Any) -> list[Any]:
    """The fixed-length tuple types ``annotation`` admits."""
    if get_origin(annotation) is tuple:
        return [annotation]
    return [t for a in get_args(annotation) for t in _tuples(a)]


#: Short spellings of dtypes (torch's and TRL's) that look nothing like the names.
ALIASES = {"fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
           "bf16": "bfloat16"}  # fmt: skip


def did_you_mean(word: Any, choices: list[str], prefix: str = "", cutoff: float = 0.6) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``word`` (``prefix`` + it: the
    whole dotted key), or ``""``."""
    if ALIASES.get(str(word).lower()) in choices:
        return f"; did you mean {prefix + ALIASES[str(word).lower()]!r}?"
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=cutoff)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


def nested_key(section: type[BaseModel] | None, leaf: str) -> str | None:
    """The dotted name below ``section`` of its one key named ``leaf`` in a section inside
    it (``rollout`` and ``max_model_len``: ``vllm.max_model_len``), or None (none, or
    several: ``seed`` is data's and train's)."""
    found, stack = [], [(section, "")] if section is not None else []
    while stack:
        model, at = stack.pop()
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                if leaf in sub.model_fields and _section(sub, leaf) is None:
                    found.append(f"{at}{name}.{leaf}")
                stack.append((sub, f"{at}{name}."))
    return found[0] if len(found) == 1 else None


def unknown_key(
    key: str,
    keys: list[str],
    section: type[BaseModel] | None = None,
    root: type[BaseModel] | None = None,
) -> str:
    """The line for ``key`` (dotted, in full), unknown where its section (``section``)
    holds ``keys``: what gspo calls verl's key or TRL's field of that name
    (:func:`~gspo.config.ported.ported_hint`; ``train.eval_steps``: ``eval.every``, not
    the 0.74-similar ``train.max_steps``), else the key of that name in a section inside it
    (``rollout.max_model_len``: ``rollout.vllm.max_model_len``, not the closer spelt
    ``rollout.max_episode_tokens``), else a section's key its name spells (in ``root``, the
    whole config: ``train.eval_every``: ``eval.every``, not ``train.save_every``), else the
    closest key of the section."""
    parent, _, leaf = key.rpartition(".")
    close = did_you_mean(leaf, keys, f"{parent}." if parent else "")
    if (ported := ported_hint(key, bool(did_you_mean(leaf, keys, cutoff=0.8)))) is not None:
        return ported
    if (inside := nested_key(section, leaf)) is not None:
        return f"{key}: unknown key; did you mean {(f'{parent}.' if parent else '') + inside!r}?"
    names = [*VERL_NAMES, *VERL_WITHOUT, *VERL_DATA_WITHOUT, *TRL_NAMES, *TRL_WITHOUT]
    near = difflib.get_close_matches(leaf, names, n=1, cutoff=0.85)  # (max_prompt_len)
    if near and not did_you_mean(leaf, keys, cutoff=0.8):
        spelt = f"{parent}.{near[0]}" if parent else near[0]
        if (ported := ported_hint(spelt, False)) is not None:
            return key + ported.removeprefix(spelt)
    spelt = [f"{leaf[:i]}.{leaf[i + 1 :]}" for i, c in enumerate(leaf) if c == "_"]
    if root is not None and (named := [k for k in spelt if field_annotation(root, k)]):
        return f"{key}: unknown key; did you mean {named[0]!r}?"
    if root is not None and not did_you_mean(leaf, keys, cutoff=0.8):  # (rollout.lr: optim's)
        moved = [f"{s}.{leaf}" for s in root.model_fields if field_annotation(root, f"{s}.{leaf}")]
        if len(moved) == 1 and moved[0] != key:
            return f"{key}: unknown key; did you mean {moved[0]!r}?"
    return f"{key}: unknown key{close}"


def _below(model: type[BaseModel], key: str, value: Any, keys: list[str]) -> str | None:
    """The line for the unknown ``key`` set with keys below it, as verl spells its own
    (``actor_rollout_ref.rollout.n=8``, ``trainer.total_training_steps``): the gspo key a
    dotted tail of one is (``actor_rollout_ref.actor.optim.lr``: ``optim.lr``), else what
    gspo calls the first that is verl's or TRL's; None if none is (it said
    ``actor_rollout_ref: unknown key``, the name verl's table gives lost)."""
    if not isinstance(value, dict):
        return None
    leaf = key.rpartition(".")[2]
    close = bool(did_you_mean(leaf, keys))  # (trainr.max_steps: train, not TRL's max_steps)
    stack, dotted = [(key, value)], []  # (the dotted names of its leaves, breadth first)
    while stack:
        at, tree = stack.pop(0)
        for sub, inner in tree.items():
            if isinstance(inner, dict) and inner:
                stack.append((f"{at}.{sub}", inner))
            else:
                dotted.append(f"{at}.{sub}")
    for full in dotted:
        parts = full.split(".")
        tails = [".".join(parts[i:]) for i in range(1, len(parts) - 1)]
        if ours := next((t for t in tails if field_annotation(model, t) is not None), None):
            return f"{full}: unknown key; did you mean {ours!r}?"
    for full in dotted:  # (actor_rollout_ref.rollout.enforce_eager: rollout.vllm.enforce_eager)
        parts = full.split(".")
        for i in range(1, len(parts) - 1):
            at = ".".join(parts[i:-1])
            if (inside := nested_key(_section(model, at), parts[-1])) is not None:
                return f"{full}: unknown key; did you mean {f'{at}.{inside}'!r}?"
    return next(filter(None, (ported_hint(full, close) for full in dotted)), None)


#: How pydantic names a member of a union in an error's location ("str", "list[str]",
#: "literal['auto']"): not a key.
_UNION_MEMBER = re.compile(
    r"(str|bool|int|float|none|callable|(list|dict|tuple|literal|nullable|function-\w+|"
    r"is-instance|json-or-python)\[.*\])"
)


def _union_error(err: dict[str, Any], errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The first error with a union's member names out of its location: one member's error
    about an element (``target_modules=[q_proj, 5]``: item 1, 5) if there is one, else the
    members' messages as one ("a valid boolean or 'auto'")."""

    def key(e: dict[str, Any]) -> tuple:
        return tuple(p for p in e["loc"] if not (isinstance(p, str) and _UNION_MEMBER.fullmatch(p)))

    field = key(err)
    if field == tuple(err["loc"]):
        return err
    same = [e for e in errors if key(e)[: len(field)] == field]
    deeper = [e for e in same if len(key(e)) > len(field)]
    if deeper:
        return {**deeper[0], "loc": key(deeper[0])}
    wants = [e["msg"].removeprefix("Input should be ").split(", unable")[0] for e in same]
    message = "Input should be " + " or ".join(dict.fromkeys(wants))
    return {**err, "loc": field, "msg": message}


def _one_line_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)`` on one line, at most ``limit`` characters (a Dataset's ran over four
    lines)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_line(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """A validation error of ``model`` (at ``prefix`` in the config) on one line: the
    first error's key, message and value, with a "did you mean" for a misspelt key or
    choice."""
    errors = exc.errors()
    err = errors[0]
    inner = err.get("ctx", {}).get("error")
    if isinstance(inner, ConfigError):  # a section made inside: its line names the key
        return str(inner)
    err = _union_error(err, errors)
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        parent = where.rpartition(".")[0]
        section = _section(model, parent)
        keys = [] if section is None else list(section.model_fields)
        # (a TRL config file of seven fields took seven tries, one key each)
        more = [
            f"{prefix}{'.'.join(map(str, e['loc']))}"
            for e in errors[1:]
            if e["type"] == "extra_forbidden"
        ]
        others = f" (also unknown: {', '.join(more)})" if more else ""
        below = _below(model, f"{prefix}{where}", err.get("input"), keys)
        root = getattr(model, "config_root", None) if prefix else model
        return (below or unknown_key(f"{prefix}{where}", keys, section, root)) + others
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    if err["type"] == "missing" and isinstance(err["loc"][-1], int):  # a tuple too short
        where = where.rpartition(".")[0]
        sizes = [len(get_args(a)) for a in _tuples(field_annotation(model, where))]
        message = f"expected {' or '.join(map(str, sizes))} values"
    said = isinstance(value, dict) or where == "" or "(got " in message  # (by a validator)
    shown = "" if said else f" (got {_one_line_repr(value)})"
    if type(value).__name__ in ("Dataset", "DatasetDict", "DataFrame", "IterableDataset"):
        shown += (
            "; a data source is a path or a hub id: save the object first "
            "(dataset.save_to_disk(DIR), then the path DIR)"
        )
    rows = isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)
    if rows and f"{prefix}{where}" in ("data.train", "data.eval", "data.sft"):
        shown += (
            "; a data source is a path or a hub id: write the rows to a file first (JSON "
            "Lines: one json.dumps(row) a line), then its path"
        )
    if err["type"] == "literal_error":
        shown += did_you_mean(value, [str(a) for a in get_args(field_annotation(model, where))])
    if err["type"] in ("model_type", "dict_type") and isinstance(value, str):  # a section
        key = "model.path" if f"{prefix}{where}" == "model" else f"{prefix}{where}.KEY"
        name, eq, rest = value.partition("=")  # (KEY=VALUE given as the section's value)
        if eq and name.isidentifier() and key.endswith(".KEY"):
            key, value = f"{prefix}{where}.{name}", rest
        shown += f"; {prefix}{where} is a section of keys: {key}={value}"  # (TRL's model=)
    return f"{prefix}{where}: {message}{shown}" if where or prefix else message
