"""Start sandbox processes, and build their mounts, on one long-lived thread.

Why one thread:
- ``bwrap --die-with-parent`` arms PR_SET_PDEATHSIG, which fires when the *thread* that forked
  bwrap exits, not the process. Sandboxes created from a short-lived worker thread (a thread
  pool) would be killed when that thread ends, so every sandbox process is forked by this
  module's daemon thread, which lives as long as the interpreter.
- Stages. As root, each sandbox's mounts (workspace tmpfs, overlay, idmapped views) are made in
  a mount namespace of its own, a *stage*: a private copy of the host's mount namespace made by
  ``unshare(CLONE_NEWNS)`` on this thread and held open by an nsfs descriptor; the sandbox's
  bwrap is forked inside it. Every bwrap copies its parent's whole mount table and re-reads it
  for each bind it makes, so with all sandboxes' mounts in the host namespace each new sandbox
  got slower with every live one (measured here: 16 live sandboxes added ~5 ms CPU and ~10 ms
  wall to each new one). Stages keep the host's table constant, and when a stage's last
  reference goes the kernel unmounts everything in it, so a crashed host process leaves no
  mount behind. Only this thread enters stages: it first unshares its filesystem attributes
  (CLONE_FS), which setns(2) requires for mount namespaces, so the rest of the process keeps
  its own.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import coderl.sandbox.mounts as mounts

T = TypeVar("T")

_jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None
_host_ns: list[int] = []  # this thread's original mount namespace, once it has unshared CLONE_FS


def _popen(argv: list[str], pass_fds: tuple[int, ...]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=pass_fds,
        close_fds=True,
        process_group=0,  # its own process group: kill(0) from inside reaches only itself
    )


def has_controlling_terminal() -> bool:
    """True when this process has a controlling terminal (``/dev/tty`` opens).

    Checked for every sandbox: a process that is not a session leader cannot gain one, but a
    session leader can.
    """
    try:
        os.close(os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY | os.O_CLOEXEC))
    except OSError:  # ENXIO: no controlling terminal (ENOENT: no /dev/tty at all)
        return False
    return True


def _serve() -> None:
    while True:
        fn, fut = _jobs.get()
        try:
            result = fn()
        except BaseException as e:  # handed to the caller, who re-raises it
            fut.set_exception(e)
        else:
            fut.set_result(result)


def _run(fn: Callable[[], T]) -> T:
    """``fn()`` on the spawner thread (started on first use); raises what ``fn`` raises."""
    global _thread
    if threading.current_thread() is _thread:
        return fn()
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="coderl-sandbox-spawner", daemon=True)
            _thread.start()
    fut: Future[T] = Future()
    _jobs.put((fn, fut))
    return fut.result()


def _host() -> int:
    """The spawner thread's host mount namespace (an nsfs fd); unshares CLONE_FS first."""
    if not _host_ns:
        mounts.unshare(mounts.CLONE_FS)
        _host_ns.append(os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
    return _host_ns[0]


def new_stage(build: Callable[[], T]) -> tuple[int, T]:
    """Run ``build()`` in a new stage; returns the stage (an nsfs fd the caller must close) and
    what ``build`` returned. Mounts made by ``build`` exist in that stage only.

    Needs root. Raises OSError (unshare/setns refused) and what ``build`` raises; the stage is
    then discarded with its mounts.
    """

    def job() -> tuple[int, T]:
        host = _host()
        mounts.unshare(mounts.CLONE_NEWNS)
        try:
            mounts.make_private("/")  # nothing made here propagates back to the host
            result = build()
            stage = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            mounts.setns(host, mounts.CLONE_NEWNS)
        return stage, result

    return _run(job)


def spawn(
    argv: list[str], *, pass_fds: tuple[int, ...] = (), stage: int | None = None
) -> subprocess.Popen[bytes]:
    """``Popen(argv)`` with stdin/stdout/stderr pipes, in a new process group, forked by the
    long-lived spawner thread, inside ``stage`` (from ``new_stage``) when given.

    Raises what Popen raises (FileNotFoundError when ``argv[0]`` is missing, OSError).
    """

    def job() -> subprocess.Popen[bytes]:
        if stage is None:
            return _popen(argv, pass_fds)
        host = _host()
        mounts.setns(stage, mounts.CLONE_NEWNS)
        try:
            return _popen(argv, pass_fds)
        finally:
            mounts.setns(host, mounts.CLONE_NEWNS)

    return _run(job)
