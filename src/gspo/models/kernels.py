"""Linear layers on oneDNN's float32 matrix products, for models on the CPU.

PyTorch's CPU builds compute ``F.linear`` in float32 with MKL. On CPUs MKL does not
recognise as Intel's it takes slower generic paths: on this project's AMD EPYC hosts
oneDNN (also inside every x86 build of PyTorch) computes the same products about twice
as fast, both the small ones of a decoding step (``[128 x 256] x [256 x 768]``: 0.147 vs
0.296 ms) and the large ones of training (``[6100 x 256] x [256 x 768]``: 5.2 vs 10.6 ms
forward, 1.7-2.1x with the backward; ``benchmarks/long_levers.py --only linear``). Intel
CPUs were not measured: there MKL takes its own fast paths and the gain may be small.

:func:`set_linear_kernel` points every plain ``nn.Linear`` of a model at
:func:`onednn_linear` (forward and backward); :func:`linear_for` gives a model's decoding
step and its training forward's vocabulary projection the same kernel. The sums are the
same up to float rounding (another blocking of the same products); anything the kernel
does not take (another dtype or device, tensor subclasses such as FSDP's sharded
``DTensor``, autocast) goes to ``F.linear``. Selected by ``model.cpu_linear`` (``onednn``
by default; ``torch`` keeps MKL).
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from types import MethodType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The attribute recording which kernel a model's linear layers use.
MARK = "_gspo_linear_kernel"

LinearFn = Callable[..., Tensor]


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear op (x86 CPU builds do)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _takes(*tensors: Tensor | None) -> bool:
    """Whether the oneDNN kernel computes ``x @ weight.T + bias``: plain float32 CPU
    tensors, autocast off (under autocast torch's own ``F.linear`` casts as it should)."""
    plain = (Tensor, nn.Parameter)
    return not torch.is_autocast_enabled("cpu") and all(
        type(t) in plain and t.dtype == torch.float32 and t.device.type == "cpu"
        for t in tensors
        if t is not None
    )


def _mm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x [M, K] @ weight[N, K].T + bias``, by oneDNN; strided operands are fine."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`_mm` over ``x``'s last dimension, whatever its leading ones."""
    return _mm(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


#: Largest weight (elements) whose gradient is computed transposed (see ``backward``).
_TRANSPOSE_MAX = 1 << 22


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        g = grad.reshape(-1, weight.shape[0])
        need_x, need_w, need_b = ctx.needs_input_grad
        # the weight's transpose as a strided view: a contiguous copy of it costs more
        # than it saves (of a vocabulary projection's weight, far more)
        grad_x = _mm(g, weight.t()).view(x.shape) if need_x else None
        # grad_w = g^T x, [N, M] x [M, K]. oneDNN is faster when its product has fewer
        # rows than columns, so for N > K it computes [K, N] and transposes that, unless
        # the copy of the result outweighs the gain (weights above _TRANSPOSE_MAX, e.g. a
        # vocabulary projection); `long_levers.py --only linear` times both shapes.
        grad_w = None
        n, k = weight.shape
        if need_w and k < n <= _TRANSPOSE_MAX // k:
            grad_w = _mm(flat.t(), g.t()).t().contiguous()
        elif need_w:
            grad_w = _mm(g.t(), flat.t())
        grad_b = g.sum(0) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` through oneDNN where it applies (see the module docstring)."""
    if not _takes(x, weight, bias) or x.numel() == 0:
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _OneDNNLinear.apply(x, weight, bias)
    return _linear(x, weight, bias)


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    return onednn_linear(x, self.weight, self.bias)


def set_linear_kernel(model: nn.Module, kernel: str = "onednn") -> str:
    """Point ``model``'s plain ``nn.Linear`` layers at oneDNN when ``kernel`` is
    ``"onednn"``, the model is on the CPU and this torch has oneDNN; returns the kernel in
    use (``"onednn"`` or ``"torch"``), also recorded on the model for :func:`linear_for`."""
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    used = "onednn" if kernel == "onednn" and on_cpu and onednn_available() else "torch"
    for module in model.modules():
        if type(module) is nn.Linear:
            if used == "onednn":
                module.forward = MethodType(_forward, module)
            elif "forward" in module.__dict__:
                del module.forward
    setattr(model, MARK, used)
    return used


def linear_kernel(model: nn.Module) -> str:
    """The kernel :func:`set_linear_kernel` chose for ``model`` (``"torch"`` if never asked)."""
    return getattr(model, MARK, "torch")


def linear_for(model: nn.Module) -> LinearFn:
    """The linear function that matches ``model``'s layers: :func:`onednn_linear` or
    ``F.linear``."""
    return onednn_linear if linear_kernel(model) == "onednn" else F.linear
