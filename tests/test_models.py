"""Models: built-in tiny model and tokenizer, HF loading, completion log-probs."""

import math
import re

import pytest
import torch

from gspo.models import (
    TinyModelSpec,
    build_tiny_model,
    completion_logprobs,
    load_model,
    logprobs_from_hidden,
    packed_completion_logprobs,
    position_ids_from_mask,
    save_pretrained_atomic,
    token_logprobs_from_logits,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("text", ["Q: 12+34=? A: 46", "a\n\nb\n\n\n c  d"])
def test_char_tokenizer_round_trips_text(tokenizer, text):
    """One token a character: a blank line (two newlines) was one <unk>."""
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id not in ids and tokenizer.unk_token_id not in ids


def test_builtin_is_a_real_hf_model_that_reloads(tmp_path, tokenizer, tiny_model):
    save_pretrained_atomic(tiny_model, tokenizer, tmp_path / "m")
    assert not (tmp_path / "m.tmp").exists()
    model, tok = load_model(tmp_path / "m", device=CPU, dtype=torch.float32)
    assert model.config.model_type == "qwen3"
    ids = torch.tensor([tok("1+2=")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, tiny_model(ids).logits, atol=1e-6)


def test_moe_builtin_builds(tokenizer):
    spec = TinyModelSpec(architecture="qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1)
    model = build_tiny_model(spec, tokenizer, seed=0)
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 8


def test_same_seed_same_init(tokenizer):
    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    a = build_tiny_model(spec, tokenizer, seed=5).state_dict()
    b = build_tiny_model(spec, tokenizer, seed=5).state_dict()
    c = build_tiny_model(spec, tokenizer, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_load_model_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.path: .* is not a directory"):
        load_model(tmp_path / "nope", device=CPU, dtype=torch.float32)
    (tmp_path / "checkpoints" / "step-0000048").mkdir(parents=True)  # (a run removed 40)
    removed = r"step-0000040 is not a directory: no such checkpoint \(.*checkpoints holds "
    with pytest.raises(FileNotFoundError, match=removed + "step-0000048; a run keeps its"):
        load_model(tmp_path / "checkpoints" / "step-0000040", device=CPU, dtype=torch.float32)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty", device=CPU, dtype=torch.float32)


def test_weights_that_do_not_make_the_model_are_one_line(tmp_path, tokenizer, capsys):
    """A tensor missing from the files trained from its random initialisation (after
    transformers' multi-line report); a truncated file or a config.json of other shapes
    ended in a traceback; tensors the model has no place for were left out unsaid."""
    import json

    from safetensors.torch import load_file, save_file

    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    model = build_tiny_model(spec, tokenizer, seed=0)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    save_pretrained_atomic(model, tokenizer, tmp_path / "m")
    load_model(tmp_path / "m", device=CPU, dtype=torch.float32)  # whole: loads
    weights = tmp_path / "m" / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, weights)
    with pytest.raises(ValueError, match=r"/m: the weight files lack lm_head.weight, which"):
        load_model(tmp_path / "m", device=CPU, dtype=torch.float32)
    second = {k.replace("layers.0", "layers.1"): v.clone() for k, v in tensors.items()}
    extra = {**tensors, **second}
    save_file(extra, weights)  # a second layer config.json does not make: trained without
    capsys.readouterr()
    load_model(tmp_path / "m", device=CPU, dtype=torch.float32)
    err = capsys.readouterr().err
    assert err.startswith("gspo: warning: model.path: ") and err.count("\n") == 1
    assert "/m: 11 tensor(s) of the weight files have no place in the model" in err
    load_model(tmp_path / "m", device=CPU, dtype=torch.float32, warn=False)
    assert capsys.readouterr().err == ""
    save_file(tensors, weights)
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "hidden_size": 16}))
    with pytest.raises(ValueError) as err:
        load_model(tmp_path / "m", device=CPU, dtype=torch.float32)
    assert "] in the weight files but [" in str(err.value) and "\n" not in str(err.value)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cannot load .*/m: model.safetensors is truncated or "):
        load_model(tmp_path / "m", device=CPU, dtype=torch.float32)


def test_another_trainers_checkpoint_dir_loads_without_a_manifest(tmp_path, tokenizer):
    """Only gspo's own step checkpoints (their trainer state beside) must hold a manifest:
    a user's model saved as .../checkpoints/step-1000 was refused as damaged."""
    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    theirs = tmp_path / "x" / "checkpoints" / "step-1000"
    save_pretrained_atomic(build_tiny_model(spec, tokenizer, seed=0), tokenizer, theirs)
    load_model(theirs, device=CPU, dtype=torch.float32)


