"""The pieces every config section shares: the base model and the error formatter."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A configuration problem; the message names the offending dotted key."""


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


def _section_keys(model: type[BaseModel] | None, loc: Sequence[Any]) -> list[str] | None:
    """The keys the section at ``loc`` (a path of field names or aliases below ``model``)
    accepts, or None where the path leaves the tree of sections (a dict-valued field)."""
    for part in loc:
        if model is None:
            return None
        fields = {f.alias or name: f for name, f in model.model_fields.items()}
        if part not in fields:
            return None
        ann = fields[part].annotation
        candidates = (ann, *typing.get_args(ann))  # `Section | None` names its section inside
        model = next(
            (a for a in candidates if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
    if model is None:
        return None
    return sorted(f.alias or name for name, f in model.model_fields.items())


def _error_message(
    err: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> str:
    """One line per error, each naming its dotted key; an unknown key also lists the keys its
    section accepts (and the closest one) when ``model`` is the validated model."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in ([prefix] if prefix else []) + list(e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            valid = _section_keys(model, e["loc"][:-1])
            hint = ""
            if valid:
                close = difflib.get_close_matches(str(e["loc"][-1]), valid, n=1)
                near = ".".join([*key.split(".")[:-1], *close])
                hint = f" (did you mean {near!r}?)" if close else ""
                hint += f"; valid: {valid}"
            lines.append(f"unknown key {key!r}{hint}")
        elif key:  # a section's own check: its input is the whole section, not worth printing
            got = "" if isinstance(e.get("input"), dict) else f" (got {e.get('input')!r})"
            lines.append(f"{key}: {msg}{got}")
        else:
            lines.append(msg)
    return "; ".join(lines)
