"""The ``local`` backend: rollout workers as threads or as spawned processes on this machine.

- ``thread``: workers share the trainer's process and a :class:`MemoryWeightStore`. Right when
  rollouts wait (sandboxed test runs, an inference server, environment latency): waiting releases
  the GIL. Python-heavy sampling serialises on the GIL.
- ``process``: one ``spawn``-ed process per worker, each with its own sampler, reading weights from
  a :class:`FileWeightStore` in a temporary directory. Costs a process start (torch import, ~2 s)
  per worker and a safetensors write per published version.

A worker that raises stops the run: :meth:`poll` re-raises its error in the trainer.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import shutil
import tempfile
import threading
import time
import traceback
from typing import Any

from coderl.asyncrl.types import Group, Job, SamplerFactory, Weights
from coderl.asyncrl.weights import FileWeightStore, MemoryWeightStore, WeightStore
from coderl.asyncrl.worker import RolloutWorker

_STOP = None
_BUILD_LOCK = threading.Lock()
"""Sampler factories run one at a time: model builders seed torch's process-wide RNG, and two
threads building at once would interleave their draws (and get different base weights)."""


class WorkerError(RuntimeError):
    """A rollout worker raised; the message carries its name and traceback."""


def _serve(
    worker_name: str,
    make: SamplerFactory,
    store: WeightStore,
    turn_sync: bool,
    jobs: Any,
    results: Any,
) -> None:
    """Worker main loop: a rollout's jobs in, their groups (or the error) out, until the stop
    sentinel."""
    try:
        with _BUILD_LOCK:
            sampler = make()
        worker = RolloutWorker(worker_name, sampler, store, turn_sync=turn_sync)
        while (rollout := jobs.get()) is not _STOP:
            results.put(worker.run_rollout(rollout))
    except BaseException:  # the domain: a worker's failure is reported to the trainer
        results.put(WorkerError(f"rollout worker {worker_name} failed:\n{traceback.format_exc()}"))


class LocalBackend:
    """Rollout workers on this machine; the trainer talks to them through two queues."""

    def __init__(
        self,
        make_sampler: SamplerFactory,
        *,
        num_workers: int,
        mode: str = "thread",
        turn_sync: bool = False,
    ) -> None:
        if mode not in ("thread", "process"):
            raise ValueError(f"unknown local mode {mode!r}; valid: ['thread', 'process']")
        self.num_workers = num_workers
        self.mode = mode
        self._tmp: str | None = None
        self._workers: list[Any] = []
        self.store: WeightStore
        if mode == "thread":
            self.store = MemoryWeightStore()
            self._jobs: Any = queue.Queue()
            self._results: Any = queue.Queue()
            for i in range(num_workers):
                t = threading.Thread(
                    target=_serve,
                    name=f"rollout-{i}",
                    daemon=True,
                    args=(
                        f"thread-{i}",
                        make_sampler,
                        self.store,
                        turn_sync,
                        self._jobs,
                        self._results,
                    ),
                )
                self._workers.append(t)
        else:
            ctx = mp.get_context("spawn")
            self._tmp = tempfile.mkdtemp(prefix="coderl-weights-")
            self.store = FileWeightStore(self._tmp)
            self._jobs = ctx.Queue()
            self._results = ctx.Queue()
            for i in range(num_workers):
                p = ctx.Process(
                    target=_serve,
                    name=f"rollout-{i}",
                    daemon=True,
                    args=(
                        f"process-{i}",
                        make_sampler,
                        self.store,
                        turn_sync,
                        self._jobs,
                        self._results,
                    ),
                )
                self._workers.append(p)
        for w in self._workers:
            w.start()

    def publish(self, version: int, weights: Weights) -> None:
        self.store.publish(version, weights)

    def submit(self, jobs: list[Job]) -> None:
        """Queue one rollout (its jobs run together on one worker)."""
        self._jobs.put(list(jobs))

    def poll(self, timeout: float) -> list[Group]:
        """Finished groups: waits up to ``timeout`` seconds for the first, then takes what is there.

        Raises:
            WorkerError: a worker failed (its traceback is in the message).
        """
        out: list[Group] = []
        try:
            item = self._results.get(timeout=timeout) if timeout > 0 else self._results.get_nowait()
            while True:
                if isinstance(item, WorkerError):
                    raise item
                out.extend(item)
                item = self._results.get_nowait()
        except queue.Empty:
            return out

    def poll_discard(self) -> None:
        """Read and drop every waiting result (used while shutting down)."""
        try:
            while True:
                self._results.get_nowait()
        except queue.Empty:
            pass

    def close(self) -> None:
        """Drop queued jobs, stop the workers (after their current group), remove weight files."""
        try:
            while True:
                self._jobs.get_nowait()
        except queue.Empty:
            pass
        for _ in self._workers:
            self._jobs.put(_STOP)
        deadline = time.monotonic() + 10
        while any(w.is_alive() for w in self._workers) and time.monotonic() < deadline:
            self.poll_discard()  # a process cannot exit while its results sit unread in a pipe
            for w in self._workers:
                w.join(timeout=0.05)
        for w in self._workers:
            if self.mode == "process" and w.is_alive():
                w.terminate()
                w.join()
        if self.mode == "process":
            self._jobs.close()
            self._results.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._workers = []
