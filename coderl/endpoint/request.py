"""What a chat-completions request may carry, in one place: the fields ``coderl serve`` and the
gateway honour (:class:`ChatRequest`), the fields they accept only at a value that changes
nothing (:data:`NEUTRAL`), and the one-line OpenAI-style 400 for everything else
(:func:`parse_request`).

Three kinds of field, decided per field and value:

- **honoured** (:class:`ChatRequest`): ``model``, ``messages``, ``tools``, ``tool_choice``
  (``"auto"``/``"none"``), ``temperature``, ``top_p``, ``max_tokens`` /
  ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``, ``stream``, ``stream_options``,
  ``parallel_tool_calls``, ``user``, and coderl's own ``episode_id``, ``population``,
  ``is_summary``, ``return_token_ids``.
- **neutral or bookkeeping** (:data:`NEUTRAL`): accepted and ignored at a value that changes
  nothing about the sample or the answer (``n: 1``, ``frequency_penalty: 0``, ``logit_bias:
  {}``, ``response_format: {"type": "text"}``, vLLM's ``top_k: -1``, ...), or at any value when
  the field is bookkeeping (``metadata``, ``store``, ``service_tier``, ``prompt_cache_key``,
  ...). Any other value would change the answer in a way coderl does not implement: refused,
  naming the field, the value and what is supported.
- **unknown**: refused, as OpenAI refuses an unrecognized argument (vLLM ignores extra fields
  with a warning; a client that asks for something coderl would silently not do is told so).

Values are not coerced (``"5"`` for ``max_tokens`` is refused, as OpenAI refuses it).
Messages: roles are OpenAI's; ``content`` is a string or a list of text parts, and null (or
absent) only on an assistant message that has ``tool_calls``, as OpenAI has it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from coderl.endpoint.calls import RequestError


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` is honoured; ``include_obfuscation`` (OpenAI's
    padding of stream chunks against length side channels) is ignored. Accepted also without
    ``stream`` (it then changes nothing), where OpenAI and vLLM refuse it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ChatRequest(BaseModel):
    """The honoured fields of OpenAI's chat-completions request (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    parallel_tool_calls: bool | None = None
    """False: the reply carries at most one tool call (the completion is cut after the first)."""
    user: str | None = None
    episode_id: str | None = Field(default=None, max_length=128)
    population: str | None = Field(default=None, max_length=128)
    is_summary: bool = False
    return_token_ids: bool = False
    """Also return the sampled token ids (``choices[0].token_ids``, as vLLM's extension names
    them) and the prompt's (``prompt_token_ids``): what a token-exact client harness continues
    from (:mod:`coderl.online.agent_client`)."""


ALLOWED = {
    "model": "a string (a served model name)",
    "messages": "a non-empty list of message objects",
    "tools": 'a list of {"type": "function", "function": {...}} objects, or null',
    "tool_choice": '"auto" or "none" (or null)',
    "temperature": "a number from 0 to 2, or null",
    "top_p": "a number above 0 and at most 1, or null",
    "max_tokens": "a positive integer, or null",
    "max_completion_tokens": "a positive integer, or null",
    "stop": "a string, a list of at most 4 non-empty strings, or null",
    "seed": "an integer, or null",
    "logprobs": "true, false or null",
    "stream": "true, false or null",
    "stream_options": '{"include_usage": true|false, "include_obfuscation": true|false} or null',
    "parallel_tool_calls": "true, false or null",
    "user": "a string, or null",
    "episode_id": "a string of at most 128 characters, or null",
    "population": "a string of at most 128 characters, or null",
    "is_summary": "true or false",
    "return_token_ids": "true or false",
}
"""What each honoured field accepts, as the 400 for a bad value says it."""
assert set(ALLOWED) == set(ChatRequest.model_fields)


def _number(neutral: float) -> Callable[[Any], bool]:
    return lambda v: v is None or (not isinstance(v, bool) and v == neutral)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in (None, *values))


def _kind(*types: type) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, types) and not isinstance(v, bool))


