"""gspo: Group Sequence Policy Optimization for language models.

A run from Python (docs/python.md)::

    import gspo

    config = gspo.load_config("my.yaml", ["model.path=...", "data.train=train.jsonl"])
    config.reward.functions = [my_reward, "format"]
    gspo.train(config, "runs/mine")
    print(gspo.evaluate("runs/mine").metrics)  # its latest checkpoint, as the run evaluates

The algorithmic core is importable without loading transformers::

    from gspo import policy_loss, group_advantages
"""

from gspo.objectives import DEFAULT_CLIP, LEVELS, PolicyLoss, group_advantages, policy_loss

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_CLIP", "LEVELS", "Config", "PolicyLoss", "Trainer", "__version__",
    "evaluate", "group_advantages", "load_config", "policy_loss", "train",
]  # fmt: skip

# imported when first used: the trainer loads transformers
_LAZY = {
    "Config": "gspo.config",
    "load_config": "gspo.config",
    "Trainer": "gspo.trainer",
    "train": "gspo.runs",
    "evaluate": "gspo.checkpoint_eval",
}


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gspo' has no attribute {name!r}")
