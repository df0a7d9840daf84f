"""Every recipe in examples/ is a valid config and runs one RL step on tiny stand-ins.

The stand-ins: a built-in tiny model (dense, or MoE for recipes that measure expert
churn) with a chat template, saved with ``save_pretrained``, and a small dataset saved
with ``save_to_disk`` that has the columns the recipes read (GSM8K's question/answer,
MATH's problem/solution). Sizes are shrunk by overrides; everything else, templates,
system prompts, answer extraction and reward functions included, is the recipe's own.
"""

import math
from pathlib import Path

import datasets
import pytest

from gspo.config import load_config
from gspo.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    save_pretrained_atomic,
)
from gspo.trainer import Trainer
from gspo.training.setup import load_task_data

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))

CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

ROWS = [
    {
        "question": f"Ann has {a} pens and buys {b}. How many now?",
        "answer": f"{a}+{b}={a + b}\n#### {a + b}",
        "problem": f"What is ${a}+{b}$?",
        "solution": f"We add: ${a}+{b}=\\boxed{{{a + b}}}$.",
        "level": "Level 1",
    }
    for a, b in [(3, 4), (10, 5), (7, 8), (20, 22), (1, 1), (6, 9)]
]


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand_ins")
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    small = dict(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=64)
    for name, spec in (
        ("dense", TinyModelSpec(**small)),
        ("moe", TinyModelSpec(architecture="qwen3_moe", experts=4, **small)),
    ):
        save_pretrained_atomic(build_tiny_model(spec, tokenizer, seed=0), tokenizer, root / name)
    splits = {"train": ROWS, "test": ROWS[:2]}
    datasets.DatasetDict(
        {k: datasets.Dataset.from_list(v) for k, v in splits.items()}
    ).save_to_disk(str(root / "data"))
    return root


def test_there_are_examples():
    assert len(EXAMPLES) >= 4


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_is_valid_as_written_and_says_what_it_is_for(path):
    config = load_config(path)
    assert config.model.path is not None and config.data.train is not None
    header = path.read_text()
    assert "Sized for:" in header and "What matters here:" in header
    assert "model.path=" in header  # the command line to run it
    # the download line names the hub client's current command (`hf`; huggingface_hub 1.x
    # no longer installs `huggingface-cli`)
    assert "hf download " in header and "huggingface-cli" not in header


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs_one_step_on_stand_ins(path, stand_ins, tmp_path):
    written = load_config(path)
    moe = bool(written.moe.measure_churn or written.moe.routing_replay)
    data = stand_ins / "data"
    overrides = [
        f"model.path={stand_ins / ('moe' if moe else 'dense')}",
        "model.device=cpu",
        f"data.train={data}::train",
        "rollout.engine=torch",
        "rollout.group_size=2",
        "rollout.prompts_per_batch=2",
        "rollout.max_new_tokens=4",
        "algorithm.minibatches=1",
        "train.max_steps=1",
        "train.save_every=0",
        "eval.every=0",
        "eval.max_prompts=2",
        "eval.samples=1",
        "log.progress=false",
        "log.plots=false",
        "log.tensorboard=false",
    ]
    if written.data.eval is not None:
        overrides.append(f"data.eval={data}::test")
    if written.data.sft is not None:
        overrides += [f"data.sft={data}::train", "train.cold_start_steps=1"]
    config = load_config(path, overrides)

    # the recipe's own prompt and answer settings, applied to the stand-in rows
    rows = load_task_data(config).train
    prompt = rows[0]["prompt"]
    text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    assert ROWS[0]["question"] in text or ROWS[0]["problem"] in text
    if config.data.system_prompt is not None:
        assert prompt[0] == {"role": "system", "content": config.data.system_prompt}
    if config.data.answer_column is not None:
        assert [r["answer"] for r in rows] == [
            str(int(r["answer"].split("#### ")[1])) for r in ROWS
        ]

    records = Trainer(config, tmp_path / "run").fit()
    lines = [r for r in records if "train/loss" in r]
    assert len(lines) == 1 and math.isfinite(lines[0]["train/loss"])
    for name in config.reward.functions:  # each function's mean is logged beside the sum
        assert f"train/reward/{name.rpartition(':')[2]}" in lines[0]
    assert any("eval/accuracy" in r for r in records)
    if moe:
        assert "moe/expert_change_fraction" in lines[0]
    if config.rollout.environment is not None:  # episodes: the environment was loaded
        assert "env/turns_mean" in lines[0]
        assert any("eval/turns_mean" in r for r in records)
