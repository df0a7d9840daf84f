"""Reward functions: what they are (:mod:`.contract`), reading completions (:mod:`.parsing`;
where their thinking ends, :mod:`.thinking`), the built-in verifiers (:mod:`.verifiers`), a
function from its spec (:mod:`.loading`), calling them on a batch (:mod:`.runner`), several
with weights (:mod:`.functions`), DAPO's overlong penalty (:mod:`.penalty`), a built-in per
row by its ``data_source`` (:mod:`.by_source`, registered as ``by_source`` on import) and
the sandbox behind the ``code`` reward (:mod:`.sandbox`, imported when that reward runs).
Needs only the standard library and :mod:`gspo.plugins`; math-verify is imported when the
``math`` reward runs.
"""

from gspo.rewards.by_source import BySource
from gspo.rewards.contract import RewardError, RewardFunction
from gspo.rewards.functions import RewardFunctions, RewardResult
from gspo.rewards.loading import load_reward_function
from gspo.rewards.parsing import (
    completion_text,
    extract_final_answer,
    parse_number,
    reference_answer,
)
from gspo.rewards.penalty import overlong_penalty
from gspo.rewards.verifiers import (
    BUILTIN_REWARDS,
    code_reward,
    exact_match_reward,
    format_reward,
    math_reward,
    numeric_match_reward,
)

# fmt: off
__all__ = [
    "BUILTIN_REWARDS", "BySource", "RewardError", "RewardFunction", "RewardFunctions",
    "RewardResult",
    "code_reward", "completion_text", "exact_match_reward", "extract_final_answer",
    "format_reward", "load_reward_function", "math_reward", "numeric_match_reward",
    "overlong_penalty", "parse_number", "reference_answer",
]
# fmt: on
