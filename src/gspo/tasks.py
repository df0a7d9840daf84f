"""Tasks: the built-in procedurally generated task, dataset loading, prompt encoding.

A dataset here is a list of rows (dicts) with a ``prompt`` column (a string or a list of
chat messages) plus any other columns, which are passed to reward functions by name, as
in TRL. Cold-start SFT rows also carry a ``completion`` string.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]


@dataclass
class TaskData:
    """Prompts for RL (``train``), held-out prompts (``eval``), SFT rows (``sft``)."""

    train: list[Row]
    eval: list[Row]
    sft: list[Row]


def addition_task(
    *,
    digits: int = 2,
    eval_size: int = 500,
    sft_size: int = 8000,
    label_noise: float = 0.5,
    seed: int = 0,
) -> TaskData:
    """``a+b=`` with ``digits``-digit operands; the answer column holds ``str(a + b)``.

    The held-out split is disjoint from the training prompts. The cold-start SFT rows come
    from the training split; with probability ``label_noise`` an SFT answer's last digit is
    replaced by a uniformly random digit. Such a model puts roughly half its mass on the
    right answer: sampling finds it often, so RL has something to reinforce (pass@k -> pass@1).
    """
    if digits < 1 or digits > 6:
        raise ValueError(f"data.digits must be between 1 and 6; got {digits}")
    rng = random.Random(seed)
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)]
    if len(pairs) > 200_000:
        pairs = [(rng.randint(lo, hi), rng.randint(lo, hi)) for _ in range(200_000)]
        pairs = list(dict.fromkeys(pairs))
    rng.shuffle(pairs)
    eval_size = min(eval_size, len(pairs) // 5)
    held_out, train = pairs[:eval_size], pairs[eval_size:]

    def row(a: int, b: int) -> Row:
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}

    sft = []
    for a, b in (train[rng.randrange(len(train))] for _ in range(sft_size)):
        answer = str(a + b)
        if rng.random() < label_noise:
            answer = answer[:-1] + str(rng.randrange(10))
        sft.append({"prompt": f"{a}+{b}=", "completion": answer})
    return TaskData(train=[row(*p) for p in train], eval=[row(*p) for p in held_out], sft=sft)


BUILTIN_TASKS = {"addition": addition_task}


def load_rows(path: str | Path, *, what: str) -> list[Row]:
    """Rows of a JSONL, JSON or Parquet file (via ``datasets``), checked for a prompt column.

    ``what`` names the config key in error messages (e.g. ``data.train``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what}: file not found: {path}")
    suffix = path.suffix.lower()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
    if suffix not in builders:
        raise ValueError(f"{what}: {path} must end in .jsonl, .json or .parquet")
    if suffix == ".jsonl":  # one json.loads per line: no need to start `datasets` for it
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{what}: {path} line {number} is not JSON: {exc}") from exc
    else:
        import datasets

        datasets.disable_progress_bars()
        try:
            table = datasets.load_dataset(builders[suffix], data_files=str(path), split="train")
        except Exception as exc:  # datasets raises many types for malformed files
            raise ValueError(f"{what}: cannot read {path}: {type(exc).__name__}: {exc}") from exc
        rows = table.to_list()
    if not rows:
        raise ValueError(f"{what}: {path} has no rows")
    if not isinstance(rows[0], dict) or "prompt" not in rows[0]:
        raise ValueError(f"{what}: {path} has no 'prompt' column (columns: {list(rows[0])})")
    return rows


def encode_prompt(prompt: str | list[dict[str, str]], tokenizer) -> list[int]:
    """Token ids of a prompt: chat messages go through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "prompt is a list of chat messages but the tokenizer has no chat template"
            )
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    raise ValueError(
        f"prompt must be a string or a list of chat messages; got {type(prompt).__name__}"
    )


def as_completion(text: str, prompt: Any) -> Any:
    """TRL's completion form: a string for string prompts, a message list for chat prompts."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": text}]
    return text
