"""Linear layers on oneDNN's float32 matrix products, for models on the CPU.

PyTorch's CPU builds compute ``F.linear`` in float32 with MKL. On CPUs MKL does not
recognise as Intel's it takes slower generic paths: on this project's AMD EPYC hosts
oneDNN (also inside every x86 build of PyTorch) computes the same products about twice
as fast, both the small ones of a decoding step (``[128 x 256] x [256 x 768]``: 0.147 vs
0.296 ms) and the large ones of training (``[6100 x 256] x [256 x 768]``: 5.2 vs 10.6 ms
forward, 1.7-2.1x with the backward; ``benchmarks/long_levers.py --only linear``). On an
Intel Xeon (AVX-512, AMX) MKL takes its own fast paths and is the faster: the same
command at 5bee4d5 gave 0.181 vs 0.254 ms and 7.9 vs 9.0 ms, so ``model.cpu_linear=auto``
(the default) picks oneDNN on CPUs not Intel's and MKL on Intel's.

:func:`set_linear_kernel` points every plain ``nn.Linear`` of a model at
:func:`onednn_linear` (forward and backward); :func:`linear_for` gives a model's decoding
step and its training forward's vocabulary projection the same kernel. The sums are the
same up to float rounding (another blocking of the same products); anything the kernel
does not take (another dtype or device, tensor subclasses such as FSDP's sharded
``DTensor``, autocast) goes to ``F.linear``. Selected by ``model.cpu_linear`` (``auto`` by
default; ``onednn``; ``torch`` keeps MKL).

The vocabulary projection (the head, :func:`gspo.models.logprobs.head_logits`) has a
precision of its own, recorded beside the kernel (``model.head_precision``): ``float32``
(exact, but on CUDA outside the tensor cores: about 60 TFLOP/s on an H100 by its datasheet, so a
151,936-token vocabulary's head alone would cap a 0.5B model's training near 60k
tokens/s) or ``bf16_weight`` (:func:`bf16_weight_linear`: tensor-core products). What
made the sampler and the trainer disagree in bf16 was rounding the head's *logits* to
bf16 (docs/precision.md). Rounding its *inputs* to bf16 would bring part of that back:
sampler and trainer reach slightly different hidden states, and rounding each to 8 bits
turns a small difference into whole steps of the last bit (the probe's "head inputs
rounded to bf16" rows in docs/precision.md). So ``bf16_weight`` rounds only the weight,
the same matrix on both sides and so the same rounding, and keeps the hidden state to
about 16 bits as the sum of two bf16 terms; every product is exact and the sums are
float32.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from functools import cache
from types import MethodType
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: The attribute recording which kernel a model's linear layers use.
MARK = "_gspo_linear_kernel"
#: The attribute recording the precision of a model's vocabulary projection.
HEAD_MARK = "_gspo_head_precision"

HeadPrecision = Literal["float32", "bf16_weight"]

LinearFn = Callable[..., Tensor]


def onednn_available() -> bool:
    """Whether this torch has oneDNN's linear op (x86 CPU builds do)."""
    return (
        platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@cache
def cpu_vendor() -> str:
    """The CPU's vendor (``GenuineIntel``, ``AuthenticAMD``; "" where unknown)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(
                (ln.split(":", 1)[1].strip() for ln in info if ln.startswith("vendor_id")), ""
            )
    except OSError:
        return ""


def resolved_kernel(kernel: str) -> str:
    """``model.cpu_linear`` with ``auto`` resolved: oneDNN where MKL takes its generic
    paths (a CPU not Intel's: about 2x on this project's AMD EPYC hosts), torch's MKL on
    Intel's, where it was the faster (an Intel Xeon with AVX-512: a rollout batch 2.98 s
    against oneDNN's 3.61 s, ``benchmarks/long_levers.py --only linear`` at 5bee4d5)."""
    if kernel != "auto":
        return kernel
    return "torch" if cpu_vendor() == "GenuineIntel" else "onednn"


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


@cache
def _mm_out_dtype(device: torch.device) -> bool:
    """Whether ``torch.mm(..., out_dtype=torch.float32)`` takes bf16 operands on
    ``device`` (CUDA in torch >= 2.8) and gives the float32 sums, in each operand layout
    :class:`_Bf16WeightLinear` uses (plain, the second transposed, the first transposed);
    where not, :func:`_float32_sums` emulates it with float32 operands (no faster, but
    never wrong). Asked once per device."""
    if device.type != "cuda":
        return False
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(s, device=device, generator=g).bfloat16() for s in ((24, 40), (40, 16)))
    try:
        for x, y in ((a, b), (a, b.t().contiguous().t()), (a.t().contiguous().t(), b)):
            out = torch.mm(x, y, out_dtype=torch.float32)
            exact = torch.mm(x.float(), y.float())
            if out.dtype != torch.float32 or not torch.allclose(out, exact, rtol=1e-4, atol=1e-4):
                return False
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _split(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` as two bf16 terms, ``hi + lo``, about 16 significant bits ([M, K] each)."""
    flat = x.reshape(-1, x.shape[-1])
    hi = flat.bfloat16()
    return hi, (flat.float() - hi.float()).bfloat16()


def _two_terms(hi: Tensor, lo: Tensor, weight_t: Tensor) -> Tensor:
    """``hi @ weight_t + lo @ weight_t`` as one product over the stacked terms, so the
    weight is read once (a decode step's head is bound by reading it)."""
    both = _float32_sums(torch.cat([hi, lo]), weight_t)
    return both[: hi.shape[0]] + both[hi.shape[0] :]


def _float32_sums(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` of bf16 matrices, float32 out: every product exact (8 x 8 significant
    bits fit float32's 24) and the sums in float32. ``torch.mm``'s ``out_dtype`` on CUDA
    (the tensor cores); elsewhere the same arithmetic through float32 operands."""
    if _mm_out_dtype(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class _Bf16WeightLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, weight_bf16: Tensor | None = None) -> Tensor:
        (hi, lo) = _split(x)
        w = weight.bfloat16() if weight_bf16 is None else weight_bf16
        ctx.save_for_backward(hi, w)
        ctx.dtypes, ctx.shape = (x.dtype, weight.dtype), x.shape
        return _two_terms(hi, lo, w.t()).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        hi, w = ctx.saved_tensors
        # gradients at autocast's precision: bf16 operands (the input's first term), float32 sums
        g = grad.reshape(-1, w.shape[0]).bfloat16()
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = _float32_sums(g, w).view(ctx.shape).to(ctx.dtypes[0]) if need_x else None
        grad_w = _float32_sums(g.t(), hi).to(ctx.dtypes[1]) if need_w else None
        return grad_x, grad_w, None


def bf16_weight_linear(x: Tensor, weight: Tensor, weight_bf16: Tensor | None = None) -> Tensor:
    """``x @ weight.T`` (no bias), float32, with ``weight`` rounded to bf16 and ``x`` kept
    to about 16 bits as two bf16 terms: the head's product at
    ``model.head_precision=bf16_weight``: on CUDA one tensor-core product over the two
    terms stacked (twice the rows, the weight read once). Its backward
    rounds the incoming gradient and ``x`` to bf16 (autocast's precision) and returns
    gradients in the inputs' dtypes (a float32 weight gets a float32 gradient).
    ``weight_bf16``: ``weight`` rounded to bf16 already (the caller's one copy for many
    products: the chunks of a batch's head), the gradient still ``weight``'s."""
    return _Bf16WeightLinear.apply(x, weight, weight_bf16)


#: Tokens per chunk of the vocabulary projection off CUDA: 256 x 151,936 float32 logits
#: are 156 MB.
LOGPROB_CHUNK = 256

#: On CUDA a chunk's float32 logits may take up to this many bytes (:func:`head_chunk`):
#: 1,024 tokens of a 151,936-token vocabulary. On an H200 at 9891430 (the ~0.5B Qwen3's
#: head, bf16_weight, 4,096 tokens forward and backward) chunks of 256 tokens took 51.17
#: ms, of 1,024 33.56, of 4,096 31.54 (a chunk's fixed costs, its launches and its
#: checkpoint, weigh less in a bigger one); past 1,024 tokens the gain is small and the
#: memory (a few copies of the chunk's logits in backward) is not.
HEAD_CHUNK_BYTES = 1 << 30


def head_chunk(vocab: int, device: torch.device) -> int:
    """Tokens per chunk of the vocabulary projection: :data:`LOGPROB_CHUNK` off CUDA; on
    CUDA the largest power of two, at least that, whose float32 logits fit in
    :data:`HEAD_CHUNK_BYTES`."""
    tokens = LOGPROB_CHUNK
    if device.type == "cuda":
        while 2 * tokens * vocab * 4 <= HEAD_CHUNK_BYTES:
            tokens *= 2
    return tokens


def set_linear_kernel(
    model: nn.Module, kernel: str = "onednn", head: HeadPrecision = "float32"
) -> str:
    """Point ``model``'s plain ``nn.Linear`` layers at oneDNN when ``kernel`` is
    ``"onednn"`` (or ``"auto"`` on a CPU not Intel's: :func:`resolved_kernel`), the model
    is on the CPU and this torch has oneDNN; returns the kernel in use (``"onednn"`` or
    ``"torch"``), also recorded on the model for :func:`linear_for`. ``head``: the
    vocabulary projection's precision, recorded for :func:`head_linear_for`."""
    kernel = resolved_kernel(kernel)
    on_cpu = all(p.device.type == "cpu" for p in model.parameters())
    used = "onednn" if kernel == "onednn" and on_cpu and onednn_available() else "torch"
    for module in model.modules():
        if type(module) is nn.Linear:
            if used == "onednn":
                module.forward = MethodType(_forward, module)
            elif "forward" in module.__dict__:
                del module.forward
    setattr(model, MARK, used)
    setattr(model, HEAD_MARK, head)
    return used


def linear_kernel(model: nn.Module) -> str:
    """The kernel :func:`set_linear_kernel` chose for ``model`` (``"torch"`` if never asked)."""
    return getattr(model, MARK, "torch")


def linear_for(model: nn.Module) -> LinearFn:
    """The linear function that matches ``model``'s layers: :func:`onednn_linear` or
    ``F.linear``."""
    return onednn_linear if linear_kernel(model) == "onednn" else F.linear


def head_precision(model: nn.Module) -> HeadPrecision:
    """The head precision :func:`set_linear_kernel` recorded (``"float32"`` if never asked)."""
    return getattr(model, HEAD_MARK, "float32")


def head_linear_for(model: nn.Module) -> LinearFn:
    """The product of ``model``'s vocabulary projection, in the sampler and the trainer
    alike: :func:`bf16_weight_linear`, or the model's float32 kernel (:func:`linear_for`)."""
    return bf16_weight_linear if head_precision(model) == "bf16_weight" else linear_for(model)
