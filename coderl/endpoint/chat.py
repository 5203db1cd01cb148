"""The OpenAI chat-completions surface, in one place: what ``coderl serve`` and the gateway
(:mod:`coderl.envs.gateway`) accept, how a request becomes the exact prompt ids the policy samples
from, what is sent back (a JSON body or a server-sent-event stream), and how an episode's
recorded calls become its trajectory (:func:`trajectory_of`).

Supported request fields (:data:`SUPPORTED_FIELDS`; any other is refused with HTTP 400 naming
it and listing these): ``model`` (``coderl serve``: a served name, else 404; the gateway: any name, recorded), ``messages`` (``content`` a string,
null, or a list of ``{"type": "text", "text": ...}`` parts), ``tools``, ``tool_choice``
(``"auto"`` or ``"none"``), ``temperature``, ``top_p``, ``max_tokens`` /
``max_completion_tokens``, ``stop`` (up to 4 strings), ``seed``, ``logprobs``, ``n`` (1),
``stream`` and ``stream_options.include_usage``, ``user``, and coderl's own ``episode_id``,
``population``, ``is_summary``, ``return_token_ids``.
Message roles: ``system``, ``developer`` (rendered as ``system``), ``user``, ``assistant``,
``tool``; any other (or none) is refused with a 400, as OpenAI refuses it.

Refused with a reason: ``tool_choice`` ``"required"`` or a named function (constraining the
sample would make the recorded behaviour logprobs those of another distribution), content parts
other than text (images, audio), ``n > 1``, ``top_logprobs > 0``, ``presence_penalty``,
``frequency_penalty``, ``logit_bias``, ``response_format`` and every other field.

Recording is token-exact: the prompt ids are the chat template's rendering of the messages,
encoded once; the completion is the sampled ids and their behaviour logprobs. A ``stop`` string
cuts the completion after the first token whose text completes it: what is recorded and
trained is that prefix of the sample (a prefix of an autoregressive sample is a sample), and
the returned text ends before the stop string. A stream is sent after the whole completion is
sampled (one content delta, then the tool calls, the finish reason and usage): it carries the
same recording as the non-streamed reply, not token-by-token latency.

Token in, token out (:mod:`coderl.endpoint.continuation`): a call that carries the episode's
previous call and its reply unchanged, then new turns, is sampled from the previous prompt, the
sampled ids and the template's delta, never from a re-tokenization of the model's own text.

Segments (:func:`trajectory_of`): a call whose prompt ids start with the previous call's prompt
plus completion continues that context window (the prompt's new tail is context, loss mask 0);
any other call (the client rewrote, summarised or truncated its history, or its re-rendered
history tokenizes differently from what was sampled) starts a new segment, and is counted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pydantic
from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from coderl.agent.tools import Tool
from coderl.endpoint.calls import (
    ContextFullError,
    RequestError,
    function_entries,
    parse_reply,
    render_prompt,
    renderer_for,
)
from coderl.endpoint.continuation import Turn, continued_prompt
from coderl.endpoint.errors import error_response
from coderl.policy.base import Completion, SamplingParams
from coderl.policy.episode import encode
from coderl.trajectory import Segment, Trajectory


class ChatRequest(BaseModel):
    """The subset of OpenAI's chat-completions request that is supported; others are errors."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    episode_id: str | None = Field(default=None, max_length=128)
    population: str | None = Field(default=None, max_length=128)
    is_summary: bool = False
    return_token_ids: bool = False
    """Also return the sampled token ids (``choices[0].token_ids``, as vLLM's extension names
    them) and the prompt's (``prompt_token_ids``): what a token-exact client harness continues
    from (:mod:`coderl.online.agent_client`)."""


SUPPORTED_FIELDS = tuple(ChatRequest.model_fields)
"""Every request field that is accepted (the others are refused with a 400 listing these)."""