def test_a_tokenizer_or_config_that_does_not_fit_is_one_line(tmp_path, tokenizer, capsys):
    """A pad added to the tokenizer without resizing the embeddings, or no pad nor eos:
    a traceback inside the first generation. A cut tokenizer.json, tokenizer_config.json
    alone, a config.json not JSON or of an unknown model_type: half a line, the tokenizer
    blamed, or transformers' own warning line first."""
    import copy
    import json

    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    model = build_tiny_model(spec, tokenizer, seed=0)
    rows = model.get_input_embeddings().num_embeddings
    m = tmp_path / "m"

    def refused(tok, pattern: str) -> None:
        save_pretrained_atomic(model, tok, m)
        with pytest.raises(ValueError) as err:
            load_model(m, device=CPU, dtype=torch.float32)
        assert "\n" not in str(err.value) and re.search(pattern, str(err.value)), err.value

    added = copy.deepcopy(tokenizer)  # a pad past the table: ids len(tokenizer) .. rows
    added.add_tokens([f"<extra{i}>" for i in range(rows - len(tokenizer))])
    added.add_special_tokens({"pad_token": "[PAD]"})
    refused(
        added,
        rf"the tokenizer's pad token '\[PAD\]' is id {rows}, past the model's "
        rf"{rows}-row embedding table \(a token added without model.resize_token_",
    )
    bare = copy.deepcopy(tokenizer)
    bare.pad_token = bare.eos_token = None
    refused(bare, r"the tokenizer of .*/m has no pad token and no eos token")
    save_pretrained_atomic(model, tokenizer, m)
    load_model(m, device=CPU, dtype=torch.float32)  # (as saved: whole)
    assert capsys.readouterr().err == ""
    for name, cut, said in (
        ("tokenizer.json", 100, r"the tokenizer of .*/m: tokenizer.json is not whole JSON \("),
        ("config.json", 10, r"/m/config.json is not whole JSON \("),
    ):
        whole = (m / name).read_text()
        (m / name).write_text(whole[:cut])
        with pytest.raises(ValueError, match=said):
            load_model(m, device=CPU, dtype=torch.float32)
        (m / name).write_text(whole)
    config = json.loads((m / "config.json").read_text())
    (m / "config.json").write_text(json.dumps({**config, "model_type": "qwen9"}))
    with pytest.raises(ValueError, match=r"/m/config.json has model_type 'qwen9', which "):
        load_model(m, device=CPU, dtype=torch.float32)
    assert capsys.readouterr().err == ""  # (transformers' own line before)
    (m / "config.json").write_text(json.dumps(config))
    (m / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"no vocabulary beside its tokenizer_config.json"):
        load_model(m, device=CPU, dtype=torch.float32)


def test_completion_logprobs_match_a_full_forward(tokenizer, tiny_model):
    """Left-padded prompts + right-padded completions give each row's unpadded log-probs."""
    rows = [("12+3=", "15"), ("7+8=", "15!"), ("100+1=", "1")]
    pad = tokenizer.pad_token_id
    p_ids = [tokenizer(p)["input_ids"] for p, _ in rows]
    c_ids = [tokenizer(c)["input_ids"] for _, c in rows]
    pw, cw = max(map(len, p_ids)), max(map(len, c_ids))
    prompt = torch.tensor([[pad] * (pw - len(p)) + p for p in p_ids])
    prompt_mask = (prompt != pad).long()
    completion = torch.tensor([c + [pad] * (cw - len(c)) for c in c_ids])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (cw - len(c)) for c in c_ids]).bool()
    temperature = 0.7
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model, prompt, prompt_mask, completion, completion_mask, temperature=temperature
        )
        for i, (p, c) in enumerate(zip(p_ids, c_ids, strict=True)):
            logits = tiny_model(torch.tensor([p + c])).logits[0].float() / temperature
            ref = torch.log_softmax(logits, -1)[len(p) - 1 : -1].gather(
                -1, torch.tensor(c)[:, None]
            )
            assert torch.allclose(lp[i, : len(c)], ref.squeeze(-1), atol=1e-5)


