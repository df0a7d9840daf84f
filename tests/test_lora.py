"""LoRA (``model.lora``, PEFT): what trains, the reference, sampling, checkpoints, export."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import FAST as TRAINER_FAST

from gspo.cli import main
from gspo.config import ConfigError, load_config
from gspo.engines import SamplingParams, TorchEngine
from gspo.models import load_model
from gspo.models.kernels import linear_kernel, set_linear_kernel
from gspo.telemetry import read_metrics
from gspo.trainer import Trainer
from gspo.training.lora import merged_copy, optimizer_state_bytes, quiet_peft

SAMPLING = SamplingParams(max_new_tokens=4, temperature=1.0)

FAST = [*TRAINER_FAST, "train.cold_start_steps=0", "model.lora.r=4"]  # later keys win


def lora_run(tmp_path: Path, varied_reward: str, *extra: str, name: str = "run") -> Trainer:
    config = load_config(
        None,
        [*FAST, varied_reward, "train.max_steps=4", "algorithm.minibatches=2", "optim.lr=1e-2",
         *extra],
    )  # fmt: skip
    trainer = Trainer(config, tmp_path / name)
    trainer.fit()
    return trainer


def base_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def peft_base_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The policy's frozen base weights under their HF names."""
    base = trainer.policy.module.get_base_model()
    return {
        k.replace(".base_layer.", "."): v for k, v in base.state_dict().items() if "lora_" not in k
    }


def test_lora_trains_only_adapters_and_leaves_the_base_bitwise_unchanged(tmp_path, varied_reward):
    trainer = lora_run(tmp_path, varied_reward)
    module = trainer.policy.module
    trained = [n for n, p in module.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    # the optimizer holds exactly the adapters, and its state is what was logged
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in module.parameters() if p.requires_grad}
    summary = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
                   if "model/trainable_params" in r)  # fmt: skip
    assert summary["model/trainable_params"] == sum(p.numel() for p in module.parameters()
                                                    if p.requires_grad)  # fmt: skip
    assert summary["model/trainable_params"] < 0.2 * summary["model/params"]
    assert summary["optim/state_bytes"] == optimizer_state_bytes(trainer.optimizer)
    # the adapters moved (lora_B starts at zero) ...
    assert any(p.abs().max() > 0 for n, p in module.named_parameters() if "lora_B" in n)
    # ... and the base is bitwise the model the run started from
    saved = base_weights(tmp_path / "run" / "base_model")
    now = peft_base_state(trainer)
    for key, tensor in saved.items():
        assert torch.equal(now[key], tensor), key


def test_lora_reference_is_the_base_with_adapters_off_and_no_second_model(tmp_path, varied_reward):
    trainer = lora_run(tmp_path, varied_reward, "algorithm.kl_coef=0.1")
    assert trainer.reference.module is None  # nothing loaded
    lines = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/kl" in r]
    assert lines and all(r["train/kl"] >= 0 for r in lines)
    assert any(r["train/kl"] > 0 for r in lines)
    base, _ = load_model(tmp_path / "run" / "base_model", device=torch.device("cpu"),
                         dtype=torch.float32)  # fmt: skip
    batch = trainer.sampler.engine.generate([[5, 6, 7], [8, 9]], n=2,
                                            params=SAMPLING, seed=1)  # fmt: skip
    reference = trainer.reference.logprobs(batch)
    expected = trainer.policy.logprobs(batch, base).detach()
    assert torch.allclose(reference, expected, atol=1e-6)
    with torch.no_grad():
        adapted = trainer.policy.logprobs(batch)
    assert (adapted - reference).abs().max() > 1e-4  # the adapters do change the policy


def test_torch_engine_samples_through_the_adapters(tmp_path, varied_reward):
    trainer = lora_run(tmp_path, varied_reward)
    engine = trainer.sampler.engine
    assert isinstance(engine, TorchEngine) and engine.model is trainer.policy.module
    lines = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")
             if r.get("train/minibatch") == 0]  # fmt: skip
    # on-policy minibatches: sampler and trainer log-probs agree at float32 level
    assert lines and all(r["mismatch/token_abs_max"] < 1e-4 for r in lines)


