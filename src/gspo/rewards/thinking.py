"""Where a completion's thinking ends and its answer starts (:func:`answer_text`), which
every built-in reads: a reasoning model's thinking is not its answer.

Only a leading thinking block is thinking: one the completion opens with ``<think>``, one
its prompt opened (:func:`opens_thinking`: a template ending the generation prompt with
``<think>``), or one a template opened unseen (a chat prompt: the completion holds only
``</think>``). A tag further on is the answer's own text (a program's
``print("</think>")``), but for a ``<think>`` in its prose that is never closed (cut off
while thinking again: nothing after it is an answer).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gspo.rewards.parsing import _content_text, completion_text

THINK, END = "<think>", "</think>"
#: The keyword a rollout passes the built-ins (and a function that takes it): for each
#: completion, whether the generation prompt its chat template rendered ended with
#: ``<think>`` (Qwen3-Thinking's, DeepSeek-R1's): its thinking, every turn's in a multi-turn
#: episode, was opened for it. (A chat prompt's messages do not say it.)
THINKING_OPENED = "thinking_opened"

#: Code in Markdown: a fenced block (to its closing fence, or the end: cut off) or an
#: inline span. A tag inside one is the program's text, not the model's thinking.
_CODE = re.compile(r"```.*?(?:```|\Z)|`[^`\n]*`", re.DOTALL)


def opens_thinking(prompt: Any) -> bool:
    """Whether ``prompt`` ends inside a think block it opened: a text prompt rendered by a
    template that ends the generation prompt with ``<think>`` (DeepSeek-R1's, QwQ's,
    Qwen3-Thinking-2507's; ``<think>\\n`` too), or a chat prompt whose last, assistant,
    message does. Its completion starts in the thinking and holds only ``</think>``."""
    if isinstance(prompt, Sequence) and not isinstance(prompt, str) and prompt:
        last = prompt[-1]
        if not (isinstance(last, Mapping) and last.get("role") == "assistant"):
            return False
        prompt = last.get("content")
        prompt = _content_text(prompt) if isinstance(prompt, str | list) else None
    return isinstance(prompt, str) and prompt.rstrip().endswith(THINK)


def _outside_code(text: str, tag: str, start: int = 0) -> int:
    """Where ``tag`` first occurs in ``text`` from ``start`` outside code (-1: nowhere)."""
    spans = [m.span() for m in _CODE.finditer(text)]  # (in order, apart)
    starts = [s for s, _ in spans]
    at = text.find(tag, start)
    while at >= 0:
        k = bisect.bisect_right(starts, at) - 1  # (the last span starting at or before)
        if k < 0 or at >= spans[k][1]:
            return at
        at = text.find(tag, spans[k][1])
    return -1


def answer_text(completion: Any, prompt: Any = None) -> str:
    """The part of a completion that holds its answer: what follows its leading thinking
    (to the first ``</think>``: of a completion that opens with ``<think>``, of one whose
    ``prompt`` opened it, or, outside code, one with no ``<think>`` before it), and
    before a ``<think>`` its prose opens again and never closes. Thinking never closed
    leaves no answer (cut off while thinking). Tags in the answer's code are its text.
    (It read after the last ``</think>`` and cut at any ``<think>``: a program that
    printed either scored 0.)"""
    text = completion_text(completion)
    if opens_thinking(prompt) or text.lstrip().startswith(THINK):
        _, closed, text = text.partition(END)
        if not closed:
            return ""
    elif (end := _outside_code(text, END)) >= 0 and THINK not in text[:end]:
        text = text[end + len(END) :]  # (a chat template opened it, unseen by the reward)
    opened = _outside_code(text, THINK)
    if opened >= 0 and END not in text[opened:]:
        text = text[:opened]  # (a think block opened again and not closed)
    return text


def aligned_prompts(prompts: Any, n: int, opened: Sequence[bool] | None = None) -> list[Any]:
    """The prompt of each of ``n`` completions as :func:`answer_text` reads it: ``prompts``
    where it is one per completion, else None each (a direct call's prompts, not aligned,
    are not read); ``<think>`` where ``opened`` (:data:`THINKING_OPENED`) says the chat
    template opened the thinking (a chat prompt's messages do not say it)."""
    aligned = isinstance(prompts, Sequence) and not isinstance(prompts, str)
    out = list(prompts) if aligned and len(prompts) == n else [None] * n
    if isinstance(opened, Sequence) and len(opened) == n:
        out = [THINK if flag else prompt for prompt, flag in zip(out, opened, strict=True)]
    return out


def template_opened(prompt_tails: Sequence[str]) -> list[bool]:
    """:data:`THINKING_OPENED` of completions whose prompts, as the model saw them
    (rendered by the chat template), end with ``prompt_tails``."""
    return [tail.rstrip().endswith(THINK) for tail in prompt_tails]
