"""Warm sandboxes: started in the background ahead of time, handed out by ``create``.

Starting a ``bwrap`` sandbox (namespaces, mounts, ``setpriv``, ``bash``) takes ~10 ms of wall
time, most of it in the kernel. In RL the same base is used by the G episodes of a group and
again at later steps, so that start-up can happen before the caller asks: ``prepare(base, n)``
asks the pool to keep ``n`` started sandboxes of that base ready; ``create`` then hands one out
(a *hit*: it costs a dictionary lookup) and starts a replacement in the background, or, when
none is ready (a *miss*), starts one on the spot exactly like ``Sandbox.create``.

A pool does not create CPU: every sandbox handed out was started by someone, and a background
start costs the same CPU as a foreground one. It only moves the start-up off the caller's
critical path; callers that ask faster than the pool can refill get misses.

Isolation: a warm sandbox is an ordinary fresh ``BwrapSandbox`` (its own workspace, uid and
namespaces) whose shell has run nothing but ``true`` to prove it is up. It is removed from the
pool before it is returned, so it is handed out once; closing it closes it for good (sandboxes
are never recycled). Only the ``bwrap`` backend is pooled.

Bounds: at most ``size`` sandboxes idle or being started, over all bases; asking for more
evicts (closes) the ready sandboxes of the least recently used bases first. ``close()``, leaving
a ``with`` block, or interpreter exit stops the background workers and closes every idle
sandbox; sandboxes already handed out belong to their callers.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Unpack

from coderl.progress import warn_masked
from coderl.sandbox.base import Limits, Sandbox, SandboxError, SandboxOptions
from coderl.sandbox.bwrap import BwrapSandbox

log = logging.getLogger(__name__)

_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    """Stop every pool before ``coderl.sandbox.bwrap`` closes the remaining sandboxes (atexit
    runs handlers in reverse order of registration, and this module imports bwrap first)."""
    for pool in list(_pools):
        pool.close()


@dataclass(frozen=True)
class _Key:
    """Everything ``Sandbox.create`` takes, normalized: two requests with equal keys may be
    served by each other's warm sandboxes."""

    base: Path
    limits: Limits
    env: tuple[tuple[str, str], ...]
    ro_mounts: tuple[tuple[str, str], ...]
    rw_mounts: tuple[tuple[str, str], ...]
    network: bool

    def start(self) -> BwrapSandbox:
        return BwrapSandbox(
            self.base,
            limits=self.limits,
            env=dict(self.env),
            ro_mounts=dict(self.ro_mounts),
            rw_mounts=dict(self.rw_mounts),
            network=self.network,
        )


@dataclass
class PoolStats:
    """Counters since the pool was made."""

    hits: int = 0
    """``create`` calls served by a warm sandbox."""
    misses: int = 0
    """``create`` calls that started a sandbox on the spot."""
    started: int = 0
    """Sandboxes started in the background."""
    evicted: int = 0
    """Warm sandboxes closed unused (eviction, ``prepare(base, 0)``, ``close``)."""
    failed: int = 0
    """Background starts that raised; the base then stops being warmed (the next ``create``
    for it starts a sandbox on the spot and raises the error to its caller)."""
    last_error: str = ""
    """The last background start error, as ``repr(exception)``."""


