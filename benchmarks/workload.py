"""The reference workload shared by both sides of ``vs_trl.py`` (and usable on its own).

A 4-layer, 256-wide Qwen3 (GQA 4/2 heads), a 17-token character vocabulary, 2-digit
addition prompts and a dense reward; everything is written to one folder so that gspo and
TRL load the very same weights, tokenizer and data.

The long workload (``build(..., vocab=520)``) is the same but for a vocabulary padded with
unused characters: a random model then rarely samples EOS (1 token in 520), so its
completions run to hundreds of tokens and their length is set by ``max_new_tokens``.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
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
#: Vocabulary of the long workload (the reference one has 17 tokens).
LONG_VOCAB = 520


def dense(prompts, completions, answer, **kwargs):
    """Position-wise agreement with the answer plus a small bonus for digits (never flat)."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        agree = sum(a == b for a, b in zip(text, gold, strict=False)) / len(gold)
        digits = sum(c.isdigit() for c in text) / max(len(text), 1)
        rewards.append(agree + 0.1 * digits - 0.01 * abs(len(text) - len(gold)))
    return rewards


def padding_characters(count: int) -> str:
    """``count`` distinct characters from U+0100 on, none a surrogate or in ``CHARSET``."""
    chars = (chr(c) for c in range(0x100, 0x110000) if not 0xD800 <= c <= 0xDFFF)
    return "".join(next(chars) for _ in range(count))


def build(
    folder: str | Path,
    seed: int = 0,
    vocab: int | None = None,
    spec: TinyModelSpec | None = None,
) -> Path:
    """Write ``model/`` (HF format) and ``train.jsonl`` under ``folder``; return it.

    ``vocab``: pad the character vocabulary to this many tokens with characters no prompt
    or answer uses (the long workload); the model then also takes positions up to 1,024.
    ``spec``: another model size (the GPU check's ~0.5B Qwen3).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    charset, spec = CHARSET, spec or SPEC
    if vocab is not None:
        extra = vocab - len(build_char_tokenizer(CHARSET))
        if extra < 0:
            raise ValueError(f"vocab must be at least {vocab - extra}; got {vocab}")
        charset = CHARSET + padding_characters(extra)
        spec = replace(spec, max_positions=max(spec.max_positions, 1024))
    tokenizer = build_char_tokenizer(charset)
    model = build_tiny_model(spec, tokenizer, seed=seed)
    save_pretrained_atomic(model, tokenizer, folder / "model")
    rng = random.Random(seed)
    with open(folder / "train.jsonl", "w") as f:
        for _ in range(PROMPTS):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return folder
