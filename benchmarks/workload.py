"""The reference workload shared by both sides of ``vs_trl.py`` (and usable on its own).

A 4-layer, 256-wide Qwen3 (GQA 4/2 heads), a 17-token character vocabulary, 2-digit
addition prompts and a dense reward; everything is written to one folder so that gspo and
TRL load the very same weights, tokenizer and data.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from gspo.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    save_pretrained_atomic,
)

CHARSET = "0123456789+= "
SPEC = TinyModelSpec(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=768)
PROMPTS = 2048


def dense(prompts, completions, answer, **kwargs):
    """Position-wise agreement with the answer plus a small bonus for digits (never flat)."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        agree = sum(a == b for a, b in zip(text, gold, strict=False)) / len(gold)
        digits = sum(c.isdigit() for c in text) / max(len(text), 1)
        rewards.append(agree + 0.1 * digits - 0.01 * abs(len(text) - len(gold)))
    return rewards


def build(folder: str | Path, seed: int = 0) -> Path:
    """Write ``model/`` (HF format) and ``train.jsonl`` under ``folder``; return it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(CHARSET)
    model = build_tiny_model(SPEC, tokenizer, seed=seed)
    save_pretrained_atomic(model, tokenizer, folder / "model")
    rng = random.Random(seed)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(PROMPTS):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return folder
