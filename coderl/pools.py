"""Thread pools that Ctrl-C does not wait out.

``with ThreadPoolExecutor() as pool:`` waits on leaving for every job submitted, the queued
ones included: a ``KeyboardInterrupt`` (Ctrl-C, or SIGTERM as ``coderl`` turns it into one) in
an evaluation or rollout that has hundreds of episodes to grade waited for all of them.
:func:`thread_pool` leaves at once on an exception instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager


@contextmanager
def thread_pool(max_workers: int | None = None) -> Iterator[ThreadPoolExecutor]:
    """A :class:`ThreadPoolExecutor` for the block. When the block ends normally it waits for
    every job, as ``with ThreadPoolExecutor()`` does; when it raises (``KeyboardInterrupt``
    included), the jobs not started are cancelled and the running ones are not waited for (each
    ends on its own: a sandbox call when its caller closes the sandbox or at its timeout; the
    interpreter joins them at exit)."""
    pool = ThreadPoolExecutor(max_workers)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
