"""The static-shape decode step (gspo.engines.static_decode, ``rollout.cuda_graphs``) on the
CPU, where it runs eagerly: the same tokens as the per-step loop for a seed, log-probs of
the trainer's forward. The captured CUDA graphs are checked in tests/test_cuda.py."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gspo.engines.static_decode as static_decode
import gspo.engines.torch_engine as torch_engine
from gspo.engines import SamplingParams, TorchEngine
from gspo.engines.decoding import KVDecoder, ModelDecoder, make_decoder
from gspo.engines.static_decode import StaticDecoder, buckets, capturable
from gspo.models import TinyModelSpec, build_tiny_model, completion_logprobs

#: different lengths (left padding in the prompt batch)
TEXTS = ("12+34=", "5+6=", "123+456=", "7=")


def encode(tokenizer, texts=TEXTS):
    return [tokenizer(t)["input_ids"] for t in texts]


def ids(tokenizer):
    return dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)


def eos_likely(model, tokenizer, scale: float = 8.0) -> None:
    """EOS's head row scaled up (and the final norm sharpened): rows finish at many
    different steps, so the batch shrinks through several buckets."""
    with torch.no_grad():
        model.model.norm.weight.mul_(3.0)
        model.lm_head.weight[tokenizer.eos_token_id] *= scale  # tied with the embedding


class Spy:
    """Which (batch, span) shapes the static step ran at and which compactions it made."""

    def __init__(self, monkeypatch):
        self.shapes: list[tuple[int, int]] = []
        self.compactions: list[tuple[int, int]] = []
        advance, compact = StaticDecoder.advance, StaticDecoder.compact

        def spy_advance(decoder, batch, span):
            self.shapes.append((batch, span))
            advance(decoder, batch, span)

        def spy_compact(decoder, batch, bucket):
            self.compactions.append((batch, bucket))
            compact(decoder, batch, bucket)

        monkeypatch.setattr(StaticDecoder, "advance", spy_advance)
        monkeypatch.setattr(StaticDecoder, "compact", spy_compact)


def test_buckets_are_the_batch_then_powers_of_two_below_it():
    assert buckets(20) == [20, 16, 8, 4, 2, 1]
    assert buckets(16) == [16, 8, 4, 2, 1]
    assert buckets(3) == [3, 2, 1]
    assert buckets(1) == [1]


@pytest.mark.parametrize("attention", ["products", "sdpa", "sdpa, key spans"])
@pytest.mark.parametrize(
    "temperature,top_p,noise", [(1.0, 1.0, 0.0), (0.7, 0.9, 0.0), (1.0, 1.0, 0.5), (0.0, 1.0, 0.0)]
)
def test_static_step_samples_what_the_loop_samples(
    tokenizer, tiny_model, monkeypatch, attention, temperature, top_p, noise
):
    """Same seed -> the same tokens as the per-step loop of the fast decoder, log-probs
    within 1e-5 (attention over zero-filled, masked columns sums in another order), on a
    padded prompt batch whose rows finish at different steps; the batch moves down
    through several buckets and the attention span grows (a chunk of 8 columns here).
    ``key spans``: the loop's SDPA over spans of 5 columns (``KVDecoder.key_span``, CUDA's
    way), whose mask the static step must not take past the prompts."""
    monkeypatch.setattr(torch_engine, "CHECK_EVERY", 3)
    monkeypatch.setattr(static_decode, "SPAN_CHUNK", 8)
    monkeypatch.setattr(KVDecoder, "attention", attention.split(",")[0])
    monkeypatch.setattr(KVDecoder, "key_span", 5 if "spans" in attention else None)
    eos_likely(tiny_model, tokenizer)
    params = SamplingParams(32, temperature=temperature, top_p=top_p, logit_noise=noise)
    loop = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=False)
    static = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=True)
    spy = Spy(monkeypatch)
    a = loop.generate(encode(tokenizer), n=8, params=params, seed=3)
    assert not spy.shapes  # the loop never took the static step
    b = static.generate(encode(tokenizer), n=8, params=params, seed=3)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask)
    assert a.finish_reasons == b.finish_reasons
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-5
    assert len({span for _, span in spy.shapes}) >= 3
    if temperature > 0:
        assert len(set(b.completion_lengths.tolist())) > 5  # rows finished at many steps
        assert len(spy.compactions) >= 2, spy.compactions  # 32 -> 16 -> 8 at least
        assert all(bucket in buckets(32) for _, bucket in spy.compactions)
    if noise == 0:  # the sampler's log-probs are the trainer's
        with torch.no_grad():
            lp = completion_logprobs(
                tiny_model, b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask,
                temperature=temperature or 1.0,
            )  # fmt: skip
        assert (lp - b.sampler_logprobs).abs()[b.completion_mask].max() < 1e-5


@pytest.mark.parametrize("kernel", [None, "sdpa", "efficient"])
def test_the_loop_and_the_static_step_ask_attention_for_their_own_kernels(
    tokenizer, tiny_model, monkeypatch, kernel
):
    """``KVDecoder.sdpa_kernel`` None: the loop asks ``attend`` for ``LOOP_SDPA_KERNEL``
    (one switch for the loop alone), the static step for torch's pick (None); a kernel set
    is what both ask for. On the CPU every kernel is SDPA, so the tokens are the same
    whatever is asked."""
    import gspo.engines.decoding as decoding

    monkeypatch.setattr(KVDecoder, "attention", "sdpa")
    monkeypatch.setattr(KVDecoder, "sdpa_kernel", kernel)
    asked: dict[str, set] = {"loop": set(), "static": set()}
    attend = decoding.attend
    for module, way in ((decoding, "loop"), (static_decode, "static")):

        def spy(*args, way=way):
            asked[way].add(args[-1])
            return attend(*args)

        monkeypatch.setattr(module, "attend", spy)
    params = SamplingParams(12)
    batches = [
        TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=graphs).generate(
            encode(tokenizer), n=2, params=params, seed=1
        )
        for graphs in (False, True)
    ]
    if kernel is None:
        assert asked == {"loop": {decoding.LOOP_SDPA_KERNEL}, "static": {None}}
    else:
        assert asked == {"loop": {kernel}, "static": {kernel}}
    assert torch.equal(batches[0].completion_ids, batches[1].completion_ids)


def test_static_step_drops_nothing_before_its_checks_and_stops_when_all_rows_finish(
    tokenizer, tiny_model, monkeypatch
):
    """Finished rows are read on the host only every CHECK_EVERY steps (the step never
    synchronises): with checks every 5 steps the batch shrinks only at steps 5, 10, ...,
    and the loop ends at the first check that finds no live row."""
    monkeypatch.setattr(torch_engine, "CHECK_EVERY", 5)
    eos_likely(tiny_model, tokenizer, scale=20.0)
    spy = Spy(monkeypatch)
    engine = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=True)
    steps = 60
    batch = engine.generate(encode(tokenizer), n=4, params=SamplingParams(steps), seed=0)
    longest = int(batch.completion_lengths.max())
    assert longest < steps - 5  # every row stopped well before the end...
    assert len(spy.shapes) == -(-longest // 5) * 5 - 1  # ...and so did the loop, at a check
    changes = [j for j in range(1, len(spy.shapes)) if spy.shapes[j][0] != spy.shapes[j - 1][0]]
    assert changes and all((j + 1) % 5 == 0 for j in changes)  # step j + 1 follows check j + 1


def test_engine_takes_the_static_step_only_where_it_is_switched_on(tokenizer, tiny_model):
    """The default (``auto``) on the CPU and ``False`` keep the per-step loop (the CPU
    path is unchanged); ``True``
    takes the eager static step for the fast decoder, never for the reference decoder;
    MoE blocks cannot be captured."""
    cpu = torch.device("cpu")
    fast, reference = make_decoder(tiny_model), ModelDecoder(tiny_model)
    assert isinstance(fast, KVDecoder) and capturable(fast)
    engine = TorchEngine(tiny_model, **ids(tokenizer))
    assert engine.cuda_graphs == "auto" and engine.static_step(fast, cpu) is None
    engine.cuda_graphs = True
    assert engine.static_step(fast, cpu) == "eager"
    assert engine.static_step(reference, cpu) is None
    engine.cuda_graphs = False
    assert engine.static_step(fast, cpu) is None
    spec = TinyModelSpec("qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)
    moe = make_decoder(build_tiny_model(spec, tokenizer, seed=0))
    assert isinstance(moe, KVDecoder) and not capturable(moe)


def test_static_step_runs_moe_blocks_and_lora_adapters_like_the_loop(tokenizer, tiny_model):
    """MoE blocks (the model's own modules) and merged LoRA matrices in the static step:
    the same tokens as the per-step loop."""
    from test_rollout import lora_model

    spec = TinyModelSpec("qwen3_moe", layers=2, hidden=64, heads=2, kv_heads=1, intermediate=128)
    models = [
        build_tiny_model(spec, tokenizer, seed=0),
        lora_model(tiny_model, "all-linear"),
    ]
    params = SamplingParams(16, temperature=0.8)
    for model in models:
        a = TorchEngine(model, **ids(tokenizer), cuda_graphs=False).generate(
            encode(tokenizer), n=3, params=params, seed=1
        )
        b = TorchEngine(model, **ids(tokenizer), cuda_graphs=True).generate(
            encode(tokenizer), n=3, params=params, seed=1
        )
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-5


def test_an_mlp_with_biases_runs_as_its_module_and_is_not_captured(tokenizer):
    """Llama's ``mlp_bias``: the static step computed each dense MLP from its three matrices
    and dropped the biases (other tokens, log-probs 0.46 apart), and ``capturable`` said yes,
    so ``rollout.cuda_graphs=auto`` would have sampled it wrong on CUDA. Such an MLP runs
    as its own module, uncaptured: the loop's tokens and log-probs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=128, mlp_bias=True, **ids(tokenizer),
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).bias.normal_(0, 1.0)  # a trained model's biases
    decoder = make_decoder(model)
    assert isinstance(decoder, KVDecoder) and not capturable(decoder)
    params = SamplingParams(16, temperature=1.0)
    a, b = (
        TorchEngine(model, **ids(tokenizer), cuda_graphs=graphs).generate(
            encode(tokenizer), n=3, params=params, seed=1
        )
        for graphs in (False, True)
    )
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert (a.sampler_logprobs - b.sampler_logprobs).abs().max() < 1e-5
    model.config.mlp_bias = False  # without biases: captured, as before
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.mlp, name).bias = None
    assert capturable(make_decoder(model))


