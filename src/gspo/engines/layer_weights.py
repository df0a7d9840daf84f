"""A decoder layer's weights as the fast decoder's step reads them (:class:`LayerWeights`):
read from the model once (:func:`read_layer`), or read again after the weights moved into
the tensors read before, in place (``into=``), so their addresses, what a captured CUDA
graph reads, stay and no second copy is made (:meth:`gspo.engines.decoding.KVDecoder.
reload`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from gspo.engines import lora_weights


def plain_mlp(mlp: nn.Module) -> bool:
    """A dense gated MLP (one of ``MLPS``) whose projections have no bias (Llama's
    ``mlp_bias``): one the static step computes from its three matrices alone. Any other
    MLP runs as its own module there, so it is not captured."""
    return type(mlp).__name__ in lora_weights.MLPS and all(
        lora_weights.bias_of(getattr(mlp, n)) is None for n in lora_weights.MLP_PROJECTIONS
    )


def dense_layers(layers: list[LayerWeights]) -> bool:
    """Whether every layer's MLP is dense, computed from its matrices (merged LoRA ones, or
    a :func:`plain_mlp`'s): no MoE block, whose routing reads the device on the host."""
    return all(layer.mlp_weights is not None or plain_mlp(layer.mlp) for layer in layers)


@dataclass
class LayerWeights:
    """One decoder layer's weights as the fast step uses them: matrices in the compute
    dtype, norm weights in the parameters' (as the residual stream, as transformers has it)."""

    input_norm: Tensor
    qkv: Tensor  # [(H + 2 Hkv) * D, hidden]: q, k and v projections stacked
    qkv_bias: Tensor | None
    qk_norm: Tensor | None  # [H + Hkv, D]: q_norm's weight for query heads, k_norm's for keys
    o: Tensor
    post_norm: Tensor
    mlp: nn.Module
    #: gate, up and down matrices of a dense MLP whose projections carry LoRA adapters
    #: (merged for the call); None: the MLP is called as its module
    mlp_weights: tuple[Tensor, Tensor, Tensor] | None = None
    #: unmerged adapters (a 16-bit compute dtype): ``(A, B)`` with ``x @ A.T @ B.T`` the
    #: update of the matrix beside it, per adapted matrix (None: none on it)
    qkv_lora: tuple[Tensor, Tensor, Tensor | None] | None = None
    o_lora: tuple[Tensor, Tensor, Tensor | None] | None = None
    mlp_lora: tuple[tuple[Tensor, Tensor, Tensor | None] | None, ...] | None = None


class Mismatch(Exception):
    """A weight that no longer fits the tensor it is to be written into."""


def read_layer(
    layer: nn.Module,
    *,
    dtype: torch.dtype,
    low_rank: bool,
    heads: int,
    kv_heads: int,
    into: LayerWeights | None = None,
) -> LayerWeights:
    """``layer``'s weights in the compute ``dtype`` (``low_rank``: adapters beside the base
    matrices, else merged into them); with ``into`` (this layer's weights read before)
    written into its tensors in place (:func:`place`), :class:`Mismatch` where they no
    longer fit."""
    a, fresh = layer.self_attn, into is None
    weight = lora_weights.base_weight if low_rank else lora_weights.merged_weight

    def had(name: str):  # the tensor(s) to write into; None: build anew
        return None if fresh else getattr(into, name)

    def one(name: str, parts: list[Tensor] | None, cast: torch.dtype | None = dtype):
        if not fresh and (parts is None) != (had(name) is None):
            raise Mismatch
        return None if parts is None else place(had(name), parts, cast)

    def each(name: str, tensors, cast: torch.dtype | None = None):
        return place_all(had(name), tensors, cast, fresh)

    projections = (a.q_proj, a.k_proj, a.v_proj)
    bias = None
    if lora_weights.bias_of(a.q_proj) is not None:
        bias = [lora_weights.bias_of(p) for p in projections]
    qk_norm = None
    if hasattr(a, "q_norm"):
        qk_norm = [a.q_norm.weight.expand(heads, -1), a.k_norm.weight.expand(kv_heads, -1)]
    mlp_weights, mlp_lora = None, None
    if lora_weights.adapted_mlp(layer.mlp):
        mlp_projections = [getattr(layer.mlp, n) for n in lora_weights.MLP_PROJECTIONS]
        mlp_weights = [weight(p) for p in mlp_projections]
        if low_rank:
            olds = had("mlp_lora") or (None,) * 3
            mlp_lora = tuple(
                place_all(old, lora_weights.low_rank([p], dtype), None, fresh)
                for old, p in zip(olds, mlp_projections, strict=True)
            )
    if not fresh and (mlp_lora is None) != (into.mlp_lora is None):
        raise Mismatch
    adapters = partial(lora_weights.low_rank, dtype=dtype)
    return LayerWeights(
        input_norm=one("input_norm", [layer.input_layernorm.weight], None),
        qkv=one("qkv", [weight(p) for p in projections]),
        qkv_bias=one("qkv_bias", bias),
        qk_norm=one("qk_norm", qk_norm, None),
        o=one("o", [weight(a.o_proj)]),
        post_norm=one("post_norm", [layer.post_attention_layernorm.weight], None),
        mlp=layer.mlp,
        mlp_weights=each("mlp_weights", mlp_weights, dtype),
        qkv_lora=each("qkv_lora", adapters(projections) if low_rank else None),
        o_lora=each("o_lora", adapters([a.o_proj]) if low_rank else None),
        mlp_lora=mlp_lora,
    )


def place(into: Tensor | None, parts: list[Tensor], dtype: torch.dtype | None) -> Tensor:
    """``parts`` stacked along the first dimension, in ``dtype`` (None: theirs): a new
    tensor (the one part itself when already in that dtype), or, given ``into``, written
    into it in place (cast part by part by ``copy_``, no stacked or cast copy made).
    :class:`Mismatch` where ``into`` has another shape or dtype, or is a parameter that
    the part no longer is (a module's weight is never overwritten)."""
    dtype = dtype or parts[0].dtype
    if into is None:
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(dtype)
    if len(parts) == 1 and parts[0] is into:
        return into
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if isinstance(into, nn.Parameter) or into.shape != shape or into.dtype != dtype:
        raise Mismatch
    row = 0
    for part in parts:
        into[row : row + part.shape[0]].copy_(part)
        row += part.shape[0]
    return into


def place_all(
    into: tuple | None, tensors: tuple | list | None, dtype: torch.dtype | None, fresh: bool
) -> tuple | None:
    """:func:`place` for a tuple of weights (each of one part; a None kept as None); None
    where there are none. ``fresh``: a new layer's (``into`` unused); otherwise
    :class:`Mismatch` where only one of ``into`` and ``tensors`` has them."""
    if not fresh and (into is None) != (tensors is None):
        raise Mismatch
    if tensors is None:
        return None
    olds = into if not fresh else (None,) * len(tensors)
    if len(olds) != len(tensors):
        raise Mismatch
    out = []
    for old, t in zip(olds, tensors, strict=True):
        if (old is None) != (t is None) and not fresh:
            raise Mismatch
        out.append(None if t is None else place(old, [t], dtype))
    return tuple(out)
