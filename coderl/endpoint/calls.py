"""The harness's tools and tool-call formats on the served side (``coderl serve``, the held-out
evaluator).

A served conversation is rendered and its reply parsed exactly as the agent harness does it
(:mod:`coderl.agent`), so a model trained in one call format is served in that format and a
served call is valid iff the harness would execute it:

- **Tools** are the harness's (:data:`coderl.agent.tools.TOOLS`): a request names them in
  OpenAI's ``tools`` list; the schema shown to the model and the strict argument validator are
  the harness's (a request whose ``parameters`` differ from them is refused, since its client
  expects other arguments). ``GET /v1/tools`` lists them.
- **Prompt**: :class:`coderl.agent.context.ChatRenderer` decides, as in training, whether the
  chat template shows the tools itself or the system prompt carries the format's tool section
  (``CallFormat.instructions``); the client's system message plays the harness's
  ``instructions``. Earlier assistant turns with ``tool_calls`` are written back as the format's
  call text.
- **Reply**: the text the harness would see (the final stop token dropped, special tokens kept)
  is parsed by the format's parser (``CALL_FORMATS``) and every call goes through
  :func:`coderl.agent.parsing.validate`: one broken call makes the turn ``invalid``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from coderl.agent.context import ChatRenderer
from coderl.agent.episode import EpisodeConfig
from coderl.agent.parsing import BrokenCall, ToolCall, get_call_format, validate
from coderl.agent.tools import TOOLS, Tool
from coderl.policy.episode import render

Message = dict[str, Any]


def harness_format(cfg: Any) -> tuple[str, bool]:
    """``(call_format, template_tools)`` to serve a run's policy in: ``online.serve.call_format``
    if set, else the run's harness settings (``tasks.options.episode``), else the harness
    defaults (:class:`coderl.agent.EpisodeConfig`).

    Args:
        cfg: a :class:`coderl.config.Config`.
    """
    episode = cfg.tasks.options.get("episode", {})
    call_format = (
        cfg.online.serve.call_format or episode.get("call_format") or EpisodeConfig.call_format
    )
    return call_format, bool(episode.get("template_tools", EpisodeConfig.template_tools))


class RequestError(ValueError):
    """A request that cannot be served as the harness would (the message says why;
    ``param``: the request field at fault, when one is)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextFullError(RequestError):
    """A request whose prompt leaves the model no room to sample (it fills the context)."""


def function_entries(request_tools: Sequence[Any] | None) -> list[tuple[Any, dict[str, Any]]]:
    """``(name, function)`` of each entry of a request's ``tools`` (the name unchecked).

    Raises:
        RequestError: an entry that is not ``{"type": "function", "function": {...}}``.
    """
    out = []
    for t in request_tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError('each tool must be {"type": "function", "function": {...}}')
        out.append((fn.get("name"), fn))
    return out


def served_tools(
    request_tools: Sequence[Any] | None, registry: Mapping[str, Tool] = TOOLS
) -> dict[str, Tool]:
    """The harness tools a request offers, by name, in the request's order.

    Raises:
        RequestError: an entry that is not ``{"type": "function", "function": {"name": ...}}``,
            a name that is not a harness tool (the message lists them), or ``parameters`` that
            differ from the harness's schema.
    """
    out: dict[str, Tool] = {}
    for name, fn in function_entries(request_tools):
        if not isinstance(name, str) or name not in registry:
            raise RequestError(
                f"unknown tool {name!r}: coderl serve offers the harness's tools "
                f"{sorted(registry)} (GET /v1/tools lists their schemas)"
            )
        want = registry[name].schema["function"]["parameters"]
        if "parameters" in fn and fn["parameters"] != want:
            raise RequestError(
                f"tool {name!r}: parameters differ from the harness's schema {json.dumps(want)}"
            )
        out[name] = registry[name]
    return out


