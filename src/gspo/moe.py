"""Mixture-of-Experts routing: capture it, replay it, and measure how much it changes.

GSPO paper, section 5.3 (spec claim 3): after one gradient step about 10% of the experts
a MoE model activates for the same rollout change, so GRPO's token ratios compare
log-probs computed through different experts. *Routing Replay* caches the experts chosen
under ``pi_old`` and forces them when computing ``pi_theta`` for the ratio.

Everything works on the router modules of transformers' MoE blocks (:data:`ROUTERS`),
whose forward is ``logits = h @ W.T; p = softmax(logits); top-k of p`` (optionally
renormalised) and returns ``(router_logits, routing_weights, selected_experts)``; the
MoE block then runs ``experts(h, selected_experts, routing_weights)``. DeepSeek's,
GPT-OSS's, Granite's and Jamba's routers (:data:`SCORED_ROUTERS`) return the same triple
from other scores and are captured and replayed alike; the load-balancing loss here is
not DeepSeek's.

Shapes. A forward over an ``[B, L]`` input calls each router once with the flattened
``B * L`` tokens, so a recorded routing is an integer tensor ``[layers, B * L, k]``:
for every MoE layer (in module order) and every input token (row-major over ``[B, L]``,
padding included) the ``k`` experts chosen. ``layers`` counts MoE layers only. Nothing
here assumes how a caller lays sequences out in ``[B, L]`` (padded or packed): replay
needs the same layout as the capture, and :func:`response_token_mask` finds the response
tokens in whatever layout a forward uses.

- :func:`capture_routing` records the experts chosen (forward hooks, no change to the
  computation).
- :func:`replay_routing` makes every router use recorded experts: logits and softmax
  are computed as usual from the current weights and only the top-k *choice* is
  replaced, so the gate values (and their gradient into the router weights) are those
  of the current router at the replayed experts.
- :func:`expert_change_fraction` compares two recordings over the tokens of a mask.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

#: Router classes handled here, by class name, with whether their forward casts the
#: routing weights back to the logits' dtype (Mixtral's and MiniMax's keep float32).
#: All compute ``softmax(float32) -> top-k -> renormalise`` (unless ``norm_topk_prob``
#: is False on the router): checked against transformers 5.23's sources.
ROUTERS: dict[str, bool] = {
    "Qwen3MoeTopKRouter": True,
    "Qwen2MoeTopKRouter": True,
    "Qwen3NextTopKRouter": True,
    "Qwen3VLMoeTextTopKRouter": True,
    "Qwen3_5MoeTopKRouter": True,
    "Qwen3OmniMoeThinkerTextTopKRouter": True,
    "OlmoeTopKRouter": True,
    "FlexOlmoTopKRouter": True,
    "MixtralTopKRouter": False,
    "MiniMaxTopKRouter": False,
    # (copies of the above, forward line for line, in transformers 5.24)
    "MellumTopKRouter": True,
    "Qwen4ExpTextTopKRouter": True,
    "Qwen3OmniMoeTalkerTextTopKRouter": True,
    "Qwen3OmniMoeTextTopKRouter": True,
}

#: Routers that weight their experts otherwise (the same triple out), by class name, with
#: how (each checked against transformers 5.24's sources; copies have the same forward).
#: ``sigmoid`` (DeepSeek-V3, GLM-4.5, dots.llm1): experts chosen on ``sigmoid(logits) +
#: e_score_correction_bias`` within the ``topk_group`` best of ``n_group`` groups, weighted
#: by their plain sigmoid scores (renormalised when ``norm_topk_prob``); ``deepseek_v2``
#: (greedy or group-limited): weighted by their softmax probabilities; both times
#: ``routed_scaling_factor``, in float32. The bias and the groups shape the choice only,
#: so a replay, which takes the choice as recorded, needs neither. ``topk_softmax``
#: (GPT-OSS, its router's bias included) and ``topk_softmax_float`` (Granite-MoE): top-k
#: of the logits, weighted by a softmax over the k chosen logits (Granite's in float32);
#: ``softmax_unnormalised`` (Jamba): the softmax probabilities, not renormalised.
SCORED_ROUTERS: dict[str, str] = {
    "DeepseekV3TopkRouter": "sigmoid",
    "DeepseekV32TopkRouter": "sigmoid",
    "Glm4MoeTopkRouter": "sigmoid",
    "Glm4MoeLiteTopkRouter": "sigmoid",
    "Dots1TopkRouter": "sigmoid",
    "DeepseekV2TopkRouter": "deepseek_v2",
    "GptOssTopKRouter": "topk_softmax",
    "GraniteMoeTopKRouter": "topk_softmax_float",
    "GraniteMoeSharedTopKRouter": "topk_softmax_float",
    "GraniteMoeHybridTopKRouter": "topk_softmax_float",
    "JambaTopKRouter": "softmax_unnormalised",
    # (copies of the above, forward line for line, in transformers 5.24)
    **dict.fromkeys(
        (
            "AXK1TopkRouter",
            "BailingHybridTopkRouter",
            "Dots3NoteTextTopkRouter",
            "ExaoneMoeTopkRouter",
            "Glm4vMoeTextTopkRouter",
            "Glm5NextTextTopkRouter",
            "GlmMoeDsaTopkRouter",
            "HYV4TopkRouter",
            "HYV4VLTopkRouter",
            "KimiLinearTopkRouter",
            "MiMoV2FlashTopkRouter",
            "NemotronHTopkRouter",
            "SolarOpenTopkRouter",
        ),
        "sigmoid",
    ),
    "DeepseekOcr2TextTopkRouter": "deepseek_v2",
    "UnlimitedOcrTextTopkRouter": "deepseek_v2",
    "GraniteMoeSWATopKRouter": "topk_softmax_float",
}

#: The scorings :func:`load_balancing_loss` (a softmax router's) does not describe.
NO_SOFTMAX_BALANCE = ("sigmoid", "deepseek_v2")


def _handled(module: nn.Module) -> bool:
    return type(module).__name__ in ROUTERS or type(module).__name__ in SCORED_ROUTERS


#: Below this, the replayed experts' summed probability is treated as underflowed.
_NEGLIGIBLE = 1e-20


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE router modules of ``model``, in module (= layer) order.

    Raises ``ValueError`` for a model without any (a dense model, or a MoE family whose
    router is not in :data:`ROUTERS`).
    """
    routers = [m for m in model.modules() if _handled(m)]
    if not routers:
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        if (router := unhandled_router(model)) is not None:
            raise ValueError(
                f"{kind} is a mixture-of-experts model whose router ({router}) gspo does not "
                f"handle (it handles {', '.join([*ROUTERS, *SCORED_ROUTERS])})"
            )
        raise ValueError(
            f"model has no MoE routers ({kind}: no module of a supported router class: "
            f"{', '.join([*ROUTERS, *SCORED_ROUTERS])})"
        )
    return routers


