"""``rollout.compile``: the fast decoder's per-layer work through ``torch.compile``
(gspo.engines.compiled), on the CPU (inductor's C++ kernels): the same tokens as the
uncompiled decoder for a seed, in the per-step loop and the static step, log-probs of
the trainer's forward to float32 rounding; MoE models and oneDNN's products are left
uncompiled. Its CUDA graphs: tests/test_cuda.py."""

import pytest
import torch

from gspo.engines import SamplingParams, TorchEngine, compiled
from gspo.engines.decoding import KVDecoder, make_decoder
from gspo.models import TinyModelSpec, build_tiny_model, completion_logprobs
from gspo.models.kernels import set_linear_kernel

TEXTS = ("12+34=", "5+6=", "123+456=", "7=")


def ids(tokenizer):
    return dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def counting(monkeypatch) -> list[KVDecoder]:
    """The decoders :func:`compiled.compile_layers` compiled, in order."""
    made: list[KVDecoder] = []
    real = compiled.compile_layers

    def spy(decoder):
        made.append(decoder)
        real(decoder)

    monkeypatch.setattr("gspo.engines.decoding.compile_layers", spy)
    return made


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["loop", "static-step"])
def test_compiled_layers_sample_what_the_uncompiled_ones_do(
    tokenizer, tiny_model, monkeypatch, cuda_graphs
):
    made = counting(monkeypatch)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(24, temperature=1.0)
    plain = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=cuda_graphs)
    fused = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=cuda_graphs, compile=True)
    a = plain.generate(prompts, n=4, params=params, seed=5)
    assert not made
    b = fused.generate(prompts, n=4, params=params, seed=5)
    assert len(made) == 1 and made[0].compiled
    # the bound methods are the compiled ones (dynamo's wrapper, not the class's own)
    assert made[0].queries_keys_values.__func__ is not KVDecoder.queries_keys_values
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-5
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask
        )
    assert (lp - b.sampler_logprobs).abs()[b.completion_mask].max() < 1e-5


def test_moe_models_and_onednn_products_stay_uncompiled(tokenizer, monkeypatch):
    made = counting(monkeypatch)
    spec = TinyModelSpec("qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)
    moe = make_decoder(build_tiny_model(spec, tokenizer, seed=0), compile=True)
    assert isinstance(moe, KVDecoder) and not moe.compiled and not made
    assert moe.after_attention.__func__ is KVDecoder.after_attention
    dense = build_tiny_model(TinyModelSpec("qwen3", layers=1, hidden=64, heads=2, kv_heads=1,
                                           intermediate=128), tokenizer, seed=0)  # fmt: skip
    set_linear_kernel(dense, "onednn", "float32")  # (the CPU's default in a run)
    assert not make_decoder(dense, compile=True).compiled and not made


def test_rollout_compile_reaches_the_run_s_engines(tmp_path, ones_reward, monkeypatch):
    """``rollout.compile=true`` is the run's torch engine's switch, and the async
    producer's: both decoders compile."""
    from conftest import CPU

    from gspo.config import load_config
    from gspo.trainer import Trainer

    made = counting(monkeypatch)
    overrides = [
        CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
        "model.intermediate=128", "data.eval_size=8", "data.sft_size=16",
        "train.cold_start_steps=0", "rollout.group_size=4", "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=8", "eval.every=0", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", ones_reward, "rollout.compile=true", "train.max_steps=2",
        "algorithm.minibatches=1", "rollout.max_staleness=1", "model.cpu_linear=torch",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    assert trainer.sampler.engine.compile is True
    trainer.fit()
    assert made and all(d.compiled for d in made)