def request_error(e: pydantic.ValidationError) -> tuple[str, str | None]:
    """``(message, param)`` of a request that failed validation: one line naming each bad field
    (the body itself when it is not a JSON object), and for a field that is not supported at
    all, the list of the supported ones; ``param`` the first bad field (None: the body)."""
    parts, unknown, fields = [], False, []
    for x in e.errors():
        where = ".".join(str(p) for p in x["loc"])
        fields.append(where)
        if x["type"] == "json_invalid":
            parts.append(f"the request body is not valid JSON ({x['msg']})")
        elif not where:
            parts.append(f"the request body must be a JSON object ({x['msg']})")
        elif x["type"] == "extra_forbidden":
            unknown = True
            parts.append(f"{where}: not supported by coderl")
        else:
            parts.append(f"{where}: {x['msg']}")
    if unknown:
        parts.append(f"supported fields: {', '.join(SUPPORTED_FIELDS)}")
    return "; ".join(parts), (fields[0] or None) if fields else None


def stop_strings(req: ChatRequest) -> list[str]:
    """The request's ``stop`` as a list (at most 4 non-empty strings).

    Raises:
        RequestError: more than 4, or an empty string.
    """
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise RequestError("stop: at most 4 non-empty strings", param="stop")
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
        f"tool_choice {json.dumps(req.tool_choice)} is not supported: coderl records the "
        "policy's samples as drawn, so it cannot force a call; supported: 'auto', 'none'",
        param="tool_choice",
    )


ROLES = ("system", "developer", "user", "assistant", "tool")
"""The message roles accepted (OpenAI's; ``developer`` is rendered as ``system``)."""


