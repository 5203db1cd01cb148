"""One writer per run directory, and a run's logs never replaced unasked.

:func:`run_lock` holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` for as long as a
command writes there (``coderl train``, ``train-async``, ``sft``); a second command on the same
directory fails at once with one line naming the holder (its pid and command line, which the
lock file records). The kernel drops a ``flock`` when its process ends however it ends (``kill
-9``, a crash, a lost node of a local file system), so a stale lock cannot outlive its run and
nothing has to be cleaned up by hand. The lock is re-entrant within a process (the CLI holds it
around SFT and RL, and the training loop takes it again).

:func:`ensure_fresh_logs` refuses to start a new run over the logs a run left (a run stopped
before its first checkpoint leaves ``metrics.jsonl``, ``eval.jsonl`` and ``audit.jsonl`` but
nothing to resume from): they are kept, and the error says how to go on.

Limits: ``flock`` is advisory (a process that ignores the lock is not stopped) and on NFS it is
only as good as the server's lock support. Ranks of a ``torchrun`` run other than rank 0 do not
take the lock (they write under ``ranks/`` only).
"""

from __future__ import annotations

import fcntl
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"
RUN_LOGS = ("metrics.jsonl", "eval.jsonl", "audit.jsonl")
"""The logs a training run appends to; a new run refuses to start over any that is non-empty."""

_held: dict[Path, tuple[int, int]] = {}  # resolved run dir -> (fd, depth) of this process


class RunDirBusy(FileExistsError):
    """Another live process holds the run directory's lock (a ``FileExistsError``: the command
    line prints it as one line)."""


def launch_rank() -> int:
    """This process's rank as ``torchrun`` (or the Ray launcher) set it in ``RANK``; 0 alone."""
    return int(os.environ.get("RANK", "0") or 0)


@contextmanager
def run_lock(run_dir: str | Path, command: str | None = None) -> Iterator[None]:
    """Hold ``run_dir``'s writer lock (created with the directory if needed) for the block.

    Args:
        run_dir: the run directory.
        command: what the lock file records for a refused second writer (default: this
            process's command line).

    Raises:
        RunDirBusy: another live process holds the lock (names its pid and command).
    """
    if launch_rank() > 0:
        yield
        return
    key = Path(run_dir).resolve()
    if key in _held:
        fd, depth = _held[key]
        _held[key] = (fd, depth + 1)
        try:
            yield
        finally:
            fd, depth = _held[key]
            _held[key] = (fd, depth - 1)
        return
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirBusy(
            f"{run_dir} is in use by {holder}; wait for it to finish (or stop it), or set "
            "run_dir=... to write elsewhere"
        ) from None
    said = command or shlex.join(["coderl", *sys.argv[1:]])
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} ({said})\n".encode(), 0)
    _held[key] = (fd, 1)
    try:
        yield
    finally:
        fd, depth = _held.pop(key)
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def enclosing_run(path: str | Path) -> Path | None:
    """The training run directory at or above ``path`` (one with a ``config.yaml`` beside its
    checkpoints, logs, SFT weights or lock), or None."""
    out = Path(path).resolve()
    for d in [out, *out.parents]:
        if (d / "config.yaml").is_file() and any(
            (d / m).exists() for m in ("checkpoints", "sft", LOCK_FILE, *RUN_LOGS)
        ):
            return d
    return None


def existing_logs(run_dir: str | Path) -> list[Path]:
    """The non-empty :data:`RUN_LOGS` of ``run_dir``."""
    root = Path(run_dir)
    return [p for name in RUN_LOGS if (p := root / name).is_file() and p.stat().st_size > 0]


def ensure_fresh_logs(run_dir: str | Path) -> None:
    """Refuse to start a new run where a run's logs already are.

    Raises:
        FileExistsError: ``run_dir`` holds a non-empty metrics, eval or audit log (names them
            and the ways out).
    """
    found = existing_logs(run_dir)
    if found:
        names = ", ".join(p.name for p in found)
        raise FileExistsError(
            f"{run_dir} already holds the logs of an earlier run ({names}) and no checkpoint to "
            "resume; set run_dir=... to start a new run elsewhere, or move those files away"
        )
