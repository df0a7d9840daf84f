"""The base of every config section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: an unknown key is an error and an assigned value is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
