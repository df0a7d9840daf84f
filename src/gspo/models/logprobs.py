"""Log-probs of completions under a model: the training forward.

Everything the trainer needs from a model's outputs goes through :func:`completion_logprobs`
(packed sequences, the vocabulary head chunked and in float32), so a built-in tiny Qwen3
and a user's Qwen3-8B directory take the same path; the rollout engines' decoders use the
same head (:func:`head_logits`) so that sampler and trainer agree.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gspo.models.kernels import bf16_weight_linear, head_chunk, head_linear_for
from gspo.models.layout import PACK_TOKENS, HostCopy, pack_layout


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


#: Architectures whose logits are exactly ``lm_head(final hidden state)``: for these the
#: vocabulary projection is done in chunks from the hidden states (no full logits tensor).
PLAIN_LM_HEAD = frozenset(
    {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "olmoe"}
)

#: ``with_entropy``: no entropy (False), the entropy with its gradient (True: an entropy
#: bonus in the loss), or ``"metric"``: the same values without a graph, computed once in
#: the forward and not again when backward recomputes a checkpointed head chunk.
WithEntropy = bool | Literal["metric"]

#: The vocabulary projection of a plain head runs in float32 (autocast off), in the
#: sampler and in the trainer alike. Under bf16 autocast the logits would otherwise be
#: rounded to bf16 (8 significant bits: 0.06 at a logit of 16) by each side separately,
#: and a small difference in their hidden states then flips roundings: per-token log-probs
#: that differ by up to ~0.1, more than GSPO's 3e-4 clip range on the sequence mean
#: (docs/precision.md). False: the head in the compute dtype (for measurements only).
HEAD_IN_FLOAT32 = True


def plain_lm_head(model) -> bool:
    """Whether ``model``'s logits are exactly ``lm_head(final hidden state)``: a bias-free
    ``nn.Linear`` head on an architecture of :data:`PLAIN_LM_HEAD`."""
    head = model.get_output_embeddings()
    return (
        type(head) is torch.nn.Linear
        and head.bias is None
        and getattr(model.config, "model_type", None) in PLAIN_LM_HEAD
    )


def head_logits(hidden: Tensor, weight: Tensor, linear=F.linear) -> Tensor:
    """``hidden @ weight.T``, ``[..., H] x [V, H] -> [..., V]`` float32 logits of a plain
    head, summed in float32 whatever autocast is on (:data:`HEAD_IN_FLOAT32`).

    ``linear``: the product (:func:`gspo.models.kernels.head_linear_for` of the model):
    float32, or ``bf16_weight_linear`` (which casts its inputs itself).
    """
    if not HEAD_IN_FLOAT32:
        return linear(hidden, weight).float()
    with torch.autocast(hidden.device.type, enabled=False):
        if getattr(linear, "func", linear) is bf16_weight_linear:  # (or a partial of it)
            return linear(hidden, weight)
        return linear(hidden.float(), weight.float())


def head_matrix(weight: Tensor, linear) -> Tensor:
    """The head's ``weight`` in the dtype ``linear`` (:func:`head_logits`' product)
    computes with: bf16 for ``bf16_weight_linear``, else float32 (:data:`HEAD_IN_FLOAT32`;
    as it is when that is off). Cast once, by the caller, not per chunk or per step."""
    if not HEAD_IN_FLOAT32:
        return weight
    return weight.bfloat16() if linear is bf16_weight_linear else weight.float()


class CompletionLogprobs(torch.nn.Module):
    """The training forward: log-probs of completions under ``model`` (see
    :func:`completion_logprobs`) as a module.

    The trainer calls this module, not the HF model, for every log-prob it trains on, so
    a wrapper around the whole computation (FSDP2's root unit under ``torchrun``) sees
    the embeddings, the decoder and the LM head used inside one ``forward``.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        completion_ids: Tensor,
        completion_mask: Tensor,
        temperature: float = 1.0,
        share_prompts: bool | Literal["auto"] = False,
        with_entropy: WithEntropy = False,
        chunk_size: int | None = None,
        on_host: HostCopy | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Packed for architectures in :data:`PLAIN_LM_HEAD`, else the model's own forward
        (``on_host``: the four inputs in CPU memory, for the packed layout)."""
        if plain_lm_head(self.model):
            return packed_completion_logprobs(
                self.model,
                prompt_ids,
                prompt_mask,
                completion_ids,
                completion_mask,
                temperature=temperature,
                chunk_size=chunk_size,
                share_prompts=share_prompts,
                with_entropy=with_entropy,
                on_host=on_host,
            )
        return padded_completion_logprobs(
            self.model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            temperature=temperature,
            with_entropy=with_entropy,
        )


def completion_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    share_prompts: bool | Literal["auto"] = False,
    with_entropy: WithEntropy = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs of the completion tokens under ``model``, ``[N, T]`` float32.

    With ``with_entropy`` also the entropy of the (temperature-scaled) next-token
    distribution at each completion position, ``[N, T]`` float32 (0 where masked),
    computed in the same chunks as the log-probs: no full logits tensor either way.

    ``prompt_ids``/``prompt_mask`` ``[N, P]`` (left-padded), ``completion_ids``/
    ``completion_mask`` ``[N, T]`` (right-padded); 0 where ``completion_mask`` is false.
    The logits are divided by ``temperature`` first, as the sampler does, so the
    trainer's pi_theta and the sampler's pi_old are the same distribution. For
    architectures in :data:`PLAIN_LM_HEAD` the sequences are packed (no compute on
    padding) and only counted completion tokens are projected to the vocabulary,
    ``chunk_size`` at a time (None: :func:`head_chunk`'s;
    :func:`packed_completion_logprobs`, which with ``share_prompts`` also computes a
    prompt repeated over rows once); other models go through their own forward with
    ``logits_to_keep`` (:func:`padded_completion_logprobs`). The trainer's forward is the
    same computation as a module, :class:`CompletionLogprobs`.
    """
    return CompletionLogprobs(model)(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        temperature=temperature,
        share_prompts=share_prompts,
        with_entropy=with_entropy,
        chunk_size=chunk_size,
    )


def padded_completion_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: WithEntropy = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`completion_logprobs` through the model's own forward (padded rows, the logits
    of the completion positions only): any architecture."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1).long()
    t = completion_ids.shape[1]
    inputs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logits = model(**inputs, logits_to_keep=t + 1).logits[:, :-1, :]
    result = token_logprobs_from_logits(
        logits, completion_ids, temperature, with_entropy=with_entropy
    )
    keep = completion_mask.bool()
    masked = [torch.where(keep, x, torch.zeros_like(x)) for x in _as_tuple(result)]
    return (masked[0], masked[1]) if with_entropy else masked[0]


