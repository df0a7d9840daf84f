"""The ``by_source`` reward: each row of a verl Parquet file scored by the built-in its
``data_source`` names (verl's ``default_compute_score`` table, ``reward.sources`` over
it), so a file mixing math and code rows trains without a reward of one's own. Until
2026-11-29 one ``reward.functions`` list scored every row."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import CPU

from gspo.cli import main
from gspo.config import load_config
from gspo.data import load_rows, prepare_rows
from gspo.rewards import RewardError, RewardFunctions, sandbox
from gspo.training.rollout import reward_means

CALLS = {"fn_name": "add", "inputs": [[1, 2], [2, 2], [10, 1]], "outputs": [[3], [4], [11]]}
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
EASY_ONLY = "```python\ndef add(a, b):\n    return a + b if a < 10 else 0\n```"
VERL = [f"data.{key}_column=reward_model.ground_truth" for key in ("answer", "tests")]


def mixed_rows(sources: list[str] | None = None) -> list[dict]:
    """A verl-shaped file: two math rows (gsm8k, MATH-500) and a code row (apps)."""
    given = [("openai/gsm8k", "72"), ("HuggingFaceH4/MATH-500", "\\frac{1}{2}"),
             ("apps", json.dumps(CALLS))]  # fmt: skip
    return [
        {
            "data_source": source if sources is None else sources[k],
            "prompt": [{"role": "user", "content": f"Problem {k}"}],
            "ability": "code" if source == "apps" else "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": k},
        }
        for k, (source, truth) in enumerate(given)
    ]


def prepared(tmp_path: Path, rows: list[dict], overrides: list[str]) -> list[dict]:
    path = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = load_config(None, overrides).data
    return prepare_rows(load_rows(path, what="data.train"), data, what="data.train")


def score(rows: list[dict], completions: list[str], overrides: list[str]):
    """Each row once per completion (rows[k] for completions[k])."""
    config = load_config(None, ["reward.functions=[by_source]", *overrides])
    rewards = RewardFunctions.from_specs(config.reward.specs())
    columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
    return rewards([row["prompt"] for row in rows], completions, columns)


def test_math_rows_by_math_rules_and_code_rows_by_the_sandbox(tmp_path: Path) -> None:
    rows = prepared(tmp_path, mixed_rows(), VERL)
    rows = [rows[0], rows[0], rows[1], rows[1], rows[2], rows[2]]
    completions = ["#### 72", "#### 71", "So \\boxed{0.5}", "\\boxed{2}", RIGHT, EASY_ONLY]
    result = score(rows, completions, [])
    assert result.rewards == pytest.approx([1, 0, 1, 0, 1, 2 / 3])
    # each source's own values, logged as train/reward/by_source/SOURCE
    means = reward_means(result.per_function, "train/reward/")
    by = "train/reward/by_source"
    assert means == pytest.approx(
        {by: (3 + 2 / 3) / 6, f"{by}/openai/gsm8k": 0.5, f"{by}/HuggingFaceH4/MATH-500": 0.5,
         f"{by}/apps": 5 / 6}
    )  # fmt: skip
    # reward.code_scoring=all scores the code rows it routes: 1 where every test passes
    assert score(rows, completions, ["reward.code_scoring=all"]).rewards[4:] == [1.0, 0.0]


def test_reward_sources_routes_sources_of_ones_own(tmp_path: Path) -> None:
    rows = prepared(tmp_path, mixed_rows(["my_math", "aime_2024", "my_code_v2"]), VERL)
    completions = ["72", "\\boxed{\\frac{1}{2}}", RIGHT]
    sources = "reward.sources={my_math: exact_match, my_code*: code}"
    assert score(rows, completions, [sources]).rewards == [1.0, 1.0, 1.0]  # (aime*: verl's)
    config = load_config(None, ["reward.functions=[by_source]", sources])
    assert len({*config.reward.specs()}) == 1  # (hashable, as a function is: was a TypeError)
    # a source's key of one's own over verl's: gsm8k's rows compared as exact text
    rows = prepared(tmp_path, mixed_rows(), VERL)
    override = "reward.sources={openai/gsm8k: exact_match}"
    assert score(rows[:1], ["The answer is 72"], [override]).rewards == [0.0]
    assert score(rows[:1], ["The answer is 72"], []).rewards == [1.0]


def test_an_unknown_source_stops_the_run_naming_it_and_the_key(tmp_path: Path) -> None:
    rows = prepared(tmp_path, mixed_rows(["openai/gsm8k", "my_math", "apps"]), VERL)
    config = load_config(None, ["reward.functions=[by_source]"])
    rewards = RewardFunctions.from_specs(config.reward.specs())
    said = (
        "data.train (x) row 2: reward 'by_source': data_source 'my_math' is none of its "
        "sources (verl's, and reward.sources); set reward.sources={my_math: math} (or one of "
        "code, exact_match, format, math, numeric_match, or path/to/file.py:function)"
    )
    with pytest.raises(RewardError) as caught:
        rewards.check_rows(rows, "data.train (x)")
    assert str(caught.value) == said
    with pytest.raises(RewardError, match="data_source 'my_math' is none of its sources"):
        score(rows, ["72", "1", RIGHT], [])  # (not a silent 0 for the row)
    rows[1]["data_source"] = None  # (a null cell: no source named, nothing to set)
    said = r"row 2: reward 'by_source': a row without a data_source \(None\), which names"
    with pytest.raises(RewardError, match=said):
        rewards.check_rows(rows, "data.train (x)")


def test_a_row_without_what_its_builtin_reads_says_which_key_to_set(tmp_path: Path) -> None:
    rows = prepared(tmp_path, mixed_rows(), VERL[:1])  # (no data.tests_column)
    config = load_config(None, ["reward.functions=[by_source]"])
    rewards = RewardFunctions.from_specs(config.reward.specs())
    with pytest.raises(RewardError, match=r"row 3: data_source 'apps' is scored by code, which "
                       r"reads the column 'tests', which the row lacks; verl's data keeps it in "
                       r"reward_model: data.tests_column=reward_model.ground_truth$"):  # fmt: skip
        rewards.check_rows(rows, "data.train (x)")
    assert rewards.check_rows(rows[:2], "data.train (x)") == []  # (math rows: answers)
    rows[1]["answer"] = None  # (a null ground_truth: said at the start, not silently None)
    assert rewards.check_rows(rows[:2], "data.train (x)") == [
        "data.train (x): 1 of 2 rows (row 2) has no 'answer', which reward function "
        "'by_source' reads for their data_source: their completions are not scored"
    ]


def test_reward_sources_is_checked_with_the_config() -> None:
    with pytest.raises(ValueError, match="'maths' is not a built-in a source is scored by"):
        load_config(None, ["reward.functions=[by_source]", "reward.sources={a: maths}"])
    with pytest.raises(ValueError, match="reward.functions does not name: add by_source"):
        load_config(None, ["reward.sources={a: math}"])
    load_config(None, ["reward.functions=[by_source]", "reward.code_scoring=all"])


def test_gspo_train_on_a_mixed_verl_parquet(tmp_path, monkeypatch) -> None:
    """`gspo train` with reward.functions=[by_source] on a file of math and code rows: the
    code rows' completions run as a program passing 2 of 3 tests (program_of patched: the
    tiny model writes no code) get 2/3, the math rows' what math-verify says (the tiny
    model's text is no answer: 0); each source's mean is logged."""
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(mixed_rows()), data)
    easy_only = "def add(a, b):\n    return a + b if a < 10 else 0"
    monkeypatch.setattr(sandbox, "program_of", lambda completion, prompt=None: easy_only)
    run = tmp_path / "run"
    args = [CPU, "model.layers=1", "model.hidden=64", "model.heads=2", "model.kv_heads=1",
            "model.intermediate=128", "rollout.group_size=2", "rollout.prompts_per_batch=3",
            "rollout.max_new_tokens=4", "train.max_steps=2", "algorithm.minibatches=1",
            "eval.every=2", "log.progress=false", "log.plots=false", "log.tensorboard=false",
            "log.completions_every=1", f"data.train={data}", "train.cold_start_steps=0",
            f"data.eval={data}", *VERL, "reward.functions=[by_source]"]  # fmt: skip
    assert main(["train", "--output-dir", str(run), *args]) == 0
    logged = [json.loads(line) for line in (run / "completions" / "rollout-000000.jsonl").open()]
    by_prompt = {line["prompt"][0]["content"]: line["rewards"] for line in logged}
    assert by_prompt["Problem 2"] == {"by_source": pytest.approx(2 / 3),
                                      "by_source/apps": pytest.approx(2 / 3)}  # fmt: skip
    assert set(by_prompt["Problem 0"]) == {"by_source", "by_source/openai/gsm8k"}
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    evaluated = [m for m in metrics if "eval/reward_mean" in m]
    metrics = [m for m in metrics if "train/reward_mean" in m]
    assert metrics[0]["train/reward/by_source/apps"] == pytest.approx(2 / 3)
    assert "train/reward/by_source/HuggingFaceH4/MATH-500" in metrics[0]
    assert evaluated[0]["eval/reward/by_source/apps"] == pytest.approx(2 / 3)


def test_gspo_train_stops_at_its_start_on_an_unknown_source(tmp_path, capsys) -> None:
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(mixed_rows(["openai/gsm8k", "mine", "apps"])), data)
    run = tmp_path / "run"
    given = [CPU, f"data.train={data}", *VERL, "reward.functions=[by_source]"]
    assert main(["train", "--output-dir", str(run), *given]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gspo: error: data.train (") and "row 2: reward 'by_source'" in err
    assert "set reward.sources={mine: math}" in err and len(err.splitlines()) == 1
    assert not run.exists()  # (before the run writes anything)


def test_with_a_timeout_it_runs_aside_with_the_columns_it_passes_on(tmp_path: Path) -> None:
    """With reward.timeout (or async rollouts) math-verify's time limits need a main thread:
    by_source runs in a worker process of its own, as math does, with its answers and tests
    (sent only its required data_source, every math row was unscored)."""
    rows = prepared(tmp_path, mixed_rows(), VERL)
    config = load_config(None, ["reward.functions=[by_source]", "reward.sources={x: math}"])
    rewards = RewardFunctions.from_specs(config.reward.specs(), timeout=120)
    try:
        columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
        result = rewards([r["prompt"] for r in rows], ["#### 72", "\\boxed{0.5}", RIGHT], columns)
        assert result.rewards == [1.0, 1.0, 1.0]
        assert rewards.runner._aside is not None  # (it ran aside)
    finally:
        rewards.close()


def scored_round(sources: list[str], values: list[float]):
    """A rollout round of one response per prompt, scored by_source for these sources."""
    import torch

    from gspo.engines.batch import RolloutBatch
    from gspo.training.rollout import Scored

    n = len(values)
    ones = torch.ones(n, 2, dtype=torch.long)
    batch = RolloutBatch(ones, ones, ones, ones, torch.zeros(n, 2), ["stop"] * n, 1)
    per_function: dict[str, list[float | None]] = {"by_source": list(values)}
    for i, source in enumerate(sources):
        per_function.setdefault(f"by_source/{source}", [None] * n)[i] = values[i]
    return Scored(batch, ["c"] * n, torch.tensor(values), per_function)


def test_rounds_and_ranks_of_other_sources_are_merged_and_logged() -> None:
    """Dynamic sampling's rounds (and torchrun's ranks) see different sources, so a
    by_source/SOURCE one lacks: merge_groups took the first round's names (a KeyError for
    a source the first lacked), rollout_metrics rank 0's (another rank's sources lost)."""
    import torch

    from gspo.distributed import Distributed
    from gspo.training.rollout import merge_groups, rollout_metrics

    rounds = [scored_round(["apps", "apps"], [1.0, 0.0]), scored_round(["aime"], [1.0])]
    merged = merge_groups(rounds, [1, 2])
    assert merged.per_function == {
        "by_source": [0.0, 1.0], "by_source/apps": [0.0, None], "by_source/aime": [None, 1.0]
    }  # fmt: skip
    metrics = rollout_metrics(Distributed(), merged, torch.zeros(2))
    assert metrics["train/reward/by_source/aime"] == 1.0
    assert metrics["train/reward/by_source/apps"] == 0.0


def test_verls_reward_keys_name_gspos() -> None:
    """custom_reward_function.path and data.reward_fn_key were 'unknown key' alone."""
    from gspo.config import ConfigError

    with pytest.raises(ConfigError, match=r"^custom_reward_function: unknown key; verl's "
                       r"custom_reward_function is reward.functions=\[FILE.py:FUNCTION\] "
                       r"\(called on a batch as TRL calls one"):  # fmt: skip
        load_config(None, ["custom_reward_function.path=my_reward.py"])
    with pytest.raises(ConfigError, match=r"with reward.sources=\{SOURCE: FILE.py:FUNCTION\} "
                       r"for the sources a function of one's own scores"):  # fmt: skip
        load_config(None, ["custom_reward_function.path=my_reward.py"])
    with pytest.raises(ConfigError, match=r"^data.reward_fn_key: unknown key; verl's "
                       r"reward_fn_key has no equivalent here: reward.functions=\[by_source\] "
                       r"picks each row's built-in by its data_source column"):  # fmt: skip
        load_config(None, ["data.reward_fn_key=data_source"])


def test_the_unscored_warning_names_the_functions_not_the_sources(capsys) -> None:
    from gspo.training.rollout import Scorer

    per_function = {"by_source": [None, None], "by_source/openai/gsm8k": [None, None]}
    Scorer(None, None).warn_if_unscored(per_function, 2)  # type: ignore[arg-type]
    assert "check reward.functions (by_source) against" in capsys.readouterr().err


def test_a_source_with_a_colon_is_logged_under_by_source() -> None:
    """metric_labels shortened `file.py:function` to its function in every name, the
    per-source ones too: data_source 'aime:2024' was logged as train/reward/2024."""
    rewards = RewardFunctions.from_specs(["by_source"])
    columns = {"data_source": ["aime:2024", "aime:2024"], "answer": ["5", "5"]}
    result = rewards(["p", "p"], ["\\boxed{5}", "\\boxed{4}"], columns)
    assert reward_means(result.per_function, "train/reward/") == {
        "train/reward/by_source": 0.5, "train/reward/by_source/aime:2024": 0.5
    }  # fmt: skip


def test_a_file_under_a_folder_named_as_a_builtin_is_no_source_of_it(capsys) -> None:
    """Without by_source, a function math/mine.py:f beside math was taken for math's
    per-source entry: left out of the unscored warning (and its None of the completions log)."""
    from gspo.training.rollout import Scorer

    per_function = {"math": [None], "math/mine.py:f": [None]}
    Scorer(None, None).warn_if_unscored(per_function, 1)  # type: ignore[arg-type]
    assert "check reward.functions (math, math/mine.py:f) against" in capsys.readouterr().err
    means = reward_means({"math": [1.0], "math/mine.py:f": [0.0]}, "r/")
    assert means == {"r/math": 1.0, "r/f": 0.0}


def test_each_prefix_the_docs_give_routes_as_they_say() -> None:
    """The docs and reward.sources' description gave verl's sources as `numina_*`, a
    prefix by their own rule, where the table has verl's six numina_ names alone: a
    numina_ source of another name stopped the run."""
    import re

    from gspo.config.reward import RewardConfig
    from gspo.rewards.by_source import BySource

    root = Path(__file__).resolve().parent.parent
    texts = [(root / "docs" / doc).read_text() for doc in ("training.md", "from_verl.md")]
    parts = [p for t in texts for p in re.split(r"\n\s*\n|\n(?=\|)", t) if "by_source" in p]
    named = {t for p in parts for t in re.findall(r"`([\w/.-]+)\*`", p)}
    named |= set(re.findall(r"([\w/.-]+)\*", RewardConfig.model_fields["sources"].description))
    assert "aime" in named
    for prefix in named - {"searchR1_", "my_code"}:  # (said to have no built-in; an example)
        assert BySource().route(f"{prefix}2024") == "math"


def test_empty_mapping_tests_stop_the_run_at_its_start_as_before() -> None:
    """has_value took an empty mapping of tests for no tests (setup's check, which it
    replaced, did not): the code reward refuses {}, so the run stopped at the batch that
    first sampled the row, hours in, where it had stopped at its start; by_source said
    the row's completions are not scored."""
    said = r"^data.train \(x\) row 1: tests: expected assert statements"
    with pytest.raises(ValueError, match=said):
        RewardFunctions.from_specs(["code"]).check_rows([{"tests": {}}], "data.train (x)")
    with pytest.raises(ValueError, match=said):
        RewardFunctions.from_specs(["by_source"]).check_rows(
            [{"data_source": "apps", "tests": {}}], "data.train (x)"
        )


