"""What a reward function is, and the error raised when one is at fault.

Reward functions follow TRL's convention, so a TRL reward function works here unchanged.
A reward function is called with keyword arguments only::

    rewards = f(prompts=prompts, completions=completions, **columns)

* ``prompts``: one prompt per completion (a string, or a list of chat messages).
* ``completions``: one completion per prompt. A string when prompts are strings; when prompts
  are chat message lists, a TRL conversational completion ``[{"role": "assistant",
  "content": text}]`` (use :func:`gspo.rewards.completion_text` to get the text of either
  form).
* ``columns``: the dataset's other columns (e.g. ``answer``), each a list aligned with
  ``completions``.
* ``completion_ids``: each completion's token ids (a list of ints), as TRL passes them; only
  to a function that takes it (by name or ``**kwargs``), so one written for gspo without
  ``**kwargs`` is called as before.
* ``thinking_opened``: whether each completion's chat template opened its thinking (its
  generation prompt ended with ``<think>``: Qwen3-Thinking's, DeepSeek-R1's), which the
  prompt's messages do not say; gspo's own, offered as ``completion_ids`` is.

It returns a list with one ``float`` or ``None`` per completion; ``None`` means "not
applicable to this sample" and is skipped when rewards are combined (TRL's nansum).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: What a rollout passes a reward function beside the data's columns, to a function that
#: takes it (by name or ``**kwargs``): TRL's name for it (``thinking_opened``: gspo's).
OFFERED = ("completion_ids", "thinking_opened")

#: What TRL passes a reward function and gspo does not, and what gspo has instead.
TRL_ONLY = {
    "trainer_state": "the run's step reaches no reward function",
    "log_extra": "gspo logs each function's mean (train/reward/NAME) and, with "
    "log.completions_every, the completions with their rewards",
    "log_metric": "gspo logs each function's mean (train/reward/NAME)",
}

RewardFunction = Callable[..., Sequence[float | None]]
"""A TRL-style reward function: ``f(prompts=..., completions=..., **columns) -> list``."""


class RewardError(ValueError):
    """A reward function could not be loaded, called, or returned an invalid result.

    Messages are one line and name the reward function (its spec) at fault.
    """
