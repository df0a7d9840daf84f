"""``gspo eval``: a checkpoint (or a model) evaluated as its run evaluates, nothing written."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_trainer import FAST

from gspo.checkpoint_eval import evaluate
from gspo.cli import main
from gspo.telemetry import read_metrics

STEPS = ["train.max_steps=4", "algorithm.minibatches=2", "eval.every=2", "train.save_every=2"]


def logged_evals(run):
    """The run's evaluations by step: its eval/* figures."""
    found: dict[int, dict] = {}
    for record in read_metrics(run / "metrics.jsonl"):
        figures = {k: v for k, v in record.items() if k.startswith("eval/")}
        if figures:
            found.setdefault(record["step"], {}).update(figures)
    return found


def snapshot(run):
    """Every file of a run with its bytes: what an evaluation must leave as it was."""
    return {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 4 steps (checkpoints at 0, 2, 4; evaluations at 0, 2, 4), and a LoRA run
    of 4 steps from its step 0 whose checkpoints hold its adapters only
    (``train.save_only_model``: no optimizer state, which a resume's loading asked for)."""
    root = tmp_path_factory.mktemp("eval")
    (root / "varied.py").write_text(
        "def varied(prompts, completions, **kw):\n"
        "    return [sum(ord(ch) for ch in c) % 7 / 7 for c in completions]\n"
    )
    varied = f"reward.functions=[{root / 'varied.py'}:varied]"
    run, lora = root / "run", root / "lora"
    assert main(["train", "--output-dir", str(run), *FAST, *STEPS, varied]) == 0
    step0 = run / "checkpoints" / "step-0000000"
    adapters = ["model.lora.r=4", "optim.lr=0.05", "train.cold_start_steps=0",
                f"model.path={step0}", "train.save_only_model=true"]  # fmt: skip
    assert main(["train", "--output-dir", str(lora), *FAST, *STEPS, *adapters, varied]) == 0
    return run, lora


def test_each_checkpoint_gives_the_figures_its_run_logged_and_nothing_is_written(
    trained, tmp_path, capsys
):
    """Its own config and its step's evaluation seed: the sampled figures as well as the
    greedy ones are the run's (float32, the CPU), at every step, full and LoRA."""
    for run in trained:
        before, logged = snapshot(run), logged_evals(run)
        assert sorted(logged) == [0, 2, 4]
        greedy = "eval/response_length_mean_greedy"
        assert logged[4] != logged[0] or logged[4][greedy] != logged[0][greedy]  # it moved
        for step in (0, 2, 4):
            evaluated = evaluate(run, step=step)
            figures = {k: v for k, v in evaluated.metrics.items() if k.startswith("eval/")}
            assert figures == logged[step], (run.name, step)
            assert evaluated.logged == logged[step] and evaluated.step == step
        assert snapshot(run) == before
    # the command: the latest checkpoint, its figures beside the run's, and --json
    run = trained[0]
    capsys.readouterr()
    assert main(["eval", str(run), "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"evaluated {run}/checkpoints/step-0000004 (step 4) on 24 held-out")
    accuracy = logged_evals(run)[4]["eval/accuracy"]
    assert "eval/accuracy  " in out and f"(the run logged {accuracy:.4f})" in out
    written = json.loads((tmp_path / "e.json").read_text())
    assert written["step"] == 4 and written["eval/accuracy"] == accuracy


def test_overrides_change_the_evaluation_and_a_model_directory_takes_a_config(trained, tmp_path):
    run = trained[0]
    more = evaluate(run, overrides=["eval.samples=3", "eval.greedy=false"])
    assert "eval/accuracy_greedy" not in more.metrics and more.prompts == 24
    assert more.logged == {}  # (another measurement: not set beside the run's)
    assert (
        more.metrics["eval/response_length_mean"]
        != logged_evals(run)[4]["eval/response_length_mean"]
        or more.metrics["eval/reward_mean"] != logged_evals(run)[4]["eval/reward_mean"]
    )
    # the step-0 checkpoint's model, as a plain directory with the run's config: step 0's
    plain = evaluate(run / "checkpoints" / "step-0000000", config=run / "config.yaml")
    assert plain.metrics["eval/accuracy_greedy"] == logged_evals(run)[0]["eval/accuracy_greedy"]
    model = evaluate(run / "base_model", config=run / "config.yaml")
    assert model.step == 0 and not model.logged and "eval/accuracy" in model.metrics
    # a checkpoint copied out of its run keeps its step (its name gave step 0's seed)
    copy = tmp_path / "best"
    shutil.copytree(run / "checkpoints" / "step-0000004", copy)
    figures = {k: v for k, v in evaluate(copy).metrics.items() if k.startswith("eval/")}
    assert figures == logged_evals(run)[4]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--step", "3"], "--step 3: {run} holds no checkpoint of that step (steps: 0, 2, 4)"),
        (["--step", "2", "--config", "nowhere.yaml"], "nowhere.yaml"),
        (["--json", "/nowhere/e.json"], "--json /nowhere/e.json: /nowhere is no directory"),
    ],
)
def test_bad_requests_are_one_line(trained, capsys, args, said):
    run = trained[0]
    assert main(["eval", str(run), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said.format(run=run) in err, err


def test_a_model_directory_has_no_steps_and_a_mistyped_checkpoint_names_those_held(trained, capsys):
    run = trained[0]
    assert main(["eval", str(run / "base_model"), "--step", "2"]) == 2
    assert "--step with the model directory" in capsys.readouterr().err
    assert main(["eval", str(run / "checkpoints" / "step-4")]) == 2
    err = capsys.readouterr().err
    assert "holds step-0000000, step-0000002, step-0000004" in err and "\n" not in err.strip()


def test_what_is_neither_a_run_nor_a_model_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    neither = "is neither a checkpoint, a run with one, nor a model directory (no config.json)"
    for path, said in [(tmp_path / "gone", "does not exist"), (tmp_path / "empty", neither)]:
        assert main(["eval", str(path)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"gspo: error: eval: {path} {said}", err


def test_a_compare_directory_names_its_runs(tmp_path, capsys):
    """gspo eval runs/compare said "neither a checkpoint, a run with one, nor a model
    directory", where gspo export names the runs inside it."""
    out = tmp_path / "cmp"
    for run in ("grpo-seed0", "gspo-seed0"):
        (out / "runs" / run / "checkpoints").mkdir(parents=True)
    runs = f"{out}/runs/grpo-seed0, {out}/runs/gspo-seed0"
    for command in ("eval", "export"):
        assert main([command, str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (
            f"gspo: error: {command}: {out} is neither a checkpoint nor a run with one "
            f"(runs inside it: {runs})"
        ), err


def test_an_export_keeps_its_step_and_gives_the_figures_its_run_logged(trained, tmp_path):
    """An export evaluated with its run's config drew step 0's evaluation seeds: its
    sampled figures were not those the run logged at the exported step."""
    run = trained[0]
    out = tmp_path / "merged"
    assert main(["export", str(run / "checkpoints" / "step-0000002"), "--merge", str(out)]) == 0
    assert json.loads((out / "gspo_export.json").read_text())["step"] == 2
    evaluated = evaluate(out, config=run / "config.yaml")
    figures = {k: v for k, v in evaluated.metrics.items() if k.startswith("eval/")}
    assert evaluated.step == 2 and figures == logged_evals(run)[2]


def test_export_dtype_writes_the_weights_rounded_to_it(trained, tmp_path, capsys):
    """``--dtype bfloat16``: a full fine-tuning export was float32 alone (a bf16 base's
    export twice its bytes); without ``--merge`` it is one line."""
    from safetensors.torch import load_file

    run, out = trained[0], tmp_path / "bf16"
    assert main(["export", str(run), "--merge", str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    trained_weights = load_file(run / "checkpoints" / "step-0000004" / "model.safetensors")
    written = load_file(out / "model.safetensors")
    assert written.keys() == trained_weights.keys()
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, trained_weights[name].to(torch.bfloat16)), name
    capsys.readouterr()
    assert main(["export", str(run), "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "gspo: error: --dtype needs --merge OUT, the copy it writes", err


def test_export_step_picks_a_runs_checkpoint_as_eval_step_does(trained, tmp_path, capsys):
    """``gspo export RUN --step N`` (``gspo eval``'s ``--step``) was an unknown argument."""
    run, out = trained[0], tmp_path / "step2"
    steps = run / "checkpoints"
    assert main(["export", str(run), "--step", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"{steps / 'step-0000002'} is a plain HF model")
    assert main(["export", str(run), "--step", "2", "--merge", str(out)]) == 0
    assert json.loads((out / "gspo_export.json").read_text())["step"] == 2
    for argv, said in [
        (["--step", "3"], f"--step 3: {run} holds no checkpoint of that step (steps: 0, 2, 4)"),
        ([], "pass its run instead"),
    ]:
        source = run if argv else steps / "step-0000002"
        assert main(["export", str(source), *(argv or ["--step", "2"])]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("gspo: error: export: ") and said in err and "\n" not in err, err


def test_a_damaged_latest_checkpoint_names_step_as_the_way_to_an_older_one(
    trained, tmp_path, capsys
):
    """The error said to pass the older checkpoint by its path; ``--step N`` reaches it."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    with open(run / "checkpoints" / "step-0000004" / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    for command in ("export", "eval"):
        assert main([command, str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"{command} a whole one by its step (gspo {command} {run} --step N)")
    assert main(["export", str(run), "--step", "2"]) == 0


def test_export_into_a_path_under_a_file_names_the_file(trained, tmp_path, capsys):
    """It said "cannot be written (File exists)", the parent's mkdir's error."""
    (tmp_path / "notes.txt").write_text("x")
    out = tmp_path / "notes.txt" / "merged"
    assert main(["export", str(trained[0]), "--merge", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    file = tmp_path / "notes.txt"
    assert err == f"gspo: error: export: --merge {out}: {file} is a file, not a directory", err


def test_an_export_made_before_its_step_was_recorded_reads_it_from_its_source(tmp_path):
    """An export written before gspo_export.json held its step (only exported_from) was
    evaluated with step 0's seeds, against the docs' "an export keeps its step"."""
    from gspo.export import EXPORT_MARK, exported_step

    mark = {"exported_from": str(tmp_path / "run" / "checkpoints" / "step-0000006")}
    (tmp_path / EXPORT_MARK).write_text(json.dumps(mark))
    assert exported_step(tmp_path) == 6
    (tmp_path / EXPORT_MARK).write_text(json.dumps({**mark, "step": 4}))
    assert exported_step(tmp_path) == 4
    (tmp_path / EXPORT_MARK).write_text(json.dumps({"exported_from": str(tmp_path / "x")}))
    assert exported_step(tmp_path) == 0
    (tmp_path / EXPORT_MARK).unlink()
    assert exported_step(tmp_path) == 0


def test_the_report_counts_its_prompts_in_words():
    """One prompt was "1 held-out prompts"."""
    from gspo.checkpoint_eval import Evaluated, report

    def first_line(prompts: int) -> str:
        return report(Evaluated(Path("m"), 3, prompts, {"eval/accuracy": 0.5})).splitlines()[0]

    assert first_line(1) == "evaluated m (step 3) on 1 held-out prompt"
    assert first_line(2) == "evaluated m (step 3) on 2 held-out prompts"


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["embed_tokens", "q_proj"], ["lm_head"]])
def test_an_adapter_loads_as_peft_loads_it(tmp_path, monkeypatch, targets):
    """gspo eval's adapter (set_model_state_dict, for FSDP's shards) lands where PEFT's
    set_peft_model_state_dict put it, on every parameter; an adapted embedding's (PEFT
    saves its lora_embedding_A and its base_layer.weight) was refused as 'weights its
    config's adapters lack'."""
    from types import SimpleNamespace

    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import gspo.publish
    from gspo.checkpoint_eval import _load_adapter
    from gspo.config.model import LoraSettings
    from gspo.training.lora import ADAPTER_WEIGHTS, attach_lora

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=8, tie_word_embeddings=False)  # fmt: skip
        settings = LoraSettings(r=2, target_modules=targets)
        return attach_lora(Qwen3ForCausalLM(config), settings, seed=seed)

    trained = model(1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))  # (the base too: a saved base_layer is loaded)
    state = {k: v.contiguous() for k, v in get_peft_model_state_dict(trained).items()}
    save_file(state, tmp_path / ADAPTER_WEIGHTS)
    monkeypatch.setattr(gspo.publish, "check_manifest", lambda *a: None)
    peft, ours = model(2), model(2)
    set_peft_model_state_dict(peft, state)
    _load_adapter(SimpleNamespace(module=ours, device="cpu", stepped=lambda: None), tmp_path)
    expected = dict(peft.named_parameters())
    for name, value in ours.named_parameters():
        assert torch.equal(value, expected[name]), name
    fresh = dict(model(2).named_parameters())  # (and something was loaded)
    assert any(not torch.equal(v, fresh[n]) for n, v in ours.named_parameters())
