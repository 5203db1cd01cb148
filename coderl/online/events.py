"""Outcome events that arrive after the model answered, validated before they reach storage.

Every event carries a client-generated ``event_id`` (the idempotency key: the same id twice is
stored once) and the ``interaction_id`` returned by ``coderl serve``. Kinds:

- ``accepted`` / ``rejected``: the user kept or discarded the suggestion.
- ``edit_persisted``: ``fraction`` (in [0, 1]) of the agent's edited lines still present
  ``after_minutes`` minutes later.
- ``follow_up``: the user's next message, classified ``dissatisfied`` / ``neutral`` /
  ``satisfied``.
- ``tool_error``: the client could not parse or execute a tool call of this interaction.
- ``latency_ms``: end-to-end latency the user saw, in milliseconds.

Malformed input never raises out of :func:`parse_event`: it returns a :class:`Rejected` with a
reason, which the store counts. The same limits hold for an imported line and for an event
posted to the HTTP endpoint: at most ``MAX_EVENT_BYTES`` of JSON, nested at most ``MAX_DEPTH``
levels, numbers that are finite JSON numbers (booleans, strings, ``NaN`` and ``Infinity`` are
rejected). Times are Unix seconds (float).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    TypeAdapter,
    ValidationError,
)

from coderl.agent.parsing import nesting_exceeds
from coderl.config.online import EVENT_TYPES

_Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError(f"expected a number, got the boolean {str(v).lower()}")
    return v


_Number = Annotated[float, BeforeValidator(_not_bool), Strict(), Field(allow_inf_nan=False)]
"""A finite JSON number (an int or a float); booleans, strings, NaN and infinities are errors."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: _Id
    """Client-generated idempotency key."""
    interaction_id: _Id
    """The id ``coderl serve`` returned for the completion this event is about."""
    occurred_at: _Number | None = Field(default=None, ge=0)
    """Client time of the event (Unix seconds); the server's receive time is used when absent."""


class Accepted(_Event):
    type: Literal["accepted"]


class RejectedSuggestion(_Event):
    type: Literal["rejected"]


class EditPersisted(_Event):
    type: Literal["edit_persisted"]
    fraction: _Number = Field(ge=0.0, le=1.0)
    """Fraction of the agent's edited lines still present after ``after_minutes``."""
    after_minutes: _Number = Field(gt=0)
    """How long after the edit the client measured persistence, in minutes."""


class FollowUp(_Event):
    type: Literal["follow_up"]
    sentiment: Literal["dissatisfied", "neutral", "satisfied"]


class ToolError(_Event):
    type: Literal["tool_error"]
    message: str = Field(default="", max_length=4000)


class LatencyMs(_Event):
    type: Literal["latency_ms"]
    value: _Number = Field(ge=0, le=86_400_000)
    """Milliseconds."""


FeedbackEvent = Annotated[
    Accepted | RejectedSuggestion | EditPersisted | FollowUp | ToolError | LatencyMs,
    Field(discriminator="type"),
]
_KINDS = [
    get_args(m.model_fields["type"].annotation)[0] for m in get_args(get_args(FeedbackEvent)[0])
]
if _KINDS != list(EVENT_TYPES):  # one model per configured event type, in the same order
    raise ImportError(f"event models {_KINDS} != EVENT_TYPES {list(EVENT_TYPES)}")
