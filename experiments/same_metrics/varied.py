"""The harness's reward: varied within every group (a hash of the characters), so every
rollout batch has advantages and every run updates its weights whatever it samples. The
built-in tasks' own rewards are flat on these tiny, barely cold-started models (0 for
every completion): with them no run took a step, and "the same metrics" said little."""


def varied(prompts, completions, **kwargs):
    return [sum(ord(ch) for ch in str(c)) % 7 / 7 for c in completions]