class SandboxPool:
    """Keeps started ``bwrap`` sandboxes ready for the bases asked for with ``prepare``.

    size: most sandboxes idle or being started at once, over all bases (>= 1).
    workers: background threads starting sandboxes (>= 1); 2 keeps both cores of a 2-core
        machine busy while one start waits on the kernel.
    Raises ValueError for a size or workers below 1.
    """

    def __init__(self, size: int = 8, *, workers: int = 2) -> None:
        if size < 1 or workers < 1:
            raise ValueError(f"size and workers must be >= 1, got {size} and {workers}")
        self.size = size
        self.stats = PoolStats()
        self._cond = threading.Condition()
        self._wanted: OrderedDict[_Key, int] = OrderedDict()  # least recently used first
        self._idle: dict[_Key, deque[BwrapSandbox]] = {}
        self._starting: dict[_Key, int] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"coderl-sandbox-pool-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()
        _pools.add(self)

    # --- the caller's side -----------------------------------------------------------------

    def prepare(self, base: str | Path, count: int = 1, **options: Unpack[SandboxOptions]) -> None:
        """Keep ``count`` sandboxes of these ``Sandbox.create`` arguments ready (0: stop).

        Returns at once; the sandboxes are started in the background. ``count`` is capped at
        ``size``; other bases' ready sandboxes are evicted, least recently used first, to stay
        within ``size``. Raises ValueError (negative count, closed pool), FileNotFoundError
        (``base`` missing).
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        key = _key(base, **options)
        evicted: list[BwrapSandbox] = []
        with self._cond:
            self._check_open()
            self._wanted[key] = min(count, self.size)
            self._wanted.move_to_end(key)
            evicted += self._trim(key, self._wanted[key])
            for other in list(self._wanted):
                while sum(self._wanted.values()) > self.size and self._wanted[other] > 0:
                    self._wanted[other] -= 1
                    evicted += self._trim(other, self._wanted[other])
            self._wanted = OrderedDict((k, n) for k, n in self._wanted.items() if n)
            self._cond.notify_all()
        self._close_unused(evicted)

    def create(self, base: str | Path, **options: Unpack[SandboxOptions]) -> Sandbox:
        """A sandbox like ``Sandbox.create(base, ...)``: a warm one when ready (and a
        replacement is started in the background), else one started now.

        Raises what ``Sandbox.create`` raises, and SandboxError when the pool is closed.
        """
        key = _key(base, **options)
        with self._cond:
            self._check_open()
            ready = self._idle.get(key)
            sb = ready.popleft() if ready else None
            if key in self._wanted:
                self._wanted.move_to_end(key)
            if sb is not None:
                self.stats.hits += 1
                self._cond.notify_all()  # a worker refills the slot
            else:
                self.stats.misses += 1
        return sb if sb is not None else key.start()

    def ready(self, base: str | Path, **options: Unpack[SandboxOptions]) -> int:
        """How many sandboxes of these ``create`` arguments are ready now."""
        key = _key(base, **options)
        with self._cond:
            return len(self._idle.get(key, ()))

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until every prepared base has its count of ready sandboxes (or a start
        failed); True when that happened within ``timeout`` seconds."""
        with self._cond:
            return self._cond.wait_for(
                lambda: (
                    self._closed or self._next_key() is None and not any(self._starting.values())
                ),
                timeout,
            )

    def close(self) -> None:
        """Stop the workers and close every ready sandbox; idempotent. Sandboxes handed out
        are not touched."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._wanted.clear()
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        with self._cond:
            unused = [sb for ready in self._idle.values() for sb in ready]
            self._idle.clear()
        self._close_unused(unused)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the background side ---------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._next_key() is not None)
                if self._closed:
                    return
                key = self._next_key()
                assert key is not None
                self._starting[key] = self._starting.get(key, 0) + 1
            sb: BwrapSandbox | None = None
            error = "the worker raised (its traceback is on stderr)"
            try:
                sb = key.start()
                if sb.exec("true").exit_code != 0:
                    raise SandboxError("a warm sandbox failed its start-up check")
                error = ""
            except START_FAULTS as e:  # not the caller's: counted; its own create raises it
                warn_masked(log, "a warm sandbox failed to start")
                error = repr(e)
            finally:  # anything else is a bug: accounted for here, then it ends this worker
                if error and sb is not None:
                    sb.close()
                self._settle(key, None if error else sb, error)

    def _settle(self, key: _Key, sb: BwrapSandbox | None, error: str) -> None:
        """Account for one background start of ``key``: ``sb`` started, or ``error``."""
        with self._cond:
            self._starting[key] -= 1
            if sb is None:
                self.stats.failed += 1
                self.stats.last_error = error
                self._wanted.pop(key, None)
            elif not self._closed and self._wanted.get(key, 0) > len(self._idle.get(key, ())):
                self._idle.setdefault(key, deque()).append(sb)
                self.stats.started += 1
                sb = None
            self._cond.notify_all()
        self._close_unused([sb] if sb is not None else [])

    def _next_key(self) -> _Key | None:
        """The most recently used base that needs one more sandbox started, if the bound
        allows one more (call with the lock held)."""
        busy = sum(map(len, self._idle.values())) + sum(self._starting.values())
        if busy >= self.size:
            return None
        for key in reversed(self._wanted):
            have = len(self._idle.get(key, ())) + self._starting.get(key, 0)
            if have < self._wanted[key]:
                return key
        return None

    def _trim(self, key: _Key, keep: int) -> list[BwrapSandbox]:
        """Remove ready sandboxes of ``key`` beyond ``keep`` (lock held); returns them."""
        ready = self._idle.get(key, deque())
        out = []
        while len(ready) > keep:
            out.append(ready.pop())
        return out

    def _close_unused(self, sandboxes: list[BwrapSandbox]) -> None:
        for sb in sandboxes:
            sb.close()
        with self._cond:
            self.stats.evicted += len(sandboxes)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox pool is closed")


START_FAULTS: tuple[type[Exception], ...] = (SandboxError, OSError, ValueError)
"""What starting a ``BwrapSandbox`` raises when it cannot: the sandbox failed, the host's I/O
(a missing base or mount: FileNotFoundError), a mount the backend refuses (ValueError)."""


def _key(base: str | Path, **options: Unpack[SandboxOptions]) -> _Key:
    path = Path(base).resolve()
    if not path.is_dir():
        raise FileNotFoundError(f"base {path} is not an existing directory")
    return _Key(
        base=path,
        limits=options.get("limits") or Limits(),
        env=tuple(sorted((options.get("env") or {}).items())),
        ro_mounts=tuple(sorted((options.get("ro_mounts") or {}).items())),
        rw_mounts=tuple(sorted((options.get("rw_mounts") or {}).items())),
        network=options.get("network", False),
    )
