"""The ``data`` section: where prompts come from and how a row becomes one, and the
prompt template's fields (:func:`template_fields`, also used by :mod:`gspo.data`)."""

from __future__ import annotations

import re
import string
from typing import Any, Literal

from pydantic import Field

from gspo.config.section import Section


def template_fields(template: str) -> list[str]:
    """The column names ``template`` reads (``{question}``, ``{meta[level]}`` -> ``meta``).

    Raises ``ValueError`` (message without the key) for malformed format strings and
    positional fields such as ``{}``, a common slip for ``\\boxed{}`` (write ``{{}}``).
    """
    fields = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"not a format string ({exc}); write {{{{ and }}}} for braces") from None
    for _, field, _, _ in parsed:
        if field is None:
            continue
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not name or name.isdigit():
            raise ValueError(
                f"{{{field}}} is a positional field; name a column, or write {{{{}}}} for "
                "literal braces (\\boxed{{}})"
            )
        fields.append(name)
    return fields


class DataConfig(Section):
    """Prompts for RL, held-out prompts for evaluation, rows for the cold-start SFT.

    With ``data.train`` null a built-in task generates all three (the ``digits`` ..
    ``label_noise`` keys shape it). Otherwise each of ``data.train`` / ``data.eval`` /
    ``data.sft`` is a local file (JSONL, JSON, Parquet, CSV), a local dataset directory
    (``save_to_disk`` output or data files) or a ``datasets`` hub id
    ``owner/name[:config[:split]]``; an existing local path always wins, and ``./``
    marks a relative one. The prompt comes from ``data.prompt_column`` (a string or chat
    messages) or ``data.prompt_template``; every other column reaches the reward
    functions as a keyword argument.
    """

    task: Literal["addition", "chain", "calculator"] = Field(
        "addition",
        description="Built-in task: addition (a+b=, 2-4 tokens), chain (step-by-step "
        "multi-term addition, ~20-70 tokens with its 6 terms, ~130 at 12; scored by "
        "numeric_match) "
        "or calculator (a+b= with an add tool, multi-turn; the task brings data.digits=5)",
    )
    train: str | None = Field(
        None,
        description="RL prompts: a local .jsonl/.json/.parquet/.csv file or dataset "
        "directory, or a datasets hub id owner/name[:config[:split]] "
        "(openai/gsm8k:main:train); null = the built-in task",
    )
    eval: str | None = Field(
        None,
        description="Held-out prompts, same forms (openai/gsm8k:main:test); with a built-in "
        "task it replaces the generated held-out split",
    )
    sft: str | None = Field(
        None, description="Cold-start SFT rows, same forms: a prompt and a completion column"
    )
    prompt_column: str = Field(
        "prompt",
        description="Column holding the prompt (a string or a list of chat messages)",
    )
    prompt_template: str | None = Field(
        None,
        description="Prompt as a Python format string over the row's columns, e.g. "
        "'Solve: {question}' (literal braces doubled: \\boxed{{}}); replaces "
        "data.prompt_column",
    )
    system_prompt: str | None = Field(
        None,
        description="System message put before each prompt (the prompt becomes chat "
        "messages, so the tokenizer needs a chat template); a prompt that has one keeps it",
    )
    chat_template: bool = Field(
        False,
        description="Send string prompts through the tokenizer's chat template as one user "
        "message (implied by data.system_prompt); message-list prompts always are",
    )
    drop_long_prompts: bool = Field(
        False,
        description="Leave out the prompts that leave fewer than rollout.max_new_tokens "
        "positions of the context the rollouts have (verl's filter_overlong_prompts), counted "
        "in one warning line; false: one longer than the context stops the run naming its row",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra variables for the chat template, e.g. {enable_thinking: false} "
        "for Qwen3",
    )
    answer_column: str | None = Field(
        None,
        description="Column whose final answer (GSM8K '#### 42' -> 42, the last \\boxed{} "
        "-> its content) becomes the answer column the built-in rewards read, or a dotted "
        "path to a field of a mapping column (verl's reward_model.ground_truth); "
        "null = use the answer column as it is",
    )
    completion_column: str = Field(
        "completion", description="data.sft: column holding the cold-start completion"
    )
    tests_column: str | None = Field(
        None,
        description="Column holding the code reward's tests (APPS and TACO: input_output), "
        "read as the tests column, or a dotted path to a field of a mapping column (verl's "
        "reward_model.ground_truth); null = the tests column as it is",
    )
    digits: int = Field(2, ge=1, le=6, description="Built-in tasks: digits per operand")
    terms: int = Field(12, ge=2, le=40, description="chain: most operands per prompt")
    min_terms: int = Field(2, ge=2, description="chain: fewest operands per prompt")
    eval_size: int = Field(
        500,
        ge=1,
        description="Built-in tasks: held-out prompts (at most a fifth of the distinct prompts)",
    )
    sft_size: int = Field(8000, ge=1, description="Built-in tasks: cold-start SFT rows")
    label_noise: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Built-in tasks: probability that a cold-start row is wrong (addition: "
        "a random last digit; chain: one slipped partial sum)",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="Built-in tasks: the seed their prompts and train / held-out / SFT split "
        "are drawn from; null: train.seed's. gspo compare sets the cold start's for every "
        "run, so that each seed's runs are evaluated on the same held-out prompts, none of "
        "them the cold start's SFT rows",
    )

    def source_of(self, key: str) -> str:
        """Where ``key``'s rows (``data.train``, ``data.eval``, ``data.sft``) come from, as
        messages name it: the key's value, or the built-in task."""
        return getattr(self, key.removeprefix("data.")) or f"the built-in {self.task} task"

    def check_prompt_template(self) -> None:
        """A template replaces the prompt column and must be a format string over columns."""
        if self.prompt_template is not None:
            if "prompt_column" in self.model_fields_set and self.prompt_column != "prompt":
                raise ValueError("set one of data.prompt_column and data.prompt_template")
            try:
                template_fields(self.prompt_template)
            except ValueError as exc:
                raise ValueError(f"data.prompt_template: {exc}") from None

    def check_sources(self) -> None:
        """``data.train``/``eval``/``sft`` name something: an empty string (``train: ""`` in
        a YAML file) read the working directory as a dataset."""
        for key in ("train", "eval", "sft"):
            value = getattr(self, key)
            if value is not None and not value.strip():
                raise ValueError(
                    f"data.{key}: empty; name a file, a directory or a dataset id (null for none)"
                )

    def check_chain_terms(self) -> None:
        """The built-in chain task's fewest operands are at most its most."""
        if self.task == "chain" and self.train is None and self.min_terms > self.terms:
            raise ValueError(
                f"data.min_terms={self.min_terms} exceeds data.terms={self.terms} (the chain "
                "task's fewest and most operands per prompt)"
            )
