"""Several reward functions with weights (:class:`RewardFunctions`): loaded from their
specs, called on a batch, their values checked and combined into one reward each."""

from __future__ import annotations

import inspect
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.plugins import (
    counted,
    missing_arguments,
    numbered,
    one_line,
    takes_keyword,
    unexpected_arguments,
)
from gspo.rewards.contract import OFFERED, TRL_ONLY, RewardError, RewardFunction
from gspo.rewards.loading import load_reward_function
from gspo.rewards.runner import Runner


@dataclass
class RewardResult:
    """Rewards for one batch of completions.

    ``rewards[i]`` is the combined reward of completion ``i`` (the weighted sum over reward
    functions, skipping None; 0.0 if every function returned None); ``per_function[name][i]``
    is what function ``name`` returned for it (as float, or None).
    """

    rewards: list[float]
    per_function: dict[str, list[float | None]]


#: The largest reward magnitude: rewards are float32 tensors, and a group's standard
#: deviation squares them (float32 holds 3.4e38: past ~1e19 the squares overflow and
#: every advantage of the group is silently 0).
REWARD_MAX = 1e18


def _check_value(name: str, index: int, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, numbers.Real) or hasattr(type(value), "__float__")
    ):
        raise RewardError(
            f"reward function {name!r} returned a non-numeric value at index {index}: "
            f"{one_line(ValueError(repr(value)), 80)}"
        )
    try:
        converted = float(value)
    except (TypeError, ValueError) as e:
        raise RewardError(
            f"reward function {name!r} returned a non-numeric value at index {index}: "
            f"{type(value).__name__} ({type(e).__name__}: {one_line(e, 120)})"
        ) from e
    if not math.isfinite(converted):
        raise RewardError(
            f"reward function {name!r} returned a non-finite value at index {index}: "
            f"{converted} (use None for 'not applicable')"
        )
    if abs(converted) > REWARD_MAX:
        raise RewardError(
            f"reward function {name!r} returned {converted:g} at index {index}: beyond "
            f"±{REWARD_MAX:g}, past which float32 statistics of the rewards overflow; "
            "scale it down"
        )
    return converted


def _spec_name(spec: str | RewardFunction) -> str:
    if isinstance(spec, str):
        return spec.strip()
    return getattr(spec, "__name__", None) or type(spec).__name__


def metric_labels(names: Sequence[str]) -> dict[str, str]:
    """Each reward function's name as its metric calls it (``train/reward/LABEL``): a spec
    ``path/to/file.py:function`` or ``package.module:function`` by its function, as TRL
    names it (``#2`` of a repeated spec kept); the whole name where two would be the same.
    A ``by_source`` split's ``NAME/SOURCE`` is its function's label and the source as it
    is (a source ``aime:2024`` was logged as ``train/reward/2024``)."""
    split = split_names(names)
    short = {}
    for name in names:
        if name not in split:
            spec, mark, repeat = name.partition("#")
            short[name] = spec.rpartition(":")[2].strip() + mark + repeat
    counts = Counter(short.values())
    labels = {name: label if counts[label] == 1 else name for name, label in short.items()}
    for name, base in split.items():
        labels[name] = labels[base] + name[len(base) :]
    return {name: labels[name] for name in names}


def split_names(names: Sequence[str]) -> dict[str, str]:
    """Of ``names`` (``per_function``'s), the per-source entries ``NAME/SOURCE`` of a
    ``by_source`` function among them (:func:`_split`): each -> its function's NAME."""
    bases = [n for n in names if n.partition("#")[0] == "by_source"]
    return {n: b for n in names for b in bases if n.startswith(f"{b}/")}


def _split(
    name: str, values: list[float | None], keys: Sequence[Any]
) -> dict[str, list[float | None]]:
    """``values`` split by ``keys`` (a row's data_source): ``NAME/KEY`` holds the values
    of the rows of that key, None elsewhere (logged as ``train/reward/NAME/KEY``)."""
    out: dict[str, list[float | None]] = {}
    for i, key in enumerate(keys):
        column = out.setdefault(f"{name}/{key}", [None] * len(values))
        column[i] = values[i]
    return out


