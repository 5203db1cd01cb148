"""The data of an episode: what it is given and what it leaves behind.

Given: the task (:class:`AgentTask`) and the :class:`EpisodeConfig` (limits, prompts, tool sets,
call format, branching). Left: the :class:`Episode` record (token-exact trajectory, transcripts,
:class:`ToolCallRecord` log, :class:`EpisodeStats`, continuations as :class:`Branch` es), what the
grader and the trainer read. No behaviour beyond validating the config: the loop that fills an
episode is :mod:`coderl.agent.episode`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coderl.agent.branch import BranchSpec
from coderl.agent.context import Message
from coderl.agent.tools import TOOLSETS, ToolConfig
from coderl.sandbox.base import Sandbox
from coderl.trajectory import Trajectory

FinishReason = Literal["submitted", "max_turns", "max_tokens", "broken_calls", "context", "error"]
"""``context``: the model's own self-summary left the next window no room for a turn, or its
next prompt leaves the engine no room to sample (:class:`ContextExhausted`): an agent-caused
ending, scored; ``error``: the harness raised (infrastructure, masked)."""

DEFAULT_INSTRUCTIONS = (
    "You are a coding agent working in a repository at the workspace root. Use the tools to "
    "read and search the code, edit files and run commands or tests. When the task is done, "
    "call submit."
)
DEFAULT_SUMMARY_INSTRUCTION = (
    "Your context is full. Write a short summary of your progress so far: what you found, which "
    "files you changed and how, what is left to do. Do not call any tool. The summary will "
    "replace the conversation so far."
)


class AgentTask(Protocol):
    """What the harness needs from a task; ``coderl.tasks.Task`` satisfies it. The workspace is
    the sandbox the caller creates from the task's environment."""

    @property
    def id(self) -> str: ...

    @property
    def problem_statement(self) -> str:
        """The text the agent is given."""
        ...

    @property
    def kind(self) -> str:
        """Task kind; selects the tool set (``EpisodeConfig.toolsets``)."""
        ...


@dataclass
class SimpleTask:
    """A plain :class:`AgentTask`."""

    id: str
    problem_statement: str
    kind: str = "repo"