_ADAPTER: TypeAdapter[Any] = TypeAdapter(FeedbackEvent)
MAX_EVENT_BYTES = 16_384
"""Largest event, as JSON text (an imported line, or an event of an HTTP request re-encoded)."""
MAX_DEPTH = 8
"""Deepest nesting of JSON containers in an event or a request body (events are flat)."""
MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""Largest body of one ``POST /v1/feedback`` request."""


@dataclass(frozen=True)
class Rejected:
    """A malformed event: why, and (truncated) what was received."""

    reason: str
    raw: str
    key: str | None = None
    """Idempotency key of a rejected imported line (source, line number, content); None for
    rejects that cannot recur identically (HTTP requests): each is counted."""
    line: int | None = None
    """Line number of a rejected imported line (None: not from a file)."""


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(data: bytes | bytearray | str) -> Any:
    """Decode JSON text; a :class:`Rejected` (never an exception) when it is not UTF-8, not
    standard JSON (``NaN`` and ``Infinity`` are not), or nested deeper than ``MAX_DEPTH``."""
    text = data
    if isinstance(data, bytes | bytearray):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejected(f"invalid_json: not UTF-8 ({e.reason})", repr(data[:200]))
    assert isinstance(text, str)
    try:
        obj = json.loads(text, parse_constant=_no_constants)
    except RecursionError:
        return Rejected(f"too_deep: nested deeper than {MAX_DEPTH} levels", text[:200])
    except json.JSONDecodeError as e:
        return Rejected(f"invalid_json: {e.msg} at char {e.pos}", text[:1000])
    except ValueError as e:
        return Rejected(f"invalid_json: {e}", text[:1000])
    if nesting_exceeds(obj, MAX_DEPTH):
        return Rejected(f"too_deep: nested deeper than {MAX_DEPTH} levels", text[:200])
    return obj


def parse_event(raw: Any) -> _Event | Rejected:
    """Validate one event given as a dict, JSON text or bytes.

    Returns:
        the typed event, or :class:`Rejected` whose ``reason`` starts with a short category
        (``invalid_json``, ``too_large``, ``too_deep``, ``not_an_object``, ``invalid_event``)
        followed by the details. Never raises for bad input.
    """
    if isinstance(raw, bytes | bytearray | str):
        unit = "chars" if isinstance(raw, str) else "bytes"
        if len(raw) > MAX_EVENT_BYTES:
            return Rejected(f"too_large: {len(raw)} {unit} > {MAX_EVENT_BYTES}", "")
        raw = parse_json(raw)
        if isinstance(raw, Rejected):
            return raw
    elif nesting_exceeds(raw, MAX_DEPTH):
        return Rejected(f"too_deep: nested deeper than {MAX_DEPTH} levels", "")
    if not isinstance(raw, dict):
        return Rejected(f"not_an_object: got {type(raw).__name__}", str(raw)[:1000])
    try:
        size = len(json.dumps(raw, ensure_ascii=False, default=str).encode("utf-8", "replace"))
    except ValueError as e:  # a non-finite float handed in as a dict
        return Rejected(f"invalid_event: {e}", "")
    if size > MAX_EVENT_BYTES:
        return Rejected(f"too_large: {size} bytes > {MAX_EVENT_BYTES}", "")
    try:
        return _ADAPTER.validate_python(raw)  # type: ignore[no-any-return]
    except ValidationError as e:
        details = "; ".join(plain_error(err) for err in e.errors())
        return Rejected(f"invalid_event: {details}", json.dumps(raw, default=str)[:1000])


_KNOWN = ", ".join(EVENT_TYPES)
_SAID: dict[str, str] = {
    "missing": "missing",
    "extra_forbidden": "not a field of this event type",
    "finite_number": "must be a finite number",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "string_too_short": "must not be empty",
    "string_too_long": "longer than {max_length} characters",
    "string_pattern_mismatch": "may hold only letters, digits and _ . : -",
    "greater_than": "must be above {gt}",
    "greater_than_equal": "must be at least {ge}",
    "less_than_equal": "must be at most {le}",
    "literal_error": "must be one of {expected}",
    "value_error": "{error}",
}
"""pydantic error type -> what :func:`plain_error` says (``{...}``: the error's context)."""


def plain_error(err: Any) -> str:
    """One pydantic error of an event (an item of ``ValidationError.errors()``) in plain words:
    ``field: what is wrong`` (the field without the event-type prefix pydantic puts first), a
    missing or unknown ``type`` with the known types; an error type not in :data:`_SAID`
    keeps pydantic's message."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "union_tag_not_found":
        return f'no "type" (one of: {_KNOWN})'
    if kind == "union_tag_invalid":
        return f"type {ctx.get('tag')!r} is not an event type (one of: {_KNOWN})"
    loc = [str(p) for p in err["loc"]]
    field = ".".join(loc[1:] if loc[:1] and loc[0] in EVENT_TYPES else loc) or "event"
    said = _SAID.get(kind)
    return f"{field}: {said.format(**ctx) if said else err['msg']}"


def read_jsonl(path: str | Path) -> Iterator[_Event | Rejected]:
    """Parse a JSONL file of events line by line (blank lines skipped). A rejected line carries
    a key made of the file's resolved path, its line number and its content, so replaying the
    import (after a crash) counts it once.

    Raises:
        FileNotFoundError: the file does not exist.
    """
    source = str(Path(path).resolve())
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                ev = parse_event(line)
                if isinstance(ev, Rejected):
                    h = hashlib.sha256(f"{source}\0{lineno}\0".encode() + line).hexdigest()
                    ev = replace(ev, key=f"line:{h[:40]}", line=lineno)
                yield ev
