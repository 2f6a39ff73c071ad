"""The base every configuration section derives from: frozen, typed, no unknown fields."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A frozen config section; unknown keys are errors (a typo must not be ignored silently)."""

    # coerce_numbers_to_str: `--set run.id=123` (parsed as YAML, so a number) still names a string field
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)
