"""Task ledger, episode buffer and admission control with bounded staleness.

- :class:`TaskLedger` hands out jobs from the task stream and remembers which are outstanding
  (issued, not yet trained on or dropped), so that a resumed run re-issues exactly those: no task
  is skipped, none is trained on twice.
- :class:`EpisodeBuffer` holds complete groups until the trainer takes them. Before each take it
  applies admission control: a group is admitted only if
  ``current_version - oldest_version_in_group <= max_staleness`` (AReaL, Fu et al. 2025,
  Sec. 5.1, "staleness-aware training"); older groups are returned to the caller to be dropped or
  re-sampled.

Both are owned by the trainer's thread; neither is thread-safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from coderl.asyncrl.types import Group, Job
from coderl.train.pipeline import rollout_seed

TaskStream = Callable[[int], tuple[str, Any]]
"""Task index -> ``(task_id, task)``; deterministic, defined for every index >= 0."""


def job_seed(run_seed: int, index: int, attempt: int, tasks_per_rollout: int = 1) -> int:
    """Sampling seed of a job: a pure function of (run seed, task index, attempt), so that the
    same job samples the same tokens whichever worker runs it and however the run was resumed.

    A first attempt takes the seed of its rollout block (task indices ``[b * n, (b + 1) * n)``
    with ``n = tasks_per_rollout``), ``rollout_seed(run_seed, b)``: the seed ``coderl train``
    gives step ``b`` when ``n`` is its tasks per step. A re-sample (``attempt >= 1``) rolls out
    alone with ``rollout_seed(run_seed, index, attempt)``, which no block seed equals.
    """
    if attempt == 0:
        return rollout_seed(run_seed, index // tasks_per_rollout)
    return rollout_seed(run_seed, index, attempt)


def cycle_tasks(tasks: list[tuple[str, Any]]) -> TaskStream:
    """A task stream that walks ``tasks`` in order, epoch after epoch.

    Raises:
        ValueError: ``tasks`` is empty.
    """
    if not tasks:
        raise ValueError("the task list is empty")
    return lambda i: tasks[i % len(tasks)]


class TaskLedger:
    """Issues jobs in task-stream order and tracks the outstanding ones."""

    def __init__(self, stream: TaskStream, *, seed: int = 0, tasks_per_rollout: int = 1) -> None:
        if tasks_per_rollout < 1:
            raise ValueError(f"tasks_per_rollout must be >= 1, got {tasks_per_rollout}")
        self.stream = stream
        self.seed = seed
        self.tasks_per_rollout = tasks_per_rollout
        self.next_index = 0
        """Index of the next fresh task in the stream."""
        self.retry: deque[tuple[int, int]] = deque()
        """(index, attempt) to issue before fresh tasks: re-samples and resumed jobs."""
        self.outstanding: dict[int, Job] = {}
        """Issued jobs not yet trained on or dropped, by task index."""

    def _peek(self) -> tuple[int, int]:
        return self.retry[0] if self.retry else (self.next_index, 0)

    def next_job(self) -> Job:
        """The next job: a queued retry if any, else the next fresh task."""
        if self.retry:
            index, attempt = self.retry.popleft()
        else:
            index, attempt = self.next_index, 0
            self.next_index += 1
        task_id, task = self.stream(index)
        seed = job_seed(self.seed, index, attempt, self.tasks_per_rollout)
        job = Job(index, task, task_id, seed, attempt)
        self.outstanding[index] = job
        return job

    def next_rollout(self, limit: int) -> list[Job]:
        """The next jobs to roll out together (at most ``limit``, at least one): first attempts
        of one rollout block, in index order; a re-sample goes alone.

        Raises:
            ValueError: ``limit < 1``.
        """
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        jobs = [self.next_job()]
        n, first = self.tasks_per_rollout, jobs[0]
        while first.attempt == 0 and len(jobs) < limit:
            index, attempt = self._peek()
            if attempt != 0 or index // n != first.index // n or index != jobs[-1].index + 1:
                break
            jobs.append(self.next_job())
        return jobs

    def _pop(self, job: Job) -> None:
        if job.index not in self.outstanding:
            raise KeyError(f"job for task index {job.index} is not outstanding")
        del self.outstanding[job.index]

    def consumed(self, job: Job) -> None:
        """The job's group was trained on. Raises KeyError if it was not outstanding."""
        self._pop(job)

    def dropped(self, job: Job) -> None:
        """The job's group was dropped as too stale; its task is not trained on."""
        self._pop(job)

    def resample(self, job: Job) -> None:
        """Queue the job's task again, first in line, as attempt + 1."""
        self._pop(job)
        self.retry.appendleft((job.index, job.attempt + 1))

    def state_dict(self) -> dict[str, Any]:
        """Plain-JSON state. Outstanding jobs (in flight or buffered) are saved as retries in
        index order: a resumed run re-issues them instead of skipping them."""
        pending = sorted(
            [(j.index, j.attempt) for j in self.outstanding.values()] + list(self.retry)
        )
        return {
            "next_index": self.next_index,
            "retry": [list(p) for p in pending],
            "seed": self.seed,
            "tasks_per_rollout": self.tasks_per_rollout,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; anything outstanding in this ledger is forgotten (its results are discarded).

        Raises:
            ValueError: the state was saved with a different run seed.
        """
        if state["seed"] != self.seed:
            raise ValueError(f"ledger seed {state['seed']} differs from this run's {self.seed}")
        if state.get("tasks_per_rollout", 1) != self.tasks_per_rollout:
            raise ValueError(
                f"ledger tasks_per_rollout {state.get('tasks_per_rollout', 1)} differs from this "
                f"run's {self.tasks_per_rollout} (the seeds of its first attempts would change)"
            )
        self.next_index = int(state["next_index"])
        self.retry = deque((int(i), int(a)) for i, a in state["retry"])
        self.outstanding = {}


class EpisodeBuffer:
    """Complete groups waiting for the trainer, with staleness-bounded admission."""

    def __init__(self, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._waiting: list[tuple[int, Group]] = []  # (oldest version, group)

    def __len__(self) -> int:
        return len(self._waiting)

    def put(self, group: Group) -> None:
        """Add a complete group. Raises ValueError if it holds no versioned sampled token."""
        self._waiting.append((group.oldest_version(), group))

    def evict_stale(self, version: int) -> list[tuple[int, Group]]:
        """Remove and return ``(staleness, group)`` for every group with
        ``version - oldest_version > max_staleness``."""
        stale = [(version - v, g) for v, g in self._waiting if version - v > self.max_staleness]
        self._waiting = [(v, g) for v, g in self._waiting if version - v <= self.max_staleness]
        return stale

    def take(self, n: int, version: int) -> list[Group] | None:
        """``n`` admitted groups for the trainer at ``version``, or None if fewer are waiting.

        Call :meth:`evict_stale` first. The oldest groups go first (they are nearest to being
        dropped); the batch is returned in task-index order, so a batch does not depend on which
        worker finished first.

        Raises:
            ValueError: a waiting group is too stale for ``version`` (evict first).
        """
        if len(self._waiting) < n:
            return None
        if any(version - v > self.max_staleness for v, _ in self._waiting):
            raise ValueError(f"stale groups are waiting at version {version}; evict them first")
        self._waiting.sort(key=lambda vg: (vg[0], vg[1].job.index))
        batch, self._waiting = self._waiting[:n], self._waiting[n:]
        return sorted((g for _, g in batch), key=lambda g: g.job.index)
