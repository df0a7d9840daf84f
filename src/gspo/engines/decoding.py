"""Decoders for :class:`gspo.engines.TorchEngine`: prefill prompts, then one token per row per step.

Two implementations of one small interface (``prefill``, ``step``, ``select``):

- :class:`KVDecoder`, the fast path for decoder-only models of the Llama / Qwen2 / Qwen3
  families (dense or MoE MLPs): keys and values go into buffers allocated once for the
  whole generation (no per-step concatenation), and a step is the model's own arithmetic
  written as a few fused tensor operations (one QKV matmul, one norm and one rotary
  embedding over queries and keys together, single-query attention on the key/value
  heads). The MLP of each layer is called as the model's own module, so MoE blocks and
  their routers run unchanged. A LoRA model (PEFT adapters on the linear layers, float32
  parameters) decodes with each adapted matrix merged for the call, ``W + scale * B @ A``
  (what PEFT's merge computes; the base weights are not touched), dense MLPs included,
  instead of PEFT's extra products and dispatch per layer and step. Under a 16-bit
  autocast the adapters are not merged (the update, small beside ``W``, would mostly
  round away in a 16-bit matrix): each adapted product adds ``((x A^T) B^T) * scale`` in
  the compute dtype, as PEFT's forward does, the projections of one fused matrix sharing
  one pair of low-rank products.
- :class:`ModelDecoder`, the reference: the transformers forward with a ``DynamicCache``,
  for every other model (and to check the fast path against).

Both prefill each distinct prompt once (transformers forward) and copy its keys and
values to its ``n`` responses. Prompts are left-padded, so at any step every row writes
the same cache column; rows only differ by their padding mask and positions.
"""

from __future__ import annotations

import contextlib
import inspect
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo.engines import lora_weights
from gspo.engines.compiled import LayerWork, layer_work
from gspo.engines.layer_weights import LayerWeights, Mismatch, dense_layers, place, read_layer
from gspo.models import head_logits, length_dependent_rope, plain_lm_head, position_ids_from_mask
from gspo.models.kernels import head_linear_for, linear_for
from gspo.models.logprobs import head_matrix

#: model_type values whose decoder layers :class:`KVDecoder` reimplements (checked
#: against transformers 5.23's modeling files): RMSNorm before attention and MLP, RoPE
#: on all of a head's dimensions, optional per-head q/k RMSNorm (Qwen3), optional
#: q/k/v biases (Qwen2), full attention in every layer.
#: The loop's SDPA key columns on CUDA are a multiple of this (:attr:`KVDecoder.key_span`).
KEY_SPAN = 64

#: The per-step loop's SDPA kernel (:attr:`KVDecoder.sdpa_kernel` None): torch's pick.
#: On an H200 at 9891430 (~0.5B Qwen3, 128 rows, bf16, a 128-token generation after a
#: 16-token warm-up) the loop's step took 22.06 ms with the memory-efficient kernel by
#: name, 35.37 with torch's pick (cuDNN's) over the same key spans; but that generation
#: met each span's shape for the first time, and cuDNN builds (and keeps) a plan per new
#: shape. How often a run meets new shapes (its batch also shrinks as rows finish) is not
#: measured; the decode stage now times both at shapes met before, cuDNN's best case.
#: Torch's pick stays until a measurement says otherwise ("efficient" then).
LOOP_SDPA_KERNEL = "sdpa"

FAST_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"})

_NORMS = frozenset(
    {"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen2MoeRMSNorm", "Qwen3MoeRMSNorm"}
)


