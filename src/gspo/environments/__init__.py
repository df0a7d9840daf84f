"""Environments: what a model talks to in a multi-turn, tool-using episode.

An environment is a plain Python class named in config (``rollout.environment=
path/to/env.py:Factory`` or ``package.module:Factory``); ``Factory()`` makes one
environment per episode. It follows TRL's ``environment_factory`` convention (a factory
with required parameters is called with the dataset row instead, see
:meth:`EnvironmentFactory.make`):

- ``reset(**row)`` (optional) is called first with the dataset row's columns it takes
  (all of them with ``**kwargs``; the prompt included); a string it returns is appended
  to the prompt's last user message.
- Every other public method is a **tool**. Its name, docstring (Google style, with an
  ``Args:`` section) and type hints become the JSON schema handed to the tokenizer's chat
  template (``transformers.utils.get_json_schema``). The model calls tools in the
  Hermes/Qwen format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; each
  call's return value (``str()``, or JSON for other types) goes back as a ``tool`` message.
- ``step(text)`` (optional) is the generic hook for environments that are not
  tool-shaped (games, interpreters): called with the model's turn when it made no tool
  call, it returns the next observation (a ``user`` message) or None to end it.
- ``get_reward()`` (optional) is the environment's own reward for the episode: the
  built-in reward function ``environment`` returns it, and is the default reward of an
  environment that has one. Every reward function also gets ``environments=`` (one per
  completion), as TRL's do.
- ``close()`` (optional) is called once the episode has been scored.

An episode ends when the model's turn calls no tool and ``step`` is absent or returns
None, or at ``rollout.max_turns`` / ``rollout.max_episode_tokens`` (run by
:mod:`gspo.training.episodes`). A call that does not parse, names no tool, has arguments
the tool does not take or its schema does not allow, or whose tool raises is answered
with an ``error: ...`` tool message and counted (``env/tool_errors_mean``); it never
stops the run. A factory that cannot be loaded or made, a ``reset`` that raises or a
tool without a schema stops it.
"""

from gspo.environments.calculator import Calculator
from gspo.environments.deadlines import (
    ENV_GRACE_SECONDS,
    INTERRUPT_EVERY,
    SLOW_CALL_SECONDS,
    EnvError,
    EnvTimeout,
    SlowCalls,
    deadline,
)
from gspo.environments.episodes import RESERVED, TOOL_KINDS, EnvironmentFactory, Episode, accepted
from gspo.environments.tool_calls import (
    NoText,
    ToolCall,
    argument_error,
    parse_tool_calls,
    tool_result_text,
)

__all__ = [
    "ENV_GRACE_SECONDS", "INTERRUPT_EVERY", "RESERVED", "SLOW_CALL_SECONDS", "TOOL_KINDS",
    "Calculator", "EnvError", "EnvTimeout", "EnvironmentFactory", "Episode", "NoText",
    "SlowCalls", "ToolCall", "accepted", "argument_error", "deadline", "parse_tool_calls",
    "tool_result_text",
]  # fmt: skip
