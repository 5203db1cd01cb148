"""Tool-call formats: how calls are written in an assistant message, parsed back, and explained.

A :class:`CallFormat` bundles three functions that must agree: ``parse`` (assistant text ->
calls, in order), ``format_call`` (a call -> the text a model should write; used by scripted
policies and tool-format demonstrations) and ``instructions`` (the system-prompt section that
lists the tools and shows the format, for chat templates that ignore ``tools=``).
``CALL_FORMATS`` is the only place where a format name selects an implementation.

Parsing is strict: anything that looks like a call but is not a well-formed one becomes a
:class:`BrokenCall` with a message saying what is wrong; nothing is silently dropped.

Formats:

- ``hermes`` (default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, as
  in the Hermes function-calling format used by Qwen2.5, SmolLM2 and similar chat templates.
- ``xml``: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``
  (the layout of Qwen3-Coder's template). Values are raw text, so code needs no JSON escaping;
  non-string parameters are read as JSON according to the tool's schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pydantic

from coderl.config.online import CALL_FORMAT_NAMES

if TYPE_CHECKING:  # the tools build their schemas with transformers (and torch) at import
    from coderl.agent.tools import Tool


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call (its arguments are not validated against the tool yet)."""

    name: str
    arguments: dict[str, Any]
    text: str
    """The call's text as written in the message."""


@dataclass(frozen=True)
class BrokenCall:
    """Text that was meant as a call but cannot be run; ``error`` says why, for the model."""

    text: str
    error: str


ParsedCall = ToolCall | BrokenCall

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
MAX_ARGUMENT_DEPTH = 16
"""Deepest nesting of lists and objects inside a call's arguments; deeper is a broken call. No
tool takes nested values, and what reads the tool log later (hack detectors, reports) recurses:
arguments nested just under the JSON parser's limit would crash them there instead."""


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether parsed JSON ``value`` nests lists/objects more than ``limit`` levels deep (a
    top-level container is level 1). Iterative: never recurses, stops at the first container
    past the limit. Shared by the call parser and the online event limits."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _too_deep(arguments: Any) -> bool:
    """Arguments nested more than ``MAX_ARGUMENT_DEPTH`` levels below the arguments object."""
    return nesting_exceeds(arguments, MAX_ARGUMENT_DEPTH + 1)


def _blocks(text: str) -> list[tuple[str, str | None, int]]:
    """Split ``text`` into ``<tool_call>`` blocks: ``(block text, error or None, end)`` in order,
    ``end`` the character offset in ``text`` right after the block (after its ``</tool_call>``,
    or where the next block or the text begins or ends for an unclosed one)."""
    out: list[tuple[str, str | None, int]] = []
    open_at: int | None = None
    for m in re.finditer(r"</?tool_call>", text):
        if m.group() == _OPEN:
            if open_at is not None:
                error = f"{_OPEN} block not closed by {_CLOSE}"
                out.append((text[open_at : m.start()], error, m.start()))
            open_at = m.end()
        elif open_at is None:
            out.append((m.group(), f"{_CLOSE} without a matching {_OPEN}", m.end()))
        else:
            out.append((text[open_at : m.start()], None, m.end()))
            open_at = None
    if open_at is not None:
        out.append((text[open_at:], f"{_OPEN} block not closed by {_CLOSE}", len(text)))
    return out


def call_ends(text: str) -> list[int]:
    """The character offset in ``text`` right after each call that a format's ``parse`` finds
    there, in the same order (every format in ``CALL_FORMATS`` parses one call per block)."""
    return [end for _, _, end in _blocks(text)]


