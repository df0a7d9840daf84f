"""The weights being trained, behind one handle: :class:`Policy`."""

from __future__ import annotations

import contextlib
import copy

import torch

from gspo.distributed import Distributed, full_state_dict, shard_policy
from gspo.engines import RolloutBatch
from gspo.models import CompletionLogprobs, WithEntropy
from gspo.training.lora import is_lora
from gspo.training.seeds import derive_seed


class Policy:
    """The trained model as the loop sees it: forward, backward, version, whole weights.

    ``module`` is the HF causal LM; ``forward`` (:class:`CompletionLogprobs` over it) is
    the training forward and, under torchrun, FSDP2's root unit. :meth:`replica` gives the
    whole weights as a plain HF module: the module itself in one process, a copy refreshed
    from the shards under FSDP. Rollout engines sample from it and checkpoints export it.
    ``version`` counts optimizer steps (SFT and RL) so that whoever holds a copy of the
    weights knows when it is stale.

    With LoRA (``adapters``) ``module`` is a PEFT model: only the adapters train, the
    replica under FSDP is refreshed from the gathered adapters alone, :meth:`base` is the
    same module with its adapters off (the KL reference); engines that take plain weights
    get the replica with its adapters merged into a copy
    (:func:`gspo.training.sampler.push_weights`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        dist: Distributed,
        *,
        compute_dtype: torch.dtype,
        temperature: float,
    ):
        self.module = module
        self.forward = CompletionLogprobs(module)
        self.dist = dist
        self.compute_dtype = compute_dtype
        self.device = next(module.parameters()).device
        self.temperature = temperature
        self.adapters = is_lora(module)
        self._replica = module
        if dist.enabled:
            self._replica = copy.deepcopy(module).requires_grad_(False)
            shard_policy(self.forward, module, dist.world_size)
        self.version = 0
        self._replica_version = 0
        #: the current rollout batch's dropout seed (LoRA dropout), None = no dropout
        self.dropout_seed: int | None = None

    def parameters(self):
        return self.forward.parameters()

    def train(self) -> None:
        self.forward.train()

    def same_dropout(self, k: int) -> None:
        """Before a forward of minibatch ``k``: torch's global generator, which PEFT's
        dropout draws from, seeded for that minibatch, so pi_old's recompute and the
        update's forward of one minibatch drop the same inputs and the ratio is 1 on the
        same weights (a no-op while ``dropout_seed`` is None)."""
        if self.dropout_seed is not None:
            torch.manual_seed(derive_seed(self.dropout_seed, k))

    def stepped(self) -> None:
        """Record that an optimizer step (or a checkpoint load) changed the weights."""
        self.version += 1

    def base(self):
        """Context in which the forward runs the frozen base: the adapters switched off.

        Only for a LoRA policy; under FSDP every rank enters it at the same point.
        """
        if not self.adapters:
            raise ValueError("Policy.base: the policy has no adapters (model.lora.r=0)")
        return self.module.disable_adapter()

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def logprobs(
        self,
        batch: RolloutBatch,
        module: torch.nn.Module | None = None,
        *,
        with_entropy: WithEntropy = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Completion log-probs ``[N, T]`` of ``batch`` under ``module`` (the policy by default).

        ``with_entropy``: ``(log-probs, entropy)``, the entropy of each completion position's
        next-token distribution from the same chunked pass (no full logits tensor).
        The responses of a group share their prompt, which is computed once for them
        (``share_prompts``, see :func:`gspo.models.packed_completion_logprobs`).
        """
        forward = self.forward if module is None else CompletionLogprobs(module)
        with self.autocast():
            return forward(
                batch.prompt_ids,
                batch.prompt_mask,
                batch.completion_ids,
                batch.completion_mask,
                temperature=self.temperature,
                share_prompts="auto",
                with_entropy=with_entropy,
            )

    def backward(
        self, loss: torch.Tensor, local_count: float, own: torch.Tensor | None = None
    ) -> None:
        """``loss.backward()`` for a mean over ``local_count`` items of this rank's share.

        Under torchrun the loss is scaled (:meth:`Distributed.mean_scale`) so that FSDP's
        average over ranks is the gradient of the mean over the whole global batch.
        ``own``: a loss each rank computes over its whole share whatever was counted (a
        MoE model's load balancing), added unscaled: FSDP averages it over ranks.
        """
        if self.dist.enabled:
            loss = loss * self.dist.mean_scale(local_count)
        (loss if own is None else loss + own).backward()

    def replica(self) -> torch.nn.Module:
        """The whole weights as a plain HF module, brought up to the current version.

        A collective under torchrun (gathered from the shards): every rank calls it at the
        same point of the loop.
        """
        if self._replica_version != self.version:
            if self._replica is not self.module:
                # a LoRA run gathers the adapters only: the frozen base never changes
                state = full_state_dict(self.module, self.dist, trainable_only=self.adapters)
                self._replica.load_state_dict(state, strict=not self.adapters)
            self._replica_version = self.version
        return self._replica