def cached_forward(model: nn.Module, cache, **inputs):
    """The model's forward with a KV ``cache``: ``(output, the cache it returned)``.

    transformers 5.24 renamed the forward's ``past_key_values`` argument (and output) to
    ``cache`` and warns on the old name; models that predate it (or remote code) take
    the old one, so the name is read from the forward's signature.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    out = model(**inputs, **{name: cache}, use_cache=True)
    returned = getattr(out, "cache", None) if name == "cache" else None
    return out, returned if returned is not None else out.past_key_values


def head_weight(model: nn.Module) -> Tensor | None:
    """The matrix a plain head (:func:`gspo.models.logprobs.plain_lm_head`) multiplies by, cast to
    the dtype the head computes with once per generation for
    :func:`gspo.models.logprobs.head_logits` (float32, or bf16 at
    ``model.head_precision=bf16_weight``; otherwise each step would cast it); None for any
    other head."""
    if not plain_lm_head(model):
        return None
    return head_matrix(model.get_output_embeddings().weight, head_linear_for(model))


def next_token_logits(
    model: nn.Module, cache, head: Tensor | None = None, **inputs
) -> tuple[Tensor, object]:
    """The model's forward with a KV ``cache`` -> (float32 logits of each row's last
    token ``[R, V]``, the cache).

    With ``head`` (:func:`head_weight`) the plain head is applied to the decoder's last
    hidden states by :func:`gspo.models.logprobs.head_logits`, in float32, exactly as the trainer
    applies it; otherwise the logits are the model's own forward's.
    """
    if head is not None:
        out, cache = cached_forward(model.get_decoder(), cache, **inputs)
        return head_logits(out.last_hidden_state[:, -1], head, head_linear_for(model)), cache
    out, cache = cached_forward(model, cache, **inputs, logits_to_keep=1)
    return out.logits[:, -1, :].float(), cache


def prefill_cache(model: nn.Module, ids: Tensor, mask: Tensor, head: Tensor | None = None):
    """Run the distinct prompts ``[U, P]`` once; ``(logits of their last token [U, V], cache)``
    (``head``: :func:`head_weight`). Eagerly where the blocks were compiled for the
    training forwards (``model.compile``): they would be compiled again for a key/value
    cache, and for each prompt length. (Torch's compile stance is process-wide, so it is
    switched only then: ``model.compile`` refuses the async producer's thread.)"""
    from transformers import DynamicCache

    blocks = getattr(model.get_decoder(), "layers", ())
    compiled = any(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    eager = torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()
    with eager:
        return next_token_logits(
            model,
            DynamicCache(),
            head,
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids_from_mask(mask),
        )


class ModelDecoder:
    """The transformers forward with a ``DynamicCache``: any causal LM, the reference path."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.head = head_weight(model)

    def prefill(self, ids: Tensor, mask: Tensor, n: int, capacity: int) -> Tensor:
        """``[U, P]`` distinct prompts -> logits ``[U * n, V]`` of each response's first token."""
        logits, self.cache = prefill_cache(self.model, ids, mask, self.head)
        self.cache.batch_repeat_interleave(n)
        # the mask for every column up to ``capacity``, sliced (not grown) step by step
        rows = ids.shape[0] * n
        self.mask = torch.ones((rows, capacity), dtype=mask.dtype, device=mask.device)
        self.mask[:, : mask.shape[1]] = mask.repeat_interleave(n, dim=0)
        self.length = mask.shape[1]
        return logits.repeat_interleave(n, dim=0)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Tokens ``[R]`` at positions ``[R]`` -> next-token logits ``[R, V]``."""
        self.length += 1
        logits, self.cache = next_token_logits(
            self.model,
            self.cache,
            self.head,
            input_ids=tokens.unsqueeze(-1),
            attention_mask=self.mask[:, : self.length],
            position_ids=positions.unsqueeze(-1),
        )
        return logits

    def select(self, rows: Tensor) -> Tensor:
        """Keep only the batch rows ``rows`` (increasing; finished rows leave), in that
        order; returns ``rows``, the old row at each new batch position."""
        self.cache.batch_select_indices(rows)
        self.mask = self.mask[rows]
        return rows


def fast_decodable(model: nn.Module) -> bool:
    """Whether ``model``'s layers are exactly those :class:`KVDecoder` reimplements.

    Checked module by module (plain ``nn.Linear`` projections or PEFT LoRA layers over
    them in float32, no bias on the output projection, the expected RMSNorms, full
    attention, a RoPE that does not depend on the sequence length), so another
    adapter (DoRA, a merged or bf16 LoRA layer), another wrapper or another attention
    takes the reference path.
    """
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FAST_MODEL_TYPES:
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    decoder = model.get_decoder()
    if type(decoder.embed_tokens) is not nn.Embedding:
        return False
    rope_type = getattr(getattr(decoder, "rotary_emb", None), "rope_type", None)
    if not rope_type or length_dependent_rope(model) is not None:
        return False
    if type(decoder.norm).__name__ not in _NORMS:
        return False
    for layer in decoder.layers:
        a = layer.self_attn
        linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj)
        mergeable = all(lora_weights.mergeable(p) for p in linears)
        if not mergeable or lora_weights.bias_of(a.o_proj) is not None:
            return False
        if len({lora_weights.bias_of(p) is None for p in linears[:3]}) != 1:
            return False
        if lora_weights.lora_mlp(layer.mlp) and not lora_weights.adapted_mlp(layer.mlp):
            return False
        if hasattr(a, "q_norm") and type(a.q_norm).__name__ not in _NORMS:
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(m).__name__ not in _NORMS for m in norms):
            return False
        if getattr(a, "sliding_window", None) is not None:
            return False
    return True


class KVDecoder:
    """Pre-allocated KV buffers and a lean decoding step (see the module docstring).

    ``supports(model)`` says whether a model can take this path. The weights are read
    from the model when the decoder is built (one per ``generate`` call); the matrices in
    the dtype the products run in (autocast's when it is on), so a step casts no weight.
    """

    #: Single-query attention: ``"products"`` (batched matrix products over transposed
    #: keys), ``"sdpa"`` (``scaled_dot_product_attention``, the trainer's kernel family)
    #: or None: products in float32 (faster on the CPU, benchmarks/README.md), SDPA in a
    #: 16-bit dtype, where the products would round each score to 16 bits before the
    #: softmax while the trainer's SDPA keeps them in float32 (docs/precision.md).
    attention: str | None = None

    #: SDPA's key columns per step, rounded up to a multiple of this, the unwritten ones
    #: masked: None is :data:`KEY_SPAN` on CUDA (cuDNN's kernel builds a plan per shape;
    #: a length growing by one is a new shape every step: docs/engines.md), 1 elsewhere.
    key_span: int | None = None

    #: SDPA's kernel (:func:`attend`): ``"sdpa"``, torch's pick; ``"efficient"``, on CUDA
    #: the memory-efficient kernel by name, not the process-wide backend switch (which
    #: would reach an async trainer's forward); None, :data:`LOOP_SDPA_KERNEL` in the
    #: per-step loop, torch's pick in the static step (gspo.engines.static_decode).
    sdpa_kernel: str | None = None

    def __init__(self, model: nn.Module, *, compile: bool = False):
        self.model = model
        self.linear = linear_for(model)  # the kernel of the model's own linear layers
        self.head_linear = head_linear_for(model)  # and of its vocabulary projection
        config = model.config
        decoder = model.get_decoder()
        dtype = _compute_dtype(next(model.parameters()))
        self.dtype = dtype  # of the matrices and the KV buffers
        attn = decoder.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.eps = decoder.norm.variance_epsilon
        self.embed = decoder.embed_tokens.weight
        self.final_norm = decoder.norm.weight
        self.head = head_weight(model)  # supports(): always a plain head
        self.rotary = decoder.rotary_emb
        # the KV buffers at full size, ([keys], [values]), once prefilled (see prefill)
        self.buffers: tuple[list[Tensor], list[Tensor]] | None = None
        self.transposed = False
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None
        self.no_bias = torch.zeros((1, 1, 1), dtype=dtype, device=self.embed.device)
        # adapters merged into the matrices (float32), or kept beside them (16-bit)
        self.low_rank = dtype != torch.float32 and _adapted(model)
        self.layers = [self._read(layer) for layer in decoder.layers]
        #: whether the per-layer work runs compiled (``rollout.compile``): dense MLPs only,
        #: products by ``F.linear`` (inductor cannot lower oneDNN's packed-weight product)
        self.compiled = compile and dense_layers(self.layers) and self.linear is F.linear
        #: (queries_keys_values, after_attention), unbound, as every step calls them
        self.layer_work: LayerWork = layer_work(KVDecoder, self.compiled)

    def _read(self, layer: nn.Module, into: LayerWeights | None = None) -> LayerWeights:
        return read_layer(
            layer, dtype=self.dtype, low_rank=self.low_rank, heads=self.heads,
            kv_heads=self.kv_heads, into=into,
        )  # fmt: skip

    def reload(self) -> bool:
        """Read the model's weights again, after they moved, into this decoder's tensors in
        place: the matrices cast or merged straight into them, so no second copy is made
        and their addresses (what a captured CUDA graph reads) stay. False where they no
        longer fit (another compute dtype, adapters added or removed, another shape, a
        parameter the decoder reads replaced by another tensor): some may have been
        overwritten by then, so the caller drops this decoder and builds a new one."""
        model = self.model
        dtype = _compute_dtype(next(model.parameters()))
        if (dtype, dtype != torch.float32 and _adapted(model)) != (self.dtype, self.low_rank):
            return False
        decoder = model.get_decoder()
        try:
            if len(decoder.layers) != len(self.layers):
                raise Mismatch
            place(self.embed, [decoder.embed_tokens.weight], None)
            place(self.final_norm, [decoder.norm.weight], None)
            place(self.head, [model.get_output_embeddings().weight], self.head.dtype)
            for layer, mine in zip(decoder.layers, self.layers, strict=True):
                self._read(layer, into=mine)
        except Mismatch:
            return False
        return True

    def prefill(self, ids: Tensor, mask: Tensor, n: int, capacity: int) -> Tensor:
        """``[U, P]`` distinct prompts -> logits ``[U * n, V]`` of each response's first token.

        The prompts' keys and values are copied into buffers of ``capacity`` columns,
        ``n`` rows per prompt. The padding mask is kept only if some prompt is padded.
        """
        # (the model's forward: autocast would keep its casts of q/k/v/o and the MLPs to the
        # end of the generation, a second copy of the weights beside the step's own)
        with without_cast_cache(ids.device.type):
            logits, cache = prefill_cache(self.model, ids, mask, self.head)
        u, p = ids.shape
        rows = u * n
        each = torch.arange(u, device=ids.device).repeat_interleave(n)
        transposed = self.keys_transposed
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        # prefilled again at the same shape, a decoder keeps its buffers and their addresses
        # (what a captured CUDA graph reads: gspo.engines.static_decode)
        same = self.buffers is not None and self.buffers[1][0].shape == shape
        if not (same and self.transposed == transposed):
            key_shape = (*shape[:2], shape[3], shape[2]) if transposed else shape
            new = partial(torch.empty, dtype=self.dtype, device=ids.device)
            self.buffers = (
                [new(key_shape) for _ in cache.layers],
                [new(shape) for _ in cache.layers],
            )
            self.cos = self.sin = None
        self.transposed = transposed
        self.keys, self.values = list(self.buffers[0]), list(self.buffers[1])
        for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
            if transposed:
                keys[..., :p] = layer.keys[each].transpose(-1, -2)
            else:
                keys[:, :, :p] = layer.keys[each]
            values[:, :, :p] = layer.values[each]
        self.length = p
        # columns past the prompt hold zeros, not what torch.empty or an earlier generation
        # left there: the loop's spans and the static step read them masked (0 * NaN is NaN)
        for keys, values in zip(self.keys, self.values, strict=True):
            (keys[..., p:] if transposed else keys[:, :, p:]).zero_()
            values[:, :, p:].zero_()
        span = self.key_span or (KEY_SPAN if ids.device.type == "cuda" else 1)
        self.span = 1 if transposed else span  # (the products take the key length as it is)
        self.bias = attention_bias(mask.bool()[each], capacity, self.span > 1, self.dtype)
        # cos/sin of every position a row can reach, looked up per step
        positions = torch.arange(capacity, device=ids.device).unsqueeze(0)
        cos, sin = self.rotary(self.embed.new_zeros(()), positions)
        if self.cos is None:
            self.cos, self.sin = cos[0], sin[0]
        else:
            self.cos.copy_(cos[0])
            self.sin.copy_(sin[0])
        return logits[each]

    @property
    def keys_transposed(self) -> bool:
        """Whether the key buffers are ``[rows, kv heads, head_dim, columns]`` (for
        ``"products"``: the score product q @ k^T then reads a row-major operand)."""
        attention = self.attention or ("products" if self.dtype == torch.float32 else "sdpa")
        return attention == "products"

    def tensors(self) -> list[Tensor | None]:
        """Every weight a step reads but the MLP matrices (the matrices as cast or merged
        for this decoder; the static step holds its MLPs' itself), in a fixed order: two
        decoders of one model list the same shapes in the same places."""
        out: list[Tensor | None] = [self.embed, self.final_norm, self.head]
        for layer in self.layers:
            out += [layer.input_norm, layer.qkv, layer.qkv_bias, layer.qk_norm, layer.o]
            out.append(layer.post_norm)
            for low_rank in (layer.qkv_lora, layer.o_lora, *(layer.mlp_lora or (None,) * 3)):
                out += list(low_rank or (None, None, None))
        return out

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Tokens ``[R]`` at positions ``[R]`` -> next-token logits ``[R, V]``."""
        rows, heads, kv, d = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        group, col = heads // kv, self.length
        self.length = length = col + 1
        cos = self.cos[positions].unsqueeze(1)  # [R, 1, D], shared by every head
        sin = self.sin[positions].unsqueeze(1)
        h = F.embedding(tokens, self.embed)
        span = length
        if self.span > 1:  # SDPA over whole spans (``key_span``), this step's column opened
            span = min(-(-length // self.span) * self.span, self.values[0].shape[2])
            self.bias[:, :, col] = 0.0
        before, after = self.layer_work
        for i, layer in enumerate(self.layers):
            qk, v = before(self, layer, h, cos, sin)
            self.values[i][:, :, col] = v
            # one query per row: a key/value head's query heads attend as one group
            if self.transposed:
                self.keys[i][..., col] = qk[:, heads:]
                q = qk[:, :heads].reshape(rows * kv, group, d)
                keys = self.keys[i][..., :length].reshape(rows * kv, d, length)
                scores = torch.baddbmm(self.no_bias, q, keys, beta=0.0, alpha=self.scaling)
                if self.bias is not None:
                    scores.view(rows, kv * group, length).add_(self.bias[..., :length])
                values = self.values[i][:, :, :length].reshape(rows * kv, length, d)
                out = torch.bmm(scores.softmax(-1), values)
            else:
                self.keys[i][:, :, col] = qk[:, heads:]
                mask = None if self.bias is None else self.bias[:, None, :, :span]
                out = attend(
                    qk[:, :heads].reshape(rows, kv, group, d),
                    self.keys[i][:, :, :span],
                    self.values[i][:, :, :span],
                    mask,
                    self.scaling,
                    self.sdpa_kernel or LOOP_SDPA_KERNEL,
                )
            h = after(self, layer, h, out.reshape(rows, heads * d), layer.mlp_weights)
        h = F.rms_norm(h, (h.shape[-1],), self.final_norm, self.eps)
        return head_logits(h, self.head, self.head_linear)

    def queries_keys_values(
        self, layer: LayerWeights, h: Tensor, cos: Tensor, sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        """A layer's input norm and QKV product of the residual stream ``h`` ``[R, hidden]``:
        queries and keys ``[R, H + Hkv, D]`` (q/k-normed, rotated) and values ``[R, Hkv, D]``."""
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        x = F.rms_norm(h, (h.shape[-1],), layer.input_norm, self.eps)
        qkv = self.project(x, layer.qkv, layer.qkv_lora, layer.qkv_bias)
        qkv = qkv.view(h.shape[0], heads + 2 * kv, d)
        qk, v = qkv[:, : heads + kv], qkv[:, heads + kv :]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), None, self.eps) * layer.qk_norm
        half = d // 2
        rotated = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
        return qk * cos + rotated * sin, v

    def after_attention(
        self,
        layer: LayerWeights,
        h: Tensor,
        out: Tensor,
        mlp_weights: tuple[Tensor, Tensor, Tensor] | None,
    ) -> Tensor:
        """The residual stream after a layer whose attention gave ``out`` ``[R, H * D]``: the
        output projection, the post-attention norm and the MLP (its ``mlp_weights`` gate, up
        and down matrices, else the module)."""
        h = h + self.project(out, layer.o, layer.o_lora)
        x = F.rms_norm(h, (h.shape[-1],), layer.post_norm, self.eps)
        if mlp_weights is None:
            return h + layer.mlp(x.unsqueeze(1)).squeeze(1)
        gate, up, down = mlp_weights
        lora = layer.mlp_lora or (None, None, None)  # adapters beside (16-bit)
        act = layer.mlp.act_fn(self.project(x, gate, lora[0])) * self.project(x, up, lora[1])
        return h + self.project(act, down, lora[2])

    def project(
        self,
        x: Tensor,
        weight: Tensor,
        lora: tuple[Tensor, Tensor, Tensor | None] | None = None,
        bias: Tensor | None = None,
    ) -> Tensor:
        """``x @ weight.T (+ bias)``, plus the unmerged adapters' update
        (:func:`lora_weights.add_update`)."""
        out = self.linear(x, weight, bias)
        return out if lora is None else lora_weights.add_update(out, x, lora, self.linear)

    def select(self, rows: Tensor) -> Tensor:
        """Keep only the batch rows ``rows`` (increasing; finished rows leave); returns
        the old row at each new batch position.

        The buffers are compacted in place: each kept row beyond the new batch size moves
        into the slot of a leaving row below it, and the buffers become their first rows
        (a view). Only the moved rows are copied, so rows can leave as soon as they finish;
        the batch order changes accordingly.
        """
        kept = rows.shape[0]
        movers = rows[rows >= kept]  # kept rows that sit beyond the new batch size
        leaving = torch.ones(kept, dtype=torch.bool, device=rows.device)
        leaving[rows[rows < kept]] = False
        slots = leaving.nonzero().squeeze(-1)  # slots of leaving rows below it
        order = torch.arange(kept, device=rows.device)
        order[slots] = movers
        for buffers in (self.keys, self.values):
            for i, b in enumerate(buffers):
                b[slots] = b[movers]
                buffers[i] = b[:kept]
        if self.bias is not None:
            self.bias = self.bias[order]
        return order


def attention_bias(real: Tensor, capacity: int, spans: bool, dtype: torch.dtype) -> Tensor | None:
    """A decoder's additive attention mask ``[rows, 1, capacity rounded up to 16 columns]``
    (the alignment the memory-efficient kernel wants of a mask's rows): -inf on the
    prompts' padding (``real`` ``[rows, P]``: True on a prompt's tokens) and, with
    ``spans``, on every column past the prompts (each opened as a step writes it); None
    where it would be all zeros."""
    rows, p = real.shape
    if not spans and bool(real.all()):
        return None
    bias = torch.zeros((rows, 1, -(-capacity // 16) * 16), dtype=dtype, device=real.device)
    bias[:, 0, :p].masked_fill_(~real, float("-inf"))
    if spans:
        bias[:, 0, p:] = float("-inf")
    return bias


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, kernel: str | None
) -> Tensor:
    """A decoding step's attention: queries ``[R, Hkv, group, D]`` (a key/value head's
    query heads as one group) over keys and values ``[R, Hkv, L, D]``, ``mask`` additive,
    broadcastable to ``[R, Hkv, group, L]`` (rows 16-column aligned), or None.
    ``kernel`` (:attr:`KVDecoder.sdpa_kernel`): ``"efficient"``, on CUDA, the
    memory-efficient kernel by name, given what SDPA would give it (the queries in the
    keys' dtype, as autocast casts them, the mask expanded); anything else (``"sdpa"``,
    None) and off CUDA, SDPA as torch picks its kernel."""
    if kernel == "efficient" and q.is_cuda:
        q, bias = q.to(k.dtype), None
        if mask is not None:
            bias = aligned(mask.to(k.dtype)).expand(*q.shape[:3], k.shape[2])
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        return efficient(q, k, v, bias, False, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def aligned(mask: Tensor) -> Tensor:
    """``mask`` with every dimension of more than one entry at a stride of a multiple of
    16 (a copy padded past its last column where not): the memory-efficient kernel reads
    a mask's rows at aligned strides, and SDPA pads a mask so for it too."""
    strides = zip(mask.stride()[:-1], mask.shape[:-1], strict=True)
    if not any(stride % 16 for stride, size in strides if size > 1):
        return mask
    return F.pad(mask, (0, -mask.shape[-1] % 16))[..., : mask.shape[-1]]


def without_cast_cache(device_type: str):
    """Autocast as it is on ``device_type`` but without its cache of cast weights, which
    would keep each cast made inside until the outermost autocast ends."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    dtype = torch.get_autocast_dtype(device_type)
    return torch.autocast(device_type, dtype=dtype, cache_enabled=False)


def make_decoder(model: nn.Module, *, compile: bool = False) -> KVDecoder | ModelDecoder:
    """The fast decoder when ``model`` supports it (its per-layer work compiled with
    ``compile``), the reference one otherwise."""
    return KVDecoder(model, compile=compile) if fast_decodable(model) else ModelDecoder(model)


def _adapted(model: nn.Module) -> bool:
    """Whether PEFT LoRA layers sit in ``model``'s decoder."""
    return any(lora_weights.is_lora(m) for m in model.get_decoder().modules())


def _compute_dtype(weight: Tensor) -> torch.dtype:
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype
