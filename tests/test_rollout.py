"""Rollout: the PyTorch engine (KV cache, seeded, early stop) and RolloutBatch."""

import pytest
import torch

from gspo.engines import SamplingParams, TorchEngine, sample_next
from gspo.models import completion_logprobs


def engine_for(model, tokenizer):
    return TorchEngine(
        model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )


def prompts(tokenizer, texts=("12+34=", "5+6=", "123+456=")):
    return [tokenizer(t)["input_ids"] for t in texts]


def test_sampler_logprobs_equal_a_recompute(tokenizer, tiny_model):
    engine = engine_for(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    batch = engine.generate(prompts(tokenizer), n=4, params=params, seed=0)
    assert len(batch) == 12 and batch.group_size == 4
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            batch.completion_mask,
            temperature=0.8,
        )
    delta = (lp - batch.sampler_logprobs).abs()[batch.completion_mask]
    assert delta.max() < 1e-4


def test_same_seed_same_samples_other_seed_differs(tokenizer, tiny_model):
    engine = engine_for(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=6)
    a = engine.generate(prompts(tokenizer), n=3, params=params, seed=1)
    b = engine.generate(prompts(tokenizer), n=3, params=params, seed=1)
    c = engine.generate(prompts(tokenizer), n=3, params=params, seed=2)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)


def test_greedy_matches_hf_generate(tokenizer, tiny_model):
    engine = engine_for(tiny_model, tokenizer)
    texts = ("12+34=", "5+6=")
    batch = engine.generate(prompts(tokenizer, texts), n=1, params=SamplingParams(7, 0.0), seed=0)
    for i, text in enumerate(texts):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        ref = tiny_model.generate(ids, max_new_tokens=7, do_sample=False, eos_token_id=None)
        ours = batch.completion_ids[i][batch.completion_mask[i]]
        assert ours.tolist() == ref[0, ids.shape[1] :].tolist()[: len(ours)]


def test_finished_rows_stop_and_are_masked(tokenizer, tiny_model):
    """With EOS made likely, rows finish at different steps; later positions are padding."""
    # An LM head with a bias on EOS (a bias also takes the model's own-logits path).
    old_head = tiny_model.lm_head
    head = torch.nn.Linear(old_head.in_features, old_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old_head.weight)
        head.bias.zero_()
        head.bias[tokenizer.eos_token_id] = 2.0
    tiny_model.lm_head = head
    engine = engine_for(tiny_model, tokenizer)
    batch = engine.generate(prompts(tokenizer), n=8, params=SamplingParams(12), seed=0)
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            batch.completion_mask,
        )
    lengths = batch.completion_lengths
    assert len(set(lengths.tolist())) > 2  # rows stopped at different steps
    eos = tokenizer.eos_token_id
    for i in range(len(batch)):
        n = int(lengths[i])
        row = batch.completion_ids[i]
        if batch.finish_reasons[i] == "stop":
            assert row[n - 1] == eos and eos not in row[: n - 1].tolist()
        else:
            assert n == 12 and eos not in row.tolist()
        assert (row[n:] == tokenizer.pad_token_id).all()
        assert (batch.sampler_logprobs[i, n:] == 0).all()
    # dropping finished rows from the KV cache must not change the remaining rows' log-probs
    delta = (lp - batch.sampler_logprobs).abs()[batch.completion_mask]
    assert delta.max() < 1e-4


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_next(logits, SamplingParams(top_p=0.7), gen)
    assert set(tokens.tolist()) == {0, 1}
    # reported log-probs are of the untruncated distribution (what the trainer recomputes)
    assert torch.allclose(logprobs[tokens == 1], torch.log(torch.tensor(0.3)), atol=1e-6)


def test_select_trims_padding(tokenizer, tiny_model):
    engine = engine_for(tiny_model, tokenizer)
    batch = engine.generate(
        prompts(tokenizer, ("1+1=", "123+456=")), n=2, params=SamplingParams(5), seed=0
    )
    sub = batch.select(torch.tensor([0, 1]))  # the short prompt's group
    assert sub.prompt_ids.shape[1] == len(tokenizer("1+1=")["input_ids"])
    assert torch.equal(sub.completion_ids, batch.completion_ids[:2, : sub.completion_ids.shape[1]])
    assert len(sub.finish_reasons) == 2


