"""User datasets: sources (files, saved directories, hub ids), prompts, answers, errors."""

import json

import datasets
import pytest

from gspo.chat import encode_prompt
from gspo.config import ConfigError, load_config
from gspo.data import load_rows, parse_source, prepare_rows, template_fields
from gspo.models import build_char_tokenizer

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "Half of 10?", "answer": "10/2=5\n#### 5"},
    {"question": "What is 6*7?", "answer": "6*7=42\n#### 42"},
]


def data_config(*overrides):
    return load_config(None, list(overrides)).data


@pytest.fixture
def gsm8k_dir(tmp_path):
    """A GSM8K stand-in: a DatasetDict (train, test) written with save_to_disk."""
    path = tmp_path / "gsm8k"
    datasets.DatasetDict(
        train=datasets.Dataset.from_list(GSM8K_ROWS),
        test=datasets.Dataset.from_list(GSM8K_ROWS[:1]),
    ).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_local_files(tmp_path, suffix):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        path.write_text("prompt,answer\n1+1=,2\n2+2=,4\n")
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    loaded = load_rows(path, what="data.train")
    assert [{k: str(v) for k, v in r.items()} for r in loaded] == rows


def test_saved_dataset_directory_and_its_splits(gsm8k_dir):
    assert load_rows(f"{gsm8k_dir}::train", what="data.train") == GSM8K_ROWS
    assert load_rows(f"{gsm8k_dir}::test", what="data.eval") == GSM8K_ROWS[:1]
    with pytest.raises(ValueError, match=r"data.eval: .* has splits train, test; name one as"):
        load_rows(gsm8k_dir, what="data.eval")
    with pytest.raises(ValueError, match=r"data.eval: .*no split 'dev' \(splits: train, test\)"):
        load_rows(f"{gsm8k_dir}::dev", what="data.eval")
    single = gsm8k_dir.parent / "single"
    datasets.Dataset.from_list(GSM8K_ROWS).save_to_disk(str(single))
    assert load_rows(single, what="data.train") == GSM8K_ROWS


