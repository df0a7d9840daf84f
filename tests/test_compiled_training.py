"""``model.compile``: the policy's transformer blocks through ``torch.compile`` for the
training forwards (the update's, pi_old's recompute, the cold start's). The loss and the
gradients are those of the uncompiled blocks to float32 rounding; generation is the fast
decoder's, which does not call the blocks; what cannot take it is a one-line error."""

from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
from conftest import CPU
from test_activation_checkpointing import (
    ON as CHECKPOINTING,
)
from test_activation_checkpointing import (
    build_policy,
    fixed_batch,
    one_update,
    perturb_adapters,
)
from test_compiled_decode import needs_cxx
from test_trainer import FAST

from gspo.cli import main
from gspo.config import load_config
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer
from gspo.training.blocks import compile_blocks

#: (on a torch before 2.6, which pyproject allows, model.compile is a one-line error)
pytestmark = pytest.mark.skipif(
    not hasattr(torch.compiler, "set_stance"), reason="model.compile needs torch 2.6 or newer"
)

ON = "model.compile=true"
#: (on the CPU the blocks compile with torch's linear layers, not oneDNN's: refused below)
TORCH_LINEAR = "model.cpu_linear=torch"
VARIANTS = {
    "full": [TORCH_LINEAR],
    "lora": [TORCH_LINEAR, "model.lora.r=4"],
    "checkpointing": [TORCH_LINEAR, CHECKPOINTING],
}


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["frames"]["ok"]


@needs_cxx
@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_blocks_keep_the_loss_and_the_gradients(tmp_path, variant):
    torch._dynamo.reset()
    batch, out = fixed_batch(), []
    for overrides in ([*VARIANTS[variant]], [*VARIANTS[variant], ON]):
        policy = build_policy(tmp_path / str(len(out)), *overrides)
        if "lora" in variant:
            perturb_adapters(policy)
        blocks = policy.module.get_decoder().layers
        before = compiled_frames()
        out.append(one_update(policy, batch))
        compiled = compiled_frames() > before
        assert compiled == (ON in overrides)
        assert all((b._compiled_call_impl is not None) == compiled for b in blocks)
    (loss_off, grads_off, fwd_off, bwd_off), (loss_on, grads_on, fwd_on, bwd_on) = out
    assert (fwd_on, bwd_on) == (fwd_off, bwd_off)  # each block as often, compiled or not
    torch.testing.assert_close(loss_on, loss_off, rtol=0, atol=1e-5)
    assert grads_on.keys() == grads_off.keys()
    for name, grad in grads_off.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def without_and_with_gradients(tmp_path, device: str = CPU):
    """bf16 log-probs of one batch through compiled blocks, without gradients (pi_old
    recomputed) and with them (the update's forward), and through the eager blocks."""
    torch._dynamo.reset()
    at = device.split("=")[1]
    policy = build_policy(tmp_path, TORCH_LINEAR, "model.dtype=bfloat16", ON, device=device)
    batch = fixed_batch(length=24, device=at)
    policy.train()
    with torch.no_grad():
        old = policy.logprobs(batch)
    new = policy.logprobs(batch)
    assert new.requires_grad
    uncompiled = build_policy(
        tmp_path / "eager", TORCH_LINEAR, "model.dtype=bfloat16", device=device
    )
    with torch.no_grad():
        eager = uncompiled.logprobs(batch)
    return old, new.detach(), eager


@needs_cxx
def test_in_bf16_a_forward_with_gradients_and_one_without_agree_to_the_bit(tmp_path):
    """pi_old recomputed without gradients (minibatches after the first: the first's is
    its update's own forward) and the update's forward with them go through different
    compiled graphs; in bf16 they must still agree, or those minibatches' ratios carry the
    two graphs' rounding (GSPO's clip range is 3e-4 on a sequence's mean). On CUDA:
    tests/test_cuda.py."""
    old, new, eager = without_and_with_gradients(tmp_path)
    assert torch.equal(new, old)
    assert not torch.equal(eager, old)  # (the check above is not of eager code)


