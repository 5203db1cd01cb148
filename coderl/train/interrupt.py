"""Ctrl-C and SIGTERM at a consistent point of a training step.

A step mutates the run in two places: the task sampler while it rolls out (cursor, a pool's
estimates), and the weights, optimizer and version when it updates. :func:`deferred_interrupts`
holds a signal that lands inside the update until the step is whole; :class:`StepSnapshot`
keeps the sampler's state from before the step, so a step interrupted in its rollouts (the long
part) is abandoned and the state of the last completed step is what the checkpoint holds
(:func:`coderl.train.loop.train`).

``coderl train-async`` holds signals the same way around its ledger changes and steps and
checkpoints the last completed step (:func:`coderl.asyncrl.trainer.train_async`).

A sharded run (torchrun) cannot stop where the signal lands: its ranks are at different points,
a checkpoint is a collective, and a rank blocked in one does not see the signal. There a signal
only marks the stop, and the ranks agree at each step's end to stop together
(:class:`AgreedStop`); the step in progress is finished, not abandoned. Not covered there: a
signal before the first step (model load, the evaluation before training) stops each rank where
it lands, as in one process; nothing is lost, but a rank blocked in a collective may end with
the backend's error.
"""

from __future__ import annotations

import copy
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block; a signal that arrived in it is raised again as
    the block ends, to the handler that was there before (the CLI's: ``KeyboardInterrupt``).
    Outside the main thread (no handler can be set there) nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])


@dataclass
class StepSnapshot:
    """What a checkpoint of the last completed step needs that a step in progress changes
    before its update: the step number and the sampler's cursor and state
    (:func:`coderl.train.run.save`)."""

    step: int
    cursor: int
    sampler: dict[str, Any]

    @classmethod
    def of(cls, run: Any) -> StepSnapshot:
        """The snapshot of ``run`` (a :class:`coderl.train.run.Run`) between steps."""
        return cls(run.step, run.sampler.position, copy.deepcopy(run.sampler.state_dict()))

    def state(self) -> dict[str, Any]:
        """The entries of ``state.json`` that :func:`coderl.train.run.save` takes from the
        sampler, as they were at the snapshot."""
        return {"cursor": self.cursor, **({"sampler": self.sampler} if self.sampler else {})}


class StepInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM held through a step's update and raised once the step was complete:
    ``metrics`` are the step's, not yet logged (:func:`coderl.train.loop.training_step`)."""

    def __init__(self, metrics: dict[str, float]) -> None:
        super().__init__()
        self.metrics = metrics


REPEAT_S = 1.0
"""A repeat of the first signal within this many seconds is the same stop, not a second one: a
scheduler that signals every process of a job (Slurm's ``scancel``) reaches each rank, and
torchrun passes the signal on to each rank again."""


class AgreedStop:
    """Ctrl-C and SIGTERM in a sharded run (``sharded``): every rank stops at the end of the same
    step, so the caller can checkpoint it collectively (:func:`coderl.train.loop.train`).

    In the block a signal only marks the stop. :meth:`check`, which every rank calls at the end
    of each step, gathers the ranks' marks; if any rank has one, every rank delivers the
    strongest (SIGTERM over SIGINT) to the handler that was there before (the CLI's: a
    ``KeyboardInterrupt``, exit 143 or 130) and :attr:`agreed` is set. A second signal more than
    :data:`REPEAT_S` after the first goes to that handler at once: the rank stops promptly, with
    no checkpoint (the others are stopped by torchrun). Not sharded, or outside the main thread:
    nothing is changed and :meth:`check` is free."""

    def __init__(self, sharded: bool) -> None:
        self.active = sharded and threading.current_thread() is threading.main_thread()
        self.agreed = False
        self._first: tuple[int, float] | None = None  # (signal, monotonic time)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> AgreedStop:
        if self.active:
            self._previous = {s: signal.signal(s, self._mark) for s in _SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _mark(self, signum: int, frame: Any) -> None:
        if self._first is None:
            self._first = (signum, time.monotonic())
        elif time.monotonic() - self._first[1] > REPEAT_S:
            self._deliver(signum)

    def _deliver(self, signum: int) -> None:
        handler = self._previous[signum]
        if callable(handler):
            handler(signum, None)
        else:  # SIG_DFL, SIG_IGN: what the signal did before the block
            signal.signal(signum, handler)
            signal.raise_signal(signum)

    def check(self) -> None:
        """Every rank calls it between steps (one ``all_gather_object``): returns if no rank
        has a signal; else delivers one on every rank (see the class docstring)."""
        if not self.active:
            return
        from coderl.train.distributed import gather

        signum = max(gather(self._first[0] if self._first else 0))
        if signum:
            self.agreed = True
            self._deliver(signum)
