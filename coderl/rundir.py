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

A command that fails (or is stopped) before writing any result leaves its run directory as it
found it (:func:`_as_found`): a directory it created is removed again, and what it wrote there
before its first result (``config.yaml``, ``tb/``, empty logs, its lock files; for the online
commands a new store without a recorded row and a new registry holding only version 0, the base
model) is removed or, for a ``config.yaml`` that was there before, put back; so the next attempt
starts from the same state and needs no ``--force`` or other ``run_dir``. Once a result is
written (a metric, an evaluation, a checkpoint, SFT weights or their log; an interaction, an
event, a candidate or a warm start), nothing is removed.

A ``run_dir`` that is a file, or lies under one, is refused in one line naming the key and the
file (:func:`check_run_dir`), before anything is created.

Limits: ``flock`` is advisory (a process that ignores the lock is not stopped) and on NFS it is
only as good as the server's lock support. Ranks of a ``torchrun`` run other than rank 0 do not
take the lock (they write under ``ranks/`` only).
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"
RUN_LOGS = ("metrics.jsonl", "eval.jsonl", "eval_extra.jsonl", "audit.jsonl")
"""The logs a training run appends to; a new run refuses to start over any that is non-empty."""
CKPT_PREFIX = "step-"
"""Checkpoints are ``RUN_DIR/checkpoints/step-NNNNNN`` (:mod:`coderl.train.checkpoint`)."""
SFT_WEIGHTS = "sft/trainable.safetensors"
"""Where ``coderl sft`` writes its weights under the run directory; RL starts from them."""
TB_DIR = "tb"
"""The run's TensorBoard event files (:class:`coderl.metrics.MetricsLogger`)."""
SETUP_FILES = ("config.yaml", TB_DIR, *RUN_LOGS)
"""What a command writes into a run directory before its first result (the logs while still
empty): removed again when it fails before any result (:func:`_as_found`)."""

_held: dict[Path, list] = {}  # lock file -> [fd, depth, shared] of this process


class RunDirBusy(FileExistsError):
    """Another live process holds the run directory's lock (a ``FileExistsError``: the command
    line prints it as one line)."""


def _umask() -> int:
    """This process's umask (read from ``/proc`` where it can be: setting it to read it would
    race with threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(path: str | Path) -> None:
    """Give the files at or under ``path`` the read/write bits a plain ``open`` gives under the
    process umask (``0o666 & ~umask``, added to what they have). safetensors (0.7) writes a file
    through a temporary file and renames it, so the file keeps the temporary's ``0600`` while
    every other file a command writes is ``0644`` under umask 022; every command that writes
    weights (checkpoints, SFT, exports, registry versions, reward models) calls this after."""
    root = Path(path)
    bits = 0o666 & ~_umask()
    for f in [root, *root.rglob("*")] if root.is_dir() else [root]:
        st = f.lstat()
        if f.is_file() and not f.is_symlink() and (st.st_mode & bits) != bits:
            os.chmod(f, (st.st_mode & 0o7777) | bits)


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


def check_run_dir(run_dir: str | Path) -> None:
    """Refuse a ``run_dir`` that is a file or lies under one, before anything is created.

    Raises:
        FileExistsError: one line naming ``run_dir=`` and the file.
    """
    root = Path(run_dir)
    for d in [root, *root.parents]:
        if d.is_dir():
            return
        if d.exists():
            where = "is a file" if d == root else f"lies under the file {d}"
            raise FileExistsError(
                f"run_dir={run_dir} {where}, not a directory; set run_dir=... to a new "
                "directory or a run's"
            )


def _entries(root: Path) -> dict[str, tuple[int, int]]:
    """``root``'s entries: name -> (size, mtime in ns); none when it is not a directory."""
    if not root.is_dir():
        return {}
    stats = {n: (root / n).lstat() for n in os.listdir(root)}
    return {n: (st.st_size, st.st_mtime_ns) for n, st in stats.items()}


