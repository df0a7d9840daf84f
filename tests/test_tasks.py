"""Tasks: the built-in addition and chain tasks, prompt encoding."""

import pytest

from gspo.chat import encode_prompt
from gspo.models import build_char_tokenizer
from gspo.rewards import numeric_match_reward
from gspo.tasks import (
    TASK_DEFAULTS,
    addition_task,
    as_completion,
    chain_completion,
    chain_steps,
    chain_task,
)


def test_addition_splits_are_disjoint_and_answers_correct():
    task = addition_task(digits=2, eval_size=300, sft_size=500, label_noise=0.0, seed=1)
    train = {r["prompt"] for r in task.train}
    held_out = {r["prompt"] for r in task.eval}
    assert len(held_out) == 300 and not train & held_out
    assert len(train) + len(held_out) == 90 * 90
    for r in task.eval[:50]:
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["answer"] == str(int(a) + int(b))
    for r in task.sft:  # no noise: every SFT answer is right, and from the train split
        assert r["prompt"] in train
        a, b = r["prompt"].rstrip("=").split("+")
        assert r["completion"] == str(int(a) + int(b))


def test_label_noise_corrupts_about_the_stated_share():
    task = addition_task(digits=2, sft_size=4000, label_noise=0.5, seed=0)
    wrong = 0
    for r in task.sft:
        a, b = r["prompt"].rstrip("=").split("+")
        wrong += r["completion"] != str(int(a) + int(b))
    # A random replacement digit is right 1 time in 10: expected wrong share 0.45.
    assert 0.41 < wrong / len(task.sft) < 0.49


def test_addition_is_seeded():
    a = addition_task(seed=3, sft_size=10)
    b = addition_task(seed=3, sft_size=10)
    c = addition_task(seed=4, sft_size=10)
    assert a.eval == b.eval and a.sft == b.sft
    assert a.eval != c.eval


def operands(prompt):
    return [int(t) for t in prompt.rstrip("=").split("+")]


def test_chain_answers_right_and_held_out_disjoint():
    task = chain_task(terms=6, min_terms=3, eval_size=200, train_size=2000, sft_size=300,
                      label_noise=0.0, seed=1)  # fmt: skip
    train = {r["prompt"] for r in task.train}
    held_out = {r["prompt"] for r in task.eval}
    assert len(held_out) == 200 and len(train) == 2000 and not train & held_out
    for r in task.eval:
        assert 3 <= len(operands(r["prompt"])) <= 6
        assert r["answer"] == str(sum(operands(r["prompt"])))
    for r in task.sft:  # no noise: every line adds up and the last line is the total
        assert r["prompt"] in train
        *lines, last = r["completion"].split("\n")
        assert len(lines) == len(operands(r["prompt"])) - 1
        for line in lines:
            left, total = line.split("=")
            a, b = left.split("+")
            assert int(a) + int(b) == int(total)
        assert last == f"answer: {sum(operands(r['prompt']))}"


def test_chain_format_and_lengths_as_designed():
    assert chain_steps([12, 34, 56, 78]) == [(12, 34, 46), (46, 56, 102), (102, 78, 180)]
    assert chain_completion(chain_steps([12, 34, 56, 78])) == (
        "12+34=46\n46+56=102\n102+78=180\nanswer: 180"
    )
    task = chain_task(terms=12, sft_size=2000, label_noise=0.0, seed=0)
    lengths = [len(r["completion"]) for r in task.sft]  # one token per character
    # 2 terms: ~20 tokens; 12 terms: ~130
    assert 17 <= min(lengths) <= 22 and 120 <= max(lengths) < 144
    assert 65 < sum(lengths) / len(lengths) < 85


def test_chain_label_noise_slips_one_step_and_stays_consistent():
    task = chain_task(terms=8, sft_size=3000, label_noise=0.5, seed=0)
    wrong = 0
    for r in task.sft:
        *lines, last = r["completion"].split("\n")
        total = int(last.removeprefix("answer: "))
        wrong += total != sum(operands(r["prompt"]))
        # the later steps add correctly from whatever the previous line said
        previous = None
        for line in lines:
            left, result = line.split("=")
            a = left.split("+")[0]
            if previous is not None:
                assert int(a) == previous
            previous = int(result)
        assert previous == total
    # a slipped digit is right again 1 time in 10: expected wrong share 0.45
    assert 0.41 < wrong / len(task.sft) < 0.49


def test_chain_reward_reads_the_final_answer():
    prompt, gold = "12+34+56+78=", "180"
    right = "12+34=46\n46+56=102\n102+78=180\nanswer: 180"
    slipped = "12+34=46\n46+56=103\n103+78=181\nanswer: 181"
    unfinished = "12+34=46\n46+56=102\n102+78="
    rewards = numeric_match_reward(
        prompts=[prompt] * 3, completions=[right, slipped, unfinished], answer=[gold] * 3
    )
    assert rewards == [1.0, 0.0, 0.0]


def test_chain_config_needs_a_final_answer_reward():
    from gspo.config import ConfigError, load_config

    assert load_config(None, ["data.task=chain"]).reward.functions == ["numeric_match"]
    with pytest.raises(ConfigError, match=r"numeric_match"):  # set by hand: refused
        load_config(None, ["data.task=chain", "reward.functions=[exact_match]"])
    config = load_config(None, ["data.task=chain", "reward.functions=[numeric_match]",
                                "data.terms=5"])  # fmt: skip
    assert config.data.terms == 5


