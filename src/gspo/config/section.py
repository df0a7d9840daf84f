"""The base of every config section: unknown keys are errors, assignments are validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: an unknown key is an error, an assigned value is validated, and a
    float is finite (no inf or NaN)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