def _setup_only(root: Path, name: str) -> bool:
    """Whether ``root/name`` is a lock file or a :data:`SETUP_FILES` entry that holds no result
    (a log: empty), or the SFT directory while still empty (a demo stopped during SFT)."""
    path = root / name
    if name == LOCK_FILE or name.startswith(LOCK_FILE + "."):
        return True
    if name in RUN_LOGS:
        return path.is_file() and path.stat().st_size == 0
    if name == Path(SFT_WEIGHTS).parent.name:  # made before SFT, holds its weights once done
        return path.is_dir() and not path.is_symlink() and not any(path.iterdir())
    return name in SETUP_FILES


SetupCheck = Callable[[Path, set[str]], bool]
"""``(run_dir, names the command created there) -> whether none of them holds a result``: the
setup of a command beyond :data:`SETUP_FILES` (the online commands' store and registry,
:func:`coderl.online.runfiles.setup_only`)."""


class _Found:
    """What :func:`_as_found` puts back: ``root``'s entries (name -> size, mtime) and
    ``config.yaml`` as found, the topmost directory of ``root``'s path that did not exist, and
    the command's own setup check (:data:`SetupCheck`, or None)."""

    def __init__(self, root: Path, setup: SetupCheck | None = None) -> None:
        self.root = root
        self.setup = setup
        self.created = next((d for d in [*reversed(root.parents), root] if not d.exists()), None)
        self.entries = _entries(root)
        config = root / "config.yaml"
        self.config = config.read_bytes() if config.is_file() else None


@contextmanager
def _as_found(found: _Found) -> Iterator[None]:
    """Leave ``found.root`` as it was found when the block raises (a failure, Ctrl-C) before
    writing any result: every changed entry is a lock file or a :data:`SETUP_FILES` entry (see
    the module docstring), or a new entry that the command's own check (``found.setup``) finds
    holds no result. Then the new ones are removed, a ``config.yaml`` that was there is put
    back byte for byte, and the directories of the path that did not exist are removed when
    empty. Anything else changed: nothing is touched. Entered inside the lock, so no other
    writer can start in between."""
    try:
        yield
    except BaseException:
        root = found.root
        try:
            changed = [n for n, st in _entries(root).items() if found.entries.get(n) != st]
            rest = {n for n in changed if not _setup_only(root, n)}
            if not rest or (
                found.setup is not None
                and not rest & found.entries.keys()  # only new entries: never one that was there
                and found.setup(root, rest)
            ):
                _put_back(found, changed)
        except OSError:  # the failure that got here is the one to report
            pass
        raise


def _put_back(found: _Found, changed: list[str]) -> None:
    """:func:`_as_found`'s undo of the setup entries ``changed``."""
    root = found.root
    for name in changed:
        path = root / name
        if name == "config.yaml" and found.config is not None:
            path.write_bytes(found.config)
        elif name not in found.entries:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    if found.created is None:
        return
    for d in [root, *root.parents]:
        if not d.is_dir() or any(d.iterdir()):
            return
        d.rmdir()
        if d == found.created:
            return


