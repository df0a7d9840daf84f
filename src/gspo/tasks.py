"""Tasks: the built-in procedurally generated tasks (user datasets: ``gspo.data``).

A dataset here is a list of rows (dicts) with a ``prompt`` column (a string or a list of
chat messages) plus any other columns, which are passed to reward functions by name, as
in TRL. Cold-start SFT rows also carry a ``completion`` string.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
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


def chain_steps(terms: list[int]) -> list[tuple[int, int, int]]:
    """The running sums of ``terms``: ``(sum so far, next term, new sum)`` per step."""
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append((total, term, total + term))
        total += term
    return steps


def chain_completion(steps: list[tuple[int, int, int]]) -> str:
    """One line ``a+b=c`` per step, then ``answer: <last sum>`` (read by ``numeric_match``)."""
    lines = [f"{a}+{b}={c}" for a, b, c in steps]
    return "\n".join([*lines, f"answer: {steps[-1][2]}"])


def chain_task(
    *,
    digits: int = 2,
    terms: int = 12,
    min_terms: int = 2,
    eval_size: int = 500,
    sft_size: int = 8000,
    label_noise: float = 0.5,
    train_size: int = 20_000,
    seed: int = 0,
) -> TaskData:
    """Step-by-step multi-term addition: long responses whose length varies with the prompt.

    The prompt ``12+34+56+78=`` (``min_terms`` to ``terms`` operands of ``digits`` digits,
    drawn uniformly) is answered with every partial sum on its own line and the total::

        12+34=46
        46+56=102
        102+78=180
        answer: 180

    One token per character: with 2-digit operands a step is about 10 tokens, so 12 terms
    make a completion of about 120 tokens and 2 terms one of about 20. The ``answer``
    column holds the total; score with ``numeric_match`` (it reads the ``answer:`` line).
    The held-out prompts are disjoint from the training ones. With probability
    ``label_noise`` a cold-start SFT row carries one slip: the last digit of one uniformly
    chosen partial sum is replaced by a random digit, and the later steps add correctly
    from the wrong value, so the chain stays self-consistent but its answer is wrong (9
    times in 10). The model learns to slip now and then; RL has something to remove.
    """
    if digits < 1 or digits > 6:
        raise ValueError(f"data.digits must be between 1 and 6; got {digits}")
    if not 2 <= min_terms <= terms:
        raise ValueError(f"need 2 <= data.min_terms <= data.terms; got {min_terms}, {terms}")
    rng = random.Random(seed)
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    prompts: dict[tuple[int, ...], None] = {}
    for _ in range(50 * (eval_size + train_size)):  # bounded: tiny digit/term ranges run dry
        if len(prompts) == eval_size + train_size:
            break
        count = rng.randint(min_terms, terms)
        prompts[tuple(rng.randint(lo, hi) for _ in range(count))] = None
    ordered = list(prompts)
    eval_size = min(eval_size, len(ordered) // 5)
    held_out, train = ordered[:eval_size], ordered[eval_size:]

    def prompt(t: tuple[int, ...]) -> str:
        return "+".join(map(str, t)) + "="

    def row(t: tuple[int, ...]) -> Row:
        return {"prompt": prompt(t), "answer": str(sum(t))}

    sft = []
    for t in (train[rng.randrange(len(train))] for _ in range(sft_size)):
        steps = chain_steps(list(t))
        if rng.random() < label_noise:
            slip = rng.randrange(len(steps))  # step `slip` adds operand t[slip + 1]
            a, b, c = steps[slip]
            wrong = int(str(c)[:-1] + str(rng.randrange(10)))
            steps = [*steps[:slip], (a, b, wrong), *chain_steps([wrong, *t[slip + 2 :]])]
        sft.append({"prompt": prompt(t), "completion": chain_completion(steps)})
    return TaskData(train=[row(t) for t in train], eval=[row(t) for t in held_out], sft=sft)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call in the Hermes/Qwen format the environments parse (compact JSON)."""
    body = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))
    return f"<tool_call>{body}</tool_call>"