def test_a_minibatch_cut_from_a_batch_carries_its_ids_and_masks_on_the_host(tokenizer, tiny_model):
    """What ``select`` and ``trimmed`` hand on (so a minibatch on CUDA is cut and laid out
    without waiting for the device) is the minibatch's own ids and masks, cut the same
    way; a batch changed with ``dataclasses.replace`` makes its own."""
    from dataclasses import replace

    engine = engine_for(tiny_model, tokenizer)
    batch = engine.generate(
        prompts(tokenizer, ("1+1=", "123+456=")), n=3, params=SamplingParams(6), seed=1
    )
    for rows in ([0, 2], [4, 1, 3], [5]):
        sub = batch.select(torch.tensor(rows))
        names = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        for name, t in zip(names, sub.on_host(), strict=True):
            assert torch.equal(t.long(), getattr(sub, name).cpu().long()), (rows, name)
        again = sub.select(torch.tensor([len(rows) - 1]))  # a cut of a cut
        assert torch.equal(again.on_host().completion_ids, again.completion_ids)
    shorter = replace(batch, completion_mask=torch.zeros_like(batch.completion_mask))
    assert batch.on_host().completion_mask.any() and not shorter.on_host().completion_mask.any()


def test_a_host_copy_is_left_on_the_host_by_an_fsdp_roots_move_of_its_inputs():
    """Under torchrun the policy's forward is FSDP's root, which moves the tensors of its
    tuple (and named tuple) arguments to its device before the forward (on CUDA): the host
    copy the packed layout reads must stay where it is (it is a dataclass)."""
    from torch.distributed.utils import _to_kwargs

    from gspo.models import HostCopy

    host = HostCopy(*(torch.zeros(2, 3, dtype=torch.long) for _ in range(4)))
    (args,), (kwargs,) = _to_kwargs((tuple(host),), {"on_host": host}, torch.device("meta"), False)
    assert all(t.device.type == "meta" for t in args[0])  # what a tuple would go through
    assert kwargs["on_host"] is host


def test_logit_noise_changes_the_sampler_distribution_and_its_logprobs(tiny_model, tokenizer):
    """The testing-only noise emulates an engine whose probabilities differ from ours."""
    engine = engine_for(tiny_model, tokenizer)
    clean = SamplingParams(max_new_tokens=6, temperature=1.0)
    noisy = SamplingParams(max_new_tokens=6, temperature=1.0, logit_noise=0.5)
    batch = engine.generate(prompts(tokenizer), n=4, params=noisy, seed=0)
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model,
            batch.prompt_ids,
            batch.prompt_mask,
            batch.completion_ids,
            batch.completion_mask,
        )
    delta = (lp - batch.sampler_logprobs).abs()[batch.completion_mask]
    assert delta.mean() > 0.05  # the sampler's log-probs are of the perturbed logits
    again = engine.generate(prompts(tokenizer), n=4, params=noisy, seed=0)
    assert torch.equal(again.completion_ids, batch.completion_ids)  # seeded
    base = engine.generate(prompts(tokenizer), n=4, params=clean, seed=0)
    with torch.no_grad():
        lp0 = completion_logprobs(
            tiny_model, base.prompt_ids, base.prompt_mask, base.completion_ids, base.completion_mask
        )
    assert (lp0 - base.sampler_logprobs).abs()[base.completion_mask].max() < 1e-4


def test_fast_decoder_is_taken_for_qwen3_and_not_for_a_biased_head(tokenizer, tiny_model):
    from gspo.engines.decoding import KVDecoder, ModelDecoder, make_decoder

    assert isinstance(make_decoder(tiny_model), KVDecoder)
    old_head = tiny_model.lm_head
    tiny_model.lm_head = torch.nn.Linear(old_head.in_features, old_head.out_features, bias=True)
    assert isinstance(make_decoder(tiny_model), ModelDecoder)