def test_tasks_bring_their_settings_where_the_user_sets_none(tmp_path):
    from gspo.config import load_config

    calculator = load_config(None, ["data.task=calculator", "rollout.max_turns=2"])
    assert (
        calculator.rollout.max_new_tokens == TASK_DEFAULTS["calculator"]["rollout.max_new_tokens"]
    )
    assert calculator.rollout.max_turns == 2  # the user's value wins
    # the environment the run uses is in the resolved config (gspo config prints it)
    assert calculator.rollout.environment == "gspo.environments:Calculator"
    (tmp_path / "c.yaml").write_text("data:\n  task: calculator\nrollout:\n  max_new_tokens: 9\n")
    assert load_config(tmp_path / "c.yaml").rollout.max_new_tokens == 9  # a file's too
    # a run on the user's data gets none of them; addition's are the config's defaults
    assert load_config(None, ["data.task=calculator", "data.train=x.jsonl"]).environment is None
    assert load_config(None, ["data.task=addition"]) == load_config()


#: Each built-in task's documented command line, as overrides, and where it is documented.
DOCUMENTED = {
    "addition": ([], "README.md", "`make demo` runs `gspo train` with no config"),
    "chain": (["data.task=chain"], "docs/training.md", "gspo train data.task=chain"),
    "calculator": (
        ["data.task=calculator"],  # (the task brings data.digits=5)
        "docs/environments.md",
        "`gspo train data.task=calculator`",
    ),
}

#: The documented runs made short: a fifth of a cold start or less, two rollout batches.
SHORTER = [
    "model.device=cpu",
    "train.cold_start_steps=150",
    "train.max_steps=8",
    "eval.every=0",
    "eval.max_prompts=16",
    "log.progress=false",
    "log.plots=false",
    "log.tensorboard=false",
]
#: Per task, what SHORTER leaves too short: 150 SFT steps teach chain the chain's form but
#: none of its sums (held-out accuracy 0), and 8 RL steps cannot add what the cold start
#: did not teach, so its cold start is about half of the task's own 1,500 steps.
SHORTER_FOR = {"chain": ["train.cold_start_steps=800"]}


# Cost: the three took 2.9 min of wall time (2.6 CPU-min; chain 2.0 min of it, with its
# 800-step cold start) on f3694a2 on this 2-core host, OMP_NUM_THREADS=1, while other jobs
# held a load of about 3; not yet timed on an idle machine.
@pytest.mark.slow
@pytest.mark.parametrize("task", DOCUMENTED)
def test_each_documented_task_command_learns(tmp_path, task):
    """`gspo train data.task=calculator data.digits=5` once trained nothing: every tool call
    was cut at the default rollout.max_new_tokens=8. Each task's documented command, made
    short, must end above the untrained model: addition's accuracy, calculator's tool
    calls, and chain's accuracy (its 800-step cold start teaches the sums, not only the
    chain's form: its responses also end within rollout.max_new_tokens where the untrained
    run to it)."""
    from pathlib import Path

    from gspo.config import load_config
    from gspo.trainer import Trainer

    overrides, page, command = DOCUMENTED[task]
    root = Path(__file__).resolve().parents[1]
    assert command in " ".join((root / page).read_text().split())  # the docs say so

    def final_eval(name, *extra):
        config = load_config(None, [*overrides, *SHORTER, *SHORTER_FOR.get(task, []), *extra])
        records = Trainer(config, tmp_path / name).fit()
        return [r for r in records if "eval/accuracy" in r][-1]

    untrained = final_eval("untrained", "train.cold_start_steps=0", "train.max_steps=0")
    trained = final_eval("trained")
    seen = {k: (untrained.get(k), trained[k]) for k in trained if k.startswith("eval/")}
    if task == "addition":  # 3 of 64 held-out samples right against 0 (0db35c8, this CPU)
        assert trained["eval/accuracy"] > untrained["eval/accuracy"], seen
    elif task == "calculator":  # calls the tool (a cut call is not one)
        assert trained["eval/tool_calls_mean"] > untrained["eval/tool_calls_mean"] + 0.25, seen
    else:  # writes whole chains, within the budget, and adds: held-out chains come out right
        limit = load_config(None, overrides).rollout.max_new_tokens
        assert untrained["eval/response_length_mean_greedy"] > 0.9 * limit, seen
        assert trained["eval/response_length_mean_greedy"] < limit / 2, seen
        # 0.016 -> 0.36 sampled and 0 -> 0.75 greedy (f3694a2, this CPU); with the 150-step
        # cold start the other tasks get, 0 and 0
        assert trained["eval/accuracy"] > untrained["eval/accuracy"] + 0.15, seen
        assert trained["eval/accuracy_greedy"] > untrained["eval/accuracy_greedy"] + 0.4, seen


def test_encode_prompt_string_and_chat():
    tok = build_char_tokenizer()
    ids = encode_prompt("12+3=", tok)
    assert tok.decode(ids) == "12+3="
    messages = [{"role": "user", "content": "hi"}]
    # the built-in template: a user message is its text, the model answers right after
    assert tok.decode(encode_prompt(messages, tok)) == "hi"
    tok.chat_template = None
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        encode_prompt(messages, tok)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    assert tok.decode(encode_prompt(messages, tok)) == "user:hi\nassistant:"


def test_as_completion_follows_trl():
    assert as_completion("42", "1+1=") == "42"
    assert as_completion("42", [{"role": "user", "content": "q"}]) == [
        {"role": "assistant", "content": "42"}
    ]
