"""The frozen reference policy of the KL penalty (``algorithm.kl_coef > 0``)."""

from __future__ import annotations

from pathlib import Path

import torch

from gspo.engines import RolloutBatch
from gspo.models import load_model, model_files
from gspo.models.kernels import head_precision, linear_kernel, set_linear_kernel
from gspo.moe import experts_implementation, set_experts_implementation
from gspo.moved import model_not_found
from gspo.training.checkpoint import checkpoint_dir
from gspo.training.policy import Policy, per_minibatch


class Reference:
    """Log-probs under the cold-start model (the step-0 checkpoint), when the KL is on.

    Loaded on first use, so a run without the penalty never holds a second model, and a
    resumed run reads the same step-0 weights. A LoRA run (``policy.adapters``) loads
    nothing: its frozen base is the step-0 model, so the reference is the policy's own
    forward with the adapters switched off.
    """

    def __init__(
        self, kl_coef: float, output_dir: Path, policy: Policy, model_path: str | None = None
    ):
        self.enabled = kl_coef > 0.0
        self.path = checkpoint_dir(output_dir, 0)
        self.model_path = model_path  # (``model.path``: where a step 0's model is now)
        self.policy = policy
        self.module: torch.nn.Module | None = None

    def logprobs(self, batch: RolloutBatch) -> torch.Tensor | None:
        """``[N, T]`` reference log-probs of ``batch``, or ``None`` when the KL is off."""
        if not self.enabled:
            return None
        if self.policy.adapters:
            with torch.no_grad(), self.policy.base():
                return self.policy.logprobs(batch)
        if self.module is None:
            model_dir = model_files(self.path, self.model_path)
            if not model_dir.is_dir():
                raise model_not_found(model_dir, self.path)
            self.module, _ = load_model(  # the policy's load said what its weights lack
                model_dir,
                device=self.policy.device,
                dtype=torch.float32,
                warn=False,
            )
            self.module.eval().requires_grad_(False)
            policy = self.policy.module
            set_linear_kernel(self.module, linear_kernel(policy), head_precision(policy))
            set_experts_implementation(self.module, experts_implementation(self.policy.module))
        with torch.no_grad():
            return self.policy.logprobs(batch, self.module)

    def per_minibatch(self, batch: RolloutBatch, minibatches: list[torch.Tensor]) -> torch.Tensor:
        """``[N, T]`` reference log-probs, each minibatch on its training forward's layout
        (the pass before the first update; the KL must be on)."""
        return per_minibatch(self.logprobs, batch, minibatches)
