"""The rows' reward columns checked before a run starts (:func:`check_reward_columns`):
a column a reward function needs, missing (an error) or left empty in some rows, and gold
answers a built-in cannot score (warnings)."""

from __future__ import annotations

from typing import Any

from gspo.config import Config
from gspo.data import not_an_answer
from gspo.plugins import numbered, some_of
from gspo.rewards import RewardFunctions
from gspo.rewards.by_source import SOURCE_COLUMN, BySource
from gspo.rewards.parsing import _gold_number, has_value
from gspo.rewards.verifiers import BUILTIN_REWARDS
from gspo.tasks import TaskData

#: The built-in whose gold answers must be numbers.
ROUTE = "numeric_match"


def check_reward_columns(
    rewards: RewardFunctions, data: TaskData, config: Config, environment: Any | None
) -> list[str]:
    """Before the run writes anything (or ``--overwrite`` removes an old run): the reward
    functions find the columns they need in the training and the held-out rows (an
    environment adds ``environments``); one line naming the data that lacks one. Returned:
    a warning line for each such column that some rows leave empty (None, blank text or
    an empty list: a built-in does not score their completions, so in training their
    groups teach nothing; the user's own function is called with them as they are), and for
    a function's parameter that only TRL fills."""
    extra = ["environments"] if environment is not None else []
    hint = ""
    if environment is not None and "functions" not in config.reward.model_fields_set:
        hint = (  # (one with get_reward is scored by it: with_environment_reward)
            f"; the environment has no get_reward, so reward.functions scores its "
            f"episodes, and its default is [{', '.join(map(str, config.reward.functions))}]: "
            "set reward.functions"
        )
    warnings = rewards.trl_defaults()
    for key, rows in (("data.train", data.train), ("data.eval", data.eval)):
        if rows:
            where = config.data.source_of(key)
            columns = [k for k in rows[0] if k != "prompt"]
            rewards.check_columns(columns, f"{key} ({where})", passed=extra, hint=hint)
            compared = [  # (the built-ins that compare it, wherever they are in the list)
                n
                for n, f in zip(rewards.names, rewards.functions, strict=True)
                if n.partition("#")[0] in BUILTIN_REWARDS
                and "answer" in getattr(f, "required_columns", ())
            ]
            if "answer" in columns and compared:
                _answers_are_text(numbered(rows), compared[0], f"{key} ({where})")
                numeric = [n for n in compared if n.partition("#")[0] == "numeric_match"]
                warnings += _not_numbers(numbered(rows), len(rows), numeric[:1], f"{key} ({where})")
            for column, name in rewards.required(columns).items():
                empty = [i for i, row in numbered(rows) if not has_value(row.get(column))]
                if empty:  # (a built-in leaves them unscored; the user's decides)
                    gets = (
                        "their completions are not scored"
                        if name.partition("#")[0] in BUILTIN_REWARDS  # (exact_match#2 too)
                        else f"it is called with their {column} as it is (None, blank or [])"
                    )
                    warnings.append(
                        f"{key} ({where}): {some_of(empty, len(rows), 'row')} no {column!r}, "
                        f"which reward function {name!r} needs: "
                        f"{gets}"
                    )
            warnings += rewards.check_rows(rows, f"{key} ({where})")  # (code's, by_source's)
            warnings += _routed_answers(rewards, rows, f"{key} ({where})")
    return warnings


def _routed_answers(rewards: RewardFunctions, rows: list[dict], where: str) -> list[str]:
    """For ``by_source``: the rows it routes to a built-in that compares the answer, as
    for that built-in named in ``reward.functions`` (its routes checked already)."""
    warnings = []
    for name, function in zip(rewards.names, rewards.functions, strict=True):
        if not isinstance(function, BySource):
            continue
        routes = [(i, row, function.route(row.get(SOURCE_COLUMN))) for i, row in numbered(rows)]
        compared = [(i, row) for i, row, r in routes if r in ("exact_match", "math", ROUTE)]
        _answers_are_text(compared, name, where)
        numeric = [(i, row) for i, row, route in routes if route == ROUTE]
        how = f" scores with {ROUTE} for their data_source, which"
        warnings += _not_numbers(numeric, len(rows), [name], where, how)
    return warnings


def _answers_are_text(rows: list[tuple[int, dict]], name: str, where: str) -> None:
    """Every row's ``answer`` one a built-in reward compares (a mapping's repr was the
    gold answer: every completion scored 0, unsaid); else one line naming the row.
    ``rows``: the rows it compares, each with its number."""
    for i, row in rows:
        if said := not_an_answer(row.get("answer")):
            raise ValueError(
                f"{where} row {i}: the answer (column 'answer', which reward function "
                f"{name!r} compares) {said}"
            )


def _not_numbers(
    rows: list[tuple[int, dict]], total: int, named: list[str], where: str, how: str = ""
) -> list[str]:
    """A warning line when some rows' gold answer is no number (``seven``, ``inf``):
    ``numeric_match`` returns None for them, so their completions are never scored by it,
    and their groups teach nothing where it is the only reward. Rows with no answer at all
    are said by :func:`check_reward_columns` already. ``rows``: those ``named[0]`` scores,
    each with its number, of ``total`` (none named: nothing to say; ``by_source``'s, which
    it scores with numeric_match: ``how`` says so)."""
    if not named:
        return []
    found = []
    for i, row in rows:
        gold = row.get("answer")
        golds = list(gold) if isinstance(gold, (list, tuple)) else [gold]  # (any of them)
        if has_value(gold) and all(_gold_number(one) is None for one in golds):
            found.append((i, gold))
    if not found:
        return []
    return [
        f"{where}: {some_of([i for i, _ in found], total, 'row')} a gold answer that is not a "
        f"number, as {str(found[0][1])[:60]!r}, which reward function {named[0]!r}{how} never "
        "scores (None): their completions are not scored by it"
    ]
