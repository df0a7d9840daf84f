"""Models: built-in tiny model and tokenizer, HF loading, completion log-probs."""

import pytest
import torch

from gspo.models import (
    TinyModelSpec,
    build_tiny_model,
    completion_logprobs,
    load_model,
    save_pretrained_atomic,
    token_logprobs_from_logits,
)

CPU = torch.device("cpu")


def test_char_tokenizer_round_trips_text(tokenizer):
    text = "Q: 12+34=? A: 46"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id not in ids


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
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path / "empty", device=CPU, dtype=torch.float32)


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
