"""gspo from a Python script: ``gspo.load_config`` / ``gspo.train``, reward functions given
as the functions themselves, one-line errors for bad assignments, and a script without
``if __name__ == "__main__":`` under ``reward.workers``."""

from __future__ import annotations

import operator
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from test_distributed import torchrun
from test_trainer import FAST

import gspo
from gspo.config import ConfigError, dump_config_text
from gspo.plugins import object_spec
from gspo.rewards import RewardError, load_reward_function
from gspo.rewards.verifiers import format_reward
from gspo.telemetry import read_metrics
from gspo.trainer import SHARDED, latest_checkpoint

RUN = [*FAST, "train.cold_start_steps=0", "train.max_steps=2", "eval.every=0"]


def quarter(prompts, completions, **kwargs):
    """Scores every completion 0.25, whatever it says."""
    return [0.25] * len(completions)


def test_config_made_in_python_says_a_bad_value_in_one_line():
    """``gspo.Config(...)`` (TRL's GRPOConfig(...) habit) raised pydantic's multi-line error."""
    assert gspo.Config(optim={"lr": 1e-3}).optim.lr == 1e-3
    assert gspo.Config() == gspo.load_config()  # the default task brings no settings
    for made, said in [
        (lambda: gspo.Config(optim={"lr": -1}), "optim.lr: Input should be greater than 0"),
        (lambda: gspo.Config(optim={"lrr": 1}), "optim.lrr: unknown key; did you mean 'optim.lr'?"),
        (lambda: gspo.Config(model={"lora": {"r": -1}}), "model.lora.r: Input should be"),
        (lambda: gspo.Config(rolout={}), "rolout: unknown key; did you mean 'rollout'?"),
    ]:
        with pytest.raises(ConfigError) as raised:
            made()
        assert str(raised.value).startswith(said) and "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"a list of 'key.sub=value' strings, got str"):
        gspo.load_config(None, "optim.lr=1e-3")