def _flag(v: Any) -> bool:
    return v is None or isinstance(v, bool)


AS_DRAWN = "coderl records the policy's samples as drawn"
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    # OpenAI's sampling and output fields, at the value that changes nothing
    "n": (_number(1), "1 (one choice per request)"),
    "frequency_penalty": (_number(0), "0 (no penalty)"),
    "presence_penalty": (_number(0), "0 (no penalty)"),
    "logit_bias": (_one_of({}), "{} (no bias)"),
    "top_logprobs": (_number(0), "0 (logprobs: true returns each sampled token's logprob)"),
    "response_format": (_one_of({"type": "text"}), '{"type": "text"} (free text)'),
    "modalities": (_one_of(["text"]), '["text"]'),
    "audio": (_one_of(), "null (text only)"),
    "reasoning_effort": (_one_of(), "null (the policy is served as trained)"),
    "verbosity": (_one_of(), "null (the policy is served as trained)"),
    "web_search_options": (_one_of(), "null (no web search)"),
    "moderation": (_one_of(), "null (no moderation)"),
    "functions": (_one_of([]), "[] (the deprecated functions: use tools)"),
    "function_call": (_one_of("auto", "none"), '"auto" or "none" (use tool_choice)'),
    "prediction": (_kind(dict), "an object (a latency hint: the answer is the same)"),
    # bookkeeping: stored, billed or cached elsewhere; coderl records every call regardless
    "metadata": (_kind(dict), "an object (bookkeeping, ignored)"),
    "store": (_flag, "true, false or null (coderl records every call regardless)"),
    "service_tier": (_kind(str), "a string (a latency tier, ignored)"),
    "safety_identifier": (_kind(str), "a string (bookkeeping, ignored)"),
    "prompt_cache_key": (_kind(str), "a string (a cache hint, ignored)"),
    "prompt_cache_retention": (_kind(str), "a string (a cache hint, ignored)"),
    "prompt_cache_options": (_kind(dict), "an object (a cache hint, ignored)"),
    # vLLM's sampling extensions (sent through the SDK's extra_body), at their defaults
    "top_k": (_one_of(-1, 0), "-1 or 0 (no top-k cut)"),
    "min_p": (_number(0), "0 (no min-p cut)"),
    "repetition_penalty": (_number(1), "1 (no penalty)"),
    "length_penalty": (_number(1), "1 (no penalty)"),
    "min_tokens": (_number(0), f"0 ({AS_DRAWN}; a minimum would mask the stop token)"),
    "ignore_eos": (_one_of(False), f"false ({AS_DRAWN})"),
    "use_beam_search": (_one_of(False), f"false ({AS_DRAWN})"),
    "include_stop_str_in_output": (_one_of(False), "false (the reply ends before a stop string)"),
    "skip_special_tokens": (_one_of(True), "true"),
    "spaces_between_special_tokens": (_one_of(True), "true"),
    "echo": (_one_of(False), "false"),
    "add_generation_prompt": (_one_of(True), "true (the policy answers as trained)"),
    "continue_final_message": (_one_of(False), "false (the policy answers as trained)"),
    "chat_template_kwargs": (_one_of({}), "{} (the conversation is rendered as in training)"),
}
"""Fields accepted and ignored at a neutral value (or any value, for bookkeeping):
``name -> (accepts(value), what is supported)``; any other value is refused."""


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as JSON for an error line, cut to ``limit`` characters."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unknown(name: str) -> str:
    return (
        f"{name}: unknown field, refused (coderl would not act on it); accepted fields: "
        f"{', '.join(ChatRequest.model_fields)}; and at a neutral value only: {', '.join(NEUTRAL)}"
    )


