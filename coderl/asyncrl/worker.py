"""A rollout worker: one sampler, kept on the newest published weights, turning jobs into groups.

The same class runs in a thread, in a spawned process and inside a Ray actor; only the store it
reads weights from differs.
"""

from __future__ import annotations

import time

from coderl.asyncrl.types import Group, Job, Sampler
from coderl.asyncrl.weights import WeightStore


class RolloutWorker:
    def __init__(self, name: str, sampler: Sampler, store: WeightStore, *, turn_sync: bool) -> None:
        self.name = name
        self.sampler = sampler
        self.store = store
        self.turn_sync = turn_sync
        self.version = -1
        """Version of the weights the sampler holds; -1 before the first load."""

    def sync(self) -> int:
        """Load the newest published weights if they are newer than ours; return our version."""
        if self.store.latest_version() > self.version:
            version, weights = self.store.get()
            self.sampler.load_weights(version, weights)
            self.version = version
        return self.version

    def _current(self) -> int:
        return self.version

    def run(self, job: Job) -> Group:
        """Pick up new weights, then run and grade one group for ``job``.

        Raises:
            LookupError: no weights were ever published.
        """
        return self.run_rollout([job])[0]

    def run_rollout(self, jobs: list[Job]) -> list[Group]:
        """Pick up new weights, then run and grade the groups of ``jobs`` in one rollout (one
        job: ``sampler.rollout``; several: ``sampler.rollout_batch``). Each group is charged an
        equal share of the wall time.

        Raises:
            LookupError: no weights were ever published.
            TypeError: several jobs and a sampler without ``rollout_batch``.
        """
        started = time.monotonic()
        if self.sync() < 0:
            raise LookupError("no weights published before the first job")
        version = self.version
        between_turns = self.sync if self.turn_sync else self._current
        if len(jobs) == 1:
            groups = [self.sampler.rollout(jobs[0], between_turns)]
        elif hasattr(self.sampler, "rollout_batch"):
            groups = self.sampler.rollout_batch(jobs, between_turns)
        else:
            raise TypeError(
                f"{type(self.sampler).__name__} has no rollout_batch: set tasks_per_rollout=1"
            )
        share = (time.monotonic() - started) / len(jobs)
        return [
            Group(job, episodes, self.name, started, share, version)
            for job, episodes in zip(jobs, groups, strict=True)
        ]
