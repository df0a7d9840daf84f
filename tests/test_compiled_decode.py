"""``rollout.compile``: the fast decoder's per-layer work through ``torch.compile``
(gspo.engines.compiled), on the CPU (inductor's C++ kernels): the same tokens as the
uncompiled decoder for a seed, in the per-step loop and the static step, log-probs of
the trainer's forward to float32 rounding, no graph break; MoE models and oneDNN's
products are left uncompiled; a dropped compiled decoder is freed at once. Its CUDA
graphs: tests/test_cuda.py."""

import gc
import os
import shutil
import weakref

import pytest
import torch

from gspo.engines import SamplingParams, TorchEngine
from gspo.engines.decoding import KVDecoder, make_decoder
from gspo.models import TinyModelSpec, build_tiny_model, completion_logprobs
from gspo.models.kernels import onednn_available, set_linear_kernel

TEXTS = ("12+34=", "5+6=", "123+456=", "7=")
PLAIN = (KVDecoder.queries_keys_values, KVDecoder.after_attention)

#: inductor writes the CPU's kernels in C++ (``$CXX``, else g++): a machine without a
#: compiler cannot compile them
needs_cxx = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None,
    reason="torch.compile on the CPU needs a C++ compiler",
)


def ids(tokenizer):
    return dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def built(monkeypatch) -> list[KVDecoder]:
    """Every :class:`KVDecoder` made from now on, in order."""
    made: list[KVDecoder] = []
    init = KVDecoder.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(KVDecoder, "__init__", spy)
    return made


@needs_cxx
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["loop", "static-step"])
def test_compiled_layers_sample_what_the_uncompiled_ones_do(
    tokenizer, tiny_model, monkeypatch, cuda_graphs
):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    made = built(monkeypatch)
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    params = SamplingParams(24, temperature=1.0)
    plain = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=cuda_graphs)
    fused = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=cuda_graphs, compile=True)
    a = plain.generate(prompts, n=4, params=params, seed=5)
    assert [d.compiled for d in made] == [False] and made[0].layer_work == PLAIN
    counters.clear()
    b = fused.generate(prompts, n=4, params=params, seed=5)
    assert [d.compiled for d in made] == [False, True]
    assert all(f is not p for f, p in zip(made[1].layer_work, PLAIN, strict=True))
    # dynamo holds compiled code for both (not run uncompiled), made without a graph break
    assert all(_debug_get_cache_entry_list(f.__code__) for f in PLAIN)
    assert not counters["graph_break"]
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-5
    with torch.no_grad():
        lp = completion_logprobs(
            tiny_model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask
        )
    assert (lp - b.sampler_logprobs).abs()[b.completion_mask].max() < 1e-5


def test_a_dropped_compiled_decoder_is_freed_at_once(tiny_model):
    """Its two functions are held unbound: no reference cycle keeps it (and its KV cache)
    alive until a cyclic collection."""
    gc.disable()
    try:
        decoder = make_decoder(tiny_model, compile=True)
        assert decoder.compiled
        gone = weakref.ref(decoder)
        del decoder
        assert gone() is None
    finally:
        gc.enable()


def test_moe_models_and_onednn_products_stay_uncompiled(tokenizer, monkeypatch):
    made = built(monkeypatch)
    spec = TinyModelSpec("qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)
    moe = make_decoder(build_tiny_model(spec, tokenizer, seed=0), compile=True)
    assert isinstance(moe, KVDecoder) and not moe.compiled and moe.layer_work == PLAIN
    if onednn_available():
        spec = TinyModelSpec("qwen3", layers=1, hidden=64, heads=2, kv_heads=1, intermediate=128)
        dense = build_tiny_model(spec, tokenizer, seed=0)
        assert set_linear_kernel(dense, "onednn", "float32") == "onednn"  # (a CPU run's default)
        assert not make_decoder(dense, compile=True).compiled
    assert not any(d.compiled for d in made)


@needs_cxx
def test_rollout_compile_reaches_the_run_s_engines(tmp_path, ones_reward, monkeypatch):
    """``rollout.compile=true`` is the run's torch engine's switch and the async
    producer's: the producer's decoders (over its own copy of the weights) compile."""
    from conftest import CPU

    from gspo.config import load_config
    from gspo.trainer import Trainer

    made = built(monkeypatch)
    overrides = [
        CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
        "model.intermediate=128", "data.eval_size=8", "data.sft_size=16",
        "train.cold_start_steps=0", "rollout.group_size=4", "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=8", "eval.every=1", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", ones_reward, "rollout.compile=true", "train.max_steps=2",
        "algorithm.minibatches=1", "rollout.max_staleness=1", "model.cpu_linear=torch",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    assert trainer.sampler.engine.compile is True
    trainer.fit()
    producer = trainer.rollouts.module
    assert made and all(d.compiled for d in made)
    assert {d.model is producer for d in made} == {True, False}  # the producer's, the main's
