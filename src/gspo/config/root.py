"""The whole run configuration, :class:`Config`: its sections, the order their rules run
in, the warnings and the values derived from several keys.

Every batch size is per optimizer step (global), never per process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from gspo.config.algorithm import AlgorithmConfig, OptimConfig
from gspo.config.checks import (
    chain_reward,
    correction_lora_dropout,
    environment_reward_workers,
    lora_cold_start,
    minibatches_fit,
    moe_model,
    overlong_buffer_fits,
    staleness_compile,
    staleness_routing,
    vllm_lora_sync,
    vllm_top_p,
)
from gspo.config.data import DataConfig, template_fields
from gspo.config.model import LoraSettings, ModelConfig, MoEConfig
from gspo.config.reward import RewardConfig
from gspo.config.rollout import RolloutConfig
from gspo.config.run import EvalConfig, LogConfig, TrainConfig
from gspo.config.section import ConfigError, Section

_LORA = LoraSettings().model_dump()  # the defaults: changed ones mean adapters were meant
_FILTER_MAX_ROUNDS = RolloutConfig.model_fields["filter_max_rounds"].default


class Config(Section):
    """The whole run configuration: one YAML file, every section optional.

    Every batch size is per optimizer step (global), never per process.
    """

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    moe: MoEConfig = Field(default_factory=MoEConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        """Each section's own rules and the rules across sections (:mod:`gspo.config.checks`)
        in one fixed order: the first broken one is the error a user sees. The sections'
        rules run here, not as their own validators, so that this order holds and each
        message reads as written (a section validator's would be prefixed by its name)."""
        model, data, reward, rollout = self.model, self.data, self.reward, self.rollout
        algo = self.algorithm
        model.check_builtin_shape()
        rollout.check_group_size()
        minibatches_fit(rollout, algo)
        reward.check_functions()
        reward.check_weights()
        reward.check_code_scoring()
        vllm_top_p(rollout, algo)
        correction_lora_dropout(algo, model.lora)
        data.check_prompt_template()
        data.check_sources()
        data.check_chain_terms()
        chain_reward(data, reward)
        environment_reward_workers(rollout, reward)
        overlong_buffer_fits(reward, rollout, self.response_limit)
        algo.check_rollout_correction()
        staleness_routing(rollout, self.moe)
        staleness_compile(rollout, model)
        rollout.check_logit_noise()
        lora_cold_start(model.lora, self.train, data)
        vllm_lora_sync(rollout, model.lora)
        model.lora.check_targets()
        moe_model(model, self.moe)
        self.train.check_time_limit()
        return self

    def check(self) -> Config:
        """The rules across keys again, for a config changed from Python since it was made:
        an assignment (``config.model.lora.r = 4``) checks its own key alone, so a mix a
        file or the command line is refused (a LoRA cold start, a group of 1, a built-in
        model's heads that do not divide) trained silently or failed deep inside
        transformers. A one-line :class:`ConfigError` naming the first broken rule."""
        try:
            return self._consistent()
        except ConfigError:
            raise
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def warnings(self) -> list[str]:
        """One line per setting that is valid but does nothing, or leaves the run unable to
        learn."""
        lines = []
        data = self.data
        cold = data.sft is not None and self.train.cold_start_steps > 0
        if data.train is not None and self.model.path is None and not cold:
            why = "no data.sft" if data.sft is None else "train.cold_start_steps=0"
            lines.append(
                f"data.train with model.path null and {why}: RL starts from the built-in "
                "model's random initialisation with no cold start, which rarely earns any "
                "reward (set model.path to a trained model, or data.sft for a cold start)"
            )
        if data.train is not None and data.task != "addition":
            lines.append(
                f"data.task={data.task} is a built-in task, which data.train replaces: its "
                "prompts, rewards and environment are not used (set rollout.environment "
                "and reward.functions for your data)"
            )
        if data.train is not None and data.eval is None and self.train.max_steps > 0:
            lines.append(
                "data.train without data.eval: no held-out evaluation runs (no eval/* "
                "metrics, accuracy rows or plot; set data.eval to a held-out file)"
            )
        if data.train is not None and _same_source(data.train, data.eval):
            lines.append(
                f"data.eval is data.train ({data.eval}): the held-out evaluation scores the "
                "training prompts, so eval/* measures memorisation, not generalisation"
            )
        gold = data.answer_column or "answer"  # (a single-brace \boxed{answer} filled it in)
        if data.prompt_template is not None and gold in template_fields(data.prompt_template):
            lines.append(
                f"data.prompt_template reads {{{gold}}}, the column the rewards score "
                "against: every prompt holds its own answer (literal braces are doubled: "
                "\\boxed{{}})"
            )
        if (lopsided := _one_sided_clip(self.algorithm)) is not None:
            lines.append(lopsided)
        if (  # (an environment may take a fixed prompt: its reset says the rest)
            data.prompt_template is not None
            and not template_fields(data.prompt_template)
            and self.rollout.environment is None
        ):
            lines.append(
                "data.prompt_template names no column (as {question}): every prompt is the "
                "same text (single braces name a column, doubled ones are literal)"
            )
        batch = self.rollout.group_size * self.rollout.prompts_per_batch
        parts = self.algorithm.minibatches
        if batch % parts:
            lines.append(
                f"algorithm.minibatches={parts} does not divide the rollout batch of {batch} "
                f"responses (rollout.prompts_per_batch x rollout.group_size): minibatches of "
                f"{batch // parts + 1} and {batch // parts}, whose responses weigh unequally in "
                "their optimizer steps (TRL refuses such a split); use a divisor"
            )
        if self.total_steps != self.train.max_steps:
            lines.append(
                f"train.max_steps={self.train.max_steps} is not a whole number of rollout "
                f"batches of algorithm.minibatches={parts} optimizer steps: the run takes "
                f"{self.total_steps}"
            )
        past = [s for s in self.log.profile_steps if s > self.total_steps]
        if past:
            lines.append(
                f"log.profile_steps: step {past[0]} is past the run's {self.total_steps} "
                "optimizer steps (train.max_steps in whole rollout batches): nothing is "
                "profiled there"
            )
        lora = self.model.lora
        unused = [k for k, v in lora.model_dump().items() if k != "r" and v != _LORA[k]]
        if lora.r == 0 and unused:
            lines.append(
                f"model.lora.{unused[0]} is set but model.lora.r=0 (full fine-tuning): the "
                "LoRA settings do nothing (set model.lora.r > 0 for adapters)"
            )
        unmatched = self.algorithm.old_logprobs == "sampler" or self.rollout.max_staleness > 0
        if lora.r > 0 and lora.dropout > 0 and unmatched:
            pi_old = (
                "the sampler's log-probs (algorithm.old_logprobs=sampler)"
                if self.algorithm.old_logprobs == "sampler"
                else "the async producer's pi_old (rollout.max_staleness > 0)"
            )
            lines.append(
                f"model.lora.dropout={lora.dropout:g}: the update's forward drops adapter "
                f"inputs that {pi_old} kept, so on-policy ratios are not 1 and GSPO's narrow "
                "clip range clips responses of the on-policy minibatch (0 keeps them 1)"
            )

        def changed(section: Section, keys: tuple[str, ...]) -> list[str]:
            """The keys of ``section`` off their defaults (a run's own config.yaml, given
            back as --config, holds every key: set, but not changed)."""
            fields = type(section).model_fields
            return [k for k in keys if getattr(section, k) != fields[k].default]

        model = self.model
        moe_only = ("experts", "experts_per_token", "expert_intermediate", "norm_topk_prob")
        builtin_only = ("builtin", "layers", "hidden", "heads", "kv_heads", "intermediate")
        if model.path is not None and (
            set_ := _unlike(model, changed(model, builtin_only + moe_only))
        ):
            lines.append(
                f"model.{set_[0]} is set but model.path names a model, which has its own "
                "architecture and sizes: the built-in model's settings do nothing"
            )
        dense = model.path is None and model.builtin == "qwen3"
        if dense and (set_ := changed(model, moe_only)):
            lines.append(
                f"model.{set_[0]} is set but model.builtin=qwen3 has no experts (set "
                "model.builtin=qwen3_moe for a MoE model)"
            )
        rollout = self.rollout
        turns = changed(rollout, ("max_turns", "max_episode_tokens", "env_timeout"))
        if self.environment is None and turns:
            lines.append(
                f"rollout.{turns[0]} is set but there is no rollout.environment: it applies "
                "to multi-turn episodes, and every response here is one turn (set "
                "rollout.environment for them)"
            )
        if self.environment is not None and self.data.drop_long_prompts:
            lines.append(
                "data.drop_long_prompts=true with rollout.environment: it reads single-turn "
                "prompts only, and an environment's episodes render their own, so no prompt "
                "is left out (set data.drop_long_prompts=false)"
            )
        if self.reward.overlong_buffer is not None and self.reward.overlong_penalty == 0:
            lines.append(
                "reward.overlong_buffer is set but reward.overlong_penalty=0: no overlong "
                "penalty applies (set reward.overlong_penalty > 0, DAPO's 1.0)"
            )
        if not rollout.filter_groups and rollout.filter_max_rounds != _FILTER_MAX_ROUNDS:
            lines.append(
                "rollout.filter_max_rounds is set but rollout.filter_groups=false: no group "
                "is filtered, so no extra round is sampled (set rollout.filter_groups=true "
                "for dynamic sampling)"
            )
        return lines

    @property
    def environment(self) -> str | None:
        """``rollout.environment`` (the calculator task's default: its built-in one)."""
        return self.rollout.environment

    @property
    def task_seed(self) -> int:
        """The seed a built-in task's data is drawn from: ``data.seed``, or ``train.seed``."""
        return self.train.seed if self.data.seed is None else self.data.seed

    @property
    def max_episode_tokens(self) -> int:
        """``rollout.max_episode_tokens``, or ``max_turns * max_new_tokens``."""
        r = self.rollout
        return r.max_episode_tokens or r.max_turns * r.max_new_tokens

    @property
    def response_limit(self) -> int:
        """The longest response: ``rollout.max_new_tokens``, or with an environment the
        episode's ``max_episode_tokens`` (the overlong penalty ramps up to it)."""
        return self.max_episode_tokens if self.environment else self.rollout.max_new_tokens

    @property
    def overlong_buffer(self) -> int:
        """``reward.overlong_buffer``, or a fifth of :attr:`response_limit` (at least 1)."""
        buffer = self.reward.overlong_buffer
        return max(self.response_limit // 5, 1) if buffer is None else buffer

    @property
    def rollout_batches(self) -> int:
        """Rollout batches needed for ``train.max_steps`` optimizer steps."""
        return -(-self.train.max_steps // self.algorithm.minibatches)

    @property
    def total_steps(self) -> int:
        """Optimizer steps a run takes: ``train.max_steps`` rounded up to whole rollout
        batches (each gives ``algorithm.minibatches`` steps)."""
        return self.rollout_batches * self.algorithm.minibatches


def _one_sided_clip(algorithm: Any) -> str | None:
    """One of ``algorithm.clip_low``/``clip_high`` set and the other the level's paper
    value, an order of magnitude apart (TRL's ``epsilon=0.2`` ported as clip_low alone
    beside GSPO's clip_high of 4e-4: a band of [0.8, 1.0004], unsaid)."""
    from gspo.objectives import DEFAULT_CLIP

    if (algorithm.clip_low is None) == (algorithm.clip_high is None):
        return None
    default_low, default_high = DEFAULT_CLIP[algorithm.level]
    low = default_low if algorithm.clip_low is None else algorithm.clip_low
    high = default_high if algorithm.clip_high is None else algorithm.clip_high
    if min(low, high) <= 0 or max(low, high) / min(low, high) < 10:
        return None
    if algorithm.clip_high is None:
        (given, value), (other, default) = ("clip_low", low), ("clip_high", high)
    else:
        (given, value), (other, default) = ("clip_high", high), ("clip_low", low)
    return (
        f"algorithm.{given}={value:g} beside the {algorithm.level} level's {other}="
        f"{default:g}: the clip band is [{1 - low:g}, {1 + high:g}] (TRL's epsilon sets "
        f"both: set algorithm.{other} too)"
    )


def _name_sections(model: type[Section], prefix: str = "") -> None:
    """Give every section class its place in the config (``optim.``, ``model.lora.``) and
    the config it is in."""
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            field.annotation.config_key = f"{prefix}{name}."
            field.annotation.config_root = Config
            _name_sections(field.annotation, field.annotation.config_key)


_name_sections(Config)


#: The transformers config key of each built-in size (``model.layers`` ...).
_HF_KEYS = {
    "builtin": "model_type", "layers": "num_hidden_layers", "hidden": "hidden_size",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
    "intermediate": "intermediate_size", "experts": "num_experts",
    "experts_per_token": "num_experts_per_tok", "expert_intermediate": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
}  # fmt: skip


def _unlike(model: ModelConfig, keys: list[str]) -> list[str]:
    """Of the built-in ``keys`` set beside ``model.path``, those its model does not share
    (its config.json; all of them when it cannot be read): sizes that equal the model's
    (``gspo compare`` names its cold start, made from them, or the step-0 checkpoint that
    points at the model they made: no cold start rows) are not said to do nothing."""
    from gspo.models.loading import model_files

    try:
        actual = json.loads((model_files(str(model.path)) / "config.json").read_text())
    except (OSError, ValueError):
        return keys
    return [k for k in keys if actual.get(_HF_KEYS[k], object()) != getattr(model, k)]


def _same_source(train: str, eval_: str | None) -> bool:
    """``data.eval`` names what ``data.train`` does: the same text, or the same local file
    or directory written two ways."""
    if eval_ is None:
        return False
    if train == eval_:
        return True
    a, b = Path(train).expanduser(), Path(eval_).expanduser()
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def checked_config(config: Any, who: str) -> Config:
    """``config`` if it is a :class:`Config` whose rules across keys hold
    (:meth:`Config.check`: keys assigned from Python were checked alone); else one line
    naming ``who`` took it (``train``, ``Trainer``)."""
    if not isinstance(config, Config):
        raise TypeError(
            f"{who}: config must be a gspo.config.Config (gspo.config.load_config(path, "
            f"overrides) makes one), got {type(config).__name__}"
        )
    return config.check()
