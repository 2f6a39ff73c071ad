"""The base every configuration section derives from: frozen, typed, no unknown fields."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A frozen config section; unknown keys are errors (a typo must not be ignored silently)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)