def test_reference_decoder_uses_the_cache_argument_transformers_names(tokenizer, tiny_model):
    """No deprecation warning from the installed transformers' forward (5.24 renamed
    ``past_key_values`` to ``cache``; older versions take the old name)."""
    import warnings

    kw = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    engine = TorchEngine(tiny_model, fast=False, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = engine.generate(
            prompts(tokenizer, ("12+34=",)), n=2, params=SamplingParams(8), seed=0
        )
    assert out.completion_ids.shape[0] == 2


@pytest.mark.parametrize("linear", ["torch", "onednn"])
@pytest.mark.parametrize("attention", ["products", "sdpa", "sdpa, key spans"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_fast_decoder_samples_what_the_reference_samples(
    tokenizer, tiny_model, temperature, top_p, attention, linear, monkeypatch
):
    """Same seed -> the same tokens as the transformers forward, log-probs within 1e-5.

    The prompts have different lengths (left padding), EOS is made likely so rows finish
    at different steps and leave the batch, and finished-ness is read every 3 steps.
    ``linear``: the model's linear layers (and so the fast step's) on F.linear or oneDNN.
    ``key spans``: SDPA over keys in spans of 5 columns, the unwritten ones masked
    (``KVDecoder.key_span``, what CUDA takes).
    """
    import gspo.engines.torch_engine as rollout
    from gspo.engines.decoding import KVDecoder
    from gspo.models.kernels import onednn_available, set_linear_kernel

    if linear == "onednn" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    assert set_linear_kernel(tiny_model, linear) == linear
    monkeypatch.setattr(rollout, "CHECK_EVERY", 3)
    monkeypatch.setattr(KVDecoder, "attention", attention.split(",")[0])
    monkeypatch.setattr(KVDecoder, "key_span", 5 if "spans" in attention else None)
    with torch.no_grad():
        tiny_model.lm_head.weight[tokenizer.eos_token_id] *= 0  # shared with the embedding
        tiny_model.model.norm.weight.mul_(3.0)  # sharper distributions
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_p=top_p)
    texts = ("12+34=", "5+6=", "123+456=", "7=")
    kw = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    fast = TorchEngine(tiny_model, **kw).generate(
        prompts(tokenizer, texts), n=5, params=params, seed=3
    )
    ref = TorchEngine(tiny_model, fast=False, **kw).generate(
        prompts(tokenizer, texts), n=5, params=params, seed=3
    )
    assert torch.equal(fast.completion_ids, ref.completion_ids)
    assert torch.equal(fast.completion_mask, ref.completion_mask)
    assert fast.finish_reasons == ref.finish_reasons
    delta = (fast.sampler_logprobs - ref.sampler_logprobs).abs().max()
    assert delta < 1e-5
    if temperature > 0:
        lengths = fast.completion_lengths
        assert len(set(lengths.tolist())) > 2  # rows finished at different steps
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model,
            fast.prompt_ids,
            fast.prompt_mask,
            fast.completion_ids,
            fast.completion_mask,
            temperature=temperature or 1.0,
        )
    assert (lp - fast.sampler_logprobs).abs()[fast.completion_mask].max() < 1e-4


def test_samples_do_not_depend_on_when_finished_rows_leave(tokenizer, tiny_model, monkeypatch):
    """Every step draws one uniform per response row, live or not: same tokens whatever
    the drop threshold and however often finished-ness is read."""
    import gspo.engines.torch_engine as rollout

    engine = engine_for(tiny_model, tokenizer)
    params = SamplingParams(max_new_tokens=16)
    runs = []
    for every, fraction in ((1, 1e-9), (5, 0.25), (100, 2.0)):
        monkeypatch.setattr(rollout, "CHECK_EVERY", every)
        monkeypatch.setattr(rollout, "DROP_FRACTION", fraction)
        runs.append(engine.generate(prompts(tokenizer), n=6, params=params, seed=4))
    for other in runs[1:]:
        assert torch.equal(other.completion_ids, runs[0].completion_ids)
        # a matrix product's rounding can depend on how many rows it has
        assert torch.allclose(other.sampler_logprobs, runs[0].sampler_logprobs, atol=1e-6)


def test_key_spans_hide_what_an_earlier_generation_left_in_the_buffers(
    tokenizer, tiny_model, monkeypatch
):
    """SDPA over spans (``KVDecoder.key_span``) reads columns not written yet, masked: a
    decoder prefilled again at the same shape keeps its buffers, and what they held (NaN
    here) is zeroed first, as 0 * NaN would poison every row. Logits as without spans."""
    from gspo.engines import pad_batch
    from gspo.engines.decoding import KVDecoder

    monkeypatch.setattr(KVDecoder, "attention", "sdpa")
    ids, mask = pad_batch(prompts(tokenizer), tokenizer.pad_token_id, torch.device("cpu"))
    n, p = 2, ids.shape[1]
    positions = mask.sum(-1).repeat_interleave(n)
    tokens = torch.arange(len(positions)) % 7 + 1
    logits = {}
    with torch.no_grad():
        for span in (1, 5):
            monkeypatch.setattr(KVDecoder, "key_span", span)
            decoder = KVDecoder(tiny_model)
            decoder.prefill(ids, mask, n, p + 9)
            for buffer in [*decoder.keys, *decoder.values]:
                buffer.fill_(float("nan"))  # an earlier generation's leftovers, at worst
            decoder.prefill(ids, mask, n, p + 9)  # (the same shape: the same buffers)
            logits[span] = [decoder.step(tokens, positions + j) for j in range(7)]
    for spanned, plain in zip(logits[5], logits[1], strict=True):
        assert torch.isfinite(spanned).all()
        assert torch.allclose(spanned, plain, atol=1e-5)


def test_a_mask_for_the_efficient_kernel_gets_aligned_rows():
    """``aligned``: a mask whose rows sit at strides the memory-efficient kernel cannot
    read (not multiples of 16) is copied into padded rows, the same values; an aligned
    one (a slice of a 16-column-aligned buffer, a broadcast dimension) is left as it is."""
    from gspo.engines.decoding import aligned

    mask = torch.randn(3, 1, 1, 37)
    padded = aligned(mask)
    assert torch.equal(padded, mask) and padded.stride()[0] % 16 == 0
    buffer = torch.randn(3, 1, 48)
    sliced = buffer[:, None, :, :37]
    assert aligned(sliced) is sliced
    expanded = sliced.expand(3, 2, 4, 37)  # (broadcast dimensions: stride 0)
    assert aligned(expanded) is expanded


@pytest.mark.parametrize("attention", ["products", "sdpa"])
def test_select_keeps_each_rows_cache_and_reports_its_order(
    tokenizer, tiny_model, monkeypatch, attention
):
    """``select`` moves kept rows into leaving rows' slots: the order it returns says which
    old row sits where, and the next step's logits are those of that old row (padded
    prompts, so the padding mask moves with its row), on both decoders."""
    from gspo.engines import pad_batch
    from gspo.engines.decoding import KVDecoder, ModelDecoder, fast_decodable

    monkeypatch.setattr(KVDecoder, "attention", attention)
    ids, mask = pad_batch(prompts(tokenizer), tokenizer.pad_token_id, torch.device("cpu"))
    n, p = 3, ids.shape[1]
    rows = torch.tensor([0, 2, 5, 7, 8])  # out of 9; three of them beyond the new size
    tokens = torch.arange(9) % 7 + 1
    positions = mask.sum(-1).repeat_interleave(n)
    with torch.no_grad():
        for decoder in (KVDecoder(tiny_model), ModelDecoder(tiny_model)):
            decoder.prefill(ids, mask, n, p + 4)
            decoder.step(tokens, positions)  # one step, so the copy covers a decoded column
            full = decoder.step(tokens, positions + 1)  # every row's next logits, no select
            decoder.prefill(ids, mask, n, p + 4)
            decoder.step(tokens, positions)
            order = decoder.select(rows)
            assert sorted(order.tolist()) == rows.tolist()
            logits = decoder.step(tokens[order], positions[order] + 1)
            for j, i in enumerate(order.tolist()):
                assert torch.allclose(logits[j], full[i], atol=1e-5), (type(decoder), j, i)
    assert fast_decodable(tiny_model)


def test_inverse_cdf_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(20000, 1)
    tokens, _ = sample_next(logits, SamplingParams(), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4) / len(tokens)
    assert (freq - probs).abs().max() < 0.01


def one_level_inversion(probs, uniforms):
    """The float64 CDF over the whole vocabulary (the sampler's inversion before blocks)."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


@pytest.mark.parametrize(
    ("rows", "vocab", "block"), [(3000, 1000, 16), (2000, 997, 64), (32, 151_936, 256)]
)
def test_the_two_level_inversion_draws_the_tokens_the_whole_vocabulary_cdf_draws(
    rows, vocab, block
):
    """Blocks' sums, then the chosen block's own CDF: the same tokens as one float64 CDF
    over the whole vocabulary, for peaked and flat rows, rows with zeroed tokens (top-p),
    a vocabulary that is not a multiple of the block, and uniforms at 0 and just below 1."""
    from gspo.engines.sampling import invert_cdf

    gen = torch.Generator().manual_seed(0)
    scale = torch.logspace(-1, 1.5, rows).unsqueeze(-1)  # flat to nearly one-hot
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)
    zeroed = torch.rand(rows, vocab, generator=gen) < 0.5
    probs[1::2] = probs[1::2].masked_fill(zeroed[1::2], 0.0)
    uniforms = torch.rand(rows, generator=gen)
    uniforms[:4] = torch.tensor([0.0, 1 - 2**-24, 0.5, 1 - 2**-24])
    tokens = invert_cdf(probs, uniforms, block=block)
    assert torch.equal(tokens, one_level_inversion(probs, uniforms))
    assert (probs.gather(-1, tokens[:, None]) > 0).all()


def test_the_two_level_inversion_never_draws_a_token_of_probability_zero():
    """Uniforms at each token's boundary and within a few ulps of each block's, blocks
    starting and ending in zeros, the vocabulary ending in them: every token drawn has
    positive probability."""
    from gspo.engines.sampling import invert_cdf

    block, vocab = 8, 61
    probs = torch.rand(vocab, generator=torch.Generator().manual_seed(1))
    probs[0] = 0.0  # the start of the first block
    probs[block - 3 : block] = 0.0  # its end
    probs[2 * block : 3 * block + 2] = 0.0  # a whole block and the start of the next
    probs[vocab - 4 :] = 0.0  # the end of the vocabulary (a short last block)
    cdf = probs.double().cumsum(0)
    blocks = torch.nn.functional.pad(probs, (0, 3)).view(-1, block).sum(-1).double().cumsum(0)
    near = (blocks / blocks[-1]).unsqueeze(-1) + torch.arange(-4, 5) * 2.0**-53
    edges = torch.tensor([0.0, 1 - 2**-24], dtype=torch.float64)
    uniforms = torch.cat([cdf / cdf[-1], near.flatten(), edges]).clamp(0.0, 1 - 2**-53)
    tokens = invert_cdf(probs.expand(len(uniforms), vocab).contiguous(), uniforms, block=block)
    assert (probs[tokens] > 0).all()
    # a first block of zeros, a uniform of 0 (the first block with mass, not block 0)
    leading = torch.zeros(1, 12)
    leading[0, 5] = 1.0
    assert invert_cdf(leading, torch.zeros(1), block=4).item() == 5
    # a float64 uniform whose fraction of its block rounds to 1 (the block's last token,
    # of probability 0, without the clamp below 1)
    row = [1.7426442233681172e-10, 9.199929013048447e-12, 6.638422589411164e-10, 0.0,
           0.6868699193000793, 0.0003611780412029475, 0.10444220900535583, 0.0,
           4.683397225591079e-09, 0.05475963279604912, 0.00567439291626215, 0.0]  # fmt: skip
    u = torch.tensor([0.9290769762957599], dtype=torch.float64)
    assert invert_cdf(torch.tensor([row]), u, block=4).item() == 6
    # and a uniform at the middle of a token's share of the CDF draws that token
    middles = ((cdf - probs / 2) / cdf[-1])[probs > 0]
    drawn = invert_cdf(probs.expand(len(middles), vocab).contiguous(), middles, block=block)
    assert drawn.tolist() == probs.nonzero().squeeze(-1).tolist()


def test_fast_decoder_runs_the_moe_builtin_like_the_reference(tokenizer):
    """MoE blocks are called as the model's own modules: same tokens as the reference."""
    from gspo.engines.decoding import KVDecoder, make_decoder
    from gspo.models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec("qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)
    model = build_tiny_model(spec, tokenizer, seed=0)
    assert isinstance(make_decoder(model), KVDecoder)
    kw = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    params = SamplingParams(max_new_tokens=12)
    fast = TorchEngine(model, **kw).generate(prompts(tokenizer), n=3, params=params, seed=0)
    ref = TorchEngine(model, fast=False, **kw).generate(
        prompts(tokenizer), n=3, params=params, seed=0
    )
    assert torch.equal(fast.completion_ids, ref.completion_ids)
    assert (fast.sampler_logprobs - ref.sampler_logprobs).abs().max() < 1e-5


def lora_model(model, targets, *, use_dora=False, seed=0):
    """``model`` with PEFT LoRA adapters on ``targets``, their B made non-zero (fresh
    adapters add nothing) so that they change what the model samples."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=use_dora)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return peft_model.eval()


@pytest.mark.parametrize("linear", ["torch", "onednn"])
@pytest.mark.parametrize(
    "targets", ["all-linear", ["q_proj", "v_proj"], ["gate_proj", "down_proj"]]
)
def test_fast_decoder_merges_lora_adapters_and_samples_what_peft_samples(
    tokenizer, tiny_model, targets, linear
):
    """A LoRA model decodes on the fast path with its adapters merged for the call: the
    same tokens as PEFT's own forward (the reference decoder), log-probs within 1e-5, the
    base weights untouched, and the adapters' effect kept (tokens differ without them)."""
    from gspo.engines.decoding import KVDecoder, make_decoder
    from gspo.models.kernels import onednn_available, set_linear_kernel

    if linear == "onednn" and not onednn_available():
        pytest.skip("this torch has no oneDNN")
    with torch.no_grad():
        tiny_model.lm_head.weight[tokenizer.eos_token_id] *= 0  # long rows
    model = lora_model(tiny_model, targets)
    assert set_linear_kernel(model, linear) == linear
    decoder = make_decoder(model)
    assert isinstance(decoder, KVDecoder)
    adapted_mlps = sum(layer.mlp_weights is not None for layer in decoder.layers)
    assert adapted_mlps == (0 if targets == ["q_proj", "v_proj"] else len(decoder.layers))
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    kw = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    params = SamplingParams(max_new_tokens=20, temperature=0.8)
    texts = ("12+34=", "5+6=", "123+456=")
    fast = TorchEngine(model, **kw).generate(prompts(tokenizer, texts), n=4, params=params, seed=1)
    ref = TorchEngine(model, fast=False, **kw).generate(
        prompts(tokenizer, texts), n=4, params=params, seed=1
    )
    assert torch.equal(fast.completion_ids, ref.completion_ids)
    assert (fast.sampler_logprobs - ref.sampler_logprobs).abs().max() < 1e-5
    after = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base[k], after[k]) for k in base)
    with model.disable_adapter():  # the base model alone, also on the fast path
        plain = TorchEngine(model, **kw).generate(
            prompts(tokenizer, texts), n=4, params=params, seed=1
        )
        plain_ref = TorchEngine(model, fast=False, **kw).generate(
            prompts(tokenizer, texts), n=4, params=params, seed=1
        )
    assert torch.equal(plain.completion_ids, plain_ref.completion_ids)
    assert not torch.equal(plain.completion_ids, fast.completion_ids)


