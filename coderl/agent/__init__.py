"""The agent harness: tools, tool-call parsing, the episode loop, self-summarization.

Entry points: :func:`run_episode` / :func:`run_episodes` (many episodes, batched sampling),
:class:`EpisodeConfig`, :class:`Episode`; tools in ``TOOLS`` / ``TOOLSETS``; tool-call formats
in ``CALL_FORMATS``; :class:`ScriptedPolicy` for tests and demonstrations.
"""

from coderl.agent.context import ChatRenderer, TemplateError, template_supports_tools
from coderl.agent.episode import (
    AgentTask,
    Episode,
    EpisodeConfig,
    EpisodeStats,
    SimpleTask,
    ToolCallRecord,
)
from coderl.agent.parsing import CALL_FORMATS, BrokenCall, CallFormat, ToolCall, get_call_format
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
