"""Rollout engines: sample G responses per prompt and return them as a :class:`RolloutBatch`.

An engine is anything with ``generate`` and ``sync_weights`` (:class:`RolloutEngine`).
:class:`TorchEngine` samples from the training module itself (HF causal LM, KV cache),
so its weights are always current and ``sync_weights`` has nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import Tensor

from gspo.models import position_ids_from_mask


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


@dataclass
class RolloutBatch:
    """``N = prompts * group_size`` sampled responses; rows of one group are consecutive.

    Tensors: ``prompt_ids``/``prompt_mask`` ``[N, P]`` left-padded; ``completion_ids``/
    ``completion_mask`` ``[N, T]`` right-padded (the mask covers the sampled tokens,
    the stop token included); ``sampler_logprobs`` ``[N, T]`` float32 log-probs the
    sampler assigned to its tokens under ``softmax(logits / temperature)`` (0 where masked).
    ``finish_reasons`` is ``"stop"`` or ``"length"`` per row.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    sampler_logprobs: Tensor
    finish_reasons: list[str]
    group_size: int

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)

    def select(self, rows: Tensor) -> RolloutBatch:
        """The sub-batch of the given row indices (a minibatch), trimmed of empty columns."""
        picked = {
            f.name: getattr(self, f.name)[rows]
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        reasons = [self.finish_reasons[i] for i in rows.tolist()]
        batch = RolloutBatch(**picked, finish_reasons=reasons, group_size=self.group_size)
        return batch.trimmed()

    def trimmed(self) -> RolloutBatch:
        """Drop prompt columns that are padding in every row and trailing completion padding."""
        p_keep = int(self.prompt_mask.sum(-1).max().item()) if len(self) else 0
        t_keep = int(self.completion_mask.sum(-1).max().item()) if len(self) else 0
        p = self.prompt_ids.shape[1]
        return RolloutBatch(
            prompt_ids=self.prompt_ids[:, p - p_keep :],
            prompt_mask=self.prompt_mask[:, p - p_keep :],
            completion_ids=self.completion_ids[:, :t_keep],
            completion_mask=self.completion_mask[:, :t_keep],
            sampler_logprobs=self.sampler_logprobs[:, :t_keep],
            finish_reasons=self.finish_reasons,
            group_size=self.group_size,
        )


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


def sample_next(
    logits: Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """One decoding step: ``[R, V]`` logits -> (token ids ``[R]``, their log-probs ``[R]``).

    The log-prob is under ``softmax(logits / temperature)`` before top-p truncation (the
    distribution the trainer recomputes); greedy decoding reports ``temperature = 1``.
    """
    logits = logits.float()
    if params.logit_noise > 0:
        noise = torch.randn(logits.shape, generator=generator, device=logits.device)
        logits = logits + params.logit_noise * noise
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


#: Finished rows leave the batch and KV cache once this share of the batch has finished.
DROP_FRACTION = 0.25


class TorchEngine:
    """Batched sampling from a HF causal LM with a KV cache; finished rows leave the batch.

    Each distinct prompt is run through the model once (prefill) and its KV cache copied
    to its ``n`` responses, instead of ``n`` identical prefills. Only unfinished rows draw
    from the generator, so the samples do not depend on when finished rows are dropped.
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, eos_token_id: int | None):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model  # same module object: nothing to copy

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch:
        from transformers import DynamicCache

        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        generator = torch.Generator(device=device).manual_seed(seed)
        unique_ids, unique_mask = pad_batch(prompts, self.pad_token_id, device)
        prompt_ids = unique_ids.repeat_interleave(n, dim=0)
        prompt_mask = unique_mask.repeat_interleave(n, dim=0)
        rows = prompt_ids.shape[0]
        stop_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

        tokens_out = torch.full((rows, params.max_new_tokens), self.pad_token_id, dtype=torch.long)
        logprobs_out = torch.zeros((rows, params.max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(rows, dtype=torch.long)
        finished = [False] * rows

        # prefill: each distinct prompt once, then its cache and logits copied n times
        cache = DynamicCache()
        out = model(
            input_ids=unique_ids,
            attention_mask=unique_mask,
            position_ids=position_ids_from_mask(unique_mask),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1, :].repeat_interleave(n, dim=0)
        active = torch.arange(rows, device=device)  # original row of each live batch row
        attention = prompt_mask
        positions = position_ids_from_mask(prompt_mask)
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # per live batch row
        for k in range(params.max_new_tokens):
            # Finished rows stay in the batch (their tokens are ignored) until a quarter
            # of it has finished: re-indexing the KV cache at every step costs more.
            tokens = torch.full((len(active),), self.pad_token_id, dtype=torch.long, device=device)
            picked, logprobs = sample_next(logits[alive], params, generator)
            tokens[alive] = picked
            rows_cpu = active[alive].cpu()
            tokens_out[rows_cpu, k] = picked.cpu()
            logprobs_out[rows_cpu, k] = logprobs.cpu()
            lengths[rows_cpu] = k + 1
            done = torch.isin(picked, stop)
            for r in rows_cpu[done.cpu()].tolist():
                finished[r] = True
            alive[alive.clone()] = ~done
            if not alive.any():
                break
            if (~alive).sum() >= DROP_FRACTION * len(alive):  # finished rows leave the batch
                idx = alive.nonzero().squeeze(-1)
                cache.batch_select_indices(idx)
                active, tokens, attention = active[idx], tokens[idx], attention[idx]
                positions, alive = positions[idx], alive[idx]
            attention = torch.cat([attention, attention.new_ones(attention.shape[0], 1)], dim=1)
            positions = positions[:, -1:] + 1
            if k + 1 < params.max_new_tokens:
                out = model(
                    input_ids=tokens.unsqueeze(-1),
                    attention_mask=attention,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                cache, logits = out.past_key_values, out.logits[:, -1, :]

        t = int(lengths.max().item()) if rows else 0
        completion_mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
        model.train(was_training)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens_out[:, :t].to(device),
            completion_mask=completion_mask.to(device),
            sampler_logprobs=(logprobs_out[:, :t] * completion_mask).to(device),
            finish_reasons=["stop" if f else "length" for f in finished],
            group_size=n,
        )