@dataclass
class RewardFunctions:
    """Several reward functions with weights, called together on a batch.

    Build with :meth:`from_specs`. ``names`` are the specs as given (a repeated spec gets a
    ``#2``, ``#3``... suffix), aligned with ``functions`` and ``weights``.
    """

    names: list[str]
    functions: list[RewardFunction]
    weights: list[float]
    specs: list[str | RewardFunction] = field(default_factory=list)
    runner: Runner = field(default_factory=lambda: Runner())

    @classmethod
    def from_specs(
        cls,
        specs: Sequence[str | RewardFunction],
        weights: Sequence[float] | None = None,
        *,
        workers: int = 0,
        timeout: float | None = None,
    ) -> RewardFunctions:
        """Load the reward functions named by ``specs`` (see :func:`load_reward_function`).

        A spec may also be a callable, used as is and named by its ``__name__``. ``weights``
        None means 1.0 each; otherwise it needs one finite number per spec (``reward.weights``).
        ``workers`` and ``timeout`` choose how they are called (:class:`Runner`).
        """
        if isinstance(specs, str):
            specs = [specs]
        specs = list(specs)
        if not specs:
            raise RewardError("no reward functions given: at least one reward spec is needed")
        if weights is None:
            weight_list = [1.0] * len(specs)
        else:
            if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
                raise RewardError(
                    f"reward.weights must be a list of numbers, got {type(weights).__name__}"
                )
            if len(weights) != len(specs):
                raise RewardError(
                    f"reward.weights has {len(weights)} values but there are {len(specs)} "
                    f"reward functions ({', '.join(_spec_name(s) for s in specs)})"
                )
            weight_list = []
            for i, w in enumerate(weights):
                if isinstance(w, bool) or not isinstance(w, numbers.Real):
                    raise RewardError(f"reward.weights[{i}] is not a number: {w!r}")
                if not math.isfinite(float(w)):
                    raise RewardError(f"reward.weights[{i}] is not finite: {w!r}")
                weight_list.append(float(w))

        names: list[str] = []
        functions: list[RewardFunction] = []
        seen: dict[str, int] = {}
        for spec in specs:
            if callable(spec) and not isinstance(spec, str):
                function: RewardFunction = spec
            else:
                function = load_reward_function(spec)
            base = _spec_name(spec)
            seen[base] = seen.get(base, 0) + 1
            name = base if seen[base] == 1 else f"{base}#{seen[base]}"
            while name in names:  # e.g. specs "f" "f" "f#2"
                seen[base] += 1
                name = f"{base}#{seen[base]}"
            names.append(name)
            functions.append(function)
        runner = Runner(workers=workers, timeout=timeout)
        runner.check(names, specs)  # before the run starts, not at its first batch
        return cls(names, functions, weight_list, specs=specs, runner=runner)

    def __len__(self) -> int:
        return len(self.functions)

    def check_columns(
        self, columns: Sequence[str], source: str, *, passed: Sequence[str] = (), hint: str = ""
    ) -> None:
        """Before a run starts (before anything is written or an old run removed): each
        function's required arguments, and the columns a built-in needs, are among the
        data's ``columns``; each function takes every keyword the call passes (the prompts,
        the completions, every column: by name or ``**kwargs``), as the first call would
        find out after the run started; and no column is named like the calls' own
        arguments. ``source``
        names the data (``data.train``) in the one-line :class:`RewardError`; ``passed``: the
        keywords the calls add beside the columns (an environment's ``environments``);
        ``hint`` ends the line of a missing column."""
        offered = [key for key in OFFERED if self.take(key)]  # (else the column is theirs)
        for clash in ("prompts", "completions", *offered):
            if clash in columns:
                raise RewardError(
                    f"{source}: its column {clash!r} clashes with the reward functions' "
                    "argument of that name; rename the column"
                )
        given = ["prompts", "completions", *columns, *passed]
        for name, function in zip(self.names, self.functions, strict=True):
            needed = missing_arguments(function, [*given, *OFFERED])
            needed += [c for c in getattr(function, "required_columns", ()) if c not in given]
            trl = [c for c in needed if c in TRL_ONLY]
            if trl:
                raise RewardError(
                    f"reward function {name!r} needs {trl[0]!r}, which TRL passes and gspo "
                    f"does not (docs/from_trl.md: {TRL_ONLY[trl[0]]}); give the parameter a "
                    "default (None) to run without it"
                )
            if "environments" in needed and "environments" not in passed:
                raise RewardError(
                    f"reward function {name!r} needs 'environments' (TRL's: each episode's "
                    "environment), which only a run with an environment passes: set "
                    "rollout.environment (docs/environments.md)"
                )
            if needed:
                have = ", ".join(columns) or "none but the prompt"
                singular = [n for n in needed if n in ("completion", "prompt")]
                call = (  # (TRL's shape: f(prompts, completions, **kwargs), lists)
                    f"; a reward function gets {singular[0]}s, a list, not {singular[0]}: "
                    "def f(prompts, completions, **kwargs) -> list[float]"
                    if singular
                    else ""
                ) + hint
                if "reward_model" in columns and (verl := {"answer", "tests"} & set(needed)):
                    call += (  # (verl's Parquet layout: a struct column)
                        f"; verl's data keeps it in reward_model: data.{min(verl)}_column="
                        "reward_model.ground_truth"
                    )
                raise RewardError(
                    f"reward function {name!r} needs the column(s) "
                    f"{', '.join(dict.fromkeys(needed))}, which {source} lacks (its columns: "
                    f"{have}){call}"
                )
            if unexpected := unexpected_arguments(function, given):
                whose = source if unexpected[0] in columns else "every call"
                raise RewardError(
                    f"reward function {name!r} takes no argument {unexpected[0]!r}, which "
                    f"{whose} gives (the call passes prompts, completions and every data "
                    "column, as keywords: TRL's convention); add **kwargs to its parameters"
                )

    def check_rows(self, rows: Sequence[Mapping[str, Any]], where: str) -> list[str]:
        """At the start, what a built-in reads of each row, as it reads it: the ``code``
        reward's tests parse (a row whose tests hold no assert stopped the run when it was
        first sampled, hours in), ``by_source`` has a built-in for each row's source; one
        line naming the row (``where``: the data). Returned: the functions' warning lines."""
        from gspo.rewards.code_tests import parse_tests
        from gspo.rewards.parsing import has_value

        warnings: list[str] = []
        for name, function in zip(self.names, self.functions, strict=True):
            if name.partition("#")[0] == "code":
                for i, row in numbered(rows):
                    if has_value(tests := row.get("tests")):
                        parse_tests(tests, f"{where} row {i}: tests")
            if callable(check := getattr(function, "check_rows", None)):
                warnings += check(rows, where) or []
        return warnings

    def take(self, key: str) -> bool:
        """Whether some function takes the keyword ``key`` (by name or ``**kwargs``): what
        the calls offer beside the data (:data:`gspo.rewards.contract.OFFERED`) is made
        only then."""
        return any(takes_keyword(function, key) for function in self.functions)

    def trl_defaults(self) -> list[str]:
        """A warning line for each function with a parameter only TRL passes
        (``trainer_state``, ``log_metric``, ...) that has a default: it always gets
        the default here."""
        lines = []
        for name, function in zip(self.names, self.functions, strict=True):
            try:
                parameters = inspect.signature(function).parameters
            except (TypeError, ValueError):
                continue
            for key in TRL_ONLY:
                if key in parameters and parameters[key].default is not inspect.Parameter.empty:
                    lines.append(
                        f"reward function {name!r} takes {key!r}, which TRL passes and gspo "
                        f"does not (docs/from_trl.md): it always gets its default "
                        f"({parameters[key].default!r:.40})"
                    )
        return lines

    def required(self, columns: Sequence[str]) -> dict[str, str]:
        """Of ``columns``, those some function cannot do without (its required arguments, a
        built-in's columns): column -> the first such function's name."""
        out: dict[str, str] = {}
        for name, function in zip(self.names, self.functions, strict=True):
            needed = missing_arguments(function, ["prompts", "completions"])
            for column in [*needed, *getattr(function, "required_columns", ())]:
                if column in columns:
                    out.setdefault(column, name)
        return out

    def close(self) -> None:
        """Stop the worker processes, if any (also done when the object is collected)."""
        self.runner.close()

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        columns: Mapping[str, Sequence[Any]] | None = None,
    ) -> RewardResult:
        """Score ``completions`` with every function and combine the results.

        Each function is called as ``f(prompts=prompts, completions=completions, **columns)``
        where every column is a list aligned with ``completions``. The combined reward of a
        completion is ``sum(weight * value)`` over the functions whose value is not None (0.0
        if all are None). Raises :class:`RewardError`, naming the function, if one raises,
        returns something other than a list/tuple of the right length, or returns a value
        that is neither None nor a finite number.
        """
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"got {len(prompts)} prompts for {n} completions")
        columns = dict(columns or {})
        for key, values in columns.items():
            if key in ("prompts", "completions"):
                raise RewardError(
                    f"dataset column {key!r} clashes with the reward function argument "
                    f"of the same name; rename the column"
                )
            try:
                count = len(values)
            except TypeError:
                raise RewardError(
                    f"dataset column {key!r} must be a list aligned with completions, "
                    f"got {type(values).__name__}"
                ) from None
            if isinstance(values, (str, bytes)) or count != n:
                raise RewardError(f"dataset column {key!r} has {count} values for {n} completions")

        per_function: dict[str, list[float | None]] = {}
        specs = self.specs or self.functions
        outputs = self.runner.run(self.names, self.functions, specs, prompts, completions, columns)
        for name, raw in zip(self.names, outputs, strict=True):
            if not isinstance(raw, (list, tuple)):
                shape = getattr(raw, "shape", None)  # (a 1-D array became a list: a 2-D not)
                shown = "" if shape is None else f" of shape {tuple(shape)}"
                raise RewardError(
                    f"reward function {name!r} returned {type(raw).__name__}{shown}, "
                    f"expected a list of float or None (or a 1-D array of {n})"
                )
            if len(raw) != n:
                raise RewardError(
                    f"reward function {name!r} returned {counted(len(raw), 'value')} for {n} "
                    "completions (one "
                    "for each, in their order)"
                )
            per_function[name] = [_check_value(name, i, v) for i, v in enumerate(raw)]
        for name, function in zip(self.names, self.functions, strict=True):
            if (split := getattr(function, "split_by", None)) in columns:  # (by_source's)
                per_function |= _split(name, per_function[name], columns[split])

        rewards = []
        for i in range(n):
            total = 0.0
            for name, weight in zip(self.names, self.weights, strict=True):
                value = per_function[name][i]
                if value is not None:
                    total += weight * value
            if not abs(total) <= REWARD_MAX:
                raise RewardError(
                    f"the weighted sum of {', '.join(map(repr, self.names))} at index {i} is "
                    f"{total:g}: beyond ±{REWARD_MAX:g}, past which float32 statistics of "
                    "the rewards overflow; lower reward.weights or the values"
                )
            rewards.append(total)
        return RewardResult(rewards=rewards, per_function=per_function)
