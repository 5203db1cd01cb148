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
reason, which the store counts. Times are Unix seconds (float).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

_Id = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-]+$")]


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: _Id
    """Client-generated idempotency key."""
    interaction_id: _Id
    """The id ``coderl serve`` returned for the completion this event is about."""
    occurred_at: float | None = Field(default=None, ge=0)
    """Client time of the event (Unix seconds); the server's receive time is used when absent."""


class Accepted(_Event):
    type: Literal["accepted"]


class RejectedSuggestion(_Event):
    type: Literal["rejected"]


class EditPersisted(_Event):
    type: Literal["edit_persisted"]
    fraction: float = Field(ge=0.0, le=1.0)
    """Fraction of the agent's edited lines still present after ``after_minutes``."""
    after_minutes: float = Field(gt=0)
    """How long after the edit the client measured persistence, in minutes."""


class FollowUp(_Event):
    type: Literal["follow_up"]
    sentiment: Literal["dissatisfied", "neutral", "satisfied"]


class ToolError(_Event):
    type: Literal["tool_error"]
    message: str = Field(default="", max_length=4000)


class LatencyMs(_Event):
    type: Literal["latency_ms"]
    value: float = Field(ge=0, le=86_400_000)
    """Milliseconds."""


FeedbackEvent = Annotated[
    Accepted | RejectedSuggestion | EditPersisted | FollowUp | ToolError | LatencyMs,
    Field(discriminator="type"),
]
EVENT_TYPES = ("accepted", "rejected", "edit_persisted", "follow_up", "tool_error", "latency_ms")
_ADAPTER: TypeAdapter[Any] = TypeAdapter(FeedbackEvent)
MAX_EVENT_BYTES = 16_384


@dataclass(frozen=True)
class Rejected:
    """A malformed event: why, and (truncated) what was received."""

    reason: str
    raw: str


def parse_event(raw: Any) -> _Event | Rejected:
    """Validate one event given as a dict, JSON text or bytes.

    Returns:
        the typed event, or :class:`Rejected` whose ``reason`` starts with a short category
        (``invalid_json``, ``too_large``, ``not_an_object``, ``invalid_event``) followed by the
        validation details. Never raises for bad input.
    """
    text = raw if isinstance(raw, str) else None
    if isinstance(raw, bytes | bytearray):
        if len(raw) > MAX_EVENT_BYTES:
            return Rejected(f"too_large: {len(raw)} bytes > {MAX_EVENT_BYTES}", "")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejected(f"invalid_json: not UTF-8 ({e.reason})", repr(raw[:200]))
    if text is not None:
        if len(text) > MAX_EVENT_BYTES:
            return Rejected(f"too_large: {len(text)} chars > {MAX_EVENT_BYTES}", text[:200])
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            return Rejected(f"invalid_json: {e.msg} at char {e.pos}", text[:1000])
    if not isinstance(raw, dict):
        return Rejected(f"not_an_object: got {type(raw).__name__}", str(raw)[:1000])
    try:
        return _ADAPTER.validate_python(raw)  # type: ignore[no-any-return]
    except ValidationError as e:
        details = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
            for err in e.errors()
        )
        return Rejected(f"invalid_event: {details}", json.dumps(raw, default=str)[:1000])


def read_jsonl(path: str | Path) -> Iterator[_Event | Rejected]:
    """Parse a JSONL file of events line by line (blank lines skipped).

    Raises:
        FileNotFoundError: the file does not exist.
    """
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                yield parse_event(line)