def flat_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with list-of-parts contents joined into one string (text parts only) and
    the ``developer`` role (OpenAI's newer name for ``system``) as ``system``, the role chat
    templates know.

    Raises:
        RequestError: a message that is not an object, a role not in :data:`ROLES`, or a
            content part that is not text.
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
        if role == "developer":
            m = {**m, "role": "system"}
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(
                        f"messages.{i}.content: part of type {kind!r} is not supported; "
                        "supported: a string or {'type': 'text', 'text': ...} parts",
                        param=f"messages.{i}.content",
                    )
                texts.append(part["text"])
            m = {**m, "content": "".join(texts)}
        out.append(m)
    return out


class _AnyArguments(BaseModel):
    model_config = ConfigDict(extra="allow")


def _not_run_here(*_: Any, **__: Any) -> str:
    raise RuntimeError("a client's tool runs in the client, not in coderl")


def client_tools(request_tools: Sequence[Any] | None) -> dict[str, Tool]:
    """The client's own tools (an agent program's), by name, for rendering and parsing: the
    schema is shown as given; a call is valid when it names an offered tool with an object of
    arguments (the program validates the arguments itself).

    Raises:
        RequestError: an entry that is not ``{"type": "function", "function": {"name": ...}}``,
            or a name given twice.
    """
    out: dict[str, Tool] = {}
    for name, fn in function_entries(request_tools):
        if not isinstance(name, str) or not name or name in out:
            raise RequestError(
                f"tools: a missing or repeated function name {name!r}", param="tools"
            )
        out[name] = Tool(name, _not_run_here, {"type": "function", "function": fn}, _AnyArguments)
    return out


@dataclass
class Sampled:
    """One answered call, as recorded: the exact prompt, the completion (cut at a ``stop``
    string), and the client's view of it."""

    prompt_ids: list[int]
    completion: Completion
    text: str
    """The completion's text without a final stop token (what the call format parses)."""
    content: str | None
    calls: list[dict[str, Any]]
    """OpenAI ``tool_calls`` (empty when none, or when a call was invalid)."""
    status: str
    """``none``, ``valid`` or ``invalid`` (:func:`coderl.endpoint.calls.parse_reply`)."""
    params: SamplingParams
    turn: Turn
    """What the episode's next call may continue (:mod:`coderl.endpoint.continuation`)."""


def cut_at_stop(
    tokenizer: Any, out: Completion, text: str, stops: list[str]
) -> tuple[Completion, str]:
    """``(completion, text)`` cut after the first sampled token whose text completes one of
    ``stops`` (the returned text ends before the stop string); unchanged when none occurs."""
    if not stops or not any(s in text for s in stops):
        return out, text
    for k in range(1, len(out.token_ids) + 1):
        head = str(tokenizer.decode(out.token_ids[:k], skip_special_tokens=False))
        hits = [head.index(s) for s in stops if s in head]
        if hits:
            cut = Completion(
                out.token_ids[:k],
                out.logprobs[:k],
                "stop",
                out.policy_version,
                out.token_versions[:k] if out.token_versions else [],
            )
            return cut, head[: min(hits)]
    return out, text


def sample_chat(
    req: ChatRequest,
    tokenizer: Any,
    tools: Mapping[str, Tool],
    generate: Callable[[list[int], SamplingParams], Completion],
    *,
    temperature: float,
    max_new_tokens: int,
    context: int | None,
    call_format: str,
    template_tools: bool,
    previous: Turn | None = None,
) -> Sampled:
    """Render ``req`` as the harness renders it, sample once through ``generate`` and read the
    reply: the one path of ``coderl serve`` and the gateway. A call that carries ``previous``
    (the episode's last call) and its reply unchanged continues from its exact ids
    (:func:`coderl.endpoint.continuation.continued_prompt`); any other is rendered whole.

    Args:
        tools: what the model is shown and its calls are checked against (the harness's tools
            for ``coderl serve``, :func:`client_tools` for the gateway); ignored when
            ``tool_choice`` is ``"none"``.
        context: tokens of prompt plus completion the model holds (None: unknown).

    Raises:
        RequestError: bad content parts, ``stop`` or ``tool_choice``, a conversation the
            template cannot render, or a prompt that fills the context.
        whatever ``generate`` raises (an engine failure).
    """
    stops = stop_strings(req)
    tools = tools if offers_tools(req) else {}
    messages = flat_messages(req.messages)
    try:
        renderer = renderer_for(
            tokenizer, messages, tools, call_format=call_format, template_tools=template_tools
        )
        shown = [t.schema for t in tools.values()]
        prompt = continued_prompt(
            previous, messages, shown, renderer, call_format=call_format
        ) or encode(tokenizer, render_prompt(renderer, messages, call_format=call_format))
    except RequestError:
        raise
    except Exception as e:  # template errors are the client's bad input
        raise RequestError(f"cannot render the conversation: {e}") from None
    room = max_new_tokens if context is None else context - len(prompt)
    if room <= 0:
        raise ContextFullError(
            f"prompt of {len(prompt)} tokens leaves no room to sample: the model's context is "
            f"{context} tokens (prompt plus completion)"
        )
    budget = req.max_completion_tokens or req.max_tokens or max_new_tokens
    params = SamplingParams(
        temperature=temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_new_tokens=min(budget, max_new_tokens, room),
        stop_token_ids=renderer.stop_token_ids,
        seed=req.seed,
    )
    sampled = generate(prompt, params)
    out, text = cut_at_stop(tokenizer, sampled, renderer.content(sampled), stops)
    content, calls, status = parse_reply(text, tools, call_format)
    turn = Turn(messages, shown, prompt, out, content, calls, whole=out is sampled)
    return Sampled(prompt, out, text, content, calls, status, params, turn)


def response_body(
    iid: str, model: str, created: int, s: Sampled, tokenizer: Any, *, logprobs: bool
) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` body of one sampled call."""
    message: dict[str, Any] = {"role": "assistant", "content": s.content}
    if s.calls:
        message["tool_calls"] = s.calls
    out = s.completion
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if s.calls else out.finish_reason,
        "logprobs": None,
    }
    if logprobs:
        choice["logprobs"] = {
            "content": [
                {
                    "token": (t := tokenizer.decode([i])),
                    "logprob": lp,
                    "bytes": list(t.encode()),
                    "top_logprobs": [],
                }
                for i, lp in zip(out.token_ids, out.logprobs, strict=True)
            ]
        }
    n_prompt, n_out = len(s.prompt_ids), len(out.token_ids)
    return {
        "id": iid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": n_prompt,
            "completion_tokens": n_out,
            "total_tokens": n_prompt + n_out,
        },
    }


def stream_events(body: dict[str, Any], *, include_usage: bool) -> Iterator[str]:
    """The server-sent events of a ``chat.completion.chunk`` stream carrying ``body`` (the
    non-streamed reply of the same call), ending with ``data: [DONE]``."""
    choice = body["choices"][0]
    message = choice["message"]
    head = {k: body[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    extra = {k: body[k] for k in body if k not in (*head, "object", "choices", "usage")}

    def chunk(delta: dict[str, Any], finish: str | None = None, **more: Any) -> str:
        c = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": more.get("lp")}
        return f"data: {json.dumps(head | extra | {'choices': [c]})}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]}, lp=choice.get("logprobs"))
    elif choice.get("logprobs"):
        yield chunk({}, lp=choice["logprobs"])
    if message.get("tool_calls"):
        calls = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
        yield chunk({"tool_calls": calls})
    yield chunk({}, choice["finish_reason"])
    if include_usage:
        yield f"data: {json.dumps(head | {'choices': [], 'usage': body['usage']})}\n\n"
    yield "data: [DONE]\n\n"


@dataclass
class Call:
    """One recorded model call of an episode: the exact prompt and what was sampled."""

    prompt_ids: list[int]
    completion: Completion
    provenance: dict[str, Any] = field(default_factory=dict)


def trajectory_of(calls: Sequence[Call]) -> tuple[Trajectory, int]:
    """An episode's trajectory from its calls in order, and how many calls started a new segment
    although an earlier one existed (history rewritten, summarised, truncated or re-tokenised
    differently from what was sampled).

    A call continues the current segment iff its prompt ids start with the segment's ids (the
    previous prompt plus its completion); the new tail is appended as context (loss mask 0) and
    the completion as sampled tokens (behaviour logprobs and versions kept).
    """
    traj, breaks = Trajectory(), 0
    for c in calls:
        seg = traj.segments[-1] if traj.segments else None
        if seg is not None and c.prompt_ids[: len(seg.token_ids)] == seg.token_ids:
            seg.append_context(c.prompt_ids[len(seg.token_ids) :], kind="observation")
        else:
            breaks += seg is not None
            seg = Segment(provenance={"segment": len(traj.segments)})
            seg.append_context(c.prompt_ids, kind="prompt")
            traj.segments.append(seg)
        seg.append_sampled(c.completion.token_ids, c.completion.logprobs, c.completion.versions())
        seg.provenance.setdefault("actions", []).append(
            {
                "finish_reason": c.completion.finish_reason,
                "version": c.completion.policy_version,
                **c.provenance,
            }
        )
    return traj, breaks


async def chat_endpoint(
    request: Request, complete: Callable[[ChatRequest], dict[str, Any]]
) -> Response:
    """``POST /v1/chat/completions`` of ``coderl serve`` and the gateway: validate the body
    (400 naming every bad or unsupported field), answer it with ``complete`` in a worker thread
    (its ``HTTPException`` becomes an error body) and send the reply as JSON or, with
    ``stream``, as server-sent events (:func:`stream_events`)."""
    try:
        req = ChatRequest.model_validate_json(await request.body())
    except pydantic.ValidationError as e:
        message, param = request_error(e)
        return error_response(400, message, param=param)
    try:
        body = await run_in_threadpool(complete, req)
    except HTTPException as e:
        return error_response(e.status_code, str(e.detail), param=getattr(e, "param", None))
    headers = {"X-Interaction-Id": body["id"]}
    if not req.stream:
        return JSONResponse(body, headers=headers)
    usage = bool((req.stream_options or {}).get("include_usage"))
    events = stream_events(body, include_usage=usage)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def calls_from_rows(rows: Sequence[Mapping[str, Any]]) -> list[Call]:
    """The calls of stored interactions (``coderl serve``'s rows of one episode, oldest
    first), for :func:`trajectory_of`: a served episode and the same calls through the gateway
    give the same trajectory."""
    return [
        Call(
            list(r["prompt_token_ids"]),
            Completion(
                list(r["completion_token_ids"]),
                list(r["behaviour_logprobs"]),
                r.get("finish_reason", "stop"),  # rows made by hand may leave it out
                int(r["policy_version"]),
            ),
            {"status": r.get("tool_call_status"), "interaction_id": r.get("interaction_id")},
        )
        for r in rows
    ]