def test_token_logprobs_from_logits_is_log_softmax_gather():
    logits = torch.randn(3, 5, 11, dtype=torch.bfloat16)
    ids = torch.randint(0, 11, (3, 5))
    out = token_logprobs_from_logits(logits, ids, 2.0)
    ref = torch.log_softmax(logits.float() / 2.0, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert out.dtype == torch.float32
    assert torch.allclose(out, ref, atol=1e-6)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_logprobs_equal_full_logits_in_value_and_gradient(chunk):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    ids = torch.randint(0, 50, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)

    ours = logprobs_from_hidden(hidden, weight, ids, 0.7, chunk)
    (ours * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    ref = torch.log_softmax((hidden @ weight.T) / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()
    assert torch.allclose(ours, ref, atol=1e-5)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-5)
    assert torch.allclose(grads[1], weight.grad, atol=1e-5)


def test_the_default_head_chunk_is_256_tokens_off_cuda_and_a_gigabyte_of_logits_on_it(
    monkeypatch,
):
    """``head_chunk``: 256 tokens on the CPU whatever the vocabulary; on CUDA the largest
    power of two whose float32 logits fit in 1 GiB (1,024 tokens of Qwen's 151,936), never
    fewer than 256. ``logprobs_from_hidden`` without a chunk size takes it: the products
    it runs have that many rows."""
    import gspo.models.logprobs as logprobs
    from gspo.models import head_chunk

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert head_chunk(151_936, cpu) == head_chunk(50, cpu) == 256
    assert head_chunk(151_936, cuda) == 1024
    assert head_chunk(50, cuda) == 2**22  # 4 * 50 * 2**22 bytes = 800 MiB
    assert head_chunk(4_000_000, cuda) == 256  # (4 GB of logits a chunk: still 256 tokens)
    rows = []

    def linear(x, w):
        rows.append(x.shape[0])
        return x @ w.T

    monkeypatch.setattr(logprobs, "head_chunk", lambda vocab, device: 4 if vocab == 30 else 0)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8, generator=gen), torch.randn(30, 8, generator=gen)
    ids = torch.randint(0, 30, (2, 6), generator=gen)
    out = logprobs_from_hidden(hidden, weight, ids, 1.0, linear=linear)
    assert rows == [4, 4, 4]
    ref = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(out, ref, atol=1e-5)


def test_at_temperature_1_the_head_and_the_sampler_divide_nothing():
    """Dividing by a temperature of 1 changes no value (x / 1 is x) but costs a pass over
    each chunk's logits (156 MB at a 151,936-token vocabulary), one more in backward, and
    one over each decoding step's: none is made; at another temperature it is. (Divisions
    of smaller tensors, the sampler's per-row fraction, are not counted.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gspo.engines import SamplingParams, sample_next

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            first = args[0] if args else None
            if not (isinstance(first, torch.Tensor) and first.shape[-1:] == (30,)):
                return func(*args, **(kwargs or {}))  # (not over a vocabulary of 30)
            self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(30, 8, generator=gen, requires_grad=True)
    ids = torch.randint(0, 30, (2, 6), generator=gen)
    logits = torch.randn(4, 30, generator=gen)
    for temperature, divides in ((1.0, False), (0.7, True)):
        with Ops() as ops:
            logprobs_from_hidden(hidden, weight, ids, temperature, 4).sum().backward()
            sample_next(logits, SamplingParams(8, temperature=temperature), gen)
        assert any(n.startswith("div") for n in ops.names) == divides, ops.names


def test_chunked_logprobs_without_grad_and_empty():
    with torch.no_grad():
        out = logprobs_from_hidden(
            torch.randn(2, 3, 4), torch.randn(9, 4), torch.zeros(2, 3).long(), 1.0, 2
        )
    assert out.shape == (2, 3) and not out.requires_grad
    empty = logprobs_from_hidden(
        torch.randn(2, 0, 4), torch.randn(9, 4), torch.zeros(2, 0).long(), 1.0, 2
    )
    assert empty.shape == (2, 0)


@pytest.mark.parametrize("pack_tokens", [8, 12, 40, 4096])
def test_packed_logprobs_equal_the_padded_forward(tokenizer, tiny_model, pack_tokens):
    """Packing into one row or several (first-fit decreasing) changes no value or gradient."""
    gen = torch.Generator().manual_seed(1)
    n, p, t = 6, 5, 7
    prompt = torch.randint(4, 60, (n, p), generator=gen)
    prompt_mask = torch.ones(n, p, dtype=torch.long)
    prompt_mask[0, :2] = 0  # left padding
    prompt_mask[3, :4] = 0
    completion = torch.randint(4, 60, (n, t), generator=gen)
    lengths = torch.tensor([7, 1, 3, 0, 5, 2])
    completion_mask = torch.arange(t)[None, :] < lengths[:, None]
    args = (tiny_model, prompt, prompt_mask, completion, completion_mask)
    packed = packed_completion_logprobs(*args, temperature=0.8, pack_tokens=pack_tokens)
    # the padded reference: the model's own forward on left/right-padded rows
    ids = torch.cat([prompt, completion], 1)
    mask = torch.cat([prompt_mask, completion_mask.long()], 1)
    logits = tiny_model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits[:, p - 1 : -1]
    ref = token_logprobs_from_logits(logits, completion, 0.8) * completion_mask
    assert torch.allclose(packed, ref, atol=1e-5)
    assert (packed[~completion_mask] == 0).all()
    weight = tiny_model.model.embed_tokens.weight
    g_packed = torch.autograd.grad(packed.sum(), weight)[0]
    g_ref = torch.autograd.grad(ref.sum(), weight)[0]
    assert torch.allclose(g_packed, g_ref, atol=1e-4)


@pytest.mark.parametrize("pack_tokens", [8, 40, 4096])
def test_shared_prompts_equal_the_padded_forward_and_feed_each_prompt_once(
    tokenizer, tiny_model, pack_tokens
):
    """Rows with one prompt (a group) share it: same values and gradients, fewer tokens."""
    gen = torch.Generator().manual_seed(2)
    p, t = 5, 6
    prompts = torch.randint(4, 60, (3, p), generator=gen)
    groups = torch.tensor([0, 1, 0, 2, 1, 0, 0])  # rows 0, 2, 5, 6 share prompt 0, ...
    prompt = prompts[groups]
    prompt_mask = torch.ones(len(groups), p, dtype=torch.long)
    prompt_mask[groups == 1, :2] = 0  # prompt 1 is left-padded, in both its rows
    completion = torch.randint(4, 60, (len(groups), t), generator=gen)
    lengths = torch.tensor([6, 1, 0, 3, 5, 2, 4])
    completion_mask = torch.arange(t)[None, :] < lengths[:, None]
    args = (tiny_model, prompt, prompt_mask, completion, completion_mask)
    fed: list[int] = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: fed.append(int(inputs[0].numel()))
    )
    try:
        shared = packed_completion_logprobs(*args, pack_tokens=pack_tokens, share_prompts=True)
        alone = packed_completion_logprobs(*args, pack_tokens=pack_tokens)
    finally:
        hook.remove()
    assert torch.allclose(shared, alone, atol=1e-5)
    assert (shared[~completion_mask] == 0).all()
    real = int(completion_mask.sum()) + 5 + 3 + 5  # completions, the three prompts once each
    assert fed[0] >= real and fed[0] < fed[1]  # (rows of several have a tail)
    if pack_tokens == 4096:  # one row, no tail: exactly the real tokens
        assert fed == [real, real - 13 + int(prompt_mask.sum())]
    weight = tiny_model.model.embed_tokens.weight
    g_shared = torch.autograd.grad(shared.sum(), weight)[0]
    g_alone = torch.autograd.grad(alone.sum(), weight)[0]
    assert torch.allclose(g_shared, g_alone, atol=1e-4)


def test_a_sliding_window_model_does_not_share_prompts_past_its_window(tokenizer):
    """The shared layout's explicit mask let every token see the whole sequence: a Mistral
    with a window of 4 got log-probs far from its own forward (GSPO then clipped most
    on-policy sequences). Past the window the rows are packed alone."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config

    from gspo.models.layout import sliding_window

    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    assert sliding_window(model.config) == 4 and sliding_window(Qwen3Config()) is None
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 60, (1, 5), generator=gen).repeat(3, 1)  # one group
    completion = torch.randint(4, 60, (3, 9), generator=gen)
    masks = torch.ones_like(prompt), torch.ones_like(completion)
    args = (model, prompt, masks[0], completion, masks[1])
    with torch.no_grad():
        ids = torch.cat([prompt, completion], 1)
        own = torch.log_softmax(model(ids).logits[:, 4:-1], -1)
        own = own.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        for share in (True, "auto", False):
            packed = packed_completion_logprobs(*args, share_prompts=share)
            assert (packed - own).abs().max() < 1e-5


