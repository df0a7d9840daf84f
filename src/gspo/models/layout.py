"""Where a forward's tokens go: sequences packed end to end into rows without padding
(:func:`pack_layout`, the layout of :func:`gspo.models.packed_completion_logprobs`),
worked out on the host from a batch's ids and masks there (:class:`HostCopy`), and
moved to the device without waiting for it (:func:`to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

#: Least tokens per packed row (a row is at least as long as the longest sequence).
#: Attention runs over a whole row, block-diagonal mask included, so a row costs
#: ``row_tokens**2`` in attention: short rows keep that near the per-sequence cost. On the
#: benchmark workload (32 sequences, 679 tokens) forward + backward took 142 ms in one
#: row, 123 ms in rows of 128 and 106 ms in rows of 64 (``python benchmarks/levers.py``).
#: 64 is not the default because the demo's outcome moved with it (rows change the float
#: rounding): its cold start ended at greedy 0.82 instead of 0.98 and RL reached 0.78,
#: under the demo's 0.80 target (benchmarks/README.md).
PACK_TOKENS = 128


@dataclass(frozen=True)
class HostCopy:
    """A batch's ids and masks in CPU memory (``[N, P]`` prompts, ``[N, T]`` completions),
    from which :func:`pack_layout` lays out a forward without waiting for a GPU. A
    dataclass, not a tuple: an FSDP root moves the tensors inside a forward's tuple
    arguments to its device, and leaves a dataclass as it is."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor

    def __iter__(self):
        return iter((self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask))


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
    on_host: HostCopy | None = None,
) -> PackedLayout:
    """The packed layout of :func:`packed_completion_logprobs` (``config``: the model's).

    Worked out on the host from a copy of the inputs there and moved to their device in
    pinned memory without waiting: on CUDA, building it there took a host
    synchronisation per row (each boolean selection) and a kernel per slice, during which
    the GPU sat idle. ``on_host``: that copy (e.g.
    :meth:`gspo.engines.RolloutBatch.on_host`), else it is made here (one wait).
    """
    device = completion_ids.device
    n = completion_ids.shape[0]
    host = torch.device("cpu")
    if on_host is None:
        tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        joined = torch.cat([x.long() for x in tensors], 1).to(host)  # one copy, one wait
        on_host = HostCopy(*joined.split([x.shape[1] for x in tensors], 1))
    if any(x.device.type != "cpu" for x in on_host):
        where = [x.device for x in on_host]
        raise ValueError(f"pack_layout: on_host must be in CPU memory; got {where}")
    prompt_ids, completion_ids = on_host.prompt_ids.long(), on_host.completion_ids.long()
    prompt_mask, completion_mask = on_host.prompt_mask.bool(), on_host.completion_mask.bool()
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
