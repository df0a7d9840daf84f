"""``rollout.compile``: a decoding step's per-layer work through ``torch.compile``.

A step of :class:`gspo.engines.decoding.KVDecoder` is, per layer, two norms, the QKV,
output and MLP products, the rotary embedding and a handful of casts and additions: on a
GPU some 25 small kernels a layer, which even replayed as a CUDA graph each take their
few microseconds. Compiled (TorchInductor), the elementwise work fuses into a few
kernels around the products. :func:`compile_layers` gives a decoder compiled versions
of its two per-layer methods (the work before attention and after it); attention, the
head and sampling stay as they are. Compiled once per process and method (the same code
serves every layer and every decoder of the same shapes; a new batch size compiles
once more, then with the batch dimension symbolic), at the first steps that reach it:
seconds that the first rollout batch pays.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from types import MethodType
from typing import Any

import torch


@cache
def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` through ``torch.compile`` (inductor; the whole body one graph, so a
    break is an error rather than a silent slow path), made once per process."""
    return torch.compile(function, fullgraph=True)


def compile_layers(decoder: Any) -> None:
    """Replace ``decoder``'s ``queries_keys_values`` and ``after_attention`` by their
    compiled versions (bound to it): a dense decoder only, whose MLPs it computes from
    their matrices (an MoE block's routing reads the device on the host), with
    ``F.linear`` products (oneDNN's packed weights on the CPU do not compile)."""
    cls = type(decoder)
    decoder.queries_keys_values = MethodType(compiled(cls.queries_keys_values), decoder)
    decoder.after_attention = MethodType(compiled(cls.after_attention), decoder)