OWN = """
def score(prompts, completions, answer, **kwargs):
    return [1.0 if str(a) in c else 0.5 for c, a in zip(completions, answer)]

async def quarter(prompts, completions, **kwargs):
    return [0.25] * len(completions)

def gold(prompts, completions, gold, **kwargs):
    return [1.0] * len(completions)

def boom(prompts, completions, **kwargs):
    return [1 / 0]
"""


def test_reward_sources_names_functions_of_ones_own(tmp_path: Path, monkeypatch) -> None:
    """verl's custom_reward_function for some sources: reward.sources took only the
    built-ins' names ('my_rewards.py:score' is not a built-in a source is scored by)."""
    from gspo.training.setup import with_absolute_paths

    (tmp_path / "my_rewards.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [
        {"prompt": "p", "data_source": s, "answer": "7"}
        for s in ("mine", "openai/gsm8k", "other_v1")
    ]
    sources = "reward.sources={mine: my_rewards.py:score, other*: my_rewards:quarter}"
    result = score(rows, ["9", "#### 7", "7"], [sources])
    assert result.rewards == [0.5, 1.0, 0.25]  # (quarter is async def, as TRL takes them)
    assert reward_means(result.per_function, "r/") == {
        "r/by_source": pytest.approx(1.75 / 3), "r/by_source/mine": 0.5,
        "r/by_source/openai/gsm8k": 1.0, "r/by_source/other_v1": 0.25,
    }  # fmt: skip
    config = load_config(None, ["reward.functions=[by_source]", sources])
    recorded = with_absolute_paths(config).reward.sources  # (a resume elsewhere finds it)
    assert recorded == {"mine": f"{tmp_path}/my_rewards.py:score", "other*": "my_rewards:quarter"}
    # under reward.timeout it runs aside (math-verify's limits) with every column it passes on
    rewards = RewardFunctions.from_specs(config.reward.specs(), timeout=120)
    try:
        columns = {k: [row[k] for row in rows] for k in rows[0] if k != "prompt"}
        assert rewards(["p"] * 3, ["9", "#### 7", "7"], columns).rewards == [0.5, 1.0, 0.25]
    finally:
        rewards.close()


