"""oneDNN linear layers on the CPU (gspo.models.kernels): same values and gradients as F.linear."""

import copy

import pytest
import torch
import torch.nn.functional as F

from gspo.models import kernels, packed_completion_logprobs
from gspo.models.kernels import (
    bf16_weight_linear,
    head_linear_for,
    head_precision,
    linear_for,
    linear_kernel,
    onednn_available,
    onednn_linear,
    set_linear_kernel,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def close(a, b, rel=1e-5):
    return (a - b).abs().max().item() <= rel * max(b.abs().max().item(), 1.0)


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 33), (1, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_features", [19, 40])  # fewer and more outputs than inputs
@pytest.mark.parametrize("transpose_max", [1 << 22, 0])  # weight gradient transposed or not
def test_onednn_linear_gives_the_values_and_gradients_of_f_linear(
    shape, with_bias, out_features, transpose_max, monkeypatch
):
    monkeypatch.setattr(kernels, "_TRANSPOSE_MAX", transpose_max)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(out_features, 33, generator=g, requires_grad=True)
    b = torch.randn(out_features, generator=g, requires_grad=True) if with_bias else None
    grad = torch.randn(*shape[:-1], out_features, generator=g)
    out = onednn_linear(x, w, b)
    ref = F.linear(x, w, b)
    assert out.shape == ref.shape and close(out, ref)
    mine = torch.autograd.grad(out, [t for t in (x, w, b) if t is not None], grad)
    theirs = torch.autograd.grad(ref, [t for t in (x, w, b) if t is not None], grad)
    for m, t in zip(mine, theirs, strict=True):
        assert m.shape == t.shape and close(m, t)


@needs_onednn
def test_a_frozen_weight_gets_no_gradient_and_the_input_still_does():
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8)  # frozen (a LoRA run's base)
    onednn_linear(x, w).pow(2).sum().backward()
    assert w.grad is None
    expected = torch.autograd.grad(F.linear(x, w).pow(2).sum(), x)[0]
    assert close(x.grad, expected)


def test_what_the_kernel_does_not_take_goes_to_f_linear_exactly():
    x64, w64 = torch.randn(5, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(onednn_linear(x64, w64), F.linear(x64, w64))
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = onednn_linear(x, w)
        assert out.dtype == torch.bfloat16 and torch.equal(out, F.linear(x, w))
    wide_bias = torch.randn(3, dtype=torch.float64)
    assert torch.equal(onednn_linear(x64, w64, wide_bias), F.linear(x64, w64, wide_bias))
    with pytest.raises(RuntimeError):  # what F.linear says of a float64 bias on float32
        onednn_linear(x, w, wide_bias)
    empty = torch.randn(0, 8)
    assert onednn_linear(empty, w).shape == (0, 3)


@needs_onednn
def test_a_model_switched_to_onednn_trains_like_the_same_model_on_f_linear(tiny_model):
    model = copy.deepcopy(tiny_model)
    assert linear_kernel(model) == "torch" and linear_for(model) is F.linear
    assert set_linear_kernel(model) == "onednn"
    assert linear_kernel(model) == "onednn" and linear_for(model) is onednn_linear
    patched = [m for m in model.modules() if "forward" in m.__dict__]
    assert patched and all(type(m) is torch.nn.Linear for m in patched)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 16, (6, 5), generator=g)
    completion = torch.randint(3, 16, (6, 9), generator=g)
    ones = torch.ones_like
    grads = []
    for m in (tiny_model, model):
        m.train()
        lp = packed_completion_logprobs(m, prompt, ones(prompt), completion, ones(completion))
        lp.sum().backward()
        grads.append([p.grad for p in m.parameters()])
        if m is tiny_model:
            ref = lp
    assert close(lp, ref)
    assert all(close(a, b) for a, b in zip(grads[1], grads[0], strict=True))
    # a copy (FSDP's replica is one) runs on its own weights, not the original's
    replica = copy.deepcopy(model)
    with torch.no_grad():
        for p in replica.parameters():
            p.zero_()
    x = torch.randn(2, model.config.hidden_size)
    layer = replica.model.layers[0].mlp.down_proj
    assert torch.equal(layer(torch.randn(2, layer.in_features)), torch.zeros(2, layer.out_features))
    q = model.model.layers[0].self_attn.q_proj
    assert not torch.equal(q(x), torch.zeros(2, q.out_features))
    # and "torch" puts the layers back on F.linear
    assert set_linear_kernel(model, "torch") == "torch"
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert linear_for(model) is F.linear


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_a_run_puts_its_policy_and_kl_reference_on_model_cpu_linear(tmp_path, kernel):
    from test_trainer import FAST

    from gspo.config import load_config
    from gspo.trainer import Trainer

    overrides = [*FAST, "train.cold_start_steps=0", "train.max_steps=2",
                 "algorithm.minibatches=2", "algorithm.kl_coef=0.1", "eval.every=0",
                 f"model.cpu_linear={kernel}"]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    trainer.fit()
    module = trainer.policy.module
    assert linear_kernel(module) == kernel
    patched = {m for m in module.modules() if "forward" in m.__dict__}
    linears = {m for m in module.modules() if type(m) is torch.nn.Linear}
    assert patched == (linears if kernel == "onednn" else set())
    assert trainer.reference.module is not None  # loaded by the KL term
    assert linear_kernel(trainer.reference.module) == kernel
    # the head's precision goes with the kernel: float32 on the CPU whatever autocast
    assert head_precision(module) == head_precision(trainer.reference.module) == "float32"


