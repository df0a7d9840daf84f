"""A reward function from its spec: a built-in name, ``file.py:function`` or
``package.module:function`` (:func:`load_reward_function`)."""

from __future__ import annotations

import difflib

from gspo.plugins import PYTHON_OBJECT, load_object, spec_form
from gspo.rewards.contract import RewardError, RewardFunction
from gspo.rewards.verifiers import BUILTIN_REWARDS


def _builtin_names() -> str:
    return ", ".join(sorted(BUILTIN_REWARDS))


def load_reward_function(spec: str) -> RewardFunction:
    """Load a reward function from its spec.

    ``spec`` is a built-in name (see :data:`BUILTIN_REWARDS`), ``path/to/file.py:function``
    (relative to the current directory, or absolute; the file is imported as a module under a
    unique name, with its directory on ``sys.path`` while it is imported), or
    ``package.module:function`` (``function`` may be a dotted attribute path).

    The returned function is called TRL-style:
    ``f(prompts=prompts, completions=completions, **columns) -> list[float | None]``.

    Raises :class:`RewardError` (one line, naming the spec) if the spec is malformed, the file
    does not exist, the import fails, the attribute is missing or is not callable.
    """
    if not isinstance(spec, str):
        raise RewardError(
            f"a reward function spec must be a string, got {type(spec).__name__}: {spec!r}"
        )
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if (problem := reward_spec_problem(spec)) is not None:
        raise RewardError(problem)
    return load_object(spec, "reward function", RewardError, _expected())


def _expected() -> str:
    return (
        f"a built-in name ({_builtin_names()}), 'path/to/file.py:function' or "
        "'package.module:function'"
    )


def reward_spec_problem(spec: str) -> str | None:
    """What makes the string ``spec`` no reward function, read as text alone (a misspelt
    built-in, a file without its function, a list written as one string): ``gspo config``
    and a config made in Python say it before a run starts. None where it may load (what
    it names is looked for when it is loaded)."""
    spec = spec.strip()
    if spec in BUILTIN_REWARDS or spec.startswith(PYTHON_OBJECT):
        return None
    if "," in spec and ":" not in spec:  # reward.functions='a, b': one string, not a list
        listed = ", ".join(part.strip() for part in spec.split(","))
        return (
            f"invalid reward function spec {spec!r}: several functions are a list, "
            f"reward.functions='[{listed}]'"
        )
    close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
    if close and ":" not in spec:
        return (
            f"invalid reward function spec {spec!r}: not a built-in name "
            f"({_builtin_names()}); did you mean {close[0]!r}?"
        )
    return spec_form(spec, "reward function", _expected())
