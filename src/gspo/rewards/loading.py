"""A reward function from its spec: a built-in name, ``file.py:function`` or
``package.module:function`` (:func:`load_reward_function`)."""

from __future__ import annotations

import difflib

from gspo.plugins import load_object
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
    if "," in spec and ":" not in spec:  # reward.functions='a, b': one string, not a list
        listed = ", ".join(part.strip() for part in spec.split(","))
        raise RewardError(
            f"invalid reward function spec {spec!r}: several functions are a list, "
            f"reward.functions='[{listed}]'"
        )
    close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
    if close and ":" not in spec:
        raise RewardError(
            f"invalid reward function spec {spec!r}: not a built-in name "
            f"({_builtin_names()}); did you mean {close[0]!r}?"
        )
    expected = (
        f"a built-in name ({_builtin_names()}), 'path/to/file.py:function' or "
        "'package.module:function'"
    )
    return load_object(spec, "reward function", RewardError, expected)
