"""The ``model`` section (with ``model.lora``) and the ``moe`` section: the policy network."""

from __future__ import annotations

import os
import re
from typing import Literal

from pydantic import Field, field_validator

from gspo.config.section import Section


class LoraSettings(Section):
    """LoRA adapters (PEFT) on the policy: RL trains only them, the base stays frozen.

    ``r = 0`` trains every weight (full fine-tuning). With ``r > 0`` only the adapters
    have gradients and optimizer state, the KL reference is the same module with its
    adapters switched off, and checkpoints hold the adapter in PEFT's format.
    """

    r: int = Field(0, ge=0, description="LoRA rank; 0 = full fine-tuning (no adapters)")
    alpha: float = Field(
        32.0, gt=0.0, description="LoRA alpha: the adapter's update is scaled by alpha / r"
    )
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Dropout on the adapters' input; pi_old is then recomputed under each "
        "minibatch's own masks (algorithm.old_logprobs=auto), so on-policy ratios stay 1",
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: all-linear (every linear layer but the "
        "output head), a list of module names (q_proj, v_proj, ...) or one regex",
    )

    def check_targets(self) -> None:
        """Adapters need at least one target module; one string of names (``q_proj``,
        ``q_proj,v_proj``) is no regex that matches one (PEFT matches a string against a
        module's whole name), so it is refused with the list to write."""
        targets = self.target_modules
        if self.r > 0 and isinstance(targets, list) and not targets:
            raise ValueError("model.lora.target_modules: empty list (use all-linear)")
        if self.r > 0 and isinstance(targets, str) and targets.strip().lower() == "all_linear":
            raise ValueError(
                f"model.lora.target_modules={targets!r}: no module has that name; did you "
                "mean all-linear?"
            )
        names = isinstance(targets, str) and re.fullmatch(r"\w+(\s*,\s*\w+)*", targets)
        if self.r > 0 and names:  # ("all-linear" is no such string)
            listed = ", ".join(n.strip() for n in targets.split(","))
            raise ValueError(
                f"model.lora.target_modules={targets!r}: one string is a regex that must "
                "match a module's whole name (model.layers.0.self_attn.q_proj), as in "
                f"PEFT; to name modules by their last part write a list: "
                f"model.lora.target_modules='[{listed}]'"
            )

    @property
    def drops_inputs(self) -> bool:
        """Whether adapters are on and drop their inputs (``dropout`` > 0): a forward's
        masks are then a draw of its own (:meth:`gspo.training.policy.Policy.same_dropout`)."""
        return self.r > 0 and self.dropout > 0


