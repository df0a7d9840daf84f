"""The ``reward`` section: the reward functions and what shapes their sum."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, field_serializer, field_validator

from gspo.config.section import Section
from gspo.plugins import object_spec


class RewardConfig(Section):
    """Reward functions, called on every rollout batch and combined into one scalar reward.

    They follow TRL's convention (``prompts``, ``completions`` and every dataset column as
    keyword arguments, one float or ``None`` per completion), so TRL reward functions work
    unchanged; ``None`` is left out of the weighted sum.
    """

    functions: list[str | Callable[..., Any]] = Field(
        default_factory=lambda: ["exact_match"],
        description="Built-ins (exact_match, numeric_match, math, format, code; environment: "
        "the rollout.environment's get_reward; by_source: each row by the built-in its "
        "data_source names, reward.sources) or "
        "path/to/file.py:function / package.module:function; one name alone is a list of one; "
        "from Python also the functions themselves (docs/python.md)",
    )
    weights: list[float] | None = Field(
        None,
        description="One weight per function for the weighted sum (one number alone is a "
        "list of one); null = 1.0 each",
    )
    workers: int = Field(
        0,
        ge=0,
        description="Worker processes that score each rollout batch in parallel chunks; "
        "0 = in the trainer process (the only choice with rollout.environment, whose "
        "environments the reward functions get)",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds the reward functions may take per rollout batch before the run "
        "stops with one line naming the function (hung workers killed; with workers=0 the "
        "call is left running in its thread); null = no limit",
    )
    overlong_penalty: float = Field(
        0.0,
        ge=0.0,
        description="DAPO's soft overlong punishment on training rewards (not evaluation): "
        "0 up to rollout.max_new_tokens (with an environment: max_episode_tokens) - "
        "overlong_buffer tokens, then falling linearly to "
        "-overlong_penalty at the limit; 0 = off (DAPO: 1.0)",
    )
    overlong_buffer: int | None = Field(
        None,
        ge=1,
        description="Tokens before the limit where the overlong penalty ramps (the limit: "
        "rollout.max_new_tokens, with an environment rollout.max_episode_tokens); null = a "
        "fifth of that limit (DAPO: 4096 of 20480)",
    )

    code_scoring: Literal["fraction", "all"] = Field(
        "fraction",
        description="The code reward of a program: fraction = the fraction of its row's tests "
        "it passes; all = 1 where it passes every one, else 0 (PRIME's prime_code by default, "
        "DeepCoder, Skywork-OR1: partial credit rewards programs that special-case the easy "
        "tests; docs/code_reward.md)",
    )

    sources: dict[str, str | Callable[..., Any]] = Field(
        default_factory=dict,
        description="The by_source reward: data_source -> the built-in that scores its rows "
        "(math, numeric_match, exact_match, format, code) or a function of one's own "
        "(path/to/file.py:function / package.module:function, as in reward.functions; from "
        "Python also the function itself), over verl's table (openai/gsm8k: "
        "numeric_match; lighteval/MATH, HuggingFaceH4/MATH-500, math_dapo, aime*, its six "
        "numina_ sets (numina_cn_k12, ...): math; apps, taco, codecontests, "
        "codeforces: code); a key ending in * names every source it starts, e.g. "
        "{my_math: math, my_code: code, my_chem: my_rewards.py:score}",
    )

    @field_validator("sources")
    @classmethod
    def _routable(
        cls, value: dict[str, str | Callable[..., Any]]
    ) -> dict[str, str | Callable[..., Any]]:
        from gspo.rewards.by_source import source_problem

        for source, name in value.items():
            if (problem := source_problem(source, name)) is not None:
                raise ValueError(problem)
        return value

    @field_validator("functions", mode="before")
    @classmethod
    def _one_function(cls, value: Any) -> Any:
        mappings = [
            v for v in (value if isinstance(value, list) else [value]) if isinstance(v, dict)
        ]
        one = mappings[0] if mappings and len(mappings[0]) == 1 else {}
        # ('rw.py: fn', as YAML reads a space after ':'; a dict from Python is no such slip)
        if one and all(isinstance(v, str | None) for v in (*one, *one.values())):
            ((source, name),) = one.items()
            raise ValueError(
                f"{{{source}: {name}}} was read as a mapping (YAML takes ': ' as one); "
                f"write {source}:{name}, without the space"
            )
        value = [value] if isinstance(value, str) or callable(value) else value
        for i, item in enumerate(value if isinstance(value, list) else []):
            if not (isinstance(item, str) or callable(item)):
                raise ValueError(
                    f"item {i} is neither a spec string nor a function: {type(item).__name__}"
                )
        return value

    @field_validator("weights", mode="before")
    @classmethod
    def _one_weight(cls, value: Any) -> Any:
        """One number alone is a list of one, as one function name is."""
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if isinstance(value, str) and len(parts := value.replace(",", " ").split()) > 1:
            raise ValueError(  # ('1,2' from the command line: as reward.functions says)
                f"several weights are a list, reward.weights='[{', '.join(parts)}]'"
            )
        return [value] if is_number else value

    @field_serializer("functions")
    def _as_specs(self, functions: list[str | Callable[..., Any]]) -> list[str]:
        """Functions given as Python objects are written as the spec that loads them
        (``module:function``), or as ``<python object NAME>`` where none can."""
        return [f if isinstance(f, str) else object_spec(f) for f in functions]

    @field_serializer("sources")
    def _sources_as_specs(self, sources: dict[str, str | Callable[..., Any]]) -> dict[str, str]:
        """A source's function given as itself written as ``functions``' are."""
        return {k: v if isinstance(v, str) else object_spec(v) for k, v in sources.items()}

    def check_functions(self) -> None:
        """At least one function, and each spec string well formed as text (a misspelt
        built-in, a file without its ``:function``): said by ``gspo config`` and by a
        config made in Python, before a run starts; what a spec names is looked for when
        the run loads it."""
        from gspo.rewards.loading import reward_spec_problem

        if not self.functions:
            raise ValueError(
                "reward.functions: empty; name one at least (a built-in such as exact_match, "
                "or path/to/file.py:function)"
            )
        for spec in self.functions:
            if isinstance(spec, str) and (problem := reward_spec_problem(spec)) is not None:
                raise ValueError(f"reward.functions: {problem}")

    def check_code_scoring(self) -> None:
        """``code_scoring=all`` scores the built-in ``code`` reward, which is named (or
        ``by_source``, which may route rows to it); ``sources`` routes for ``by_source``."""
        if self.sources and not any(map(_is_by_source, self.functions)):
            raise ValueError(
                "reward.sources routes the rows of the by_source reward, which "
                "reward.functions does not name: add by_source, or drop reward.sources"
            )
        named_code = any(_is_code(f) or _is_by_source(f) for f in self.functions)
        if self.code_scoring != "fraction" and not named_code:
            named = ", ".join(map(str, self._as_specs(list(self.functions))))
            raise ValueError(
                f"reward.code_scoring={self.code_scoring} scores the built-in code reward, "
                f"which reward.functions ({named}) does not name: add code, or drop "
                "reward.code_scoring"
            )

    def specs(self) -> list[str | Callable[..., Any]]:
        """``functions`` as they are loaded: the built-in ``code`` scored as
        ``code_scoring`` says (:class:`gspo.rewards.verifiers.CodeReward`), ``by_source``
        routed as ``sources`` says (:class:`gspo.rewards.by_source.BySource`)."""
        if self.code_scoring == "fraction" and not self.sources:
            return list(self.functions)
        from gspo.rewards.by_source import BySource
        from gspo.rewards.verifiers import CodeReward

        code = CodeReward(self.code_scoring)
        by_source = BySource(dict(self.sources), self.code_scoring)
        # (a CodeReward passed as itself keeps its scoring where code_scoring is left alone)
        rescored = [_is_code(f) and (isinstance(f, str) or self.code_scoring != "fraction")
                    for f in self.functions]  # fmt: skip
        return [
            code if again else by_source if _is_by_source(f) else f
            for f, again in zip(self.functions, rescored, strict=True)
        ]

    def check_weights(self) -> None:
        """One weight per reward function, if weights are given."""
        if self.weights is not None and len(self.weights) != len(self.functions):
            named = ", ".join(map(str, self._as_specs(list(self.functions))))
            entries = "entry" if len(self.weights) == 1 else "entries"
            raise ValueError(
                f"reward.weights has {len(self.weights)} {entries} for "
                f"{len(self.functions)} reward.functions ({named}): give one weight per "
                "function, or reward.weights=null (1.0 each)"
            )


def _is_code(function: str | Callable[..., Any]) -> bool:
    """Whether ``function`` is the built-in ``code`` reward (its name, ``code_reward`` or
    another :class:`~gspo.rewards.verifiers.CodeReward`)."""
    if isinstance(function, str):
        return function.strip() == "code"
    from gspo.rewards.verifiers import CodeReward

    return isinstance(function, CodeReward)


def _is_by_source(function: str | Callable[..., Any]) -> bool:
    """Whether ``function`` is the built-in ``by_source`` reward (its name)."""
    return isinstance(function, str) and function.strip() == "by_source"
