"""The pieces every config section shares: the base model and the error formatter."""

from __future__ import annotations

import difflib
import re
import typing
from collections import defaultdict
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
            value = e.get("input")
            got = "" if isinstance(value, dict) or e["type"] == "missing" else f"got {value!r}"
            said, near = plain_message(e)
            hint = "; ".join(x for x in (got, near) if x)
            said = said or msg.replace("Input should be", "must be", 1)  # a type not in _PLAIN
            lines.append(f"{key}: {said}" + (f" ({hint})" if hint else ""))
        else:
            lines.append(msg)
    return "; ".join(lines)


_PLAIN = {
    "greater_than_equal": "must be at least {ge}",
    "greater_than": "must be greater than {gt}",
    "less_than_equal": "must be at most {le}",
    "less_than": "must be less than {lt}",
    "multiple_of": "must be a multiple of {multiple_of}",
    "int_type": "must be a whole number",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list, e.g. [1, 4]",
    "tuple_type": "must be a list, e.g. [1, 4]",
    "dict_type": "must be a mapping, e.g. {{key: value}}",
    "model_type": "must be a section, a mapping such as {{key: value}}",
    "model_attributes_type": "must be a section, a mapping such as {{key: value}}",
    "finite_number": "must be a finite number",
    "string_too_short": "needs at least {min_length} character(s)",
    "string_too_long": "takes at most {max_length} character(s)",
    "too_short": "needs at least {min_length} item(s)",
    "too_long": "takes at most {max_length} item(s)",
    "string_pattern_mismatch": "must match {pattern}",
    "missing": "is required",
    "none_required": "must be null",
    "literal_error": "must be {expected}",
    "enum": "must be {expected}",
}
"""pydantic's error types -> the line a config error says instead of pydantic's own wording
("Input should be greater than or equal to 1"), formatted with the error's context."""


def plain_message(error: Any) -> tuple[str | None, str | None]:
    """(what a value must be, "did you mean ..." or None) for one pydantic error (a dict of
    ``ValidationError.errors()``): None for a type :data:`_PLAIN` does not hold (a section's
    own check, whose message is already plain)."""
    template = _PLAIN.get(error["type"])
    if template is None:
        return None, None
    ctx = error.get("ctx") or {}
    shown = {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}  # 1, not 1.0
    said = template.format_map(defaultdict(lambda: "?", shown))
    near = None
    if error["type"] in ("literal_error", "enum") and isinstance(error.get("input"), str):
        options = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        close = difflib.get_close_matches(error["input"], options, n=1)
        near = f"did you mean {close[0]!r}?" if close else None
    return said, near
