"""One writer per run directory, and a run's logs never replaced unasked.

:func:`run_lock` holds an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` for as long as a
command writes there (``coderl train``, ``train-async``, ``sft``); a second command on the same
directory fails at once with one line naming the holder (its pid and command line, which the
lock file records). The kernel drops a ``flock`` when its process ends however it ends (``kill
-9``, a crash, a lost node of a local file system), so a stale lock cannot outlive its run and
nothing has to be cleaned up by hand. The lock is re-entrant within a process (the CLI holds it
around SFT and RL, and the training loop takes it again).

:func:`online_lock` is the online side: ``coderl serve``, ``online cycle``/``run`` and ``online
import`` share one directory by design, so each holds the writer lock shared (a writer is refused
while any of them runs, and they are refused while a writer runs) plus an exclusive lock of its
role (``RUN/.lock.serve``: a second server on the same registry is refused).

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
RUN_LOGS = ("metrics.jsonl", "eval.jsonl", "eval_extra.jsonl", "audit.jsonl")
"""The logs a training run appends to; a new run refuses to start over any that is non-empty."""

_held: dict[Path, list] = {}  # lock file -> [fd, depth, shared] of this process


class RunDirBusy(FileExistsError):
    """Another live process holds the run directory's lock (a ``FileExistsError``: the command
    line prints it as one line)."""


def launch_rank() -> int:
    """This process's rank as ``torchrun`` (or the Ray launcher) set it in ``RANK``; 0 alone."""
    return int(os.environ.get("RANK", "0") or 0)


def _holders(run_dir: Path) -> str:
    """Who holds ``run_dir``'s lock, as the lock files record it: the writer, else every live
    online role (a role file whose lock is still held)."""
    said = (run_dir / LOCK_FILE).read_text(errors="replace").strip()
    if said:
        return said
    live = []
    for f in sorted(run_dir.glob(LOCK_FILE + ".*")):
        fd = os.open(f, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # free: its holder is gone
            fcntl.flock(fd, fcntl.LOCK_UN)
        except BlockingIOError:
            live.append(os.pread(fd, 4096, 0).decode(errors="replace").strip())
        finally:
            os.close(fd)
    return " and ".join(x for x in live if x) or "another process"


@contextmanager
def _flock(
    path: Path, *, shared: bool, record: str | None, run_dir: Path, advice: str = ""
) -> Iterator[None]:
    """Hold ``path``'s ``flock`` (re-entrant within this process), writing ``record`` into it.

    Raises:
        RunDirBusy: another process holds it in a conflicting mode, or this process holds it
            shared and asks for it exclusive.
    """
    key = path.resolve()
    if key in _held:
        if _held[key][2] and not shared:
            raise RunDirBusy(
                f"{run_dir} is served by this process (coderl serve or online); a writer "
                "cannot run inside it"
            )
        _held[key][1] += 1
        try:
            yield
        finally:
            _held[key][1] -= 1
        return
    fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _holders(run_dir) if key.name == LOCK_FILE else key.read_text().strip()
        advice = advice or (
            "wait for it to finish (or stop it), or set run_dir=... to write elsewhere"
        )
        raise RunDirBusy(
            f"{run_dir} is in use by {holder or 'another process'}; {advice}"
        ) from None
    os.ftruncate(fd, 0)  # held: whatever a dead holder recorded is stale
    if record is not None:
        os.pwrite(fd, f"{record}\n".encode(), 0)
    _held[key] = [fd, 1, shared]
    try:
        yield
    finally:
        fd = _held.pop(key)[0]
        if record is not None:
            os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _said(command: str | None) -> str:
    return f"pid {os.getpid()} ({command or shlex.join(['coderl', *sys.argv[1:]])})"


@contextmanager
def run_lock(run_dir: str | Path, command: str | None = None) -> Iterator[None]:
    """Hold ``run_dir``'s writer lock (created with the directory if needed) for the block.

    Args:
        run_dir: the run directory.
        command: what the lock file records for a refused second writer (default: this
            process's command line).

    Raises:
        RunDirBusy: another live process holds the lock, as a writer or an online role (names
            its pid and command).
    """
    if launch_rank() > 0:
        yield
        return
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    with _flock(root / LOCK_FILE, shared=False, record=_said(command), run_dir=root):
        yield


def ensure_not_live(run_dir: str | Path) -> None:
    """Refuse to resume a run that is still running (checked by taking and releasing its lock).

    Raises:
        RunDirBusy: another live process holds ``run_dir`` (names it; a run live before its
            first checkpoint would otherwise read as "no checkpoint").
    """
    root = Path(run_dir)
    if launch_rank() > 0 or not (root / LOCK_FILE).is_file():
        return
    advice = "it is still running: resume it after it stops (Ctrl-C prints the resume command)"
    with _flock(root / LOCK_FILE, shared=False, record=_said(None), run_dir=root, advice=advice):
        pass


@contextmanager
def online_lock(run_dir: str | Path, role: str, command: str | None = None) -> Iterator[None]:
    """Hold ``run_dir`` for one online role (``serve``, ``cycle``, ``import``) for the block.

    The online roles share a run directory by design (a server records interactions into its
    store while ``coderl online cycle`` claims them and promotes into its registry), so each
    takes the writer lock *shared*, which every writer (:func:`run_lock`: ``train``, ``sft``,
    ...) is refused; and each role is one process at a time (an exclusive lock on
    ``RUN/.lock.ROLE``), so a second ``coderl serve`` cannot share the registry of a live one.
    Re-entrant within a process (``coderl online run`` serves and cycles in one process).

    Raises:
        RunDirBusy: a writer holds ``run_dir``, or another process holds ``role`` there.
    """
    root = Path(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    with _flock(root / LOCK_FILE, shared=True, record=None, run_dir=root):
        with _flock(
            root / f"{LOCK_FILE}.{role}", shared=False, record=_said(command), run_dir=root
        ):
            yield


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


OTHER_OUTPUTS = {
    "cycles.jsonl": "an online run",
    "registry": "an online run",
    "online.db": "an online run",
    "export.json": "an export",
}
"""What another command leaves in its directory (name -> what it is): a training run never
starts among them."""


def ensure_fresh_logs(run_dir: str | Path) -> None:
    """Refuse to start a new run where a run's logs already are, or in the output of another
    command (:data:`OTHER_OUTPUTS`: an online run's cycles and registry, an export).

    Raises:
        FileExistsError: ``run_dir`` holds a non-empty metrics, eval or audit log, or another
            command's output (names them and the ways out).
    """
    other = [(n, what) for n, what in OTHER_OUTPUTS.items() if (Path(run_dir) / n).exists()]
    if other:
        names = ", ".join(n for n, _ in other)
        raise FileExistsError(
            f"{run_dir} holds {other[0][1]} ({names}), not a training run; set run_dir=... to "
            "start the training run elsewhere"
        )
    found = existing_logs(run_dir)
    if found:
        names = ", ".join(p.name for p in found)
        raise FileExistsError(
            f"{run_dir} already holds the logs of an earlier run ({names}) and no checkpoint to "
            "resume; set run_dir=... to start a new run elsewhere, or move those files away"
        )