def _full_entropy(logits):
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_entropy_equals_full_logits_in_value_and_gradient(chunk):
    """with_entropy: each position's entropy of softmax(logits / T), from the same chunks
    (checkpointed), equals the full-logits formula in value and gradient; the log-probs
    are unchanged."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    ids = torch.randint(0, 50, (3, 5), generator=gen)
    up_lp, up_h = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    lp, ent = logprobs_from_hidden(hidden, weight, ids, 0.7, chunk, with_entropy=True)
    ((lp * up_lp).sum() + (ent * up_h).sum()).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    logits = (hidden @ weight.T) / 0.7
    ref_lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)
    ref_ent = _full_entropy(logits)
    ((ref_lp * up_lp).sum() + (ref_ent * up_h).sum()).backward()
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    assert ent.min() > 0 and ent.max() < math.log(50)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-4)
    assert torch.allclose(grads[1], weight.grad, atol=1e-4)
    plain = logprobs_from_hidden(hidden.detach(), weight.detach(), ids, 0.7, chunk)
    assert torch.equal(plain, lp.detach())


def test_a_ruled_out_token_leaves_the_entropy_finite_and_its_gradient_too():
    """A logit of -inf (a token the model rules out) has probability 0 and adds nothing to
    the entropy: the value and gradient are those of the other tokens alone, not NaN."""
    gen = torch.Generator().manual_seed(4)
    finite = torch.randn(2, 3, 6, generator=gen)
    logits = torch.cat([finite, torch.full((2, 3, 2), -math.inf)], -1).requires_grad_()
    ids = torch.randint(0, 6, (2, 3), generator=gen)
    lp, ent = token_logprobs_from_logits(logits, ids, 0.7, with_entropy=True)
    ent.sum().backward()
    ref = finite.clone().requires_grad_()
    ref_ent = _full_entropy(ref / 0.7)
    ref_ent.sum().backward()
    ref_lp = torch.log_softmax(finite / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.allclose(lp, ref_lp, atol=1e-6) and torch.allclose(ent, ref_ent, atol=1e-6)
    assert torch.allclose(logits.grad[..., :6], ref.grad, atol=1e-6)
    assert torch.equal(logits.grad[..., 6:], torch.zeros(2, 3, 2))


def test_a_metric_entropy_is_the_same_values_once_and_without_a_graph(monkeypatch):
    """with_entropy="metric" (the entropy only logged): the log-probs, their gradients
    and the entropies of with_entropy=True, bitwise; the entropies carry no graph and
    each chunk computes them once, in the forward, not again when backward recomputes
    the checkpointed chunk (True computes them twice per chunk)."""
    import gspo.models.logprobs as logprobs_module

    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 7, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    ids = torch.randint(0, 50, (3, 7), generator=gen)
    up = torch.randn(3, 7, generator=gen)
    real, calls = logprobs_module._entropy, []

    def counted(*args):
        calls.append(torch.is_grad_enabled())
        return real(*args)

    monkeypatch.setattr(logprobs_module, "_entropy", counted)
    runs = {}
    for mode in (True, "metric"):
        calls.clear()
        lp, ent = logprobs_from_hidden(hidden, weight, ids, 0.7, 8, with_entropy=mode)
        (lp * up).sum().backward()
        runs[mode] = (lp, ent, hidden.grad.clone(), weight.grad.clone(), list(calls))
        hidden.grad = weight.grad = None
    chunks = 3  # 21 tokens in chunks of 8
    assert runs[True][4] == [True] * 2 * chunks and runs["metric"][4] == [False] * chunks
    assert runs[True][1].requires_grad and not runs["metric"][1].requires_grad
    for a, b in zip(runs[True][:4], runs["metric"][:4], strict=True):
        assert torch.equal(a.detach(), b.detach())


def test_packed_entropy_equals_the_padded_forward(tokenizer, tiny_model):
    gen = torch.Generator().manual_seed(4)
    n, p, t = 4, 5, 6
    prompt = torch.randint(4, 60, (n, p), generator=gen)
    prompt_mask = torch.ones(n, p, dtype=torch.long)
    completion = torch.randint(4, 60, (n, t), generator=gen)
    completion_mask = torch.arange(t)[None, :] < torch.tensor([6, 2, 0, 4])[:, None]
    lp, ent = completion_logprobs(
        tiny_model, prompt, prompt_mask, completion, completion_mask,
        temperature=0.9, with_entropy=True,
    )  # fmt: skip
    ids = torch.cat([prompt, completion], 1)
    mask = torch.cat([prompt_mask, completion_mask.long()], 1)
    logits = tiny_model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits[:, p - 1 : -1]
    ref_ent = _full_entropy(logits / 0.9) * completion_mask
    assert torch.allclose(ent, ref_ent, atol=1e-4)
    assert (ent[~completion_mask] == 0).all() and (ent[completion_mask] > 0).all()
    ref_lp, ref_ent2 = token_logprobs_from_logits(logits, completion, 0.9, with_entropy=True)
    assert torch.allclose(lp, ref_lp * completion_mask, atol=1e-5)
    assert torch.allclose(ref_ent2 * completion_mask, ref_ent, atol=1e-5)


def test_auto_layout_shares_long_prompts_and_not_long_completions(tokenizer, tiny_model):
    """``share_prompts="auto"`` takes the layout :func:`layout_cost` finds cheaper; values
    and gradients equal the padded forward's either way."""
    from gspo.models import layout_cost

    gen = torch.Generator().manual_seed(5)
    fed: list[int] = []
    hook = tiny_model.model.embed_tokens.register_forward_hook(
        lambda module, inputs, output: fed.append(int(inputs[0].numel()))
    )
    try:
        for p, t in ((60, 3), (3, 60)):  # long prompt + short completions, and the reverse
            prompt = torch.randint(4, 60, (1, p), generator=gen).repeat(4, 1)
            completion = torch.randint(4, 60, (4, t), generator=gen)
            ones = torch.ones_like
            args = (tiny_model, prompt, ones(prompt), completion, ones(completion))
            fed.clear()
            auto = packed_completion_logprobs(*args, share_prompts="auto")
            packed_completion_logprobs(*args, share_prompts=True)
            packed_completion_logprobs(*args, share_prompts=False)
            shared, alone = fed[1], fed[2]
            assert fed[0] == (shared if p > t else alone)
            ref = completion_logprobs(tiny_model, *args[1:])
            assert torch.allclose(auto, ref, atol=1e-5)
            weight = tiny_model.model.embed_tokens.weight
            g_auto = torch.autograd.grad(auto.sum(), weight)[0]
            g_ref = torch.autograd.grad(ref.sum(), weight)[0]
            assert torch.allclose(g_auto, g_ref, atol=1e-4)
    finally:
        hook.remove()
    config = tiny_model.config

    assert layout_cost(config, [600]) > layout_cost(config, [150] * 4)  # attention: quadratic
    assert layout_cost(config, [60 + 4 * 3]) < layout_cost(config, [128] * 2)


