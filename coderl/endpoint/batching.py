"""Concurrent requests to one server, batched for an in-process sampler.

``coderl serve`` answers every request in its own thread. A vLLM engine batches concurrent
requests by itself (continuous batching), so they go to it directly. The in-process sampler
(:class:`coderl.policy.engine.TorchEngine` behind a policy) holds one model on the machine's
cores and batches only what one ``generate`` call carries, so :class:`WindowBatcher` batches at
request granularity: one worker thread makes one ``generate`` call at a time, and each call
carries every request waiting for the sampler when it starts (all that arrived while the
previous call was generating).

Before a call starts it may wait, at most ``window_s``, for requests the server holds: those
still being prepared (rendering, tokenizing), and new ones, up to the number of requests in
the server or that the previous round carried, whichever is more. The server announces each request for its whole lifetime
(:meth:`WindowBatcher.incoming`). This is a dynamic batcher whose preferred batch size is read
off the traffic: clients that send again as soon as they are answered (a chat user, an agent's
next turn) come back together, instead of drifting into a call of one and a call of the rest.
A lone client's request waits for nothing: it is the only request in the server, and the
previous round carried one.

Requests with the same sampler and the same sampling parameters share a call. Each request
gets its own completion back, with its own sampled ids and the logprobs the batch computed for
them (the exact behaviour logprobs of what was sampled). A request with a ``seed`` is sampled
alone (equal seeds give equal samples only for the same batch), so seeded replies do not depend
on the traffic around them.

The worker is the only caller of the samplers it serves: an in-process model is never run from
two threads at once, and no lock is held while it generates (requests queue and announce
themselves meanwhile). A failing ``generate`` fails the requests of its batch only; the worker
keeps serving.

Limits: requests with different ``max_new_tokens`` (or temperatures, stop ids) are not merged;
they are served one batch after the other. A batch is not extended while it generates (no
token-level continuous batching: a request that arrives during a call waits for its end). With
traffic whose users do not send again at once, a call can wait ``window_s`` for requests that
do not come (the price of the wait, bounded).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import astuple
from typing import Any

from coderl.policy.base import Completion, SamplingParams

_Item = tuple[Any, list[int], SamplingParams, "Future[Completion]"]


class EngineError(RuntimeError):
    """The sampler's ``generate`` raised: the engine's fault (out of memory, a lost device, a
    dead vLLM engine), never the request's. The original is chained as ``__cause__``."""


def generate_one(
    sampler: Any, prompt: list[int], params: SamplingParams, batcher: WindowBatcher | None
) -> Completion:
    """One completion of ``prompt``: through ``batcher`` (an in-process sampler), else straight
    from ``sampler`` (an engine that batches concurrent requests itself).

    Raises:
        EngineError: the engine raised, whatever it raised.
    """
    try:
        if batcher is not None:
            return batcher.generate(sampler, prompt, params)
        outs: list[Completion] = sampler.generate([prompt], params)
        [out] = outs
        return out
    # any error: engines fail in their own types (torch, CUDA, vLLM, HTTP clients)
    except Exception as e:  # noqa: BLE001 - a failing engine fails this request, not the server
        raise EngineError(f"engine failure: {type(e).__name__}: {e}") from e


class WindowBatcher:
    """Batches concurrent ``generate`` calls of in-process samplers (see the module docstring).

    Args:
        window_s: the longest a call waits, before it starts, for requests the server holds
            (0: never waits).
        max_batch: most prompts in one ``generate`` call.
    """

    def __init__(self, window_s: float = 0.05, max_batch: int = 32) -> None:
        if window_s < 0 or max_batch < 1:
            raise ValueError(
                f"window_s must be >= 0 and max_batch >= 1, got {window_s}, {max_batch}"
            )
        self.window_s, self.max_batch = window_s, max_batch
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._count = threading.Lock()  # guards the two counts and the queue's puts
        self._inside = 0  # requests inside incoming()
        self._preparing = 0  # of those, the ones that have not called generate yet
        self._previous = 1  # requests the previous round of generate calls carried
        self._tls = threading.local()  # .preparing: this thread's request is preparing
        self.batches = 0  # generate calls made (for tests and benchmarks)
        self.batch_sizes: Counter[int] = Counter()  # prompts per generate call -> calls
        self.busy_s = 0.0  # seconds spent in them
        self._thread = threading.Thread(target=self._run, daemon=True, name="coderl-batcher")
        self._thread.start()

    @contextmanager
    def incoming(self) -> Iterator[None]:
        """Around one request's whole handling, in its thread: while it has not called
        :meth:`generate`, a call about to start waits (at most ``window_s``) for it; while it
        is inside, it counts towards the size a call waits for. A request that never calls
        :meth:`generate` (an error, an engine that batches itself) is not waited for once it
        leaves."""
        with self._count:
            self._inside += 1
            self._preparing += 1
            self._tls.preparing = True
        try:
            yield
        finally:
            with self._count:
                self._inside -= 1
                self._handed_over()

    def _handed_over(self) -> None:
        """This thread's request no longer counts as preparing (the caller holds ``_count``)."""
        if getattr(self._tls, "preparing", False):
            self._preparing -= 1
            self._tls.preparing = False

    def generate(self, sampler: Any, prompt: list[int], params: SamplingParams) -> Completion:
        """One completion of ``prompt``, sampled in a batch with the requests around it.

        Raises:
            whatever the sampler's ``generate`` raised for the batch.
        """
        fut: Future[Completion] = Future()
        with self._count:  # queued and no longer preparing in one step: never waited for twice
            self._queue.put((sampler, prompt, params, fut))
            self._handed_over()
        return fut.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _collect(self, first: _Item) -> tuple[list[_Item], bool]:
        """``first`` and every request queued behind it, then, until ``window_s`` after
        ``first`` was taken, those that arrive while requests are still being prepared or while
        the batch holds fewer requests than the server does, or than the previous round
        carried; and whether :meth:`close` was asked."""
        items, deadline = [first], time.monotonic() + self.window_s
        while len(items) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                with self._count:
                    preparing, target = self._preparing, max(self._inside, self._previous)
                left = deadline - time.monotonic()
                if left <= 0 or (preparing == 0 and len(items) >= target):
                    break
                try:
                    item = self._queue.get(timeout=min(left, 0.002))
                except queue.Empty:
                    continue
            if item is None:
                return items, True
            items.append(item)
        return items, False

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            items, closing = self._collect(first)
            self._previous = len(items)
            groups: dict[Any, list[_Item]] = {}
            for i, it in enumerate(items):
                sampler, _, params, _ = it
                key = (id(sampler), astuple(params)) if params.seed is None else ("seeded", i)
                groups.setdefault(key, []).append(it)
            for group in groups.values():
                self._serve(group)
            if closing:
                return

    def _serve(self, group: list[_Item]) -> None:
        sampler, params = group[0][0], group[0][2]
        self.batches += 1
        self.batch_sizes[len(group)] += 1
        t = time.perf_counter()
        try:
            outs = sampler.generate([p for _, p, _, _ in group], params)
        except BaseException as e:  # the requests' failure, not the worker's
            for *_, fut in group:
                fut.set_exception(e)
            return
        finally:
            self.busy_s += time.perf_counter() - t
        for (*_, fut), out in zip(group, outs, strict=True):
            fut.set_result(out)