@pytest.mark.parametrize("base", ["float32", "bfloat16"])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_bf16_lora_decodes_on_the_fast_path_with_its_adapters_beside_the_matrices(
    tokenizer, tiny_model, targets, static, base, monkeypatch
):
    """Under bf16 autocast a LoRA model (float32 parameters, as the trainer holds them)
    takes the fast decoder with its adapters unmerged: the update, small beside W, would
    mostly round away in a bf16 matrix. Its log-probs are the trainer's forward's (PEFT's)
    as closely as the plain model's are, and they carry the adapters' effect; in the loop
    and in the static step (``rollout.cuda_graphs``, eager here) alike. Merged into bf16
    matrices instead, they would not be. A frozen base held in bf16 (as a LoRA run holds
    it on CUDA) takes the same path: it took PEFT's forward, every layer a module call."""
    from gspo.engines import lora_weights
    from gspo.engines.decoding import KVDecoder, make_decoder

    texts = ("12+34=", "7+8=", "99+1=", "5+55=")
    kw = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.no_grad():
        tiny_model.lm_head.weight.mul_(3.0)  # logits of a trained model's size
    model = lora_model(tiny_model, targets)
    with torch.no_grad():  # an update of a trained adapter's size: about 1% of W
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.1)
            elif not param.requires_grad:  # (the frozen base: training.lora's cast)
                param.data = param.data.to(getattr(torch, base))

    def sampled_and_trainer(fast: bool):
        engine = TorchEngine(model, fast=fast, cuda_graphs=static and fast, **kw)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            decoder = make_decoder(model)
            b = engine.generate(prompts(tokenizer, texts), n=8, params=SamplingParams(24), seed=1)
            lp = completion_logprobs(
                model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask
            )
        return decoder, b, lp

    def mean_gap(a, b, mask):  # per sampled token
        return float(((a - b) * mask).abs().sum() / mask.sum())

    decoder, fast, trainer = sampled_and_trainer(True)
    assert isinstance(decoder, KVDecoder) and decoder.low_rank
    mask = fast.completion_mask.bool()
    gap = mean_gap(trainer, fast.sampler_logprobs, mask)
    _, ref, ref_trainer = sampled_and_trainer(False)  # PEFT's forward with its own cache
    ref_gap = mean_gap(ref_trainer, ref.sampler_logprobs, ref.completion_mask.bool())
    assert gap < 1.25 * ref_gap, (gap, ref_gap)
    if targets == "all-linear" and not static:  # the adapters merged into bf16 matrices
        with monkeypatch.context() as m:
            m.setattr(lora_weights, "base_weight", lora_weights.merged_weight)
            m.setattr(lora_weights, "low_rank", lambda *args, **kwargs: None)
            _, merged, merged_trainer = sampled_and_trainer(True)
        merged_gap = mean_gap(
            merged_trainer, merged.sampler_logprobs, merged.completion_mask.bool()
        )
        assert merged_gap > 1.25 * ref_gap, (merged_gap, ref_gap)
    # the adapters count: the base model finds the LoRA model's tokens less alike
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), model.disable_adapter():
        base = completion_logprobs(
            model, fast.prompt_ids, fast.prompt_mask, fast.completion_ids, fast.completion_mask
        )
    adapters_effect = mean_gap(base, trainer, mask)
    assert gap < adapters_effect / 5, (gap, adapters_effect)