def test_a_model_directory_without_a_tokenizer_is_one_line(tmp_path, tokenizer, tiny_model):
    """transformers built an empty tokenizer for it, and every prompt encoded to nothing."""
    tiny_model.save_pretrained(tmp_path / "m")
    with pytest.raises(FileNotFoundError, match=r"model.path: .*/m has no tokenizer \(none of"):
        load_model(tmp_path / "m", device=CPU, dtype=torch.float32)
    tokenizer.save_pretrained(tmp_path / "m")
    _, loaded = load_model(tmp_path / "m", device=CPU, dtype=torch.float32)
    assert loaded("12+3=")["input_ids"] == tokenizer("12+3=")["input_ids"]


def test_dropout_is_switched_off_so_training_mode_computes_the_samplers_probabilities(tokenizer):
    """GPT-2's configs carry dropout 0.1: in the update's training-mode forward it made the
    on-policy ratios 0.13-0.23 off 1 in log space (70% of sequences clipped, silently)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen3Config, Qwen3ForCausalLM

    from gspo.models import disable_dropout

    small = {"vocab_size": len(tokenizer), "n_embd": 32, "n_layer": 1, "n_head": 2}
    gpt2 = GPT2LMHeadModel(GPT2Config(**small, n_positions=64))  # dropout 0.1 throughout
    qwen = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, attention_dropout=0.3, attn_implementation="eager")
    )  # fmt: skip
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    for model, rate in ((gpt2, 0.1), (qwen, 0.3)):
        model.train()
        torch.manual_seed(0)
        with torch.no_grad():
            assert not torch.equal(model(ids).logits, model.eval()(ids).logits)
        assert disable_dropout(model) == {"dropout": pytest.approx(rate)}
        with torch.no_grad():
            assert torch.equal(model.train()(ids).logits, model.eval()(ids).logits)
        assert disable_dropout(model) == {}  # nothing left to switch off
    assert gpt2.config.attn_pdrop == 0.1  # config.json (an export) keeps the model's own


def test_moe_router_jitter_is_switched_off_like_dropout(tokenizer):
    """Mixtral's router_jitter_noise rescales the hidden states in training mode: 0.1
    clipped 43% of the on-policy tokens, recompute or not (the MoE audit's probe)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from gspo.models import disable_dropout

    mixtral = MixtralForCausalLM(
        MixtralConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1)
    )  # fmt: skip
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    mixtral.train()
    torch.manual_seed(0)
    with torch.no_grad():
        assert not torch.equal(mixtral(ids).logits, mixtral.eval()(ids).logits)
    assert disable_dropout(mixtral) == {"router jitter": pytest.approx(0.1)}
    with torch.no_grad():
        assert torch.equal(mixtral.train()(ids).logits, mixtral.eval()(ids).logits)
    # PhiMoE's router_jitter_noise is its routing's threshold, in eval mode too: kept
    from transformers import PhimoeConfig, PhimoeForCausalLM

    phimoe = PhimoeForCausalLM(
        PhimoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.01,
                     input_jitter_noise=0.0)
    ).eval()  # fmt: skip
    with torch.no_grad():
        before = phimoe(ids).logits
        assert disable_dropout(phimoe) == {
            "expert sampling within router_jitter_noise": pytest.approx(0.01)
        }  # (its training mode's sampling is off: the next test)
        assert torch.equal(phimoe(ids).logits, before)
        assert phimoe.config.router_jitter_noise == 0.01


