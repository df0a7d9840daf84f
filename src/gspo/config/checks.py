"""The rules across config sections, grouped by topic; each takes the sections it reads.

:meth:`gspo.config.root.Config._consistent` runs them, with each section's own rules, in
one fixed order (the first broken rule is the error a user sees). Each raises
``ValueError`` with a one-line message naming the keys.
"""

from __future__ import annotations

from gspo.config.algorithm import AlgorithmConfig
from gspo.config.data import DataConfig
from gspo.config.model import LoraSettings, ModelConfig, MoEConfig
from gspo.config.reward import RewardConfig
from gspo.config.rollout import VLLM_LORA_RANKS, RolloutConfig
from gspo.config.run import TrainConfig

# --------------------------------------------------------------------------------------------
# The rollout batch and its minibatches
# --------------------------------------------------------------------------------------------


def minibatches_fit(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """Each minibatch holds at least one response of the rollout batch."""
    batch = rollout.group_size * rollout.prompts_per_batch
    if algorithm.minibatches > batch:
        raise ValueError(
            f"algorithm.minibatches={algorithm.minibatches} exceeds the rollout batch "
            f"of {batch} responses (rollout.group_size * rollout.prompts_per_batch)"
        )


# --------------------------------------------------------------------------------------------
# The sampler's log-probs
# --------------------------------------------------------------------------------------------


def vllm_top_p(rollout: RolloutConfig, algorithm: AlgorithmConfig) -> None:
    """vLLM with nucleus sampling needs pi_old recomputed."""
    if rollout.engine == "vllm" and rollout.top_p < 1.0 and algorithm.old_logprobs == "sampler":
        # vLLM reports log-probs of the nucleus-renormalised distribution, the trainer
        # recomputes the untruncated one: the ratio would be off by the nucleus mass.
        raise ValueError(
            "rollout.top_p < 1 with rollout.engine=vllm needs "
            "algorithm.old_logprobs=recompute (vLLM's log-probs are of the truncated "
            "distribution)"
        )


def correction_lora_dropout(algorithm: AlgorithmConfig, lora: LoraSettings) -> None:
    """A rollout correction weighs the trainer's pi_old against the sampler's: with LoRA
    dropout pi_old is computed under the update's masks, so it would weigh the masks."""
    if algorithm.rollout_correction != "none" and lora.r > 0 and lora.dropout > 0:
        raise ValueError(
            f"algorithm.rollout_correction={algorithm.rollout_correction} with "
            f"model.lora.dropout={lora.dropout:g}: pi_old is computed with the update's "
            "dropout masks and the sampler without, so the correction would weigh dropout's "
            "noise, not the engines' mismatch; set one of them off"
        )


# --------------------------------------------------------------------------------------------
# Rewards
# --------------------------------------------------------------------------------------------


def chain_reward(data: DataConfig, reward: RewardConfig) -> None:
    """The built-in chain task is scored on its final number, not the whole completion."""
    if data.task == "chain" and data.train is None and reward.functions == ["exact_match"]:
        # the answer column holds the total; the completion is the whole chain
        raise ValueError("data.task=chain needs reward.functions=[numeric_match]")


def environment_reward_workers(rollout: RolloutConfig, reward: RewardConfig) -> None:
    """Environments stay in the trainer process, so their rewards do too; the built-in
    ``environment`` reward needs one."""
    named = [f for f in reward.functions or () if isinstance(f, str) and f.strip() == "environment"]
    if named and rollout.environment is None:
        raise ValueError(
            "reward.functions: 'environment' is each episode's environment's own reward "
            "(its get_reward()), and rollout.environment is not set (docs/environments.md)"
        )
    if rollout.environment is not None and reward.workers > 0:
        raise ValueError(
            "reward.workers > 0 cannot be used with rollout.environment (the reward "
            "functions get the environments, which stay in the trainer process)"
        )


def overlong_buffer_fits(reward: RewardConfig, rollout: RolloutConfig, response_limit: int) -> None:
    """The overlong penalty's ramp fits in the longest response (``response_limit``)."""
    if reward.overlong_buffer is not None and (reward.overlong_buffer > response_limit):
        limit = "max_episode_tokens" if rollout.environment else "max_new_tokens"
        raise ValueError(
            f"reward.overlong_buffer={reward.overlong_buffer} exceeds "
            f"rollout.{limit}={response_limit}"
        )


# --------------------------------------------------------------------------------------------
# Async rollouts
# --------------------------------------------------------------------------------------------


def staleness_routing(rollout: RolloutConfig, moe: MoEConfig) -> None:
    """MoE routing records are taken under the trainer's weights: synchronous rollouts only."""
    staleness = rollout.max_staleness
    if staleness > 0 and (moe.routing_replay or moe.measure_churn):
        key = "moe.routing_replay" if moe.routing_replay else "moe.measure_churn"
        raise ValueError(
            f"{key} needs rollout.max_staleness=0 (pi_old's routing would be recorded "
            "under the trainer's weights, not the stale ones that sampled the batch)"
        )


def staleness_compile(rollout: RolloutConfig, model: ModelConfig) -> None:
    """The sampler's prefill runs the blocks eagerly under torch's process-wide compile
    stance: a producer thread's prefill would switch the trainer's forwards to eager."""
    if rollout.max_staleness > 0 and model.compile:
        raise ValueError(
            "model.compile needs rollout.max_staleness=0 (the producer thread's prefill "
            "would run the trainer's compiled blocks eagerly meanwhile)"
        )


# --------------------------------------------------------------------------------------------
# LoRA
# --------------------------------------------------------------------------------------------


def lora_cold_start(lora: LoraSettings, train: TrainConfig, data: DataConfig) -> None:
    """LoRA trains RL only: no cold start where there are rows for one."""
    sft_rows = data.train is None or data.sft is not None
    if lora.r > 0 and train.cold_start_steps > 0 and sft_rows:
        raise ValueError(
            f"model.lora.r={lora.r} needs train.cold_start_steps=0: LoRA trains RL "
            "only; run the cold start without LoRA and pass its step-0 checkpoint as "
            "model.path"
        )


def vllm_lora_sync(rollout: RolloutConfig, lora: LoraSettings) -> None:
    """Syncing adapters to vLLM needs adapters of a rank vLLM takes."""
    if rollout.vllm.lora_sync == "adapter" and rollout.engine == "vllm":
        if lora.r == 0:
            raise ValueError(
                "rollout.vllm.lora_sync=adapter needs LoRA adapters (model.lora.r > 0)"
            )
        if lora.r > VLLM_LORA_RANKS[-1]:
            raise ValueError(
                f"rollout.vllm.lora_sync=adapter: model.lora.r={lora.r} is above vLLM's "
                f"largest LoRA rank {VLLM_LORA_RANKS[-1]} (use lora_sync=merged)"
            )


# --------------------------------------------------------------------------------------------
# Mixture of Experts
# --------------------------------------------------------------------------------------------


def moe_model(model: ModelConfig, moe: MoEConfig) -> None:
    """The ``moe`` keys that act on experts need a MoE model."""
    dense_builtin = model.path is None and model.builtin == "qwen3"
    moe_keys = {
        "moe.routing_replay": moe.routing_replay,
        "moe.measure_churn": moe.measure_churn,
        "moe.router_aux_loss_coef": moe.router_aux_loss_coef > 0,
    }
    wanted = [key for key, value in moe_keys.items() if value]
    if dense_builtin and wanted:
        key = wanted[0]
        raise ValueError(
            f"{key} needs a MoE model (model.builtin=qwen3_moe or a MoE model.path); "
            "model.builtin=qwen3 is dense"
        )
