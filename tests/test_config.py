"""Config: YAML + dotted overrides, one-line errors naming the key."""

import re
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.config import ConfigError, dump_config, dump_config_text, load_config, parse_override
from gspo.config.doc import REGENERATE, format_default, keys, render_reference, sections

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_defaults_are_the_papers_gspo_settings():
    c = load_config()
    assert c.algorithm.level == "sequence"
    assert c.algorithm.minibatches == 4
    assert c.algorithm.kl_coef == 0.0
    assert c.algorithm.clip_low is None and c.algorithm.clip_high is None  # -> 3e-4 / 4e-4


def test_overrides_are_parsed_as_yaml_values():
    c = load_config(
        overrides=[
            "optim.lr=3e-4",
            "rollout.group_size=4",
            "algorithm.level=token",
            "reward.functions=[exact_match, numeric_match]",
            "reward.weights=[1, 0.5]",
            "log.tensorboard=false",
        ]
    )
    assert c.optim.lr == pytest.approx(3e-4)
    assert c.rollout.group_size == 4
    assert c.algorithm.level == "token"
    assert c.reward.functions == ["exact_match", "numeric_match"]
    assert c.reward.weights == [1.0, 0.5]
    assert c.log.tensorboard is False
    # one number alone is a list of one, as one function name is (it was refused)
    one = load_config(overrides=["reward.functions=math", "reward.weights=2"]).reward
    assert (one.functions, one.weights) == (["math"], [2.0])


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 0.01\ntrain:\n  max_steps: 8\n")
    c = load_config(path, ["train.max_steps=12"])
    assert c.optim.lr == 0.01 and c.train.max_steps == 12


def test_dump_and_reload_round_trip(tmp_path):
    c = load_config(overrides=["algorithm.clip_high=0.3", "model.path=/some/dir"])
    dump_config(c, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == c


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lrr=1", "optim.lrr: unknown key"),
        ("nosuch.key=1", "nosuch: unknown key"),
        ("rollout.group_size=0", "rollout.group_size:"),
        ("algorithm.level=bogus", "algorithm.level:"),
        ("optim.lr=abc", "optim.lr:"),
        ("reward.weights=[1, 2]", "reward.weights has 2 entries for 1 reward.functions"),
        ("algorithm.minibatches=1000", "algorithm.minibatches=1000 exceeds"),
        ("model.device=gpu", "model.device: not a torch device (auto, cpu, cuda, cuda:1)"),
    ],
)
def test_bad_values_name_the_key(override, expected):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[override])
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optim.lrr=1", "optim.lrr: unknown key; did you mean 'optim.lr'?"),
        ("rollout.groupsize=4",
         "rollout.groupsize: unknown key; did you mean 'rollout.group_size'?"),
        ("modle.path=x", "modle: unknown key; did you mean 'model'?"),
        # another section's key its name spells (it said 'train.save_every')
        ("train.eval_every=2", "train.eval_every: unknown key; did you mean 'eval.every'?"),
        # TRL's eval_steps: 0.74-similar to max_steps, which it said
        ("train.eval_steps=2", "TRL's eval_steps is eval.every here (docs/from_trl.md)"),
        # a key of another section, none of its own as close (it said nothing)
        ("rollout.lr=1e-6", "rollout.lr: unknown key; did you mean 'optim.lr'?"),
        ("train.kl_coef=0.1", "train.kl_coef: unknown key; did you mean 'algorithm.kl_coef'?"),
        # a TRL or verl name misspelt, no key of the section as close (it said nothing)
        ("rollout.num_generation=8", "rollout.num_generation: unknown key; TRL's "
         "num_generations is rollout.group_size here (docs/from_trl.md)"),
        # TRL's names, as a user porting a GRPOConfig writes them
        ("learning_rate=1e-6", "learning_rate: unknown key; TRL's learning_rate is optim.lr here "
         "(docs/from_trl.md)"),
        ("algorithm.beta=0.04", "algorithm.beta: unknown key; TRL's beta is algorithm.kl_coef "
         "here (docs/from_trl.md)"),
        # (a section name was closer: "did you mean 'reward'?")
        ("scale_rewards=false", "scale_rewards: unknown key; TRL's scale_rewards is "
         "algorithm.advantage_scale (group, batch, or none for False) here (docs/from_trl.md)"),
        # TRL's epsilon bounds both sides: clip_low alone left [0.8, 1.0004]
        ("epsilon=0.2", "TRL's epsilon is algorithm.clip_low (and algorithm.clip_high: TRL's "
         "epsilon bounds both sides, gspo's unset side is the level's paper range) here "
         "(docs/from_trl.md)"),
        ("delta=1", "is not implemented (docs/from_trl.md)"),  # (not "did you mean 'data'?")
        # (not "did you mean 'rollout.vllm'?", a section: rollout.vllm=true was refused)
        ("rollout.use_vllm=true", "TRL's use_vllm is rollout.engine here (docs/from_trl.md)"),
        ("model=/models/Qwen3-0.6B", "model is a section of keys: model.path=/models/Qwen3-0.6B"),
        # (it said data.chat_template_kwargs.KEY=enable_thinking=false)
        ("data.chat_template_kwargs=enable_thinking=false", "(got 'enable_thinking=false'); "
         "data.chat_template_kwargs is a section of keys: "
         "data.chat_template_kwargs.enable_thinking=false"),
        ("vllm_max_model_length=4096", "is rollout.vllm.max_model_len here (docs/from_trl.md)"),
        # (it named algorithm.minibatches alone: 4x the optimizer steps of TRL's run)
        ("gradient_accumulation_steps=4", "gradient_accumulation_steps: unknown key; TRL's "
         "gradient_accumulation_steps is part of what rollout.prompts_per_batch x "
         "rollout.group_size / algorithm.minibatches gives per optimizer step (no one key) "
         "here (docs/from_trl.md)"),
        ("temperature=0.7", "temperature: unknown key; TRL's temperature is "
         "rollout.temperature here (docs/from_trl.md)"),
        ("loss_type=dapo", "loss_type: unknown key; TRL's loss_type has no equivalent here: "
         "gspo has one aggregation, TRL's \"grpo\" (the mean of each response's token mean) "
         "(docs/from_trl.md)"),
        ("data.task=calculater", "(got 'calculater'); did you mean 'calculator'?"),
        ("algorithm.level=sequnce", "(got 'sequnce'); did you mean 'sequence'?"),
        ("model.dtype=fp16", "(got 'fp16'); did you mean 'float16'?"),  # (no match before)
        ("model.dtype=half", "(got 'half'); did you mean 'float16'?"),
        ("reward.functions=[exact_mach]", "numeric_match); did you mean 'exact_match'?"),
    ],
)  # fmt: skip
def test_unknown_keys_and_values_suggest_the_closest(tmp_path, override, expected):
    with pytest.raises(ValueError) as info:  # the reward's is a RewardError, when loaded
        config = load_config(overrides=[override])
        from gspo.rewards import RewardFunctions

        RewardFunctions.from_specs(config.reward.functions)
    assert str(info.value).endswith(expected)
    with pytest.raises(ConfigError, match=r"^data.max_prompt_len: unknown key; verl's max_prompt_"):
        load_config(overrides=["data.max_prompt_len=512"])  # (it said 'data.prompt_column')
    with pytest.raises(ConfigError, match=r"eval_every: unknown key; did you mean 'eval.every'"):
        load_config().train.eval_every = 2  # (set from Python too)
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["optim.zzzz=1"])  # nothing close: no suggestion
    assert str(info.value) == "optim.zzzz: unknown key"


