"""gspo: Group Sequence Policy Optimization for language models.

The algorithmic core is importable without loading transformers::

    from gspo import policy_loss, group_advantages
"""

from gspo.advantages import group_advantages
from gspo.objectives import DEFAULT_CLIP, LEVELS, PolicyLoss, policy_loss

__version__ = "0.1.0"
__all__ = ["DEFAULT_CLIP", "LEVELS", "PolicyLoss", "__version__", "group_advantages", "policy_loss"]
