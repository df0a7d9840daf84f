"""Scoring speed of ``reward.workers``: the ``math`` reward (math-verify) on 1,024 completions.

    .venv/bin/python benchmarks/reward_workers.py [--n 1024] [--workers 0 2] [--repeats 3]

Completions are LaTeX answers of a few shapes (fractions, roots, decimals, wrong values),
half of them right. Settings alternate within each repeat; the median per setting is
printed, with the speed-up over ``workers=0``. Worker start-up (once per run) is timed
apart from scoring.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gspo.provenance import measured_at
from gspo.rewards import RewardFunctions


def batch(n: int, seed: int = 0) -> tuple[list[str], list[str], list[str]]:
    rng = random.Random(seed)
    prompts, completions, answers = [], [], []
    for _ in range(n):
        a, b = rng.randint(1, 40), rng.randint(2, 40)
        shape = rng.randrange(4)
        if shape == 0:
            gold, right = f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{a}}}{{{b}}}"
        elif shape == 1:
            gold, right = f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}"
        elif shape == 2:
            gold, right = (
                f"{a / b:.4f}",
                f"{a}/{b}" if (a / b) == round(a / b, 4) else f"{a / b:.4f}",
            )
        else:
            gold, right = f"x^{{{a}}}", f"x^{a}"
        wrong = f"\\frac{{{a + 1}}}{{{b}}}"
        answer = right if rng.random() < 0.5 else wrong
        prompts.append(f"Problem {a}/{b}")
        completions.append(f"We compute step by step. The answer is $\\boxed{{{answer}}}$.")
        answers.append(gold)
    return prompts, completions, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(measured_at(), flush=True)
    prompts, completions, answers = batch(args.n)
    functions = {w: RewardFunctions.from_specs(["math"], workers=w) for w in args.workers}
    for w, f in functions.items():
        if w:
            start = time.perf_counter()
            f.runner.start()
            print(f"workers={w}: start-up {time.perf_counter() - start:.2f} s (once per run)")
    times: dict[int, list[float]] = {w: [] for w in args.workers}
    results = {}
    for _ in range(args.repeats):
        for w, f in functions.items():
            start = time.perf_counter()
            results[w] = f(prompts, completions, {"answer": answers}).rewards
            times[w].append(time.perf_counter() - start)
    first = args.workers[0]
    assert all(results[w] == results[first] for w in args.workers), "settings disagree"
    base = statistics.median(times[first])
    print(f"math reward, {args.n} completions, mean reward {sum(results[first]) / args.n:.3f}")
    print("| reward.workers | median s | all runs | speed-up |")
    print("|---|---|---|---|")
    for w in args.workers:
        med = statistics.median(times[w])
        runs = ", ".join(f"{t:.2f}" for t in times[w])
        print(f"| {w} | {med:.2f} | {runs} | {base / med:.2f}x |")
    for f in functions.values():
        f.close()


if __name__ == "__main__":
    main()
