"""The pieces every config section shares: the base model and the error formatter."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration problem; the message names the offending dotted key."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


def _error_message(err: ValidationError, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in ([prefix] if prefix else []) + list(e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}")
        elif key:  # a section's own check: its input is the whole section, not worth printing
            got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
            lines.append(f"{key}: {msg}{got}")
        else:
            lines.append(msg)
    return "; ".join(lines)
