"""DAPO's soft overlong punishment (``reward.overlong_penalty``), added to training rewards."""

from __future__ import annotations

from collections.abc import Sequence


def overlong_penalty(
    lengths: Sequence[int], max_tokens: int, buffer: int, penalty: float
) -> list[float]:
    """DAPO's soft overlong punishment, one value per response (0 or negative).

    Responses up to ``max_tokens - buffer`` tokens get 0; inside the buffer the penalty
    grows linearly to ``-penalty`` at ``max_tokens`` (a response cut off at the limit):
    ``-penalty * (length - (max_tokens - buffer)) / buffer``.
    """
    if buffer < 1 or buffer > max_tokens:
        raise ValueError(f"buffer must be in [1, {max_tokens}]; got {buffer}")
    start = max_tokens - buffer
    return [-penalty * min(max(n - start, 0), buffer) / buffer for n in lengths]
