"""Start sandbox processes from one long-lived thread.

``bwrap --die-with-parent`` arms PR_SET_PDEATHSIG, which fires when the *thread* that forked bwrap
exits, not the process. Sandboxes created from a short-lived worker thread (a thread pool) would
be killed when that thread ends, so every sandbox process is forked by this module's daemon
thread, which lives as long as the interpreter.
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from concurrent.futures import Future

_jobs: queue.SimpleQueue[tuple[list[str], tuple[int, ...], Future[subprocess.Popen[bytes]]]]
_jobs = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None


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
        argv, pass_fds, fut = _jobs.get()
        try:
            proc = _popen(argv, pass_fds)
        except BaseException as e:  # handed to the caller, who re-raises it
            fut.set_exception(e)
        else:
            fut.set_result(proc)


def spawn(argv: list[str], *, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
    """``Popen(argv)`` with stdin/stdout/stderr pipes, in a new process group, forked by the
    long-lived spawner thread.

    Raises what Popen raises (FileNotFoundError when ``argv[0]`` is missing, OSError).
    """
    global _thread
    if threading.current_thread() is threading.main_thread():  # lives as long as the process
        return _popen(argv, pass_fds)
    with _started:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="coderl-sandbox-spawner", daemon=True)
            _thread.start()
    fut: Future[subprocess.Popen[bytes]] = Future()
    _jobs.put((argv, pass_fds, fut))
    return fut.result()
