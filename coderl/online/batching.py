"""Concurrent requests to one server, batched for an in-process sampler.

``coderl serve`` answers every request in its own thread. A vLLM engine batches concurrent
requests by itself (continuous batching), so they go to it directly. The in-process sampler
(:class:`coderl.policy.engine.TorchEngine` behind a policy) holds one model on the machine's
cores and batches only what one ``generate`` call carries: :class:`WindowBatcher` collects the
requests that arrive within ``window_s`` of the first and sends those with the same sampler
and the same sampling parameters as one ``generate`` call. Each request gets its own
completion back, with its own sampled ids and the logprobs the batch computed for them (the
exact behaviour logprobs of what was sampled). A request with a ``seed`` is sampled alone
(equal seeds give equal samples only for the same batch), so seeded replies do not depend on
the traffic around them.

One worker thread is the only caller of the samplers it serves: an in-process model is never
run from two threads at once. A failing ``generate`` fails the requests of its batch only; the
worker keeps serving.

Limits: requests with different ``max_new_tokens`` (or temperatures, stop ids) are not merged;
they are served one batch after the other within a window.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import astuple
from typing import Any

from coderl.policy.base import Completion, SamplingParams

_Item = tuple[Any, list[int], SamplingParams, "Future[Completion]"]


class WindowBatcher:
    """Batches concurrent ``generate`` calls of in-process samplers (see the module docstring).

    Args:
        window_s: how long after the first request of a batch others may join it.
        max_batch: most prompts in one ``generate`` call.
    """

    def __init__(self, window_s: float = 0.005, max_batch: int = 32) -> None:
        if window_s < 0 or max_batch < 1:
            raise ValueError(
                f"window_s must be >= 0 and max_batch >= 1, got {window_s}, {max_batch}"
            )
        self.window_s, self.max_batch = window_s, max_batch
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self.batches = 0  # generate calls made (for tests and benchmarks)
        self.busy_s = 0.0  # seconds spent in them
        self._thread = threading.Thread(target=self._run, daemon=True, name="coderl-batcher")
        self._thread.start()

    def generate(self, sampler: Any, prompt: list[int], params: SamplingParams) -> Completion:
        """One completion of ``prompt``, sampled in a batch with the requests around it.

        Raises:
            whatever the sampler's ``generate`` raised for the batch.
        """
        fut: Future[Completion] = Future()
        self._queue.put((sampler, prompt, params, fut))
        return fut.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _collect(self, first: _Item) -> tuple[list[_Item], bool]:
        """The window's requests (``first`` included) and whether :meth:`close` was asked."""
        items, deadline = [first], time.monotonic() + self.window_s
        while len(items) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return items, True
            items.append(item)
        return items, False

    def _run(self) -> None:
        while (first := self._queue.get()) is not None:
            items, closing = self._collect(first)
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