def test_phimoe_routers_route_as_at_inference_in_training_mode(tokenizer):
    """PhiMoE's sparsemixer draws each token's experts (Gumbel) among those within
    router_jitter_noise of the best in training mode, and scales a drawn one's gate by 1/3
    at random: the update's forward ran other experts than the sampler's and the on-policy
    ratios were off 1 (the MoE audit: 2% of a tiny model's token-layers at 0.01)."""
    import copy

    from transformers import PhimoeConfig, PhimoeForCausalLM

    from gspo.models import disable_dropout

    torch.manual_seed(0)
    phimoe = PhimoeForCausalLM(
        PhimoeConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.5,
                     input_jitter_noise=0.0)
    )  # fmt: skip
    ids = torch.tensor([tokenizer("12+34=46")["input_ids"]])
    with torch.no_grad():
        inference = phimoe.eval()(ids).logits
        assert not torch.equal(phimoe.train()(ids).logits, inference)
    assert disable_dropout(phimoe) == {
        "expert sampling within router_jitter_noise": pytest.approx(0.5)
    }
    assert disable_dropout(phimoe) == {}  # nothing left to switch off
    for model in (phimoe, copy.deepcopy(phimoe)):  # (async rollouts copy the policy)
        model.train()
        router = model.model.layers[0].mlp.router
        assert model.training and model.model.layers[0].mlp.training and not router.training
        model(ids).logits.sum().backward()  # the router still learns: the gate's gradient
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        with torch.no_grad():
            assert torch.equal(model(ids).logits, inference)
    assert phimoe.config.router_jitter_noise == 0.5  # config.json (an export) keeps it


