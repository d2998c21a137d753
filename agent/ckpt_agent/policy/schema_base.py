"""What every policy model shares: camelCase aliases, strictness, CEL rules, number types."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Field(ge=1)]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    """A CEL validation rule for the CRD schema (``x-kubernetes-validations``)."""
    out: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


class CamelModel(BaseModel):
    """Base: camelCase aliases, unknown fields are errors, docstrings become descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=False,
    )

    def to_wire(self) -> dict[str, Any]:
        """The camelCase dict as stored in Kubernetes (defaults included)."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)