def test_the_decoders_lora_update_is_rounded_where_peft_rounds_it(tiny_model):
    """In bf16 the fast decoder adds an unmerged adapter's update as PEFT's layer does: the
    low-rank product in bf16, then times the adapter's scale, rounded once more, then
    added. Folding the scale into B (rounded with it, as before) gives other roundings
    wherever the scale is not a power of two: here 1.5 (lora_alpha 6, r 4). Bitwise equal
    on one projection; on the stacked q/k/v, the same per column."""
    from peft import LoraConfig, get_peft_model

    from gspo.engines.decoding import make_decoder

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=6, target_modules=targets))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    attention = model.base_model.model.model.layers[0].self_attn
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        decoder = make_decoder(model.eval())
        layer = decoder.layers[0]
        x = torch.randn(7, attention.o_proj.in_features, generator=gen)
        ours = decoder.project(x, layer.o, layer.o_lora)
        assert ours.dtype == torch.bfloat16 and layer.o_lora[2] is not None
        assert torch.equal(ours, attention.o_proj(x))
        h = torch.randn(7, attention.q_proj.in_features, generator=gen)
        qkv = decoder.project(h, layer.qkv, layer.qkv_lora)
        peft = torch.cat([attention.q_proj(h), attention.k_proj(h), attention.v_proj(h)], -1)
        assert torch.equal(qkv, peft)