def unhandled_router(model: nn.Module) -> str | None:
    """The router class of a mixture-of-experts model whose routers are not in
    :data:`ROUTERS` (a module whose class is named like one, or one named ``gate`` or
    ``router``), or None (a dense model, one whose MoE config leaves every layer dense,
    or one handled here). Such a model trains, without expert churn, Routing Replay or
    the router loss: before, nothing said so (DeepSeek-V3, GPT-OSS, Granite)."""
    if is_moe(model):
        return None
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    places = [config, getattr(config, "ffn_config", None)]  # (DBRX's are nested)
    keys = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    counts = [getattr(c, k, None) for c in places for k in keys]
    if not any(isinstance(n, int) and n > 1 for n in counts):
        return None
    for name, module in model.named_modules():
        kind, attribute = type(module).__name__, name.rpartition(".")[2]
        if re.search(r"(Router|Gate|Gating)$", kind) or attribute in ("gate", "router"):
            return kind
    return None


def is_moe(model: nn.Module) -> bool:
    """Whether ``model`` has routers :func:`find_routers` supports."""
    return any(_handled(m) for m in model.modules())


def _index_dtype(router: nn.Module) -> torch.dtype:
    return torch.int16 if router.num_experts <= torch.iinfo(torch.int16).max else torch.int32


