"""Log-probs of completions under a model: the training forward.

Everything the trainer needs from a model's outputs goes through :func:`completion_logprobs`
(packed sequences, the vocabulary head chunked and in float32), so a built-in tiny Qwen3
and a user's Qwen3-8B directory take the same path; the rollout engines' decoders use the
same head (:func:`head_logits`) so that sampler and trainer agree.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from gspo.models.kernels import bf16_weight_linear, head_chunk, head_linear_for


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
        on_host: Sequence[Tensor] | None = None,
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


#: Least tokens per packed row (a row is at least as long as the longest sequence).
#: Attention runs over a whole row, block-diagonal mask included, so a row costs
#: ``row_tokens**2`` in attention: short rows keep that near the per-sequence cost. On the
#: benchmark workload (32 sequences, 679 tokens) forward + backward took 142 ms in one
#: row, 123 ms in rows of 128 and 106 ms in rows of 64 (``python benchmarks/levers.py``).
#: 64 is not the default because the demo's outcome moved with it (rows change the float
#: rounding): its cold start ended at greedy 0.82 instead of 0.98 and RL reached 0.78,
#: under the demo's 0.80 target (benchmarks/README.md).
PACK_TOKENS = 128


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
    on_host: Sequence[Tensor] | None = None,
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


@dataclass
class PackedLayout:
    """Where each sequence's tokens sit in the packed forward (:func:`pack_layout`), on
    the model's device: ``tokens``/``positions`` ``[R, W]`` (``mask`` ``[R, 1, W, W]`` when
    prompts are shared, else None), and for each counted completion token ``k`` of row
    ``i`` (``rows``, ``cols``, in ``completion_mask.nonzero()`` order) the packed row and
    column of the hidden state that predicts it and the token itself (``targets``)."""

    tokens: Tensor
    positions: Tensor
    mask: Tensor | None
    rows: Tensor
    cols: Tensor
    packed_rows: Tensor
    before: Tensor
    targets: Tensor


def pack_layout(
    config,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    pack_tokens: int = PACK_TOKENS,
    share_prompts: bool | Literal["auto"] = False,
    on_host: Sequence[Tensor] | None = None,
) -> PackedLayout:
    """The packed layout of :func:`packed_completion_logprobs` (``config``: the model's).

    Worked out on the host from a copy of the inputs there and moved to their device in
    pinned memory without waiting: on CUDA, building it there took a host
    synchronisation per row (each boolean selection) and a kernel per slice, during which
    the GPU sat idle. ``on_host``: that copy (the four tensors in CPU memory, e.g.
    :meth:`gspo.engines.RolloutBatch.on_host`), else it is made here (one wait).
    """
    device = completion_ids.device
    n = completion_ids.shape[0]
    host = torch.device("cpu")
    if on_host is None:
        tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        joined = torch.cat([x.long() for x in tensors], 1).to(host)  # one copy, one wait
        on_host = joined.split([x.shape[1] for x in tensors], 1)
    prompt_ids, completion_ids = on_host[0].long(), on_host[2].long()
    prompt_mask, completion_mask = on_host[1].bool(), on_host[3].bool()
    prompt_len = prompt_mask.sum(-1).tolist()
    prompts = [prompt_ids[i][prompt_mask[i]] for i in range(n)]
    completions = [completion_ids[i][completion_mask[i]] for i in range(n)]
    # segments: a prompt and the rows whose completions follow it (one row each, unshared)
    segments = [[i] for i in range(n)]
    lengths = [prompt_len[i] + len(completions[i]) for i in range(n)]
    place, used = _pack(lengths, pack_tokens)
    shared = False
    window = sliding_window(config)  # the shared layout's explicit mask would drop it
    if (
        share_prompts
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and (window is None or max(lengths) <= window)
    ):
        members: dict[tuple[int, ...], list[int]] = {}
        for i in range(n):
            members.setdefault(tuple(prompts[i].tolist()), []).append(i)
        if len(members) < n:  # some prompt repeats
            groups = list(members.values())
            group_lengths = [
                prompt_len[rows[0]] + sum(len(completions[i]) for i in rows) for rows in groups
            ]
            group_place, group_used = _pack(group_lengths, pack_tokens)
            if share_prompts != "auto" or layout_cost(config, group_used) < layout_cost(
                config, used
            ):
                segments, lengths, place, used = groups, group_lengths, group_place, group_used
                shared = True
    width = max(used)
    tokens = torch.zeros((len(used), width), dtype=torch.long, device=host)  # tail: any id
    positions = torch.zeros((len(used), width), dtype=torch.long, device=host)
    # per packed token: its segment (tail: one more) and branch (0 prompt, j+1 completion j)
    segment_of = torch.full((len(used), width), -1, dtype=torch.long, device=host)
    branch_of = torch.zeros((len(used), width), dtype=torch.long, device=host)
    row_of, prompt_end, completion_start = [0] * n, [0] * n, [0] * n
    for s, rows in enumerate(segments):
        row, offset = place[s]
        p = prompt_len[rows[0]]
        tokens[row, offset : offset + p] = prompts[rows[0]]
        positions[row, offset : offset + p] = torch.arange(p, device=host)
        segment_of[row, offset : offset + lengths[s]] = s
        at = offset + p
        for j, i in enumerate(rows):
            length = len(completions[i])
            tokens[row, at : at + length] = completions[i]
            positions[row, at : at + length] = torch.arange(p, p + length, device=host)
            branch_of[row, at : at + length] = j + 1
            row_of[i], prompt_end[i], completion_start[i] = row, offset + p - 1, at
            at += length
    for row, filled in enumerate(used):  # the tail of a row is one more dummy sequence
        positions[row, filled:] = torch.arange(width - filled, device=host)
    mask = None
    if shared:  # [rows, 1, query, key], built where the model is (it grows as width^2)
        segment_of[segment_of < 0] = len(segments)
        segment_of, branch_of = to_device(segment_of, device), to_device(branch_of, device)
        same = segment_of.unsqueeze(2) == segment_of.unsqueeze(1)  # [rows, query, key]
        causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
        visible = (branch_of.unsqueeze(1) == 0) | (branch_of.unsqueeze(2) == branch_of.unsqueeze(1))
        mask = (same & causal & visible).unsqueeze(1)
    # completion token k of row i is predicted by the hidden state just before it: the
    # prompt's last token for k = 0, the completion's token k - 1 after that
    rows, cols = completion_mask.nonzero(as_tuple=True)
    before = torch.where(
        cols == 0, torch.tensor(prompt_end)[rows], torch.tensor(completion_start)[rows] + cols - 1
    )
    packed_rows, targets = torch.tensor(row_of)[rows], completion_ids[rows, cols]
    moved = [to_device(x, device) for x in (tokens, positions, rows, cols, packed_rows, before)]
    moved.append(to_device(targets, device))
    return PackedLayout(moved[0], moved[1], mask, *moved[2:])


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` (on the host) on ``device``: from pinned memory without waiting on CUDA."""
    if device.type != "cuda" or x.device.type != "cpu":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def _entropy(logits: Tensor, logsumexp: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` along the last dimension, given its logsumexp.

    A token a model rules out (logit -inf, probability 0) adds nothing: ``0 * -inf`` would
    make the entropy NaN, so such logits count at the dtype's lowest finite value."""
    low = torch.finfo(logits.dtype).min
    return logsumexp - (torch.softmax(logits, dim=-1) * logits.clamp_min(low)).sum(-1)


def _pack(lengths: list[int], pack_tokens: int) -> tuple[list[tuple[int, int]], list[int]]:
    """First-fit decreasing of segments of ``lengths`` tokens into rows of at least
    ``pack_tokens``: ``(row, offset)`` of each segment, and the tokens in each row."""
    budget = max([pack_tokens, *lengths])
    used: list[int] = []
    place = [(0, 0)] * len(lengths)
    for s in sorted(range(len(lengths)), key=lambda s: -lengths[s]):
        row = next((r for r, u in enumerate(used) if u + lengths[s] <= budget), None)
        if row is None:
            used.append(0)
            row = len(used) - 1
        place[s] = (row, used[row])
        used[row] += lengths[s]
    return place, used


def sliding_window(config) -> int | None:
    """The attention window of a model whose layers (some or all) see only the last
    ``sliding_window`` tokens (Mistral; Qwen2 with ``use_sliding_window``; Gemma's local
    layers), or None where every layer sees the whole sequence."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return window if isinstance(window, int) and window > 0 else None


def layout_cost(config, used: list[int]) -> float:
    """Estimated FLOPs of a packed forward whose rows hold ``used`` tokens each.

    Every row is padded to the widest, and attention runs over a whole row through a
    mask (SDPA computes every block of it): per layer ``2 x`` the projection and MLP
    weights per position, plus ``4 x heads x head_dim`` per (query, key) pair of a row.
    Backward scales both alike. The LM head is the same for every layout and left out.
    """
    rows, width = len(used), max(used)
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", heads)
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    active = getattr(config, "num_experts_per_tok", 1) if hasattr(config, "num_experts") else 1
    weights = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter * active
    layers = config.num_hidden_layers
    return layers * (2.0 * weights * rows * width + 4.0 * heads * head_dim * rows * width**2)


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
