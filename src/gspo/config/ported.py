"""Settings as other frameworks name them: TRL's ``GRPOConfig`` fields and verl's keys,
each with what gspo calls it or why it has none. An unknown key of one of these names is
refused with that hint (:func:`ported_hint`) instead of the nearest gspo key, which was
often wrong (verl's ``ppo_mini_batch_size``, a size, is no ``algorithm.minibatches``, a
count). docs/from_trl.md and docs/from_verl.md have the whole tables."""

from __future__ import annotations

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
    "max_prompt_length": "prompts are not truncated (data.drop_long_prompts=true leaves out "
    "those too long for the context)",
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
    "vllm_tensor_parallel_size": "each rank runs its own vLLM engine, tensor-parallel size 1",
    "vllm_enable_sleep_mode": "vLLM keeps its weights and KV cache while the trainer trains "
    "(rollout.vllm.gpu_memory_utilization bounds them)",
    "vllm_model_impl": "vLLM picks its own implementation of the model",
    **dict.fromkeys(
        ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout"),
        "vLLM runs colocated (rollout.engine=vllm), no server mode",
    ),
}


#: verl's keys (the leaf of its dotted names: ``actor_rollout_ref.actor.clip_ratio_low``)
#: and what gspo calls them (docs/from_verl.md has the whole table).
VERL_NAMES = {
    "clip_ratio_low": "algorithm.clip_low",
    "clip_ratio_high": "algorithm.clip_high",
    "clip_ratio": "algorithm.clip_low and algorithm.clip_high (one value each)",
    "loss_mode": "algorithm.level (verl's gspo is sequence, vanilla is token)",
    "adv_estimator": "algorithm.advantage_scale (gspo's advantages are GRPO's: group-relative)",
    "norm_adv_by_std_in_grpo": "algorithm.advantage_scale (group; none for False)",
    "train_batch_size": "rollout.prompts_per_batch (prompts per rollout batch, over all ranks)",
    "ppo_mini_batch_size": "algorithm.minibatches, a count: data.train_batch_size / "
    "ppo_mini_batch_size",
    "response_length": "rollout.max_new_tokens",
    "max_response_length": "rollout.max_new_tokens",
    "kl_loss_coef": "algorithm.kl_coef (a k3 penalty in the loss: use_kl_loss with low_var_kl)",
    "use_kl_loss": "algorithm.kl_coef (0: off)",
    "entropy_coeff": "algorithm.entropy_coef",
    "total_training_steps": "train.max_steps, in optimizer steps (verl's steps x "
    "algorithm.minibatches)",
    "total_epochs": "train.max_steps, in optimizer steps",
    "save_freq": "train.save_every, in optimizer steps (verl's x algorithm.minibatches)",
    "test_freq": "eval.every, in optimizer steps (verl's x algorithm.minibatches)",
    "enable_gradient_checkpointing": "model.activation_checkpointing",
    "lora_rank": "model.lora.r (with model.lora.alpha, model.lora.target_modules)",
    "rollout_is": "algorithm.rollout_correction (token_tis: verl's token rollout_is)",
    "train_files": "data.train (one file, a directory of data files or a dataset id)",
    "val_files": "data.eval (one file, a directory of data files or a dataset id)",
    "prompt_key": "data.prompt_column (a string or chat messages)",
    "filter_overlong_prompts": "data.drop_long_prompts (the prompts that leave fewer than "
    "rollout.max_new_tokens positions of the context)",
    "custom_reward_function": "reward.functions=[FILE.py:FUNCTION] (called on a batch as "
    "TRL calls one: prompts, completions and every column as lists, a float per completion; "
    "not per row as verl's compute_score; its default_compute_score: "
    "reward.functions=[by_source], with reward.sources={SOURCE: FILE.py:FUNCTION} for the "
    "sources a function of one's own scores)",
}

#: verl's keys with no gspo setting, and why (docs/from_verl.md).
VERL_WITHOUT = {
    "clip_ratio_c": "no dual clip (a bound on the ratio for negative advantages)",
    "loss_agg_mode": "gspo has one aggregation, verl's seq-mean-token-mean (the mean of "
    "each response's token mean)",
    "ppo_epochs": "each rollout batch is used once, in algorithm.minibatches steps",
    "ppo_micro_batch_size_per_gpu": "a minibatch is one forward and backward "
    "(model.activation_checkpointing lowers its memory)",
    "use_dynamic_bsz": "a minibatch is one forward and backward, its sequences packed",
    "kl_loss_type": "the KL penalty is k3 (verl's low_var_kl, without its clamp)",
    "use_kl_in_reward": "the KL penalty is in the loss (algorithm.kl_coef), not the reward",
    "tensor_model_parallel_size": "each rank runs its own vLLM engine, tensor-parallel size 1",
    "free_cache_engine": "vLLM keeps its weights and KV cache while the trainer trains "
    "(rollout.vllm.gpu_memory_utilization bounds them)",
    "reward_fn_key": "reward.functions=[by_source] picks each row's built-in by its "
    "data_source column, verl's default reward_fn_key (another column: rename it)",
}

#: verl's keys too common to be taken for verl's anywhere: only under this gspo section.
VERL_SECTION = {"n": ("rollout", "rollout.group_size")}

OVERLONG = (
    "prompts are not cut: one longer than the model's context stops the run with one line "
    "naming its row (verl's truncation=error), or data.drop_long_prompts=true leaves out "
    "those that leave fewer than rollout.max_new_tokens positions"
)
#: verl's ``data.*`` keys with no gspo setting (only under ``data``: TRL's
#: ``max_prompt_length`` at the top has its own line).
VERL_DATA_WITHOUT = dict.fromkeys(("max_prompt_length", "truncation"), OVERLONG)


def ported_hint(key: str, close: bool) -> str | None:
    """The line for the unknown ``key`` (dotted, in full) where its name is verl's or
    TRL's: what gspo calls it, or why it has none; None for any other name (``close``:
    its section has a key close to it, which a TRL name common enough yields to)."""
    parent, _, leaf = key.rpartition(".")
    # (rollout.n and verl's own actor_rollout_ref.rollout.n)
    section = parent.rpartition(".")[2]
    if leaf in VERL_NAMES or (leaf in VERL_SECTION and VERL_SECTION[leaf][0] == section):
        where = VERL_NAMES.get(leaf) or VERL_SECTION[leaf][1]
        return f"{key}: unknown key; verl's {leaf} is {where} here (docs/from_verl.md)"
    without = VERL_WITHOUT | (VERL_DATA_WITHOUT if section == "data" else {})
    if leaf in without:
        return (
            f"{key}: unknown key; verl's {leaf} has no equivalent here: {without[leaf]} "
            "(docs/from_verl.md)"
        )
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
    return None