@pytest.mark.parametrize(
    ("route", "said"),
    [
        ("nofile.py:score", r"^reward.sources: mine: reward function "
         r"file not found: 'nofile.py'"),
        ("my_rewards.py:scor", r"^reward.sources: mine: reward function "
         r"'my_rewards.py:scor': file 'my_rewards.py' has no attribute 'scor'; did you mean"),
        ("my_rewards.py:gold", r"^data.train \(x\) row 1: data_source 'mine' is scored by "
         r"'my_rewards.py:gold' \(reward.sources: mine\), which needs the column\(s\) gold"),
    ],
)  # fmt: skip
def test_a_function_of_ones_own_is_checked_at_the_start(tmp_path, monkeypatch, route, said):
    (tmp_path / "my_rewards.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    config = load_config(
        None, ["reward.functions=[by_source]", f"reward.sources={{mine: {route}}}"]
    )
    rewards = RewardFunctions.from_specs(config.reward.specs())
    with pytest.raises(RewardError, match=said):
        rewards.check_rows([{"data_source": "mine", "answer": "7"}], "data.train (x)")


def test_a_failing_function_of_ones_own_is_named_with_its_source(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(OWN)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError, match=r"^reward function 'my_rewards.py:boom' \(reward."
                       r"sources: mine\) raised ZeroDivisionError: division by zero"):  # fmt: skip
        score(
            [{"prompt": "p", "data_source": "mine", "answer": "7"}],
            ["7"],
            ["reward.sources={mine: my_rewards.py:boom}"],
        )
    with pytest.raises(ValueError, match=r"reward.sources: a: 'maths' is not a built-in a "
                       r"source is scored by .* did you mean 'math'\?$"):  # fmt: skip
        load_config(None, ["reward.functions=[by_source]", "reward.sources={a: maths}"])
    with pytest.raises(ValueError, match=r"reward.sources: a: 'by_source' is not a built-in a"):
        load_config(None, ["reward.functions=[by_source]", "reward.sources={a: by_source}"])


