"""What a rollout engine takes and returns: :class:`SamplingParams` in, a
:class:`RolloutBatch` out, and the :class:`RolloutEngine` protocol every engine meets.

An engine is anything with ``generate`` and ``sync_weights``: the torch engine
(:mod:`gspo.engines.torch_engine`) or vLLM (:mod:`gspo.engines.vllm_engine`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Protocol

import torch
from torch import Tensor

from gspo.models.layout import HostCopy, to_device


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` is greedy decoding."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    #: Testing only: Gaussian noise of this standard deviation added to the logits before
    #: sampling, so the sampler's distribution (and its log-probs) differ from the
    #: trainer's, as a bf16 inference engine's do. 0 = the model's own distribution.
    logit_noise: float = 0.0
    #: The torch engine's static decode step (``rollout.cuda_graphs``): whether its buffers
    #: (the KV cache) and graphs stay allocated after this generation, for a later one of
    #: the same shapes (the next rollout batch); False frees them at its end (a multi-turn
    #: episode's later turns, whose shapes do not come again). Not a sampling setting: two
    #: params that differ only here are equal.
    keep_buffers: bool = field(default=True, compare=False)


@dataclass
class RolloutBatch:
    """``N = prompts * group_size`` sampled responses; rows of one group are consecutive.

    Tensors: ``prompt_ids``/``prompt_mask`` ``[N, P]`` left-padded; ``completion_ids``/
    ``completion_mask`` ``[N, T]`` right-padded (the mask covers the sampled tokens,
    the stop token included); ``sampler_logprobs`` ``[N, T]`` float32 log-probs the
    sampler assigned to its tokens under ``softmax(logits / temperature)`` (0 where masked).
    ``finish_reasons`` is ``"stop"`` or ``"length"`` per row.

    ``action_mask`` ``[N, T]`` bool: the completion tokens the model sampled (its actions).
    In a multi-turn episode (:mod:`gspo.training.episodes`) the completion also holds the
    environment's tokens (tool responses, turn separators): context the trainer computes
    through but never trains on. Single-turn rollouts leave it None and it becomes the
    completion mask.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    sampler_logprobs: Tensor
    finish_reasons: list[str]
    group_size: int
    action_mask: Tensor | None = None

    def __post_init__(self) -> None:
        if self.action_mask is None:
            self.action_mask = self.completion_mask.bool()

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)

    def on_host(self) -> HostCopy:
        """The ids and masks in CPU memory: the batch's own tensors on the CPU, else copied
        from the device once (one wait) and handed on to the batches :meth:`select` and
        :meth:`trimmed` make of it, so that cutting a minibatch and laying out its forward
        (:func:`gspo.models.pack_layout`) wait for nothing on CUDA. The batch's tensors are
        not changed in place once made (a changed batch is a new one)."""
        host = self.__dict__.get(_HOST)
        if host is None:
            tensors = (self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask)
            if self.completion_ids.device.type != "cpu":
                joined = torch.cat([t.long() for t in tensors], 1).cpu()  # one copy, one wait
                tensors = joined.split([t.shape[1] for t in tensors], 1)
            host = self.__dict__[_HOST] = HostCopy(*tensors)
        return host

    def select(self, rows: Tensor) -> RolloutBatch:
        """The sub-batch of the given row indices (a minibatch), trimmed of empty columns.
        ``rows`` in CPU memory (a copy on the batch's device is made without waiting; rows
        on a device are copied to the CPU first, which waits)."""
        rows = rows.cpu()
        on_device = to_device(rows, self.completion_ids.device)
        picked = {
            f.name: getattr(self, f.name)[on_device]
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        reasons = [self.finish_reasons[i] for i in rows.tolist()]
        batch = RolloutBatch(**picked, finish_reasons=reasons, group_size=self.group_size)
        batch.__dict__[_HOST] = HostCopy(*(t[rows] for t in self.on_host()))
        return batch.trimmed()

    def trimmed(self) -> RolloutBatch:
        """Drop prompt columns that are padding in every row and trailing completion padding."""
        host = self.on_host()
        p_keep = int(host.prompt_mask.sum(-1).max()) if len(self) else 0
        t_keep = int(host.completion_mask.sum(-1).max()) if len(self) else 0
        p = self.prompt_ids.shape[1]
        batch = RolloutBatch(
            prompt_ids=self.prompt_ids[:, p - p_keep :],
            prompt_mask=self.prompt_mask[:, p - p_keep :],
            completion_ids=self.completion_ids[:, :t_keep],
            completion_mask=self.completion_mask[:, :t_keep],
            sampler_logprobs=self.sampler_logprobs[:, :t_keep],
            finish_reasons=self.finish_reasons,
            group_size=self.group_size,
            action_mask=self.action_mask[:, :t_keep],
        )
        batch.__dict__[_HOST] = HostCopy(
            host.prompt_ids[:, p - p_keep :],
            host.prompt_mask[:, p - p_keep :],
            host.completion_ids[:, :t_keep],
            host.completion_mask[:, :t_keep],
        )
        return batch


#: Where a :class:`RolloutBatch` keeps its :class:`HostCopy` (not a field: a batch made
#: with ``dataclasses.replace`` or by hand makes its own when asked).
_HOST = "_host_copy"


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch:
        """Sample ``n`` responses for each prompt (token ids); rows of a prompt are adjacent."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights."""
        ...


def pad_batch(
    sequences: list[list[int]], pad_id: int, device: torch.device, *, side: str = "left"
) -> tuple[Tensor, Tensor]:
    """``[N, max_len]`` token ids and a 0/1 mask, padded on the ``side`` given.

    Prompts are left-padded (generation continues from the last column); completions
    are right-padded (they start at the first column).
    """
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, s in enumerate(sequences):
        if s:
            cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
    return ids.to(device), mask.to(device)
