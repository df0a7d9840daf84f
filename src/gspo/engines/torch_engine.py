"""The torch rollout engine: samples G responses per prompt from the training module itself.

:class:`TorchEngine` samples from the module it is given (HF causal LM, KV cache), so its
weights are always current and ``sync_weights`` has nothing to do.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from gspo.engines import static_decode
from gspo.engines.batch import RolloutBatch, SamplingParams, pad_batch
from gspo.engines.decoding import KVDecoder, ModelDecoder, fast_decodable, make_decoder
from gspo.engines.sampling import sample_next
from gspo.engines.static_decode import StaticDecoder, capturable

#: Finished rows leave the batch and KV cache once this share of the batch has finished
#: (0: at every check where any row has). The fast decoder only copies the rows that move
#: into their slots, so leaving at once costs less than computing them.
DROP_FRACTION = 0.0

#: Which rows have finished is read on the host every this many steps (a device sync on
#: a GPU); between reads, finished rows are computed and their tokens ignored.
CHECK_EVERY = 8


class TorchEngine:
    """Batched sampling from a HF causal LM with a KV cache; finished rows leave the batch.

    Each distinct prompt is run through the model once (prefill) and its KV cache copied
    to its ``n`` responses, instead of ``n`` identical prefills. Decoding goes through
    :func:`gspo.engines.decoding.make_decoder`: pre-allocated KV buffers and a lean step for the
    Llama/Qwen families, the transformers forward for any other model (``fast=False``
    forces the latter, the reference). Every step draws one uniform number per response
    row from the seeded generator, live or not, so the samples depend on the seed only,
    not on when finished rows are dropped or which decoder runs (up to float rounding).

    ``cuda_graphs`` (``rollout.cuda_graphs``): where the fast decoder applies, decode with
    :class:`gspo.engines.static_decode.StaticDecoder`'s static-shape step, captured as CUDA
    graphs. ``"auto"``: on CUDA for models whose step can be captured (dense MLPs), the
    eager loop elsewhere; True: the static step wherever the fast decoder applies,
    captured where it can be and run eagerly elsewhere (the CPU: the tested path);
    False: never (the per-step loop). ``compile`` (``rollout.compile``): the fast decoder's
    per-layer work through ``torch.compile`` (:mod:`gspo.engines.compiled`; dense models).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pad_token_id: int,
        eos_token_id: int | None,
        fast: bool = True,
        cuda_graphs: bool | Literal["auto"] = "auto",
        compile: bool = False,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.fast = fast
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        #: the static step's buffers and graphs, kept for the next generation of the same
        #: shapes (a training run's rollout batches): its graphs are captured once
        self.static: StaticDecoder | None = None

    def static_step(self, decoder: KVDecoder | ModelDecoder, device: torch.device) -> str | None:
        """How this call decodes: ``"graphs"`` (the static step captured), ``"eager"`` (the
        static step run eagerly) or None (the eager loop of :meth:`decode`)."""
        if self.cuda_graphs is False or not isinstance(decoder, KVDecoder):
            return None
        if device.type == "cuda" and capturable(decoder) and StaticDecoder.capture:
            return "graphs"
        return "eager" if self.cuda_graphs is True else None

    def sync_weights(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            self.static = None  # buffers and graphs over another module's weights
        self.model = model  # same module object: nothing to copy

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, n: int, params: SamplingParams, seed: int
    ) -> RolloutBatch:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        generator = torch.Generator(device=device).manual_seed(seed)
        unique_ids, unique_mask = pad_batch(prompts, self.pad_token_id, device)
        prompt_ids = unique_ids.repeat_interleave(n, dim=0)
        prompt_mask = unique_mask.repeat_interleave(n, dim=0)
        rows, steps = prompt_ids.shape[0], params.max_new_tokens
        stop_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)

        positions = prompt_mask.sum(-1)  # of the token each row feeds next
        # whole span chunks: a slightly longer or shorter prompt keeps the shapes
        chunk = static_decode.SPAN_CHUNK
        capacity = -(-(unique_ids.shape[1] + steps) // chunk) * chunk
        shapes = dict(rows=rows, capacity=capacity, params=params, stop=stop)
        run = self.static
        static = None
        if run is not None and self.fast and fast_decodable(model):
            # the kept static step's settings, its weights read again into its own tensors
            static = self.static_step(run.decoder, device)
            vocab = model.get_output_embeddings().weight.shape[0]
            if static is None:
                run = None  # the eager loop this time: the static step kept, untouched
            elif not run.reuse(model, **shapes, vocab=vocab, graphs=static == "graphs"):
                run = self.static = None  # (weights partly overwritten) memory back first
        else:
            run = None
        if run is not None:
            decoder = run.decoder
            logits = decoder.prefill(unique_ids, unique_mask, n, capacity)
            run.start(positions)
        else:
            fast = self.fast
            decoder = make_decoder(model, compile=self.compile) if fast else ModelDecoder(model)
            static = self.static_step(decoder, device)
        if static is None:
            logits = decoder.prefill(unique_ids, unique_mask, n, unique_ids.shape[1] + steps)
            tokens_out, logprobs_out, lengths = self.decode(
                decoder, logits, positions, params, generator, stop
            )
        else:
            assert isinstance(decoder, KVDecoder)
            if run is None:
                self.static = None  # its memory back before the new buffers are allocated
                logits = decoder.prefill(unique_ids, unique_mask, n, capacity)
                run = self.static = StaticDecoder(
                    decoder,
                    positions=positions,
                    params=params,
                    stop=stop,
                    pad_token_id=self.pad_token_id,
                    vocab=decoder.head.shape[0],  # of the logits
                    graphs=static == "graphs",
                )
            run.run(logits, generator, check_every=CHECK_EVERY, drop_fraction=DROP_FRACTION)
            # the next generation writes into the same buffers: the tokens handed out are
            # a copy (the log-probs are, once masked below)
            tokens_out, logprobs_out = run.tokens_out.clone(), run.logprobs_out
            lengths = run.lengths
            if not params.keep_buffers:
                self.static = None  # (freed once this generation's reads below are done)

        t = int(lengths.max()) if rows else 0
        completion_mask = torch.arange(t, device=device).unsqueeze(0) < lengths.unsqueeze(1)
        last = tokens_out.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        stopped = (torch.isin(last, stop) & (lengths > 0)).tolist()
        model.train(was_training)
        return RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=tokens_out[:, :t],
            completion_mask=completion_mask,
            sampler_logprobs=logprobs_out[:, :t] * completion_mask,
            finish_reasons=["stop" if s else "length" for s in stopped],
            group_size=n,
        )

    def decode(
        self,
        decoder: KVDecoder | ModelDecoder,
        logits: Tensor,
        positions: Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        stop: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The eager loop: sample from the prefill's ``logits`` on, one ``decoder.step`` per
        token; (tokens ``[rows, steps]``, their log-probs, each row's length)."""
        rows, steps, device = logits.shape[0], params.max_new_tokens, logits.device
        tokens_out = torch.full((rows, steps), self.pad_token_id, dtype=torch.long, device=device)
        logprobs_out = torch.zeros((rows, steps), dtype=torch.float32, device=device)
        lengths = torch.zeros(rows, dtype=torch.long, device=device)
        active = torch.arange(rows, device=device)  # original row of each live batch row
        alive = torch.ones(rows, dtype=torch.bool, device=device)  # per live batch row
        vocab = logits.shape[-1]
        for k in range(steps):
            # one uniform (and noise row) per original row, whichever rows are live
            uniforms = torch.rand(rows, generator=generator, device=device)[active]
            noise = None
            if params.logit_noise > 0:
                noise = torch.randn((rows, vocab), generator=generator, device=device)[active]
            picked, logprobs = sample_next(logits, params, uniforms=uniforms, noise=noise)
            tokens = torch.where(alive, picked, self.pad_token_id)
            tokens_out[active, k] = tokens
            logprobs_out[active, k] = torch.where(alive, logprobs, 0.0)
            lengths.index_add_(0, active, alive.long())
            alive = alive & ~torch.isin(tokens, stop)
            if k + 1 == steps:
                break
            if (k + 1) % CHECK_EVERY == 0:
                live = int(alive.sum())
                if live == 0:
                    break
                finished = len(active) - live
                if finished and finished >= DROP_FRACTION * len(active):
                    order = decoder.select(alive.nonzero().squeeze(-1))
                    active, alive, positions, tokens = (
                        active[order],
                        alive[order],
                        positions[order],
                        tokens[order],
                    )
            logits = decoder.step(tokens, positions)
            positions = positions + 1
        return tokens_out, logprobs_out, lengths