def test_import_gspo_loads_no_trainer_until_train_is_used():
    code = (
        "import sys, gspo; assert 'transformers' not in sys.modules; "
        "gspo.load_config(); assert 'gspo.trainer' not in sys.modules; "
        "assert gspo.train is sys.modules['gspo.runs'].train"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        gspo.trian  # noqa: B018
    assert {"train", "load_config", "Trainer", "Config"} <= set(dir(gspo))  # tab completion


def test_a_function_is_written_as_the_spec_that_loads_it():
    assert object_spec(format_reward) == "gspo.rewards.verifiers:format_reward"
    assert load_reward_function(object_spec(format_reward)) is format_reward
    assert object_spec(quarter) == "test_python_api:quarter"
    assert load_reward_function("test_python_api:quarter") is quarter

    def local(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    for obj, name in ((local, "local"), (lambda **k: None, "<lambda>")):
        spec = object_spec(obj)
        assert spec == f"<python object {name}>"
        said = r"as a Python object.*resume=True.*gspo eval DIR 'reward"
        with pytest.raises(RewardError, match=said):
            load_reward_function(spec)


def test_reward_functions_may_be_functions_and_are_recorded_as_specs():
    config = gspo.load_config(None, RUN)
    config.reward.functions = quarter  # one alone is a list of one, as a spec string is
    assert config.reward.functions == [quarter]
    assert "functions" in config.reward.model_fields_set  # set: an environment's reward yields
    config.reward.functions = [quarter, "format", lambda **k: None]
    written = yaml.safe_load(dump_config_text(config))["reward"]["functions"]
    assert written == ["test_python_api:quarter", "format", "<python object <lambda>>"]


@pytest.mark.parametrize(
    ("section", "key", "value", "said"),
    [
        ("reward", "functions", [3], "reward.functions: item 0 is neither a spec string nor a"),
        ("optim", "lr", -1.0, "optim.lr: Input should be greater than 0 (got -1.0)"),
        ("optim", "lrr", 1, "optim.lrr: unknown key; did you mean 'optim.lr'?"),
        ("rollout", "engine", "vlm", "rollout.engine: Input should be 'torch' or 'vllm'"),
        ("optim", "lr", float("nan"), "optim.lr: "),
        ("model.lora", "r", -2, "model.lora.r: Input should be greater than or equal to 0"),
        ("rollout", "environment", object(), "rollout.environment: a spec string or the class"),
    ],
)  # fmt: skip
def test_a_bad_assignment_is_one_line_naming_the_key(section, key, value, said):
    config = gspo.load_config()
    part = operator.attrgetter(section)
    with pytest.raises(ConfigError) as raised:
        setattr(part(config), key, value)
    message = str(raised.value)
    assert message.startswith(said) and "\n" not in message
    assert part(config) == part(gspo.load_config())  # unchanged


@pytest.mark.parametrize(
    ("section", "key", "value", "said"),
    [
        ("model.lora", "r", 4, "model.lora.r=4 needs train.cold_start_steps=0"),
        ("rollout", "group_size", 1, "rollout.group_size=1: GSPO, GRPO and GSPO-token are"),
        ("model", "kv_heads", 3, "model.kv_heads=3 must divide model.heads=2"),
        ("data", "prompt_template", "{prompt", "data.prompt_template: not a format string"),
    ],
)  # fmt: skip
def test_an_assignment_that_breaks_a_rule_across_keys_stops_train_and_trainer(
    tmp_path, section, key, value, said
):
    """An assignment checks its own key alone: these mixes, each refused by load_config,
    trained (a LoRA cold start; a group of one that learned nothing) or failed inside
    transformers (heads), leaving a directory behind. Now train and Trainer check the
    rules across keys first, in one line, before anything is written."""
    config = gspo.load_config(None, [*RUN, "model.heads=2", "train.cold_start_steps=2"])
    setattr(operator.attrgetter(section)(config), key, value)  # (its own key: fine)
    for start in (gspo.train, gspo.Trainer):
        with pytest.raises(ConfigError) as raised:
            start(config, tmp_path / "run")
        message = str(raised.value)
        assert message.startswith(said) and "\n" not in message
        assert not (tmp_path / "run").exists()
    with pytest.raises(TypeError, match="Trainer: config must be a gspo.config.Config"):
        gspo.Trainer(None, tmp_path / "run")


@pytest.mark.parametrize("given", [{"optim": {"lr": 1e-3}}, "config"])
def test_load_config_given_a_dict_or_a_config_says_what_it_takes(given):
    """A dict of sections or a Config as load_config's path was a TypeError from pathlib."""
    given = gspo.load_config() if given == "config" else given
    with pytest.raises(ConfigError) as raised:
        gspo.load_config(given)
    assert str(raised.value).startswith(
        f"load_config: path is a YAML file's path, got a {type(given).__name__}; "
    )


@pytest.mark.parametrize("workers", [0, 1])
def test_train_with_a_function_as_the_reward(tmp_path, workers):
    """The function scores the rollouts (in this process, or pickled to a worker)."""
    config = gspo.load_config(None, [*RUN, f"reward.workers={workers}"])
    config.reward.functions = [quarter]
    records = gspo.train(config, tmp_path / "run")
    rewards = [r["train/reward_mean"] for r in records if "train/reward_mean" in r]
    assert len(rewards) >= 2 and set(rewards) == {0.25}
    logged = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["train/reward_mean"] for r in logged if "train/reward_mean" in r] == rewards
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["reward"]["functions"] == ["test_python_api:quarter"]


def test_resuming_a_run_given_an_unloadable_function_says_how(tmp_path):
    config = gspo.load_config(None, RUN)
    config.reward.functions = [lambda prompts, completions, **kw: [1.0] * len(completions)]
    gspo.train(config, tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-m", "gspo", "train", "--resume", str(tmp_path / "run"),
         "train.max_steps=3"],
        capture_output=True, text=True,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert "<python object <lambda>>" in lines[0] and "resume=True" in lines[0]


def test_an_unloadable_object_names_the_override_of_its_own_key():
    """The hint named `gspo eval DIR 'reward.functions=[...]'` for an environment too, and
    no `gspo train --resume` form at all."""
    from gspo.environments import EnvError, EnvironmentFactory

    with pytest.raises(RewardError) as reward:
        load_reward_function("<python object correct>")
    with pytest.raises(EnvError) as environment:
        EnvironmentFactory("<python object Calc>")
    assert "gspo train --resume DIR 'reward.functions=[file.py:name, ...]'" in str(reward.value)
    said = str(environment.value)
    assert "gspo train --resume DIR rollout.environment=file.py:Name" in said
    assert "gspo eval DIR rollout.environment=file.py:Name" in said
    assert "reward.functions" not in said


@pytest.mark.slow
def test_a_script_without_a_main_guard_under_reward_workers_stops_with_one_line(tmp_path):
    """Each spawned worker imports the main script: without the guard it started the run
    again, its workers did the same, and the pool respawned them forever (a hang, with
    thousands of traceback lines)."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import gspo

            def quarter(prompts, completions, **kwargs):
                return [0.25] * len(completions)

            config = gspo.load_config(None, {[*RUN, "reward.workers=2"]!r})
            config.reward.functions = [quarter]
            gspo.train(config, {str(tmp_path / "run")!r})
            """
        )
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "reward.workers=2" in last and 'if __name__ == "__main__"' in last, done.stderr[-2000:]
    assert done.stderr.count("Traceback") == 1  # the script's own error, no worker's


