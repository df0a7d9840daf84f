"""``rollout.compile``: a decoding step's per-layer work through ``torch.compile``.

A step of :class:`gspo.engines.decoding.KVDecoder` is, per layer, two norms, the QKV,
output and MLP products, the rotary embedding and a handful of casts and additions: on a
GPU some 25 small kernels a layer, which even replayed as a CUDA graph each take their
few microseconds. Compiled (TorchInductor), the elementwise work fuses into a few
kernels around the products. :func:`layer_work` gives a decoder its two per-layer
functions (the work before attention and after it), compiled or not; attention, the
head and sampling stay as they are. Compiled once per process and method (the same code
serves every layer and every decoder of the same shapes; a new batch size compiles
once more, then with the batch dimension symbolic), at the first steps that reach it:
seconds that the first rollout batch pays.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

#: a decoder's two per-layer functions, unbound: ``(queries_keys_values, after_attention)``
LayerWork = tuple[Callable[..., Any], Callable[..., Any]]


@cache
def compiled(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` through ``torch.compile`` (inductor), made once per process. Not
    ``fullgraph``: past dynamo's limit of recompilations per function (8: models, dtypes,
    devices and batch-size classes decoded in one process add up) it runs uncompiled
    rather than failing the generation."""
    return torch.compile(function)


def layer_work(cls: type, compile: bool) -> LayerWork:
    """``cls``'s ``queries_keys_values`` and ``after_attention``, unbound (called as
    ``f(decoder, ...)``: a decoder holding them makes no reference cycle, so its KV cache
    is freed as soon as it is dropped), compiled with ``compile``."""
    work = (cls.queries_keys_values, cls.after_attention)
    return (compiled(work[0]), compiled(work[1])) if compile else work
