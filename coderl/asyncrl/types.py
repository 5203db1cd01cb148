"""The seams of asynchronous RL: episodes and groups in, weights out.

The async machinery never looks inside a model. It talks to two sides through small Protocols:

- a :class:`Sampler` (the rollout side) loads versioned weights and turns one task into a group of
  episodes whose sampled tokens carry the policy version and behaviour logprob that produced them;
- a :class:`Learner` (the trainer side) takes a batch of complete groups, takes one optimizer step
  (with the importance-weight correction from :mod:`coderl.algorithms`) and exposes the new weights
  under a new version (a step that updates nothing keeps the version).

Everything that crosses a thread, process or Ray boundary here is a plain dataclass of lists, ints
and floats (plus a weights dict of tensors), so it pickles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from coderl.trajectory import Trajectory

Weights = dict[str, Tensor]
"""A policy's trainable tensors by name (a ``state_dict``); what the trainer publishes."""


@dataclass
class Episode:
    """One rollout of one task: the trajectory as the model saw it, and its graded reward."""

    task_id: str
    """The task this episode attempted; episodes of a group share it."""
    trajectory: Trajectory
    """Segments with token ids, loss masks, behaviour logprobs and per-token policy versions."""
    reward: float = 0.0
    """Scalar outcome reward (set by the grader)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form audit data (grader output, reward components, timings)."""

    def sampled_versions(self) -> list[int]:
        """Policy versions of every sampled token (``loss_mask == 1``), in order."""
        return [
            v
            for seg in self.trajectory.segments
            for v, m in zip(seg.policy_versions, seg.loss_mask, strict=True)
            if m
        ]


@dataclass
class Job:
    """One unit of rollout work: sample a group for one task."""

    index: int
    """Position of the task in the run's task stream; the ledger's key (unique per run)."""
    task: Any
    """The task object handed to the sampler (a dict, a task spec...); must pickle."""
    task_id: str
    """Stable identifier of the task (e.g. ``humaneval/12``)."""
    seed: int
    """Seed for sampling; derived from (run seed, index, attempt), never from worker state."""
    attempt: int = 0
    """0 for the first try; n for the n-th re-sample after a stale drop."""


@dataclass
class Group:
    """A complete group of episodes for one task: the unit the trainer consumes."""

    job: Job
    episodes: list[Episode]
    worker: str = ""
    """Which rollout worker produced it (for audit)."""
    started_s: float = 0.0
    """``time.monotonic()`` of the worker when the group started (its own clock)."""
    duration_s: float = 0.0
    """Wall seconds the worker spent on the group (rollout and grading)."""

    version: int = -1
    """Version of the weights the worker held when it started the group (-1: unknown)."""

    def oldest_version(self) -> int:
        """Minimum policy version over every sampled token of every episode; for a group whose
        every episode is masked (``info["valid"]`` False) and holds no sampled token (a harness
        that crashed before sampling), the worker's ``version``.

        Raises:
            ValueError: the group holds no sampled token and is not entirely masked with a known
                version (nothing to bound staleness by).
        """
        versions = [v for ep in self.episodes for v in ep.sampled_versions()]
        if not versions:
            masked = bool(self.episodes) and all(
                ep.info.get("valid") is False for ep in self.episodes
            )
            if masked and self.version >= 0:
                return self.version
            raise ValueError(f"group for task {self.job.task_id!r} has no sampled token")
        if min(versions) < 0:
            raise ValueError(
                f"group for task {self.job.task_id!r} has a sampled token with policy version "
                f"{min(versions)}; every sampled token must carry the version that produced it"
            )
        return min(versions)

    def num_tokens(self) -> int:
        return sum(len(ep.sampled_versions()) for ep in self.episodes)


BetweenTurns = Callable[[], int]
"""Called by a sampler between turns of a running episode: picks up newer weights if any have
been published (when turn-level weight sync is on) and returns the version now loaded."""


class Sampler(Protocol):
    """The rollout side: a policy copy plus the environment and grader it runs episodes in."""

    def load_weights(self, version: int, weights: Weights) -> None:
        """Replace the policy's weights; tokens sampled afterwards carry ``version``."""
        ...

    def rollout(self, job: Job, between_turns: BetweenTurns) -> list[Episode]:
        """Run and grade one group of episodes for ``job.task``, seeded by ``job.seed``."""
        ...


class BatchSampler(Sampler, Protocol):
    """A sampler that can roll out several jobs in one batched call (``tasks_per_rollout > 1``)."""

    def rollout_batch(self, jobs: list[Job], between_turns: BetweenTurns) -> list[list[Episode]]:
        """One group per job, in order; all sampled together with ``jobs[0].seed``."""
        ...


class Learner(Protocol):
    """The trainer side: algorithm-blind at this seam (groups in, a new version out)."""

    @property
    def version(self) -> int:
        """Version of the current weights: the number of weight updates so far; a
        :meth:`train_step` that updates the weights adds 1, one that updates nothing (no valid
        episode) adds 0, so staleness counts updates, not steps."""
        ...

    @property
    def steps(self) -> int:
        """:meth:`train_step` calls so far, with or without an update (restored by
        :meth:`load_state_dict`); the runner stops at a number of steps."""
        ...

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One step on ``groups`` (an optimizer step when any episode is valid); returns
        metrics (``logprob_gap`` among them)."""
        ...

    def weights(self) -> Weights:
        """A copy of the current weights, safe to hand to another thread."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (weights, optimizer, version, steps)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Grader(Protocol):
    """Grades a group produced by a sampler that left rewards unset (Ray grader actors)."""

    def grade(self, group: Group) -> Group: ...


SamplerFactory = Callable[[], Sampler]
"""Builds a sampler inside the worker that owns it (thread, process or Ray actor); must pickle
for the process and Ray backends (a module-level function or a ``functools.partial`` of one)."""
