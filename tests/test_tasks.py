"""Tasks: the built-in addition task, dataset loading, prompt encoding."""

import json

import pytest

from gspo.models import build_char_tokenizer
from gspo.tasks import addition_task, as_completion, encode_prompt, load_rows


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


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_load_rows_formats(tmp_path, suffix):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_rows(path, what="data.train") == rows


def test_load_rows_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.train: file not found"):
        load_rows(tmp_path / "missing.jsonl", what="data.train")
    (tmp_path / "x.csv").write_text("prompt\nhi\n")
    with pytest.raises(ValueError, match=r"data.eval: .* must end in"):
        load_rows(tmp_path / "x.csv", what="data.eval")
    (tmp_path / "np.jsonl").write_text(json.dumps({"question": "1+1"}) + "\n")
    with pytest.raises(ValueError, match="no 'prompt' column"):
        load_rows(tmp_path / "np.jsonl", what="data.train")


def test_encode_prompt_string_and_chat():
    tok = build_char_tokenizer()
    ids = encode_prompt("12+3=", tok)
    assert tok.decode(ids) == "12+3="
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no chat template"):
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


def test_bad_jsonl_line_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match="data.train: .* line 2 is not JSON"):
        load_rows(path, what="data.train")
