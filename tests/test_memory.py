"""A CUDA out-of-memory error in any stage of a run ends ``gspo train`` with one line that
names the stage and the settings to lower (src/gspo/training/memory.py).

No CUDA needed: each test raises the error torch raises on CUDA (``torch.OutOfMemoryError``,
with torch's multi-line message) from inside one stage of a CPU run."""

import pytest
import torch
from test_trainer import FAST  # names model.device=cpu

import gspo.engines
import gspo.training.cold_start
import gspo.training.forward
import gspo.training.update
from gspo.cli import main

#: what torch says on CUDA (its message runs on over several sentences)
TORCH_SAYS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
    "of which 1.06 GiB is free. Of the allocated memory 75.12 GiB is allocated by PyTorch.\n"
    "See documentation for Memory Management (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
)
RUN = [*FAST, "train.cold_start_steps=0", "train.max_steps=2", "algorithm.minibatches=2"]


def out_of_memory(*args, **kwargs):
    raise torch.OutOfMemoryError(TORCH_SAYS)


def error_line(tmp_path, capsys, *overrides: str) -> str:
    code = main(["train", "--output-dir", str(tmp_path / "run"), *RUN, *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("gspo: error: CUDA out of memory (tried to allocate 2.00 GiB) ")
    assert "GPU 0 has a total capacity" not in err  # torch's detail: GSPO_DEBUG=1 shows it
    return err


def oom_when_sampling(monkeypatch, n: int) -> None:
    """The engine runs out when it samples ``n`` responses per prompt (rollouts sample
    rollout.group_size=4, the evaluation eval.samples=2 and greedy 1)."""
    real = gspo.engines.TorchEngine.generate

    def generate(self, prompts, *, n_=n, **kwargs):
        if kwargs["n"] == n_:
            out_of_memory()
        return real(self, prompts, **kwargs)

    monkeypatch.setattr(gspo.engines.TorchEngine, "generate", generate)


@pytest.mark.parametrize("staleness", [0, 1], ids=["in-step", "producer-thread"])
def test_oom_while_sampling_rollouts_names_the_batch_sizes(
    tmp_path, capsys, monkeypatch, staleness
):
    oom_when_sampling(monkeypatch, n=4)
    err = error_line(tmp_path, capsys, f"rollout.max_staleness={staleness}")
    assert "while sampling rollouts: lower rollout.prompts_per_batch (4), " in err
    assert "rollout.group_size (4) or rollout.max_new_tokens (4)" in err


def test_oom_in_the_evaluation_names_the_batch_sizes_too(tmp_path, capsys, monkeypatch):
    oom_when_sampling(monkeypatch, n=2)
    err = error_line(tmp_path, capsys)
    assert "while sampling the held-out evaluation" in err
    assert "lower rollout.prompts_per_batch (4)" in err


def test_oom_in_the_policy_update_names_the_minibatches(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gspo.training.update.PolicyUpdate, "apply", out_of_memory)
    err = error_line(tmp_path, capsys)
    assert "in the policy update: raise algorithm.minibatches (2)" in err
    assert "lower rollout.max_new_tokens (4)" in err and "model.lora.r" in err
    assert err.endswith("; model.activation_checkpointing=true keeps one transformer block's "
                        "activations instead of all of them")  # fmt: skip


def test_oom_with_activation_checkpointing_on_does_not_advise_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gspo.training.update.PolicyUpdate, "apply", out_of_memory)
    err = error_line(tmp_path, capsys, "model.activation_checkpointing=true")
    assert "in the policy update: raise algorithm.minibatches (2)" in err
    assert "activation_checkpointing" not in err


def test_oom_recomputing_pi_old_names_the_minibatches(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gspo.training.forward, "recompute_per_minibatch", out_of_memory)
    err = error_line(tmp_path, capsys, "algorithm.old_logprobs=recompute")
    assert "while computing the rollout batch's pi_old log-probs: " in err
    assert "raise algorithm.minibatches (2)" in err


def test_oom_in_the_cold_start_names_its_batch_size(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gspo.training.cold_start, "pad_batch", out_of_memory)
    err = error_line(tmp_path, capsys, "train.cold_start_steps=2", "train.cold_start_cache=false")
    assert "in the cold-start SFT: lower train.cold_start_batch_size (16); " in err
    assert err.endswith("model.activation_checkpointing=true keeps one transformer block's "
                        "activations instead of all of them")  # fmt: skip


def test_other_runtime_errors_are_not_taken_for_oom(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(gspo.training.update.PolicyUpdate, "apply", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        main(["train", "--output-dir", str(tmp_path / "run"), *RUN])