def test_auto_takes_mkl_on_intel_cpus_and_onednn_on_others(tiny_model, monkeypatch):
    """oneDNN was the CPU's default: on an Intel Xeon (AVX-512) MKL's products were the
    faster (a rollout batch 2.98 s against 3.61 s, benchmarks/long_levers.py --only linear),
    on AMD EPYC hosts oneDNN's about twice MKL's."""
    from gspo.models import kernels

    for vendor, expected in (("GenuineIntel", "torch"), ("AuthenticAMD", "onednn"), ("", "onednn")):
        monkeypatch.setattr(kernels, "cpu_vendor", lambda vendor=vendor: vendor)
        assert kernels.resolved_kernel("auto") == expected
        assert kernels.resolved_kernel("onednn") == "onednn"  # (named: as named)
        assert kernels.resolved_kernel("torch") == "torch"
        if kernels.onednn_available():
            assert set_linear_kernel(tiny_model, "auto") == expected
    monkeypatch.undo()
    assert kernels.cpu_vendor() in ("GenuineIntel", "AuthenticAMD", "")  # (read, not patched)


def bf16(t):
    return t.detach().bfloat16().float()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_the_bf16_weight_head_rounds_the_weight_only_and_never_its_sums(weight_dtype):
    """``bf16_weight_linear``: the weight rounded to bf16, the input kept to ~16 bits (two
    bf16 terms), float32 sums and result (on the CPU through float32 operands, on CUDA
    torch.mm's out_dtype); its backward rounds the incoming gradient and the input to bf16
    and gives each input a gradient of its own dtype."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 4).requires_grad_()
    w = torch.randn(300, 64, generator=g).to(weight_dtype).requires_grad_()
    grad = torch.randn(3, 5, 300, generator=g)
    out = bf16_weight_linear(x, w)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 300)
    exact_x = F.linear(x.detach(), bf16(w))  # only the weight rounded
    scale = exact_x.abs().max()  # 144 here

    def off(a, b):
        return (a - b).abs().max() / scale

    assert off(out, exact_x) < 1e-5  # x to ~16 bits (measured 2.8e-6)
    # rounding x to bf16 too (1.3e-3 measured), or the sums as autocast does (2.3e-3): far more
    assert off(F.linear(bf16(x), bf16(w)), exact_x) > 1e-4
    assert off(out, F.linear(x.bfloat16(), w.bfloat16()).float()) > 1e-4
    if weight_dtype == torch.float32:  # the weight is rounded (1.7e-3 measured)
        assert off(out, F.linear(x.detach(), w.detach())) > 1e-4
    out.backward(grad)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == weight_dtype
    torch.testing.assert_close(x.grad, (bf16(grad) @ bf16(w)), rtol=1e-6, atol=1e-5)
    flat_g, flat_x = bf16(grad).reshape(-1, 300), bf16(x).reshape(-1, 64)
    torch.testing.assert_close(w.grad.float(), (flat_g.t() @ flat_x).to(weight_dtype).float())
    with torch.no_grad():  # no graph: the same values
        assert torch.equal(bf16_weight_linear(x, w), out.detach())


def test_the_bf16_weight_heads_gradient_is_summed_over_its_chunks_in_float32():
    """The training head in chunks at ``bf16_weight`` (one bf16 copy of the weight for
    every chunk): the float32 weight's gradient is as close to a float64 one over 32
    chunks as over one. Summed in bf16 across the chunks (the chunks fed a bf16 copy),
    its error grew with them: 2.84e-3 in one chunk, 6.03e-3 in 32 (2.32e-3 in both now)."""
    from gspo.models.logprobs import logprobs_from_hidden

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 512, 64, generator=g)
    weight = (torch.randn(3000, 64, generator=g) * 0.1).requires_grad_()
    ids = torch.randint(0, 3000, (4, 512), generator=g)
    upstream = torch.randn(4, 512, generator=g)
    exact = weight.detach().double().requires_grad_()
    lp = torch.log_softmax(hidden.double() @ exact.T, -1).gather(-1, ids[..., None])[..., 0]
    (lp * upstream.double()).sum().backward()
    errors = []
    for chunk in (2048, 64):
        weight.grad = None
        lp = logprobs_from_hidden(hidden, weight, ids, 1.0, chunk, linear=bf16_weight_linear)
        (lp * upstream).sum().backward()
        assert weight.grad.dtype == torch.float32
        errors.append(((weight.grad.double() - exact.grad).norm() / exact.grad.norm()).item())
    assert errors[0] < 3e-3 and errors[1] < 1.1 * errors[0], errors


def test_head_precision_auto_is_bf16_weight_on_cuda_below_float32_only():
    from gspo.config import load_config
    from gspo.training.setup import head_precision as resolve

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = load_config(None, [])
    assert resolve(auto, cuda, torch.bfloat16) == resolve(auto, cuda, torch.float16)
    assert resolve(auto, cuda, torch.bfloat16) == "bf16_weight"
    assert resolve(auto, cuda, torch.float32) == "float32"
    assert resolve(auto, cpu, torch.bfloat16) == "float32"
    forced = load_config(None, ["model.head_precision=bf16_weight"])
    assert resolve(forced, cpu, torch.float32) == "bf16_weight"
    assert resolve(load_config(None, ["model.head_precision=float32"]), cuda, torch.bfloat16) == (
        "float32"
    )


def test_the_head_kernel_follows_the_models_mark(tiny_model):
    assert head_precision(tiny_model) == "float32" and head_linear_for(tiny_model) is F.linear
    set_linear_kernel(tiny_model, "torch", "bf16_weight")
    assert head_precision(tiny_model) == "bf16_weight"
    assert head_linear_for(tiny_model) is bf16_weight_linear
    assert linear_for(tiny_model) is F.linear  # the other layers keep their kernel
