"""Start or join Ray, and shut down a Ray this process started: the one way every coderl driver
that uses Ray (``train-async`` with ``async.backend=ray``, ``coderl train`` with
``trainer.distributed.launcher=ray``) gets its cluster.

``address=None`` starts a local Ray (``num_cpus``, None: all); ``"auto"`` joins the cluster
running on this machine; ``"host:port"`` or ``"ray://host:port"`` joins that one. An explicit
address is first probed with a TCP connection: Ray itself retries an unreachable address for
minutes before it gives up.

Needs ``pip install coderl[ray]``; Ray is imported by the functions, not by this module.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any

# descendants of this process that existed before ensure_ray() started Ray (never reaped)
_PIDS_BEFORE_RAY: set[int] = set()
PROBE_TIMEOUT_S = 5.0
"""How long a TCP connection to an explicit ``address`` may take before it counts as
unreachable."""


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Start or join Ray unless it is running already; True if this call started it.

    Raises:
        ConnectionError: nothing accepts a TCP connection at an explicit ``host:port`` address.
    """
    import ray

    if address not in (None, "auto"):  # also when connected already: a named cluster must exist
        _probe(address)
    if ray.is_initialized():
        return False
    import psutil

    _PIDS_BEFORE_RAY.clear()
    _PIDS_BEFORE_RAY.update(p.pid for p in psutil.Process().children(recursive=True))
    try:
        if address is None:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
        else:
            ray.init(address=address, log_to_driver=True)
    except BaseException:
        shutdown_owned_ray()  # stop whatever half-started (a raylet that timed out, a GCS)
        raise
    return True


def _probe(address: str) -> None:
    """Raise ConnectionError unless ``address`` (``[ray://]host:port``) accepts a TCP connection
    within :data:`PROBE_TIMEOUT_S`."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConnectionError(f"Ray address {address!r} is not host:port, ray://host:port or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
            pass
    except OSError as err:
        raise ConnectionError(f"no Ray cluster reachable at {address!r} ({err})") from None


def shutdown_owned_ray(grace_s: float = 10.0) -> None:
    """``ray.shutdown()`` for a Ray this process started, then reap its processes.

    Ray's shutdown signals its raylet, GCS and workers but does not wait for them; a worker busy
    exiting can outlive the call by many seconds on a loaded machine. Every descendant of this
    process that did not exist before :func:`ensure_ray` started Ray is Ray's: they are waited for
    up to ``grace_s`` seconds and killed after that, so closing leaves no process behind.
    """
    import psutil
    import ray

    me = psutil.Process()
    ours = [p for p in me.children(recursive=True) if _started_by_ray(p)]
    ray.shutdown()
    # anything Ray spawned while shutting down is a descendant too
    ours += [
        p
        for p in me.children(recursive=True)
        if _started_by_ray(p) and p.pid not in {q.pid for q in ours}
    ]
    _, alive = psutil.wait_procs(ours, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


def _started_by_ray(proc: Any) -> bool:
    """Born after Ray started, and not Python's own multiprocessing resource tracker (which
    serves this process for its lifetime and exits with it)."""
    import psutil

    if proc.pid in _PIDS_BEFORE_RAY:
        return False
    try:
        return not any("resource_tracker" in part for part in proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