@dataclass
class EpisodeConfig:
    """Limits, prompts and formats of an episode."""

    max_turns: int = 20
    """Assistant turns that may call tools (summary turns are not counted)."""
    max_tokens: int = 8192
    """Generated tokens per episode, summaries included."""
    max_tokens_per_turn: int = 1024
    """Generated tokens per assistant turn."""
    context_budget: int = 4096
    """Tokens one context window may hold (prompt + observations + the next turn)."""
    summary_max_tokens: int = 256
    """Generated tokens for one summary."""
    max_consecutive_broken_calls: int = 3
    """The episode ends (``broken_calls``) after this many malformed calls in a row."""
    max_calls_per_turn: int = 16
    """Tool calls run per assistant turn; later ones in the same message are ``not_run``. Each
    run call can return ``tools.max_observation_chars``, so this bounds what one turn adds to
    the window (and to the summary prompt, which may exceed ``context_budget`` by it): without
    it a turn of many cheap ``read_file`` calls could push a prompt past the engine's context
    length, which fails the whole batch of rollouts."""
    call_format: str = "hermes"
    """Tool-call format, a key of ``CALL_FORMATS``."""
    template_tools: bool = True
    """Let a chat template that renders ``tools=`` show the tools, in its own words and call
    format; set False when ``call_format`` differs from the template's (e.g. ``xml`` on a
    Qwen2.5 template) so the system prompt describes the format that is parsed."""
    instructions: str = DEFAULT_INSTRUCTIONS
    """Task-independent system prompt (tool definitions are added when the template lacks them)."""
    task_template: str = "{problem_statement}"
    """The first user message; ``{problem_statement}`` is replaced by the task's text."""
    summary_instruction: str = DEFAULT_SUMMARY_INSTRUCTION
    """User message that asks for a summary when the context window is full."""
    summary_template: str = "\n\nSummary of your progress so far:\n{summary}\n\nContinue the task."
    """Appended to the task message of a new window; ``{summary}`` is the model's summary."""
    no_action_message: str = (
        "No tool call found in your message. Call a tool, or call submit if you are done."
    )
    """User message after a turn with no tool call."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    seed: int | None = None
    """Sampler seed, passed with every batch."""
    toolsets: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(TOOLSETS))
    """Task kind -> names of the tools its episodes get (default ``TOOLSETS``)."""
    tools: ToolConfig = field(default_factory=ToolConfig)
    """Limits of the built-in tools (timeouts, result caps, observation size)."""
    branch: BranchSpec = field(default_factory=BranchSpec)
    """Turn boundaries at which the episode forks continuations (default: none)."""
    potential: Callable[[AgentTask, Sandbox], float | None] | None = None
    """Called with the task and the episode's sandbox after each ``run`` call the harness
    executed (``status="ok"``); its value is that call's ``ToolCallRecord.potential`` (the
    shaping potential, :mod:`coderl.rewards.shaping`). Continuations do not call it."""

    def __post_init__(self) -> None:
        if isinstance(self.tools, dict):  # from a YAML preset's tasks.options.episode.tools
            try:
                self.tools = ToolConfig(**self.tools)
            except TypeError as e:
                raise ValueError(f"EpisodeConfig.tools: {e}") from None
        positive = (
            "max_turns",
            "max_tokens",
            "max_tokens_per_turn",
            "context_budget",
            "summary_max_tokens",
            "max_consecutive_broken_calls",
            "max_calls_per_turn",
            "temperature",
        )
        bad = {k: getattr(self, k) for k in positive if not getattr(self, k) > 0}
        if bad or not 0 < self.top_p <= 1:
            raise ValueError(
                f"EpisodeConfig: {bad or {'top_p': self.top_p}} must be positive (top_p in (0, 1])"
            )
        for name, template, key in (
            ("task_template", self.task_template, "problem_statement"),
            ("summary_template", self.summary_template, "summary"),
        ):
            if "{" + key + "}" not in template:
                raise ValueError(f"EpisodeConfig.{name} must contain {{{key}}}")


@dataclass
class ToolCallRecord:
    """One call found in an assistant message, run or not."""

    turn: int
    name: str | None
    """Tool name; None when the call could not be parsed."""
    arguments: dict[str, Any] | None
    text: str
    """The call as the model wrote it."""
    observation: str
    """What the model was shown for it."""
    status: Literal["ok", "tool_error", "broken", "not_run"]
    """``broken``: malformed, unknown tool or bad arguments; ``not_run``: after ``submit``, or
    past ``EpisodeConfig.max_calls_per_turn``."""
    started_s: float
    """Start time (seconds since the episode began)."""
    duration_s: float
    potential: float | None = None
    """``EpisodeConfig.potential`` of the workspace right after this ``run`` call (None: not
    measured, or unknown)."""


@dataclass
class EpisodeStats:
    turns: int = 0
    generated_tokens: int = 0
    broken_tool_calls: int = 0
    tool_errors: int = 0
    """Well-formed calls whose tool failed (file not found, ambiguous edit...)."""
    no_action_turns: int = 0
    summaries: int = 0
    turns_after_summary: int = 0
    """Turns taken in context windows that a self-summary opened (the policy summarised and
    went on)."""
    wall_time_s: float = 0.0
    finish_reason: FinishReason = "error"


@dataclass
class Episode:
    """Everything the grader and the trainer need from one episode."""

    task_id: str
    episode_id: str
    trajectory: Trajectory
    """One segment per context window, token-exact; all share the episode's reward."""
    transcripts: list[list[Message]]
    """The messages of each context window (assistant text decoded from the sampled ids)."""
    tool_calls: list[ToolCallRecord]
    diff: str
    """``sandbox.diff()`` at the end of the episode."""
    stats: EpisodeStats
    error: str | None = None
    """Traceback when ``finish_reason`` is ``error``."""
    failure: Literal["infra", "agent"] | None = None
    """Who caused ``error``: ``infra`` (the harness or the sandbox raised) or ``agent`` (a
    workspace the policy made that the diff cannot walk: a tree too deep, an undecodable
    name); None without an error."""
    branches: list[Branch] = field(default_factory=list)
    """Continuations forked from this episode's turn boundaries (``EpisodeConfig.branch``), in
    boundary order; each is a complete episode (the shared prefix, then its own turns)."""


@dataclass
class Branch:
    """One continuation of an episode."""

    turn: int
    """The boundary it started from: ``s_turn``, after ``turn`` turns (1 or more)."""
    index: int
    """Which of the boundary's ``k`` continuations (0-based)."""
    episode: Episode
    """The continuation as a whole episode: the parent's first ``turn`` turns, then its own."""
