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
    tokens = invert_cdf(probs, uniforms)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


#: Tokens per block of :func:`invert_cdf`'s first level (151,936 tokens: 594 blocks).
CDF_BLOCK = 256


def invert_cdf(probs: Tensor, uniforms: Tensor, block: int = CDF_BLOCK) -> Tensor:
    """Per row of ``probs`` ``[R, V]`` (non-negative, not necessarily normalised), the
    token where the row's CDF first exceeds ``uniforms`` ``[R]`` (in ``[0, 1)``) times its
    total: never a token of probability 0.

    In two levels, so that no running sum spans the vocabulary: the blocks' sums (float32
    over ``block`` tokens each), their CDF in float64 picks the block, then the CDF of the
    block's own tokens in float64 picks the token at the same fraction of the block's mass.
    A float32 running sum over the whole vocabulary would drift by more than its rarest
    tokens' probabilities, and one in float64 (what this replaces) scans every token
    twice as wide: 43 ms against 1.4 ms for 64 rows of 151,936 tokens on the CPU
    (``benchmarks/README.md``); the tokens drawn are the same but where a uniform falls
    within a float32 rounding of a block's sum (about 1e-7 of the total) of a boundary.
    Static shapes and no synchronisation: it runs inside a captured CUDA graph."""
    rows, vocab = probs.shape
    whole = vocab - vocab % block
    sums = probs[:, :whole].view(rows, whole // block, block).sum(-1)
    if whole < vocab:  # the last, shorter block
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], dim=-1)
    sums = sums.double()
    cdf = sums.cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)  # < the total: uniforms < 1
    # the first block whose CDF exceeds the target: one of positive mass
    chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    before = (cdf.gather(-1, (chosen - 1).clamp(min=0)) * (chosen > 0)).squeeze(-1)
    # the target's fraction of the block's mass, below 1 by two ulps at most, so that the
    # token found has positive probability (the block's own sum rounds differently)
    mass = sums.gather(-1, chosen).squeeze(-1)
    fraction = ((target.squeeze(-1) - before) / mass).clamp_(0.0, 1.0 - 2.0**-52)
    columns = chosen * block + torch.arange(block, device=probs.device)  # [R, block]
    inside = probs.gather(-1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, 0.0)
    inside = inside.double().cumsum(-1)
    at = (fraction * inside[:, -1]).unsqueeze(-1)
    token = torch.searchsorted(inside, at, right=True).clamp_(max=block - 1)
    return (chosen * block + token).squeeze(-1).clamp_(max=vocab - 1)
