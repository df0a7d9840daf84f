"""Sampling one token per row from its logits: :func:`sample_next`, what every decoding
step of :class:`gspo.engines.TorchEngine` runs (eagerly, or inside a captured CUDA graph:
it reads its random numbers from the tensors it is given and synchronises nothing)."""

from __future__ import annotations

import torch
from torch import Tensor

from gspo.engines.batch import SamplingParams


def sample_next(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    *,
    uniforms: Tensor | None = None,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One decoding step: ``[R, V]`` logits -> (token ids ``[R]``, their log-probs ``[R]``).

    The log-prob is under ``softmax(logits / temperature)`` before top-p truncation (the
    distribution the trainer recomputes); greedy decoding reports ``temperature = 1``.
    A token is drawn by inverting the (truncated) CDF at one uniform number per row,
    ``uniforms`` ``[R]`` in ``[0, 1)``; ``noise`` ``[R, V]`` is the standard normal noise
    of ``params.logit_noise``. Either is drawn from ``generator`` when not given.
    """
    logits = logits.float()
    if params.logit_noise > 0:
        if noise is None:
            noise = torch.randn(logits.shape, generator=generator, device=logits.device)
        logits = logits + params.logit_noise * noise
    if params.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # (x / 1 is x)
    logprobs = torch.log_softmax(scaled, dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    if uniforms is None:
        uniforms = torch.rand(logits.shape[0], generator=generator, device=logits.device)
    # float64: a float32 running sum over a large vocabulary drifts by more than the
    # probability of its rarest tokens
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
