"""The base of every config section: unknown keys are errors, assignments are validated,
and a validation error is one line naming the key (:func:`error_line`)."""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, ClassVar, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator


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
                raise ConfigError(unknown_key(f"{self.config_key}{name}", keys)) from None
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


def did_you_mean(word: Any, choices: list[str], prefix: str = "") -> str:
    """``"; did you mean 'x'?"`` for the choice closest to ``word`` (``prefix`` + it: the
    whole dotted key), or ``""``."""
    if ALIASES.get(str(word).lower()) in choices:
        return f"; did you mean {prefix + ALIASES[str(word).lower()]!r}?"
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f"; did you mean {prefix + close[0]!r}?" if close else ""


BATCH_SIZES = (
    "part of what rollout.prompts_per_batch x rollout.group_size / algorithm.minibatches "
    "gives per optimizer step (no one key)"
)

#: TRL ``GRPOConfig`` fields a user porting a config writes, and what gspo calls them
#: (docs/from_trl.md has the whole table, with how each differs).
TRL_NAMES = {
    "learning_rate": "optim.lr",
    "num_generations": "rollout.group_size",
    "beta": "algorithm.kl_coef",
    "epsilon": "algorithm.clip_low (and algorithm.clip_high: TRL's epsilon bounds both "
    "sides, gspo's unset side is the level's paper range)",
    "epsilon_high": "algorithm.clip_high",
    "importance_sampling_level": "algorithm.level",
    "scale_rewards": "algorithm.advantage_scale (group, batch, or none for False)",
    "max_completion_length": "rollout.max_new_tokens",
    "per_device_train_batch_size": BATCH_SIZES,
    "generation_batch_size": "rollout.prompts_per_batch x rollout.group_size, over all ranks",
    "gradient_accumulation_steps": BATCH_SIZES,
    "steps_per_generation": "algorithm.minibatches (optimizer steps per rollout batch: "
    "TRL's steps_per_generation / gradient_accumulation_steps)",
    "num_train_epochs": "train.max_steps",
    "reward_weights": "reward.weights",
    "reward_funcs": "reward.functions",
    "mask_truncated_completions": "algorithm.mask_truncated",
    "max_grad_norm": "optim.grad_clip",
    "adam_beta1": "optim.betas",
    "adam_beta2": "optim.betas",
    "use_vllm": "rollout.engine",
    "vllm_gpu_memory_utilization": "rollout.vllm.gpu_memory_utilization",
    "vllm_importance_sampling_correction": "algorithm.rollout_correction",
    "vllm_importance_sampling_mode": "algorithm.rollout_correction",
    "vllm_importance_sampling_clip_min": "algorithm.correction_min",
    "vllm_importance_sampling_clip_max": "algorithm.correction_max",
    "vllm_max_model_length": "rollout.vllm.max_model_len",
    "vllm_mode": "rollout.engine=vllm (colocated: gspo's one mode)",
    "lora_target_modules": "model.lora.target_modules",
    "num_completions_to_print": "log.completions_every (to completions/, not the console)",
    "eval_strategy": "eval.every (0: no evaluation)",
    "model_name_or_path": "model.path",
    "bf16": "model.dtype",
    "gradient_checkpointing": "model.activation_checkpointing",
    "lora_r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "eval_steps": "eval.every",
    "save_steps": "train.save_every",
    "output_dir": "--output-dir",
    "report_to": "log.wandb / log.mlflow",
    "log_completions": "log.completions_every (N: every Nth rollout batch, to completions/)",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "seed": "train.seed",
    "max_steps": "train.max_steps",
    "weight_decay": "optim.weight_decay",
    "warmup_steps": "optim.warmup_steps",
    "warmup_ratio": "optim.warmup_steps (a number of steps)",
    "entropy_coef": "algorithm.entropy_coef",
    "save_total_limit": "train.keep_checkpoints",
    "save_only_model": "train.save_only_model",
    "peft_config": "model.lora (r, alpha, dropout, target_modules)",
    "chat_template_kwargs": "data.chat_template_kwargs",
    "router_aux_loss_coef": "moe.router_aux_loss_coef",
    "num_generations_eval": "eval.samples",
    "train_dataset": "data.train",
    "eval_dataset": "data.eval",
    "fp16": "model.dtype",
    "use_cpu": "model.device",
    "environment_factory": "rollout.environment (a class or factory: one environment per episode)",
    "max_tool_calling_iterations": "close to rollout.max_turns (gspo counts the model's "
    "turns, not its tool calls)",
}

#: TRL ``GRPOConfig`` fields with no gspo setting, and why (docs/from_trl.md).
TRL_WITHOUT = {
    "loss_type": "gspo has one aggregation, TRL's \"grpo\" (the mean of each response's "
    "token mean)",
    "num_iterations": "each rollout batch is used once, in algorithm.minibatches steps",
    "max_prompt_length": "prompts are not truncated",
    "logging_steps": "every optimizer step is logged",
    "lr_scheduler_type": "the schedule is a linear warm-up, then constant (TRL's "
    '"constant"; "linear" decay has no equivalent)',
    "delta": "two-sided clipping (a bound on the ratio for negative advantages) is not implemented",
    "sync_ref_model": "the KL reference is the starting model throughout",
    "top_entropy_quantile": "every completion token is in the loss",
    "off_policy_mask_threshold": "no off-policy mask (algorithm.rollout_correction corrects "
    "sampler-trainer mismatch)",
    "multi_objective_aggregation": "rewards are always summed (weighted), then advantages",
    "use_bias_correction_kl": "train/kl is the k3 mean without the importance ratio",
    "cast_lm_head_to_fp32": "the head's logits are float32 in every setting "
    "(model.head_precision picks its products)",
    "shuffle_dataset": "prompts are always shuffled",
    "adam_epsilon": "AdamW's epsilon is torch's 1e-8",
    "top_k": "sampling takes rollout.temperature and rollout.top_p only",
    "min_p": "sampling takes rollout.temperature and rollout.top_p only",
    "repetition_penalty": "sampling takes rollout.temperature and rollout.top_p only",
}


def unknown_key(key: str, keys: list[str]) -> str:
    """The line for ``key`` (dotted, in full), unknown where its section holds ``keys``:
    the closest key of the section, else what gspo calls TRL's field of that name."""
    parent, _, leaf = key.rpartition(".")
    close = did_you_mean(leaf, keys, f"{parent}." if parent else "")
    # (optim.beta: optim.betas, not TRL's beta; at the top a section's name is always close:
    # scale_rewards is not "reward")
    # (but rollout.use_vllm is rollout.engine, not the closer rollout.vllm: a section whose
    # own key TRL's name maps to)
    own = parent and TRL_NAMES.get(leaf, "").startswith(f"{parent}.")
    if leaf in TRL_NAMES and (not close or not parent or own):
        return f"{key}: unknown key; TRL's {leaf} is {TRL_NAMES[leaf]} here (docs/from_trl.md)"
    if leaf in TRL_WITHOUT and (not close or not parent):
        return (
            f"{key}: unknown key; TRL's {leaf} has no equivalent here: {TRL_WITHOUT[leaf]} "
            "(docs/from_trl.md)"
        )
    return f"{key}: unknown key{close}"


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
        return unknown_key(f"{prefix}{where}", keys) + others
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
        shown += f"; {prefix}{where} is a section of keys: {key}={value}"  # (TRL's model=)
    return f"{prefix}{where}: {message}{shown}" if where or prefix else message
