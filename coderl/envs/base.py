"""The seam between the drivers and the world: an :class:`Environment` turns tasks into episodes
(the harness running in sandboxes) and grades them (hidden tests).

Failure attribution (the only masking rule): an episode or grade that yields no reward names who
caused it in ``failure``:

- ``"infra"``: the sandbox could not start, the environment is missing, the grader or the harness
  raised unexpectedly, the engine is down. Not the policy's doing: the sample is **masked** (it
  leaves the loss and its group's baseline) and counted.
- ``"agent"``: anything the policy's own actions caused (broken calls, timeouts of its own
  commands, overlong output, a self-summary too long for the next window, code that breaks the
  grader's test run). An ordinary failure: the sample is **scored** like a wrong answer.

A record that leaves ``failure`` unset is classified by :func:`coderl.train.pipeline.attribute`
(``finish_reason="error"`` and a ``grading_error`` without a kind are ``infra``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from coderl.policy.base import Completion, SamplingParams
from coderl.trajectory import Trajectory

FailureKind = Literal["infra", "agent"]
"""Who caused an episode or a grade to yield no reward (see the module docstring)."""
FAILURE_KINDS: tuple[FailureKind, ...] = ("infra", "agent")


@dataclass
class EpisodeRecord:
    """One finished episode, as the drivers need it."""

    task_id: str
    trajectory: Trajectory
    """Token-exact segments (what the model saw and sampled)."""
    finish_reason: str = "submit"
    """Why the episode ended (``submitted``, ``max_turns``, ``max_tokens``, ``broken_calls``,
    ``context``, ``stop``, ``length``, ``error``...)."""
    turns: int = 1
    """Model turns taken."""
    truncated: bool = False
    """The episode hit a token or turn budget instead of ending on its own."""
    broken_tool_calls: int = 0
    parsed_calls: bool = False
    """Its replies were parsed as tool calls (an agent harness): ``broken_tool_calls`` is a
    measurement; False (single-reply tasks): nothing was parsed, and nothing is reported."""
    no_action_turns: int = 0
    """Turns in which the model produced no tool call and no answer."""
    summaries: int = 0
    """Self-summarisations (context resets)."""
    turns_after_summary: int = 0
    """Turns taken in windows a self-summary opened (0: none, or the episode ended there)."""
    answer: Any = None
    """What the grader needs (a diff, a solution file, sampled tokens)."""
    episode: Any = None
    """The harness's ``coderl.agent.episode.Episode`` (tool log, transcripts), when there is one."""
    failure: FailureKind | None = None
    """Who caused the episode to fail (None: it did not fail, or let the pipeline decide from
    ``finish_reason``)."""
    failure_reason: str = ""
    """One line on why it failed (empty when it did not)."""
    branches: list[tuple[int, EpisodeRecord]] = field(default_factory=list)
    """Continuations forked at turn boundaries (``rollout.branch``): ``(t, record)``, ``t`` the
    boundary ``s_t`` it started from; each record is a whole episode, graded like one."""


@dataclass
class GradeRecord:
    resolved: bool = False
    """Every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    fraction_passed: float = 0.0
    grading_error: str | None = None
    """Why grading yielded no verdict. With ``failure_kind`` ``"infra"`` (or unset) the sample is
    masked and counted; with ``"agent"`` it is scored as a failure."""
    failure_kind: FailureKind | None = None
    """Who caused ``grading_error`` (None with an error: ``infra``)."""
    result: Any = None
    """The grader's full ``GradeResult`` (per-test outcomes, stripped paths, reason), if any."""


class SamplingPolicy(Protocol):
    """What an environment needs from the policy: token-level sampling with a weight version."""

    version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...


class Environment(Protocol):
    """Tasks, the agent harness over them, and their grader."""

    def tasks(self, split: str) -> list[Any]:
        """Tasks of a split; each has an ``id`` attribute."""
        ...

    def ease(self, task: Any) -> float | None:
        """Task ease in [0, 1] from metadata (1 = easiest), or None to use the group pass rate."""
        ...

    def rollout(
        self, policy: SamplingPolicy, tasks: list[Any], params: SamplingParams, group_size: int
    ) -> list[EpisodeRecord]:
        """``group_size`` episodes per task, task-major (task 0's group first), seeded by
        ``params.seed``."""
        ...

    def grade(self, tasks: list[Any], episodes: list[EpisodeRecord]) -> list[GradeRecord]:
        """One grade per episode; ``tasks`` holds each episode's task."""
        ...

    def token_budget(self) -> int:
        """Most tokens an episode can sample (turns x tokens per turn)."""
        ...
