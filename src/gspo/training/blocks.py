"""How each transformer block of the trained model runs: ``model.compile`` (the blocks
through ``torch.compile``) and ``model.activation_checkpointing`` (transformers' own)."""

from __future__ import annotations

import torch

from gspo.distributed import Distributed
from gspo.moe import is_moe


def compile_blocks(model, dist: Distributed) -> None:
    """``model.compile``: each transformer block's forward through ``torch.compile``, in
    place (the parameters and their names stay; compiled at the first call, the blocks
    sharing one compiled code, with symbolic shapes from the start: a packed minibatch's
    token count changes every time, and past 8 graphs dynamo would run new variants
    eagerly). A model the fast decoder does not run would
    sample through the compiled blocks with a key/value cache growing every step, and
    under torchrun FSDP2's hooks on each block would be compiled with it: both one-line
    errors, as are a MoE model (its routing gives the experts new shapes every batch) and
    oneDNN's linear layers on the CPU (inductor cannot lower their packed products)."""
    from gspo.engines.decoding import fast_decodable
    from gspo.models.kernels import linear_kernel

    if not hasattr(torch.compiler, "set_stance"):  # (the sampler's prefill runs eagerly)
        raise ValueError(f"model.compile needs torch 2.6 or newer (this is {torch.__version__})")
    if dist.world_size > 1:
        raise ValueError(
            "model.compile: one process only for now (under torchrun each block's FSDP2 "
            "hooks would be compiled with it); set model.compile=false"
        )
    name = type(model).__name__
    if is_moe(model):
        raise ValueError(
            f"model.compile: {name} is a mixture-of-experts model, whose blocks are not "
            "compiled (its routing gives the experts new shapes every batch); set "
            "model.compile=false"
        )
    if not fast_decodable(model):
        raise ValueError(
            f"model.compile: the torch engine's fast decoder does not run {name} "
            "(docs/engines.md), so it would sample through the compiled blocks; set "
            "model.compile=false"
        )
    if linear_kernel(model) == "onednn":
        raise ValueError(
            "model.compile: on the CPU it needs model.cpu_linear=torch (inductor cannot "
            "compile oneDNN's linear layers, the default on CPUs not Intel's)"
        )
    for block in model.get_decoder().layers:
        block.compile(dynamic=True)


def enable_activation_checkpointing(model) -> None:
    """``model.activation_checkpointing``: transformers' own, on every decoder layer.

    Each layer (a ``GradientCheckpointingLayer``) then runs under
    ``torch.utils.checkpoint`` when the module is in training mode and gradients are on:
    the update's forward keeps each layer's input only and backward runs the layer again.
    Forwards under ``no_grad`` (pi_old, the reference, generation) are unchanged. The
    non-reentrant checkpoint needs no input that requires grad, so the hook transformers
    adds for that (``enable_input_require_grads``, for a frozen LoRA base) is removed: the
    backward computes the same gradients, no more. A model without support is a one-line
    ``ValueError``.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"model.activation_checkpointing: {type(model).__name__} does not support "
            "activation checkpointing (transformers' supports_gradient_checkpointing is False)"
        )
    kwargs = {"use_reentrant": False}
    # newer transformers name it activation_checkpointing_enable (the old name warns)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.disable_input_require_grads()