def test_dora_and_bf16_lora_take_the_reference_decoder(tokenizer, tiny_model):
    import copy

    from gspo.engines.decoding import KVDecoder, ModelDecoder, make_decoder

    dora = lora_model(copy.deepcopy(tiny_model), ["q_proj"], use_dora=True)
    assert isinstance(make_decoder(dora), ModelDecoder)
    lora = lora_model(tiny_model, ["q_proj"])
    assert isinstance(make_decoder(lora), KVDecoder)
    lora.to(torch.bfloat16)  # merged into bf16 weights the update would round away
    assert isinstance(make_decoder(lora), ModelDecoder)


def test_bf16_sampler_logprobs_agree_with_the_trainer_forward(tokenizer, tiny_model, monkeypatch):
    """Under bf16 autocast the sampler's log-probs and the trainer's packed forward part
    where each rounds differently: the head's logits rounded to bf16 on each side and the
    decoder's bf16 attention scores. With the head in float32 and SDPA in the decoder (the
    defaults) the gap per token and per sequence mean falls several-fold."""
    from gspo.engines.decoding import KVDecoder
    from gspo.models import logprobs as models

    with torch.no_grad():
        tiny_model.lm_head.weight.mul_(3.0)  # logits of a trained model's size
    texts = ("12+34=", "7+8=", "99+1=", "5+55=")

    def gaps(fast: bool = True) -> tuple[float, float]:
        engine = TorchEngine(
            tiny_model,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            fast=fast,
        )
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            b = engine.generate(prompts(tokenizer, texts), n=8, params=SamplingParams(24), seed=1)
            lp = completion_logprobs(
                tiny_model,
                b.prompt_ids,
                b.prompt_mask,
                b.completion_ids,
                b.completion_mask,
                share_prompts="auto",
            )
        mask = b.completion_mask.bool()
        delta = (lp - b.sampler_logprobs) * mask
        sequence = delta.sum(-1) / mask.sum(-1)
        return float(delta.abs().sum() / mask.sum()), float(sequence.abs().mean())

    token, sequence = gaps()
    # what is left is decode vs packed forward, not the fast decoder: the transformers
    # forward with its own cache leaves the same gap
    reference_token, _ = gaps(fast=False)
    assert abs(reference_token - token) < 0.2 * token
    monkeypatch.setattr(models, "HEAD_IN_FLOAT32", False)
    monkeypatch.setattr(KVDecoder, "attention", "products")
    token_before, sequence_before = gaps()
    assert token < token_before / 3
    assert sequence < sequence_before / 3
    assert sequence < 1e-4 < sequence_before  # GSPO's clip band is 3e-4 / 4e-4