def test_rollout_cuda_graphs_reaches_the_run_s_engine(tmp_path, ones_reward, monkeypatch):
    """``rollout.cuda_graphs`` is the run's torch engine's switch: ``true`` on the CPU
    samples a rollout batch through the static step, and the trainer's recompute agrees
    with its log-probs to float32 rounding."""
    from conftest import CPU

    from gspo.config import load_config
    from gspo.trainer import Trainer

    overrides = [
        CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
        "model.intermediate=128", "data.eval_size=8", "data.sft_size=16",
        "train.cold_start_steps=0", "rollout.group_size=4", "rollout.prompts_per_batch=4",
        "rollout.max_new_tokens=8", "eval.every=0", "log.progress=false", "log.plots=false",
        "log.tensorboard=false", "algorithm.old_logprobs=recompute", ones_reward,
        "rollout.cuda_graphs=true",
    ]  # fmt: skip
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    assert trainer.sampler.engine.cuda_graphs is True
    spy = Spy(monkeypatch)
    experience = trainer.rollout_stage.experience(0)
    assert spy.shapes  # sampled by the static step
    trainer.update_stage.train(experience, 0)  # whose forward is minibatch 0's pi_old
    assert experience.metrics["mismatch/token_abs_max"] < 1e-5


#: prompts of other lengths than TEXTS, as many: the same rows and (in whole span
#: chunks) the same capacity
OTHER_TEXTS = ("9+9=", "40+2=", "1=", "31+11=")