@needs_cxx
def test_a_run_with_compiled_blocks_trains_as_one_without(tmp_path):
    """Generation, pi_old (recomputed: a no-grad forward through the compiled blocks),
    the KL reference (a LoRA run's: the blocks with the adapters off), the updates and the
    evaluation of a short run: the same rewards and lengths (the fast decoder samples; the
    blocks it does not call), the losses and ratios to float32 rounding, and its forwards
    ran compiled code: few graphs (the blocks share one compiled code, and past dynamo's
    limit of 8 graphs it would run new variants eagerly, unsaid)."""
    overrides = [*FAST, TORCH_LINEAR, "train.cold_start_steps=0", "train.max_steps=3",
                 "algorithm.minibatches=2", "algorithm.old_logprobs=recompute",
                 "model.lora.r=4", "algorithm.kl_coef=0.1",
                 "model.layers=2"]  # fmt: skip
    records = []
    for name, extra in (("off", []), ("on", [ON])):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        Trainer(load_config(None, [*overrides, *extra]), tmp_path / name).fit()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) == (name == "on")
        # with and without gradients, the adapters on and off; not a graph per block
        assert graphs <= 4
        records.append([r for r in read_metrics(tmp_path / name / "metrics.jsonl")])
    off, on = records
    assert len(on) == len(off)
    for a, b in zip(off, on, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if key.startswith(("time", "io/")) or not isinstance(value, int | float):
                continue
            if key.startswith(("train/reward", "train/completion", "eval/")):
                assert b[key] == value, key
            else:
                assert b[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key


@needs_cxx
def test_a_cold_start_through_compiled_blocks_learns_as_one_without(tmp_path, monkeypatch):
    """The cold start (SFT: padded rows of every length) runs the compiled blocks too, in
    one graph (symbolic shapes), and its losses are the uncompiled run's to float32
    rounding."""
    import gspo.trainer

    graphs = []
    cold_start = gspo.trainer.cold_start

    def counted(*args, **kwargs):
        out = cold_start(*args, **kwargs)
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        return out

    monkeypatch.setattr(gspo.trainer, "cold_start", counted)
    overrides = [*FAST, TORCH_LINEAR, "train.cold_start_steps=20", "train.cold_start_cache=false",
                 "train.max_steps=1", "algorithm.minibatches=1", "model.layers=2",
                 "eval.every=0"]  # fmt: skip
    losses = []
    for name, extra in (("off", []), ("on", [ON])):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        Trainer(load_config(None, [*overrides, *extra]), tmp_path / name).fit()
        records = read_metrics(tmp_path / name / "metrics.jsonl")
        losses.append([r["sft/loss"] for r in records if "sft/loss" in r])
    assert graphs == [0, 1]
    assert len(losses[1]) == len(losses[0]) >= 1
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def test_a_mixture_of_experts_model_is_a_one_line_error(tmp_path, capsys):
    moe = ["model.builtin=qwen3_moe", "model.experts=4", "model.expert_intermediate=32"]
    code = main(["train", "--output-dir", str(tmp_path / "run"), *FAST, TORCH_LINEAR, *moe, ON])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith("gspo: error: model.compile: Qwen3MoeForCausalLM is a mixture-of-")


def test_onednn_on_the_cpu_is_a_one_line_error(tmp_path, capsys):
    from gspo.models.kernels import onednn_available

    if not onednn_available():
        pytest.skip("this torch has no oneDNN: its linear layers are torch's already")
    onednn = "model.cpu_linear=onednn"  # (auto: torch's on an Intel CPU)
    code = main(["train", "--output-dir", str(tmp_path / "run"), *FAST, ON, onednn])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        "gspo: error: model.compile: on the CPU it needs model.cpu_linear=torch (inductor "
        "cannot compile oneDNN's linear layers, the default on CPUs not Intel's)"
    )


def test_several_ranks_and_models_the_fast_decoder_does_not_run_are_refused(
    tiny_model, monkeypatch
):
    with pytest.raises(ValueError, match=r"^model.compile: one process only for now"):
        compile_blocks(tiny_model, SimpleNamespace(world_size=2))
    tiny_model.config._attn_implementation = "flex_attention"  # (not one it reimplements)
    with pytest.raises(ValueError, match=r"fast decoder does not run Qwen3ForCausalLM"):
        compile_blocks(tiny_model, SimpleNamespace(world_size=1))
    monkeypatch.delattr(torch.compiler, "set_stance")  # (a torch before 2.6)
    with pytest.raises(ValueError, match=r"^model.compile needs torch 2.6 or newer \(this is "):
        compile_blocks(tiny_model, SimpleNamespace(world_size=1))
    assert all(b._compiled_call_impl is None for b in tiny_model.get_decoder().layers)


@needs_cxx
def test_async_rollouts_are_refused_and_the_prefill_runs_the_blocks_eagerly(tokenizer, tiny_model):
    """The sampler's prefill runs the blocks eagerly (torch's compile stance, which is
    process-wide: an async producer's prefill would switch the trainer's forwards to
    eager meanwhile, so model.compile refuses rollout.max_staleness > 0)."""
    from gspo.config import ConfigError
    from gspo.engines import SamplingParams, TorchEngine

    with pytest.raises(ConfigError, match=r"^model.compile needs rollout.max_staleness=0"):
        load_config(None, [ON, "rollout.max_staleness=1"])
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "5+6=")]
    # uncompiled blocks: the stance is left alone (an async producer's prefill beside the
    # main thread's would otherwise leave it at force_eager: its save/restore is not safe
    # across threads)
    stance = torch.compiler.set_stance
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.compiler, "set_stance", lambda *a, **k: pytest.fail("switched"))
        TorchEngine(tiny_model, **ids).generate(prompts, n=2, params=SamplingParams(6), seed=0)
    assert torch.compiler.set_stance is stance
    torch._dynamo.reset()
    compile_blocks(tiny_model, SimpleNamespace(world_size=1))
    before = compiled_frames()
    TorchEngine(tiny_model, **ids).generate(prompts, n=2, params=SamplingParams(6), seed=0)
    assert compiled_frames() == before  # nothing compiled for the sampler
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([prompts[0]]))
    assert compiled_frames() > before  # (the blocks are compiled for a forward)