class ModelConfig(Section):
    """The policy: a local Hugging Face causal LM (``model.path``) or a built-in tiny one.

    The ``layers`` .. ``norm_topk_prob`` keys size the built-in model (a real
    transformers architecture, random init, character tokenizer) and are ignored when
    ``model.path`` is set.
    """

    path: str | None = Field(
        None, description="Local HF causal-LM directory (~ expanded); None = built-in"
    )
    builtin: Literal["qwen3", "qwen3_moe"] = Field(
        "qwen3",
        description="Built-in architecture when model.path is null: qwen3 (dense) or "
        "qwen3_moe (Mixture-of-Experts)",
    )
    layers: int = Field(4, ge=1, description="Built-in: transformer layers")
    hidden: int = Field(256, ge=8, description="Built-in: hidden size (head dim = hidden / heads)")
    heads: int = Field(4, ge=1, description="Built-in: attention heads")
    kv_heads: int = Field(
        2, ge=1, description="Built-in: key/value heads (grouped-query attention)"
    )
    intermediate: int = Field(
        768,
        ge=8,
        description="Built-in qwen3: MLP width (qwen3_moe's experts use model.expert_intermediate)",
    )
    experts: int = Field(8, ge=1, description="Built-in qwen3_moe: experts per layer")
    experts_per_token: int = Field(
        2, ge=1, description="Built-in qwen3_moe: experts activated per token (top-k)"
    )
    expert_intermediate: int = Field(
        256,
        ge=1,
        description="Built-in qwen3_moe: each expert's MLP width (moe_intermediate_size; "
        "Qwen3-30B-A3B: 768 at hidden 2048)",
    )
    norm_topk_prob: bool = Field(
        True,
        description="Built-in qwen3_moe: renormalise the top-k routing weights to sum to 1 "
        "(Qwen3-MoE's setting); false = the raw softmax probabilities",
    )
    experts_implementation: Literal["auto", "eager", "grouped_mm", "batched_mm", "padded"] = Field(
        "auto",
        description="How MoE experts compute (any MoE model; the same sums up to "
        "rounding): auto = as transformers sets the model up (grouped_mm in "
        "transformers 5.24); eager, grouped_mm, batched_mm = transformers' own (eager: "
        "its loop over experts); padded = gspo's three batched matmuls (faster than the "
        "eager loop with many experts on CPU, slower than grouped_mm: "
        "benchmarks/moe_experts.py; the families whose routers gspo handles, docs/moe.md). "
        "A value that does nothing for the model is a warning",
    )
    cpu_linear: Literal["auto", "onednn", "torch"] = Field(
        "auto",
        description="Float32 linear layers on the CPU: onednn = oneDNN's matrix products "
        "(about 2x torch's default MKL on AMD CPUs; the same sums up to rounding), torch = "
        "F.linear as shipped (MKL: the faster on Intel CPUs), auto = onednn on CPUs not "
        "Intel's, torch on Intel's. Ignored on CUDA and where this torch has no oneDNN",
    )
    head_precision: Literal["auto", "float32", "bf16_weight"] = Field(
        "auto",
        description="The vocabulary projection, in the torch engine's sampler and the "
        "trainer alike (vLLM keeps its own: with bf16_weight, old_logprobs=auto recomputes "
        "pi_old; its logits are float32 either way): float32 = float32 products (on CUDA "
        "outside the tensor cores), bf16_weight = the weight rounded to bf16 (the same "
        "rounding on both sides), the hidden state kept to ~16 bits as two bf16 terms, "
        "float32 sums: tensor-core products on CUDA (elsewhere the same arithmetic, no "
        "faster); auto = bf16_weight on CUDA when model.dtype is below float32, else float32 "
        "(docs/precision.md)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype of the forward passes (autocast; trained weights and "
        "optimizer stay float32, a LoRA run's frozen base is held in it on CUDA) and of "
        "vLLM; auto = bfloat16 on CUDA (float32 for the built-in model, i.e. without "
        "model.path: docs/precision.md), float32 on CPU; float16 scales the loss "
        "(train/loss_scale)",
    )
    device: str = Field(
        "auto",
        description="torch device (cpu, cuda, cuda:1); auto = CUDA if available, else CPU. "
        "Under torchrun, cuda means GPU LOCAL_RANK",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Keep only each transformer block's input from the training forward and "
        "recompute the block in backward (transformers' activation checkpointing): the "
        "update's activation memory drops from every block's intermediates to one block's, "
        "for about one more forward per update (docs/training.md, Memory); no effect on "
        "no-grad forwards (pi_old, the reference, generation). The model must support it",
    )
    compile: bool = Field(
        False,
        description="The policy's training forwards (the update's, pi_old's recompute, the "
        "cold start's): each transformer block through torch.compile, which fuses its small "
        "elementwise kernels; compiling costs seconds at the first forward of each kind "
        "(with and without gradients; shapes symbolic). Dense models the torch engine's fast "
        "decoder runs, in one process; on the CPU with model.cpu_linear=torch "
        "(docs/training.md)",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)

    @field_validator("path")
    @classmethod
    def _home(cls, value: str | None) -> str | None:
        return None if value is None else os.path.expanduser(value)

    @field_validator("device")
    @classmethod
    def _torch_device(cls, value: str) -> str:
        """A device torch can name (``gpu`` is not one); whether this machine has it is
        checked when a run starts."""
        if value != "auto":
            import torch

            try:
                torch.device(value)
            except RuntimeError:
                raise ValueError("not a torch device (auto, cpu, cuda, cuda:1)") from None
        return value

    def check_builtin_shape(self) -> None:
        """The built-in model's sizes fit together (a ``model.path`` brings its own)."""
        if self.path is None:
            if self.hidden % self.heads or (self.hidden // self.heads) % 2:
                raise ValueError(
                    f"model.hidden={self.hidden} must be model.heads={self.heads} times an "
                    "even head size (rotary embeddings rotate pairs of dimensions)"
                )
            if self.heads % self.kv_heads:
                raise ValueError(
                    f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads}"
                )
            if self.builtin == "qwen3_moe" and self.experts_per_token > self.experts:
                raise ValueError(
                    f"model.experts_per_token={self.experts_per_token} exceeds "
                    f"model.experts={self.experts}"
                )


class MoEConfig(Section):
    """Mixture-of-Experts diagnostics and Routing Replay (MoE models only)."""

    routing_replay: bool = Field(
        False,
        description="Compute pi_theta for the ratio through the experts pi_old chose "
        "(needs rollout.max_staleness=0)",
    )
    measure_churn: bool | None = Field(
        None,
        description="Log moe/expert_change_fraction after each optimizer step; "
        "null = on for MoE models, off with rollout.max_staleness > 0 (pi_old's routing is "
        "not the trainer's; true there is refused)",
    )
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0.0,
        description="Weight of the routers' load-balancing loss (Switch Transformer, over "
        "the response tokens) added to the RL loss; 0 = off. Qwen3-MoE configs use 0.001",
    )


#: ``model.*`` keys a resumed run may change: how the same weights are computed, not
#: which weights they are (the checkpoint holds those).
RESUME_MAY_CHANGE = frozenset(
    {"device", "dtype", "cpu_linear", "head_precision", "experts_implementation",
     "activation_checkpointing", "compile"}
)  # fmt: skip
