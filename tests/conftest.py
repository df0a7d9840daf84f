"""Shared fixtures: a tiny Qwen3 model and the character tokenizer; the device guard."""

import os
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


def pytest_configure(config):
    """Several pytest-xdist workers (``make test`` from 8 cores up) share the machine's
    cores: each worker's torch takes its share for its threads, and so do its subprocesses
    (``gspo train``, torchrun) through OMP_NUM_THREADS, rather than every worker taking all
    of them (8 workers on 16 cores each ran 16 threads). OMP_NUM_THREADS set by the user
    is left as it is. GSPO_TEST_LOG: see :class:`TestLog`."""
    worker = getattr(config, "workerinput", None)  # (set in an xdist worker only)
    if worker is not None and "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        threads = max(1, (cores or os.cpu_count() or 1) // int(worker["workercount"]))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    # this suite's: taken out of the environment before the workers start, so neither they
    # nor a pytest a test starts write to it (such a pytest given its own log does)
    path = os.environ.pop("GSPO_TEST_LOG", None)
    if path and worker is None:
        config.pluginmanager.register(TestLog(path), "gspo-test-log")


class TestLog:
    """GSPO_TEST_LOG=FILE: each phase of each test (setup, call, teardown) appended to FILE
    as it ends, ``outcome<TAB>seconds<TAB>phase<TAB>test id``, by the process that reports
    (pytest-xdist's controller gets every worker's), so a suite stopped at a time limit
    still says what ran, what failed and what was slow (``benchmarks/gpu_check.py`` reads
    it)."""

    __test__ = False  # not a test class

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report) -> None:
        with open(self.path, "a") as log:
            log.write(f"{report.outcome}\t{report.duration:.2f}\t{report.when}\t{report.nodeid}\n")


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


def recompute(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """The trainer's log-probs of a sampled ``batch``'s completions, without gradients
    (what the sampler's log-probs are checked against)."""
    from gspo.models import completion_logprobs

    with torch.no_grad():
        return completion_logprobs(
            model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
            batch.completion_mask, temperature=temperature,
        )  # fmt: skip


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


@pytest.fixture(params=["bwrap", "rlimits"])
def sandbox_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A code-reward test under bubblewrap (where it works: else skipped, saying why) and
    under the rlimits-only fallback."""
    from gspo.rewards import sandbox

    if request.param == "bwrap" and sandbox.isolation()[0] != "bwrap":
        pytest.skip(sandbox.isolation()[1])
    if request.param == "rlimits":
        monkeypatch.setattr(sandbox, "_bwrap_works", lambda: False)
    assert sandbox.isolation()[0] == request.param
    return request.param
