"""What the fast decoder reads from a model's linear layers, plain or PEFT LoRA.

In float32 a LoRA layer's adapters are merged into its matrix (:func:`merged_weight`, PEFT's
own delta); below float32 they stay beside the base matrix (:func:`base_weight`,
:func:`low_rank`), since an update of about 1% of the weight would mostly round away in a
bf16 matrix, and are added in PEFT's order of operations, so the rounding is the
trainer's. :func:`mergeable` and :func:`adapted_mlp` say which layers qualify.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: Dense MLP classes computing ``down(act(gate(x)) * up(x))`` (transformers 5.24), which
#: the fast step computes itself when LoRA adapters sit on their projections.
MLPS = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen2MoeMLP", "Qwen3MoeMLP"})
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_lora(module: nn.Module | None) -> bool:
    """Whether ``module`` is a PEFT LoRA layer (a base layer plus adapters)."""
    return module is not None and hasattr(module, "base_layer") and hasattr(module, "lora_A")


def mergeable(p: nn.Module) -> bool:
    """A plain ``nn.Linear``, or a PEFT LoRA layer over one whose active adapters add
    ``scale * B @ A`` (no DoRA or other variant, no adapter bias, not merged in place),
    the adapters in float32 and the base in float32 or, frozen in the compute dtype as a
    LoRA run holds it on CUDA, in 16 bits (then only the 16-bit decoder, which keeps the
    adapters beside the matrix, runs it: such a base took PEFT's forward)."""
    if type(p) is nn.Linear:
        return True
    if not is_lora(p) or type(p.base_layer) is not nn.Linear or p.merged:
        return False
    active = [a for a in p.active_adapters if a in p.lora_A]
    for a in active:
        if a in getattr(p, "lora_variant", {}) or p.use_dora.get(a, False):
            return False
        if getattr(p, "lora_bias", {}).get(a, False):
            return False
        if p.lora_A[a].weight.dtype != torch.float32 or p.lora_B[a].weight.dtype != torch.float32:
            return False
    return p.base_layer.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)


def merged_weight(p: nn.Module) -> Tensor:
    """The matrix ``p`` multiplies by: its weight, or a LoRA layer's base weight plus each
    active adapter's ``scale * B @ A`` (PEFT's own ``get_delta_weight``, as its merge)."""
    if type(p) is nn.Linear:
        return p.weight
    weight = p.base_layer.weight
    if p.disable_adapters:
        return weight
    for a in p.active_adapters:
        if a in p.lora_A:
            weight = weight + p.get_delta_weight(a)
    return weight


def base_weight(p: nn.Module) -> Tensor:
    """The matrix of ``p`` without its adapters (they are applied beside it)."""
    return p.base_layer.weight if is_lora(p) else p.weight


def low_rank(projections: list[nn.Module] | tuple[nn.Module, ...], dtype: torch.dtype):
    """The active adapters of ``projections`` (whose outputs are stacked, in this order)
    as ``(A, B, scale)``, ``(x @ A.T @ B.T) * scale`` being the stacked update: ``A`` the
    adapters' down projections one after another, ``B`` their up projections,
    block-diagonal, ``scale`` each output's adapter scale (float32). That is PEFT's order
    of operations, so in bf16 the rounding is the trainer's: the product in bf16, then
    the scale, rounded once more. A projection with several active adapters (PEFT adds
    each one's update in turn) has its scales folded into ``B`` instead (``scale`` None).
    None when no adapter is active on any of them."""
    downs, ups, scales = [], [], []
    for p in projections:
        pairs = []
        if is_lora(p) and not p.disable_adapters:
            pairs = [
                (p.lora_A[a].weight, p.lora_B[a].weight, float(p.scaling[a]))
                for a in p.active_adapters
                if a in p.lora_A
            ]
        out_features = base_weight(p).shape[0]
        if len(pairs) > 1:  # several adapters on one projection: scales folded in
            pairs = [(a, b * s, 1.0) for a, b, s in pairs]
            scales.append(None)
        else:
            scales.append(pairs[0][2] if pairs else 1.0)
        ups.append(
            torch.cat([b for _, b, _ in pairs], dim=1)
            if pairs
            else base_weight(p).new_zeros((out_features, 0))
        )
        downs.extend(a for a, _, _ in pairs)
    if not downs:
        return None
    down, up = torch.cat(downs).to(dtype), torch.block_diag(*ups).to(dtype)
    if None in scales:
        return down, up, None
    columns = [torch.full((u.shape[0],), s) for u, s in zip(ups, scales, strict=True)]
    scale = torch.cat(columns).to(device=up.device, dtype=torch.float32)
    return down, up, scale


def bias_of(p: nn.Module) -> Tensor | None:
    return (p.base_layer if is_lora(p) else p).bias


def lora_mlp(mlp: nn.Module) -> bool:
    """Whether LoRA adapters sit on any of a gated MLP's projections."""
    return any(is_lora(getattr(mlp, n, None)) for n in MLP_PROJECTIONS)


def adapted_mlp(mlp: nn.Module) -> bool:
    """A dense gated MLP (one of ``MLPS``: ``down(act(gate(x)) * up(x))``) with LoRA
    adapters on its projections, each mergeable and without bias: the fast step
    computes it itself."""
    if type(mlp).__name__ not in MLPS or not lora_mlp(mlp):
        return False
    projections = [getattr(mlp, n) for n in MLP_PROJECTIONS]
    return all(mergeable(p) and bias_of(p) is None for p in projections)


def add_update(out: Tensor, x: Tensor, low_rank: tuple[Tensor, Tensor, Tensor | None], linear):
    """``out`` plus the unmerged adapters' update of ``x``, ``(x @ A.T) @ B.T`` times their
    scales (:func:`low_rank`), in PEFT's order: the product in the compute dtype, then the
    scale, rounded back to that dtype, then added. ``linear``: the decoder's product."""
    down, up, scale = low_rank
    update = linear(linear(x, down), up)
    if scale is not None:
        update = (update * scale).to(update.dtype)
    return out + update
