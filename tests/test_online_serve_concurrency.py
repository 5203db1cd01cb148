"""``coderl serve`` answers concurrent requests concurrently: an engine that batches by itself
gets them at once, the in-process sampler gets them batched; each request records its own exact
tokens and logprobs; client errors are 4xx with a reason, engine failures 503."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from coderl.endpoint.http import BackgroundServer
from coderl.online.server import ChatRequest, InteractionServer
from coderl.online.store import Store
from coderl.policy import load_policy
from coderl.policy.base import Completion

MESSAGES = [{"role": "user", "content": "write add(a, b)"}]


def _post(url: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _together(n: int, fn) -> list:
    """``fn(i)`` for i < n, started at once from n threads; results in order."""
    barrier, out = threading.Barrier(n), [None] * n

    def run(i: int) -> None:
        barrier.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_the_in_process_sampler_batches_concurrent_requests_and_records_each(tmp_path):
    policy = load_policy("tiny-random", reference=False)
    store = Store(f"sqlite:///{tmp_path / 'online.db'}")
    srv = InteractionServer(policy, store, version=0, max_new_tokens=6, batch_window_s=0.3)
    msgs = [[{"role": "user", "content": f"task {i} " * (i + 1)}] for i in range(6)]
    bodies = _together(6, lambda i: srv.complete(ChatRequest(model="coderl", messages=msgs[i])))
    assert srv.batcher.batches < 6  # merged: one generate call per window, not per request
    rows = {r["interaction_id"]: r for r in store.interactions()}
    assert len(rows) == 6
    for body in bodies:
        r = rows[body["id"]]
        seq = r["prompt_token_ids"] + r["completion_token_ids"]
        n = len(r["prompt_token_ids"])
        [lp] = policy.logprobs([seq], temperature=r["temperature"])
        assert lp[n:] == pytest.approx(r["behaviour_logprobs"], abs=1e-4)  # its own, exactly
    prompts = {tuple(r["prompt_token_ids"]) for r in rows.values()}
    assert len(prompts) == 6  # no request got another's prompt


class _SlowEngine:
    """An engine that batches by itself (vLLM-like): counts calls in flight at once."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.inflight = self.most = 0
        self.lock = threading.Lock()

    def generate(self, prompts, params):
        with self.lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        time.sleep(0.3)
        with self.lock:
            self.inflight -= 1
        return [Completion(token_ids=[5], logprobs=[-1.0], finish_reason="length") for _ in prompts]


def test_an_engine_that_batches_itself_gets_concurrent_requests_at_once(tmp_path):
    policy = load_policy("tiny-random", reference=False)
    engine = _SlowEngine(policy.tokenizer)
    srv = InteractionServer(engine, Store(f"sqlite:///{tmp_path / 'o.db'}"), version=0)
    _together(4, lambda i: srv.complete(ChatRequest(model="coderl", messages=MESSAGES)))
    assert engine.most == 4  # no lock around generation


def test_client_errors_are_4xx_with_a_reason_and_engine_failures_503(tmp_path):
    policy = load_policy("tiny-random", reference=False)
    policy.model.config.max_position_embeddings = 40  # a small context to overflow
    real, calls = policy.generate, {"n": 0}

    def flaky(prompts, params):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("device lost")
        return real(prompts, params)

    policy.generate = flaky  # type: ignore[method-assign]
    srv = InteractionServer(policy, Store(f"sqlite:///{tmp_path / 'o.db'}"), version=0,
                            max_new_tokens=4)  # fmt: skip
    bg = BackgroundServer(srv.app())
    url = bg.base_url + "/chat/completions"
    ok = json.dumps({"model": "coderl", "messages": MESSAGES}).encode()
    try:
        status, body = _post(url, ok)
        assert status == 503 and "device lost" in body["error"]["message"]
        status, body = _post(url, ok)  # the server kept serving
        assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"
        status, body = _post(url, b'{"model": "coderl", "messages": [')
        assert status == 400 and "json" in body["error"]["message"].lower()
        status, body = _post(url, json.dumps({"model": "coderl", "messages": "hi"}).encode())
        assert status == 400 and "messages" in body["error"]["message"]  # a field's type
        two = {"model": "coderl", "messages": MESSAGES, "n": 2}
        status, body = _post(url, json.dumps(two).encode())
        assert status == 400 and "n: " in body["error"]["message"]
        long = [{"role": "user", "content": "word " * 200}]
        status, body = _post(url, json.dumps({"model": "coderl", "messages": long}).encode())
        assert status == 400 and "context is 40 tokens" in body["error"]["message"]
        bad_tool = {"type": "function", "function": {"name": "rm_rf", "parameters": {}}}
        req = {"model": "coderl", "messages": MESSAGES, "tools": [bad_tool]}
        status, body = _post(url, json.dumps(req).encode())
        assert status == 400 and "rm_rf" in body["error"]["message"]
    finally:
        bg.stop()