def test_a_directory_of_data_files_is_split_by_their_names_and_leaves_none_out(tmp_path):
    """datasets splits a directory's files by their names and reads one kind of file: it
    trained on validation.jsonl alone beside part1.jsonl, on the one .parquet of a .jsonl,
    a .csv and a .parquet, without a word."""
    folder = tmp_path / "repo"
    folder.mkdir()
    for split, rows in (("train", GSM8K_ROWS), ("test", GSM8K_ROWS[2:])):
        (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_rows(f"{folder}::test", what="data.eval") == GSM8K_ROWS[2:]
    (folder / "more.jsonl").write_text(json.dumps(GSM8K_ROWS[0]))
    with pytest.raises(ValueError) as err:
        load_rows(f"{folder}::train", what="data.train")
    assert str(err.value) == (
        f"data.train: {folder}::train: its files are read as splits by their names (train.jsonl, "
        "test.jsonl), which leaves out more.jsonl; name each file by its split (train*.jsonl, "
        "test*.jsonl; files of one kind), or give the files to read a directory of their own"
    )
    mixed = tmp_path / "mixed"  # datasets reads one kind: the other is left out
    mixed.mkdir()
    (mixed / "a.jsonl").write_text(json.dumps({"prompt": "a", "answer": "1"}))
    (mixed / "b.jsonl").write_text(json.dumps({"prompt": "b", "answer": "2"}))
    (mixed / "c.csv").write_text("prompt,answer\nc,007\n")
    with pytest.raises(ValueError, match=r"\(a.jsonl, b.jsonl\), which leaves out c.csv;"):
        load_rows(mixed, what="data.train")
    # a hub repository's README names its configs and their files: those, and no others
    hub = tmp_path / "hub"
    for config in ("main", "socratic"):
        (hub / config).mkdir(parents=True)
        for split in ("train", "test"):
            row = {"prompt": f"{config} {split}", "answer": "1"}
            (hub / config / f"{split}-00000.jsonl").write_text(json.dumps(row))
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
        f"  - split: test\n    path: {c}/test-*\n"
        for c in ("main", "socratic")
    )
    (hub / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# a dataset\n")
    rows = load_rows(f"{hub}:main:test", what="data.eval")
    assert [r["prompt"] for r in rows] == ["main test"]  # (it read main's and socratic's)
    with pytest.raises(ValueError, match=r"Config name is missing"):
        load_rows(f"{hub}::train", what="data.train")


def test_a_directory_of_many_files_left_out_names_the_first_few(tmp_path):
    """300 shards beside a stray file were all named: an error line of 8 kB."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(300):
        (folder / f"train-{i:05d}-of-00300.jsonl").write_text(json.dumps(GSM8K_ROWS[0]))
    for name in ("extra1.jsonl", "extra2.jsonl", "extra3.jsonl", "extra4.jsonl"):
        (folder / name).write_text(json.dumps(GSM8K_ROWS[0]))
    with pytest.raises(ValueError) as err:
        load_rows(folder, what="data.train")
    said = str(err.value)
    assert (
        "by their names (train-00000-of-00300.jsonl, train-00001-of-00300.jsonl, "
        "train-00002-of-00300.jsonl and 297 more), which leaves out extra1.jsonl, "
        "extra2.jsonl, extra3.jsonl and 1 more; name each file" in said
    )
    assert len(said) < 600


def test_a_pattern_is_said_to_be_one(tmp_path, monkeypatch):
    """data.train=dir/*.jsonl said "file not found", whether or not files matched it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    with pytest.raises(FileNotFoundError) as err:
        load_rows("dir/*.jsonl", what="data.train")
    assert str(err.value) == (
        f"data.train: no file matches the pattern dir/*.jsonl (looked for {tmp_path}/dir/*.jsonl)"
    )
    for name in ("a.jsonl", "b.jsonl", "c.jsonl", "d.jsonl"):
        (tmp_path / "dir" / name).write_text(json.dumps(GSM8K_ROWS[0]))
    with pytest.raises(ValueError) as err:
        load_rows("dir/*.jsonl", what="data.train")
    assert str(err.value) == (
        "data.train: dir/*.jsonl is a pattern (4 match: dir/a.jsonl, dir/b.jsonl, dir/c.jsonl "
        "and 1 more); gspo reads one file or a directory of them: give the directory"
    )
    # a directory named with brackets is no pattern: with its split too (the review's case)
    (tmp_path / "run[1]").mkdir()
    (tmp_path / "run[1]" / "train.jsonl").write_text(json.dumps(GSM8K_ROWS[0]))
    source = parse_source("run[1]::train", what="data.train")
    assert (source.kind, source.location, source.split) == ("directory", "run[1]", "train")


def test_a_malformed_dataset_card_in_a_directory_names_the_file(tmp_path):
    """The YAML error named no file: "cannot load local dataset ...: ParserError: ...
    (a directory must hold a datasets.save_to_disk dataset, or data files ...)"."""
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps(GSM8K_ROWS[0]))
    (folder / "README.md").write_text("---\nconfigs: [\n  - a: b\n---\n# a dataset\n")
    with pytest.raises(ValueError) as err:
        load_rows(folder, what="data.train")
    said = str(err.value)
    assert said.startswith(
        f"data.train: {folder}: the YAML header of {folder / 'README.md'} is malformed: "
        "ParserError: while parsing a flow node"
    )
    assert "\n" not in said and "save_to_disk" not in said


def test_hub_ids_reach_load_dataset_with_config_and_split(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no local directory named like the id
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert load_rows("openai/gsm8k:main:train", what="data.train") == GSM8K_ROWS
    load_rows("HuggingFaceH4/MATH-500::test", what="data.eval")
    load_rows("openai/gsm8k:main", what="data.eval")
    assert calls == [
        ("openai/gsm8k", "main", "train"),
        ("HuggingFaceH4/MATH-500", None, "test"),
        ("openai/gsm8k", "main", None),
    ]


def test_a_split_slice_reads_that_part(monkeypatch, tmp_path, gsm8k_dir):
    """datasets' split slices (train[:100], test[10%:]) as TRL's load_dataset(split=...)
    takes them: their colon split the value in four, refused as 'more than
    SOURCE:CONFIG:SPLIT', a hub id's and a local one's alike."""
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    load_rows("openai/gsm8k:main:test[:200]", what="data.eval")
    assert calls == [("openai/gsm8k", "main", "test[:200]")]  # (datasets slices it)
    questions = [r["question"] for r in GSM8K_ROWS]
    parts = {"train[:2]": questions[:2], "train[-1:]": questions[2:],
             "train[1:2]": questions[1:2], "train[34%:]": questions[1:]}  # fmt: skip
    for split, want in parts.items():
        rows = load_rows(f"{gsm8k_dir}::{split}", what="data.train")
        assert [r["question"] for r in rows] == want, split
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(f'{{"prompt": "q{i}"}}\n' for i in range(10)))
    (folder / "test.jsonl").write_text('{"prompt": "t"}\n')
    rows = load_rows(f"{folder}::train[:30%]", what="data.train")
    assert [r["prompt"] for r in rows] == ["q0", "q1", "q2"]
    with pytest.raises(ValueError) as err:
        load_rows(f"{folder}::train[a:b]", what="data.train")
    assert str(err.value) == (
        f"data.train: {folder}::train[a:b]: the split 'train[a:b]' is not SPLIT[START:STOP] "
        "(test[:200], train[10%:])"
    )
    with pytest.raises(ValueError, match=r"^data.train: .*::train\[5:\] has no rows$"):
        load_rows(f"{gsm8k_dir}::train[5:]", what="data.train")


def offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1 as a user's shell sets it before the process starts: huggingface_hub
    and datasets read it when imported, which they were before the test (set only in the
    environment, each lookup went to the network: 23 s of timeouts without one)."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def test_uncached_hub_id_offline_is_one_line(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    offline(monkeypatch)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    with pytest.raises(ValueError) as info:
        load_rows("nobody-here/no-such-dataset:main:train", what="data.train")
    message = str(info.value)
    assert message.startswith("data.train: cannot load dataset id 'nobody-here/no-such-dataset")
    assert "\n" not in message
    assert message.endswith(
        "(offline, the dataset must be in the datasets cache, or a local copy given: "
        "data.train=FILE (.jsonl, .json, .parquet, .csv) or a save_to_disk directory)"
    )


def test_which_values_are_local_and_which_are_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "openai").mkdir()
    (tmp_path / "openai" / "gsm8k").mkdir()  # an existing local directory wins over the id
    assert parse_source("openai/gsm8k:main:train", what="k").kind == "directory"
    assert parse_source("other/gsm8k:main:train", what="k").kind == "hub"
    for missing in ("train.jsonl", "./gsm8k", "/no/such/dir", "~/nope", "x.parquet:a:b"):
        with pytest.raises(FileNotFoundError, match="k: file not found"):
            parse_source(missing, what="k")
    # where a relative one was looked for (a config file's paths are the current
    # directory's, not the file's: it said "file not found: train.jsonl" alone)
    for missing, said in (
        ("train.jsonl", f"train.jsonl (looked for {tmp_path / 'train.jsonl'})"),
        ("./gsm8k", f"./gsm8k (looked for {tmp_path / 'gsm8k'})"),
        ("/no/such/dir", "/no/such/dir"),
    ):
        with pytest.raises(FileNotFoundError) as err:
            parse_source(missing, what="k")
        assert str(err.value) == f"k: file not found: {said}"
    with pytest.raises(ValueError, match="more than SOURCE:CONFIG:SPLIT"):
        parse_source("a/b:c:d:e", what="k")
    with pytest.raises(ValueError, match="neither an existing local path nor a dataset id"):
        parse_source("a b/c", what="k")
    (tmp_path / "x.txt").write_text("prompt\n")
    with pytest.raises(ValueError, match=r"data.eval: .* must end in"):
        load_rows(tmp_path / "x.txt", what="data.eval")
    (tmp_path / "d.jsonl").write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match="data.train: .* line 2 is not JSON"):
        load_rows(tmp_path / "d.jsonl", what="data.train")


def test_template_system_prompt_and_answer_extraction():
    data = data_config(
        "data.train=gsm8k",
        "data.prompt_template=Q: {question}\nPut the answer in \\boxed{{}}. A:",
        "data.system_prompt=You are careful: think {step} by step.",
        "data.answer_column=answer",
    )
    rows = prepare_rows(GSM8K_ROWS, data, what="data.train")
    assert rows[0]["prompt"] == [
        {"role": "system", "content": "You are careful: think {step} by step."},
        {"role": "user", "content": f"Q: {GSM8K_ROWS[0]['question']}\nPut the answer in "
                                    "\\boxed{}. A:"},
    ]  # fmt: skip
    assert [r["answer"] for r in rows] == ["7", "5", "42"]
    assert rows[0]["question"] == GSM8K_ROWS[0]["question"]  # other columns stay


def test_prompt_column_chat_rows_and_boxed_answers():
    math_rows = [{"problem": "1/2+0?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}]
    data = data_config("data.prompt_column=problem", "data.answer_column=solution")
    rows = prepare_rows(math_rows, data, what="data.train")
    assert rows[0]["prompt"] == "1/2+0?" and rows[0]["answer"] == "\\frac{1}{2}"
    assert rows[0]["solution"] == math_rows[0]["solution"]
    # a chat prompt that has its own system message keeps it; string prompts become chat
    chat_rows = [
        {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "q"}]},
        {"prompt": "plain"},
    ]
    rows = prepare_rows(chat_rows, data_config("data.system_prompt=sys"), what="data.train")
    assert rows[0]["prompt"] == chat_rows[0]["prompt"]
    assert rows[1]["prompt"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "plain"},
    ]
    rows = prepare_rows(chat_rows[1:], data_config("data.chat_template=true"), what="data.train")
    assert rows[0]["prompt"] == [{"role": "user", "content": "plain"}]


def test_the_tests_column_is_read_as_the_code_rewards_tests():
    """APPS and TACO keep their tests in ``input_output``: the code reward reads ``tests``."""
    calls = json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]})
    apps = [{"question": "Write add.", "input_output": calls}]
    data = data_config("data.prompt_column=question", "data.tests_column=input_output")
    (row,) = prepare_rows(apps, data, what="data.train")
    assert row["tests"] == calls and row["input_output"] == calls
    with pytest.raises(ValueError, match="data.tests_column: no column 'input_output' of "):
        prepare_rows([{"question": "q"}], data, what="data.train")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["data.prompt_column=questoin"], "data.prompt_column: no column 'questoin' of "),
        (["data.prompt_template=Q: {questoin}"], "data.prompt_template: no column 'questoin'"),
        (
            ["data.prompt_column=question", "data.answer_column=solution"],
            "data.answer_column: no column 'solution' of ",
        ),
    ],
)
def test_bad_columns_name_the_key_and_the_columns(overrides, expected):
    data = data_config("data.train=t.jsonl", *overrides)
    with pytest.raises(ValueError) as info:
        prepare_rows(GSM8K_ROWS, data, what="data.train")
    message = str(info.value)
    assert message.startswith(expected)
    assert "data.train (t.jsonl; columns: question, answer)" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ({"role": "usr", "content": "1+1="}, "message 1 has the role 'usr'; did you mean 'user'?"),
        ({"role": "user", "text": "1+1="}, "message 1 has no 'content' (its keys: role, text)"),
    ],
)
def test_a_misspelt_role_or_content_key_in_a_chat_prompt_is_named(message, said):
    """The chat template wrote nothing for such a message, and the row was refused as
    "the prompt is empty (0 tokens)", which named neither."""
    data = data_config("data.train=t.jsonl")
    with pytest.raises(ValueError) as info:
        prepare_rows([{"prompt": [message]}], data, what="data.train")
    assert str(info.value).startswith(f"data.train (t.jsonl) row 1: {said}")
    kept = [{"role": "model", "content": "x"}, {"role": "assistant", "tool_calls": []}]
    assert prepare_rows([{"prompt": kept}], data, what="data.train")[0]["prompt"] == kept


def test_cold_start_rows_need_no_answer_column():
    """data.answer_column was required of data.sft's rows too, which nothing scores: a
    prompt/completion SFT file beside RL rows with a solution column was refused."""
    data = data_config("data.train=t.jsonl", "data.sft=s.jsonl", "data.answer_column=solution")
    sft = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}]
    rows = prepare_rows(sft, data, what="data.sft", sft=True)
    assert [(r["prompt"], r["completion"]) for r in rows] == [("1+1=", "2"), ("2+2=", "4")]
    assert all("answer" not in r for r in rows)
    with pytest.raises(ValueError, match="data.answer_column: no column 'solution'"):
        prepare_rows(sft, data, what="data.train")


def test_a_column_name_with_spaces_around_it_is_pointed_to(tmp_path):
    """A CSV header "prompt , answer" said only "no column 'prompt'" (columns: prompt ,  answer)."""
    path = tmp_path / "s.csv"
    path.write_text("prompt , answer\nq,1\n")
    data = data_config(f"data.train={path}", "data.answer_column=answer")
    with pytest.raises(ValueError) as err:
        prepare_rows(load_rows(path, what="data.train"), data, what="data.train")
    assert str(err.value) == (
        f"data.prompt_column: no column 'prompt' of data.train ({path}; columns: prompt ,  "
        "answer) (the column 'prompt ' differs by spaces around it)"
    )


def test_a_column_missing_from_a_later_row_names_the_row():
    rows = [{"prompt": "a"}, {"prompt": "b"}, {"question": "c"}]
    with pytest.raises(ValueError, match="no column 'prompt' in row 3 of data.eval"):
        prepare_rows(rows, data_config(), what="data.eval")


def test_sft_rows_need_their_completion_column():
    data = data_config("data.prompt_column=question", "data.completion_column=answer")
    rows = prepare_rows(GSM8K_ROWS, data, what="data.sft", sft=True)
    assert rows[2]["completion"] == GSM8K_ROWS[2]["answer"]
    with pytest.raises(ValueError, match="data.completion_column: no column 'completion'"):
        prepare_rows(GSM8K_ROWS, data_config("data.prompt_column=question"), what="data.sft",
                     sft=True)  # fmt: skip


def test_sft_rows_of_messages_split_before_the_first_assistant_message():
    """TRL's conversational SFT rows (a `messages` column) were "no column 'prompt'"."""
    system, user = {"role": "system", "content": "s"}, {"role": "user", "content": "1+1="}
    answer, more = {"role": "assistant", "content": "2"}, {"role": "user", "content": "and?"}
    rows = [{"messages": [system, user, answer, more, answer]}]
    got = prepare_rows(rows, data_config(), what="data.sft", sft=True)
    assert got[0]["prompt"] == [system, user] and got[0]["completion"] == [answer, more, answer]
    for bad, said in (([user], "no assistant message"), ([answer], "no message before")):
        with pytest.raises(
            ValueError,
            match=rf"^data.sft \(the built-in addition task\) row 2: messages has {said}",
        ):
            prepare_rows([*rows, {"messages": bad}], data_config(), what="data.sft", sft=True)
    with pytest.raises(ValueError, match="data.prompt_column: no column 'prompt'"):
        prepare_rows(rows, data_config(), what="data.train")  # RL prompts: as before


@pytest.mark.parametrize(
    ("messages", "said"),
    [
        # a misspelt assistant said "messages has no assistant message", no hint
        ([{"role": "user", "content": "1+1="}, {"role": "asistant", "content": "2"}],
         "message 2 has the role 'asistant'; did you mean 'assistant'?"),
        # a turn without content was learnt as an empty one, only counted in a warning
        ([{"role": "user", "content": "1+1="}, {"role": "assistant", "text": "2"}],
         "message 2 has no 'content' (its keys: role, text)"),
    ],
)  # fmt: skip
def test_a_cold_start_conversations_misspelt_role_or_missing_content_names_it(messages, said):
    data = data_config("data.sft=s.jsonl")
    with pytest.raises(ValueError) as err:
        prepare_rows([{"messages": messages}], data, what="data.sft", sft=True)
    assert str(err.value).startswith(f"data.sft (s.jsonl) row 1: {said}")
    prompt = [{"role": "user", "content": "1+1="}]  # (a completion column's messages too)
    with pytest.raises(ValueError) as err:
        rows = [{"prompt": prompt, "completion": messages[1:]}]
        prepare_rows(rows, data, what="data.sft", sft=True)
    assert str(err.value).startswith(f"data.sft (s.jsonl) row 1: {said.replace('2', '1', 1)}")
    empty = [*prompt, {"role": "assistant", "content": ""}]  # (written empty: the warning)
    assert prepare_rows([{"messages": empty}], data, what="data.sft", sft=True)


def test_number_cells_are_read_as_the_numbers_written():
    """A CSV column with a blank cell is read as floats: answer_column made 58 "58.0" (no
    exact_match ever 1), and a number completion was the tokenizer's error naming no row."""
    rows = [{"q": "a", "a": 58.0, "c": 5}, {"q": "b", "a": float("nan"), "c": 2.0}]
    data = data_config("data.prompt_column=q", "data.answer_column=a", "data.completion_column=c")
    got = prepare_rows(rows, data, what="data.sft", sft=True)
    assert [(r["answer"], r["completion"]) for r in got] == [("58", "5"), (None, "2")]
    rows[1]["c"] = None
    with pytest.raises(ValueError) as err:
        prepare_rows(rows, data, what="data.sft", sft=True)
    assert str(err.value) == (
        "data.sft (the built-in addition task) row 2: the completion (column 'c') is None; "
        "a cold-start completion is "
        "text or a list of chat messages (each a mapping with a 'role' and its 'content')"
    )
    rows[1]["c"] = ["2"]  # (a list of strings: an AttributeError deep in the cold start)
    with pytest.raises(ValueError, match=r"task\) row 2: the completion \(column 'c'\) is"):
        prepare_rows(rows, data, what="data.sft", sft=True)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("\\boxed{} {question}", "{} is a positional field"),
        ("{0} {question}", "{0} is a positional field"),
        ("Q: {question", "not a format string"),
        ("Q: question}", "not a format string"),
    ],
)
def test_malformed_templates_are_config_errors(template, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"data.prompt_template={template}"])
    assert str(info.value).startswith(f"data.prompt_template: {expected}")


def test_template_fields_and_one_prompt_key():
    assert template_fields("{a} {b[0]} {c.real} {{literal}}") == ["a", "b", "c"]
    with pytest.raises(ConfigError, match="set one of data.prompt_column and data.prompt_template"):
        load_config(None, ["data.prompt_column=q", "data.prompt_template={q}"])


def test_chat_template_kwargs_reach_the_template():
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if not think %}[no]{% endif %}{% endif %}"
    )
    messages = [{"role": "user", "content": "hi"}]
    assert tok.decode(encode_prompt(messages, tok)).endswith("assistant:[no]")
    assert tok.decode(encode_prompt(messages, tok, think=True)).endswith("assistant:")


@pytest.mark.slow
def test_cli_trains_on_a_dataset_directory_with_a_template(gsm8k_dir, tmp_path):
    """Issue 18's line, overrides on both sides of an option, a template with colons."""
    from conftest import CPU

    from gspo.cli import main
    from gspo.telemetry import read_metrics

    out = tmp_path / "run"
    small = [CPU, "model.layers=1", "model.hidden=32", "model.heads=2", "model.kv_heads=1",
             "model.intermediate=64", "rollout.group_size=2", "rollout.prompts_per_batch=2",
             "rollout.max_new_tokens=3", "algorithm.minibatches=1", "train.max_steps=1",
             "eval.samples=1", "log.progress=false", "log.plots=false",
             "log.tensorboard=false"]  # fmt: skip
    code = main(
        [
            "train",
            "data.prompt_template=Q: {question} A:",
            f"data.train={gsm8k_dir}::train",
            "--output-dir",
            str(out),
            f"data.eval={gsm8k_dir}::test",
            "data.answer_column=answer",
            "reward.functions=[numeric_match]",
            *small,
        ]
    )
    assert code == 0
    config = load_config(out / "config.yaml")
    assert config.data.prompt_template == "Q: {question} A:"
    assert any("train/loss" in r for r in read_metrics(out / "metrics.jsonl"))


def test_drop_long_prompts_leaves_them_out_with_a_count(tmp_path, capsys):
    """verl's filter_overlong_prompts had no equivalent: one prompt too long for the context
    stopped the whole run. With data.drop_long_prompts the prompts that leave fewer than
    rollout.max_new_tokens positions are left out, counted; none left is an error."""
    from conftest import CPU

    from gspo.cli import main

    # (602 tokens: past the context of 512; 508: leaves 4 positions, rollout.max_new_tokens 8)
    rows = [
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": "1+" * 300 + "2=", "answer": "3"},
        {"prompt": "1+" * 253 + "2=", "answer": "3"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [CPU, "model.layers=1", "model.hidden=32", "model.heads=2", "model.kv_heads=1",
                 "model.intermediate=64", f"data.train={data}", "train.cold_start_steps=0",
                 "train.max_steps=1", "algorithm.minibatches=1", "rollout.prompts_per_batch=2",
                 "rollout.group_size=2", "log.completions_every=1", "data.drop_long_prompts=true",
                 "reward.functions=[numeric_match]"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) == 0
    assert (
        f"gspo: warning: data.train ({data}): data.drop_long_prompts left out 2 of 4 prompts "
        "(row 2 first), which leave fewer than rollout.max_new_tokens=8 positions of the "
        "model's context of 512 (max_position_embeddings)\n"
    ) in capsys.readouterr().err
    logged = (tmp_path / "run" / "completions" / "rollout-000000.jsonl").read_text()
    prompts = {json.loads(line)["prompt"] for line in logged.splitlines()}
    assert prompts == {"1+2=", "2+2="}
    data.write_text(json.dumps(rows[1]) + "\n")
    assert main(["train", "--output-dir", str(tmp_path / "run2"), *overrides]) == 2
    said = capsys.readouterr().err.strip()
    assert said.endswith(
        "left out 1 of 1 prompts (row 1 first), which leave fewer than "
        "rollout.max_new_tokens=8 positions of the model's context of 512 "
        "(max_position_embeddings): none is left"
    )


def test_the_starts_warnings_count_the_rows_drop_long_prompts_keeps(tmp_path, capsys):
    """The start's warnings were made before data.drop_long_prompts dropped rows: a dropped
    row's empty or non-numeric answer was warned of, counted among all the file's rows,
    'fewer than rollout.prompts_per_batch' was not said of the 2 rows left, and 'data.eval
    has 4 rows; eval.max_prompts=3 evaluates the first 3' was said of 2. The rows left
    keep their numbers in the file."""
    from conftest import CPU

    from gspo.cli import main

    rows = [
        {"prompt": "1+2=", "answer": "3"},
        {"prompt": "1+" * 300 + "2=", "answer": None},  # (dropped)
        {"prompt": "1+" * 253 + "2=", "answer": "seven"},  # (dropped)
        {"prompt": "2+2=", "answer": None},
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [CPU, "model.layers=1", "model.hidden=32", "model.heads=2", "model.kv_heads=1",
                 "model.intermediate=64", f"data.train={data}", f"data.eval={data}",
                 "eval.max_prompts=3", "eval.every=0", "train.cold_start_steps=0",
                 "train.max_steps=1", "algorithm.minibatches=1", "rollout.prompts_per_batch=3",
                 "rollout.group_size=2", "data.drop_long_prompts=true", "log.progress=false",
                 "reward.functions=[numeric_match]"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "gspo: warning" in line]
    assert (
        f"gspo: warning: data.train ({data}): 1 of 2 rows (row 4) has no 'answer', which "
        "reward function 'numeric_match' needs: their completions are not scored" in said
    )
    assert (
        f"gspo: warning: data.train ({data}) has 2 rows, fewer than "
        "rollout.prompts_per_batch=3: each rollout batch takes some prompts more than once "
        "(their groups are alike; a smaller rollout.prompts_per_batch takes each once)" in said
    )
    assert not [line for line in said if "not a number" in line or "eval.max_prompts" in line]
    assert len([line for line in said if "has no 'answer'" in line]) == 2  # (train, eval)


@pytest.mark.parametrize(
    ("rows", "said"),
    [
        ([{"prompt": "1+2=", "answer": "3"}, {"prompt": "", "answer": "3"}],
         "data.train (TRAIN) row 2: the prompt is empty (0 tokens): ''"),
        ([{"prompt": "1+2=", "answer": "3"}, {"prompt": " \n\t", "answer": "3"}],
         "data.train (TRAIN) row 2: the prompt is only whitespace: ' \\n\\t'"),
        ([{"prompt": "1+2=", "answer": "3"},
          {"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": " "}],
           "answer": "3"}],
         "data.train (TRAIN) row 2: every user message is blank"),
        ([{"prompt": "1+2=", "answer": "3"}, {"prompt": 12, "answer": "3"}],
         "data.train (TRAIN) row 2: the prompt is 12 (a number: data.prompt_template={prompt} "
         "writes it as text); a prompt is text or a list of chat messages "
         "(each a mapping with a 'role' and its 'content')"),
        ([{"prompt": "1+" * 300 + "2=", "answer": "3"}],
         "data.train (TRAIN) row 1: the prompt is 602 tokens, longer than the model's context "
         "of 512 "
         "(max_position_embeddings)"),
    ],
)  # fmt: skip
def test_prompts_the_model_cannot_take_name_their_row(tmp_path, capsys, rows, said):
    """An empty prompt reached the model as a 0-token sequence (a reshape traceback, or
    with good rows beside it, sampling from nothing); a too-long one ran past the context."""
    from conftest import CPU

    from gspo.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [CPU, "model.layers=1", "model.hidden=32", "model.heads=2", "model.kv_heads=1",
                 "model.intermediate=64", f"data.train={data}", "train.cold_start_steps=0",
                 "train.max_steps=1", "reward.functions=[numeric_match]"]  # fmt: skip
    assert main(["train", "--output-dir", str(tmp_path / "run"), *overrides]) == 2
    said = said.replace("TRAIN", str(data))  # (the file the user opens)
    assert capsys.readouterr().err.strip() == f"gspo: error: {said}"


def test_a_chat_prompt_that_renders_to_nothing_names_its_row():
    from gspo.training.prompts import encode_prompts
    from gspo.training.sampler import SingleTurn

    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"prompt": [{"role": "user", "content": "1+2="}]}, {"prompt": [{"role": "user"}]}]
    with pytest.raises(ValueError) as err:
        encode_prompts(load_config(), SingleTurn(None), tok, rows, name="data.eval")
    assert str(err.value) == "data.eval row 2: the prompt is empty (0 tokens): [{'role': 'user'}]"
    assert encode_prompts(load_config(), SingleTurn(None), tok, rows[:1], name="data.eval") == [
        tok("1+2=")["input_ids"]
    ]


def test_a_chat_message_of_a_role_the_template_leaves_out_names_it():
    """Qwen's template writes nothing for a role it does not know: the message was
    dropped, unsaid; a template that writes every role (Llama's, Gemma's model) is kept."""
    from gspo.training.prompts import encode_prompts
    from gspo.training.sampler import SingleTurn

    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] in ['system', 'user', 'assistant', 'tool'] %}"
        "{{ m['content'] }}{% endif %}{% endfor %}"
    )
    narrated = [{"role": "narrator", "content": "it rains"}, {"role": "user", "content": "1+2="}]
    rows = [{"prompt": [{"role": "user", "content": "1+2="}]}, {"prompt": narrated}]
    with pytest.raises(ValueError) as err:
        encode_prompts(load_config(), SingleTurn(None), tok, rows, name="data.train (t.jsonl)")
    assert str(err.value) == (
        "data.train (t.jsonl) row 2: message 1 has the role 'narrator', which the chat "
        "template writes nothing for (the roles every template knows: system, user, "
        "assistant, tool)"
    )
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
    assert len(encode_prompts(load_config(), SingleTurn(None), tok, rows, name="t")) == 2
    # Llama 3's ipython turns are written JSON-encoded: a quote or a line break in one is
    # its text all the same (the review's case: refused)
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'ipython' %}{{ m['content'] | tojson }}"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    )
    result = [{"role": "user", "content": "run it"},
              {"role": "ipython", "content": '{"result": "ok"}\nline 2'}]  # fmt: skip
    assert encode_prompts(load_config(), SingleTurn(None), tok, [{"prompt": result}], name="t")


def test_prompts_with_text_the_tokenizer_lacks_are_a_warning(capsys):
    """The built-in character tokenizer maps characters it lacks (emoji, CJK) to <unk>:
    said (before: silently)."""
    from gspo.training.prompts import encode_prompts
    from gspo.training.sampler import SingleTurn

    tok = build_char_tokenizer()
    rows = [{"prompt": "1+2="}, {"prompt": "1+2=😀"}, {"prompt": "二+2="}]
    ids = encode_prompts(load_config(), SingleTurn(None), tok, rows, name="data.train")
    assert ids[1][-1] == tok.unk_token_id
    assert capsys.readouterr().err.strip() == (
        "gspo: warning: data.train: 2 prompt(s) (row 2 first) hold text the tokenizer does "
        "not have, which it encodes as <unk>: the model never sees it"
    )
    encode_prompts(load_config(), SingleTurn(None), tok, rows[:1], name="data.train")
    assert capsys.readouterr().err == ""


def test_a_file_datasets_cannot_read_is_our_one_line_only(tmp_path, capfd):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file at all")
    with pytest.raises(ValueError, match=r"data.train: cannot read .*bad.parquet: ArrowInvalid"):
        load_rows(bad, what="data.train")
    out, err = capfd.readouterr()
    assert "Failed to read schema" not in out + err  # datasets' own logged error, before
    import datasets

    assert datasets.logging.get_verbosity() == datasets.logging.WARNING  # restored
    model = tmp_path / "model"  # a directory that is no dataset (a model's, say)
    model.mkdir()
    (model / "config.yaml").write_text("a: 1\n")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError) as err:
        load_rows(model, what="data.train")
    assert str(err.value).endswith(
        "(a directory must hold a datasets.save_to_disk dataset, or data files of one kind: "
        ".jsonl, .json, .parquet, .csv)"
    )


def test_a_split_written_as_a_config_is_pointed_to_the_split(tmp_path):
    """``DIR:train`` reads ``train`` as a config name (datasets: "BuilderConfig 'train' not
    found"); the error now says how to name the split, which then loads."""
    data = tmp_path / "dd"
    data.mkdir()
    (data / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError) as err:
        load_rows(f"{data}:train", what="data.train")
    assert str(err.value).endswith(
        f"; for the split 'train' write {data}::train (SOURCE:CONFIG:SPLIT)"
    )
    assert load_rows(f"{data}::train", what="data.train") == [{"prompt": "1+1=", "answer": "2"}]


def test_structured_tool_calls_in_a_cold_start_conversation_are_refused():
    """OpenAI's / TRL's assistant message with tool_calls and content null trained the
    model to end its turn where the call should be (and null would have been "None")."""
    from gspo.data import prepare_rows

    call = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    turns = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "done"},
    ]
    rows = [{"prompt": "1+2=", "completion": "3"}, {"prompt": "1+2=", "completion": turns}]
    with pytest.raises(
        ValueError,
        match=r"^data.sft \(the built-in addition task\) row 2: an assistant message with tool",
    ):
        prepare_rows(rows, load_config().data, what="data.sft", sft=True)


def test_a_template_naming_a_method_is_refused(tmp_path):
    """``{question.upper}`` rendered ``<built-in method upper of str object at 0x...>`` into
    every prompt, silently; an attribute that is a value (``{n.real}``) renders."""
    from gspo.data import prepare_rows

    rows = [{"question": "2+2", "n": 3}]
    bad = load_config(None, ["data.train=x.jsonl", "data.prompt_template=Q: {question.upper} A:"])
    with pytest.raises(ValueError, match=r"\{question.upper\} is a method of the column's value"):
        prepare_rows(rows, bad.data, what="data.train")
    good = load_config(None, ["data.train=x.jsonl", "data.prompt_template={question} {n.real}"])
    assert prepare_rows(rows, good.data, what="data.train")[0]["prompt"] == "2+2 3"


def test_a_template_whose_every_field_is_blank_is_refused():
    """Every prompt of such rows was the template's own text ("Q:  Context: "), unsaid; one
    field blank beside another (an optional context) is a prompt."""
    from gspo.data import prepare_rows

    template = ["data.train=x.jsonl", "data.prompt_template=Q: {q} Context: {c}"]
    config = load_config(None, template)
    ok = [{"q": "2+2", "c": "", "answer": "4"}]
    assert prepare_rows(ok, config.data, what="data.train")[0]["prompt"] == "Q: 2+2 Context: "
    blank = [*ok, {"q": " ", "c": "", "answer": "4"}]
    with pytest.raises(ValueError, match=r"row 2 of .*\{q\}, \{c\} blank: the prompt is the "):
        prepare_rows(blank, config.data, what="data.train")
    # under rollout.environment its reset writes the rest of the prompt: blank ones are kept
    # (as '' always was there), a template's, a string's or a chat's
    kept = prepare_rows(blank, config.data, what="data.train", blank_ok=True)
    assert kept[1]["prompt"] == "Q:   Context: "
    plain = load_config(None, ["data.train=x.jsonl"]).data
    rows = [{"prompt": "\n", "answer": "4"}, {"prompt": [{"role": "user", "content": " "}]}]
    assert prepare_rows(rows, plain, what="data.train", blank_ok=True)[0]["prompt"] == "\n"


def test_a_chat_message_without_role_or_content_says_so():
    """It was 'the prompt is empty (0 tokens)'."""
    from gspo.chat import encode_prompt
    from gspo.models import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"chat message 0 must be a mapping with a 'role'"):
        encode_prompt([{"content": "0+1="}], tokenizer)
    assert encode_prompt([{"role": "user", "content": "0+1="}], tokenizer)


def test_prompts_that_leave_no_room_for_a_response_are_warned(capsys):
    """A prompt that fits the context but not with rollout.max_new_tokens ran past
    max_position_embeddings, unsaid."""
    from gspo.training.prompts import encode_prompts
    from gspo.training.sampler import SingleTurn

    tok = build_char_tokenizer()
    rows = [{"prompt": "1+2="}, {"prompt": "1" * 30}, {"prompt": "2" * 29}]
    config = load_config(None, ["rollout.max_new_tokens=8"])
    encode_prompts(config, SingleTurn(None), tok, rows, name="data.train", context=36)
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: warning: data.train: 2 prompt(s) (the longest 30 tokens) ")
    assert "\n" not in err
    encode_prompts(config, SingleTurn(None), tok, rows[:1], name="data.train", context=36)
    assert capsys.readouterr().err == ""
    # a model whose positions are a table (GPT-2's wpe): past it the lookup failed, after
    # the cold start ("IndexError: index out of range in self"); refused before the run
    with pytest.raises(ValueError, match=r"^data.train: 2 prompt\(s\) .* a learned table"):
        encode_prompts(config, SingleTurn(None), tok, rows, name="data.train", context=36,
                       learned_positions=True)  # fmt: skip


@pytest.mark.parametrize(
    ("rope", "positions"),
    [({"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 16,
      "original_max_position_embeddings": 24}, 24),
     ({"rope_type": "dynamic", "factor": 4.0}, 64),
     ({"rope_type": "linear", "factor": 4.0}, None)],
    ids=["longrope", "dynamic", "linear"],
)  # fmt: skip
def test_rollouts_past_where_the_rope_rescales_are_warned(capsys, rope, positions):
    """transformers' dynamic and longrope rotary embeddings rescale their frequencies from
    the largest position a call sees: past that point the sampler's cached decode and the
    trainer's forward part (measured here: within float32 rounding while the sequences stay
    within the length, not past it). Said once, where the rollouts can reach it; a fixed
    scaling never."""
    import torch
    from conftest import SMALL
    from transformers import GPTJConfig, GPTJForCausalLM, LlamaConfig, LlamaForCausalLM

    from gspo.engines import SamplingParams, TorchEngine
    from gspo.models import build_tiny_model, completion_logprobs, length_dependent_rope
    from gspo.training.prompts import warn_length_dependent_rope
    from gspo.training.sampler import SingleTurn

    tok = build_char_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=64, max_position_embeddings=64,
        rope_parameters={"rope_theta": 10000.0, **rope},
    ))  # fmt: skip
    capsys.readouterr()  # (transformers' own remarks on the config)
    found = length_dependent_rope(model)
    assert found == (None if positions is None else (rope["rope_type"], positions))
    prompts = [[1] * 10, [1] * 12]
    for new_tokens in (8, 60):
        config = load_config(None, [f"rollout.max_new_tokens={new_tokens}"])
        warn_length_dependent_rope(config, SingleTurn(None), model, prompts, context=None)
        err = capsys.readouterr().err
        if positions is None or 12 + new_tokens <= positions:
            assert err == ""
        else:
            kind, reach = rope["rope_type"], 12 + new_tokens
            assert err.startswith(
                f"gspo: warning: the model's rotary embedding ({kind}) rescales its frequencies "
                f"once a forward sees more than {positions} positions, and rollouts here reach "
                f"{reach} (prompt 12 + rollout.max_new_tokens)"
            )
            assert err.count("\n") == 1
    assert length_dependent_rope(build_tiny_model(SMALL, tok, seed=0)) is None  # Qwen3's default
    gptj = GPTJConfig(vocab_size=len(tok), n_embd=64, n_layer=1, n_head=2, rotary_dim=16)
    assert length_dependent_rope(GPTJForCausalLM(gptj)) is None  # a rotary without a type
    capsys.readouterr()  # (transformers' remarks on GPT-J's token ids)
    # through the run's own call: a single turn runs past max_position_embeddings (64),
    # which bounds nothing for a rotary model (the dynamic embedding's length is that one)
    from gspo.tasks import TaskData
    from gspo.training.prompts import task_prompt_ids

    data = TaskData(train=[{"prompt": "1" * 12}], eval=[{"prompt": "1+2="}], sft=[])
    config = load_config(None, ["rollout.max_new_tokens=60"])
    task_prompt_ids(config, SingleTurn(None), tok, model, data)
    err = capsys.readouterr().err
    said = f"gspo: warning: the model's rotary embedding ({rope['rope_type']}) rescales"
    assert (said in err) == (positions is not None), err
    # the rollouts cannot pass the model's context; vLLM's longrope parts below the length
    config = load_config(None, ["rollout.max_new_tokens=60"])
    warn_length_dependent_rope(config, SingleTurn(None), model, prompts, context=20)
    assert capsys.readouterr().err == ""
    for limit, said in (("null", True), (positions or 64, False)):
        config = load_config(None, ["rollout.engine=vllm", f"rollout.vllm.max_model_len={limit}"])
        warn_length_dependent_rope(config, SingleTurn(None), model, prompts, context=64)
        err = capsys.readouterr().err
        if rope["rope_type"] == "longrope" and said:
            assert err.startswith("gspo: warning: vLLM takes the long factors of the model's "
                                  "longrope at every position when its max_model_len (64) "
                                  "passes 24")  # fmt: skip
        elif rope["rope_type"] == "longrope":
            assert err == ""
    gaps = []
    for new_tokens in (8, 72):  # 4 + 8 positions, then 4 + 72: past 24 (longrope) and 64
        engine = TorchEngine(model.eval(), pad_token_id=tok.pad_token_id, eos_token_id=None)
        batch = engine.generate(
            [tok("1+2=")["input_ids"]], n=2, params=SamplingParams(new_tokens), seed=0
        )
        with torch.no_grad():
            trainer = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask,
                                          batch.completion_ids, batch.completion_mask)  # fmt: skip
        gaps.append(float((trainer - batch.sampler_logprobs).abs().max()))
    assert gaps[0] < 1e-5
    assert (gaps[1] > 1e-4) == (positions is not None), gaps


@pytest.mark.parametrize(
    ("name", "content", "rows"),
    [
        ("a.csv", "\ufeffprompt,answer\r\nq1,007\r\nq2,\r\nq3,NA\r\nq4,12345678901234567\r\n",
         [["q1", "007"], ["q2", None], ["q3", "NA"], ["q4", 12345678901234567]]),
        ("a.json", '[{"prompt": "q1", "answer": "007"}, {"prompt": "q2", "answer": 5}]',
         [["q1", "007"], ["q2", 5]]),
        ("a.json", '{"prompt": ["q1", "q2"], "answer": ["0.50", null]}',
         [["q1", "0.50"], ["q2", None]]),
        ("a.json", '{"prompt": "q1", "answer": "1"}\n{"prompt": "q2"}\n',
         [["q1", "1"], ["q2", None]]),
        ("a.jsonl", '\ufeff{"prompt": "q1", "answer": "1"}\n\n{"prompt": "q2"}\n',
         [["q1", "1"], ["q2", None]]),
        # a JSON string may hold U+2028 as it is (str.splitlines cut the line there);
        # NaN and Infinity (Python's, not JSON) are None, as datasets reads them
        ('a.jsonl', '{"prompt": "a\u2028b", "answer": NaN}\n{"prompt": "c", "answer": Infinity}',
         [["a\u2028b", None], ["c", None]]),
        # a spreadsheet's trailing unnamed columns, a cell longer than csv's default limit
        ("a.csv", "prompt,answer,,\nq1,1,,\n" + "x" * 200_000 + ",2,,\n",
         [["q1", 1], ["x" * 200_000, 2]]),
        # a cell is a number only where the number's text is the cell; nan is None (below)
        ("a.csv", "prompt,answer\nq,0.5\nr,0.50\ns,+5\nt,1e3\nu,nan\nv,12.0\n",
         [["q", 0.5], ["r", "0.50"], ["s", "+5"], ["t", "1e3"], ["u", None], ["v", "12.0"]]),
    ],
)  # fmt: skip
def test_files_give_their_values_as_written(tmp_path, name, content, rows):
    """datasets' CSV and JSON readers inferred types: a gold answer 007 became 7, 0.50 0.5,
    12345678901234567 (beside a blank cell) 12345678901234568, NA None; a byte-order mark
    failed a .jsonl. A row without a column has it as None, as in a datasets table."""
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    assert [[r["prompt"], r["answer"]] for r in load_rows(path, what="data.train")] == rows


def test_a_csv_nan_is_no_answer_as_jsons_nan_is(tmp_path):
    """A CSV cell 'nan' (Python's csv writes a float NaN so) was the gold answer 'nan':
    exact_match and math scored every completion against it (0, or 1 for one saying nan),
    where JSON's NaN and null, and an empty CSV cell, leave the row unscored (None)."""
    from gspo.rewards import BUILTIN_REWARDS

    csv = tmp_path / "a.csv"
    csv.write_text("prompt,answer\na,nan\nb,NaN\nc,\nd,None\ne,-nan\n")
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"prompt": "a", "answer": NaN}\n{"prompt": "b", "answer": null}\n')
    answers = [r["answer"] for r in load_rows(csv, what="data.train")]
    assert answers == [None, None, None, "None", None]  # ('None' may be an answer: text)
    assert [r["answer"] for r in load_rows(jsonl, what="data.train")] == [None, None]
    for name in ("exact_match", "math"):
        scored = BUILTIN_REWARDS[name](prompts=["p"] * 5, completions=["nan"] * 5, answer=answers)
        assert scored[:3] == [None, None, None] and scored[4] is None, name


TWICE = "names the column {!r} twice; JSON readers keep one of the two silently: write it once"


@pytest.mark.parametrize(
    ("name", "content", "said"),
    [
        ("a.csv", "prompt,answer\nq one,ans one,extra\nq2,2\n",
         "line 2 has more fields than its header's 2 (prompt, answer); quote fields that hold "
         "commas"),
        ("a.csv", "prompt,prompt\nq,2\n", "names the column 'prompt' twice in its header"),
        ("a.csv", "prompt,answer\n", "has no rows"),
        ("a.jsonl", '{"prompt": "q", "answer": "1"}\n"q2"\n',
         "line 2 is str 'q2', not an object of columns"),
        ("a.json", '[{"prompt": "q"}, null]',
         "record 2 is NoneType None, not an object of columns"),
        ("a.json", '{"prompt": "q"}', "holds one object, not records: write an array of objects "
         "(or JSON Lines)"),
        # columns as lists, of unequal lengths: said as "one object, not records"
        ("a.json", '{"prompt": ["q", "r"], "answer": ["1"]}', "holds one object of column "
         "lists of unequal lengths ('prompt' 2, 'answer' 1): give each column one value a row"),
        # a column written twice: json.loads kept the last, silently
        ("a.jsonl", '{"prompt": "q"}\n{"prompt": "r", "answer": 1, "answer": 2}\n',
         f"line 2 {TWICE.format('answer')}"),
        ("a.json", '[{"prompt": "q"}, {"prompt": "q", "prompt": "r"}]',
         f"record 2 {TWICE.format('prompt')}"),
        ("a.json", '{"prompt": ["q"], "prompt": ["r"]}', TWICE.format("prompt")),
        ("a.json", "", "has no rows"),
        ("a.jsonl", b'{"prompt": "caf\xe9"}\n', "is not UTF-8 text (byte 0xe9 on line 1); save "
         "it as UTF-8"),
        # a quote left open took the rest of the file as one field
        ("a.csv", 'prompt,answer\n"q1,1\nq2,2\n', "is not CSV after line 1: a quote opened and "
         "never closed"),
        # an array broken on its line 3 said "line 1" (read again as JSON Lines)
        ("a.json", '[\n{"prompt": "q"},\n{"prompt": "r" "answer": 1}\n]',
         "is not JSON: Expecting ',' delimiter: line 3 column 16 (char 34)"),
    ],
)  # fmt: skip
def test_files_that_do_not_hold_records_are_one_line(tmp_path, name, content, said):
    """Tracebacks before (a later line that is JSON but no object; an empty .json), a
    datasets message without its cause (DatasetGenerationError), or rows shifted."""
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as err:
        load_rows(path, what="data.train")
    assert str(err.value) == f"data.train: {path} {said}"


def test_a_parquet_file_with_two_columns_of_one_name_is_one_line(tmp_path):
    """pyarrow's own error was "ArrowInvalid: Multiple matches for FieldRef.Name(answer)
    in prompt: string answer: string ... __fragment_index: int32 ..."."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "a.parquet"
    columns = [pa.array(["1+1="]), pa.array(["2"]), pa.array(["3"])]
    pq.write_table(pa.table(columns, names=["prompt", "answer", "answer"]), path)
    with pytest.raises(ValueError) as err:
        load_rows(path, what="data.train")
    assert str(err.value) == f"data.train: {path} names the column 'answer' twice; rename one"


def test_a_key_written_twice_inside_a_value_is_read_as_json_reads_it(tmp_path):
    """Only a record's columns are checked: a nested object (a column nothing may read,
    metadata, a tool schema) keeps the last value, as json and datasets read it; an object
    dropped that way does not mark another that takes its place in memory."""
    path = tmp_path / "a.jsonl"
    rows = ['{"prompt": "q", "meta": {"m": {"x": 1, "x": 2}, "m": 3}}', '{"prompt": "r", "a": 1}']
    path.write_text("\n".join([*rows, *rows]) + "\n")
    assert [r["meta"] for r in load_rows(path, what="data.train")] == [{"m": 3}, None] * 2
    array = tmp_path / "a.json"
    array.write_text("[" + ", ".join([*rows] * 50) + "]")
    assert len(load_rows(array, what="data.train")) == 100


def test_a_file_with_a_config_and_a_missing_local_directory_are_local_errors(tmp_path, monkeypatch):
    """An existing file with :CONFIG said "file not found"; a missing data/dir (its parent
    there), taken for a hub id, said nothing of the local path it may have meant."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"prompt": "q"}\n')
    with pytest.raises(ValueError, match=r"^data.train: data/a.jsonl:x: a file has no configs"):
        load_rows("data/a.jsonl:x", what="data.train")
    offline(monkeypatch)  # (data/nope is a dataset id's shape)
    with pytest.raises(ValueError, match=r"nor is there a local data/nope \(write ./data/nope"):
        load_rows("data/nope", what="data.train")
    # a typo of a local path, taken for a hub id: the path it is close to (a single word
    # said nothing local at all)
    (tmp_path / "mydata").mkdir()
    for typo, near in (("mydat", "mydata"), ("data/a.jsonI", "data/a.jsonl")):
        with pytest.raises(ValueError) as err:
            load_rows(typo, what="data.train")
        assert str(err.value).endswith(f"; nor is there a local {typo} (did you mean ./{near}?)")


@pytest.mark.parametrize(
    ("overrides", "row", "said"),
    [
        (["data.prompt_template=Q: {q} A:"], {"q": None},
         "data.prompt_template: row 2 of data.train (the built-in addition task; columns: q): "
         "ValueError: {q} is None, which would be written as such"),
        # (a missing float of a Parquet column was the prompt "Q: nan A:"; a mapping or a
        # verl prompt column of chat messages their repr, unsaid)
        (["data.prompt_template=Q: {q} A:"], {"q": float("nan")},
         "data.prompt_template: row 2 of data.train (the built-in addition task; columns: q): "
         "ValueError: {q} is NaN (a missing value), which would be written as 'nan'"),
        (["data.prompt_template=Q: {q} A:"], {"q": {"text": "2+2", "id": 7}},
         "data.prompt_template: row 2 of data.train (the built-in addition task; columns: q): "
         "ValueError: {q} is a mapping {'text': '2+2', 'id': 7}, whose repr would be written; "
         "name a field: {q[text]}"),
        (["data.prompt_template=Q: {q} A:"], {"q": [{"role": "user", "content": "2+2"}]},
         "data.prompt_template: row 2 of data.train (the built-in addition task; columns: q): "
         "ValueError: {q} is chat messages [{'role': 'user', 'content': '2+2'}], whose repr "
         "would be written; data.prompt_column takes chat messages as they are"),
        (["data.prompt_template=L{meta[level]}: {q}"], {"q": "x", "meta": {"lvl": 2}},
         "data.prompt_template: row 2 of data.train (the built-in addition task; columns: q, "
         "meta): "
         "KeyError: 'level'"),
        (["data.system_prompt=Be brief"], {"prompt": ["a", "b"]},
         "data.train (the built-in addition task) row 2: the prompt is ['a', 'b']; a prompt is "
         "text or a list of chat "
         "messages (each a mapping with a 'role' and its 'content')"),
        (["data.system_prompt=Be brief"], {"prompt": None},
         "data.train (the built-in addition task) row 2: no prompt: its 'prompt' is missing "
         "or null (data.prompt_column names the column)"),
    ],
)  # fmt: skip
def test_a_later_row_that_cannot_make_a_prompt_names_itself(overrides, row, said):
    """Each was a traceback (KeyError, TypeError, AttributeError), or for None in a
    template the prompt "Q: None A:"; only the first row was checked."""
    good = {k: ("x" if k != "meta" else {"level": 1}) for k in row}
    with pytest.raises(ValueError) as err:
        prepare_rows([good, row], data_config(*overrides), what="data.train")
    assert str(err.value) == said


def test_an_empty_source_in_a_yaml_file_is_refused(tmp_path):
    """``train: ""`` read the working directory as a dataset (the command line refused it)."""
    (tmp_path / "c.yaml").write_text('data:\n  sft: ""\n')
    with pytest.raises(ConfigError, match=r"data.sft: empty; name a file, a directory or a"):
        load_config(tmp_path / "c.yaml", [])


def test_rows_without_the_column_a_reward_needs_are_counted_in_a_warning():
    """Reward columns were checked against the first row alone: rows after it without an
    answer were never scored (and a first row without one said that the data lacked the column)."""
    from gspo.rewards import RewardFunctions
    from gspo.tasks import TaskData
    from gspo.training.setup import check_reward_columns

    rows = [{"prompt": "a", "answer": None}, {"prompt": "b", "answer": "1"}]
    rows += [{"prompt": "c", "answer": None}, {"prompt": "d", "answer": "  "}]
    rows += [{"prompt": "e", "answer": []}]  # (blank and an empty list: no answer either)
    rewards = RewardFunctions.from_specs(["exact_match", "format"], None)
    config = load_config(None, ["data.train=x.jsonl"])
    warned = check_reward_columns(rewards, TaskData(rows, rows[1:2], []), config, None)
    assert warned == [
        "data.train (x.jsonl): 4 of 5 rows (row 1 first) have no 'answer', which reward "
        "function 'exact_match' needs: their completions are not scored"
    ]
    scored = rewards(["p"] * 5, ["", "1", "", "", ""], {"answer": [r["answer"] for r in rows]})
    assert scored.per_function["exact_match"] == [None, 1.0, None, None, None]
    # the user's own function is called for them (it said "not scored", and they were)

    def none_is_one(completions, answer, **kwargs):
        return [1.0 if a is None else 0.0 for a in answer]

    rewards = RewardFunctions.from_specs([none_is_one], None)
    warned = check_reward_columns(rewards, TaskData(rows, rows[1:2], []), config, None)
    assert len(warned) == 1 and warned[0].endswith(
        "which reward function 'none_is_one' needs: it is called with their answer as it is "
        "(None, blank or [])"
    ), warned


def test_gold_answers_numeric_match_never_scores_are_counted_in_a_warning():
    """A gold answer that is no number ('seven', the text 'nan') left numeric_match's
    rows unscored, unsaid until a whole batch was (and not at all in a mixed one)."""
    from gspo.rewards import RewardFunctions
    from gspo.tasks import TaskData
    from gspo.training.setup import check_reward_columns

    answers = [7, "seven", "nan", "#### 72", "3/4", None, ["eight", "8"], ["x", "y"], 2.5]
    rows = [{"prompt": str(i), "answer": a} for i, a in enumerate(answers)]
    config = load_config(None, ["data.train=x.csv"])
    rewards = RewardFunctions.from_specs(["format", "numeric_match"], None)
    warned = check_reward_columns(rewards, TaskData(rows, [], []), config, None)
    assert warned[0] == (
        "data.train (x.csv): 3 of 9 rows (row 2 first) have a gold answer that is not a "
        "number, as 'seven', which reward function 'numeric_match' never scores (None): "
        "their completions are not scored by it"
    ), warned
    assert len(warned) == 2 and "row 6) has no 'answer'" in warned[1]  # (said once, there)
    # the count is the rows numeric_match returns None for (an empty one is said above)
    scored = rewards(["p"] * 9, ["7"] * 9, {"answer": answers})
    unscored = [i for i, s in enumerate(scored.per_function["numeric_match"], 1) if s is None]
    assert unscored == [2, 3, 6, 8]
    # exact_match compares text: no such line; numbers only: none either
    exact = RewardFunctions.from_specs(["exact_match"], None)
    assert not any(
        "not a number" in w
        for w in check_reward_columns(exact, TaskData(rows, [], []), config, None)
    )
    numbers = [r for r in rows if r["answer"] in (7, "3/4", 2.5)]
    assert check_reward_columns(rewards, TaskData(numbers, [], []), config, None) == []


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        ({"value": 7}, "is dict {'value': 7}"),
        (["7", {"value": 7}], "holds dict {'value': 7}"),
        ([["7", "8"]], "holds list ['7', '8']"),
        (b"7", "is bytes b'7'"),
    ],
)
def test_a_gold_answer_that_is_no_text_is_refused(answer, said):
    """A mapping (or bytes, a list in a list) as the gold answer was compared as its repr,
    "{'value': 7}": every completion scored 0, unsaid."""
    from gspo.rewards import RewardFunctions
    from gspo.tasks import TaskData
    from gspo.training.setup import check_reward_columns

    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": answer}]
    fix = "; a gold answer is text, a number or a list of them (any of them right)"
    data = data_config("data.train=x.jsonl", "data.answer_column=answer")
    with pytest.raises(ValueError) as err:
        prepare_rows(rows, data, what="data.train")
    assert str(err.value) == f"data.train (x.jsonl) row 2: the answer (column 'answer') {said}{fix}"
    rewards = RewardFunctions.from_specs(["exact_match"], None)
    config = load_config(None, ["data.train=x.jsonl"])
    with pytest.raises(ValueError) as err:  # (no data.answer_column: the column as it is)
        check_reward_columns(rewards, TaskData(rows, [], []), config, None)
    assert str(err.value) == (
        "data.train (x.jsonl) row 2: the answer (column 'answer', which reward function "
        f"'exact_match' compares) {said}{fix}"
    )
    # a bool is its text, True (as Python and pandas write it); your own function takes any
    assert (
        prepare_rows([{"prompt": "a", "answer": True}], data, what="data.train")[0]["answer"]
        == "True"
    )
    own = RewardFunctions.from_specs([lambda completions, answer, **kw: [0.0]], None)
    check_reward_columns(own, TaskData(rows, [], []), config, None)
    # a built-in after your own function compares it all the same (it went unchecked)
    both = RewardFunctions.from_specs([lambda completions, answer, **kw: [0.0], "math"], None)
    with pytest.raises(ValueError, match="which reward function 'math' compares"):
        check_reward_columns(both, TaskData(rows, [], []), config, None)


def test_a_missing_column_under_an_environment_names_the_datas_columns_and_the_default():
    """With an environment, the error listed ``environments`` (what the calls pass beside
    the columns) among the file's columns, and an environment without get_reward left
    exact_match, the default, needing an answer the data did not have, unsaid."""
    from types import SimpleNamespace

    from gspo.rewards import RewardError, RewardFunctions
    from gspo.tasks import TaskData
    from gspo.training.setup import check_reward_columns

    rows = [{"prompt": "a", "target": 3}]
    environment = SimpleNamespace(has_reward=False)
    rewards = RewardFunctions.from_specs(["exact_match"], None)
    config = load_config(None, ["data.train=x.jsonl"])
    with pytest.raises(RewardError) as err:
        check_reward_columns(rewards, TaskData(rows, [], []), config, environment)
    assert str(err.value) == (
        "reward function 'exact_match' needs the column(s) answer, which data.train "
        "(x.jsonl) lacks (its columns: target); the environment has no get_reward, so "
        "reward.functions scores its episodes, and its default is [exact_match]: set "
        "reward.functions"
    )
    named = load_config(None, ["data.train=x.jsonl", "reward.functions=[exact_match]"])
    with pytest.raises(RewardError, match=r"lacks \(its columns: target\)$"):  # set: no hint
        check_reward_columns(rewards, TaskData(rows, [], []), named, environment)

    # a function taking ``environments`` by name finds it, though no column gives it
    def by_episode(prompts, completions, environments, **kwargs):
        return [1.0] * len(completions)

    RewardFunctions.from_specs([by_episode], None).check_columns(
        ["target"], "data.train", passed=["environments"]
    )

    # and one that cannot take it hears that every call passes it, not the data
    def fixed(prompts, completions, target):
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match="takes no argument 'environments', which every call"):
        RewardFunctions.from_specs([fixed], None).check_columns(
            ["target"], "data.train", passed=["environments"]
        )


def test_cold_start_rows_with_an_empty_completion_are_counted_in_a_warning(tmp_path):
    """A blank completion trained its prompt to end at once, without a word."""
    from gspo.training.setup import empty_completions, load_task_data

    path = tmp_path / "sft.jsonl"
    rows = [
        {"prompt": "a", "completion": "x"},
        {"prompt": "b", "completion": "  "},
        {"prompt": "c", "completion": [{"role": "assistant", "content": ""}]},
        {"prompt": "d", "completion": [{"role": "assistant", "content": "y"}]},
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = load_config(None, [f"data.sft={path}", "train.cold_start_steps=5"])
    assert empty_completions(load_task_data(config).sft, config) == [
        f"data.sft ({path}): 2 of 4 rows (row 2 first) have an empty completion: the cold "
        "start teaches their prompts to end at once"
    ]
    config = load_config(None, [f"data.sft={path}", "train.cold_start_steps=0"])
    assert empty_completions(load_task_data(config).sft, config) == []


def test_held_out_rows_past_eval_max_prompts_are_said():
    """A held-out file longer than eval.max_prompts was evaluated on its first rows alone,
    unsaid (GSM8K's 1,319 test rows measured on 500)."""
    from gspo.training.setup import held_out_cut

    rows = [{"prompt": str(i)} for i in range(12)]
    config = load_config(None, ["data.train=t.jsonl", "data.eval=e.jsonl", "eval.max_prompts=8"])
    assert held_out_cut(rows, config) == [
        "data.eval (e.jsonl) has 12 rows; eval.max_prompts=8 evaluates the first 8 "
        "(eval.max_prompts=12 evaluates them all)"
    ]
    assert held_out_cut(rows[:8], config) == []
    built_in = load_config(None, ["eval.max_prompts=8"])  # (its held-out size is data.eval_size)
    assert held_out_cut(rows, built_in) == []


def test_fewer_prompts_than_a_rollout_batch_takes_are_said():
    """A one-row data.train with rollout.prompts_per_batch=8 sampled that prompt's group
    eight times in every rollout batch, unsaid."""
    from gspo.training.setup import fewer_prompts_than_a_batch

    rows = [{"prompt": str(i)} for i in range(3)]
    config = load_config(None, ["data.train=t.jsonl", "rollout.prompts_per_batch=4"])
    assert fewer_prompts_than_a_batch(rows, config) == [
        "data.train (t.jsonl) has 3 rows, fewer than rollout.prompts_per_batch=4: each rollout "
        "batch takes some prompts more than once (their groups are alike; a smaller "
        "rollout.prompts_per_batch takes each once)"
    ]
    assert fewer_prompts_than_a_batch([*rows, {"prompt": "3"}], config) == []
    assert fewer_prompts_than_a_batch(rows[:1], config)[0].startswith(
        "data.train (t.jsonl) has 1 row, fewer than"  # (it said "has 1 rows")
    )
    built_in = load_config(None, ["rollout.prompts_per_batch=4"])  # (its own size)
    assert fewer_prompts_than_a_batch(rows, built_in) == []


def test_a_count_of_rows_in_a_message_agrees_with_its_noun_and_verb():
    """One row without an answer among several was "1 of 2 rows (row 2 first) have"; a
    one-row file "has 1 rows"."""
    from gspo.plugins import counted, some_of
    from gspo.rewards import RewardFunctions
    from gspo.tasks import TaskData
    from gspo.training.setup import check_reward_columns, empty_completions

    assert [counted(1, "row"), counted(0, "row"), counted(2, "row")] == [
        "1 row",
        "0 rows",
        "2 rows",
    ]
    assert some_of([2], 2, "row") == "1 of 2 rows (row 2) has"
    assert some_of([1], 1, "row") == "1 of 1 row (row 1) has"
    assert some_of([1, 3], 5, "row") == "2 of 5 rows (row 1 first) have"
    from gspo.trainer import took_its_steps

    one = load_config(None, ["algorithm.minibatches=1", "train.max_steps=1"])
    assert took_its_steps(1, one) == (  # (it said "its 1 steps")
        "the run already took its 1 step (train.max_steps=1 in whole rollout batches of 1); "
        "resume it with a larger train.max_steps to train on"
    )
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]
    rewards = RewardFunctions.from_specs(["exact_match"], None)
    config = load_config(None, ["data.train=x.jsonl", "data.sft=s.jsonl"])
    assert check_reward_columns(rewards, TaskData(rows, [], []), config, None) == [
        "data.train (x.jsonl): 1 of 2 rows (row 2) has no 'answer', which reward function "
        "'exact_match' needs: their completions are not scored"
    ]
    sft = [{"prompt": "a", "completion": " "}]
    assert empty_completions(sft, config) == [
        "data.sft (s.jsonl): 1 of 1 row (row 1) has an empty completion: the cold start "
        "teaches their prompts to end at once"
    ]


def test_a_model_path_inside_another_runs_checkpoints_is_warned(tmp_path):
    """A LoRA run on another run's step-4 lost its base when that run, continued, pruned
    it (train.keep_checkpoints): neither its resume nor its export worked after, unsaid."""
    from gspo.training.setup import base_in_another_run

    run = tmp_path / "full"
    for step in ("step-0000000", "step-0000004"):
        (run / "checkpoints" / step).mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    four = run / "checkpoints" / "step-0000004"
    warned = base_in_another_run(load_config(None, [f"model.path={four}"]), tmp_path / "lora")
    assert warned == [
        f"model.path is step-0000004 of the run {run}, which removes it once it has "
        "train.keep_checkpoints newer ones (gspo train --resume there); this run needs it to "
        f"resume and export: copy it elsewhere first (cp -r {four} DIR; model.path=DIR)"
    ]
    zero = run / "checkpoints" / "step-0000000"  # (never removed), nor a model elsewhere
    assert base_in_another_run(load_config(None, [f"model.path={zero}"]), tmp_path / "x") == []
    assert base_in_another_run(load_config(None, [f"model.path={tmp_path}"]), tmp_path / "x") == []


def test_code_tests_that_do_not_parse_are_named_at_the_start():
    """A row whose tests hold no assert stopped the run when the row was first sampled
    (after step 1, or hours in); now before anything trains, naming the data and row."""
    from gspo.rewards import RewardFunctions
    from gspo.tasks import TaskData
    from gspo.training.setup import check_reward_columns

    rows = [{"prompt": "p", "tests": "assert f(1) == 2"}, {"prompt": "q", "tests": "x = 1"}]
    config = load_config(None, ["data.train=code.jsonl", "reward.functions=[code]"])
    rewards = RewardFunctions.from_specs(["code"], None)
    with pytest.raises(ValueError) as raised:
        check_reward_columns(rewards, TaskData(rows, [], []), config, None)
    assert str(raised.value) == (
        "data.train (code.jsonl) row 2: tests: no assert statement among the tests"
    )
    assert check_reward_columns(rewards, TaskData(rows[:1], [], []), config, None) == []


def test_a_jsonl_row_without_the_prompt_column_is_named(tmp_path):
    """A JSONL row lacking the prompt's key reads as null (the file's columns are the union
    of its rows'): it said "the prompt is None", not that the column was missing."""
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": "4"}\n')
    rows = load_rows(path, what="data.train")
    with pytest.raises(ValueError) as err:
        prepare_rows(rows, data_config(), what="data.train")
    assert str(err.value).endswith(
        "row 2: no prompt: its 'prompt' is missing or null (data.prompt_column names the column)"
    )


def test_chat_messages_written_out_in_a_csv_are_refused(tmp_path):
    """pandas' to_csv writes a column of message lists as their repr, which was each
    prompt's text ("[{'role': 'user', ...}]"), trained on without a word."""
    import pandas as pd

    messages = [[{"role": "user", "content": "1+1="}], [{"content": "2+2=", "role": "user"}]]
    pd.DataFrame({"prompt": messages, "answer": [2, 4]}).to_csv(tmp_path / "m.csv", index=False)
    rows = load_rows(tmp_path / "m.csv", what="data.train")
    with pytest.raises(ValueError) as err:
        prepare_rows(rows, data_config(f"data.train={tmp_path / 'm.csv'}"), what="data.train")
    assert str(err.value) == (
        f"data.train ({tmp_path / 'm.csv'}) row 1: the prompt is chat messages written out as "
        """text, "[{'role': 'user', 'content': '1+1='}]": a CSV cell holds no list; save the """
        "rows as JSON Lines or Parquet"
    )
    as_json = [{"prompt": json.dumps(m)} for m in messages[1:]]  # (a string column of JSON)
    with pytest.raises(ValueError, match=r"row 1: the prompt is chat messages written out"):
        prepare_rows(as_json, data_config(), what="data.train")
    # text that merely opens with a bracket is a prompt
    text = [{"prompt": "[1, 2] + [3]?"}, {"prompt": "[{x}] is a set"}]
    assert [r["prompt"] for r in prepare_rows(text, data_config(), what="data.train")] == [
        "[1, 2] + [3]?", "[{x}] is a set"
    ]  # fmt: skip


def test_a_prompt_that_opens_with_json_data_is_not_written_out_messages():
    """A prompt that opens with JSON data holding a "role" or "content" key (records to
    read, a message list quoted to explain) was refused as chat messages written out,
    with nothing to turn the check off; a whole written-out list still is refused, a
    numpy array's repr (no commas) too."""
    prompts = [
        '[{"role": "admin", "name": "Ann"}, {"role": "guest", "name": "Bo"}]\nWho is admin?',
        '[{"content": 3, "id": 1}] Sum the content fields.',
        "[{'role': 'user', 'content': 'hi'}] is a chat in Python. Explain it.",
        '[{"role": "admin", "name": "Ann"}]',  # (no content: records, not messages)
    ]
    rows = [{"prompt": p} for p in prompts]
    assert [r["prompt"] for r in prepare_rows(rows, data_config(), what="data.train")] == prompts
    written = [
        "[{'role': 'system', 'content': 'be brief'}\n {'role': 'user', 'content': '1+1='}]",
        ' [ {"content": "1+1=", "role": "user"} ] ',
    ]
    for text in written:
        with pytest.raises(ValueError, match=r"row 1: the prompt is chat messages written out"):
            prepare_rows([{"prompt": text}], data_config(), what="data.train")


def test_a_directory_whose_path_holds_brackets_is_read(tmp_path, monkeypatch):
    """datasets reads [ ] in a directory's path as a glob pattern: run[1] parsed as a
    directory (test above) but "doesn't contain any data files", sliced or not."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "sweep[1]" / "data"
    (folder / "sub").mkdir(parents=True)
    (folder / "train.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    (folder / "test.jsonl").write_text('{"prompt": "t"}\n')
    prompts = {
        "sweep[1]/data::train": ["a", "b"],
        f"{folder}::test": ["t"],
        "sweep[1]/data::train[1:]": ["b"],
    }
    for text, want in prompts.items():
        assert [r["prompt"] for r in load_rows(text, what="data.train")] == want, text
    with pytest.raises(ValueError) as err:
        load_rows("sweep[1]/data::dev", what="data.train")
    assert str(err.value) == (
        "data.train: sweep[1]/data::dev: no split 'dev' (splits: train, test)"
    )
