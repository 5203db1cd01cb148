"""One episode of the agent loop: sample a turn, run its tool calls, repeat; summarise when full.

The loop is a generator (:func:`episode_steps`) that yields what it needs from outside, a
:class:`SampleRequest` (answered with a ``Completion``) or a :class:`ToolRequest` (a function run
in a thread pool, answered with its result), and returns the :class:`Episode`. The runner in
:mod:`coderl.agent.runner` drives many of these at once, batching the sample requests of all
episodes that are ready into one ``policy.generate`` call.

Self-summarization: when the next turn could overflow ``context_budget``, the policy is asked
(``summary_instruction``) for a summary of its progress, sampled in the current context window
(so its tokens are trainable there); the next window starts again from the system prompt and
the task, with that summary appended to the task message. Each window is one trajectory segment.
The summary turn sees the last turn's observations, so it may run past ``context_budget`` by
them (each at most ``tools.max_observation_chars`` characters and
``tools.max_observation_tokens`` tokens), the instruction and ``summary_max_tokens``: keep the
budget that far below the model's real context length. A summary so long that the window it
opens cannot fit one more turn, or any prompt that reaches the engine's context
(:func:`coderl.policy.base.context_limit`, checked by the runner before every batch), ends the
episode with ``finish_reason="context"``: the policy's own doing, graded and scored like any
other ending, never a mask and never a failed batch.

Branched episodes (``EpisodeConfig.branch``): at a chosen turn boundary ``s_t`` (after turn
``t``'s tool results, before turn ``t + 1``) the episode forks ``k`` continuations: each gets a
copy of the conversation (the token-exact segments, transcripts, tool log, counters) and a
:meth:`coderl.sandbox.base.Sandbox.fork` of the workspace, and runs on as an episode of its own
(it does not branch again) that closes its sandbox when it ends. The loop yields a
:class:`SpawnRequest` with them; the runner drives them with the others and files their episodes
under the parent's ``Episode.branches``. Not carried by a fork: whatever
:mod:`coderl.sandbox.fork` does not carry (running processes).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
import traceback
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coderl.agent.branch import BranchSpec
from coderl.agent.context import ChatRenderer, Message, cap_tokens
from coderl.agent.parsing import BrokenCall, ToolCall, get_call_format, printable, validate
from coderl.agent.tools import (
    TOOLS,
    TOOLSETS,
    Tool,
    ToolConfig,
    ToolContext,
    execute,
    resolve_tools,
)
from coderl.policy.episode import EpisodeBuilder, encode
from coderl.sandbox.base import Sandbox, WorkspaceError
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


@dataclass
class SampleRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    messages: list[Message] = field(default_factory=list)
    """The context window's messages that ``prompt_ids`` renders (the system prompt first): what
    a client of a served model sends instead of token ids (:mod:`coderl.online.agent_client`)."""
    summary: bool = False
    """Whether this turn is the self-summary of a full window."""


@dataclass
class ToolRequest:
    fn: Callable[[], Any]


@dataclass
class SpawnRequest:
    """Continuations to run beside the episode that yields this (answered with None)."""

    turn: int
    """The boundary they start from."""
    children: list[Step | Episode]
    """Their episode generators; an :class:`Episode` where the fork failed (an ``infra``
    error, already finished)."""


Step = Generator[SampleRequest | ToolRequest | SpawnRequest, Any, Episode]


@dataclass
class _State:
    """Mutable state of one running episode."""

    task: AgentTask
    cfg: EpisodeConfig
    renderer: ChatRenderer
    ctx: ToolContext
    episode: Episode
    start: float
    task_text: str
    builder: EpisodeBuilder | None = None
    """Token-exact assembly of the context windows (the policy package's)."""
    sampled: bool = False
    """Whether the current window has a completion that still needs an observation."""
    pending: list[Message] = field(default_factory=list)
    """Messages after the last completion not yet appended as tokens."""
    consecutive_broken: int = 0
    branched: int = 0
    """The last boundary this episode forked at (0: none)."""

    @property
    def stats(self) -> EpisodeStats:
        return self.episode.stats

    def fork(self, sandbox: Sandbox, episode_id: str) -> _State:
        """A copy of this state at a turn boundary, over ``sandbox`` (a fork of this one's):
        the segments, transcripts, tool log and counters are copied, the tokenizer shared; the
        copy does not branch again."""
        assert self.builder is not None and not self.ctx.submitted
        builder = copy.copy(self.builder)  # the tokenizer and tool schemas are shared
        builder.trajectory = copy.deepcopy(self.builder.trajectory)
        builder.messages = copy.deepcopy(self.builder.messages)
        ep = self.episode
        episode = Episode(
            ep.task_id,
            episode_id,
            builder.trajectory,
            copy.deepcopy(ep.transcripts),
            list(ep.tool_calls),
            "",
            dataclasses.replace(ep.stats),
        )
        cfg = dataclasses.replace(self.cfg, branch=BranchSpec(), potential=None)
        ctx = ToolContext(sandbox, self.ctx.config)
        return dataclasses.replace(
            self,
            cfg=cfg,
            ctx=ctx,
            episode=episode,
            builder=builder,
            pending=copy.deepcopy(self.pending),
        )

    def new_window(self, user_message: str) -> None:
        messages = self.renderer.opening(user_message)
        provenance = {
            "episode_id": self.episode.episode_id,
            "task_id": self.task.id,
            "native_tools": self.renderer.native_tools,
            "call_format": self.cfg.call_format,
        }
        if self.builder is None:
            self.builder = EpisodeBuilder(
                self.renderer.tokenizer,
                messages,
                tools=self.renderer.tool_schemas(),
                provenance=provenance,
            )
            self.episode.trajectory = self.builder.trajectory
        else:
            self.builder.new_segment(messages)
        self.episode.transcripts.append([dict(m) for m in messages])
        self.sampled, self.pending = False, []

    def context_len(self) -> int:
        """Tokens the window would hold with the pending messages and the generation prompt."""
        assert self.builder is not None
        n = len(self.builder.segment)
        if not self.sampled:
            return n
        # EpisodeBuilder has no public preview of an observation's tokens; its _delta is the
        # exact text add_observation would append.
        delta = self.builder._delta(list(self.pending))
        return n + len(encode(self.renderer.tokenizer, delta))

    def sample(
        self, extra: Sequence[Message], max_new: int, *, summary: bool = False
    ) -> Generator[SampleRequest, Any, str]:
        """Append the pending messages and ``extra``, sample a turn, return its text."""
        assert self.builder is not None
        new = [*self.pending, *extra]
        self.episode.transcripts[-1].extend(new)
        if self.sampled:
            self.builder.add_observation(new)
        stops = self.renderer.stop_token_ids
        window = [dict(m) for m in self.episode.transcripts[-1]]
        completion = yield SampleRequest(self.builder.prompt_ids(), max_new, stops, window, summary)
        text = self.renderer.content(completion)
        message = {"role": "assistant", "content": text}
        self.builder.add_completion(completion, message=message)
        # the turn (0-based) this action belongs to: a summary counts with the turn after it
        self.builder.segment.provenance["actions"][-1].update(
            turn=self.stats.turns, summary=summary
        )
        self.stats.generated_tokens += len(completion.token_ids)
        self.sampled, self.pending = True, []
        self.episode.transcripts[-1].append(message)
        return text


def _run_calls(st: _State, text: str, tools: Mapping[str, Tool]) -> list[ToolCallRecord]:
    """Parse and run the calls of one assistant message, in order; nothing after ``submit`` or
    past ``max_calls_per_turn`` calls run."""
    records = []
    turn = st.stats.turns
    ran = 0
    for parsed in get_call_format(st.cfg.call_format).parse(text, tools):
        started = time.monotonic() - st.start
        name = parsed.name if isinstance(parsed, ToolCall) else None
        args = parsed.arguments if isinstance(parsed, ToolCall) else None
        call = validate(parsed, tools)
        if isinstance(call, BrokenCall):  # counted after submit too (untrained there, scored)
            obs, status, duration = f"Error: {call.error}", "broken", 0.0
        elif st.ctx.submitted:
            obs, status, duration = "Not run: the task was already submitted.", "not_run", 0.0
        elif ran >= st.cfg.max_calls_per_turn:
            obs = f"Not run: at most {ran} tool calls run per turn; call it again next turn."
            status, duration = "not_run", 0.0
        else:
            ran += 1
            outcome = execute(call.tool, call.arguments, st.ctx)
            obs, duration = outcome.observation, outcome.duration_s
            status = "ok" if outcome.ok else "tool_error"
        obs = printable(obs)  # a lone surrogate echoed from the arguments must not crash encoding
        obs = cap_tokens(st.renderer.tokenizer, obs, st.cfg.tools.max_observation_tokens)
        records.append(
            ToolCallRecord(turn, name, args, parsed.text, obs, status, started, duration)  # type: ignore[arg-type]
        )
        if name == "run" and status == "ok" and st.cfg.potential is not None:
            records[-1].potential = st.cfg.potential(st.task, st.ctx.sandbox)
    return records


def _take_turn(st: _State, records: list[ToolCallRecord]) -> None:
    """Count one turn's calls and queue their results as tool messages."""
    st.episode.tool_calls.extend(records)
    for r in records:
        if r.status == "broken":
            st.stats.broken_tool_calls += 1
            st.consecutive_broken += 1
        elif r.status in ("ok", "tool_error"):
            st.stats.tool_errors += r.status == "tool_error"
            st.consecutive_broken = 0
        st.pending.append({"role": "tool", "name": r.name or "invalid", "content": r.observation})


def _untrain_after_submit(st: _State, text: str, records: list[ToolCallRecord]) -> None:
    """Take what the policy wrote after its ``submit`` call out of the loss: the call's tokens
    and the one after it (stop, or go on) stay trainable, every later token of the message is
    untrained (:meth:`coderl.policy.episode.EpisodeBuilder.untrain_after`). The broken calls
    there still count, so going on costs reward, and the one token that chose to go on carries
    that cost; without this every babbled token after a resolving submit shared the episode's
    advantage and was reinforced with it."""
    assert st.builder is not None
    ran = [i for i, r in enumerate(records) if r.status in ("ok", "tool_error")]
    end = get_call_format(st.cfg.call_format).ends(text)[ran[-1]]  # nothing runs after submit
    n = st.builder.untrain_after(end, "after submit")
    st.builder.segment.provenance["actions"][-1]["untrained"] = n


def _summarize(st: _State, max_new: int) -> Generator[SampleRequest, Any, None]:
    """Ask for a summary in the current window, then open a new window with it."""
    ask = [{"role": "user", "content": st.cfg.summary_instruction}]
    summary = yield from st.sample(ask, min(st.cfg.summary_max_tokens, max_new), summary=True)
    st.stats.summaries += 1
    st.new_window(st.task_text + st.cfg.summary_template.format(summary=summary.strip()))


def _fork(st: _State, tools: Mapping[str, Tool]) -> list[Step | Episode]:
    """``cfg.branch.k`` continuations of ``st`` at its current boundary, each over a fork of the
    sandbox; a fork that fails becomes a failed episode: ``agent`` (scored) when the parent's
    workspace made the copy fail (:class:`WorkspaceError`), else ``infra`` (masked, counted)."""
    t = st.stats.turns
    out: list[Step | Episode] = []
    for k in range(st.cfg.branch.k):
        child_id = f"{st.episode.episode_id}@{t}.{k}"
        try:
            sandbox = st.ctx.sandbox.fork()
        except Exception as e:  # noqa: BLE001 - that continuation fails, the others go on
            ep = Episode(st.task.id, child_id, Trajectory(), [], [], "", EpisodeStats())
            ep.error = traceback.format_exc()
            ep.failure = "agent" if isinstance(e, WorkspaceError) else "infra"
            out.append(ep)
            continue
        out.append(_drive(st.fork(sandbox, child_id), tools, close=True))
    return out


def _loop(st: _State, tools: Mapping[str, Tool]) -> Generator[Any, Any, FinishReason]:
    cfg = st.cfg
    while True:
        if st.stats.turns >= cfg.max_turns:
            return "max_turns"
        left = cfg.max_tokens - st.stats.generated_tokens
        if left <= 0:
            return "max_tokens"
        if cfg.branch.at(st.stats.turns) and st.branched < st.stats.turns:
            st.branched = st.stats.turns  # once per boundary (a summary loops back here)
            children = yield ToolRequest(functools.partial(_fork, st, tools))
            yield SpawnRequest(st.stats.turns, children)
        max_new = min(cfg.max_tokens_per_turn, left)
        if (n := st.context_len()) + max_new > cfg.context_budget:
            if not st.sampled:
                if st.stats.summaries:  # the policy's summary filled the window it opened
                    return "context"
                raise ValueError(
                    f"a fresh context window ({n} tokens) plus one turn ({max_new}) "
                    f"exceeds context_budget={cfg.context_budget}"
                )
            yield from _summarize(st, left)
            continue
        text = yield from st.sample((), max_new)
        st.stats.turns += 1
        st.stats.turns_after_summary += st.stats.summaries > 0
        records = yield ToolRequest(functools.partial(_run_calls, st, text, tools))
        if not records:
            st.stats.no_action_turns += 1
            st.pending = [{"role": "user", "content": cfg.no_action_message}]
            continue
        _take_turn(st, records)
        if st.ctx.submitted:
            _untrain_after_submit(st, text, records)
            return "submitted"
        if st.consecutive_broken >= cfg.max_consecutive_broken_calls:
            return "broken_calls"


def episode_steps(
    tokenizer: Any,
    task: AgentTask,
    sandbox: Sandbox,
    cfg: EpisodeConfig,
    *,
    episode_id: str | None = None,
    registry: Mapping[str, Tool] = TOOLS,
) -> Step:
    """The episode as a generator of requests (see the module docstring); returns the Episode.

    Errors inside the episode (a template that cannot be rendered exactly, a context budget too
    small for the prompt) end it with ``finish_reason="error"``, the traceback in
    ``Episode.error`` and ``Episode.failure="infra"``; a diff that fails on a workspace the
    policy made (``RecursionError``, ``UnicodeError``) is ``failure="agent"`` (scored, not
    masked); the trajectory up to that point is kept. Errors of the requests themselves
    (``policy.generate`` failing) propagate from the runner.

    Raises:
        KeyError: unknown task kind, tool names or call format (listing the valid ones), before
            any work.
    """
    if task.kind not in cfg.toolsets:
        raise KeyError(f"no tool set for task kind {task.kind!r}; valid: {sorted(cfg.toolsets)}")
    tools = resolve_tools(cfg.toolsets[task.kind], registry)
    call_format = get_call_format(cfg.call_format)
    start = time.monotonic()
    episode = Episode(task.id, episode_id or task.id, Trajectory(), [], [], "", EpisodeStats())
    try:
        renderer = ChatRenderer(tokenizer, tools, call_format, cfg.instructions, cfg.template_tools)
        task_text = cfg.task_template.format(problem_statement=task.problem_statement)
        st = _State(task, cfg, renderer, ToolContext(sandbox, cfg.tools), episode, start, task_text)
        st.new_window(task_text)
    except Exception:  # noqa: BLE001 - one broken episode must not take down a batch of rollouts
        episode.stats.finish_reason = "error"
        episode.error = traceback.format_exc()
        episode.failure = "infra"
        return (yield from _finish(episode, sandbox, start, close=False))
    return (yield from _drive(st, tools, close=False))


def _drive(st: _State, tools: Mapping[str, Tool], *, close: bool) -> Step:
    """Run the loop from ``st`` to the end, then take the diff (and close the sandbox when
    ``close``: a continuation owns its fork)."""
    episode = st.episode
    try:
        episode.stats.finish_reason = yield from _loop(st, tools)
        episode.transcripts[-1].extend(st.pending)  # results the model never got to read
    except ContextExhausted:  # the policy's observations filled the engine's context: scored
        episode.stats.finish_reason = "context"
    except Exception:  # noqa: BLE001 - one broken episode must not take down a batch of rollouts
        episode.stats.finish_reason = "error"
        episode.error = traceback.format_exc()
        episode.failure = "infra"
    return (yield from _finish(episode, st.ctx.sandbox, st.start, close=close))


class ContextExhausted(Exception):
    """Thrown into an episode by its driver: its next prompt leaves the engine no room to sample
    (:func:`coderl.policy.base.context_limit`). The episode ends ``finish_reason="context"``."""


def diff_failure(e: BaseException) -> Literal["agent", "infra"]:
    """Who made ``sandbox.diff()`` raise ``e``: ``agent`` for a workspace the policy made that the
    diff cannot walk (a tree too deep: RecursionError; an undecodable name: UnicodeError), else
    ``infra``. Every driver that takes an episode's diff attributes its failure here."""
    return "agent" if isinstance(e, RecursionError | UnicodeError) else "infra"


def _finish(episode: Episode, sandbox: Sandbox, start: float, *, close: bool) -> Step:
    try:
        episode.diff = yield ToolRequest(sandbox.diff)
    except Exception as e:  # noqa: BLE001 - without a diff the episode cannot be graded
        episode.stats.finish_reason = "error"
        episode.error = (episode.error or "") + traceback.format_exc()
        if episode.failure is None:
            episode.failure = diff_failure(e)
    if close:
        try:
            yield ToolRequest(sandbox.close)
        except Exception:  # noqa: BLE001 - the diff is taken; a leaked fork is only logged here
            episode.error = (episode.error or "") + traceback.format_exc()
    episode.stats.wall_time_s = time.monotonic() - start
    return episode
