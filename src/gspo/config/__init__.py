"""Typed configuration: YAML file plus dotted ``key.sub=value`` overrides, one loader.

Every batch size is per optimizer step (global), never per process. The sections and
their own rules live in :mod:`~gspo.config.model`, :mod:`~gspo.config.data`,
:mod:`~gspo.config.reward`, :mod:`~gspo.config.rollout`, :mod:`~gspo.config.algorithm` and
:mod:`~gspo.config.run`; the rules across sections in :mod:`~gspo.config.checks`; the
whole :class:`Config` in :mod:`~gspo.config.root`; loading in :mod:`~gspo.config.loading`;
the reference page (``gspo config --doc``) in :mod:`~gspo.config.doc`.
"""

from gspo.config.algorithm import AlgorithmConfig
from gspo.config.data import DataConfig
from gspo.config.doc import REGENERATE, format_default, keys, render_reference, sections
from gspo.config.loading import (
    ConfigError,
    changed_settings,
    dump_config,
    dump_config_text,
    flat_settings,
    load_config,
    parse_override,
)
from gspo.config.model import RESUME_MAY_CHANGE, LoraSettings
from gspo.config.rollout import VLLM_LORA_RANKS
from gspo.config.root import Config, checked_config

__all__ = [
    "REGENERATE", "RESUME_MAY_CHANGE", "VLLM_LORA_RANKS", "AlgorithmConfig", "Config",
    "ConfigError", "DataConfig", "LoraSettings", "changed_settings", "checked_config",
    "dump_config", "dump_config_text", "flat_settings", "format_default", "keys", "load_config",
    "parse_override", "render_reference", "sections",
]  # fmt: skip
