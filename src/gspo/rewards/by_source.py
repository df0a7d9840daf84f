"""The ``by_source`` reward (:class:`BySource`): each row scored by the built-in its
``data_source`` column names, as verl's ``default_compute_score`` picks a scorer per row.

:data:`VERL_SOURCES` is verl's table in gspo's built-ins; ``reward.sources`` overrides and
extends it (a key ending in ``*`` names every source it starts), a source's scorer a
built-in or a function of one's own (``path/to/file.py:function``,
``package.module:function``, loaded as ``reward.functions`` loads one: verl's
``custom_reward_function`` for some sources). A row whose source the table lacks stops the
run, at its start, in one line naming the source and the key to set.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.plugins import (
    PYTHON_OBJECT,
    counted,
    missing_arguments,
    numbered,
    object_spec,
    some_of,
    unexpected_arguments,
)
from gspo.rewards.code_tests import parse_tests
from gspo.rewards.contract import OFFERED, RewardError
from gspo.rewards.loading import load_reward_function, reward_spec_problem
from gspo.rewards.parsing import cell_text, has_value
from gspo.rewards.runner import _call_one, _offered_to
from gspo.rewards.verifiers import BUILTIN_REWARDS, CodeReward

#: The column that names a row's source (verl's).
SOURCE_COLUMN = "data_source"

_MATH_SETS = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_NUMINA = ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc", "cn_k12", "olympiads")

#: verl's ``default_compute_score`` table, each scorer as the gspo built-in closest to it:
#: gsm8k (its ``#### 72``) is numeric_match; MATH's, math_dapo's and prime_math's rules
#: are math (math-verify); prime_code and sandbox_fusion are code.
VERL_SOURCES: dict[str, str] = {
    "openai/gsm8k": "numeric_match",
    **dict.fromkeys(_MATH_SETS, "math"),
    **dict.fromkeys(("math_dapo", "math", "math_dapo_reasoning", "aime*"), "math"),
    **{f"numina_{name}": "math" for name in _NUMINA},
    **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"), "code"),
}

#: The built-ins a source may be scored by.
ROUTABLE = ("code", "exact_match", "format", "math", "numeric_match")

#: What scores a source: a built-in's name (:data:`ROUTABLE`), a reward function's spec
#: (``path/to/file.py:function``, ``package.module:function``) or, from Python, a function.
Route = str | Callable[..., Any]


def source_problem(source: str, name: Any) -> str | None:
    """What makes ``reward.sources``' entry ``source: name`` no route, read as text alone
    (what a spec names is looked for when the run starts: :meth:`BySource.check_rows`), or
    None."""
    if not str(source).strip():
        return "an empty source name"
    if callable(name) and not isinstance(name, str):
        return None
    text = name.strip() if isinstance(name, str) else ""
    if text in ROUTABLE or text.startswith(PYTHON_OBJECT):  # (that: said as it loads)
        return None
    if ":" in text or "." in text:  # (a spec, as reward.functions reads one)
        problem = reward_spec_problem(text)
        return None if problem is None else f"{source}: {problem}"
    close = difflib.get_close_matches(text, ROUTABLE, n=1)
    return (
        f"{source}: {name!r} is not a built-in a source is scored by ({', '.join(ROUTABLE)}) "
        "nor a function of one's own (path/to/file.py:function, package.module:function)"
        + (f"; did you mean {close[0]!r}?" if close else "")
    )


def route_label(name: Route) -> str:
    """A source's scorer as its messages name it: the built-in's name or the spec, or a
    function's ``module:name``."""
    return name.strip() if isinstance(name, str) else object_spec(name)


