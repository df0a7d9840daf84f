"""A CUDA out-of-memory error in any stage of a run ends ``gspo train`` with one line that
names the stage and the settings to lower (src/gspo/training/memory.py); so does running
out (on CUDA or the CPU) while loading the model, naming it, its dtype and device.

No CUDA needed: each test raises the error torch raises on CUDA (``torch.OutOfMemoryError``,
with torch's multi-line message) from inside one stage of a CPU run."""

import pytest
import torch
from test_trainer import FAST  # names model.device=cpu

import gspo.engines
import gspo.training.cold_start
import gspo.training.policy
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


@pytest.mark.parametrize("stage", ["generation", "update"])
def test_oom_with_cuda_graphs_on_names_the_decode_buffers_they_keep(
    tmp_path, capsys, monkeypatch, stage
):
    """rollout.cuda_graphs keeps a rollout batch's KV cache and graphs from one generation
    to the next (through the update too): the line says so where they are on, and only
    there (the other tests run with them off; ``auto`` on the CPU is off)."""
    if stage == "generation":
        oom_when_sampling(monkeypatch, n=4)
    else:
        monkeypatch.setattr(gspo.training.update.PolicyUpdate, "apply", out_of_memory)
    err = error_line(tmp_path, capsys, "rollout.cuda_graphs=true")
    assert err.endswith("; rollout.cuda_graphs (true) keeps the decode step's KV cache and "
                        "graphs between rollout batches: false frees them after each")  # fmt: skip
    # auto on the CPU is the loop, which keeps nothing
    assert "cuda_graphs" not in error_line(tmp_path / "auto", capsys, "rollout.cuda_graphs=auto")


def test_oom_with_activation_checkpointing_on_does_not_advise_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gspo.training.update.PolicyUpdate, "apply", out_of_memory)
    err = error_line(tmp_path, capsys, "model.activation_checkpointing=true")
    assert "in the policy update: raise algorithm.minibatches (2)" in err
    assert "activation_checkpointing" not in err


def test_oom_recomputing_pi_old_names_the_minibatches(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gspo.training.policy, "recompute_per_minibatch", out_of_memory)
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


#: what torch's CPU allocator says (a RuntimeError, not torch.OutOfMemoryError)
CPU_SAYS = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
    "memory: you tried to allocate 274877906944 bytes. Error code 12 (Cannot allocate memory)"
)


def raises(error: BaseException):
    def fail(*args, **kwargs):
        raise error

    return fail


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (torch.OutOfMemoryError(TORCH_SAYS), "CUDA out of memory (tried to allocate 2.00 GiB)"),
        (RuntimeError(CPU_SAYS), "out of CPU memory (tried to allocate 256.00 GiB)"),
        (MemoryError(), "out of CPU memory"),
    ],
    ids=["cuda", "cpu-allocator", "MemoryError"],
)
def test_oom_loading_the_model_names_it_its_dtype_device_and_what_lowers_it(
    tmp_path, capsys, monkeypatch, tiny_model, tokenizer, error, said
):
    from transformers import AutoModelForCausalLM

    from gspo.models import save_pretrained_atomic

    mine = tmp_path / "mymodel"
    save_pretrained_atomic(tiny_model, tokenizer, mine)
    weights = (mine / "model.safetensors").stat().st_size
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", raises(error))
    code = main(["train", "--output-dir", str(tmp_path / "run"), *RUN, f"model.path={mine}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith(
        f"gspo: error: {said} loading the model {mine} (float32 on cpu, "
        f"{weights / 2**20:,.1f} MiB of weight files) (gspo loads a model in float32 whatever "
        "model.dtype, the compute dtype): pick a smaller model (model.path) "
    ), err
    assert "LoRA adapters (model.lora.r > 0)" in err
    assert not (tmp_path / "run").exists()  # a run that got nowhere leaves nothing


def test_oom_moving_the_model_or_building_the_policy_is_one_line_too(tmp_path, capsys, monkeypatch):
    import gspo.trainer

    run = tmp_path / "run"
    monkeypatch.setattr(torch.nn.Module, "to", raises(torch.OutOfMemoryError(TORCH_SAYS)))
    assert main(["train", "--output-dir", str(run), *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "gspo: error: CUDA out of memory (tried to allocate 2.00 GiB) loading the model "
        f"{run / 'base_model'} (float32 on cpu, "
    ), err
    monkeypatch.undo()
    monkeypatch.setattr(gspo.trainer, "Policy", raises(MemoryError()))
    assert main(["train", "--output-dir", str(run), *RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gspo: error: out of CPU memory loading the model {run / 'base_model'}")
    assert "\n" not in err


def test_oom_loading_for_export_is_one_line(tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), *RUN, "train.max_steps=0"]) == 0
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", raises(MemoryError()))
    capsys.readouterr()
    assert main(["export", str(run), "--merge", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gspo: error: out of CPU memory loading the model {run / 'base_model'}")
    assert "\n" not in err, err


def test_other_runtime_errors_loading_are_not_taken_for_oom(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    broken = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", raises(broken))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        main(["train", "--output-dir", str(tmp_path / "run"), *RUN])