class Reads(TorchDispatchMode):
    """The storages a step's ops read that no earlier op of the step made: what a CUDA
    graph captured from the step holds the addresses of."""

    def __init__(self):
        super().__init__()
        self.read: set[int] = set()
        self.made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.made:
                self.read.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


def step_reads(monkeypatch) -> dict[tuple[int, int], set[int]]:
    """Per (batch, span) shape, every storage the static step read from outside itself."""
    reads: dict[tuple[int, int], set[int]] = {}
    step = StaticDecoder.step

    def recorded(decoder, batch, span):
        with Reads() as mode:
            step(decoder, batch, span)
        reads.setdefault((batch, span), set()).update(mode.read)

    monkeypatch.setattr(StaticDecoder, "step", recorded)
    return reads


@pytest.mark.parametrize(
    "kind", ["float32", "bfloat16", "bfloat16_bf16_weight_head", "lora", "lora_bfloat16"]
)
def test_the_next_generation_reuses_the_static_step_s_buffers_and_weights_in_place(
    tokenizer, tiny_model, monkeypatch, kind
):
    """rollout.cuda_graphs captures the static step once per shape for the whole run: the
    engine keeps its buffers, and at the next generation of the same shapes (the next
    rollout batch, after an optimizer step moved the weights) writes the new weights and
    prompts into them in place. Checked on the CPU as a captured graph would see it: the
    steps of the second generation read exactly the storages the first one's read (a
    graph replays on those addresses), and sample what a fresh engine samples from the
    moved weights; the first batch handed out stays as it was. Other shapes start anew."""
    from contextlib import nullcontext

    from test_rollout import lora_model

    monkeypatch.setattr(torch_engine, "CHECK_EVERY", 3)
    monkeypatch.setattr(static_decode, "SPAN_CHUNK", 16)
    eos_likely(tiny_model, tokenizer)
    model = lora_model(tiny_model, "all-linear") if "lora" in kind else tiny_model
    dtype = nullcontext()
    if "bfloat16" in kind:  # LoRA: adapters beside the bf16 matrices
        dtype = torch.autocast("cpu", dtype=torch.bfloat16)
    if "bf16_weight" in kind:  # the head's weight kept as a bf16 copy (CUDA's default)
        from gspo.models.kernels import set_linear_kernel

        set_linear_kernel(model, "torch", "bf16_weight")
    params = SamplingParams(40, temperature=0.9)
    engine = TorchEngine(model, **ids(tokenizer), cuda_graphs=True)
    reads = step_reads(monkeypatch)
    with dtype:
        first = engine.generate(encode(tokenizer), n=4, params=params, seed=1)
    run, handed_out = engine.static, first.completion_ids.clone()
    before = {shape: set(r) for shape, r in reads.items()}
    reads.clear()
    with torch.no_grad():  # an optimizer step: the weights move in place
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    prompts = encode(tokenizer, OTHER_TEXTS)
    with dtype:
        second = engine.generate(prompts, n=4, params=params, seed=2)
    after = {shape: set(r) for shape, r in reads.items()}
    with dtype:
        fresh = TorchEngine(model, **ids(tokenizer), cuda_graphs=True).generate(
            prompts, n=4, params=params, seed=2
        )
    assert engine.static is run  # the same buffers (and graphs, on CUDA)
    common = set(before) & set(after)
    assert len(common) >= 3, (before.keys(), after.keys())  # several buckets and spans
    for shape in common:
        assert after[shape] == before[shape], shape
    assert torch.equal(second.completion_ids, fresh.completion_ids)
    assert torch.equal(second.sampler_logprobs, fresh.sampler_logprobs)
    assert not torch.equal(second.completion_ids[:, :8], first.completion_ids[:, :8])
    assert torch.equal(first.completion_ids, handed_out)
    with dtype:  # other shapes (rows): new buffers
        engine.generate(prompts, n=2, params=params, seed=3)
    assert engine.static is not run
    # keep_buffers=False (a multi-turn episode's later turn): the same samples, and the
    # buffers freed at the end, the kept ones of other shapes first
    once = replace(params, keep_buffers=False)
    assert once == params
    with dtype:
        third = engine.generate(prompts, n=4, params=once, seed=2)
    assert engine.static is None
    assert torch.equal(third.completion_ids, fresh.completion_ids)
    assert torch.equal(third.sampler_logprobs, fresh.sampler_logprobs)