def test_merged_copy_equals_the_adapter_model_and_leaves_it_untouched(tmp_path, varied_reward):
    trainer = lora_run(tmp_path, varied_reward)
    module = trainer.policy.module
    before = {k: v.clone() for k, v in module.state_dict().items()}
    merged = merged_copy(module)
    assert not any("lora_" in k for k in merged.state_dict())
    for key, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[key]), key
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(module(input_ids=ids).logits, merged(input_ids=ids).logits,
                              atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("ahead", [0, 1])
def test_lora_dropout_draws_are_seeded(tmp_path, varied_reward, ahead):
    """PEFT's dropout draws from torch's global generator, which nothing seeded: two runs
    of one config differed, and a resumed run from the uninterrupted one. An async
    producer's recompute, in a thread of its own, drew from it too."""
    for name in "ab":
        staleness = f"rollout.max_staleness={ahead}"
        lora_run(tmp_path, varied_reward, "model.lora.dropout=0.1", staleness, name=name)
    norms = [
        [r["train/grad_norm"] for r in read_metrics(tmp_path / n / "metrics.jsonl")
         if "train/grad_norm" in r]
        for n in "ab"
    ]  # fmt: skip
    assert len(norms[0]) == 4 and norms[0] == norms[1]


@pytest.mark.parametrize("old_logprobs", ["auto", "recompute", "sampler"])
def test_with_lora_dropout_pi_old_is_recomputed_under_the_updates_own_masks(
    tmp_path, varied_reward, monkeypatch, old_logprobs
):
    """With dropout the update's forward drops adapter inputs the sampler kept. auto
    recomputes pi_old, each minibatch under the masks its update's forward then draws:
    on unchanged weights (lr 1e-30, random lora_B so that dropout matters) every ratio of
    every minibatch is exactly 1. The sampler's log-probs (no dropout) clip instead; so
    did the recompute under masks of its own."""
    import gspo.training.setup as setup

    attach = setup.attach_lora

    def random_b(*args, **kwargs):
        model = attach(*args, **kwargs)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        return model

    monkeypatch.setattr(setup, "attach_lora", random_b)
    lora_run(tmp_path, varied_reward, "model.lora.dropout=0.3", "optim.lr=1e-30",
             f"algorithm.old_logprobs={old_logprobs}", "rollout.max_new_tokens=8")  # fmt: skip
    lines = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/ratio_max" in r]
    assert len(lines) == 4 and {r["train/minibatch"] for r in lines} == {0, 1}
    ratios = [(r["train/ratio_min"], r["train/ratio_max"]) for r in lines]
    if old_logprobs != "sampler":
        assert all(r == (1.0, 1.0) and "mismatch/token_abs_max" in line
                   for r, line in zip(ratios, lines, strict=True))  # fmt: skip
    else:
        assert max(hi - lo for lo, hi in ratios) > 1e-3


def test_a_moved_lora_run_finds_its_own_base_model(tmp_path, varied_reward, capsys):
    """The built-in model's LoRA run records its base_model/ by its absolute path: once
    the run was moved, resume and export named the old place (and `model.path`)."""
    import shutil

    lora_run(tmp_path, varied_reward, name="first")
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "first", moved)
    assert main(["export", str(moved), "--merge", str(tmp_path / "merged")]) == 0
    assert main(["train", "--resume", str(moved), "train.max_steps=6"]) == 0
    assert (moved / "checkpoints" / "latest").read_text().strip() == "step-0000006"
    # an adapter as model.path: said so, with the way to a whole model
    adapter = moved / "checkpoints" / "step-0000006"
    capsys.readouterr()
    assert main(["train", "--output-dir", str(tmp_path / "x"), *FAST, f"model.path={adapter}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: model.path: {adapter} is a LoRA adapter, not a whole model: gspo "
        f"export {adapter} --merge OUT makes one (or gspo train --resume its run)"
    )


def test_lora_checkpoint_is_peft_format_and_export_merges(tmp_path, varied_reward, capsys):
    from peft import PeftModel

    trainer = lora_run(tmp_path, varied_reward)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000004"
    assert (checkpoint / "adapter_config.json").is_file()
    assert (checkpoint / "adapter_model.safetensors").is_file()
    assert not (checkpoint / "model.safetensors").exists()  # no copy of the base
    base, _ = load_model(tmp_path / "run" / "base_model", device=torch.device("cpu"),
                         dtype=torch.float32)  # fmt: skip
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    with quiet_peft():
        loaded = PeftModel.from_pretrained(base, checkpoint).eval()  # wraps base in place
    set_linear_kernel(loaded, linear_kernel(trainer.policy.module))  # the run's kernel
    with torch.no_grad():
        trained = trainer.policy.module.eval()(input_ids=ids).logits
        assert torch.equal(loaded(input_ids=ids).logits, trained)
    # gspo export RUN --merge OUT: a plain HF model with the same logits, and no warning
    # from PEFT's loading that the user could do nothing about
    out = tmp_path / "merged"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert main(["export", str(tmp_path / "run"), "--merge", str(out)]) == 0
    assert (out / "config.json").is_file() and not (out / "adapter_config.json").exists()
    merged, _ = load_model(out, device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        logits = merged.eval()(input_ids=ids).logits
    assert (logits - trained).abs().max() < 1e-5
    assert (logits - base_logits).abs().max() > 1e-4  # the adapter is in it
    # an earlier export may be replaced; the run itself, a folder holding it, or any other
    # non-empty directory never (the export replaces its target whole)
    assert main(["export", str(checkpoint), "--merge", str(out)]) == 0
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    capsys.readouterr()
    assert json.loads((out / "gspo_export.json").read_text())["exported_from"] == str(
        checkpoint.resolve()
    )
    # a model directory that is no export (the user's own model, the base a LoRA run
    # names) was overwritten silently: refused
    base = tmp_path / "run" / "base_model"
    for target in (tmp_path / "run", tmp_path, checkpoint, tmp_path / "notes", base):
        assert main(["export", str(tmp_path / "run"), "--merge", str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("gspo: error: export: --merge") and "\n" not in err, err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    assert (checkpoint / "adapter_config.json").is_file()
    # the adapter's bytes changed after writing (a disk fault): one line naming the file
    adapter = checkpoint / "adapter_model.safetensors"
    flipped = bytearray(adapter.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    adapter.write_bytes(bytes(flipped))
    assert main(["export", str(checkpoint), "--merge", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gspo: error: {adapter} holds other bytes (CRC-32 ") and "\n" not in err
    flipped[len(flipped) // 2] ^= 0xFF  # the adapter whole again
    adapter.write_bytes(bytes(flipped))
    # the base model saved over with other weights (another fine-tune in the same place):
    # a resume or merge went on with the adapter on them, silently
    weights = load_file(base / "model.safetensors")
    save_file({k: v + 0.5 if v.is_floating_point() else v for k, v in weights.items()},
              base / "model.safetensors")  # fmt: skip
    for argv in (["export", str(checkpoint), "--merge", str(out)],
                 ["train", "--resume", str(tmp_path / "run"), "train.max_steps=8"]):  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"gspo: error: {checkpoint}'s adapter was trained on the base "
                              f"model {base.resolve()}, whose weights changed since "
                              "(model.safetensors "), err  # fmt: skip


def test_a_finished_run_says_where_its_model_is(tmp_path, capsys):
    """A TRL user looks for the model in output_dir (TRL writes it there): the run's last
    line names the checkpoint that holds it, or a LoRA run's adapters and the export."""
    common = [*FAST, "train.cold_start_steps=0", "train.max_steps=2", "eval.every=0"]
    for name, extra in (("full", "model.lora.r=0"), ("lora", "model.lora.r=4")):
        assert main(["train", "--output-dir", str(tmp_path / name), *common, extra]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        step = tmp_path / name / "checkpoints" / "step-0000004"
        if name == "lora":
            assert last == (
                f"run written to {tmp_path / name}; its adapters: {step} (gspo export "
                f"{tmp_path / name} --merge OUT writes one model)"
            )
            continue
        assert last == (
            f"run written to {tmp_path / name}; its model: {step} (a Hugging Face model "
            "directory: from_pretrained loads it)"
        )
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(step).config.model_type == "qwen3"


def test_export_without_merge_names_a_full_checkpoint_or_asks_for_out(
    tmp_path, capsys, monkeypatch
):
    for name, extra in (("full", "model.lora.r=0"), ("lora", "model.lora.r=4")):
        config = load_config(None, [*FAST, extra, "train.max_steps=0", "eval.max_prompts=2"])
        Trainer(config, tmp_path / name).fit()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "nope")]) == 2  # (a typo: "neither a checkpoint")
    assert (
        capsys.readouterr().err.strip()
        == f"gspo: error: export: {tmp_path / 'nope'} does not exist"
    )
    steps = tmp_path / "full" / "checkpoints"
    assert main(["export", str(steps / "step-4")]) == 2  # (a name cut short: those there)
    said = f"export: {steps / 'step-4'} does not exist ({steps} holds step-0000000)"
    assert capsys.readouterr().err.strip() == f"gspo: error: {said}"
    (tmp_path / "cmp" / "runs").mkdir(parents=True)  # a compare's directory: its runs
    (tmp_path / "cmp" / "runs" / "full").symlink_to(tmp_path / "full")
    assert main(["export", str(tmp_path / "cmp")]) == 2
    assert f"(runs inside it: {tmp_path / 'cmp' / 'runs' / 'full'})" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "full")]) == 0
    # its step 0 (no cold start ran) names its model instead of holding a copy: that one
    # (before: the step-0 directory, which holds no weights)
    model = capsys.readouterr().out.split(" is a plain HF model")[0]
    assert model == str(tmp_path / "full" / "base_model")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(model).config.model_type == "qwen3"
    # a full model's export is marked as one: exporting again into it replaces it (it was
    # refused as "not an earlier export", a LoRA merge's alone being marked)
    for _ in range(2):
        assert main(["export", str(tmp_path / "full"), "--merge", str(tmp_path / "fx")]) == 0
    assert (tmp_path / "fx" / "gspo_export.json").is_file()
    # a place it cannot write: named as given (it named the temporary directory and
    # advised a `gspo train --resume`)
    import gspo.export

    def refused(model, tokenizer, out, **kw):
        raise PermissionError(1, "Operation not permitted", f"{out}.gspo-1.new")

    monkeypatch.setattr(gspo.export, "save_pretrained_atomic", refused)
    capsys.readouterr()
    assert main(["export", str(tmp_path / "full"), "--merge", str(tmp_path / "ro")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: export: --merge {tmp_path / 'ro'}: cannot be written (Operation not "
        "permitted)"
    )
    monkeypatch.undo()
    assert main(["export", str(tmp_path / "lora")]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a LoRA adapter" in err and "pass --merge OUT" in err and "\n" not in err
    # the model a step 0 names, gone: it was printed as "a plain HF model" all the same
    (tmp_path / "full" / "base_model").rename(tmp_path / "moved")
    assert main(["export", str(tmp_path / "full")]) == 2
    step0 = tmp_path / "full" / "checkpoints" / "step-0000000"
    assert capsys.readouterr().err.strip() == (
        f"gspo: error: export: {step0} holds no copy of its model, and the one it names, "
        f"{tmp_path / 'full' / 'base_model'}, is gone (moved or removed); put it back there"
    )
    # a later step's directory is named with its end: a resumed run removes it
    assert gspo.export.kept_until(step0) == ""
    assert gspo.export.kept_until(step0.with_name("step-0000040")).startswith(
        "; its run removes it once it has train.keep_checkpoints newer ones (a resume): "
    )
    assert gspo.export.kept_until(tmp_path / "fx") == ""


def test_export_keeps_what_runs_read_and_names_damaged_checkpoints(tmp_path, varied_reward, capsys):
    """An export could overwrite the base a LoRA run trained on (an earlier export), or land
    inside a run's checkpoints/; without --merge it named a checkpoint whose bytes changed,
    and a run whose latest checkpoint was damaged exported an older one with status 0. A
    LoRA merge of a bf16 base was written in float32 (twice the bytes)."""
    from gspo.models import save_pretrained_atomic

    full = tmp_path / "full"
    config = load_config(None, [*TRAINER_FAST, varied_reward, "train.max_steps=4"])
    Trainer(config, full).fit()
    model, tokenizer = load_model(full / "checkpoints" / "step-0000004",
                                  device=torch.device("cpu"), dtype=torch.bfloat16)  # fmt: skip
    save_pretrained_atomic(model, tokenizer, tmp_path / "bf16")
    lora_run(tmp_path, varied_reward, f"model.path={tmp_path / 'bf16'}", name="lora")
    capsys.readouterr()
    for out, said in ((tmp_path / "bf16", "the model the checkpoints of"),
                      (full / "checkpoints" / "x", f"is inside the run {full}")):  # fmt: skip
        assert main(["export", str(tmp_path / "lora"), "--merge", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"gspo: error: export: --merge {out}") and said in err, err
    assert main(["export", str(tmp_path / "lora"), "--merge", str(tmp_path / "merged")]) == 0
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "bfloat16"
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    # without --merge: the files named are checked as --merge checks them
    weights = full / "checkpoints" / "step-0000004" / "model.safetensors"
    flipped = bytearray(weights.read_bytes())
    flipped[5000] ^= 0xFF
    weights.write_bytes(bytes(flipped))
    capsys.readouterr()
    assert main(["export", str(full)]) == 2
    assert capsys.readouterr().err.startswith(f"gspo: error: {weights} holds other bytes")
    weights.unlink()  # the latest checkpoint cut short: refused, not the one before it
    assert main(["export", str(full)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gspo: error: export: the latest checkpoint of {full}, step-0000004")
    # deleted (as a resume's advice says): the one before it, as a resume takes
    shutil.rmtree(weights.parent)
    assert main(["export", str(full)]) == 0
    assert "step-0000000" in capsys.readouterr().out


def test_export_errors_are_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), "--merge", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: error:") and "\n" not in err


@pytest.mark.slow
def test_lora_resume_gives_the_same_metrics(tmp_path, varied_reward):
    common = [*FAST, varied_reward, "train.max_steps=8", "algorithm.minibatches=2",
              "train.save_every=2", "eval.every=4", "optim.lr=1e-2",
              "algorithm.kl_coef=0.05"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "full"), *common]) == 0
    assert main(["train", "--output-dir", str(tmp_path / "cut"), *common, "train.max_steps=4"]) == 0
    assert main(["train", "--resume", str(tmp_path / "cut"), "train.max_steps=8"]) == 0
    full = read_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = read_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in full] == [r["step"] for r in resumed]

    def comparable(r):
        return {k: v for k, v in r.items() if not k.startswith(("time/", "io/"))}

    for a, b in zip(full, resumed, strict=True):
        assert comparable(a) == pytest.approx(comparable(b), rel=1e-6, abs=1e-7)
    lines = [r for r in full if "train/loss" in r]
    assert len({round(r["train/reward_mean"], 6) for r in lines}) > 1


def test_lora_on_the_moe_builtin_trains(tmp_path, varied_reward):
    trainer = lora_run(
        tmp_path, varied_reward, "model.builtin=qwen3_moe", "model.experts=4",
        "moe.routing_replay=true",
    )  # fmt: skip
    trained = [n for n, p in trainer.policy.module.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in trained)
    saved = base_weights(tmp_path / "run" / "base_model")
    now = peft_base_state(trainer)
    assert all(torch.equal(now[k], v) for k, v in saved.items() if k in now)
    lines = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert len(lines) == 4


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.lora.r=-1"], "model.lora.r"),
        (["model.lora.r=8", "train.cold_start_steps=10"], "train.cold_start_steps=0"),
        (["model.lora.r=8", "train.cold_start_steps=0", "model.lora.target_modules=[]"],
         "model.lora.target_modules"),
        (["model.lora.dropout=1.5"], "model.lora.dropout"),
        # one string of names is a regex matching no whole module name (PEFT's "not found")
        (["model.lora.r=8", "train.cold_start_steps=0", "model.lora.target_modules=q_proj,v_proj"],
         "write a list: model.lora.target_modules='[q_proj, v_proj]'"),
        (["model.lora.r=8", "train.cold_start_steps=0", "model.lora.target_modules=all_linear"],
         "model.lora.target_modules='all_linear': no module has that name; did you mean "
         "all-linear?"),
    ],
)  # fmt: skip
def test_lora_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_target_modules_matching_nothing_is_one_line(tmp_path, capsys):
    code = main(["train", "--output-dir", str(tmp_path / "r"), *FAST,
                 "model.lora.target_modules=[no_such_proj]", "train.max_steps=1"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "model.lora.target_modules" in err and "\n" not in err
    # a module that is no layer: its class and what LoRA adapts (before: "Target module
    # Qwen3Attention(", the first line of the module's print-out)
    code = main(["train", "--output-dir", str(tmp_path / "r"), *FAST,
                 "model.lora.target_modules=[self_attn]", "train.max_steps=1"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert (
        code == 2
        and "\n" not in err
        and err.startswith(
            "gspo: error: model.lora.target_modules=['self_attn']: matches a Qwen3Attention, which "
            "is not a layer LoRA adapts (name its linear layers, e.g. q_proj, or all-linear): "
            "Currently, only the following modules are supported: `torch.nn.Linear`"
        )
    ), err


def test_a_name_of_the_target_list_that_matches_nothing_is_one_line(tiny_model):
    """PEFT refuses a list only when no name matches: [q_proj, v_prj] adapted q_proj
    alone and trained on, the misspelt v_proj unsaid."""
    from gspo.config import LoraSettings
    from gspo.training.lora import attach_lora

    targets = ["q_proj", "v_prj"]
    with pytest.raises(ValueError) as raised:
        attach_lora(tiny_model, LoraSettings(r=4, target_modules=targets), seed=0)
    assert str(raised.value) == (
        "model.lora.target_modules: 'v_prj' matches no module of the model (its linear "
        "layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj)"
    )
    lora = attach_lora(tiny_model, LoraSettings(r=4, target_modules=["self_attn.q_proj"]), seed=0)
    assert lora.peft_config["default"].r == 4  # (a name's last parts match, as in PEFT)


def test_attaching_adapters_prints_no_deprecation_warning(tiny_model):
    """PEFT's wrapper reads a property transformers 5.24 deprecated: gspo keeps that
    FutureWarning, which no user setting can fix, out of the run's output."""
    import warnings

    from gspo.config import LoraSettings
    from gspo.training.lora import attach_lora

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model = attach_lora(tiny_model, LoraSettings(r=4), seed=0)
    assert sum(p.requires_grad for p in model.parameters()) > 0


def test_adapters_on_a_model_loaded_by_a_relative_path_print_no_rename_warning(
    tmp_path, tiny_model, tokenizer, monkeypatch
):
    """PEFT warned at the start of every LoRA run from a relative model.path that the
    adapter's base_model_name_or_path "was renamed" (absolute vs as written)."""
    from gspo.config import LoraSettings
    from gspo.models import save_pretrained_atomic
    from gspo.training.lora import attach_lora

    save_pretrained_atomic(tiny_model, tokenizer, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    model, _ = load_model(Path("base"), device=torch.device("cpu"), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora = attach_lora(model, LoraSettings(r=4), seed=0, base_path=Path("base"))
    assert not [w for w in caught if "was renamed" in str(w.message)]
    assert lora.peft_config["default"].base_model_name_or_path == str(tmp_path / "base")


def test_adapters_on_the_moe_builtin_print_no_pattern_warning(tokenizer):
    """On a MoE model PEFT adds rank/alpha patterns for fused experts that gspo's experts
    do not match, and warned about them at every LoRA run: gspo keeps that out."""
    import warnings

    from gspo.config import LoraSettings
    from gspo.models import TinyModelSpec, build_tiny_model
    from gspo.training.lora import attach_lora

    spec = TinyModelSpec(architecture="qwen3_moe", layers=1, hidden=32, experts=4)
    moe = build_tiny_model(spec, tokenizer, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = attach_lora(moe, LoraSettings(r=4), seed=0)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("experts" in n for n in trained)


@pytest.mark.parametrize("targets", ["lm_head", ["q_proj", "lm_head"]])
def test_an_adapter_on_a_tied_embedding_is_refused_in_one_line(tiny_model, targets):
    """The built-in ties lm_head to embed_tokens (as Qwen3 up to 4B does). An adapter on
    lm_head merged into the shared weight changes the input embeddings too: the merged
    model's logits differed from the trained policy's, so
    ``gspo export --merge`` and vLLM's merged weights were silently another model."""
    from gspo.config import LoraSettings
    from gspo.training.lora import attach_lora, tied_embeddings

    assert tied_embeddings(tiny_model) == ["model.embed_tokens", "lm_head"]
    with pytest.raises(ValueError, match=r"adapts lm_head, which this model ties") as raised:
        attach_lora(tiny_model, LoraSettings(r=4, target_modules=targets), seed=0)
    assert "\n" not in str(raised.value)


def test_an_untied_model_may_adapt_its_output_layer(tiny_model):
    from gspo.config import LoraSettings
    from gspo.training.lora import attach_lora, merged_copy, tied_embeddings

    model = tiny_model
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    assert tied_embeddings(model) == []
    lora = attach_lora(model, LoraSettings(r=4, target_modules="lm_head"), seed=0)
    with torch.no_grad():
        lora.base_model.model.lm_head.lora_B["default"].weight.normal_(0, 0.05)
        ids = torch.tensor([[3, 4, 5, 6]])
        torch.testing.assert_close(merged_copy(lora)(ids).logits, lora(ids).logits)


def test_all_linear_leaves_out_routers_that_return_a_tuple():
    """PhiMoE's and Llama 4's routers are nn.Linear subclasses whose forward returns a
    tuple: all-linear adapted them and PEFT's layer added its update to the tuple, an
    AttributeError in the first forward of every LoRA run on those families."""
    from transformers import PhimoeConfig, PhimoeForCausalLM

    from gspo.config import LoraSettings
    from gspo.training.lora import attach_lora

    torch.manual_seed(0)
    config = PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64)  # fmt: skip
    model = attach_lora(PhimoeForCausalLM(config), LoraSettings(r=4), seed=0)
    ids = torch.randint(0, 64, (2, 8))
    assert model(ids).logits.shape == (2, 8, 64)
    adapted = {
        n.removesuffix(".base_layer") for n, m in model.named_modules() if hasattr(m, "base_layer")
    }
    assert not any(n.endswith("mlp.router") for n in adapted)
    assert any(n.endswith("self_attn.q_proj") for n in adapted)
    # a list names a router as the user wants it (nothing left out)
    listed = attach_lora(
        PhimoeForCausalLM(config), LoraSettings(r=4, target_modules=["q_proj"]), seed=0
    )
    assert listed.peft_config["default"].exclude_modules is None