def test_model_context_tells_a_learned_position_table_from_rotary_positions(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    from gspo.models import model_context

    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=40)
    )
    assert model_context(gpt2) == (40, True)
    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    qwen = build_tiny_model(spec, tokenizer, seed=0)
    assert model_context(qwen) == (qwen.config.max_position_embeddings, False)


def test_cold_start_rows_past_a_learned_position_table_are_cut_there(tmp_path, capsys):
    """A GPT-2 of 40 positions and a cold-start row of 65 tokens: an IndexError in the
    cold start before; now the row is cut at 40, said once, and a prompt with no room
    left for its completion is one line naming the row."""
    import json

    from transformers import GPT2Config, GPT2LMHeadModel

    from gspo.config import load_config
    from gspo.models import build_char_tokenizer
    from gspo.trainer import Trainer

    tokenizer = build_char_tokenizer()
    gpt2 = GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=40)
    )
    save_pretrained_atomic(gpt2, tokenizer, tmp_path / "m")
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    sft = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "1+1=", "completion": "2" * 60}]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft))
    overrides = [
        f"model.path={tmp_path / 'm'}", "model.device=cpu", "train.max_steps=0",
        f"data.train={tmp_path / 'train.jsonl'}", f"data.eval={tmp_path / 'train.jsonl'}",
        f"data.sft={tmp_path / 'sft.jsonl'}", "train.cold_start_steps=4",
        "train.cold_start_batch_size=4", "rollout.max_new_tokens=4", "log.progress=false",
        "log.plots=false", "log.tensorboard=false", "eval.samples=1",
    ]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run").fit()
    said = [line for line in capsys.readouterr().err.splitlines() if "data.sft" in line]
    assert said == [
        f"gspo: warning: data.sft ({tmp_path / 'sft.jsonl'}): 1 row(s) (the longest 65 tokens) "
        "run past the model's "
        "context of 40 (max_position_embeddings): cut there, so their completions lose "
        "their end (EOS included)"
    ]
    sft[1] = {"prompt": "1" * 40, "completion": "2"}
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in sft))
    with pytest.raises(ValueError, match=r"^data.sft \(.*sft.jsonl\) row 2: the prompt is 40 tok"):
        Trainer(load_config(None, overrides), tmp_path / "again").fit()


