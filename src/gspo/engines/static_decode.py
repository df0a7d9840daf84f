"""A static-shape decoding step over :class:`KVDecoder`'s weights and buffers, run eagerly
or replayed as one CUDA graph per batch-size bucket (``rollout.cuda_graphs``).

:class:`KVDecoder.step` is fast Python, but on a GPU a step is still a few hundred kernel
launches issued one at a time, with Python values (the write column, the current length,
the batch size) that change every step. :class:`StaticDecoder` runs the same arithmetic as
one step of fixed shapes whose every changing value lives on the device:

- the write column ``col`` and the step index ``k`` are one-element tensors; keys and
  values are written with ``index_copy_`` at ``col``, and attention runs over a fixed
  span of columns (the capacity in chunks of :data:`SPAN_CHUNK`) under an additive mask
  that is -inf on prompt padding and on columns past ``col``;
- positions, the token each row feeds next, which rows are alive and which original row
  each batch row is are tensors updated in place;
- the float32 head and :func:`gspo.engines.sampling.sample_next` (its log-prob included)
  are part of the step: it writes the sampled token and log-prob at ``k`` into the
  output buffers, counts the row's length and clears ``alive`` on a stop token;
- the step's uniforms (and logit noise) are read from buffers the host fills before the
  step, drawn exactly as the :class:`gspo.engines.TorchEngine` loop draws them (one per
  original row, from the seeded generator), so both paths sample the same tokens.

So one step is a fixed sequence of kernels on fixed addresses: on CUDA it is captured
once per (bucket, span) as a ``torch.cuda.CUDAGraph`` after :data:`WARMUP_STEPS` real
steps on a side stream, and replayed; elsewhere (the CPU: what the tests check) it runs
eagerly. The buffers and graphs outlive the generation: the engine keeps them, and a
next generation of the same shapes takes the new weights and prompts into them in place
(:meth:`StaticDecoder.reuse`, :meth:`StaticDecoder.start`) and replays the same graphs.
Which rows finished is read on the host every ``check_every`` steps only; when
the live rows fit a smaller bucket (powers of two below the batch), the KV buffers are
compacted into it (:meth:`KVDecoder.select`, only moved rows copied), finished rows
filling the bucket's spare slots as rows computed and ignored.

MoE blocks (called as the model's modules, whose routing synchronises with the host)
are not captured: such a model runs the static step eagerly.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gspo.engines.batch import SamplingParams
from gspo.engines.decoding import KVDecoder, attend, without_cast_cache
from gspo.engines.layer_weights import dense_layers, plain_mlp
from gspo.engines.lora_weights import MLP_PROJECTIONS, merged_weight
from gspo.engines.sampling import sample_next
from gspo.models import head_logits

#: Real steps each (bucket, span) runs eagerly on a side stream before its graph is
#: captured (the warm-up the PyTorch docs prescribe: lazy library set-up stays out of it).
WARMUP_STEPS = 2

#: Attention reads the first ``span`` columns of the cache, ``span`` the current length
#: rounded up to a multiple of this (one graph per span), not the whole capacity.
SPAN_CHUNK = 128


def buckets(rows: int) -> list[int]:
    """Batch sizes a generation of ``rows`` rows decodes at, largest first: ``rows``, then
    the powers of two below it."""
    sizes = [rows]
    power = 1 << max(rows - 1, 0).bit_length()
    while power > 1:
        power //= 2
        if power < rows:
            sizes.append(power)
    return sizes


def capturable(decoder: KVDecoder) -> bool:
    """Whether a step of ``decoder`` can be captured as a CUDA graph: every MLP dense
    (computed from its matrices; an MoE block's routing reads the device on the host)."""
    return dense_layers(decoder.layers)


class StaticDecoder:
    """One generation's static buffers over a prefilled :class:`KVDecoder`, and its graphs.

    Built after ``decoder.prefill`` (``rows`` response rows, the prompts' ``positions``
    ``[rows]``); :meth:`run` samples ``params.max_new_tokens`` tokens per row from the
    prefill's ``logits`` into :attr:`tokens_out`, :attr:`logprobs_out` and :attr:`lengths`
    (in original row order), as the eager loop of :class:`gspo.engines.TorchEngine` does.
    ``graphs``: capture each step shape as a CUDA graph (CUDA only) or run it eagerly.
    """

    #: False: :class:`gspo.engines.TorchEngine` runs the static step eagerly on CUDA too
    #: (for comparing the captured step with the same step uncaptured)
    capture: bool = True

    def __init__(
        self,
        decoder: KVDecoder,
        *,
        positions: Tensor,
        params: SamplingParams,
        stop: Tensor,
        pad_token_id: int,
        vocab: int,
        graphs: bool,
    ):
        if graphs and (positions.device.type != "cuda" or not capturable(decoder)):
            raise ValueError("CUDA graphs need a CUDA device and dense MLPs")
        self.decoder, self.params, self.graphs = decoder, params, graphs
        self.pad, self.vocab = pad_token_id, vocab
        device = positions.device
        rows, steps = positions.shape[0], params.max_new_tokens
        self.rows, self.steps = rows, steps
        self.capacity = capacity = decoder.values[0].shape[2]
        # the padding mask, held here (permuted in place, so its address stays)
        self.pad_bias = torch.zeros((rows, 1, capacity), dtype=decoder.dtype, device=device)
        self.columns = torch.arange(capacity, device=device)
        # dense MLPs from matrices in the compute dtype (cast once, not at every step)
        self.mlps = dense_mlps(decoder)
        # the module's own parameters the step reads in place (already in the compute
        # dtype): a captured graph reads their addresses, which a reuse checks are theirs
        # still (a parameter whose .data was replaced keeps its identity, not its storage)
        self.addresses = [(t, t.data_ptr()) for t in self.weights() if isinstance(t, nn.Parameter)]
        # what changes from step to step, on the device
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.k = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.empty(rows, dtype=torch.long, device=device)
        self.positions = torch.empty_like(positions)
        self.alive = torch.empty(rows, dtype=torch.bool, device=device)
        self.active = torch.empty(rows, dtype=torch.long, device=device)  # original row of each
        self.stop = stop.clone()
        self.draws = torch.empty(rows, device=device)
        self.noise = None
        if params.logit_noise > 0:
            self.noise = torch.empty((rows, vocab), device=device)
        # the results, in original row order
        self.tokens_out = torch.empty((rows, steps), dtype=torch.long, device=device)
        self.logprobs_out = torch.empty((rows, steps), dtype=torch.float32, device=device)
        self.lengths = torch.empty(rows, dtype=torch.long, device=device)
        self.start(positions)
        self.captured: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.warmed: dict[tuple[int, int], int] = defaultdict(int)
        # one memory pool for every graph: safe, as the graphs never run at once and none
        # reads what another left in the pool (every value a step hands on lives in the
        # buffers above), so they may replay in any order, generation after generation
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.side = torch.cuda.Stream(device=device) if graphs else None

    def start(self, positions: Tensor) -> None:
        """Set every buffer for a generation from the decoder's prefill (in place: the
        captured graphs read these addresses)."""
        d, p = self.decoder, self.decoder.length
        self.prompt_width = p  # (the decoder's prefill zeroed the columns past it)
        self.pad_bias.zero_()
        if d.bias is not None:  # the prompts' padding (past them the loop's spans' -inf)
            self.pad_bias[..., :p].copy_(d.bias[..., :p])
            d.bias = None
        self.col.fill_(p)
        self.k.zero_()
        self.tokens.fill_(self.pad)
        self.positions.copy_(positions)
        self.alive.fill_(True)
        torch.arange(self.rows, out=self.active)
        self.tokens_out.fill_(self.pad)
        self.logprobs_out.zero_()
        self.lengths.zero_()

    def reuse(
        self,
        model: nn.Module,
        *,
        rows: int,
        capacity: int,
        params: SamplingParams,
        stop: Tensor,
        vocab: int,
        graphs: bool,
    ) -> bool:
        """Whether the next generation (of ``model``, whose weights moved, at these shapes and
        settings) can run on these buffers and graphs, decided before any weight is read.
        If so the new weights are cast or merged straight into this generation's decoder
        and MLP matrices (:meth:`KVDecoder.reload`; no second copy of them is built), and
        the caller prefills ``self.decoder``, then calls :meth:`start`; if not, the caller
        drops this one (whose weights may be partly overwritten) and builds a new one."""
        mine = self.decoder
        if not (
            model is mine.model
            and (rows, capacity, vocab, graphs)
            == (self.rows, self.capacity, self.vocab, self.graphs)
            and params == self.params
            and torch.equal(stop, self.stop)
            and mine.keys_transposed == mine.transposed
            and all(t.data_ptr() == address for t, address in self.addresses)
        ):
            return False
        if not mine.reload():
            return False
        for layer, mlp in zip(mine.layers, self.mlps, strict=True):
            if mlp is not None and layer.mlp_weights is None:
                if not plain_mlp(layer.mlp):
                    return False
                for into, n in zip(mlp, MLP_PROJECTIONS, strict=True):
                    weight = merged_weight(getattr(layer.mlp, n))
                    if weight is not into:
                        if into.shape != weight.shape or isinstance(into, nn.Parameter):
                            return False
                        into.copy_(weight)  # cast in the copy: no cast copy made
        return True

    def weights(self) -> list[Tensor]:
        """Every weight the step reads: the decoder's and the dense MLPs' matrices."""
        mlps = [t for mlp in self.mlps if mlp is not None for t in mlp]
        return [t for t in self.decoder.tensors() + mlps if t is not None]

    # ------------------------------------------------------------------ the host loop
    def run(
        self,
        logits: Tensor,
        generator: torch.Generator,
        *,
        check_every: int,
        drop_fraction: float,
    ) -> None:
        """Sample every step from the prefill's ``logits`` ``[rows, V]`` on."""
        batch = self.rows
        self.draw(generator)
        self.sample(logits, batch)  # the first token, from the prefill's logits
        for j in range(1, self.steps):
            if j % check_every == 0:  # the only host synchronisation of the loop
                live = int(self.alive[:batch].sum())
                if live == 0:
                    break
                bucket = next(b for b in reversed(buckets(self.rows)) if b >= live)
                if bucket < batch and batch - live >= drop_fraction * batch:
                    self.compact(batch, bucket)
                    batch = bucket
            self.draw(generator)
            column = self.prompt_width + j - 1  # host copy of self.col: picks the span
            span = min(self.capacity, -(-(column + 1) // SPAN_CHUNK) * SPAN_CHUNK)
            self.advance(batch, span)

    def draw(self, generator: torch.Generator) -> None:
        """The step's random numbers, drawn as the eager loop draws them: ``rows`` uniforms,
        then ``[rows, V]`` normal noise when ``logit_noise`` is on."""
        torch.rand(self.rows, generator=generator, out=self.draws)
        if self.noise is not None:
            torch.randn(self.noise.shape, generator=generator, out=self.noise)

    def advance(self, batch: int, span: int) -> None:
        """One step at batch size ``batch`` over ``span`` columns: eager, or its graph."""
        key = (batch, span)
        if not self.graphs:
            self.step(batch, span)
        elif key in self.captured:
            self.captured[key].replay()
        elif self.warmed[key] < WARMUP_STEPS:
            self.warmed[key] += 1
            current = torch.cuda.current_stream(self.side.device)  # (the model's device)
            self.side.wait_stream(current)
            # as the capture runs it (autocast's cast cache off): compiled layers see the
            # same autocast state, so the capture finds their code compiled, not compiling
            with torch.cuda.stream(self.side), without_cast_cache("cuda"):
                self.step(batch, span)
            current.wait_stream(self.side)
        else:
            graph = torch.cuda.CUDAGraph()
            # thread_local: the trainer's thread may run beside an async rollout's capture,
            # each on its decoder's own stream (torch's default capture stream is one per
            # process, on device 0: two captures at once, or a model on cuda:1, broke it)
            try:
                with (
                    without_cast_cache("cuda"),  # (a capture keeps no cast made outside)
                    torch.cuda.graph(
                        graph, pool=self.pool, stream=self.side, capture_error_mode="thread_local"
                    ),
                ):
                    self.step(batch, span)  # recorded, not run
            except torch.OutOfMemoryError:
                raise  # the stage's one out-of-memory line names the setting
            except RuntimeError as exc:  # (the capture's end included)
                exc.add_note(
                    "gspo: capturing the decode step as a CUDA graph failed; "
                    "rollout.cuda_graphs=false decodes without graphs"
                )
                raise
            self.captured[key] = graph
            graph.replay()

    def compact(self, batch: int, bucket: int) -> None:
        """Move the live rows (and finished ones to fill it) into the first ``bucket`` rows."""
        alive = self.alive[:batch]
        live = alive.nonzero().squeeze(-1)
        spare = (~alive).nonzero().squeeze(-1)[: bucket - live.shape[0]]  # lowest first
        keep = torch.cat([live, spare]).sort().values
        order = self.decoder.select(keep)
        for buffer in (self.tokens, self.positions, self.alive, self.active, self.pad_bias):
            buffer[:bucket] = buffer[:batch][order]

    # ------------------------------------------------------------------ the static step
    def step(self, batch: int, span: int) -> None:
        """Feed each row's token, sample the next one and record it; no host value changes."""
        logits = self.forward(batch, span)
        self.positions[:batch] += 1
        self.col += 1
        self.sample(logits, batch)

    def sample(self, logits: Tensor, batch: int) -> None:
        """Sample from ``logits`` ``[batch, V]``; record token and log-prob at step ``k``."""
        active, alive = self.active[:batch], self.alive[:batch]
        noise = None if self.noise is None else self.noise[active]
        picked, logprobs = sample_next(
            logits, self.params, uniforms=self.draws[active], noise=noise
        )
        tokens = torch.where(alive, picked, self.pad)
        at = (active, self.k.expand(batch))
        self.tokens_out.index_put_(at, tokens)
        self.logprobs_out.index_put_(at, torch.where(alive, logprobs, 0.0))
        self.lengths.index_add_(0, active, alive.long())
        alive &= ~(tokens.unsqueeze(-1) == self.stop).any(-1)
        self.tokens[:batch] = tokens
        self.k += 1

    def forward(self, batch: int, span: int) -> Tensor:
        """:meth:`KVDecoder.step` at fixed shapes: next-token logits ``[batch, V]``."""
        d = self.decoder
        rows, heads, kv, dim = batch, d.heads, d.kv_heads, d.head_dim
        group, col = heads // kv, self.col
        positions = self.positions[:rows]
        cos = d.cos[positions].unsqueeze(1)  # [R, 1, D], shared by every head
        sin = d.sin[positions].unsqueeze(1)
        # -inf on prompt padding and on the columns not written yet
        mask = self.pad_bias[:rows, :, :span].masked_fill(self.columns[:span] > col, float("-inf"))
        h = F.embedding(self.tokens[:rows], d.embed)
        before, after = d.layer_work
        for i, layer in enumerate(d.layers):
            qk, v = before(d, layer, h, cos, sin)
            keys, values = d.keys[i][:rows], d.values[i][:rows]
            # the buffers hold the compute dtype; the rotary product is float32 under autocast
            values.index_copy_(2, col, v.unsqueeze(2).to(values.dtype))
            if d.transposed:  # keys [R, kv heads, head_dim, columns]
                keys.index_copy_(3, col, qk[:, heads:].unsqueeze(-1).to(keys.dtype))
                q = qk[:, :heads].reshape(rows * kv, group, dim)
                k = keys[..., :span].reshape(rows * kv, dim, span)
                scores = torch.baddbmm(d.no_bias, q, k, beta=0.0, alpha=d.scaling)
                scores.view(rows, heads, span).add_(mask)
                vals = values[:, :, :span].reshape(rows * kv, span, dim)
                out = torch.bmm(scores.softmax(-1), vals)
            else:
                keys.index_copy_(2, col, qk[:, heads:].unsqueeze(2).to(keys.dtype))
                out = attend(
                    qk[:, :heads].reshape(rows, kv, group, dim),
                    keys[:, :, :span],
                    values[:, :, :span],
                    mask[:, None],
                    d.scaling,
                    d.sdpa_kernel,
                )
            h = after(d, layer, h, out.reshape(rows, heads * dim), self.mlps[i])
        h = F.rms_norm(h, (h.shape[-1],), d.final_norm, d.eps)
        return head_logits(h, d.head, d.head_linear)


def dense_mlps(decoder: KVDecoder) -> list[tuple[Tensor, Tensor, Tensor] | None]:
    """Each layer's dense MLP matrices in the compute dtype (a LoRA MLP's merged ones); None
    for an MoE block."""
    return [layer.mlp_weights or _dense_mlp(layer.mlp, decoder.dtype) for layer in decoder.layers]


def _dense_mlp(mlp: torch.nn.Module, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor] | None:
    """A dense gated MLP's gate, up and down matrices in ``dtype``; None for an MoE block or
    an MLP with biases (run as its own module)."""
    if not plain_mlp(mlp):
        return None
    return tuple(merged_weight(getattr(mlp, n)).to(dtype) for n in MLP_PROJECTIONS)
