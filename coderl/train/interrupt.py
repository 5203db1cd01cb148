"""Ctrl-C and SIGTERM at a consistent point of a training step.

A step mutates the run in two places: the task sampler while it rolls out (cursor, a pool's
estimates), and the weights, optimizer and version when it updates. :func:`deferred_interrupts`
holds a signal that lands inside the update until the step is whole; :class:`StepSnapshot`
keeps the sampler's state from before the step, so a step interrupted in its rollouts (the long
part) is abandoned and the state of the last completed step is what the checkpoint holds
(:func:`coderl.train.loop.train`).

``coderl train-async`` holds signals the same way around its ledger changes and steps and
checkpoints the last completed step (:func:`coderl.asyncrl.trainer.train_async`).

Not covered: a sharded run (torchrun ranks are interrupted at different points, a checkpoint is
a collective, and a rank blocked in one does not see the signal); it still loses the steps after
its last checkpoint, and rank 0 alone prints the line.
"""

from __future__ import annotations

import copy
import signal
import threading
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