class Made(TorchDispatchMode):
    """The shapes of the new tensors (not views or in-place results) of ``dtype`` made."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype, self.shapes = dtype, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
               if isinstance(t, torch.Tensor)}  # fmt: skip
        for t in tree_leaves(out):
            fresh = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins
            if fresh and t.dtype == self.dtype:
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "lora", "lora_bfloat16"])
def test_the_next_generation_casts_its_weights_straight_into_the_static_step_s(
    tokenizer, tiny_model, monkeypatch, kind
):
    """At the next generation no second decoder is built and no copy of the weights in the
    compute dtype is made beside the static step's (a 7B model's bf16 copy is 14 GB): the
    moved weights are cast (or merged) into the static step's own matrices, which keep
    their addresses, and it samples the loop's tokens from the moved weights. (Float32
    LoRA merges each layer's matrices, transient, before writing them in.)"""
    from contextlib import nullcontext

    from test_rollout import lora_model

    monkeypatch.setattr(static_decode, "SPAN_CHUNK", 16)
    model = lora_model(tiny_model, "all-linear") if "lora" in kind else tiny_model
    bf16 = "bfloat16" in kind
    dtype = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    params = SamplingParams(24, temperature=0.9)
    engine = TorchEngine(model, **ids(tokenizer), cuda_graphs=True)
    with dtype:
        engine.generate(encode(tokenizer), n=4, params=params, seed=1)
    run = engine.static
    weights = [t for t in run.decoder.tensors() + [w for m in run.mlps for w in m] if t is not None]
    layers = run.decoder.layers
    matrices = {tuple(t.shape) for x in layers for t in (x.qkv, x.o)}
    matrices |= {tuple(t.shape) for m in run.mlps for t in m}
    addresses = [t.data_ptr() for t in weights]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02)
    built = []
    monkeypatch.setattr(
        torch_engine, "make_decoder", lambda m, **kw: built.append(m) or make_decoder(m, **kw)
    )
    reuse, made = StaticDecoder.reuse, Made(torch.bfloat16 if bf16 else torch.float32)

    def watched(self, *args, **kwargs):
        with made:
            return reuse(self, *args, **kwargs)

    monkeypatch.setattr(StaticDecoder, "reuse", watched)
    with dtype:
        second = engine.generate(encode(tokenizer, OTHER_TEXTS), n=4, params=params, seed=2)
    assert engine.static is run and not built
    assert [t.data_ptr() for t in weights] == addresses
    copies = [shape for shape in made.shapes if shape in matrices]
    if kind != "lora":  # (float32 LoRA: transient merges, a layer's at a time)
        assert not copies, copies
    with dtype:
        loop = TorchEngine(model, **ids(tokenizer), cuda_graphs=False).generate(
            encode(tokenizer, OTHER_TEXTS), n=4, params=params, seed=2
        )
    assert torch.equal(second.completion_ids, loop.completion_ids)
    assert (second.sampler_logprobs - loop.sampler_logprobs).abs().max() < 1e-2 if bf16 else 1e-5


