"""The ``by_source`` reward (:class:`BySource`): each row scored by the built-in its
``data_source`` column names, as verl's ``default_compute_score`` picks a scorer per row.

:data:`VERL_SOURCES` is verl's table in gspo's built-ins; ``reward.sources`` overrides and
extends it (a key ending in ``*`` names every source it starts). A row whose source the
table lacks stops the run, at its start, in one line naming the source and the key to set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gspo.plugins import some_of
from gspo.rewards.code_tests import parse_tests
from gspo.rewards.contract import RewardError
from gspo.rewards.parsing import cell_text, has_value
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


def source_problem(source: str, name: Any) -> str | None:
    """What makes ``reward.sources``' entry ``source: name`` no route, or None."""
    if not str(source).strip():
        return "an empty source name"
    if name not in ROUTABLE:
        return f"{source}: {name!r} is not a built-in a source is scored by ({', '.join(ROUTABLE)})"
    return None


@dataclass(frozen=True, eq=False)
class BySource:
    """Each row scored by the built-in its ``data_source`` names (:data:`VERL_SOURCES`,
    with ``sources`` over it); ``code`` scored as ``code_scoring`` says. A module-level
    class, so that ``reward.workers`` processes get it by pickle; hashed as itself (a
    function is), its ``sources`` a dict."""

    sources: Mapping[str, str] = field(default_factory=dict)
    code_scoring: str = "fraction"
    __name__ = "by_source"
    required_columns = (SOURCE_COLUMN,)
    #: the per-source means are logged as train/reward/by_source/SOURCE
    split_by = SOURCE_COLUMN

    #: what it passes on to the built-ins (where it runs aside: :meth:`main_thread_spec`)
    reads_columns = (SOURCE_COLUMN, "answer", "tests")

    @property
    def main_thread_spec(self) -> BySource:
        """Itself, sent to the one worker process where math-verify's time limits hold,
        as ``math``'s spec is (:class:`gspo.rewards.runner.Runner`)."""
        return self

    def table(self) -> dict[str, str]:
        return {**VERL_SOURCES, **self.sources}

    def route(self, source: Any) -> str:
        """The built-in that scores a row of ``source``; a :class:`RewardError` naming the
        source and ``reward.sources`` where the table has none."""
        table = self.table()
        key = "" if cell_text(source) is None else str(source)
        if key in table:
            return table[key]
        prefixes = [p for p in table if p.endswith("*") and key.startswith(p[:-1])]
        if key and prefixes:
            return table[max(prefixes, key=len)]
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
            f"{', '.join(ROUTABLE)})"
        )

    def function(self, name: str) -> Any:
        if name == "code":
            return CodeReward(self.code_scoring)
        return BUILTIN_REWARDS[name]

    def check_rows(self, rows: Sequence[Mapping[str, Any]], where: str) -> list[str]:
        """At the start: every row's source has a built-in, and the row what it reads (an
        ``answer``, parsing ``tests``); one line naming the row and the key to set.
        Returned: a warning line for each column some rows leave empty (not scored)."""
        empty: dict[str, list[int]] = {}
        for i, row in enumerate(rows, start=1):
            try:
                name = self.route(row.get(SOURCE_COLUMN))
            except RewardError as e:
                raise RewardError(f"{where} row {i}: {e}") from None
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
            rows.setdefault(self.route(source), []).append(i)
        out: list[float | None] = [None] * len(completions)
        for name, picked in rows.items():
            values = self.function(name)(
                prompts=[prompts[i] for i in picked],
                completions=[completions[i] for i in picked],
                **{k: [v[i] for i in picked] for k, v in columns.items()},
            )
            for i, value in zip(picked, values, strict=True):
                out[i] = value
        return out


BUILTIN_REWARDS["by_source"] = BySource()
