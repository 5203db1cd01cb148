"""``mix``: one environment over the sources of ``tasks.mix`` (a curriculum draws from several).

Each entry gets its own environment, built from the run's config with that entry's ``source``
and ``options`` (so rollout budgets, grading and rewards are exactly the source's own). A task
belongs to the source whose split listed it; ``rollout``, ``grade`` and ``ease`` dispatch each
task to its owner, so a step that draws HumanEval and repository tasks rolls each out in its
own harness and grades it with its own grader. Which source a step draws from, and how much,
is the sampler's business (:class:`coderl.train.sampling.MixSampler`).

Limits: task ids must be unique across sources (two ``toy`` sources need distinct
``options.prefix``); a collision raises. A rollout over several sources runs them one after the
other (no batching across sources). ``token_budget`` is the largest source's (the trainer's
sequence bound); the length penalty reads that one budget for every task.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coderl.envs.base import Environment, EpisodeRecord, GradeRecord, SamplingPolicy
from coderl.policy.base import SamplingParams

SEED_STRIDE = 1_000_003
"""Source ``k`` of a mixed rollout samples with ``params.seed + k * SEED_STRIDE``, so two
sources with the same prompts do not sample the same tokens."""


class MixEnvironment:
    """The environments of ``tasks.mix``, by entry label, behind one :class:`Environment`.

    Args:
        envs: label -> environment, in ``tasks.mix`` order.
        splits: label -> (training split, held-out split) of that entry.
        train_split, heldout_split: the run's ``tasks.train_split`` / ``tasks.heldout_split``;
            ``tasks(train_split)`` and ``tasks(heldout_split)`` read each entry's own split.
    """

    def __init__(
        self,
        envs: dict[str, Environment],
        splits: dict[str, tuple[str, str]],
        train_split: str,
        heldout_split: str,
    ) -> None:
        self.envs, self.splits = envs, splits
        self.train_split, self.heldout_split = train_split, heldout_split
        self._owner: dict[str, str] = {}

    def _split_of(self, label: str, split: str) -> str:
        train, heldout = self.splits[label]
        return {self.train_split: train, self.heldout_split: heldout}.get(split, split)

    def source_tasks(self, label: str, split: str) -> list[Any]:
        """Tasks of one source for the run's ``split`` (its own split name, see the class).

        Raises:
            ValueError: a task id is already owned by another source.
        """
        tasks = self.envs[label].tasks(self._split_of(label, split))
        for t in tasks:
            if self._owner.setdefault(t.id, label) != label:
                raise ValueError(
                    f"tasks.mix: task id {t.id!r} is in sources {self._owner[t.id]!r} and "
                    f"{label!r}; ids must be unique across sources"
                )
        return tasks

    def tasks(self, split: str) -> list[Any]:
        """Every source's tasks of ``split``, interleaved round-robin (so a prefix, e.g.
        ``eval.tasks``, holds every source)."""
        lists = [self.source_tasks(label, split) for label in self.envs]
        out: list[Any] = []
        for i in range(max((len(x) for x in lists), default=0)):
            out.extend(x[i] for x in lists if i < len(x))
        return out

    def owner(self, task: Any) -> str:
        """The label of the source ``task`` belongs to.

        Raises:
            KeyError: no source's training or held-out split holds the task's id.
        """
        if task.id not in self._owner:  # a fresh process (async worker): learn the ids
            for label in self.envs:
                self.source_tasks(label, self.train_split)
                self.source_tasks(label, self.heldout_split)
        return self._owner[task.id]

    def ease(self, task: Any) -> float | None:
        return self.envs[self.owner(task)].ease(task)

    def token_budget(self) -> int:
        return max(env.token_budget() for env in self.envs.values())

    def rollout(
        self, policy: SamplingPolicy, tasks: list[Any], params: SamplingParams, group_size: int
    ) -> list[EpisodeRecord]:
        """Each source's tasks rolled out by its environment (source ``k`` seeded
        ``params.seed + k * SEED_STRIDE``), returned task-major in ``tasks`` order."""
        out: list[EpisodeRecord | None] = [None] * (len(tasks) * group_size)
        for k, (label, env) in enumerate(self.envs.items()):
            idx = [i for i, t in enumerate(tasks) if self.owner(t) == label]
            if not idx:
                continue
            seed = None if params.seed is None else params.seed + k * SEED_STRIDE
            p = replace(params, seed=seed)
            eps = env.rollout(policy, [tasks[i] for i in idx], p, group_size)
            for j, i in enumerate(idx):
                out[i * group_size : (i + 1) * group_size] = eps[
                    j * group_size : (j + 1) * group_size
                ]
        assert all(ep is not None for ep in out)  # every task has an owner
        return out  # type: ignore[return-value]

    def grade(self, tasks: list[Any], episodes: list[EpisodeRecord]) -> list[GradeRecord]:
        """Each episode graded by its task's source."""
        out: list[GradeRecord | None] = [None] * len(tasks)
        for label, env in self.envs.items():
            idx = [i for i, t in enumerate(tasks) if self.owner(t) == label]
            if idx:
                grades = env.grade([tasks[i] for i in idx], [episodes[i] for i in idx])
                for i, g in zip(idx, grades, strict=True):
                    out[i] = g
        return out  # type: ignore[return-value]
