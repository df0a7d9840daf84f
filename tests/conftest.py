"""Shared fixtures: a tiny Qwen3 model and the character tokenizer; the device guard."""

from collections.abc import Sequence

import pytest
import torch

import gspo.distributed
from gspo.models import TinyModelSpec, build_char_tokenizer, build_tiny_model

SMALL = TinyModelSpec(layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)

# The override every training run of a test names unless it means CUDA (tests/test_cuda.py):
# the tests assume the CPU and float32 (model.dtype=auto is float32 on the CPU), while
# model.device=auto would take CUDA, and with it bfloat16, on a machine with a GPU.
CPU = "model.device=cpu"


@pytest.fixture(autouse=True)
def device_named(monkeypatch):
    """Every run a test starts in this process names its device: ``model.device=auto``
    fails the test on any machine, so a run that forgets :data:`CPU` fails here on the CPU
    too, not only later on a GPU machine. (All of gspo resolves ``model.device`` through
    :func:`gspo.distributed.rank_device`; runs in subprocesses are checked by
    :func:`device_named_in`.)"""
    resolve = gspo.distributed.resolve_device

    def named(device: str) -> torch.device:
        if device == "auto":
            pytest.fail(
                f"a test run left model.device=auto (CUDA and bf16 on a GPU machine): add "
                f"{CPU} (tests/conftest.py CPU) or model.device=cuda"
            )
        return resolve(device)

    monkeypatch.setattr(gspo.distributed, "resolve_device", named)


def device_named_in(args: Sequence[str]) -> None:
    """The subprocess side of :func:`device_named`: a training command line names
    ``model.device`` unless it resumes a run (whose config.yaml names it)."""
    if "--resume" not in args and not any(a.startswith("model.device=") for a in args):
        pytest.fail(f"a test run in a subprocess leaves model.device=auto: {' '.join(args)}")


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