class _CountingSampler:
    """A sampler that records the prompts of each ``generate`` call (no model)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        return [Completion(token_ids=[1], logprobs=[-1.0], finish_reason="length") for _ in prompts]


def _request(batcher, sampler, delay_s: float, leave_without_generate: bool = False, ready=None):
    """One server request as the batcher sees it: announced, prepared for ``delay_s`` (and
    until every thread is at the barrier ``ready``), then handed over (or leaving without a
    generate call, as a request that failed)."""
    from coderl.policy.base import SamplingParams

    with batcher.incoming():
        time.sleep(delay_s)
        if ready is not None:
            ready.wait()
        if leave_without_generate:
            return None
        return batcher.generate(sampler, [1, 2], SamplingParams(max_new_tokens=1))


def test_a_batch_waits_for_the_requests_still_being_prepared():
    """Eight requests announced together but handed over 30 ms apart are one generate call:
    the call waits (its window is 10 s) while any announced request is still being prepared."""
    from coderl.endpoint.batching import WindowBatcher

    batcher, sampler = WindowBatcher(window_s=10.0), _CountingSampler()
    _together(8, lambda i: _request(batcher, sampler, 0.03 * i))
    assert sampler.calls == [8]
    batcher.close()


def test_a_request_that_leaves_without_generating_is_not_waited_for():
    """A request that fails before its generate call stops counting when it leaves: the other
    request's call starts then, not at the end of the 10 s window."""
    from coderl.endpoint.batching import WindowBatcher

    batcher, sampler = WindowBatcher(window_s=10.0), _CountingSampler()
    t = time.monotonic()
    _together(2, lambda i: _request(batcher, sampler, 0.2 * i, leave_without_generate=i == 1))
    assert sampler.calls == [1] and time.monotonic() - t < 5.0
    batcher.close()


def test_clients_that_come_back_together_stay_one_batch_and_a_lone_one_never_waits():
    """After a round of 4, the next 4 requests (announced one by one, 50 ms apart, so none is
    in the server when the first is taken) are still one call: it waits for as many as the
    previous round carried. A lone client's requests are served without waiting."""
    from coderl.endpoint.batching import WindowBatcher

    batcher, sampler = WindowBatcher(window_s=10.0), _CountingSampler()
    ready = threading.Barrier(4)  # all four announced before any hands over: one round of 4
    _together(4, lambda i: _request(batcher, sampler, 0.0, ready=ready))
    assert sampler.calls == [4]
    sampler.calls.clear()

    def late(i: int) -> None:
        time.sleep(0.05 * i)
        _request(batcher, sampler, 0.0)

    _together(4, late)
    assert sampler.calls == [4]
    batcher.close()
    batcher, sampler = WindowBatcher(window_s=10.0), _CountingSampler()
    t = time.monotonic()
    for _ in range(3):
        _request(batcher, sampler, 0.0)
    assert sampler.calls == [1, 1, 1] and time.monotonic() - t < 5.0  # not 3 windows of 10 s
    batcher.close()