def printable(text: str) -> str:
    """``text`` with every lone surrogate written as a ``\\udXXX`` escape.

    Arguments parsed from a model's JSON may hold lone surrogates (``"\\ud800"`` is valid JSON);
    echoed into an observation, hashed by a learned reward term or rendered for a judge they
    would make an encoder raise, and the sample end as a mask. The escape shows the model
    what it wrote.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _not_text(arguments: dict[str, Any]) -> bool:
    """Whether a key or string of ``arguments`` (nested at most ``MAX_ARGUMENT_DEPTH`` levels:
    the parsers check that first) holds a lone surrogate: valid JSON, but no UTF-8 text. Such a
    call is broken (the policy's, scored): it never becomes a call whose name or arguments a
    tool, a log or a reward term would fail to encode, which would mask the sample."""
    try:
        json.dumps(arguments, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


NOT_TEXT = "a key or value holds a lone surrogate (\\udXXX): not UTF-8 text"
"""The error a call with such arguments gets."""


def parse_hermes(text: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
    """Parse Hermes ``<tool_call>{json}</tool_call>`` blocks; the JSON must be exactly
    ``{"name": str, "arguments": object}``."""
    calls: list[ParsedCall] = []
    for body, error, _ in _blocks(text):
        raw = f"{_OPEN}{body}{_CLOSE}" if error is None else body
        if error is not None:
            calls.append(BrokenCall(raw, error))
            continue
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:  # also: nesting or an int past the limits
            calls.append(BrokenCall(raw, f"the tool call is not valid JSON ({e})"))
            continue
        if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            calls.append(
                BrokenCall(raw, f'expected {{"name": ..., "arguments": {{...}}}}, got {got}')
            )
        elif not isinstance(obj["name"], str) or not isinstance(obj["arguments"], dict):
            calls.append(BrokenCall(raw, '"name" must be a string and "arguments" an object'))
        elif _too_deep(obj["arguments"]):
            calls.append(BrokenCall(raw, f"arguments nested over {MAX_ARGUMENT_DEPTH} levels"))
        elif _not_text(obj["arguments"]):
            calls.append(BrokenCall(raw, NOT_TEXT))
        else:  # a name with a lone surrogate is no tool's: escaped, it is reported as unknown
            calls.append(ToolCall(printable(obj["name"]), obj["arguments"], raw))
    return calls


def format_hermes(name: str, arguments: Mapping[str, Any]) -> str:
    return f"{_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{_CLOSE}"


_SUBMIT = " Call submit when the task is done."
"""Said only when the tools hold ``submit`` (a served program's own tools need not)."""


def _tool_lines(tools: Mapping[str, Tool]) -> str:
    return "\n".join(json.dumps(t.schema) for t in tools.values())


def instructions_hermes(tools: Mapping[str, Tool]) -> str:
    return (
        "# Tools\n\nYou can call these tools, described by JSON schemas:\n<tools>\n"
        f"{_tool_lines(tools)}\n</tools>\n\n"
        "To call a tool, write a JSON object with its name and arguments between <tool_call> "
        "and </tool_call> tags:\n<tool_call>\n"
        '{"name": "<tool name>", "arguments": {"<argument>": <value>}}\n</tool_call>\n'
        "You may make several calls in one message; each result comes back in a message from "
        f"the tool role.{_SUBMIT if 'submit' in tools else ''}"
    )


_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*)</function>\s*$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


def _xml_value(raw: str, kind: str | None) -> Any:
    value = raw.removeprefix("\n").removesuffix("\n")
    return value if kind in (None, "string") else json.loads(value)


def parse_xml(text: str, tools: Mapping[str, Tool]) -> list[ParsedCall]:
    """Parse ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``;
    one newline right after ``<parameter=KEY>`` and right before ``</parameter>`` is not part of
    the value."""
    calls: list[ParsedCall] = []
    for body, error, _ in _blocks(text):
        raw = f"{_OPEN}{body}{_CLOSE}" if error is None else body
        fn = None if error else _FUNCTION.match(body)
        if fn is None:
            calls.append(BrokenCall(raw, error or "expected <function=NAME>...</function>"))
            continue
        name, inner = fn.group(1), fn.group(2)
        props = tools[name].schema["function"]["parameters"]["properties"] if name in tools else {}
        leftover = _PARAMETER.sub("", inner).strip()
        if leftover:
            calls.append(BrokenCall(raw, f"text outside <parameter> tags: {leftover[:80]!r}"))
            continue
        args: dict[str, Any] = {}
        try:
            for key, value in _PARAMETER.findall(inner):
                args[key] = _xml_value(value, props.get(key, {}).get("type"))
        except (ValueError, RecursionError) as e:  # nesting or an int past the limits too
            calls.append(BrokenCall(raw, f"parameter '{key}' is not a valid JSON value ({e})"))
            continue
        if _too_deep(args):
            calls.append(BrokenCall(raw, f"arguments nested over {MAX_ARGUMENT_DEPTH} levels"))
            continue
        if _not_text(args):
            calls.append(BrokenCall(raw, NOT_TEXT))
            continue
        calls.append(ToolCall(name, args, raw))
    return calls


def format_xml(name: str, arguments: Mapping[str, Any]) -> str:
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"{_OPEN}\n<function={name}>\n{params}</function>\n{_CLOSE}"


def instructions_xml(tools: Mapping[str, Tool]) -> str:
    return (
        "# Tools\n\nYou can call these tools, described by JSON schemas:\n<tools>\n"
        f"{_tool_lines(tools)}\n</tools>\n\n"
        "To call a tool, write:\n<tool_call>\n<function=<tool name>>\n"
        "<parameter=<argument>>\n<value, as plain text>\n</parameter>\n</function>\n</tool_call>\n"
        "You may make several calls in one message; each result comes back in a message from "
        f"the tool role.{_SUBMIT if 'submit' in tools else ''}"
    )


@dataclass(frozen=True)
class CallFormat:
    """One tool-call format; the functions must agree with each other."""

    parse: Callable[[str, Mapping[str, Tool]], list[ParsedCall]]
    format_call: Callable[[str, Mapping[str, Any]], str]
    instructions: Callable[[Mapping[str, Tool]], str]
    ends: Callable[[str], list[int]] = call_ends
    """Text -> the character offset right after each call ``parse`` returns, in its order."""


CALL_FORMATS: dict[str, CallFormat] = {
    "hermes": CallFormat(parse_hermes, format_hermes, instructions_hermes),
    "xml": CallFormat(parse_xml, format_xml, instructions_xml),
}
"""Format name -> format; the only dispatch point for tool-call formats."""
if set(CALL_FORMATS) != set(CALL_FORMAT_NAMES):  # the config's names and these formats agree
    raise ImportError(f"CALL_FORMATS {sorted(CALL_FORMATS)} != {sorted(CALL_FORMAT_NAMES)}")


def get_call_format(name: str) -> CallFormat:
    """Raises: KeyError listing the valid names when ``name`` is unknown."""
    if name not in CALL_FORMATS:
        raise KeyError(f"unknown tool-call format {name!r}; valid: {sorted(CALL_FORMATS)}")
    return CALL_FORMATS[name]


@dataclass(frozen=True)
class ValidCall:
    """A call whose tool exists and whose arguments passed the tool's strict validator."""

    tool: Tool
    arguments: dict[str, Any]
    text: str


def validate(call: ParsedCall, tools: Mapping[str, Tool]) -> ValidCall | BrokenCall:
    """Check a parsed call against the episode's tools: the tool must exist and the arguments
    must match its signature exactly (no missing, unknown or wrongly typed arguments)."""
    if isinstance(call, BrokenCall):
        return call
    tool = tools.get(call.name)
    if tool is None:
        return BrokenCall(call.text, f"unknown tool {call.name!r}; available: {list(tools)}")
    try:
        args = tool.arguments.model_validate(call.arguments)
    except pydantic.ValidationError as e:
        from coderl.agent.tools import format_validation_error

        return BrokenCall(call.text, format_validation_error(tool.name, e))
    return ValidCall(tool, dict(args), call.text)