@contextmanager
def run_lock(run_dir: str | Path, command: str | None = None) -> Iterator[None]:
    """Hold ``run_dir``'s writer lock (created with the directory if needed) for the block.

    Args:
        run_dir: the run directory.
        command: what the lock file records for a refused second writer (default: this
            process's command line).

    A block that raises before writing any result leaves ``run_dir`` as it found it
    (:func:`_as_found`).

    Raises:
        RunDirBusy: another live process holds the lock, as a writer or an online role (names
            its pid and command).
        FileExistsError: ``run_dir`` is a file or lies under one (:func:`check_run_dir`).
    """
    if launch_rank() > 0:
        yield
        return
    root = Path(run_dir)
    check_run_dir(root)
    found = _Found(root)
    root.mkdir(parents=True, exist_ok=True)
    with _flock(root / LOCK_FILE, shared=False, record=_said(command), run_dir=root):
        with _as_found(found):
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
def online_lock(
    run_dir: str | Path, role: str, command: str | None = None, setup: SetupCheck | None = None
) -> Iterator[None]:
    """Hold ``run_dir`` for one online role (``serve``, ``cycle``, ``import``) for the block.

    The online roles share a run directory by design (a server records interactions into its
    store while ``coderl online cycle`` claims them and promotes into its registry), so each
    takes the writer lock *shared*, which every writer (:func:`run_lock`: ``train``, ``sft``,
    ...) is refused; and each role is one process at a time (an exclusive lock on
    ``RUN/.lock.ROLE``), so a second ``coderl serve`` cannot share the registry of a live one.
    Re-entrant within a process (``coderl online run`` serves and cycles in one process).

    A block that raises before writing anything but locks, or what ``setup`` finds holds no
    result (the online commands pass :func:`coderl.online.runfiles.setup_only`: a store without
    a recorded row, a registry with nothing but version 0, the base model), leaves ``run_dir``
    as it found it (:func:`_as_found`).

    Raises:
        RunDirBusy: a writer holds ``run_dir``, or another process holds ``role`` there.
        FileExistsError: ``run_dir`` is a file or lies under one (:func:`check_run_dir`).
    """
    root = Path(run_dir)
    check_run_dir(root)
    found = _Found(root, setup)
    root.mkdir(parents=True, exist_ok=True)
    with _flock(root / LOCK_FILE, shared=True, record=None, run_dir=root):
        with _flock(
            root / f"{LOCK_FILE}.{role}", shared=False, record=_said(command), run_dir=root
        ):
            with _as_found(found):
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
            f"resume; set run_dir=... to start a new run elsewhere, or start over there: "
            f"{start_over(found)} then the same command again"
        )


def start_over(logs: list[Path]) -> str:
    """The shell command that removes a stopped run's ``logs`` (:func:`existing_logs`: a run
    stopped before its first checkpoint) and its TensorBoard events (which the new run's would
    otherwise be drawn over) so that the same command starts it over."""
    events = sorted({p for log in logs if (p := log.parent / TB_DIR).is_dir()})
    if not events:
        return shlex.join(["rm", *map(str, logs)])
    return shlex.join(["rm", "-r", *map(str, logs), *map(str, events)])


def not_started_line(command: str, run_dir: str | Path, again: str | None = None) -> str:
    """The line for a run interrupted before its first checkpoint: nothing to resume, and where
    given, the command ``again`` that starts it over. Needs no torch, so it can be printed
    while an import of it is what the interrupt broke."""
    over = f"; start again with: {again}" if again else ""
    return (
        f"{command}: interrupted before the first checkpoint of {run_dir}; nothing to resume{over}"
    )


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run (``checkpoints/step-N`` with a ``state.json``), oldest
    first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob(f"{CKPT_PREFIX}*") if (p / "state.json").is_file()]
    return sorted(done, key=lambda p: int(p.name[len(CKPT_PREFIX) :]))


def ensure_new_run(run_dir: str | Path) -> None:
    """Refuse to start a fresh run in a directory that already holds checkpoints or a run's logs.

    A new run there would overwrite the old run's logs while older, higher-numbered checkpoints
    outrank its own, so ``--resume`` and ``coderl eval`` would silently pick the old weights; a
    run stopped before its first checkpoint has only logs, and they are kept too
    (:func:`ensure_fresh_logs`). Light (no torch): the commands call it before their imports.

    Raises:
        FileExistsError: ``run_dir`` holds checkpoints or non-empty logs (names them and the way
            out), or is a file (:func:`check_run_dir`).
    """
    check_run_dir(run_dir)
    found = list_checkpoints(run_dir)
    if found:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints of a previous run (latest: {found[-1].name}); "
            "continue it with --resume, or set run_dir=... to start a new run elsewhere"
        )
    ensure_fresh_logs(run_dir)