@pytest.mark.parametrize("graphs", [False, True])
def test_the_prefill_leaves_no_cast_of_the_weights_alive(
    tokenizer, tiny_model, monkeypatch, graphs
):
    """Under bf16 autocast the fast decoder's prefill runs the model's own forward, whose
    casts of every q/k/v/o and MLP weight autocast would keep to the end of the generation
    (the outer autocast's): a second bf16 copy of the weights beside the decoder's (the
    static step's MLPs too). None made in the prefill is alive once it returns."""
    import gc
    import weakref

    vocab = tiny_model.config.vocab_size
    shapes = {
        tuple(m.weight.shape)
        for m in tiny_model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.shape[0] != vocab
    }
    alive: dict[int, bool] = {}

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                bf16 = isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                if bf16 and tuple(t.shape) in shapes:
                    storage = t.untyped_storage()
                    alive[storage.data_ptr()] = True
                    weakref.finalize(storage, alive.pop, storage.data_ptr(), None)
            return out

    prefill, after = KVDecoder.prefill, []

    def watched(self, *args, **kwargs):
        with Casts():
            logits = prefill(self, *args, **kwargs)
        gc.collect()
        after.append(len(alive))
        return logits

    monkeypatch.setattr(KVDecoder, "prefill", watched)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=graphs)
        engine.generate(encode(tokenizer), n=2, params=SamplingParams(8), seed=0)
    assert after == [0]


def test_a_parameter_given_new_storage_is_not_read_at_its_old_address(tokenizer, tiny_model):
    """In float32 the step reads some of the module's own parameters in place (the output
    projections: already in the compute dtype), and a captured graph reads them at their
    address. A parameter whose ``.data`` was replaced is the same object with another
    storage: the next generation builds the static step anew rather than replay graphs
    over the old address, and samples what the loop samples."""
    params = SamplingParams(16, temperature=0.9)
    engine = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=True)
    engine.generate(encode(tokenizer), n=2, params=params, seed=1)
    run = engine.static
    o_proj = tiny_model.model.layers[0].self_attn.o_proj.weight
    assert any(t is o_proj for t, _ in run.addresses)
    engine.generate(encode(tokenizer), n=2, params=params, seed=1)
    assert engine.static is run  # nothing moved: reused
    with torch.no_grad():
        o_proj.data = o_proj.data * 1.5  # the same parameter, a new storage
    again = engine.generate(encode(tokenizer), n=2, params=params, seed=2)
    assert engine.static is not run
    loop = TorchEngine(tiny_model, **ids(tokenizer), cuda_graphs=False)
    expected = loop.generate(encode(tokenizer), n=2, params=params, seed=2)
    assert torch.equal(again.completion_ids, expected.completion_ids)