def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_is_saved_without_one(tmp_path):
    """gspo pads with EOS where a tokenizer has no pad token; its checkpoints and exports
    saved that stand-in (pad = EOS: common SFT collators then mask every EOS label)."""
    from transformers import AutoTokenizer

    from gspo.models import build_char_tokenizer

    tokenizer = build_char_tokenizer()  # its own: the fixture is the session's, shared
    model = build_tiny_model(TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1,
                                           intermediate=64), tokenizer, seed=0)  # fmt: skip
    tokenizer.pad_token = None
    save_pretrained_atomic(model, tokenizer, tmp_path / "m")
    model, loaded = load_model(tmp_path / "m", device=torch.device("cpu"), dtype=torch.float32)
    assert loaded.pad_token_id == loaded.eos_token_id is not None
    save_pretrained_atomic(model, loaded, tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").pad_token is None
    assert loaded.pad_token_id == loaded.eos_token_id  # the run's own still pads with EOS


def test_a_tokenizer_without_eos_is_one_line_before_a_cold_start(tmp_path):
    """The cold start ends each completion with EOS: it failed inside with "'NoneType'
    object cannot be interpreted as an integer"."""
    from gspo.config import load_config
    from gspo.models import build_char_tokenizer
    from gspo.trainer import Trainer

    tokenizer = build_char_tokenizer()  # its own: the fixture is the session's, shared

    spec = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    model = build_tiny_model(spec, tokenizer, seed=0)
    tokenizer.eos_token = None  # (a pad kept: with neither, the load says so first)
    save_pretrained_atomic(model, tokenizer, tmp_path / "m")
    overrides = [f"model.path={tmp_path / 'm'}", "model.device=cpu", "data.eval_size=8"]
    with pytest.raises(ValueError, match=r"^model.path: the tokenizer of .*/m has no eos token"):
        Trainer(load_config(None, overrides), tmp_path / "run")


def test_a_hub_id_or_a_run_as_model_path_says_what_to_give(tmp_path, monkeypatch):
    """Both said only that the path was no (HF model) directory: a TRL user's hub id, a
    run's own directory."""
    from gspo.models import load_model

    monkeypatch.chdir(tmp_path)
    cpu = torch.device("cpu")
    with pytest.raises(FileNotFoundError) as err:
        load_model("Qwen/Qwen3-0.6B", device=cpu, dtype=torch.float32)
    assert str(err.value) == (
        "model.path: Qwen/Qwen3-0.6B is not a directory; gspo reads local model directories "
        "only (nothing is downloaded during a run): download it first (hf download "
        "Qwen/Qwen3-0.6B --local-dir DIR), then model.path=DIR"
    )
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(FileNotFoundError, match=r"is a gspo run, not a model: name one of its"):
        load_model(run, device=cpu, dtype=torch.float32)


def test_auto_dtype_is_bf16_on_cuda_but_for_the_built_in_model():
    """``model.dtype=auto``: bf16 on CUDA for a model of one's own; float32 on the CPU, and
    for the built-in model everywhere (a few million parameters: bf16 only cost the demo
    accuracy); a dtype named is taken as it is."""
    from gspo.models import resolve_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("auto", cuda, builtin=True) == torch.float32
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cuda, builtin=True) == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