def test_a_config_file_of_several_unknown_keys_names_them_all(tmp_path):
    """A TRL config file given as is: one key said per try (seven tries for seven); the
    file named (it was not, unlike an override's key)."""
    (tmp_path / "trl.yaml").write_text("learning_rate: 1.0e-6\nnum_generations: 8\nbeta: 0.04\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "trl.yaml")
    assert str(info.value) == (
        f"{tmp_path / 'trl.yaml'}: learning_rate: unknown key; TRL's learning_rate is optim.lr "
        "here (docs/from_trl.md) (also unknown: num_generations, beta)"
    )
    # an override's own error is not the file's (a cross-section check's key=value first)
    (tmp_path / "ok.yaml").write_text("train:\n  max_steps: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "ok.yaml", ["rollout.group_size=1"])
    assert str(info.value).startswith("rollout.group_size=1: ")


@pytest.mark.parametrize(
    ("name", "level"),
    [("gspo", "sequence"), ("GSPO-token", "sequence_token"), ("gspo_token", "sequence_token"),
     ("grpo", "token"), ("token", "token")],
)  # fmt: skip
def test_algorithm_names_are_accepted_for_the_level(name, level):
    from gspo.objectives import DEFAULT_CLIP

    config = load_config(overrides=[f"algorithm.level={name}"])
    assert config.algorithm.level == level
    # the clip range left null is the level's paper one: GRPO's 0.2 / 0.27
    assert config.algorithm.clip_low is None and config.algorithm.clip_high is None
    assert DEFAULT_CLIP[config.algorithm.level] == ((0.2, 0.27) if name in ("grpo", "token")
                                                    else (3e-4, 4e-4))  # fmt: skip


def test_one_reward_function_needs_no_list():
    assert load_config(overrides=["reward.functions=numeric_match"]).reward.functions == [
        "numeric_match"
    ]


def test_a_group_of_one_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["rollout.group_size=1"])
    assert str(info.value).startswith("rollout.group_size=1: GSPO, GRPO and GSPO-token are "
                                      "group-relative")  # fmt: skip
    assert load_config(overrides=["rollout.group_size=2"]).rollout.group_size == 2


@pytest.mark.parametrize(
    ("overrides", "first"),
    [
        # a section's own rule between two rules across sections, and the other way round
        (["rollout.prompts_per_batch=1", "algorithm.minibatches=9", "reward.weights=[1, 2]"],
         "algorithm.minibatches=9 exceeds the rollout batch of 8 responses"),
        (["reward.weights=[1, 2]", "rollout.engine=vllm", "rollout.top_p=0.9",
          "algorithm.old_logprobs=sampler"], "reward.weights has 2 entries"),
        (["rollout.engine=vllm", "rollout.top_p=0.9", "algorithm.old_logprobs=sampler",
          "data.prompt_template={}"], "rollout.top_p < 1 with rollout.engine=vllm"),
        (["rollout.engine=vllm", "rollout.logit_noise=0.1", "rollout.max_staleness=1",
          "moe.routing_replay=true"], "moe.routing_replay needs rollout.max_staleness=0"),
        (["model.lora.r=8", "model.lora.target_modules=[]", "rollout.engine=vllm",
          "rollout.logit_noise=0.1"], "rollout.logit_noise is for the torch engine"),
        (["model.lora.r=8", "model.lora.target_modules=[]", "moe.routing_replay=true",
          "train.cold_start_steps=0"], "model.lora.target_modules: empty list"),
        # a section's error on a key's own bounds comes before every rule
        (["model.heads=3", "optim.lr=0"], "optim.lr: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_rules_run_in_a_fixed_order(overrides, first):
    """Where several rules are broken, the error is the first in Config._consistent's order."""
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert str(info.value).startswith(first), str(info.value)


def test_output_dir_has_help_text():
    from gspo.cli import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for command in ("train", "compare"):
        (action,) = [a for a in commands[command]._actions if "--output-dir" in a.option_strings]
        assert action.help and "default" in action.help


def test_overrides_have_help_text_whose_example_loads():
    """The key.sub=value of each command's --help had no word saying what it is."""
    from gspo.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("train", "compare", "eval", "config"):
        (action,) = [a for a in commands[command]._actions if a.dest == "overrides"]
        assert action.help and "gspo config --doc" in action.help
        example = re.search(r"e\.g\. (.*?) \(", action.help).group(1).split()
        assert len(example) == 2 and load_config(overrides=example).train.max_steps == 50


def test_malformed_override():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("justakey")


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n- not sections\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    # the recipes audit: an empty file ran the built-in task unsaid; a section with every
    # key commented out was "Input should be a valid dictionary"; an unknown section's
    # line lost the file; a key the command line set was blamed on the file
    (tmp_path / "empty.yaml").write_text("# optim:\n#   lr: 1e-6\n")
    with pytest.raises(ConfigError, match=r"^\S*empty.yaml: sets nothing \(empty, or comments"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "none.yaml").write_text("optim:\n#  lr: 1e-6\ntrain:\n  seed: 3\n")
    assert load_config(tmp_path / "none.yaml").optim == load_config(None).optim
    (tmp_path / "nested.yaml").write_text("model:\n  lora:\n#    r: 4\n")  # (the reviewer's)
    assert load_config(tmp_path / "nested.yaml").model.lora == load_config(None).model.lora
    # a key the command line set that only begins like the file's (data.eval, eval_size)
    (tmp_path / "size.yaml").write_text("data:\n  eval_size: -5\n")
    with pytest.raises(ConfigError, match=r"^\S*size.yaml: data.eval_size: Input should be"):
        load_config(tmp_path / "size.yaml", ["data.eval=e.jsonl"])
    (tmp_path / "unknown.yaml").write_text("optimizer:\n  lr: 1e-5\n")
    with pytest.raises(ConfigError, match=r"^\S*unknown.yaml: optimizer: unknown key; did you"):
        load_config(tmp_path / "unknown.yaml")
    (tmp_path / "lora.yaml").write_text("model:\n  lora:\n    r: 8\n")
    with pytest.raises(ConfigError, match=r"^model.lora.r=8 needs train.cold_start_steps=0"):
        load_config(tmp_path / "lora.yaml", ["train.cold_start_steps=10"])


def test_a_boolean_for_a_number_and_a_short_pair_are_one_line_each():
    """pydantic took true for 1 (train.max_steps=true trained one step) and said
    "optim.betas.1: Field required" for one beta."""
    for key in ("train.max_steps", "optim.lr", "algorithm.correction_max"):
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"{key}=true"])
        assert str(err.value).startswith(f"{key}: a number, not true or false")
    with pytest.raises(ConfigError, match=r"^optim.betas: expected 2 values \(got \[0.9\]\)$"):
        load_config(None, ["optim.betas=[0.9]"])
    config = load_config(None, ["rollout.cuda_graphs=true", "log.progress=false"])
    assert config.rollout.cuda_graphs is True and config.log.progress is False  # booleans
    with pytest.raises(ConfigError, match="^train.max_steps: a number"):
        config.train.max_steps = True


def test_cli_bad_key_is_one_line_exit_2(capsys):
    code = main(["train", "optim.nope=1", "--output-dir", "unused"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "gspo: error: optim.nope: unknown key"


def test_an_error_line_under_several_ranks_names_the_rank(capsys, monkeypatch):
    """Under torchrun every rank prints an error of its own (one found once training runs
    may be one rank's): the line says which rank; one process's line stays as it was."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["config", "optim.nope=1"]) == 2
    said = capsys.readouterr().err.strip()
    assert said == "gspo: error (rank 1 of 2): optim.nope: unknown key"
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert main(["config", "optim.nope=1"]) == 2
    assert capsys.readouterr().err.strip() == "gspo: error: optim.nope: unknown key"


def test_cli_config_prints_resolved_yaml(capsys, tmp_path):
    assert main(["config", "optim.lr=0.5"]) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "#" not in out
    # beside model.path the built-in sizes printed read as its model's: a comment says not
    assert main(["config", "model.path=/models/mine", "model.layers=2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    at = lines.index("  path: /models/mine")
    assert lines[at + 1].startswith("  # builtin to norm_topk_prob: the built-in model's sizes")
    (tmp_path / "printed.yaml").write_text(out)  # (it loads back)
    assert load_config(tmp_path / "printed.yaml").model.layers == 2
    # a path YAML wraps onto two lines: the comment went between them (invalid YAML)
    long = "/models/a folder with spaces/" + "deep " * 16 + "/mine"
    assert main(["config", f"model.path={long}"]) == 0
    (tmp_path / "long.yaml").write_text(capsys.readouterr().out)
    assert load_config(tmp_path / "long.yaml").model.path == long


def test_committed_configuration_reference_is_current():
    committed = REFERENCE.read_text() if REFERENCE.is_file() else ""
    assert committed == render_reference(), (
        f"docs/configuration.md is out of date with src/gspo/config/; run `{REGENERATE}`"
    )


def test_reference_lists_every_key_with_its_default():
    page = render_reference()
    rows = {
        line.split(" | ")[0].removeprefix("| ").strip("`"): line
        for line in page.splitlines()
        if line.startswith("| `")
    }
    names = [name for name, _ in sections()]
    assert names == [
        "model", "model.lora", "data", "reward", "rollout", "rollout.vllm",
        "algorithm", "optim", "train", "eval", "moe", "log",
    ]  # fmt: skip
    expected = set()
    for name, section in sections():
        assert f"## `{name}`" in page
        for key, field in keys(section):
            dotted = f"{name}.{key}"
            expected.add(dotted)
            assert dotted in rows, f"{dotted} missing from the reference"
            assert f"| `{format_default(field)}` |" in rows[dotted], dotted
            assert field.description, f"{dotted} has no description"
    assert set(rows) == expected
    # the defaults are YAML, as `gspo config` prints them
    assert "| `0.0001` |" in rows["optim.lr"]
    assert "| `[exact_match]` |" in rows["reward.functions"]
    assert "| `null` |" in rows["rollout.vllm.max_model_len"]
    assert ">= 1, <= 6" in rows["data.digits"]
    assert "| `true` |" in rows["rollout.vllm.enforce_eager"]


def test_cli_config_doc_prints_the_reference(capsys):
    assert main(["config", "--doc"]) == 0
    assert capsys.readouterr().out == render_reference()
    assert main(["config", "--doc", "optim.lr=1"]) == 2


def test_text_keys_take_the_value_as_written():
    template = "Q: {question}\nA: [think] - step: 1, 2 #"
    c = load_config(
        overrides=[
            "model.path=/models/a:b #1",
            "data.train=openai/gsm8k:main:train",
            "algorithm.level= token ",  # a choice: spaces around it dropped
            "data.eval=null",
            "model.device=cuda:1",
            "optim.lr=3e-4",  # non-text keys still parse as YAML
            "reward.functions=[math, format]",
        ]
    )
    assert c.model.path == "/models/a:b #1"
    assert c.data.train == "openai/gsm8k:main:train"
    assert c.algorithm.level == "token"
    assert c.data.eval is None
    assert c.model.device == "cuda:1"
    assert c.optim.lr == pytest.approx(3e-4)
    assert c.reward.functions == ["math", "format"]
    # what YAML would have turned into something else stays text
    assert parse_override("model.path=yes") == ("model.path", "yes")
    assert parse_override("model.path=123") == ("model.path", "123")
    assert parse_override(f"model.path={template}") == ("model.path", template)
    # nothing after '=': an unset shell variable (model.path=$MODEL trained the built-in)
    for empty in ("model.path=", "optim.lr= ", "data.eval="):
        with pytest.raises(ConfigError, match=r"^\w+\.\w+: no value after '=' \(an unset"):
            parse_override(empty)
    # unknown keys and whole sections fall back to YAML and are then refused by name
    with pytest.raises(ConfigError, match="data.nosuch: unknown key"):
        load_config(overrides=["data.nosuch=Q: {x}"])


@pytest.mark.parametrize(
    "argv",
    [
        ["config", "optim.lr=0.5", "--config", "CFG", "train.max_steps=7"],
        ["config", "--config", "CFG", "optim.lr=0.5", "train.max_steps=7"],
        ["config", "optim.lr=0.5", "train.max_steps=7", "--config", "CFG"],
    ],
)
def test_cli_overrides_anywhere_on_the_line(tmp_path, capsys, argv):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("optim:\n  lr: 0.01\n  warmup_steps: 3\n")
    argv = [str(cfg) if a == "CFG" else a for a in argv]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "lr: 0.5" in out and "max_steps: 7" in out and "warmup_steps: 3" in out


def test_cli_train_and_compare_take_overrides_after_options(tmp_path):
    from gspo.cli import parse_args

    argv = ["train", "a.b=1", "--output-dir", str(tmp_path), "c.d=Q: {x}", "--overwrite"]
    args = parse_args(argv)
    assert args.overrides == ["a.b=1", "c.d=Q: {x}"] and args.overwrite
    args = parse_args(["compare", "--seeds", "2", "a.b=1", "--preset", "stress", "c.d=2"])
    assert args.overrides == ["a.b=1", "c.d=2"] and args.seeds == 2


@pytest.mark.parametrize("stray", ["--bogus", "notanoverride"])
def test_cli_unknown_words_are_argparse_errors(capsys, stray):
    with pytest.raises(SystemExit) as info:
        main(["train", "a.b=1", "--output-dir", "unused", stray])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"gspo: unrecognized arguments: {stray} (see gspo --help)\n")


@pytest.mark.parametrize(
    ("argv", "near"),
    [(["train", "--output_dir", "x"], "--output-dir"),
     (["compare", "--presets", "long"], "--preset"),
     (["compare", "--no_cache"], "--no-cache"), (["export", "RUN", "--zzz", "d"], None),
     (["train", "--lr", "1e-4"], None), (["compare", "--seed", "2"], "--seeds"),
     (["train", "--out", "x"], "--output-dir"), (["train", "--o", "x"], None),
     (["train", "--learning_rate=1e-6"], "TRL's learning_rate is optim.lr here; settings are "
      "key=value words, without dashes (optim.lr=1e-6)"),
     (["train", "--optim.lr", "1e-6"], "settings are key=value words, without dashes"),
     (["train", "--max-steps", "2"], "TRL's max_steps is train.max_steps here; settings are"),
     (["train", "--per-device-train-batch-size=4"], "TRL's per_device_train_batch_size is ")],
)  # fmt: skip
def test_cli_a_misspelt_option_names_the_closest(capsys, argv, near):
    """TRL spells its options with underscores (--output_dir): "unrecognized arguments"
    alone left the user to find the dash."""
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr().err
    assert err.startswith("gspo: unrecognized arguments: "), err
    if near is not None and not near.startswith("--"):
        assert near in err, err
    else:
        assert (f"; did you mean {near}?" in err) == (near is not None), err


def test_cli_bad_argument_values_are_one_line(capsys):
    """argparse printed its usage block (three lines) before the error."""
    with pytest.raises(SystemExit) as info:
        main(["compare", "--seeds", "abc"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "gspo compare: argument --seeds: invalid int value: 'abc' (see gspo compare --help)\n"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.heads=3"], "model.hidden=256 must be model.heads=3 times an even head size"),
        (["model.hidden=96", "model.heads=32"], "even head size"),  # head size 3
        (["model.kv_heads=3"], "model.kv_heads=3 must divide model.heads=4"),
        (
            ["model.builtin=qwen3_moe", "model.experts=2", "model.experts_per_token=4"],
            "model.experts_per_token=4 exceeds model.experts=2",
        ),
    ],
)
def test_builtin_sizes_that_cannot_build_a_model_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    # a model.path brings its own sizes: the built-in keys are ignored
    load_config(None, [*overrides, "model.path=/some/model"])


@pytest.mark.parametrize("device", ["tpu", "cuda:0"])
def test_unusable_devices_are_one_line_errors(device, tmp_path, capsys):
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = ["train", "--output-dir", str(tmp_path / "run"), f"model.device={device}"]
    assert main([*run, "train.max_steps=1"]) == 2
    err = capsys.readouterr().err.strip()
    # a name torch has no device for is the config's error, a missing device the run's
    said = "model.device: not a torch device" if device == "tpu" else f"model.device={device}:"
    assert err.startswith(f"gspo: error: {said}") and "\n" not in err, err


@pytest.mark.parametrize(
    ("override", "said"),
    [  # before: ".bool: ... a valid boolean", ".str: ... (got ['q_proj', 5])", no aliases
        ("rollout.cuda_graphs=AUTO",
         "rollout.cuda_graphs: Input should be a valid boolean or 'auto' (got 'AUTO')"),
        ("model.lora.target_modules=[q_proj, 5]",
         "model.lora.target_modules.1: Input should be a valid string (got 5)"),
        ("algorithm.level=gpso",
         "algorithm.level: one of sequence (gspo), sequence_token (gspo_token), token (grpo) "
         "(got 'gpso'); did you mean 'gspo'?"),
    ],
)  # fmt: skip
def test_a_union_or_an_alias_is_said_as_the_user_wrote_it(override, said):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value) == said


def test_config_files_read_as_yaml_and_overrides_do(tmp_path, capsys):
    """Merge keys and anchors (refused before), 1e3 as a number (an override's reading,
    a string in a file before), a dotted key in a file as nested, a section override
    merged into the file's section (it replaced it, dropping weight_decay), a second
    --config (silently replaced the first), a file that is not UTF-8 (named now)."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "optim:\n  lr: &lr 0.5\n  <<: {weight_decay: 0.1}\ntrain:\n  max_steps: 1e3\n"
        "  cold_start_lr: *lr\noptim.grad_clip: 2.0\n"
    )
    config = load_config(path, ["optim={lr: 0.25}"])
    assert (config.optim.lr, config.optim.weight_decay, config.optim.grad_clip) == (0.25, 0.1, 2)
    assert (config.train.max_steps, config.train.cold_start_lr) == (1000, 0.5)
    with pytest.raises(SystemExit):
        main(["config", "--config", str(path), "--config", str(path)])
    assert "--config given twice" in capsys.readouterr().err
    # a key beside a merge overrides what the merge brings (a "duplicate key" before)
    path.write_text("optim: {<<: {lr: 0.001, weight_decay: 0.1}, lr: 0.002}\n")
    assert (load_config(path).optim.lr, load_config(path).optim.weight_decay) == (0.002, 0.1)
    # a setting whose value is a mapping is replaced, not merged (only sections merge)
    path.write_text("data:\n  chat_template_kwargs: {enable_thinking: true, foo: 1}\n")
    kwargs = load_config(path, ["data.chat_template_kwargs={enable_thinking: false}"])
    assert kwargs.data.chat_template_kwargs == {"enable_thinking": False}
    # a text that reads as a number in a file is written back quoted: config.yaml reloads
    text = load_config(None, ["data.system_prompt=1e3"])
    path.write_text(dump_config_text(text))
    assert load_config(path).data.system_prompt == "1e3"
    path.write_text("optim.lr: 0.5\noptim: {lr: 0.25, weight_decay: 0.1}\n")  # (last won)
    with pytest.raises(
        ConfigError,
        match=r"c.yaml: optim.lr is written twice \(the second time under the top-level "
        r"key 'optim:'\); keep one",
    ):
        load_config(path)
    path.write_bytes(b"optim:\n  lr: \xff\n")
    with pytest.raises(ConfigError, match=r"c.yaml: not UTF-8 text \(invalid start byte"):
        load_config(path)


def test_a_config_file_with_a_duplicate_key_or_a_syntax_error_names_line_and_column(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  max_steps: 1\n  max_steps: 3\n")  # PyYAML alone keeps the 3
    with pytest.raises(ConfigError) as err:
        load_config(dup)
    assert str(err.value) == f"{dup} line 3 column 3: not valid YAML (duplicate key 'max_steps')"
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  max_steps: 1\n   seed: [\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line 3 column 8: not valid YAML \(mapping"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"config file .*: is a directory, not a YAML file"):
        load_config(tmp_path)
    fine = tmp_path / "fine.yaml"  # one key per mapping: read as before
    fine.write_text("train:\n  max_steps: 3\n  seed: 4\nmodel:\n  lora:\n    alpha: 2\n")
    config = load_config(fine)
    assert (config.train.max_steps, config.train.seed, config.model.lora.alpha) == (3, 4, 2)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("optim.lr=.inf", "optim.lr: Input should be a finite number (got inf)"),
        ("algorithm.clip_low=nan", "algorithm.clip_low: Input should be a finite number"),
        ("optim.betas=[1.5, 0.99]", "optim.betas.0: Input should be less than 1 (got 1.5)"),
        ("optim.betas=[0.9, -0.1]", "optim.betas.1: Input should be greater than or equal to 0"),
    ],
)
def test_floats_are_finite_and_betas_in_range(override, said):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(said)


def test_model_path_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_config(None, ["model.path=~/models/q"]).model.path == str(tmp_path / "models/q")


def test_built_in_sizes_that_match_model_paths_model_are_not_warned(tmp_path):
    """gspo compare names its cold start (made from the preset's sizes) as model.path, with
    those sizes still set: no warning that they do nothing (three per seed before)."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    same = ["model.builtin=qwen3", "model.layers=2", f"model.path={tmp_path}"]
    assert load_config(None, same).warnings() == []
    other = load_config(None, ["model.layers=3", f"model.path={tmp_path}"]).warnings()
    assert len(other) == 1 and other[0].startswith("model.layers is set but model.path")
    # with no cold-start rows (the user's data, no data.sft) its step 0 holds no weights,
    # only the model it points at (model_dir.txt): that model's sizes are the ones compared
    step = tmp_path / "cold_start" / "checkpoints" / "step-0000000"
    step.mkdir(parents=True)
    (step / "model_dir.txt").write_text("../../..\n")
    same = ["model.builtin=qwen3", "model.layers=2", f"model.path={step}"]
    assert load_config(None, same).warnings() == []
    other = load_config(None, ["model.layers=3", f"model.path={step}"]).warnings()
    assert len(other) == 1 and other[0].startswith("model.layers is set but model.path")


def test_settings_that_another_setting_makes_moot_are_warned():
    """Before: adapter settings with r=0 trained the whole model, and a built-in task named
    beside data.train (e.g. --preset tools) ran without its environment, both unsaid."""
    lora = load_config(None, ["model.lora.target_modules=[q_proj]"]).warnings()
    assert lora == [
        "model.lora.target_modules is set but model.lora.r=0 (full fine-tuning): the LoRA "
        "settings do nothing (set model.lora.r > 0 for adapters)"
    ]
    with_r = ["model.lora.r=4", "model.lora.target_modules=[q_proj]", "train.cold_start_steps=0"]
    assert load_config(None, with_r).warnings() == []
    # dropout: pi_old recomputed under the update's masks (auto), unless it cannot be
    dropout = [*with_r, "model.lora.dropout=0.05"]
    assert load_config(None, dropout).warnings() == []
    assert load_config(None, [*dropout, "algorithm.old_logprobs=sampler"]).warnings() == [
        "model.lora.dropout=0.05: the update's forward drops adapter inputs that the "
        "sampler's log-probs (algorithm.old_logprobs=sampler) kept, so on-policy ratios are "
        "not 1 and GSPO's narrow clip range clips responses of the on-policy minibatch (0 "
        "keeps them 1)"
    ]
    assert (
        "the async producer's pi_old (rollout.max_staleness > 0)"
        in load_config(None, [*dropout, "rollout.max_staleness=1"]).warnings()[0]
    )
    # TRL's epsilon=0.2 ported as clip_low alone: GSPO's clip_high 4e-4 above, unsaid
    assert load_config(None, ["algorithm.clip_low=0.2"]).warnings() == [
        "algorithm.clip_low=0.2 beside the sequence level's clip_high=0.0004: the clip band "
        "is [0.8, 1.0004] (TRL's epsilon sets both: set algorithm.clip_high too)"
    ]
    both = ["algorithm.clip_low=0.2", "algorithm.clip_high=0.28"]
    for kept in (["algorithm.clip_high=5e-4"], both, ["algorithm.level=grpo", both[1]]):
        assert load_config(None, kept).warnings() == [], kept
    rounds = ["rollout.filter_max_rounds=8"]  # ignored without filter_groups, unsaid before
    assert load_config(None, rounds).warnings() == [
        "rollout.filter_max_rounds is set but rollout.filter_groups=false: no group is "
        "filtered, so no extra round is sampled (set rollout.filter_groups=true for dynamic "
        "sampling)"
    ]
    assert load_config(None, [*rounds, "rollout.filter_groups=true"]).warnings() == []
    # 16 responses in 3 minibatches of 6, 5, 5: unequal weights, accepted unsaid before
    uneven = ["rollout.group_size=4", "rollout.prompts_per_batch=4", "algorithm.minibatches=3",
              "train.max_steps=6"]  # fmt: skip
    assert load_config(None, uneven).warnings() == [
        "algorithm.minibatches=3 does not divide the rollout batch of 16 responses "
        "(rollout.prompts_per_batch x rollout.group_size): minibatches of 6 and 5, whose "
        "responses weigh unequally in their optimizer steps (TRL refuses such a split); use "
        "a divisor"
    ]
    assert load_config(None, [*uneven[:2], "algorithm.minibatches=8"]).warnings() == []
    # train.max_steps=2 in rollout batches of 4 steps took 4, unsaid
    assert load_config(None, ["train.max_steps=2"]).warnings() == [
        "train.max_steps=2 is not a whole number of rollout batches of "
        "algorithm.minibatches=4 optimizer steps: the run takes 4"
    ]
    # settings that do nothing beside others, unsaid before (a built-in size with
    # model.path, experts on the dense built-in, turns without an environment, a buffer
    # without a penalty); a task's own model sizes with model.path are not set at all
    inert = {
        "model.layers=8": "model.layers is set but model.path names a model",
        "model.experts=64": "model.experts is set but model.builtin=qwen3 has no experts",
        "rollout.max_turns=9": "rollout.max_turns is set but there is no rollout.environment",
        "rollout.env_timeout=5": "rollout.env_timeout is set but there is no rollout.environment",
        "reward.overlong_buffer=2": "reward.overlong_buffer is set but reward.overlong_penalty=0",
    }
    for override, said in inert.items():
        extra = ["model.path=/m"] if override == "model.layers=8" else []
        lines = load_config(None, [override, *extra]).warnings()
        assert len(lines) == 1 and lines[0].startswith(said), lines
    chain = load_config(None, ["data.task=chain", "model.path=/m"])
    assert chain.warnings() == [] and "layers" not in chain.model.model_fields_set
    assert load_config(None, ["data.task=calculator", "rollout.max_turns=2"]).warnings() == []
    task = ["data.task=calculator", "data.train=rows.jsonl", "model.path=/m", "data.eval=e.jsonl"]
    assert load_config(None, task).warnings() == [
        "data.task=calculator is a built-in task, which data.train replaces: its prompts, "
        "rewards and environment are not used (set rollout.environment and reward.functions "
        "for your data)"
    ]
    mine = ["data.train=rows.jsonl", "model.path=/m"]
    assert load_config(None, [*mine, "data.eval=e.jsonl"]).warnings() == []
    # the gold answer put in every prompt by a single-brace \boxed{answer} (the recipes audit)
    leak = [*mine, "data.eval=e.jsonl", "data.prompt_template='{question} in \\boxed{answer}'"]
    assert load_config(None, leak).warnings() == [
        "data.prompt_template reads {answer}, the column the rewards score against: every "
        "prompt holds its own answer (literal braces are doubled: \\boxed{{}})"
    ]
    gsm8k = [
        *leak[:-1],
        "data.answer_column=solution",
        "data.prompt_template='{question} {answer}'",
    ]
    assert load_config(None, gsm8k).warnings() == []  # (another column is scored against)
    assert len(load_config(None, [*gsm8k, "data.prompt_template='{solution}'"]).warnings()) == 1
    # a template without a field: every prompt the same text, unsaid before
    fixed = [*mine, "data.eval=e.jsonl", "data.prompt_template=Solve this."]
    assert load_config(None, fixed).warnings() == [
        "data.prompt_template names no column (as {question}): every prompt is the same text "
        "(single braces name a column, doubled ones are literal)"
    ]
    assert load_config(None, [*fixed, "rollout.environment=gspo.environments:Calculator"]) \
        .warnings() == []  # fmt: skip
    # eval.* keys set and nothing evaluated, unsaid before
    assert load_config(None, [*mine, "eval.every=10"]).warnings() == [
        "data.train without data.eval: no held-out evaluation runs (no eval/* metrics, "
        "accuracy rows or plot; set data.eval to a held-out file)"
    ]


def test_evaluating_on_the_training_data_is_said(tmp_path, monkeypatch):
    """data.eval naming data.train's file (or the same hub split) ran without a word, its
    eval/* then measuring the prompts trained on."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "other.jsonl").write_text('{"prompt": "1+2=", "answer": "3"}\n')
    said = "data.eval is data.train ({}): the held-out evaluation scores the training prompts"
    for train, eval_ in [
        ("rows.jsonl", "./rows.jsonl"),
        ("rows.jsonl", str(tmp_path / "rows.jsonl")),
        ("openai/gsm8k:main:train", "openai/gsm8k:main:train"),
    ]:
        config = load_config(None, [f"data.train={train}", f"data.eval={eval_}", "model.path=/m"])
        assert [line[: len(said.format(eval_))] for line in config.warnings()] == [
            said.format(eval_)
        ]
    for eval_ in ("other.jsonl", "openai/gsm8k:main:test", "missing.jsonl"):
        overrides = ["data.train=rows.jsonl", f"data.eval={eval_}", "model.path=/m"]
        assert load_config(None, overrides).warnings() == []


def test_a_tracker_set_to_true_is_on_with_its_own_defaults():
    """TRL's report_to="wandb" ported as log.wandb=true was refused ("Input should be a
    valid dictionary")."""
    config = load_config(overrides=["log.wandb=true", "log.mlflow=false"])
    assert (config.log.wandb, config.log.mlflow) == ({}, None)


def test_a_path_object_is_taken_where_a_path_string_is():
    """``config.data.train = Path("x.csv")`` was refused (a valid string expected)."""
    from pathlib import Path

    config = load_config()
    config.data.train, config.model.path = Path("x.csv"), Path("/models/m")
    assert (config.data.train, config.model.path) == ("x.csv", "/models/m")


def test_a_list_the_shell_split_at_a_space_says_to_quote_it():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["reward.functions=[exact_match,", "format]"])
    assert str(info.value) == (
        "reward.functions: cannot parse value '[exact_match,' as YAML (the shell split it at "
        "a space: quote it whole, 'reward.functions=[exact_match, ...')"
    )
    with pytest.raises(ConfigError) as info:  # (no space to split at: a missing bracket)
        load_config(overrides=["reward.functions=[exact_match"])
    assert str(info.value).endswith("'[exact_match' as YAML (no closing ']')")
    with pytest.raises(ConfigError) as info:  # (a mapping splits after its colon)
        load_config(overrides=["data.chat_template_kwargs={enable_thinking:", "false}"])
    assert "(the shell split it at a space: quote it whole" in str(info.value)


def test_every_trl_field_named_leads_to_a_gspo_key():
    """Each TRL field's hint names keys that exist (a hint to a key that is not there
    would be a second refusal), and each field of either table is refused with its hint."""
    from gspo.config.ported import TRL_NAMES, TRL_WITHOUT

    names = {f"{s}.{k}" for s, model in sections() for k, _ in keys(model)} | {
        s for s, _ in sections()
    }
    for field, where in TRL_NAMES.items():
        for name in re.findall(r"\b[a-z_]+\.[a-z_.]+\b", where):
            assert name in names, (field, name)
        with pytest.raises(ConfigError, match=f"^{field}: unknown key; TRL's {field} is "):
            load_config(overrides=[f"{field}=1"])
    for field in TRL_WITHOUT:
        with pytest.raises(ConfigError, match=f"TRL's {field} has no equivalent here: "):
            load_config(overrides=[f"{field}=1"])


def test_every_verl_key_named_leads_to_a_gspo_key():
    """verl's ppo_mini_batch_size (a size) was taken for algorithm.minibatches (a count)
    and its clip_ratio_c (dual clip) for algorithm.clip_low, by closeness alone."""
    from gspo.config.ported import VERL_NAMES, VERL_WITHOUT

    names = {f"{s}.{k}" for s, model in sections() for k, _ in keys(model)} | {
        s for s, _ in sections()
    }
    for field, where in VERL_NAMES.items():
        for name in re.findall(r"\b[a-z_]+\.[a-z_.]+\b", where):
            assert name in names or name.startswith("data.train_batch"), (field, name)
        for key in (field, f"algorithm.{field}"):
            with pytest.raises(ConfigError, match=f"^{key}: unknown key; verl's {field} is "):
                load_config(overrides=[f"{key}=1"])
    for field in VERL_WITHOUT:
        with pytest.raises(ConfigError, match=f"verl's {field} has no equivalent here: "):
            load_config(overrides=[f"algorithm.{field}=1"])
    with pytest.raises(
        ConfigError, match=r"^rollout.n: unknown key; verl's n is rollout.group_size"
    ):
        load_config(overrides=["rollout.n=8"])
    with pytest.raises(ConfigError, match=r"^optim.n: unknown key$"):  # (verl's under rollout)
        load_config(overrides=["optim.n=8"])
    # verl's clip_ratio_c=3 ported as clip_low: a floor of 1 - 3, no clipping below, unsaid
    with pytest.raises(ConfigError, match=r"^algorithm.clip_low: Input should be less than 1"):
        load_config(overrides=["algorithm.clip_low=3"])


def test_an_in_memory_dataset_as_a_source_is_one_line_saying_what_to_do():
    """config.data.train = Dataset(...) gave its repr over four lines, and no way on."""
    import datasets

    config = load_config()
    with pytest.raises(ConfigError) as info:
        config.data.train = datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}])
    said = str(info.value)
    assert "\n" not in said and said.startswith("data.train: Input should be a valid string")
    assert said.endswith("save the object first (dataset.save_to_disk(DIR), then the path DIR)")
    with pytest.raises(ConfigError) as info:  # (rows as a list of dicts, TRL's habit)
        config.data.eval = [{"prompt": "a", "answer": "1"}]
    said = str(info.value)
    assert "\n" not in said and said.startswith("data.eval: Input should be a valid string")
    assert said.endswith(
        "write the rows to a file first (JSON Lines: one json.dumps(row) a line), then its path"
    )


def test_the_environment_reward_without_an_environment_is_refused_up_front():
    """It failed at the first reward call, naming a line of gspo's verifiers."""
    with pytest.raises(ConfigError, match="'environment' is each episode's environment's own"):
        load_config(overrides=["reward.functions=[environment]"])
    config = load_config(overrides=["data.task=calculator", "reward.functions=[environment]"])
    assert config.environment is not None


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("exact_mach", "invalid reward function spec 'exact_mach': not a built-in name"),
        ("rw.py", "invalid reward function spec 'rw.py': no ':name' part; expected"),
        ("rw.py:a,format", "'a,format' after ':' is not a Python name"),
        ("a.b.c", "no ':name' part (a.b:c?)"),
        ("rw.py: f", "{rw.py: f} was read as a mapping (YAML takes ': ' as one); write rw.py:f"),
        ("[]", "empty; name one at least"),
    ],
)
def test_a_malformed_reward_spec_is_refused_before_a_run(spec, said, capsys):
    """gspo config printed these as a good config (gspo train refused each when it loaded
    the functions), and a config made in Python took them: the spec is checked as text now,
    nothing imported."""
    from gspo.cli import main

    assert main(["config", f"reward.functions={spec}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: error: reward.functions: ") and said in err, err
    config = load_config()
    config.reward.functions = ["exact_match", "my.py:fine", "pkg.mod:fine"]  # (not loaded)
    assert config.check() is config
    config.reward.functions = ["exact_mach"]  # (gspo.train checks the config first)
    with pytest.raises(ConfigError, match="reward.functions: invalid reward function spec"):
        config.check()
    # an environment's spec too (gspo config printed it; gspo train refused it)
    with pytest.raises(ConfigError, match=r"rollout.environment: invalid environment spec "
                       r"'a.b.C': no ':name' part \(a.b:C\?\)"):  # fmt: skip
        load_config(overrides=["rollout.environment=a.b.C"])


@pytest.mark.parametrize("weights", ["1,0.1", "1 0.1", "1, 0.1"])
def test_weights_written_without_brackets_say_how_to_write_a_list(weights, capsys):
    """reward.weights=1,0.1 said 'Input should be a valid list (got '1,0.1')'; the same
    slip in reward.functions says how to write the list."""
    assert main(["config", f"reward.weights={weights}"]) == 2
    assert capsys.readouterr().err == (
        "gspo: error: reward.weights: several weights are a list, reward.weights='[1, 0.1]' "
        f"(got {weights!r})\n"
    )
    assert load_config(None, ["reward.weights=[1, 0.1]", "reward.functions=[exact_match, format]"])


def test_a_mapping_assigned_from_python_is_not_said_to_be_a_yaml_slip():
    """``config.reward.functions = [{"correct": correct}]`` was told it had been read as a
    mapping from YAML (``rw.py: fn``) and to write ``correct:<function correct at 0x..>``."""

    def correct(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    config = load_config()
    with pytest.raises(ConfigError) as raised:
        config.reward.functions = [{"correct": correct}]
    assert str(raised.value).startswith(
        "reward.functions: item 0 is neither a spec string nor a function: dict (got "
    )
    with pytest.raises(ConfigError, match="was read as a mapping"):  # YAML's slip still is
        config.reward.functions = [{"rw.py": "fn"}]


@pytest.mark.parametrize("world", ["x", "", "0", "-1"])
def test_a_world_size_set_by_hand_is_one_line_naming_it(world, capsys, monkeypatch):
    """WORLD_SIZE=x was a traceback of int() (cli.py read it in several places, before
    anything could say it); WORLD_SIZE=0 ran as one process without a word."""
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "abc")
    for command in (["config"], ["eval", "runs/none"], ["train", "--output-dir", "runs/none"]):
        assert main(command) == 2
        said = capsys.readouterr().err
        assert said == (
            f"gspo: error: WORLD_SIZE is {world!r}, not a number of processes (a whole "
            "number, at least 1): a run of several processes is started by torchrun "
            "(torchrun --nproc-per-node N -m gspo train ...), which sets it; unset "
            "WORLD_SIZE for one\n"
        )


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.n: unknown key; verl's n "
         "is rollout.group_size here (docs/from_verl.md)"),
        ("actor_rollout_ref.actor.clip_ratio_low=3e-4", "actor_rollout_ref.actor."
         "clip_ratio_low: unknown key; verl's clip_ratio_low is algorithm.clip_low here "
         "(docs/from_verl.md)"),
        ("actor_rollout_ref.actor.optim.lr=1e-6",
         "actor_rollout_ref.actor.optim.lr: unknown key; did you mean 'optim.lr'?"),
        ("actor_rollout_ref.rollout.temperature=0.7", "actor_rollout_ref.rollout.temperature:"
         " unknown key; did you mean 'rollout.temperature'?"),
        ("trainer.total_training_steps=10", "trainer.total_training_steps: unknown key; verl's "
         "total_training_steps is train.max_steps, in optimizer steps (verl's steps x "
         "algorithm.minibatches) here (docs/from_verl.md)"),
        ("trainr.max_steps=3", "trainr: unknown key; did you mean 'train'?"),
        ("foo.bar=1", "foo: unknown key"),
        # (verl's LoRA rank said 'actor_rollout_ref: unknown key')
        ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_rank: unknown "
         "key; verl's lora_rank is model.lora.r (with model.lora.alpha, "
         "model.lora.target_modules) here (docs/from_verl.md)"),
        # verl's data keys: max_prompt_length was told 'did you mean data.prompt_column?',
        # prompt_key 'data.prompt_template?', val_files nothing
        ("data.max_prompt_length=512", "data.max_prompt_length: unknown key; verl's "
         "max_prompt_length has no equivalent here: prompts are not cut: one longer than the "
         "model's context stops the run with one line naming its row (verl's truncation=error), "
         "or data.drop_long_prompts=true leaves out those that leave fewer than "
         "rollout.max_new_tokens positions (docs/from_verl.md)"),
        ("data.filter_overlong_prompts=true", "data.filter_overlong_prompts: unknown key; "
         "verl's filter_overlong_prompts is data.drop_long_prompts (the prompts that leave "
         "fewer than rollout.max_new_tokens positions of the context) here (docs/from_verl.md)"),
        ("data.prompt_key=question", "data.prompt_key: unknown key; verl's prompt_key is "
         "data.prompt_column (a string or chat messages) here (docs/from_verl.md)"),
        ("data.val_files=test.parquet", "data.val_files: unknown key; verl's val_files is "
         "data.eval (one file, a directory of data files or a dataset id) here "
         "(docs/from_verl.md)"),
        # (TRL's max_prompt_length, at the top, keeps TRL's line)
        ("max_prompt_length=512", "max_prompt_length: unknown key; TRL's max_prompt_length "
         "has no equivalent here: prompts are not truncated (data.drop_long_prompts=true leaves "
         "out those too long for the context) (docs/from_trl.md)"),
        ("actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.model."
         "target_modules: unknown key; did you mean 'model.lora.target_modules'?"),
    ],
)  # fmt: skip
def test_a_verl_key_as_verl_spells_it_in_full_is_refused_with_its_gspo_name(override, said):
    """docs/from_verl.md's table names verl's keys in full (actor_rollout_ref.rollout.n): given
    as they are, they said 'actor_rollout_ref: unknown key', the gspo name lost."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == said


def test_gspo_eval_without_its_checkpoint_names_only_what_is_missing(capsys):
    """`gspo eval` alone said 'required: RUN_CHECKPOINT_OR_MODEL, key.sub=value', though
    overrides are optional (argparse takes a nargs='*' positional without a default as
    required)."""
    from gspo.cli import parse_args

    with pytest.raises(SystemExit) as info:
        parse_args(["eval"])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gspo eval: the following arguments are required: RUN_CHECKPOINT_OR_MODEL "
        "(see gspo eval --help)"
    )
    assert parse_args(["eval", "runs/x"]).overrides == []


def test_chain_terms_that_cross_name_both_values():
    """It said 'data.min_terms exceeds data.terms', neither value (the chain task brings
    data.terms=6 itself, which a user setting data.min_terms=20 did not write)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.task=chain", "data.min_terms=20"])
    assert str(e.value) == (
        "data.min_terms=20 exceeds data.terms=6 (the chain task's fewest and most operands "
        "per prompt)"
    )


@pytest.mark.parametrize("rank", ["3", "abc"])
def test_a_rank_without_torchrun_says_a_setup_error_at_once(rank, tmp_path, monkeypatch, capsys):
    """RANK set (by mistake, or left by a cluster's environment) without WORLD_SIZE > 1 is
    no torchrun rank: a setup error waited RANK_ZERO_GRACE_S (60 s) for a rank 0 that does
    not exist, then said it."""
    import gspo.cli

    waits: list[float] = []
    monkeypatch.setattr(gspo.cli.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--output-dir", str(tmp_path / "run"), "optim.lrr=1"]) == 2
    assert waits == []
    said = capsys.readouterr().err
    assert said == "gspo: error: optim.lrr: unknown key; did you mean 'optim.lr'?\n"


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("rollout.max_model_len=512", "rollout.max_model_len: unknown key; did you mean "
         "'rollout.vllm.max_model_len'?"),
        ("rollout.gpu_memory_utilization=0.5", "rollout.gpu_memory_utilization: unknown key; "
         "did you mean 'rollout.vllm.gpu_memory_utilization'?"),
        ("enforce_eager=false", "enforce_eager: unknown key; did you mean "
         "'rollout.vllm.enforce_eager'?"),
        ("model.r=8", "model.r: unknown key; did you mean 'model.lora.r'?"),
        ("actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout."
         "gpu_memory_utilization: unknown key; did you mean "
         "'rollout.vllm.gpu_memory_utilization'?"),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout."
         "tensor_model_parallel_size: unknown key; verl's tensor_model_parallel_size has no "
         "equivalent here: each rank runs its own vLLM engine, tensor-parallel size 1 "
         "(docs/from_verl.md)"),
        ("vllm_tensor_parallel_size=2", "vllm_tensor_parallel_size: unknown key; TRL's "
         "vllm_tensor_parallel_size has no equivalent here: each rank runs its own vLLM "
         "engine, tensor-parallel size 1 (docs/from_trl.md)"),
        ("train.nope=1", "train.nope: unknown key"),
    ],
)  # fmt: skip
def test_a_vllm_setting_put_where_trl_or_verl_users_put_it_names_rollout_vllm(override, said):
    """rollout.max_model_len (verl's rollout.max_model_len, one level up) was told 'did you
    mean rollout.max_episode_tokens?' (closer spelt, another thing), and verl's
    rollout.gpu_memory_utilization and TRL's vllm_tensor_parallel_size got no hint at all."""
    from gspo.config import Config

    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value) == said
    if "=" in override and "." in override.split("=")[0]:  # the same from Python
        section, _, leaf = override.split("=")[0].rpartition(".")
        if section in ("rollout", "model"):
            with pytest.raises(ConfigError, match=r"did you mean"):
                setattr(getattr(Config(), section), leaf, 1)


def test_drop_long_prompts_with_an_environment_is_warned():
    """Before: data.drop_long_prompts=true with an environment left out nothing (it reads
    single-turn prompts; an environment renders its episodes' own), unsaid."""
    drop = "data.drop_long_prompts=true"
    for env in (["data.task=calculator"], ["rollout.environment=my_env:Env", "model.path=/m"]):
        lines = load_config(None, [*env, drop]).warnings()
        assert len(lines) == 1, lines
        assert lines[0].startswith("data.drop_long_prompts=true with rollout.environment")
        assert load_config(None, env).warnings() == []
    assert load_config(None, [drop]).warnings() == []
