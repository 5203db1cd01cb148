"""The agent's tools: typed Python functions whose JSON schemas come from their signatures.

Each tool is a module-level function whose first parameter is the :class:`ToolContext` (the
sandbox and the tool limits) and whose other parameters are what the model passes. The model-facing
JSON schema is generated from the signature and the Google-style docstring by
``transformers.utils.get_json_schema`` (the context parameter is hidden from it), and the same
signature is turned into a strict pydantic model that validates the model's arguments. So the
schema the model is shown and the checks its calls go through cannot drift apart.

``TOOLS`` is the one place where a tool name selects an implementation; ``TOOLSETS`` names the
tool set of each task kind.

Limits: ``run`` and ``search`` are bounded by the sandbox's per-command timeout (per-tool defaults
in :class:`ToolConfig`); the file tools do bounded I/O through the sandbox and have no timeout of
their own (a Python thread cannot be interrupted). Observations are cut head-and-tail past
``ToolConfig.max_observation_chars``.
"""

from __future__ import annotations

import inspect
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic
from transformers.utils.chat_template_utils import get_json_schema

from coderl.sandbox.base import Sandbox, SandboxError


class ToolError(Exception):
    """A tool could not do what was asked; the message is shown to the model as the observation."""


@dataclass
class ToolConfig:
    """Limits and defaults of the built-in tools."""

    timeout_s: dict[str, float] = field(default_factory=lambda: {"run": 60.0, "search": 10.0})
    """Per-tool wall-clock limit (seconds) for the tools that run a command in the sandbox;
    for ``run`` it is the default when the model passes no ``timeout``."""
    max_run_timeout_s: float = 300.0
    """Largest ``timeout`` (seconds) the model may ask ``run`` for; larger requests are capped."""
    search_max_results: int = 50
    """Matching lines shown by ``search``; the rest are counted, not shown."""
    max_read_lines: int | None = None
    """Most lines one ``read_file`` call shows (None: no limit). A longer range, or a whole file
    read without one, shows its first ``max_read_lines`` lines and says how to see the rest, so
    a small model's context holds a window, not a file."""
    max_line_chars: int = 300
    """Longest line shown by ``read_file`` and ``search`` (characters); longer lines are cut."""
    max_observation_chars: int = 8000
    """Observations longer than this (characters) keep their head and tail around a marker."""
    max_observation_tokens: int = 3072
    """The same cap in the policy's tokens (``coderl.agent.context.cap_tokens``), applied by the
    episode loop: characters that cost several tokens each cannot flood the context."""

    def __post_init__(self) -> None:
        if self.max_observation_tokens < 128:
            raise ValueError(
                f"ToolConfig.max_observation_tokens must be >= 128, got {self.max_observation_tokens}"
            )
        if self.max_read_lines is not None and self.max_read_lines < 1:
            raise ValueError(f"ToolConfig.max_read_lines must be >= 1, got {self.max_read_lines}")


@dataclass
class ToolContext:
    """What a tool call may touch: one episode's sandbox, the tool limits, the submit flag."""

    sandbox: Sandbox
    config: ToolConfig = field(default_factory=ToolConfig)
    submitted: bool = False
    """Set by ``submit``; the episode loop ends the episode when it is true."""


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail of ``text`` around a marker when it is over ``max_chars``.

    The head gets half of the budget and the tail the rest; the marker names how many characters
    were left out, so the model knows the output was cut (a test log's verdict is usually at the
    end, its first error near the start).

    Raises:
        ValueError: ``max_chars`` is below 1.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1, got {max_chars}")
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail :]}"


def _cut(line: str, max_chars: int) -> str:
    return line if len(line) <= max_chars else line[:max_chars] + " [line cut]"


def _numbered(lines: Sequence[str], first: int, max_chars: int) -> str:
    return "\n".join(f"{first + i:>6}\t{_cut(line, max_chars)}" for i, line in enumerate(lines))


# ---------------------------------------------------------------------------------------------
# The built-in tools. Their docstrings are what the model reads: keep them short and exact.


def read_file(
    ctx: ToolContext, path: str, start_line: int | None = None, end_line: int | None = None
) -> str:
    """Read a text file from the workspace, with line numbers.

    Args:
        path: File path, relative to the workspace root.
        start_line: First line to show (1-based, inclusive); the file's start when omitted.
        end_line: Last line to show (1-based, inclusive); the file's end when omitted.
    """
    lines = ctx.sandbox.read_text(path).splitlines()
    if not lines:
        return f"{path} is empty."
    first = 1 if start_line is None else start_line
    last = len(lines) if end_line is None else min(end_line, len(lines))
    if first < 1 or first > len(lines) or last < first:
        raise ToolError(
            f"invalid line range {start_line}..{end_line}: {path} has lines 1..{len(lines)}"
        )
    cap = ctx.config.max_read_lines
    more = ""
    if cap is not None and last - first + 1 > cap:
        last = first + cap - 1
        more = (
            f"\n[showing lines {first}..{last} of {len(lines)}; pass start_line and end_line "
            f"to read others, at most {cap} lines at a time]"
        )
    return _numbered(lines[first - 1 : last], first, ctx.config.max_line_chars) + more


