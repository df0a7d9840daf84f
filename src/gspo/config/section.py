"""The base of every config section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A bad config file, key or value; the message is one line naming it."""


class Section(BaseModel):
    """A config section: an unknown key is an error, an assigned value is validated, and a
    float is finite (no inf or NaN).

    A bad assignment from Python (``config.optim.lr = -1``) is a one-line
    :class:`ConfigError` naming the key, as a bad override is.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    #: The section's place in the config (``"optim."``), set by :mod:`gspo.config.root`.
    config_key: ClassVar[str] = ""

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as exc:
            err = exc.errors()[0]
            message = err["msg"].removeprefix("Value error, ")
            if err["type"] == "no_such_attribute":
                message = "unknown key"
            raise ConfigError(f"{self.config_key}{name}: {message} (got {value!r})") from None
