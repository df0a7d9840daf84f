"""verl's Parquet layout: ``prompt`` (chat messages), ``data_source``, ``reward_model``
(``{"style": "rule", "ground_truth": ...}``, a struct column) and ``extra_info``. The gold
answer or the code tests are named by a dotted path into ``reward_model``
(``data.answer_column=reward_model.ground_truth``); until 2026-11-29 ``data.*_column``
named a top-level column only and such a file could not be trained on as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CPU

from gspo.cli import main
from gspo.config import load_config
from gspo.data import load_rows, prepare_rows
from gspo.data.files import field_of
from gspo.rewards import RewardError, RewardFunctions, sandbox

CALLS = {"fn_name": "add", "inputs": [[1, 2], [2, 2], [10, 1]], "outputs": [[3], [4], [11]]}


def verl_rows(ground_truths: list[object], ability: str = "code") -> list[dict]:
    return [
        {
            "data_source": "apps" if ability == "code" else "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Problem {k}"}],
            "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": "train", "index": k},
        }
        for k, truth in enumerate(ground_truths)
    ]


def write_parquet(rows: list[dict], path: Path) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_field_of_reads_a_dotted_path_into_mapping_columns() -> None:
    row = {"reward_model": {"style": "rule", "ground_truth": "42"}, "a.b": 1, "a": {"b": 2}}
    assert field_of(row, "reward_model.ground_truth") == "42"
    assert field_of(row, "reward_model") == {"style": "rule", "ground_truth": "42"}
    assert field_of(row, "a.b") == 1  # (a column of that very name first)
    assert field_of({"m": None}, "m.x") is None  # (a null mapping: an empty cell)
    for path, said in [
        ("reward_model.answer", "reward_model has no key 'answer' (its keys: style, ground_truth)"),
        ("reward_model.style.x", "reward_model.style is str 'rule', not a mapping"),
        ("nope.x", "no column 'nope'"),
    ]:
        with pytest.raises(KeyError) as caught:
            field_of(row, path)
        assert caught.value.args[0] == said


def test_answer_and_tests_columns_take_a_dotted_path(tmp_path: Path) -> None:
    math = write_parquet(verl_rows(["#### 7", "12"], ability="math"), tmp_path / "math.parquet")
    rows = load_rows(math, what="data.train")
    data = load_config(None, ["data.answer_column=reward_model.ground_truth"]).data
    assert [r["answer"] for r in prepare_rows(rows, data, what="data.train")] == ["7", "12"]
    code = write_parquet(verl_rows([json.dumps(CALLS), None]), tmp_path / "code.parquet")
    rows = load_rows(code, what="data.train")
    data = load_config(None, ["data.tests_column=reward_model.ground_truth"]).data
    prepared = prepare_rows(rows, data, what="data.train")
    assert [r["tests"] for r in prepared] == [json.dumps(CALLS), None]
    assert prepared[0]["reward_model"]["style"] == "rule"  # (the column itself still there)
    assert prepared[0]["prompt"] == [{"role": "user", "content": "Problem 0"}]


def test_a_dotted_path_that_leads_nowhere_is_one_line_naming_the_row(tmp_path: Path) -> None:
    rows = verl_rows(["1", "2"], ability="math")
    rows[1]["reward_model"] = {"style": "rule"}  # (JSON Lines: the key left out of one row)
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded = load_rows(path, what="data.train")
    for column, said in [
        ("reward_model.ground_truth", "reward_model has no key 'ground_truth' (its keys: "
         "style) in row 2 of data.train"),
        ("extra_info.index.x", "extra_info.index is int 0, not a mapping in row 1 of data.train"),
        ("reward.ground_truth", "no column 'reward' in row 1 of data.train"),
    ]:  # fmt: skip
        data = load_config(None, [f"data.answer_column={column}"]).data
        with pytest.raises(
            ValueError, match="^" + re.escape(f"data.answer_column={column}: {said}")
        ):
            prepare_rows(loaded, data, what="data.train")
    data = load_config(None, ["data.answer_column=answer"]).data  # (a plain name: as before)
    with pytest.raises(ValueError, match=r"^data.answer_column: no column 'answer' of data"):
        prepare_rows(loaded, data, what="data.train")
    sft = load_config(None, ["data.answer_column=reward_model.ground_truth"]).data
    rows = [{**row, "completion": "c"} for row in loaded]  # (nothing scores a cold start)
    assert "answer" not in prepare_rows(rows, sft, what="data.sft", sft=True)[1]


def test_a_verl_file_without_the_key_says_which_to_set() -> None:
    columns = ["data_source", "ability", "reward_model", "extra_info"]
    for name, key in (("code", "tests"), ("math", "answer")):
        rewards = RewardFunctions.from_specs([name])
        with pytest.raises(RewardError, match=rf"; verl's data keeps it in reward_model: "
                           rf"data.{key}_column=reward_model.ground_truth$"):  # fmt: skip
            rewards.check_columns(columns, "data.train (train.parquet)")


def test_gspo_train_on_a_verl_code_parquet(tmp_path, monkeypatch) -> None:
    """The command of docs/from_verl.md on a verl-shaped code file: each completion read as
    a program passing 2 of its row's 3 tests (program_of patched: the tiny model writes no
    code) gets 2/3, or 0 with reward.code_scoring=all: the tests came from the nested
    field."""
    data = write_parquet(verl_rows([json.dumps(CALLS)] * 2), tmp_path / "train.parquet")
    easy_only = "def add(a, b):\n    return a + b if a < 10 else 0"
    monkeypatch.setattr(sandbox, "program_of", lambda completion, prompt=None: easy_only)
    args = [CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
            "model.intermediate=128", "rollout.group_size=2", "rollout.prompts_per_batch=2",
            "rollout.max_new_tokens=4", "train.max_steps=1", "algorithm.minibatches=1",
            "eval.every=0", "log.progress=false", "log.plots=false", "log.tensorboard=false",
            "log.completions_every=1", f"data.train={data}", "train.cold_start_steps=0",
            "data.tests_column=reward_model.ground_truth", "reward.functions=[code]"]  # fmt: skip
    for scoring, reward in (("fraction", pytest.approx(2 / 3)), ("all", 0.0)):
        run = tmp_path / scoring
        given = [*args, f"reward.code_scoring={scoring}"]
        assert main(["train", "--output-dir", str(run), *given]) == 0
        logged = (run / "completions" / "rollout-000000.jsonl").read_text().splitlines()
        assert [json.loads(line)["rewards"]["code"] for line in logged] == [reward] * 4


def test_a_mapping_column_held_as_json_text_is_read_as_its_mapping(tmp_path: Path) -> None:
    """A CSV file (or JSON Lines written with the mapping stringified) holds verl's
    ``reward_model`` as the JSON text of an object: the dotted path reads into it (it
    stopped the run: 'reward_model is str ..., not a mapping'); text that is no JSON object
    still does."""
    truth = json.dumps({"style": "rule", "ground_truth": "#### 7"})
    path = tmp_path / "math.csv"
    path.write_text('prompt,reward_model\nWhat is 3+4?,"' + truth.replace('"', '""') + '"\n')
    rows = load_rows(path, what="data.train")
    data = load_config(None, ["data.answer_column=reward_model.ground_truth"]).data
    assert [r["answer"] for r in prepare_rows(rows, data, what="data.train")] == ["7"]
    assert field_of({"m": ' {"a": {"b": 2}}'}, "m.a.b") == 2
    for text, said in [("{not json", "str '{not json'"), ("[1]", "str '[1]'")]:
        with pytest.raises(KeyError, match=re.escape(f"m is {said}, not a mapping")):
            field_of({"m": text}, "m.a")
