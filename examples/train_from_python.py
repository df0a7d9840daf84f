"""A run from Python: the config loaded, reward functions written here, ``gspo.train``.

    python examples/train_from_python.py --output-dir runs/py [key=value ...]

Trains the embedded model on the built-in addition task (no download), scored by two
functions of this file instead of the built-in ``exact_match``: the answer itself, and a
small bonus for stopping after it. Overrides work as on the command line
(``model.path=/models/Qwen3-0.6B``, ``data.train=train.jsonl``, ``reward.workers=4``).
"""

from __future__ import annotations

import argparse
import sys

import gspo


def correct(prompts: list[str], completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1 for the right sum. ``answer`` is the data's column of that name; every column
    arrives as a keyword argument (TRL's convention), the rest in ``**kwargs``."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


def stops(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]:
    """1 when the completion is a number and nothing more; None (does not apply: left out of
    the weighted sum) when it is empty."""
    return [None if not c.strip() else float(c.strip().isdigit()) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/from_python")
    parser.add_argument("--resume", action="store_true", help="continue the run in --output-dir")
    parser.add_argument("--overwrite", action="store_true", help="replace the run in --output-dir")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args()

    try:
        config = gspo.load_config(None, ["train.max_steps=40", *args.overrides])
        config.reward.functions = [correct, stops]  # the functions themselves, not specs
        config.reward.weights = [1.0, 0.1]
        records = gspo.train(config, args.output_dir, resume=args.resume, overwrite=args.overwrite)
    except (ValueError, OSError) as exc:  # bad input (a key, a file, a run): one line each
        sys.exit(f"{parser.prog}: error: {exc}")

    accuracy = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    if accuracy:  # (under torchrun, rank 0's records: the other ranks' are empty)
        print(" -> ".join(f"{value:.3f} (step {step})" for step, value in accuracy))


# Needed: with reward.workers > 0 each worker process imports this file as it starts
if __name__ == "__main__":
    main()
