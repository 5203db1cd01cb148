"""The agent harness: tools, tool-call parsing, the episode loop, self-summarization.

Entry points: :func:`run_episode` / :func:`run_episodes` (many episodes, batched sampling),
:class:`EpisodeConfig`, :class:`Episode`; tools in ``TOOLS`` / ``TOOLSETS``; tool-call formats
in ``CALL_FORMATS``; :class:`ScriptedPolicy` for tests and demonstrations.

The names load their modules on first use (PEP 562), so that importing one light module of the
package (``coderl.agent.parsing``, as the config's online rewards do) does not import torch
through the chat renderer and the policy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coderl.agent.context import ChatRenderer, TemplateError, template_supports_tools
    from coderl.agent.parsing import CALL_FORMATS, BrokenCall, CallFormat, ToolCall, get_call_format
    from coderl.agent.record import (
        AgentTask,
        Episode,
        EpisodeConfig,
        EpisodeStats,
        SimpleTask,
        ToolCallRecord,
    )
    from coderl.agent.runner import run_episode, run_episodes
    from coderl.agent.scripted import ScriptedPolicy
    from coderl.agent.tools import (
        TOOLS,
        TOOLSETS,
        Tool,
        ToolConfig,
        ToolContext,
        ToolError,
        make_tool,
        resolve_tools,
        truncate_middle,
    )

__all__ = [
    "CALL_FORMATS",
    "TOOLS",
    "TOOLSETS",
    "AgentTask",
    "BrokenCall",
    "CallFormat",
    "ChatRenderer",
    "Episode",
    "EpisodeConfig",
    "EpisodeStats",
    "ScriptedPolicy",
    "SimpleTask",
    "TemplateError",
    "Tool",
    "ToolCall",
    "ToolCallRecord",
    "ToolConfig",
    "ToolContext",
    "ToolError",
    "get_call_format",
    "make_tool",
    "resolve_tools",
    "run_episode",
    "run_episodes",
    "template_supports_tools",
    "truncate_middle",
]

_HOME = {
    "CALL_FORMATS": "coderl.agent.parsing",
    "TOOLS": "coderl.agent.tools",
    "TOOLSETS": "coderl.agent.tools",
    "AgentTask": "coderl.agent.record",
    "BrokenCall": "coderl.agent.parsing",
    "CallFormat": "coderl.agent.parsing",
    "ChatRenderer": "coderl.agent.context",
    "Episode": "coderl.agent.record",
    "EpisodeConfig": "coderl.agent.record",
    "EpisodeStats": "coderl.agent.record",
    "ScriptedPolicy": "coderl.agent.scripted",
    "SimpleTask": "coderl.agent.record",
    "TemplateError": "coderl.agent.context",
    "Tool": "coderl.agent.tools",
    "ToolCall": "coderl.agent.parsing",
    "ToolCallRecord": "coderl.agent.record",
    "ToolConfig": "coderl.agent.tools",
    "ToolContext": "coderl.agent.tools",
    "ToolError": "coderl.agent.tools",
    "get_call_format": "coderl.agent.parsing",
    "make_tool": "coderl.agent.tools",
    "resolve_tools": "coderl.agent.tools",
    "run_episode": "coderl.agent.runner",
    "run_episodes": "coderl.agent.runner",
    "template_supports_tools": "coderl.agent.context",
    "truncate_middle": "coderl.agent.tools",
}
"""The module each exported name lives in."""


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'coderl.agent' has no attribute {name!r}")
