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
from typing import Any, Literal

from coderl.agent.branch import BranchSpec
from coderl.agent.context import ChatRenderer, Message, cap_tokens
from coderl.agent.parsing import BrokenCall, ToolCall, get_call_format, printable, validate
from coderl.agent.record import (
    DEFAULT_INSTRUCTIONS,
    DEFAULT_SUMMARY_INSTRUCTION,
    AgentTask,
    Branch,
    Episode,
    EpisodeConfig,
    EpisodeStats,
    FinishReason,
    SimpleTask,
    ToolCallRecord,
)
from coderl.agent.tools import TOOLS, Tool, ToolContext, execute, resolve_tools
from coderl.policy.episode import EpisodeBuilder, encode
from coderl.sandbox.base import DIFF_FAULTS, Sandbox, SandboxError, WorkspaceError
from coderl.trajectory import Trajectory

__all__ = [  # the episode's data (coderl.agent.record) is re-exported: callers import it here
    "DEFAULT_INSTRUCTIONS",
    "DEFAULT_SUMMARY_INSTRUCTION",
    "AgentTask",
    "Branch",
    "ContextExhausted",
    "Episode",
    "EpisodeConfig",
    "EpisodeStats",
    "FinishReason",
    "SampleRequest",
    "SimpleTask",
    "SpawnRequest",
    "Step",
    "ToolCallRecord",
    "ToolRequest",
    "diff_failure",
    "episode_steps",
]


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

    def run(self) -> Any:
        """``fn()``, what a driver calls. A ``GeneratorExit`` from it (user code: a plugin's
        argument validator, the shaping potential) is raised as a ``RuntimeError`` from it:
        thrown into the episode as itself it would read as the episode being closed, which the
        episode cannot catch and stay closable, and the batch would end."""
        try:
            return self.fn()
        except GeneratorExit as e:
            raise RuntimeError(f"GeneratorExit raised in a tool request: {e}") from e


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
        except (SandboxError, OSError) as e:  # that continuation fails, the others go on
            ep = Episode(st.task.id, child_id, Trajectory(), [], [], "", EpisodeStats())
            ep.error = traceback.format_exc()
            ep.failure = "agent" if isinstance(e, WorkspaceError) else "infra"
            out.append(ep)
            continue
        child = st.fork(sandbox, child_id)
        out.append(_drive(child.episode, sandbox, child.start, _run(child, tools), close=True))
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

    def steps() -> Generator[Any, Any, FinishReason]:
        renderer = ChatRenderer(tokenizer, tools, call_format, cfg.instructions, cfg.template_tools)
        task_text = cfg.task_template.format(problem_statement=task.problem_statement)
        st = _State(task, cfg, renderer, ToolContext(sandbox, cfg.tools), episode, start, task_text)
        st.new_window(task_text)
        return (yield from _run(st, tools))

    return (yield from _drive(episode, sandbox, start, steps(), close=False))


def _run(st: _State, tools: Mapping[str, Tool]) -> Generator[Any, Any, FinishReason]:
    """The loop from ``st`` to its finish reason."""
    reason = yield from _loop(st, tools)
    st.episode.transcripts[-1].extend(st.pending)  # results the model never got to read
    return reason


def _drive(
    episode: Episode,
    sandbox: Sandbox,
    start: float,
    steps: Generator[Any, Any, FinishReason],
    *,
    close: bool,
) -> Step:
    """Run ``steps`` (the episode's set-up and loop) to the end, then take the diff (and close
    the sandbox when ``close``: a continuation owns its fork)."""
    try:
        episode.stats.finish_reason = yield from steps
    except ContextExhausted:  # the policy's observations filled the engine's context: scored
        episode.stats.finish_reason = "context"
    except (KeyboardInterrupt, GeneratorExit):
        raise  # Ctrl-C stops the run; GeneratorExit is a close (ToolRequest.run: not a raise)
    # anything else (SystemExit included): the loop runs what the policy wrote through
    # templates, parsers, argument validators and the shaping potential, user code included; a
    # raise there is a host fault whatever the agent did (the tools' own are observations)
    except BaseException:  # noqa: BLE001 - one broken episode must not take down a batch
        episode.stats.finish_reason = "error"
        episode.error = traceback.format_exc()
        episode.failure = "infra"
    return (yield from _finish(episode, sandbox, start, close=close))


class ContextExhausted(Exception):
    """Thrown into an episode by its driver: its next prompt leaves the engine no room to sample
    (:func:`coderl.policy.base.context_limit`). The episode ends ``finish_reason="context"``."""


def diff_failure(e: BaseException) -> Literal["agent", "infra"]:
    """Who made ``sandbox.diff()`` raise ``e`` (one of ``DIFF_FAULTS``): ``agent`` for a
    workspace the policy made that the diff cannot walk (a tree too deep: RecursionError; an
    undecodable name: UnicodeError; WorkspaceError), else ``infra``. Every driver that takes an
    episode's diff attributes its failure here."""
    return "agent" if isinstance(e, RecursionError | UnicodeError | WorkspaceError) else "infra"


def _finish(episode: Episode, sandbox: Sandbox, start: float, *, close: bool) -> Step:
    try:
        episode.diff = yield ToolRequest(sandbox.diff)
    except DIFF_FAULTS as e:  # without a diff the episode cannot be graded
        episode.stats.finish_reason = "error"
        episode.error = (episode.error or "") + traceback.format_exc()
        if episode.failure is None:
            episode.failure = diff_failure(e)
    if close:
        try:
            yield ToolRequest(sandbox.close)
        except (SandboxError, OSError):  # the diff is taken; a leaked fork is only logged here
            episode.error = (episode.error or "") + traceback.format_exc()
    episode.stats.wall_time_s = time.monotonic() - start
    return episode