def calculator_task(
    *,
    digits: int = 5,
    eval_size: int = 500,
    sft_size: int = 8000,
    label_noise: float = 0.5,
    train_size: int = 20_000,
    seed: int = 0,
) -> TaskData:
    """``a+b=`` with long operands and an ``add(a, b)`` tool: a multi-turn task.

    The prompt is one user message ``a+b=``; the environment
    (:class:`gspo.environments.Calculator`) offers ``add``. A good episode is two turns::

        assistant: <tool_call>{"name":"add","arguments":{"a":12345,"b":67890}}</tool_call>
        tool:      80235
        assistant: 80235

    The ``answer`` column holds ``str(a + b)`` (score with ``exact_match``: it reads the
    last assistant message). The cold start uses the tool unreliably: a share
    ``label_noise`` of its rows are, in equal parts, a direct answer (right, but a small
    model cannot add long numbers by itself), a call with one argument digit miscopied
    (the tool's sum, wrong, is the answer) and a call whose JSON is broken (the tool
    answers with an error and the model answers directly). RL has to learn to call the
    tool every time and to copy the operands exactly.
    """
    if digits < 1 or digits > 9:
        raise ValueError(f"data.digits must be between 1 and 9 for calculator; got {digits}")
    rng = random.Random(seed)
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    pairs: dict[tuple[int, int], None] = {}
    for _ in range(50 * (eval_size + train_size)):
        if len(pairs) == eval_size + train_size:
            break
        pairs[(rng.randint(lo, hi), rng.randint(lo, hi))] = None
    ordered = list(pairs)
    eval_size = min(eval_size, len(ordered) // 5)
    held_out, train = ordered[:eval_size], ordered[eval_size:]

    def prompt(a: int, b: int) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{a}+{b}="}]

    def row(a: int, b: int) -> Row:
        return {"prompt": prompt(a, b), "answer": str(a + b)}

    def miscopy(x: int) -> int:
        text = str(x)
        i = rng.randrange(len(text))
        digit = rng.choice([d for d in "0123456789" if d != text[i] and (i or d != "0")])
        return int(text[:i] + digit + text[i + 1 :])

    def call(a: int, b: int) -> dict[str, str]:
        return {"role": "assistant", "content": tool_call_text("add", {"a": a, "b": b})}

    sft = []
    for a, b in (train[rng.randrange(len(train))] for _ in range(sft_size)):
        noisy, kind = rng.random() < label_noise, rng.randrange(3)
        if noisy and kind == 0:  # answers without the tool
            completion = [{"role": "assistant", "content": str(a + b)}]
        elif noisy and kind == 1:  # miscopies an operand into the call
            a2, b2 = (miscopy(a), b) if rng.random() < 0.5 else (a, miscopy(b))
            completion = [
                call(a2, b2),
                {"role": "tool", "name": "add", "content": str(a2 + b2)},
                {"role": "assistant", "content": str(a2 + b2)},
            ]
        elif noisy:  # broken JSON: the tool answers with an error
            broken = call(a, b)
            broken["content"] = broken["content"].replace("}}", "}", 1)
            completion = [
                broken,
                {"role": "tool", "name": "add", "content": "error: tool call is not valid JSON"},
                {"role": "assistant", "content": str(a + b)},
            ]
        else:
            completion = [
                call(a, b),
                {"role": "tool", "name": "add", "content": str(a + b)},
                {"role": "assistant", "content": str(a + b)},
            ]
        sft.append({"prompt": prompt(a, b), "completion": completion})
    return TaskData(train=[row(*p) for p in train], eval=[row(*p) for p in held_out], sft=sft)


BUILTIN_TASKS = {"addition": addition_task, "chain": chain_task, "calculator": calculator_task}

#: Settings each built-in task runs with where the user sets no value for the key (a
#: config file or an override): its token budget, turns, model size and schedule, so that
#: ``gspo train data.task=NAME`` learns on a small CPU in minutes. The config's own
#: defaults (``gspo config``) are addition's. Applied by :func:`gspo.config.load_config`.
_SMALL_MODEL = {  # the built-in model of the long-response and tool tasks (0.4M parameters)
    "model.layers": 2,
    "model.hidden": 128,
    "model.heads": 4,
    "model.kv_heads": 2,
    "model.intermediate": 384,
}
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "addition": {},
    # The model of `gspo compare --preset long`, with up to 6 terms (responses of ~20-70
    # tokens). The cold start must teach the sums, not only the chain's form: after 400
    # steps the model got 3% of held-out chains right and RL had nothing to reinforce;
    # after 1,500 it gets 60% (98% greedy: its slips are the label noise's), and RL at
    # lr 2e-5 removes the slips (docs/training.md has the figures).
    "chain": {
        "reward.functions": ["numeric_match"],  # the completion is the chain, not the total
        "data.terms": 6,
        "rollout.max_new_tokens": 80,  # 6 terms of 2 digits: up to ~65 tokens
        **_SMALL_MODEL,
        "train.cold_start_steps": 1500,
        "train.max_steps": 384,
        "optim.lr": 2e-5,  # at 1e-4 greedy accuracy fell (0.98 -> 0.79 in 96 steps)
        "eval.every": 64,
        "eval.max_prompts": 96,
    },
    # The settings of `gspo compare --preset tools`: turns of up to 80 tokens (a tool call
    # is ~45), a small model and a short cold start.
    "calculator": {
        "rollout.environment": "gspo.environments:Calculator",
        "data.digits": 5,
        "rollout.max_new_tokens": 80,
        "rollout.max_turns": 3,
        "rollout.max_episode_tokens": 200,
        "rollout.prompts_per_batch": 8,
        **_SMALL_MODEL,
        "train.cold_start_steps": 400,
        "train.cold_start_batch_size": 32,
        "train.max_steps": 192,
        "optim.lr": 5e-5,
        "eval.every": 48,
        "eval.max_prompts": 64,
    },
}


def as_completion(text: str, prompt: Any) -> Any:
    """TRL's completion form: a string for string prompts, a message list for chat prompts."""
    if isinstance(prompt, list):
        return [{"role": "assistant", "content": text}]
    return text