def _as_tuple(result: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def packed_completion_logprobs(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    pack_tokens: int = PACK_TOKENS,
    share_prompts: bool | Literal["auto"] = False,
    with_entropy: WithEntropy = False,
    on_host: HostCopy | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`completion_logprobs` without computing anything on padding.

    The real tokens of the rows (prompt then completion) are laid end to end in rows of
    about ``pack_tokens`` tokens, with positions restarting at 0 for each sequence and no
    attention mask: transformers then builds a block-diagonal causal mask from the
    positions, so sequences do not see each other. Only the hidden states that predict
    counted completion tokens are projected to the vocabulary. Same result as the padded
    forward: ``[N, T]`` float32, 0 where ``completion_mask`` is false. Needs an
    architecture in :data:`PLAIN_LM_HEAD`.

    ``share_prompts``: rows with the same prompt (a group's responses) are laid out as
    one segment, the prompt once and then each completion, positions continuing from the
    prompt in each; an explicit mask lets every completion see the prompt and itself
    only. The prompt is computed once for its rows instead of once per row (in backward
    its gradient gathers them all), which is exact up to float rounding. Taken only for
    SDPA attention (its mask is a boolean 4D tensor) and when some prompt repeats.
    ``"auto"`` shares only when that layout is estimated cheaper (:func:`layout_cost`):
    a shared segment saves the repeated prompt tokens but its attention spans all its
    completions, so it pays for long prompts and short completions, not the reverse.

    The layout is :func:`pack_layout`'s (``on_host``: the inputs in CPU memory, if at hand).
    """
    n, t = completion_ids.shape
    layout = pack_layout(
        model.config, prompt_ids, prompt_mask, completion_ids, completion_mask,
        pack_tokens=pack_tokens, share_prompts=share_prompts, on_host=on_host,
    )  # fmt: skip
    hidden = model.get_decoder()(
        input_ids=layout.tokens,
        attention_mask=layout.mask,
        position_ids=layout.positions,
        use_cache=False,
    ).last_hidden_state
    picked = logprobs_from_hidden(
        hidden[layout.packed_rows, layout.before].unsqueeze(0),
        model.get_output_embeddings().weight,
        layout.targets.unsqueeze(0),
        temperature,
        chunk_size,
        with_entropy=with_entropy,
        linear=head_linear_for(model),
    )
    outs = []
    for values in picked if with_entropy else (picked,):
        out = torch.zeros((n, t), dtype=values.dtype, device=completion_ids.device)
        outs.append(out.index_put((layout.rows, layout.cols), values[0]))
    return (outs[0], outs[1]) if with_entropy else outs[0]


def _entropy(logits: Tensor, logsumexp: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` along the last dimension, given its logsumexp.

    A token a model rules out (logit -inf, probability 0) adds nothing: ``0 * -inf`` would
    make the entropy NaN, so such logits count at the dtype's lowest finite value."""
    low = torch.finfo(logits.dtype).min
    return logsumexp - (torch.softmax(logits, dim=-1) * logits.clamp_min(low)).sum(-1)


def _chunk_head(
    hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, linear
) -> tuple[Tensor, Tensor, Tensor]:
    """A chunk's scaled logits, the log-probs of ``ids`` and the logsumexp."""
    logits = head_logits(hidden, weight, linear)
    if temperature != 1.0:  # (x / 1 is x: a pass over the logits, one in backward, saved)
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    return logits, logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - lse, lse


def _chunk_logprobs(
    hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, linear=F.linear
) -> Tensor:
    return _chunk_head(hidden, weight, ids, temperature, linear)[1]


def _chunk_logprobs_entropy(
    hidden: Tensor, weight: Tensor, ids: Tensor, temperature: float, linear=F.linear
) -> tuple[Tensor, Tensor]:
    logits, logprobs, lse = _chunk_head(hidden, weight, ids, temperature, linear)
    return logprobs, _entropy(logits, lse)


def _chunk_logprobs_metric_entropy(
    hidden: Tensor,
    weight: Tensor,
    ids: Tensor,
    temperature: float,
    linear,
    entropies: list[Tensor],
) -> Tensor:
    """:func:`_chunk_logprobs`, and the entropy as a metric: computed without a graph, and
    only on the chunk's first run (the forward), not when backward recomputes it."""
    logits, logprobs, lse = _chunk_head(hidden, weight, ids, temperature, linear)
    if not entropies:
        with torch.no_grad():
            entropies.append(_entropy(logits, lse))
    return logprobs


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    temperature: float,
    chunk_size: int | None = None,
    *,
    with_entropy: WithEntropy = False,
    linear=F.linear,
) -> Tensor | tuple[Tensor, Tensor]:
    """``log softmax(hidden @ weight.T / temperature)[token]`` without full logits.

    ``hidden`` ``[N, T, H]``, ``weight`` ``[V, H]``, ``token_ids`` ``[N, T]`` ->
    ``[N, T]`` float32. Tokens go through in chunks of ``chunk_size`` (None:
    :func:`head_chunk`'s for the vocabulary and device); with gradients on,
    each chunk is checkpointed, so backward recomputes that chunk's logits instead of
    keeping ``N x T x V`` of them alive: peak memory is one chunk's logits, not all.
    ``with_entropy``: also each position's entropy ``[N, T]``, from the same chunk's
    logits (True: through the same checkpoint, so it may carry a gradient; ``"metric"``:
    without a graph, once, see :data:`WithEntropy`). ``linear``: the
    product ``hidden @ weight.T`` (:func:`gspo.models.kernels.head_linear_for` of the model).
    """
    from torch.utils.checkpoint import checkpoint

    n, t, h = hidden.shape
    chunk_size = chunk_size or head_chunk(weight.shape[0], hidden.device)
    flat_hidden, flat_ids = hidden.reshape(n * t, h), token_ids.reshape(n * t)
    keep_graph = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if keep_graph and weight.requires_grad and HEAD_IN_FLOAT32 and linear is bf16_weight_linear:
        # one bf16 copy for every chunk's product, the weight's gradient still float32: a
        # bf16 copy as the chunks' input would sum their gradients in bf16, an error that
        # grows with the chunks (4.4e-3 -> 6.0e-3 from 8 to 32 chunks of a test head)
        linear = partial(bf16_weight_linear, weight_bf16=weight.detach().bfloat16())
    else:
        weight = head_matrix(weight, linear)  # once, not per chunk
    chunk = _chunk_logprobs_entropy if with_entropy else _chunk_logprobs
    out = []
    for start in range(0, n * t, chunk_size):
        args = (
            flat_hidden[start : start + chunk_size],
            weight,
            flat_ids[start : start + chunk_size],
        )
        if keep_graph and with_entropy == "metric":
            entropy: list[Tensor] = []
            lp = checkpoint(
                _chunk_logprobs_metric_entropy, *args, temperature, linear, entropy,
                use_reentrant=False,
            )  # fmt: skip
            out.append((lp, entropy[0]))
        elif keep_graph:
            out.append(checkpoint(chunk, *args, temperature, linear, use_reentrant=False))
        else:
            out.append(chunk(*args, temperature, linear))
    if not out:
        zeros = hidden.new_zeros((n, t), dtype=torch.float32)
        return (zeros, zeros.clone()) if with_entropy else zeros
    if with_entropy:
        return (
            torch.cat([o[0] for o in out]).reshape(n, t),
            torch.cat([o[1] for o in out]).reshape(n, t),
        )
    return torch.cat(out).reshape(n, t)


def token_logprobs_from_logits(
    logits: Tensor, token_ids: Tensor, temperature: float, *, with_entropy: WithEntropy = False
) -> Tensor | tuple[Tensor, Tensor]:
    """``log softmax(logits / temperature)[token]`` in float32, ``[N, T, V] -> [N, T]``.

    Computed row by row so that at most one row of float32 logits exists at a time.
    ``with_entropy``: also each position's entropy, ``[N, T]``.
    """
    rows, entropies = [], []
    for row_logits, row_ids in zip(logits, token_ids, strict=True):
        scaled = row_logits.float() / temperature
        picked = scaled.gather(-1, row_ids.unsqueeze(-1)).squeeze(-1)
        lse = torch.logsumexp(scaled, dim=-1)
        rows.append(picked - lse)
        if with_entropy:
            with torch.no_grad() if with_entropy == "metric" else contextlib.nullcontext():
                entropies.append(_entropy(scaled, lse))
    if with_entropy:
        return torch.stack(rows), torch.stack(entropies)
    return torch.stack(rows)
