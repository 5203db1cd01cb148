"""The ``ray`` backend: rollout workers, graders and (optionally) the trainer as Ray actors.

The objects are the local ones (:class:`RolloutWorker`, a :class:`Sampler`, a :class:`Learner`)
wrapped in actors; weights travel through Ray's object store, and a small actor maps the newest
version to its object reference. :func:`coderl.ray_cluster.ensure_ray` starts a local Ray
(``ray_num_cpus``), or joins a running cluster with ``ray_address="auto"``; actors then land on
whichever nodes have the CPUs and GPUs they reserve. A backend that started Ray shuts it down on
:meth:`RayBackend.close`.

Needs ``pip install coderl[ray]``. Not fault-tolerant: a dead actor fails the run (resume from the
last checkpoint; no task is skipped or repeated).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import ray

from coderl.asyncrl.types import Grader, Group, Job, Learner, SamplerFactory, Weights
from coderl.asyncrl.worker import RolloutWorker
from coderl.config import AsyncConfig
from coderl.ray_cluster import ensure_ray, shutdown_owned_ray


class _StoreActor:
    """Newest (version, [object ref of the weights]); the list keeps Ray from resolving the ref."""

    def __init__(self) -> None:
        self.version = -1
        self.holder: list[Any] = []

    def publish(self, version: int, holder: list[Any]) -> None:
        if version <= self.version:
            raise ValueError(
                f"weight versions must increase: publishing {version} after {self.version}"
            )
        self.version, self.holder = version, holder

    def latest_version(self) -> int:
        return self.version

    def get(self) -> tuple[int, list[Any]]:
        return self.version, self.holder


class RayWeightStore:
    """Client of the store actor, usable from the driver and from any actor (pickles)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def publish(self, version: int, weights: Weights | ray.ObjectRef) -> None:
        """Put ``weights`` (or take an existing object ref of them) and make it the newest;
        returns once workers can see it."""
        ref = weights if isinstance(weights, ray.ObjectRef) else ray.put(weights)
        ray.get(self.actor.publish.remote(version, [ref]))

    def latest_version(self) -> int:
        return int(ray.get(self.actor.latest_version.remote()))

    def get(self) -> tuple[int, Weights]:
        version, holder = ray.get(self.actor.get.remote())
        if version < 0:
            raise LookupError("no weights have been published yet")
        return version, ray.get(holder[0])


class _RolloutActor:
    def __init__(
        self, name: str, make_sampler: SamplerFactory, store: RayWeightStore, turn_sync: bool
    ) -> None:
        self.worker = RolloutWorker(name, make_sampler(), store, turn_sync=turn_sync)

    def run(self, jobs: list[Job]) -> list[Group]:
        return self.worker.run_rollout(jobs)


class _GraderActor:
    def __init__(self, make_grader: Callable[[], Grader]) -> None:
        self.grader = make_grader()

    def grade(self, groups: list[Group]) -> list[Group]:
        out = []
        for group in groups:
            started = time.monotonic()
            graded = self.grader.grade(group)
            graded.duration_s += time.monotonic() - started
            out.append(graded)
        return out


