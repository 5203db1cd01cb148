"""The asynchronous training loop: rollout workers fill a buffer, the trainer takes admitted groups.

Per iteration the trainer (this thread):

1. tops up the workers: at most ``(max_staleness + 1) * groups_per_step`` groups are outstanding
   (issued, not yet trained on or dropped), the rollout bound of AReaL (Fu et al. 2025, Sec. 5.1);
2. collects finished groups; evicts those with ``version - oldest_version > max_staleness`` and
   drops or re-samples them (admission control, the hard bound);
3. when ``groups_per_step`` admitted groups wait, takes one step and, when it updated the
   weights, publishes them under ``version + 1`` (a step that updated nothing, every episode
   masked, keeps the version: versions count updates, so staleness is not inflated by it).

Jobs go out in rollouts: the first attempts of one block of ``tasks_per_rollout`` consecutive
tasks are rolled out together by one worker in one batched call (a re-sample goes alone); see
:func:`coderl.asyncrl.buffer.job_seed` for their seeds.

With ``max_staleness=0`` only ``groups_per_step`` groups are ever outstanding and they are issued
after the weights they must use were published; with ``tasks_per_rollout = groups_per_step =
tasks.tasks_per_step`` each step is one rollout seeded as ``coderl train`` seeds that step, so the
run is ``coderl train`` exactly: same tasks, samples, batches and weights (tested against it).

A checkpoint (:meth:`AsyncRunner.state_dict`) may be taken with groups in flight; they are saved as
tasks to re-issue, so a resumed run neither skips nor repeats a task (tested). Their partial work
is lost and redone with the resumed weights. Ctrl-C and SIGTERM land only while the trainer waits
for groups: the ledger's changes, a step and its ``on_step`` hook run with them held
(:func:`coderl.train.interrupt.deferred_interrupts`), so the runner is always between steps when
one arrives.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from typing import Any, Protocol

from coderl.asyncrl.buffer import EpisodeBuffer, TaskLedger, TaskStream
from coderl.asyncrl.local import LocalBackend
from coderl.asyncrl.metrics import AsyncMetrics, hist_mean, token_staleness
from coderl.asyncrl.types import Group, Job, Learner, SamplerFactory, Weights
from coderl.config import AsyncConfig
from coderl.train.interrupt import deferred_interrupts


class RolloutBackend(Protocol):
    """Where rollout workers live. ``publish`` must be visible to jobs submitted after it."""

    num_workers: int

    def publish(self, version: int, weights: Weights) -> None: ...
    def submit(self, jobs: list[Job]) -> None:
        """Queue one rollout: ``jobs`` run together on one worker."""
        ...

    def poll(self, timeout: float) -> list[Group]: ...
    def close(self) -> None: ...


def _local_backend(cfg: AsyncConfig, make_sampler: SamplerFactory, **_: Any) -> RolloutBackend:
    return LocalBackend(
        make_sampler,
        num_workers=cfg.num_workers,
        mode=cfg.local_mode,
        turn_sync=cfg.mid_episode_sync,
    )


def _ray_backend(cfg: AsyncConfig, make_sampler: SamplerFactory, **kw: Any) -> RolloutBackend:
    ray_backend = importlib.import_module("coderl.asyncrl.ray_backend")  # needs coderl[ray]
    backend: RolloutBackend = ray_backend.RayBackend(cfg, make_sampler, **kw)
    return backend


BACKENDS: dict[str, Callable[..., RolloutBackend]] = {"local": _local_backend, "ray": _ray_backend}
"""Backend name -> constructor; the only place a name selects a backend."""


def make_backend(cfg: AsyncConfig, make_sampler: SamplerFactory, **kw: Any) -> RolloutBackend:
    """Build ``cfg.backend``. Raises ValueError for an unknown name (lists the valid ones)."""
    if cfg.backend not in BACKENDS:
        raise ValueError(f"unknown async backend {cfg.backend!r}; valid: {sorted(BACKENDS)}")
    return BACKENDS[cfg.backend](cfg, make_sampler, **kw)


StepHook = Callable[["AsyncRunner", dict[str, float]], None]


class AsyncRunner:
    """Runs ``learner`` on groups produced by rollout workers, with bounded staleness.

    Args:
        cfg: the async section; ``groups_per_step`` must be set (``tasks_per_rollout`` None: 1).
        seed: the run seed (job seeds derive from it).

    Raises:
        ValueError: ``cfg.groups_per_step`` is None, or ``tasks_per_rollout`` does not divide it.
    """

    def __init__(
        self,
        cfg: AsyncConfig,
        learner: Learner,
        make_sampler: SamplerFactory,
        tasks: TaskStream,
        *,
        seed: int = 0,
        backend: RolloutBackend | None = None,
        on_step: StepHook | None = None,
    ) -> None:
        if cfg.groups_per_step is None:
            raise ValueError("async.groups_per_step must be set (train_async resolves it)")
        self.rollout_size = cfg.tasks_per_rollout or 1
        if cfg.groups_per_step % self.rollout_size:
            raise ValueError(
                f"async.tasks_per_rollout={self.rollout_size} must divide "
                f"async.groups_per_step={cfg.groups_per_step}"
            )
        self.cfg = cfg
        self.groups_per_step: int = cfg.groups_per_step
        self.learner = learner
        self.make_sampler = make_sampler
        self.ledger = TaskLedger(tasks, seed=seed, tasks_per_rollout=self.rollout_size)
        self.buffer = EpisodeBuffer(cfg.max_staleness)
        self.backend = backend
        self.on_step = on_step
        self.metrics = AsyncMetrics(num_workers=cfg.num_workers)
        self.history: list[dict[str, float]] = []
        """Per-step metrics from the learner plus ``version``, ``staleness_max`` (per group),
        ``token_staleness_mean`` and ``token_staleness_max`` (per sampled token)."""
        self._published = -1
        self.trained_tasks: list[int] = []
        """Task indices trained on, in order (a task re-sampled after a drop appears once)."""

    # ----------------------------------------------------------------- checkpoint and resume
    def state_dict(self) -> dict[str, Any]:
        """Learner state plus the task ledger; outstanding groups become tasks to re-issue."""
        return {"learner": self.learner.state_dict(), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore before :meth:`run`. Raises RuntimeError once workers have started."""
        if self._published >= 0:
            raise RuntimeError("load_state_dict must be called before run() publishes weights")
        self.learner.load_state_dict(state["learner"])
        self.ledger.load_state_dict(state["ledger"])

    # ----------------------------------------------------------------- the loop
    def run(self, num_steps: int) -> dict[str, Any]:
        """Train until the learner has taken ``num_steps`` steps (:attr:`Learner.steps`, with
        or without an update); return :meth:`summary`.

        Raises:
            ValueError: ``num_steps`` is negative.
            WorkerError (or the backend's error type): a rollout worker failed.
        """
        if num_steps < 0:
            raise ValueError(f"num_steps must be >= 0, got {num_steps}")
        if self.backend is None:
            self.backend = make_backend(self.cfg, self.make_sampler)
        if self._published < 0:
            self.metrics.started = time.monotonic()  # rates count from the first run, not __init__
        if self.learner.version > self._published:
            self.backend.publish(self.learner.version, self.learner.weights())
            self._published = self.learner.version
        B = self.groups_per_step
        cap = (self.cfg.max_staleness + 1) * B
        while self.learner.steps < num_steps:
            with deferred_interrupts():
                self._fill(cap)
            ready = len(self.buffer) >= B
            t0 = time.monotonic()
            groups = self.backend.poll(0.0 if ready else self.cfg.poll_s)  # Ctrl-C lands here
            with deferred_interrupts():  # the ledger, the step and its hook: whole or not begun
                for group in groups:
                    self._receive(group)
                if not ready:
                    self.metrics.trainer_wait_s += time.monotonic() - t0
                self._evict_stale()
                batch = self.buffer.take(B, self.learner.version)
                if batch is not None:
                    self._train(batch)
                    self._fill(cap)  # in flight before the hook sees the state
                    if self.on_step is not None:
                        self.on_step(self, self.history[-1])
        return self.summary()

    def _fill(self, cap: int) -> None:
        assert self.backend is not None
        while (room := cap - len(self.ledger.outstanding)) > 0:
            self.backend.submit(self.ledger.next_rollout(min(room, self.rollout_size)))

    def _receive(self, group: Group) -> None:
        self.metrics.trajectories_generated += len(group.episodes)
        self.metrics.rollout_busy_s += group.duration_s
        self.buffer.put(group)

    def _evict_stale(self) -> None:
        version = self.learner.version
        for staleness, group in self.buffer.evict_stale(version):
            self.metrics.stale_staleness[staleness] += 1
            if self.cfg.stale_policy == "resample" and group.job.attempt < self.cfg.max_resamples:
                self.ledger.resample(group.job)
                self.metrics.resampled_groups += 1
            else:
                self.ledger.dropped(group.job)
                self.metrics.dropped_groups += 1

    def _train(self, batch: list[Group]) -> None:
        assert self.backend is not None
        version, steps = self.learner.version, self.learner.steps
        staleness = [version - g.oldest_version() for g in batch]
        tokens = token_staleness(batch, version)
        t0 = time.monotonic()
        step = dict(self.learner.train_step(batch))
        self.metrics.train_s += time.monotonic() - t0
        if self.learner.steps != steps + 1 or self.learner.version not in (version, version + 1):
            raise RuntimeError(
                "learner.train_step must take one step and advance the version by 1 (an "
                f"update) or 0 (none): steps {steps} -> {self.learner.steps}, version "
                f"{version} -> {self.learner.version}"
            )
        if self.learner.version > self._published:  # the same weights are not sent again
            self.backend.publish(self.learner.version, self.learner.weights())
            self._published = self.learner.version
        for group, s in zip(batch, staleness, strict=True):
            self.ledger.consumed(group.job)
            self.metrics.staleness[s] += 1
            self.metrics.trajectories_trained += len(group.episodes)
            self.trained_tasks.append(group.job.index)
        self.metrics.token_staleness.update(tokens)
        self.metrics.steps += 1
        if "logprob_gap" in step:
            self.metrics.logprob_gaps.append(step["logprob_gap"])
        step.update(
            version=float(self.learner.version),
            staleness_max=float(max(staleness)),
            token_staleness_mean=hist_mean(tokens),
            token_staleness_max=float(max(tokens, default=0)),
        )
        self.history.append(step)

    def summary(self) -> dict[str, Any]:
        return self.metrics.summary()

    def close(self) -> None:
        """Stop the workers; groups in flight are abandoned (they stay outstanding in the
        ledger, so a checkpoint taken now re-issues them)."""
        if self.backend is not None:
            self.backend.close()
            self.backend = None

    def __enter__(self) -> AsyncRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