@dataclass(frozen=True, eq=False)
class BySource:
    """Each row scored by the built-in its ``data_source`` names (:data:`VERL_SOURCES`,
    with ``sources`` over it); ``code`` scored as ``code_scoring`` says. A module-level
    class, so that ``reward.workers`` processes get it by pickle; hashed as itself (a
    function is), its ``sources`` a dict."""

    sources: Mapping[str, Route] = field(default_factory=dict)
    code_scoring: str = "fraction"
    __name__ = "by_source"
    required_columns = (SOURCE_COLUMN,)
    #: the per-source means are logged as train/reward/by_source/SOURCE
    split_by = SOURCE_COLUMN
    #: its errors' lines name the source and what scores it (passed on as they are)
    names_its_errors = True

    def __post_init__(self) -> None:  # (from Python too: a KeyError at the first batch)
        for source, name in self.sources.items():
            if (problem := source_problem(source, name)) is not None:
                raise RewardError(f"reward.sources: {problem}")
        object.__setattr__(self, "_loaded", {})  # spec -> function, loaded in this process

    def __getstate__(self) -> dict[str, Any]:  # (a function loaded from a file: by its spec)
        return {k: v for k, v in vars(self).items() if k != "_loaded"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in {**state, "_loaded": {}}.items():
            object.__setattr__(self, key, value)

    @property
    def reads_columns(self) -> tuple[str, ...] | None:
        """What it passes on where it runs aside (:meth:`main_thread_spec`): the built-ins'
        columns; None (every column) where a function of one's own scores some source."""
        if all(isinstance(n, str) and n in ROUTABLE for n in self.sources.values()):
            return (SOURCE_COLUMN, "answer", "tests")
        return None

    @property
    def main_thread_spec(self) -> BySource:
        """Itself, sent to the one worker process where math-verify's time limits hold,
        as ``math``'s spec is (:class:`gspo.rewards.runner.Runner`)."""
        return self

    def table(self) -> dict[str, Route]:
        return {**VERL_SOURCES, **self.sources}

    def route(self, source: Any) -> Route:
        """What scores a row of ``source`` (a built-in's name, a spec, a function); a
        :class:`RewardError` naming the source and ``reward.sources`` where none does."""
        return self.table()[self.entry(source)]

    def entry(self, source: Any) -> str:
        """The key of the table that routes ``source`` (its own, or the longest prefix)."""
        table = self.table()
        key = "" if cell_text(source) is None else str(source)
        if key in table:
            return key
        prefixes = [p for p in table if p.endswith("*") and key.startswith(p[:-1])]
        if key and prefixes:
            return max(prefixes, key=len)
        if not key:
            raise RewardError(
                f"reward 'by_source': a row without a data_source ({source!r}), which names "
                "the built-in that scores it: give every row one"
            )
        named = f"data_source {source!r}"
        example = key if key.isidentifier() else "SOURCE"
        raise RewardError(
            f"reward 'by_source': {named} is none of its sources (verl's, and "
            f"reward.sources); set reward.sources={{{example}: math}} (or one of "
            f"{', '.join(ROUTABLE)}, or path/to/file.py:function)"
        )

    def function(self, entry: str) -> Callable[..., Any]:
        """The function that scores the rows the table's key ``entry`` routes: a built-in,
        a function given, or one loaded by its spec (once in each process; a one-line
        :class:`RewardError` naming the key where it cannot be)."""
        name = self.table()[entry]
        if not isinstance(name, str):
            return name
        if name == "code":
            return CodeReward(self.code_scoring)
        if name in ROUTABLE:
            return BUILTIN_REWARDS[name]
        loaded: dict[str, Callable[..., Any]] = vars(self)["_loaded"]
        if name not in loaded:
            try:
                loaded[name] = load_reward_function(name)
            except RewardError as e:
                raise RewardError(f"reward.sources: {entry}: {e}") from None
        return loaded[name]

    def _check_own(self, entry: str, row: Mapping[str, Any], where: str) -> None:
        """A function of one's own that routes ``entry`` loads and takes the call's
        keywords (the prompts, the completions, every column), as the first batch that
        samples such a row would find out hours in."""
        function = self.function(entry)
        label = f"{route_label(self.table()[entry])!r} (reward.sources: {entry})"
        given = ["prompts", "completions", *(k for k in row if k != "prompt")]
        if needed := missing_arguments(function, [*given, *OFFERED]):
            raise RewardError(
                f"{where}: data_source {row.get(SOURCE_COLUMN)!r} is scored by {label}, "
                f"which needs the column(s) {', '.join(needed)}, which the data lacks"
            )
        if unexpected := unexpected_arguments(function, given):
            raise RewardError(
                f"{where}: reward function {label} takes no argument {unexpected[0]!r}, "
                "which the call passes (prompts, completions and every data column, as "
                "keywords: TRL's convention); add **kwargs to its parameters"
            )

    def check_rows(self, rows: Sequence[Mapping[str, Any]], where: str) -> list[str]:
        """At the start: every row's source has a built-in, and the row what it reads (an
        ``answer``, parsing ``tests``); one line naming the row and the key to set.
        Returned: a warning line for each column some rows leave empty (not scored)."""
        empty: dict[str, list[int]] = {}
        own: set[str] = set()  # (the keys routing to a function of one's own, checked)
        for i, row in numbered(rows):
            try:
                entry = self.entry(row.get(SOURCE_COLUMN))
            except RewardError as e:
                raise RewardError(f"{where} row {i}: {e}") from None
            name = self.table()[entry]
            if not (isinstance(name, str) and name in ROUTABLE):
                if entry not in own:
                    self._check_own(entry, row, f"{where} row {i}")
                    own.add(entry)
                continue  # (what it makes of an empty cell is its own call)
            column = ("tests",) if name == "code" else ("answer",) if name != "format" else ()
            for needed in column:
                if needed not in row:
                    raise RewardError(
                        f"{where} row {i}: data_source {row[SOURCE_COLUMN]!r} is scored by "
                        f"{name}, which reads the column {needed!r}, which the row lacks; "
                        f"verl's data keeps it in reward_model: "
                        f"data.{needed}_column=reward_model.ground_truth"
                    )
                if not has_value(row[needed]):
                    empty.setdefault(needed, []).append(i)
            if name == "code" and has_value(row["tests"]):
                parse_tests(row["tests"], f"{where} row {i}: tests")
        return [
            f"{where}: {some_of(found, len(rows), 'row')} no {column!r}, which reward "
            "function 'by_source' reads for their data_source: their completions are not scored"
            for column, found in empty.items()
        ]

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        sources = columns.get(SOURCE_COLUMN)
        if sources is None:
            raise RewardError(f"built-in reward 'by_source' needs the column {SOURCE_COLUMN!r}")
        rows: dict[str, list[int]] = {}
        for i, source in enumerate(sources):
            rows.setdefault(self.entry(source), []).append(i)
        out: list[float | None] = [None] * len(completions)
        for entry, picked in rows.items():
            function, label = self.function(entry), route_label(self.table()[entry])
            own = "" if label in ROUTABLE else f" (reward.sources: {entry})"
            try:  # (an async def, an array, a failure: as reward.functions' are called)
                values = _call_one(
                    label,
                    function,
                    [prompts[i] for i in picked],
                    [completions[i] for i in picked],
                    _offered_to(function, {k: [v[i] for i in picked] for k, v in columns.items()}),
                )
            except RewardError as e:
                raise RewardError(str(e).replace(f"{label!r}", f"{label!r}{own}", 1)) from e
            if not isinstance(values, (list, tuple)) or len(values) != len(picked):
                got = (
                    counted(len(values), "value")
                    if isinstance(values, (list, tuple))
                    else type(values).__name__
                )
                raise RewardError(
                    f"reward function {label!r}{own} returned {got} for the {len(picked)} "
                    "completions of its rows (one for each)"
                )
            for i, value in zip(picked, values, strict=True):
                out[i] = value
        return out


BUILTIN_REWARDS["by_source"] = BySource()
