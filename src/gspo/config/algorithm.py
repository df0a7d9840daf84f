"""The ``algorithm`` and ``optim`` sections: the policy-gradient objective and AdamW."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator

from gspo.config.section import Section, did_you_mean

#: An AdamW beta: a decay rate in [0, 1).
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]

#: The algorithms' names, accepted for ``algorithm.level`` (as TRL, verl and the papers
#: name them); each level brings its paper's clip range unless clip_low/high are set.
ALGORITHM_NAMES = {
    "gspo": "sequence",
    "gspo_token": "sequence_token",
    "gspo-token": "sequence_token",
    "grpo": "token",
}


class AlgorithmConfig(Section):
    """The policy-gradient objective: GSPO, GSPO-token or GRPO, and how each batch is used.

    Defaults are the GSPO paper's settings (clip 3e-4 / 4e-4, 4 minibatches per rollout
    batch, no KL penalty).
    """

    level: Literal["sequence", "sequence_token", "token"] = Field(
        "sequence",
        description="Importance ratio: sequence (GSPO), sequence_token (GSPO-token), token "
        "(GRPO); the names gspo, gspo_token and grpo are accepted for them",
    )
    clip_low: float | None = Field(
        None,
        ge=0.0,
        lt=1.0,  # (1 - clip_low, the band's floor, at or below 0 clips nothing below)
        description="Clip epsilon below 1, under 1; null = the level's paper value (3e-4 for "
        "the sequence levels, 0.2 for token)",
    )
    clip_high: float | None = Field(
        None,
        ge=0.0,
        description="Clip epsilon above 1; null = the level's paper value (4e-4 for the "
        "sequence levels, 0.27 for token)",
    )
    minibatches: int = Field(
        4,
        ge=1,
        description="Optimizer steps per rollout batch, one per minibatch (at most "
        "rollout.group_size * rollout.prompts_per_batch; under torchrun at most the "
        "responses each rank holds, that / the ranks); the first is on-policy",
    )
    old_logprobs: Literal["auto", "sampler", "recompute"] = Field(
        "auto",
        description="pi_old's log-probs: sampler (the rollout engine's, no extra pass), "
        "recompute (a no-grad trainer forward per minibatch; the first minibatch's is its "
        "update's own forward) or auto: the sampler's when "
        "the forward runs in float32, recomputed in bfloat16/float16 (where the two differ "
        "by more than GSPO's clip range: docs/precision.md), with a rollout_correction, "
        "for vLLM with top_p < 1, and with LoRA dropout in synchronous runs (recomputed "
        "under the update's own dropout masks)",
    )
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide group-centred rewards by the group's std (group), the rollout "
        "batch's (batch) or nothing (none: Dr. GRPO's advantages; its loss without the "
        "per-response length mean is not gspo's)",
    )
    kl_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of a k3 KL penalty against the cold-start (step-0) model; "
        "0 = off, no reference model loaded",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of an entropy bonus (loss -= entropy_coef * mean token entropy "
        "of pi_theta); 0 = off (train/entropy is logged either way)",
    )
    mask_truncated: bool = Field(
        False,
        description="Leave responses cut off by rollout.max_new_tokens out of the loss "
        "(DAPO's overlong filtering)",
    )
    rollout_correction: Literal["none", "token_tis", "token_mask", "sequence_mask"] = Field(
        "none",
        description="Correct for the sampler's log-probs differing from pi_old's (needs "
        "old_logprobs=recompute): token_tis (weight min(rho, max)), token_mask (IcePop: "
        "tokens with rho outside [min, max] dropped), sequence_mask (responses whose "
        "geometric-mean rho leaves [min, max] dropped); rho = pi_old / pi_sampler",
    )
    correction_min: float | None = Field(
        None,
        ge=0.0,
        description="Lower bound of rho; null = the mode's literature value (token_mask "
        "0.5, sequence_mask 0.999; token_tis has none)",
    )
    correction_max: float | None = Field(
        None,
        gt=0.0,
        description="Upper bound of rho; null = the mode's literature value (token_tis 2.0, "
        "token_mask 5.0, sequence_mask 1.001)",
    )

    @field_validator("level", mode="before")
    @classmethod
    def _algorithm_name(cls, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        value = ALGORITHM_NAMES.get(value.strip().lower(), value)
        levels = get_args(cls.model_fields["level"].annotation)
        if value not in levels:  # the levels and the algorithms' names, with a close one
            named = ", ".join(f"{a} ({n})" for n, a in ALGORITHM_NAMES.items() if "-" not in n)
            close = did_you_mean(value, [*levels, *ALGORITHM_NAMES])
            raise ValueError(f"one of {named} (got {value!r}){close}")
        return value

    def check_rollout_correction(self) -> None:
        """The rollout correction needs recomputed pi_old and bounds that fit its mode."""
        if self.rollout_correction != "none" and self.old_logprobs == "sampler":
            raise ValueError(
                f"algorithm.rollout_correction={self.rollout_correction} needs "
                "algorithm.old_logprobs=recompute: with old_logprobs=sampler pi_old is the "
                "sampler's own log-probs and there is nothing to correct"
            )
        bounds = {"correction_min": self.correction_min, "correction_max": self.correction_max}
        for key, value in bounds.items():
            if value is not None and self.rollout_correction == "none":
                raise ValueError(f"algorithm.{key} is set but algorithm.rollout_correction=none")
        if self.correction_min is not None and self.rollout_correction == "token_tis":
            raise ValueError(
                "algorithm.correction_min: token_tis only truncates from above "
                "(use token_mask to drop tokens below a bound)"
            )
        if self.rollout_correction in ("token_mask", "sequence_mask"):
            from gspo.objectives import DEFAULT_CORRECTION_BOUNDS

            low, high = DEFAULT_CORRECTION_BOUNDS[self.rollout_correction]
            low = low if self.correction_min is None else self.correction_min
            high = high if self.correction_max is None else self.correction_max
            mode = self.rollout_correction

            def said(key: str, value: float, given: float | None) -> str:
                own = f", {mode}'s own bound" if given is None else ""
                return f"algorithm.{key} ({value}{own})"

            if low >= high:  # (every token or response dropped: nothing learned)
                raise ValueError(
                    f"{said('correction_min', low, self.correction_min)} must be below "
                    f"{said('correction_max', high, self.correction_max)}: every "
                    f"{'token' if mode == 'token_mask' else 'response'} would be dropped"
                )
            if not low <= 1 <= high:  # (found at run time: no token in the loss, every batch)
                raise ValueError(
                    f"{said('correction_min', low, self.correction_min)} to "
                    f"{said('correction_max', high, self.correction_max)}: the band must hold "
                    f"1 (a weight of 1 is no mismatch), else {mode} drops what agrees exactly"
                )


class OptimConfig(Section):
    """AdamW for the RL stage (the cold start has its own ``train.cold_start_*`` keys)."""

    lr: float = Field(1e-4, gt=0.0, description="RL learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[Beta, Beta] = Field((0.9, 0.99), description="AdamW betas, each in [0, 1)")
    grad_clip: float = Field(
        1.0, ge=0.0, description="Largest global gradient norm per step; 0 = no clipping"
    )
    warmup_steps: int = Field(
        0, ge=0, description="Linear learning-rate warm-up over this many steps; 0 = none"
    )