@pytest.mark.slow
def test_a_script_under_torchrun_trains_as_gspo_train_does(tmp_path):
    """Every rank runs the script; gspo.train joins torchrun's process group (without it,
    each rank ran a whole run of its own into the same directory)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import gspo

            def quarter(prompts, completions, **kwargs):
                return [0.25] * len(completions)

            if __name__ == "__main__":
                config = gspo.load_config(None, sys.argv[2:])
                config.reward.functions = [quarter]
                gspo.train(config, sys.argv[1])
            """
        )
    )
    out = tmp_path / "run"
    done = torchrun(str(script), str(out), *RUN)
    checkpoint = latest_checkpoint(out)
    assert checkpoint is not None
    assert len(list((checkpoint / SHARDED).glob("*.distcp"))) == 2, done.stderr[-2000:]
    trained = [r for r in read_metrics(out / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in trained] == list(range(1, len(trained) + 1))  # logged once
    assert {r["train/reward_mean"] for r in trained} == {0.25}


class Talker:
    """Not tool-shaped: answers every turn with 'ok' until the third."""

    def __init__(self):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return None if self.turns >= 3 else "ok"


def test_an_environment_class_given_as_itself(tmp_path):
    """``rollout.environment`` may be the class: episodes run through it, config.yaml
    records the spec that loads it, and the cold-start cache key is the spec's."""
    from gspo.environments import Calculator
    from gspo.training.cold_start import environment_key

    (tmp_path / "data.jsonl").write_text(
        "\n".join(f'{{"prompt": "{a}+{a}=", "answer": "{2 * a}"}}' for a in range(10, 30))
    )
    data = tmp_path / "data.jsonl"
    config = gspo.load_config(
        None,
        [*RUN, f"data.train={data}", f"data.eval={data}", "rollout.max_new_tokens=8",
         "rollout.max_turns=3", "eval.max_prompts=4", "reward.functions=[numeric_match]"],
    )  # fmt: skip
    config.rollout.environment = Talker
    records = gspo.train(config, tmp_path / "run")
    assert max(r["env/turns_mean"] for r in records if "env/turns_mean" in r) > 1
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert written["rollout"]["environment"] == "test_python_api:Talker"

    assert environment_key(Calculator) == environment_key("gspo.environments:Calculator")

    def local_class(reply: str) -> type:
        class Local:
            def step(self, text):
                return reply

        return Local

    first, second = environment_key(local_class("a")), environment_key(local_class("b"))
    assert first.startswith("<python object Local> ") and first != environment_key(Talker)
    assert first == second  # one source text (a closure's values are not its source)


def test_the_example_script_runs_and_reports_accuracy(tmp_path):
    script = Path(__file__).resolve().parents[1] / "examples" / "train_from_python.py"
    done = subprocess.run(
        [sys.executable, str(script), "--output-dir", str(tmp_path / "run"), *RUN,
         "train.cold_start_steps=4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout.strip().splitlines()[-1]  # accuracy at the start and the end
    assert said.count("(step") == 2 and said.startswith("0.") and said.endswith("(step 4)")
    written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["reward"]
    assert written["functions"] == ["<python object correct>", "<python object stops>"]
    assert written["weights"] == [1.0, 0.1]
    # again into the same directory, and a misspelt key: one line each, not a traceback
    again = [sys.executable, str(script), "--output-dir", str(tmp_path / "run")]
    for extra, said in (
        ([], "already holds a run; resume=True continues it, overwrite=True replaces it"),
        (["optim.lrr=1"], "optim.lrr: unknown key; did you mean 'optim.lr'?"),
    ):
        done = subprocess.run([*again, *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith("train_from_python.py: error: ") and said in done.stderr


class Paid:
    """One turn, scored by the environment itself."""

    def step(self, text):
        return None

    def get_reward(self):
        return 0.5


def test_a_resumed_run_keeps_its_environments_reward(tmp_path):
    """With reward.functions unset the environment's get_reward scores; config.yaml said
    reward.functions=[exact_match] (the default), so a resumed run was scored by that."""
    (tmp_path / "data.jsonl").write_text(
        "\n".join(f'{{"prompt": "{a}+{a}=", "answer": "{2 * a}"}}' for a in range(10, 30))
    )
    data = tmp_path / "data.jsonl"
    config = gspo.load_config(None, [*RUN, f"data.train={data}", f"data.eval={data}"])
    config.rollout.environment = Paid
    out = tmp_path / "run"
    gspo.train(config, out)
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["reward"]["functions"] == ["environment"]
    resumed = gspo.load_config(out / "config.yaml", ["train.max_steps=8"])
    gspo.train(resumed, out, resume=True)
    rewards = [
        r["train/reward_mean"]
        for r in read_metrics(out / "metrics.jsonl")
        if "train/reward_mean" in r
    ]
    assert len(rewards) == 8 and set(rewards) == {0.5}


def test_train_refuses_what_gspo_train_refuses_and_overwrites_on_request(tmp_path, monkeypatch):
    out = tmp_path / "run"
    config = gspo.load_config(None, RUN)
    with pytest.raises(ValueError, match="resume=True, but .* does not exist"):
        gspo.train(config, out, resume=True)
    assert not out.exists()
    out.mkdir()  # as a run stopped while it started leaves it: said in Python's words
    stopped = r"holds no config.yaml .* start it again with overwrite=True\)$"
    with pytest.raises(ValueError, match=stopped):
        gspo.train(config, out, resume=True)
    out.rmdir()
    first = gspo.train(config, out)
    wider = gspo.load_config(None, [*RUN, "model.hidden=32", "train.max_steps=8"])
    with pytest.raises(ValueError, match=r"model.hidden=32: resume=True continues the"):
        gspo.train(wider, out, resume=True)
    with pytest.raises(ValueError, match="overwrite=True replaces it"):
        gspo.train(config, out)
    # a new run that fails to start leaves the old one as it was
    broken = gspo.load_config(None, [*RUN, f"data.train={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(FileNotFoundError):
        gspo.train(broken, out, overwrite=True)
    assert read_metrics(out / "metrics.jsonl") == first
    again = gspo.train(gspo.load_config(None, [*RUN, "train.seed=1"]), out, overwrite=True)
    assert read_metrics(out / "metrics.jsonl") == again != first
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    gspo.train(config, "~/tilde")
    assert (tmp_path / "home" / "tilde" / "config.yaml").is_file()


def test_a_module_spec_is_found_in_the_current_directory(tmp_path, monkeypatch):
    """A function of a module beside the script is recorded as ``module:function``; the
    ``gspo`` console script (no current directory on sys.path) could not import it."""
    (tmp_path / "beside_the_script.py").write_text(
        "def correct(prompts, completions, **kwargs):\n    return [1.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    function = load_reward_function("beside_the_script:correct")
    assert function(prompts=["p"], completions=["c"]) == [1.0]
    assert str(tmp_path) not in sys.path  # only while importing
    with pytest.raises(RewardError, match="No module named 'not_beside'"):
        load_reward_function("not_beside:correct")


def applies(completion: str) -> bool:
    return bool(completion) and ord(completion[0]) % 2 == 1


def odd_first_only(prompts, completions, **kwargs):
    """Scores completions whose first character has an odd code by their length; None
    (does not apply) for the rest."""
    return [float(len(set(c))) if applies(c) else None for c in completions]


def test_completions_no_function_scored_get_advantage_0(tmp_path):
    from gspo.trainer import Trainer

    config = gspo.load_config(None, [*RUN, "rollout.max_new_tokens=6", "rollout.group_size=8"])
    config.reward.functions = [odd_first_only]
    with Trainer(config, tmp_path / "run") as trainer:
        sampled = trainer.rollout_stage.sample(0)
        scored = sampled.scored
        assert scored.scorable is not None and 0 < scored.scorable.sum() < len(scored.rewards)
        assert scored.scorable.tolist() == [applies(c) for c in scored.completions]
        advantages = trainer.rollout_stage.prepare(sampled).advantages.cpu()
    assert (advantages[~scored.scorable] == 0).all()
    expected = gspo.group_advantages(scored.rewards, 8, scorable=scored.scorable)
    torch.testing.assert_close(advantages, expected)