def search(ctx: ToolContext, pattern: str, path: str = ".") -> str:
    """Search the workspace for a regular expression (POSIX extended, as in grep -E).

    Args:
        pattern: The regular expression to look for, matched line by line.
        path: File or directory to search in, relative to the workspace root.
    """
    cfg = ctx.config
    cmd = (
        f"grep -rnIE --exclude-dir=.git -e {shlex.quote(pattern)} -- {shlex.quote(path)}"
        " | sort -t: -k1,1 -s"
    )
    res = ctx.sandbox.exec(cmd, timeout=cfg.timeout_s.get("search"))
    if res.timed_out:
        raise ToolError("search timed out; narrow the path or the pattern")
    hits = res.stdout.splitlines()
    if not hits:
        if res.stderr.strip():
            raise ToolError(f"search failed: {res.stderr.strip()}")
        return f"No matches for {pattern!r} in {path}."
    shown = [_cut(h, cfg.max_line_chars) for h in hits[: cfg.search_max_results]]
    more = len(hits) - len(shown)
    if more > 0:
        shown.append(f"[... {more} more matching lines not shown; narrow the search ...]")
    return "\n".join(shown)


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def edit(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace one exact occurrence of a piece of text in a file.

    Args:
        path: File path, relative to the workspace root.
        old: The exact text to replace, whitespace included; it must occur exactly once.
        new: The text to put in its place.
    """
    if not old:
        raise ToolError("old must not be empty; use write_file to create or overwrite a file")
    text = ctx.sandbox.read_text(path)
    starts: list[int] = []
    at = text.find(old)
    while at != -1:
        starts.append(at)
        at = text.find(old, at + len(old))
    if not starts:
        raise ToolError(f"old text not found in {path}; read the file and copy the text exactly")
    if len(starts) > 1:
        where = ", ".join(str(_line_of(text, s)) for s in starts)
        raise ToolError(
            f"old text occurs {len(starts)} times in {path} (starting at lines {where}); "
            "include more surrounding lines so that it is unique. Nothing was changed."
        )
    updated = text[: starts[0]] + new + text[starts[0] + len(old) :]
    ctx.sandbox.write_text(path, updated)
    first = _line_of(updated, starts[0])
    new_lines = updated.splitlines()[first - 1 : first - 1 + max(1, new.count("\n") + 1)]
    return f"Edited {path}. Lines {first}..{first + len(new_lines) - 1} now read:\n" + _numbered(
        new_lines, first, ctx.config.max_line_chars
    )


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create a file, or overwrite it, with the given content.

    Args:
        path: File path, relative to the workspace root.
        content: The complete new content of the file.
    """
    ctx.sandbox.write_text(path, content)
    return f"Wrote {len(content.splitlines())} lines to {path}."


def run(ctx: ToolContext, command: str, timeout: float | None = None) -> str:
    """Run a shell command in the workspace (for example the tests) and show its output.

    Args:
        command: The shell command line, run with bash in the workspace root.
        timeout: Wall-clock limit in seconds; a default applies when omitted.
    """
    cfg = ctx.config
    limit = cfg.timeout_s.get("run", 60.0) if timeout is None else timeout
    if not limit > 0:  # NaN is valid JSON to Python and a float to pydantic
        raise ToolError(f"timeout must be positive, got {timeout}")
    limit = min(limit, cfg.max_run_timeout_s)
    res = ctx.sandbox.exec(command, timeout=limit)
    status = f"exit code {res.exit_code}"
    if res.timed_out:
        status = f"timed out after {limit:g} s ({status})"
    parts = [status]
    if res.stdout:
        parts.append(f"stdout:\n{res.stdout.rstrip()}")
    if res.stderr:
        parts.append(f"stderr:\n{res.stderr.rstrip()}")
    return "\n".join(parts)


def submit(ctx: ToolContext) -> str:
    """Finish the task: the current state of the workspace is submitted for grading."""
    ctx.submitted = True
    return "Submitted."


# ---------------------------------------------------------------------------------------------
# Schemas, argument validation, the registry.


@dataclass(frozen=True)
class Tool:
    """A tool: the function, the JSON schema shown to the model, the validator of its arguments."""

    name: str
    fn: Callable[..., str]
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``, as
    ``get_json_schema`` produces it and chat templates take it (``tools=``)."""
    arguments: type[pydantic.BaseModel]
    """Strict model of the arguments: unknown keys, missing keys and wrong types are errors."""


def make_tool(fn: Callable[..., str]) -> Tool:
    """Wrap a typed function ``fn(ctx: ToolContext, ...) -> str`` into a :class:`Tool`.

    Every parameter after the first needs a type hint and an ``Args:`` entry in the docstring.

    Raises:
        TypeError: ``fn`` has no context parameter.
        transformers.utils.chat_template_utils.DocstringParsingException /
        TypeHintParsingException: a parameter lacks a description or a JSON-able type hint.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params:
        raise TypeError(f"tool {fn.__name__} must take the ToolContext as its first parameter")
    hints = inspect.get_annotations(fn, eval_str=True)
    model_facing = params[1:]

    # get_json_schema reads the signature and the type hints: show it the function without ctx.
    def view() -> None: ...

    view.__name__ = fn.__name__
    view.__doc__ = fn.__doc__
    view.__annotations__ = {p.name: hints[p.name] for p in model_facing if p.name in hints}
    view.__signature__ = sig.replace(parameters=model_facing)  # type: ignore[attr-defined]
    schema = get_json_schema(view)

    fields: dict[str, Any] = {
        p.name: (hints[p.name], ... if p.default is inspect.Parameter.empty else p.default)
        for p in model_facing
    }
    arguments = pydantic.create_model(
        f"{fn.__name__}_arguments",
        __config__=pydantic.ConfigDict(extra="forbid", strict=True),
        **fields,
    )
    return Tool(name=fn.__name__, fn=fn, schema=schema, arguments=arguments)


TOOLS: dict[str, Tool] = {
    fn.__name__: make_tool(fn) for fn in (read_file, search, edit, write_file, run, submit)
}
"""Tool name -> tool; the only dispatch point from a name to an implementation."""

TOOLSETS: dict[str, tuple[str, ...]] = {
    "repo": ("read_file", "search", "edit", "write_file", "run", "submit"),
    "function": ("read_file", "edit", "write_file", "run", "submit"),
}
"""Task kind -> names of the tools its episodes get."""


def resolve_tools(names: Sequence[str], registry: Mapping[str, Tool] = TOOLS) -> dict[str, Tool]:
    """Look the tool ``names`` up in ``registry``, keeping their order.

    Raises:
        KeyError: a name is not in the registry (the message lists the valid ones), or ``submit``
            is missing (an episode could never end by itself).
    """
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise KeyError(f"unknown tools {unknown}; valid tools: {sorted(registry)}")
    if "submit" not in names:
        raise KeyError(f"a tool set must include 'submit'; got {list(names)}")
    return {n: registry[n] for n in names}


def format_validation_error(tool: str, err: pydantic.ValidationError) -> str:
    """One line per problem, in words the model can act on."""
    problems = []
    for e in err.errors():
        where = ".".join(str(x) for x in e["loc"]) or "arguments"
        if e["type"] == "missing":
            problems.append(f"missing required argument '{where}'")
        elif e["type"] == "extra_forbidden":
            problems.append(f"unexpected argument '{where}'")
        else:
            problems.append(f"argument '{where}': {e['msg']}")
    return f"invalid arguments for {tool}: " + "; ".join(problems)


@dataclass
class ToolOutcome:
    """What one executed tool call produced."""

    observation: str
    """The text the model sees (already truncated)."""
    ok: bool
    """False when the tool raised (the observation then starts with ``Error:``)."""
    duration_s: float


def execute(tool: Tool, arguments: Mapping[str, Any], ctx: ToolContext) -> ToolOutcome:
    """Run an already validated call. A tool failure is part of the domain: it becomes an
    ``Error: ...`` observation (with the exception type for unexpected errors, ``SystemExit``
    and other ``BaseException`` included) instead of propagating.

    Raises:
        SandboxError: the sandbox itself failed (it ends the episode with ``error``).
        KeyboardInterrupt: Ctrl-C (the run stops).
    """
    start = time.monotonic()
    try:
        text, ok = tool.fn(ctx, **arguments), True
    except SandboxError:
        raise  # the sandbox itself failed: infrastructure, not something the model did
    except ToolError as e:
        text, ok = f"Error: {e}", False
    except KeyboardInterrupt:
        raise  # Ctrl-C stops the run, whichever thread it reaches
    # anything else (SystemExit, GeneratorExit, a library's own BaseException such as
    # pytest.skip's): a tool (a plugin's too) runs on arguments the policy chose, so what it
    # raises is the agent's outcome, an observation in a scored episode; it never ends the batch
    except BaseException as e:  # noqa: BLE001 - a failing tool is an observation for the model
        text, ok = f"Error: {type(e).__name__}: {e}", False
    limit = ctx.config.max_observation_chars
    return ToolOutcome(truncate_middle(text, limit), ok, time.monotonic() - start)