def test_a_bf16_weight_head_keeps_the_sampler_and_the_trainer_together(tokenizer, tiny_model):
    """``model.head_precision=bf16_weight`` (the default on CUDA in bf16): the head's
    weight rounded to bf16 in the sampler and in the trainer alike, the hidden states
    kept to ~16 bits, the sums in float32. The gap between the two stays that of the
    float32 head, and the trainer's log-probs do move with the setting."""
    from gspo.models.kernels import set_linear_kernel

    with torch.no_grad():
        tiny_model.lm_head.weight.mul_(3.0)  # logits of a trained model's size
    texts = ("12+34=", "7+8=", "99+1=", "5+55=")
    engine = TorchEngine(
        tiny_model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )

    def run(head: str):
        set_linear_kernel(tiny_model, "torch", head)
        engine.sync_weights(tiny_model)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            b = engine.generate(prompts(tokenizer, texts), n=8, params=SamplingParams(24), seed=1)
            lp = completion_logprobs(
                tiny_model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                share_prompts="auto",
            )  # fmt: skip
        mask = b.completion_mask.bool()
        delta = (lp - b.sampler_logprobs) * mask
        token = float(delta.abs().sum() / mask.sum())
        return token, float((delta.sum(-1) / mask.sum(-1)).abs().mean()), b, lp

    token32, sequence32, batch, lp32 = run("float32")
    token16, sequence16, _, _ = run("bf16_weight")
    assert token16 < 1.1 * token32 and sequence16 < 1.1 * sequence32 < 1e-4
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the setting is used
        lp16 = completion_logprobs(
            tiny_model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
            batch.completion_mask, share_prompts="auto",
        )  # fmt: skip
    moved = ((lp16 - lp32) * batch.completion_mask).abs().max()
    assert 0 < moved < 0.05
