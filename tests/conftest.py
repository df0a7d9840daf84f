"""Shared fixtures: a tiny Qwen3 model and the character tokenizer."""

import pytest
import torch

from gspo.models import TinyModelSpec, build_char_tokenizer, build_tiny_model

SMALL = TinyModelSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)


@pytest.fixture(autouse=True)
def cold_start_cache(tmp_path, monkeypatch):
    """Each test its own cold-start cache (never the user's ~/.cache)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    return tmp_path / "xdg-cache" / "gspo" / "cold-start"


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    torch.manual_seed(0)
    return build_tiny_model(SMALL, tokenizer, seed=0)


ONES_REWARD = '''
def ones(prompts, completions, **kwargs):
    """Dense and trivially learnable: the share of '1' characters in the completion."""
    return [c.count("1") / max(len(c), 1) for c in completions]
'''


@pytest.fixture
def ones_reward(tmp_path):
    """The override ``reward.functions=[<file>:ones]``: a dense, learnable reward."""
    path = tmp_path / "ones.py"
    path.write_text(ONES_REWARD)
    return f"reward.functions=[{path}:ones]"


VARIED_REWARD = '''
def varied(prompts, completions, **kwargs):
    """Never flat in practice (a hash of the characters): every group has advantages."""
    return [sum(ord(ch) for ch in c) % 7 / 7 for c in completions]
'''


@pytest.fixture
def varied_reward(tmp_path):
    """``reward.functions=[<file>:varied]``: rewards that differ within every group, so
    every rollout batch updates the model whatever it samples (not learnable)."""
    path = tmp_path / "varied.py"
    path.write_text(VARIED_REWARD)
    return f"reward.functions=[{path}:varied]"