class RayBackend:
    """Rollout-worker actors fed from a driver-side queue, optionally chained into graders."""

    def __init__(
        self,
        cfg: AsyncConfig,
        make_sampler: SamplerFactory,
        *,
        make_grader: Callable[[], Grader] | None = None,
    ) -> None:
        if cfg.ray_num_graders > 0 and make_grader is None:
            raise ValueError("async.ray_num_graders > 0 needs a grader factory (make_grader=...)")
        self.num_workers = cfg.num_workers
        self.owns_ray = ensure_ray(cfg.ray_address, cfg.ray_num_cpus)
        try:
            self._start_actors(cfg, make_sampler, make_grader)
        except BaseException:
            if self.owns_ray:
                shutdown_owned_ray()
            raise

    def _start_actors(
        self,
        cfg: AsyncConfig,
        make_sampler: SamplerFactory,
        make_grader: Callable[[], Grader] | None,
    ) -> None:
        self.store = RayWeightStore(ray.remote(_StoreActor).options(num_cpus=0).remote())
        actor = ray.remote(_RolloutActor).options(
            num_cpus=cfg.ray_worker_cpus, num_gpus=cfg.ray_worker_gpus
        )
        turn_sync = cfg.mid_episode_sync
        self.workers = [
            actor.remote(f"ray-{i}", make_sampler, self.store, turn_sync)
            for i in range(cfg.num_workers)
        ]
        grader = ray.remote(_GraderActor).options(num_cpus=cfg.ray_worker_cpus)
        self.graders = [grader.remote(make_grader) for _ in range(cfg.ray_num_graders)]
        self._idle: deque[Any] = deque(self.workers)
        self._queue: deque[list[Job]] = deque()  # rollouts waiting for a worker
        self._rollouts: dict[Any, Any] = {}  # rollout ref -> the worker running it
        self._results: list[Any] = []  # refs of finished (graded) groups
        self._next_grader = 0

    def publish(self, version: int, weights: Weights) -> None:
        self.store.publish(version, weights)

    def submit(self, jobs: list[Job]) -> None:
        self._queue.append(list(jobs))
        self._dispatch()

    def _dispatch(self) -> None:
        while self._idle and self._queue:
            worker = self._idle.popleft()
            ref = worker.run.remote(self._queue.popleft())
            self._rollouts[ref] = worker
            if self.graders:
                grader = self.graders[self._next_grader % len(self.graders)]
                self._next_grader += 1
                ref = grader.grade.remote(ref)  # Ray hands the group over when it is ready
            self._results.append(ref)

    def poll(self, timeout: float) -> list[Group]:
        """Finished groups: waits up to ``timeout`` seconds for any progress.

        Raises:
            ray.exceptions.RayTaskError: a worker or grader raised (wraps its error).
        """
        pending = list(
            dict.fromkeys([*self._rollouts, *self._results])
        )  # without graders they coincide
        if not pending:
            time.sleep(timeout)
            return []
        ray.wait(pending, num_returns=1, timeout=timeout)
        if self._rollouts:
            done, _ = ray.wait(list(self._rollouts), num_returns=len(self._rollouts), timeout=0)
            for ref in done:
                self._idle.append(self._rollouts.pop(ref))
            self._dispatch()
        if not self._results:
            return []
        ready, rest = ray.wait(self._results, num_returns=len(self._results), timeout=0)
        self._results = rest
        return [g for groups in ray.get(ready) for g in groups]

    def close(self) -> None:
        """Kill the actors; shut Ray down if this backend started it."""
        if not ray.is_initialized():
            return
        for a in [*self.workers, *self.graders, self.store.actor]:
            ray.kill(a)
        self.workers, self.graders = [], []
        self._rollouts, self._results, self._queue = {}, [], deque()
        if self.owns_ray and ray.is_initialized():
            shutdown_owned_ray()


class _LearnerActor:
    def __init__(self, make_learner: Callable[[], Learner]) -> None:
        self.learner = make_learner()

    def version(self) -> tuple[int, int]:
        return self.learner.version, self.learner.steps

    def train_step(self, groups: list[Group]) -> tuple[dict[str, float], int, int]:
        return self.learner.train_step(groups), self.learner.version, self.learner.steps

    def weights(self) -> Weights:
        return self.learner.weights()

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        self.learner.load_state_dict(state)
        return self.learner.version, self.learner.steps

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.learner, method)(*args)


class RayLearner:
    """A :class:`Learner` inside a Ray actor (e.g. on the GPU node), behind the same interface.

    :meth:`weights` returns an object reference: the weights go from the trainer's node to the
    workers through the object store without passing through the driver.
    """

    def __init__(
        self, make_learner: Callable[[], Learner], *, num_cpus: float = 1.0, num_gpus: float = 0.0
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("start Ray first (coderl.ray_cluster.ensure_ray)")
        opts = ray.remote(_LearnerActor).options(num_cpus=num_cpus, num_gpus=num_gpus)
        self.actor = opts.remote(make_learner)
        self.version, self.steps = ray.get(self.actor.version.remote())

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        metrics, self.version, self.steps = ray.get(self.actor.train_step.remote(groups))
        return metrics

    def weights(self) -> Any:
        return self.actor.weights.remote()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = ray.get(self.actor.state_dict.remote())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version, self.steps = ray.get(self.actor.load_state_dict.remote(state))

    def call(self, method: str, *args: Any) -> Any:
        """Call any other method of the wrapped learner (e.g. an evaluation)."""
        return ray.get(self.actor.call.remote(method, *args))

    def close(self) -> None:
        ray.kill(self.actor)
