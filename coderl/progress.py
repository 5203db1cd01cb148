"""Progress of a long phase (training steps, evaluation batches): elapsed time and ETA.

On a terminal (stderr is a TTY) a rich progress bar; otherwise (``make demo > demo.log 2>&1``,
``nohup``, a cluster job) one plain line per update on stderr, e.g.
``eval 8/40 elapsed 0:01:02 eta 0:04:08 resolved 3``, where rich's bar would print nothing until
the end (and no carriage returns land in a log file). stdout stays free for a command's result
(``coderl eval`` prints one JSON document). In a ``torchrun`` run only rank 0 shows progress
(``RANK`` unset or 0).

A long stretch inside a phase (the rollout turns of one training step) shows its own progress
through :func:`inner_progress`: on a terminal a second row of the phase's bar (rich shows one
live display at a time), in a log its own lines, e.g.
``train 2/4: rollout turn 3/10 elapsed 0:00:41 eta 0:01:35 episodes done 5/16``. It shows only
inside a phase that shows progress, in the phase's thread (an asynchronous run's worker threads
stay quiet).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
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


_OPEN: list[PhaseProgress] = []
"""The phases open in this process that show progress, outermost first."""


class PhaseProgress:
    """``with PhaseProgress("train", total=N) as p: ... p.advance(status="reward 0.5")``.

    ``enabled=False`` shows nothing; ``stream`` (default stderr) decides terminal or plain lines;
    ``every_s``: in plain lines, at most one line per that many seconds, and the last one.
    """

    def __init__(
        self,
        description: str,
        total: int,
        *,
        completed: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        every_s: float = 0.0,
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
        self.own_bar = True  # False: a row of an outer phase's bar
        self.thread = threading.get_ident()
        self.t0 = self.said = time.perf_counter()
        self.every_s = every_s

    def __enter__(self) -> PhaseProgress:
        self.t0 = time.perf_counter()
        outer = next((p for p in reversed(_OPEN) if p.bar is not None), None)
        if self.enabled and self.stream.isatty() and outer is not None:
            self.bar, self.own_bar = outer.bar, False
        elif self.enabled and self.stream.isatty():
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
        if self.bar is not None:
            self.job = self.bar.add_task(
                self.description, total=self.total, completed=self.done, status=""
            )
        if self.enabled:  # a quiet phase (or another thread's) has no inner progress either
            _OPEN.append(self)
        return self

    def advance(self, n: int = 1, status: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.job, advance=n, status=status)
            return
        now = time.perf_counter()
        if self.done < self.total and now - self.said < self.every_s:
            return
        self.said, elapsed = now, now - self.t0
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
        if self in _OPEN:
            _OPEN.remove(self)
        if self.bar is not None and self.own_bar:
            self.bar.__exit__(kind, err, tb)
        elif self.bar is not None:
            self.bar.remove_task(self.job)


def _phase_here() -> PhaseProgress | None:
    """The innermost open phase, when it shows progress and was opened in this thread."""
    outer = _OPEN[-1] if _OPEN else None
    if outer is None or not outer.enabled or outer.thread != threading.get_ident():
        return None
    return outer


def inner_progress(what: str, total: int, every_s: float = 0.0) -> PhaseProgress:
    """Progress of a stretch inside the innermost open phase (see the module docstring), named
    ``"<phase> <done+1>/<total>: <what>"``, in a log at most one line per ``every_s`` seconds
    (and the last); it shows nothing outside a phase that shows progress, or in another thread
    than the phase's."""
    outer = _phase_here()
    if outer is None:
        return PhaseProgress(what, total, enabled=False)
    where = f"{outer.description} {outer.done + 1}/{outer.total}: {what}"
    return PhaseProgress(where, total, stream=outer.stream, every_s=every_s)


def inner_note(text: str) -> None:
    """One line ``"<phase> <done+1>/<total>: <text>"`` about a stretch inside the innermost open
    phase that has nothing to count (a wait on a background process), where
    :func:`inner_progress` would show."""
    outer = _phase_here()
    if outer is not None:
        line = f"{outer.description} {outer.done + 1}/{outer.total}: {text}"
        print(line, file=outer.stream, flush=True)


_MASKED_SEEN: set[tuple[str, str, str]] = set()
_MASKED_LOCK = threading.Lock()


class KnownFault(Exception):
    """Mixed into an infrastructure fault whose one-line message says all there is to know and
    what to do (a task's environment not built): :func:`warn_masked` logs it in one line, without
    a traceback."""


def warn_masked(log: logging.Logger, msg: str, *args: object) -> None:
    """Log a masked infrastructure failure, called inside the ``except`` block that masked it:
    the first failure of each cause (the logger, the message template and the exception's type
    and text) as a warning with its traceback, later ones of the same cause at debug level
    (traceback kept), so a cause that masks every episode of an evaluation (repository
    environments not built) prints one traceback, not one per episode, while the log at debug
    level keeps every one. A :class:`KnownFault` is logged in one line, its message appended,
    with no traceback (one line per cause: per missing environment, not per episode)."""
    exc = sys.exc_info()[1]
    key = (log.name, msg, f"{type(exc).__name__}: {exc}"[:300])
    with _MASKED_LOCK:
        first = key not in _MASKED_SEEN
        _MASKED_SEEN.add(key)
    if isinstance(exc, KnownFault):
        said = exc.args[0] if exc.args else type(exc).__name__
        (log.warning if first else log.debug)(msg + ": %s", *args, said)
    elif first:
        log.warning(msg, *args, exc_info=True)
    else:
        log.debug(msg + " (the same cause as the warning above)", *args, exc_info=True)