def _validation_errors(e: pydantic.ValidationError, body: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, line)`` per honoured field that failed validation: its value and what it
    allows (never pydantic's wording)."""
    fields = dict.fromkeys(str(x["loc"][0]) for x in e.errors() if x["loc"])
    return [
        (f, f"{f}: {shown(body[f])} is not allowed; allowed: {ALLOWED[f]}")
        if f in body
        else (f, f"{f}: required; allowed: {ALLOWED[f]}")
        for f in fields
    ]


def parse_request(raw: bytes) -> ChatRequest:
    """The request in the body ``raw``, checked field by field (see the module docstring).

    Raises:
        RequestError: one line naming every field at fault (its value and what is supported),
            ``param`` the first; or the body is not a JSON object.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError(
            f"the request body must be a JSON object, not {type(body).__name__} {shown(body)}"
        )
    errors: list[tuple[str, str]] = []
    for name, value in body.items():
        if name in NEUTRAL:
            accepts, supported = NEUTRAL[name]
            if not accepts(value):
                errors.append(
                    (name, f"{name}: {shown(value)} is not supported; supported: {supported}")
                )
        elif name not in ChatRequest.model_fields:
            errors.append((name, _unknown(name)))
    honoured = {k: v for k, v in body.items() if k in ChatRequest.model_fields}
    try:
        req = ChatRequest.model_validate(honoured)
    except pydantic.ValidationError as e:
        errors = _validation_errors(e, body) + errors
        req = None
    if errors:
        raise RequestError("; ".join(m for _, m in errors), param=errors[0][0])
    assert req is not None
    return req


def stop_strings(req: ChatRequest) -> list[str]:
    """The request's ``stop`` as a list (at most 4 non-empty strings).

    Raises:
        RequestError: more than 4, or an empty string.
    """
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError(
            f"stop: {shown(req.stop)} is not allowed; allowed: {ALLOWED['stop']}", param="stop"
        )
    return stops


def offers_tools(req: ChatRequest) -> bool:
    """Whether the model is shown the request's tools: ``tool_choice`` ``"auto"`` (default) yes,
    ``"none"`` no.

    Raises:
        RequestError: ``"required"`` or a named function (they would constrain the sample).
    """
    if req.tool_choice in (None, "auto"):
        return True
    if req.tool_choice == "none":
        return False
    raise RequestError(
        f"tool_choice: {shown(req.tool_choice)} is not supported: {AS_DRAWN}, so it "
        "cannot force a call; supported: 'auto', 'none'",
        param="tool_choice",
    )


ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles accepted (OpenAI's; ``developer`` is rendered as ``system``)."""

TEXT = 'a string or a list of {"type": "text", "text": ...} parts'


def _text(i: int, m: dict[str, Any]) -> str | None:
    """Message ``i``'s content as one string (None: an assistant's tool-call turn without text).

    Raises:
        RequestError: null or absent content other than on an assistant message with
            ``tool_calls``, a content of another type, or a part that is not text.
    """
    role, content = m["role"], m.get("content")
    where = f"messages.{i}.content"
    if content is None:
        if role == "assistant" and (m.get("tool_calls") or m.get("function_call")):
            return None
        raise RequestError(
            f"{where}: null or absent in the {role} message; only an assistant message with "
            f"tool_calls may leave it null; supported: {TEXT}",
            param=where,
        )
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"{where}: {shown(content)} in the {role} message is not supported; supported: {TEXT}",
            param=where,
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RequestError(
                f"{where}: part of type {kind!r} is not supported; supported: {TEXT}",
                param=where,
            )
        texts.append(part["text"])
    return "".join(texts)


def flat_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with list-of-parts contents joined into one string (text parts only) and
    the ``developer`` role (OpenAI's newer name for ``system``) as ``system``, the role chat
    templates know.

    Raises:
        RequestError: a message that is not an object, a role not in :data:`ROLES`, or a
            content that is not text (see :func:`_text`).
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages.{i}: a message must be an object", param=f"messages.{i}")
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                f"messages.{i}.role: {json.dumps(role)} is not a valid role; "
                f"supported: {', '.join(ROLES)}",
                param=f"messages.{i}.role",
            )
        text = _text(i, m)
        m = {**m, "role": "system" if role == "developer" else role}
        if isinstance(m.get("content"), list):
            m["content"] = text
        out.append(m)
    return out