def halves(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def test_by_source_with_functions_from_python() -> None:
    """From Python, reward.sources refused a function ('Input should be a valid string'),
    as reward.functions takes one; a BySource built with a source's misspelt built-in
    failed at the first batch with a KeyError ('maths')."""
    from gspo.rewards import BySource

    config = load_config(None, ["reward.functions=[by_source]"])
    config.reward.sources = {"mine": halves}
    rewards = RewardFunctions.from_specs(config.reward.specs())
    columns = {"data_source": ["mine", "openai/gsm8k"], "answer": ["1", "1"]}
    assert rewards(["p", "p"], ["x", "#### 1"], columns).rewards == [0.5, 1.0]
    assert config.model_dump(mode="json")["reward"]["sources"] == {"mine": "test_by_source:halves"}
    with pytest.raises(RewardError, match="reward.sources: mine: 'maths' is not a built-in"):
        BySource({"mine": "maths"})
    direct = RewardFunctions.from_specs([BySource({"mine": halves})])
    assert direct(["p"], ["x"], {"data_source": ["mine"], "answer": ["1"]}).rewards == [0.5]


def test_gold_answers_no_number_are_counted_for_by_sources_numeric_match() -> None:
    """numeric_match reached through by_source (openai/gsm8k's rows) was left out of the
    start's count of gold answers that are no number (named in reward.functions, it was
    counted); a mapping for an answer of a math row was not refused either."""
    from gspo.tasks import TaskData
    from gspo.training.reward_columns import check_reward_columns

    given = [("openai/gsm8k", "72"), ("openai/gsm8k", "seven"), ("math_dapo", "seven")]
    rows = [{"prompt": "p", "data_source": s, "answer": a} for s, a in given]
    config = load_config(None, ["reward.functions=[by_source]"])
    rewards = RewardFunctions.from_specs(config.reward.specs())
    said = check_reward_columns(rewards, TaskData(rows, [], []), config, None)
    assert said == [
        "data.train (the built-in addition task): 1 of 3 rows (row 2) has a gold answer that "
        "is not a number, as 'seven', which reward function 'by_source' scores with "
        "numeric_match for their data_source, which never scores (None): their completions "
        "are not scored by it"
    ]
    rows[2]["answer"] = {"value": "1/2"}
    with pytest.raises(ValueError, match=r"row 3: the answer \(column 'answer', which reward "
                       r"function 'by_source' compares\)"):  # fmt: skip
        check_reward_columns(rewards, TaskData(rows, [], []), config, None)
