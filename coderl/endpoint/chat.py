"""The OpenAI chat-completions surface, in one place: what ``coderl serve`` and the gateway
(:mod:`coderl.envs.gateway`) accept, how a request becomes the exact prompt ids the policy samples
from, what is sent back (a JSON body or a server-sent-event stream), and how an episode's
recorded calls become its trajectory (:func:`trajectory_of`).

What a request may carry (honoured fields, fields accepted at a neutral value, refusals) is
:mod:`coderl.endpoint.request`; message roles are OpenAI's (``developer`` rendered as
``system``), content a string or text parts. ``tool_choice`` ``"required"`` or a named
function is refused: constraining the sample would make the recorded behaviour logprobs those
of another distribution.

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
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from coderl.agent.parsing import get_call_format
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
from coderl.endpoint.request import (
    ChatRequest,
    flat_messages,
    offers_tools,
    parse_request,
    stop_strings,
)
from coderl.policy.base import Completion, SamplingParams
from coderl.policy.episode import TEMPLATE_FAULTS, encode
from coderl.trajectory import Segment, Trajectory


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


def _cut(
    tokenizer: Any, out: Completion, end: Callable[[str], int | None]
) -> tuple[Completion, str] | None:
    """``out`` cut after its first token ``k`` whose decoded prefix ``head`` has ``end(head)``
    not None, with ``head[:end(head)]``; None when no prefix has. A prefix of an
    autoregressive sample is a sample: it is what is recorded and trained."""
    for k in range(1, len(out.token_ids) + 1):
        head = str(tokenizer.decode(out.token_ids[:k], skip_special_tokens=False))
        if (n := end(head)) is not None:
            versions = out.token_versions[:k] if out.token_versions else []
            cut = Completion(
                out.token_ids[:k], out.logprobs[:k], "stop", out.policy_version, versions
            )
            return cut, head[:n]
    return None


def cut_at_stop(
    tokenizer: Any, out: Completion, text: str, stops: list[str]
) -> tuple[Completion, str]:
    """``(completion, text)`` cut after the first sampled token whose text completes one of
    ``stops`` (the returned text ends before the stop string); unchanged when none occurs."""
    if not stops or not any(s in text for s in stops):
        return out, text

    def before_stop(head: str) -> int | None:
        return min((head.index(s) for s in stops if s in head), default=None)

    return _cut(tokenizer, out, before_stop) or (out, text)


def cut_after_first_call(
    tokenizer: Any, out: Completion, text: str, tools: Mapping[str, Tool], call_format: str
) -> tuple[Completion, str]:
    """``(completion, text)`` cut after the first sampled token whose text holds the reply's
    first tool call whole (``parallel_tool_calls: false``: at most one call, as OpenAI and vLLM
    answer it); unchanged when the reply holds fewer than two calls."""
    parsed = get_call_format(call_format).parse(text, tools)
    if len(parsed) < 2:
        return out, text
    n = text.index(parsed[0].text) + len(parsed[0].text)

    def after_first_call(head: str) -> int | None:
        return n if head[:n] == text[:n] else None

    return _cut(tokenizer, out, after_first_call) or (out, text)


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
    except TEMPLATE_FAULTS as e:  # the template rejects the client's conversation: bad input
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
    if req.parallel_tool_calls is False and len(calls) > 1:
        out, text = cut_after_first_call(tokenizer, out, text, tools, call_format)
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
        req = parse_request(await request.body())
    except RequestError as e:
        return error_response(400, str(e), param=e.param)
    try:
        body = await run_in_threadpool(complete, req)
    except HTTPException as e:
        return error_response(e.status_code, str(e.detail), param=getattr(e, "param", None))
    headers = {"X-Interaction-Id": body["id"]}
    if not req.stream:
        return JSONResponse(body, headers=headers)
    usage = bool(req.stream_options and req.stream_options.include_usage)
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
