"""Progress of a long phase (training steps, evaluation batches): elapsed time and ETA.

On a terminal (stderr is a TTY) a rich progress bar; otherwise (``make demo > demo.log 2>&1``,
``nohup``, a cluster job) one plain line per update on stderr, e.g.
``eval 8/40 elapsed 0:01:02 eta 0:04:08 resolved 3``, where rich's bar would print nothing until
the end (and no carriage returns land in a log file). stdout stays free for a command's result
(``coderl eval`` prints one JSON document). In a ``torchrun`` run only rank 0 shows progress
(``RANK`` unset or 0).
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def eta_s(elapsed: float, done: int, total: int, start: int = 0) -> float | None:
    """Seconds left at the rate of the ``done - start`` units so far (None: none done yet)."""
    if done <= start:
        return None
    return elapsed / (done - start) * max(total - done, 0)


class PhaseProgress:
    """``with PhaseProgress("train", total=N) as p: ... p.advance(status="reward 0.5")``.

    ``enabled=False`` shows nothing; ``stream`` (default stderr) decides terminal or plain lines.
    """

    def __init__(
        self,
        description: str,
        total: int,
        *,
        completed: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self.description, self.total, self.done, self.start = (
            description,
            total,
            completed,
            completed,
        )
        rank0 = int(os.environ.get("RANK", "0") or 0) == 0  # torchrun: one rank speaks
        self.enabled, self.stream = enabled and rank0, stream or sys.stderr
        self.bar: Progress | None = None
        self.t0 = time.perf_counter()

    def __enter__(self) -> PhaseProgress:
        self.t0 = time.perf_counter()
        if self.enabled and self.stream.isatty():
            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                console=Console(file=self.stream),
            )
            self.bar.__enter__()
            self.job = self.bar.add_task(
                self.description, total=self.total, completed=self.done, status=""
            )
        return self

    def advance(self, n: int = 1, status: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.job, advance=n, status=status)
            return
        elapsed = time.perf_counter() - self.t0
        left = eta_s(elapsed, self.done, self.total, self.start)
        eta = "?" if left is None else _clock(left)
        line = f"{self.description} {self.done}/{self.total} elapsed {_clock(elapsed)} eta {eta}"
        print(f"{line} {status}".rstrip(), file=self.stream, flush=True)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        err: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.bar is not None:
            self.bar.__exit__(kind, err, tb)
