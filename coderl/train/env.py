"""The seam between the training loop and the world: an :class:`Environment` turns tasks into
episodes (the harness running in sandboxes) and grades them (hidden tests).

``ENVIRONMENTS`` maps ``tasks.source`` to a builder; it is the only place a name selects one.
``toy`` lives here: a one-turn, in-process task that needs no sandbox, for tests and smoke runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from coderl.config import Config
from coderl.policy.base import Completion, SamplingParams
from coderl.trajectory import Segment, Trajectory


@dataclass
class EpisodeRecord:
    """One finished episode, as the loop needs it."""

    task_id: str
    trajectory: Trajectory
    """Token-exact segments (what the model saw and sampled)."""
    finish_reason: str = "submit"
    """Why the episode ended (``submit``, ``max_turns``, ``context``, ``length``, ``error``...)."""
    turns: int = 1
    """Model turns taken."""
    truncated: bool = False
    """The episode hit a token or turn budget instead of ending on its own."""
    broken_tool_calls: int = 0
    no_action_turns: int = 0
    """Turns in which the model produced no tool call and no answer."""
    summaries: int = 0
    """Self-summarisations (context resets)."""
    answer: Any = None
    """What the grader needs (a diff, a solution file, sampled tokens)."""
    episode: Any = None
    """The harness's ``coderl.agent.episode.Episode`` (tool log, transcripts), when there is one."""


@dataclass
class GradeRecord:
    resolved: bool = False
    """Every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    fraction_passed: float = 0.0
    grading_error: str | None = None
    """Why grading failed; the sample is masked and counted."""
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


@dataclass
class ToyTask:
    id: str
    prompt_ids: list[int]
    residue: int
    """The task is solved by sampling tokens whose id is ``residue`` modulo ``modulus``."""
    modulus: int = 4
    split: str = "train"


@dataclass
class ToyEnvironment:
    """Task ``toy/i``: after a fixed prompt, sample tokens whose id is congruent to the task's
    residue (``i mod residues``; with the default ``residues=1`` every task wants the same
    class) modulo ``modulus``. ``fraction_passed`` is the fraction of sampled
    tokens that are; resolved means at least half are. A random policy scores about
    ``1 / modulus``; a learning one climbs.

    Not a coding task: it exercises the loop (sampling, grading, rewards, advantages, update,
    checkpoints) in milliseconds with a tiny random model.
    """

    max_new_tokens: int = 8
    modulus: int = 4
    residues: int = 1
    n_train: int = 16
    n_heldout: int = 8
    _tasks: dict[str, list[ToyTask]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def make(i: int, split: str) -> ToyTask:
            prompt = [3 + (i * 7 + j) % 97 for j in range(4 + i % 3)]
            return ToyTask(f"toy/{split}/{i}", prompt, i % self.residues, self.modulus, split)

        self._tasks = {
            "train": [make(i, "train") for i in range(self.n_train)],
            "heldout": [make(100 + i, "heldout") for i in range(self.n_heldout)],
        }

    def tasks(self, split: str) -> list[Any]:
        if split not in self._tasks:
            raise ValueError(f"unknown toy split {split!r}; valid: {sorted(self._tasks)}")
        return list(self._tasks[split])

    def ease(self, task: Any) -> float | None:
        return None

    def token_budget(self) -> int:
        return self.max_new_tokens

    def rollout(
        self, policy: SamplingPolicy, tasks: list[Any], params: SamplingParams, group_size: int
    ) -> list[EpisodeRecord]:
        prompts = [t.prompt_ids for t in tasks for _ in range(group_size)]
        params = replace(params, max_new_tokens=min(params.max_new_tokens, self.max_new_tokens))
        completions = policy.generate(prompts, params)
        episodes = []
        for i, c in enumerate(completions):
            seg = Segment()
            seg.append_context(prompts[i], kind="prompt")
            seg.append_sampled(c.token_ids, c.logprobs, c.policy_version)
            episodes.append(
                EpisodeRecord(
                    task_id=tasks[i // group_size].id,
                    trajectory=Trajectory([seg]),
                    finish_reason=c.finish_reason,
                    truncated=c.finish_reason == "length",
                    answer=c.token_ids,
                )
            )
        return episodes

    def grade(self, tasks: list[Any], episodes: list[EpisodeRecord]) -> list[GradeRecord]:
        out = []
        for task, ep in zip(tasks, episodes, strict=True):
            toks = ep.answer or []
            frac = sum(t % task.modulus == task.residue for t in toks) / max(len(toks), 1)
            out.append(GradeRecord(resolved=frac >= 0.5, fraction_passed=frac))
        return out


def _toy(cfg: Config) -> Environment:
    return ToyEnvironment(max_new_tokens=cfg.rollout.max_new_tokens, **cfg.tasks.options)


def _humaneval(cfg: Config) -> Environment:
    from coderl.train.agent_env import humaneval_environment

    return humaneval_environment(cfg)


def _repo(cfg: Config) -> Environment:
    from coderl.train.agent_env import repo_environment

    return repo_environment(cfg)


# tasks.source -> environment builder; the only dispatch point
ENVIRONMENTS: dict[str, Callable[[Config], Environment]] = {
    "toy": _toy,
    "humaneval": _humaneval,
    "repo": _repo,
}


def build_environment(cfg: Config) -> Environment:
    """The environment named by ``cfg.tasks.source``.

    Raises:
        ValueError: unknown source (lists the valid ones).
    """
    if cfg.tasks.source not in ENVIRONMENTS:
        raise ValueError(
            f"tasks.source: unknown source {cfg.tasks.source!r}; valid: {sorted(ENVIRONMENTS)}"
        )
    return ENVIRONMENTS[cfg.tasks.source](cfg)