@dataclass
class RoutingRecorder:
    """What :func:`capture_routing` saw: per MoE layer, the experts of each router call."""

    calls: list[list[Tensor]] = field(default_factory=list)  # [layer][call] -> [tokens, k]

    @property
    def experts(self) -> Tensor:
        """``[layers, tokens, k]`` integer tensor of one forward pass."""
        counts = {len(c) for c in self.calls}
        if counts != {1}:
            raise ValueError(
                f"captured {sorted(counts)} router calls per layer; .experts needs exactly "
                "one forward pass inside capture_routing (use .calls for several)"
            )
        return torch.stack([c[0] for c in self.calls])


@contextlib.contextmanager
def _router_outputs(
    model: nn.Module, take: Callable[[nn.Module, Any], Tensor]
) -> Iterator[list[list[Tensor]]]:
    """``calls[layer]``: ``take(router, output)`` of each call of every router inside the block."""
    routers = find_routers(model)
    calls: list[list[Tensor]] = [[] for _ in routers]
    handles = []
    for layer, router in enumerate(routers):

        def hook(module, args, output, layer=layer):
            calls[layer].append(take(module, output))

        handles.append(router.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_routing(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the top-k experts every router of ``model`` chooses inside the block.

    ``recorder.experts`` is ``[layers, tokens, k]`` after one forward pass. Under
    :func:`replay_routing` it records the replayed experts (what the experts ran).
    """
    with _router_outputs(
        model, lambda router, output: output[2].detach().to(_index_dtype(router))
    ) as calls:
        yield RoutingRecorder(calls=calls)


def _replayed_forward(router: nn.Module, experts: Tensor, cast: bool):
    """A forward for ``router`` that routes each token to ``experts`` ``[tokens, k]``."""
    indices = experts.long()

    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, router.hidden_dim)
        _check_tokens(hidden_states, indices)
        router_logits = nn.functional.linear(hidden_states, router.weight)
        router_probs = torch.softmax(router_logits.float(), dim=-1)
        weights = router_probs.gather(-1, indices)  # the gate values of the replayed experts
        if getattr(router, "norm_topk_prob", True):
            # The router's own arithmetic (bit-identical when nothing changed), except where
            # the current router gives the replayed experts ~0 probability and p / sum(p)
            # would be 0 / 0: there the same quantity as a softmax over their logits.
            total = weights.sum(dim=-1, keepdim=True)
            usable = total > _NEGLIGIBLE
            direct = weights / torch.where(usable, total, torch.ones_like(total))
            stable = torch.softmax(router_logits.float().gather(-1, indices), dim=-1)
            weights = torch.where(usable, direct, stable)
        if cast:
            weights = weights.to(router_logits.dtype)
        return router_logits, weights, indices

    return forward


def _scored_forward(router: nn.Module, experts: Tensor, scoring: str):
    """:func:`_replayed_forward` for a router of :data:`SCORED_ROUTERS`: its own
    arithmetic at the recorded experts (bit-identical when nothing changed)."""
    indices = experts.long()

    def forward(hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, router.weight.shape[1])
        _check_tokens(hidden_states, indices)
        if scoring.startswith(("topk_softmax", "softmax")):
            bias = getattr(router, "bias", None)
            router_logits = nn.functional.linear(hidden_states, router.weight, bias)
            if scoring == "softmax_unnormalised":
                probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
                return router_logits, probs.gather(1, indices).to(hidden_states.dtype), indices
            if scoring == "topk_softmax_float":
                router_logits = router_logits.float()
            chosen = router_logits.gather(1, indices)
            weights = torch.softmax(chosen, dim=-1, dtype=chosen.dtype)
            return router_logits, weights.to(hidden_states.dtype), indices
        router_logits = nn.functional.linear(hidden_states.float(), router.weight.float())
        if scoring == "sigmoid":
            weights = router_logits.sigmoid().gather(1, indices)
            if router.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            weights = router_logits.softmax(dim=-1, dtype=torch.float32).gather(1, indices)
        return router_logits, weights * router.routed_scaling_factor, indices

    return forward


def _check_tokens(hidden_states: Tensor, indices: Tensor) -> None:
    if hidden_states.shape[0] != indices.shape[0]:
        raise ValueError(
            f"replay_routing: the router got {hidden_states.shape[0]} tokens but the "
            f"recorded routing has {indices.shape[0]}; replay needs the same [B, L] "
            "input layout as the capture"
        )


def _replay_forward(router: nn.Module, experts: Tensor):
    name = type(router).__name__
    if name in SCORED_ROUTERS:
        return _scored_forward(router, experts, SCORED_ROUTERS[name])
    return _replayed_forward(router, experts, ROUTERS[name])


@contextlib.contextmanager
def replay_routing(model: nn.Module, experts: Tensor) -> Iterator[None]:
    """Inside the block, every router of ``model`` uses the recorded ``experts``.

    ``experts`` is a ``[layers, tokens, k]`` recording (:func:`capture_routing`) of a
    forward over the same ``[B, L]`` input layout; every forward inside the block must
    have that layout (a different token count is a ``ValueError``). The routing weights
    are the current router's scores (softmax, or :data:`SCORED_ROUTERS`' own) at the
    recorded experts, renormalised and scaled as the router's own forward does, so
    gradients reach the router weights.
    """
    routers = find_routers(model)
    if experts.dim() != 3 or experts.shape[0] != len(routers):
        raise ValueError(
            f"replay_routing: recorded routing has shape {tuple(experts.shape)}; the model "
            f"has {len(routers)} MoE layers (expected [layers, tokens, k])"
        )
    for router in routers:
        if experts.shape[2] != router.top_k:
            raise ValueError(
                f"replay_routing: recorded {experts.shape[2]} experts per token; the "
                f"router picks {router.top_k}"
            )
    try:
        for router, recorded in zip(routers, experts, strict=True):
            # an instance attribute shadows the class's forward; hooks still run around it
            router.forward = _replay_forward(router, recorded)
        yield
    finally:
        for router in routers:
            router.__dict__.pop("forward", None)


def expert_change_fraction(
    old: Tensor, new: Tensor, mask: Tensor | None = None
) -> tuple[float, list[float]]:
    """Share of activated experts that differ between two routings of the same tokens.

    ``old``, ``new``: ``[layers, tokens, k]``; ``mask``: ``[tokens]`` (0/1 or bool), the
    tokens that count (all when ``None``). An activation ``(layer, token, slot)`` of
    ``new`` has *changed* when its expert is not among the ``k`` experts ``old`` chose for
    that token and layer, so a reordering of the same experts is no change. Returns the
    fraction over all counted activations and one per layer (0.0 with no counted token).
    """
    if old.shape != new.shape:
        raise ValueError(f"routings differ in shape: {tuple(old.shape)} vs {tuple(new.shape)}")
    layers, tokens, _ = old.shape
    keep = (
        torch.ones(tokens, dtype=torch.bool, device=old.device)
        if mask is None
        else mask.reshape(-1).bool().to(old.device)
    )
    if keep.shape[0] != tokens:
        raise ValueError(f"mask has {keep.shape[0]} tokens; the routings have {tokens}")
    old_kept, new_kept = old[:, keep].long(), new[:, keep].long()  # [layers, n, k]
    changed = ~(new_kept.unsqueeze(-1) == old_kept.unsqueeze(-2)).any(-1)  # [layers, n, k]
    if changed.shape[1] == 0:
        return 0.0, [0.0] * layers
    per_layer = changed.float().mean(dim=(1, 2))
    return per_layer.mean().item(), per_layer.tolist()


class _Probed(Exception):
    """Raised by :func:`response_token_mask`'s hook to stop the forward it probes."""


def response_token_mask(
    model: nn.Module,
    forward: Callable[[Tensor, Tensor], object],
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_mask: Tensor,
) -> Tensor:
    """``[tokens]`` bool: which flattened input tokens of a forward are response tokens.

    ``forward(prompt_ids, completion_ids)`` must run the same single model forward (same
    token layout, padded or packed) as the one whose routing is recorded, for a batch with
    these prompts and masks. It is called with marker ids and stopped at the input
    embedding, before any compute, so the probe costs nothing and needs no knowledge of the
    layout: response tokens under ``completion_mask`` get id 1, prompt tokens their own id
    plus 2 (a layout that shares equal prompts sees them equal still), padding 0.

    Counted: the completion tokens under the mask (the stop token included); prompt
    tokens, padding and any filler of a packed layout are not.
    """
    response = 1
    prompt_ids = torch.where(prompt_mask.bool(), prompt_ids + 2, 0)
    completion_ids = torch.where(completion_mask.bool(), response, 0)
    seen: list[Tensor] = []

    def pre_hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input"]
        seen.append(ids.detach().reshape(-1))
        raise _Probed

    handle = model.get_input_embeddings().register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        forward(prompt_ids, completion_ids)
    except _Probed:
        pass
    finally:
        handle.remove()
    if not seen:
        raise ValueError("response_token_mask: the forward never reached the input embedding")
    return seen[0] == response


# ------------------------------------------------------------------ router aux loss


@contextlib.contextmanager
def capture_router_logits(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Keep every router's logits (``[tokens, experts]``, with their gradient) inside the block.

    Yields ``calls[layer]``: the logits of each call of that layer's router, in order.
    Under :func:`replay_routing` they are the current router's logits all the same.
    """
    with _router_outputs(model, lambda router, output: output[0]) as calls:
        yield calls


def load_balancing_loss(logits: list[Tensor], top_k: int, mask: Tensor | None = None) -> Tensor:
    """The Switch-Transformer load-balancing loss that transformers' MoE models use.

    ``logits``: one ``[tokens, experts]`` tensor per MoE layer (the same tokens);
    ``mask``: ``[tokens]``, the tokens that count (all when ``None``). With ``f_e`` the
    mean over counted (token, layer) pairs of whether ``e`` is among the top-k (the ``f_e``
    sum to ``top_k``) and ``P_e`` the mean router probability of ``e``, the loss is
    ``experts * sum_e f_e P_e``: ``top_k`` under perfectly uniform routing, more when the
    routing concentrates. Equals transformers' ``load_balancing_loss_func`` (Qwen3-MoE,
    Mixtral, ...) on the same tokens.
    """
    experts = logits[0].shape[-1]
    keep = None if mask is None else mask.reshape(-1).to(logits[0].device, torch.float32)
    counts = logits[0].new_zeros(experts, dtype=torch.float32)
    probs = logits[0].new_zeros(experts, dtype=torch.float32)
    for layer in logits:
        p = torch.softmax(layer.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices  # [tokens, k]
        weight = torch.ones_like(p[:, 0]) if keep is None else keep
        counts = counts.index_add(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probs = probs + (p * weight.unsqueeze(-1)).sum(0)
    total = (torch.ones_like(logits[0][:, 0]) if keep is None else keep).sum() * len(logits)
    total = total.clamp(min=1.0)
    return experts * torch.sum((counts / total) * (probs / total))


# ------------------------------------------------------------------ expert compute


def padded_experts_forward(
    experts: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor
) -> Tensor:
    """transformers' expert computation as three batched matmuls instead of a loop.

    For expert modules with ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``
    (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral). The (token, slot) pairs are sorted by expert
    into an ``[E, C, H]`` block padded to the busiest expert's count ``C``; the same sums
    as the eager loop up to float rounding. The eager loop's backward writes a full-size
    zero gradient of the expert weights per expert it indexes, so with many experts this
    is several times faster on the CPU; transformers 5.24's default, ``grouped_mm``, is
    faster still (``benchmarks/moe_experts.py``).
    """
    k = top_k_index.shape[1]
    count = experts.num_experts
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=count)
    width = int(per_expert.max()) if flat.numel() else 0
    sorted_experts = flat[order]
    starts = per_expert.cumsum(0) - per_expert
    position = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
    slot = sorted_experts * width + position
    token = order // k
    hidden = hidden_states.shape[-1]
    block = hidden_states.new_zeros(count * width, hidden)
    block = block.index_copy(0, slot, hidden_states[token]).view(count, width, hidden)
    gate, up = torch.bmm(block, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    out = torch.bmm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2))
    out = out.reshape(count * width, hidden)[slot]
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(hidden_states).index_add(0, token, out)


#: The name :func:`use_padded_experts` registers :func:`padded_experts_forward` under.
PADDED = "gspo_padded"


def use_padded_experts(model: nn.Module) -> None:
    """Make ``model``'s expert modules compute with :func:`padded_experts_forward`.

    Raises ``ValueError`` for a model whose experts do not have the layout it needs.
    """
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    modules = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    if not modules:
        raise ValueError("model has no expert modules with gate_up_proj / down_proj weights")
    for module in modules:
        layout = getattr(module, "is_concatenated", True) and not getattr(
            module, "is_transposed", False
        )
        if not layout or getattr(module, "has_bias", False):
            raise ValueError(
                f"{type(module).__name__}: expert weights not in the [E, 2I, H] layout"
            )
    ALL_EXPERTS_FUNCTIONS.register(PADDED, padded_experts_forward)
    model.set_experts_implementation(PADDED)


def experts_implementation(model: nn.Module) -> str:
    """How ``model``'s experts compute, as a ``model.experts_implementation`` value
    (``auto`` for a dense model or a transformers without the choice)."""
    name = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if not (is_moe(model) or unhandled_router(model)) or not name:
        return "auto"
    return "padded" if name == PADDED else str(name)


def set_experts_implementation(model: nn.Module, implementation: str) -> None:
    """Compute an MoE ``model``'s experts the way ``model.experts_implementation`` says.

    ``auto`` keeps what transformers chose when it built or loaded the model
    (``grouped_mm`` in transformers 5.24), ``padded`` is :func:`padded_experts_forward`,
    any other name is passed to transformers' ``set_experts_implementation`` (``eager``:
    its loop over experts). The same sums up to rounding in every case. A dense model is
    left as it is, and so is an MoE model whose router is not handled here asked for
    ``padded`` (transformers' own names reach it); a name this transformers cannot use
    raises ``ValueError``.
    """
    handled = is_moe(model)
    if implementation == "auto" or not (handled or unhandled_router(model)):
        return
    if implementation == "padded":
        try:
            if handled:
                use_padded_experts(model)
        except ValueError as error:  # (GPT-OSS's experts: biased, transposed)
            raise ValueError(f"model.experts_implementation=padded: {error}; use auto") from None
        return
    setter = getattr(model, "set_experts_implementation", None)
    if setter is None:
        import transformers

        raise ValueError(
            f"model.experts_implementation={implementation}: transformers "
            f"{transformers.__version__} cannot choose how experts compute; use auto"
        )
    try:
        setter(implementation)
    except (ValueError, ImportError, KeyError) as error:
        text = str(error).strip()
        reason = text.splitlines()[0] if text else type(error).__name__
        raise ValueError(f"model.experts_implementation={implementation}: {reason}") from None
