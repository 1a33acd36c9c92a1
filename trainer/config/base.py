"""Base class for every config section: strict (unknown keys rejected), typed, validated once at load."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config mapping. Unknown keys are errors (the loader turns them into "did you mean …" messages)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