def _as_text(message: Message, call_format: str) -> Message:
    """An OpenAI assistant message with ``tool_calls`` -> one whose content holds the calls in
    the format's text (what the model would have written)."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    fmt = get_call_format(call_format)
    try:
        texts = [fmt.format_call(c["function"]["name"], _arguments(c)) for c in calls]
    except (KeyError, TypeError, RecursionError, json.JSONDecodeError) as e:
        raise RequestError(f"an assistant message has a malformed tool call ({e})") from None
    head = message.get("content") or ""
    rest = {k: v for k, v in message.items() if k not in ("tool_calls", "content")}
    return {**rest, "content": "\n".join([head, *texts]) if head else "\n".join(texts)}


def _arguments(call: Any) -> dict[str, Any]:
    """A tool call's ``function.arguments``: JSON text of an object. Raises KeyError, TypeError
    (not an object), json.JSONDecodeError, RecursionError (nested past the decoder's limit)."""
    args = json.loads(call["function"]["arguments"])
    if not isinstance(args, dict):
        raise TypeError(f"arguments must be a JSON object, got {type(args).__name__}")
    return args


def renderer_for(
    tokenizer: Any,
    messages: Sequence[Message],
    tools: Mapping[str, Tool],
    *,
    call_format: str,
    template_tools: bool,
) -> ChatRenderer:
    """The harness's renderer for a served conversation (its system message, if any, is the
    ``instructions``).

    Raises:
        RequestError: the system message's content is not a string.
        KeyError: unknown call format (lists the valid ones).
        coderl.agent.context.TemplateError: the chat template cannot be used.
    """
    system = messages[0].get("content") if messages and messages[0].get("role") == "system" else ""
    if not isinstance(system, str):
        raise RequestError("the system message's content must be a string")
    return ChatRenderer(tokenizer, tools, get_call_format(call_format), system, template_tools)


def render_prompt(
    renderer: ChatRenderer,
    messages: Sequence[Message],
    *,
    call_format: str,
    add_generation_prompt: bool = True,
) -> str:
    """The generation prompt the harness would render for ``messages`` with ``renderer``'s
    tools: the format's tool section in the system prompt unless the template shows them
    (without the generation prompt when ``add_generation_prompt`` is False).

    Raises:
        RequestError: a malformed earlier tool call.
    """
    msgs = [_as_text(m, call_format) for m in messages]
    if renderer.tools and not renderer.native_tools:
        head = {"role": "system", "content": renderer.system_prompt().lstrip()}
        msgs = [head, *(msgs[1:] if msgs and msgs[0].get("role") == "system" else msgs)]
    return render(
        renderer.tokenizer,
        msgs,
        tools=renderer.tool_schemas() if renderer.tools else None,
        add_generation_prompt=add_generation_prompt,
    )


def parse_reply(
    text: str, tools: Mapping[str, Tool], call_format: str
) -> tuple[str | None, list[dict[str, Any]], str]:
    """The harness's reading of a reply: ``(content, openai_tool_calls, status)``.

    ``status`` is ``none`` (no call), ``valid`` (every call passes
    :func:`coderl.agent.parsing.validate` against ``tools``, i.e. the harness would execute
    it) or ``invalid`` (a call is malformed, names a tool not offered, or has missing, unknown
    or wrongly typed arguments); an invalid reply keeps its whole raw text as content and
    returns no call. ``content`` is the text without the calls (None when nothing is left).

    Raises:
        KeyError: unknown call format (lists the valid ones).
    """
    try:
        parsed = get_call_format(call_format).parse(text, tools)
    except RecursionError:  # JSON nested past the parser's limit: not a call anyone can run
        return text, [], "invalid"
    if not parsed:
        return text, [], "none"
    checked = [validate(p, tools) for p in parsed]
    if any(isinstance(c, BrokenCall) for c in checked):
        return text, [], "invalid"
    calls, content = [], text
    for p in parsed:
        assert isinstance(p, ToolCall)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:16]}",
                "type": "function",
                "function": {"name": p.name, "arguments": json.dumps(p.arguments)},
            }
        )
        content = content.replace(p.text, "", 1)
    return content.strip() or None, calls, "valid"
