"""``coderl serve`` under concurrent clients against the engine called directly, in one run.

N clients (threads, one HTTP request each at a time) send the same N conversations for R
rounds through ``coderl serve`` (the in-process sampler, batched by the server's window); then
the engine is called directly with the N prompts the server recorded as one ``generate`` call
per round. Prints served and direct requests/s and sampled tokens/s and their ratios, and the
p50 latency of one client against one direct single-prompt call and against the server
without a batching window (``batch_window_s=0``: what one request alone costs), with the CPU capability and
the load average before and after (a loaded machine makes the figures noisy; the ratios are
measured side by side).

    .venv/bin/python bench/serve.py                       # tiny-random, 8 clients, 3 rounds
    .venv/bin/python bench/serve.py --clients 8 --rounds 5 --max-new-tokens 64

Not measured here: vLLM behind the server (``engine.kind=vllm``; it batches by itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import urllib.request

import torch

from coderl.online.server import BackgroundServer, InteractionServer
from coderl.online.store import Store
from coderl.policy import load_policy
from coderl.policy.base import SamplingParams


def _ask(url: str, i: int, max_tokens: int) -> float:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": f"write a function number {i} " * (1 + i % 3)}],
        "max_tokens": max_tokens,
    }
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        r.read()
    return time.perf_counter() - t


def served(url: str, clients: int, rounds: int, max_tokens: int) -> float:
    """Wall seconds for ``clients`` concurrent clients, each sending ``rounds`` requests."""

    def client(i: int) -> None:
        for _ in range(rounds):
            _ask(url, i, max_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    policy = load_policy("tiny-random", reference=False)
    store = Store(f"sqlite:///{tempfile.mkdtemp()}/online.db")
    srv = InteractionServer(policy, store, version=0, max_new_tokens=args.max_new_tokens)
    bg = BackgroundServer(srv.app())
    url = bg.base_url + "/chat/completions"
    n, k = args.clients, args.rounds
    try:
        _ask(url, 0, args.max_new_tokens)  # warm-up
        before, calls0, busy0 = len(store.interactions()), srv.batcher.batches, srv.batcher.busy_s
        wall_served = served(url, n, k, args.max_new_tokens)
        rows = store.interactions()[before:]
        calls, busy = srv.batcher.batches - calls0, srv.batcher.busy_s - busy0
        one = [_ask(url, i % n, args.max_new_tokens) for i in range(5 * k)]
    finally:
        bg.stop()
    unbatched = InteractionServer(policy, store, version=0, max_new_tokens=args.max_new_tokens,
                                  batch_window_s=0.0)  # fmt: skip
    bg = BackgroundServer(unbatched.app())
    try:
        url0 = bg.base_url + "/chat/completions"
        one0 = [_ask(url0, i % n, args.max_new_tokens) for i in range(5 * k)]
    finally:
        bg.stop()
    tok_served = sum(len(r["completion_token_ids"]) for r in rows)
    prompts = [r["prompt_token_ids"] for r in rows[:n]]
    params = SamplingParams(temperature=0.8, max_new_tokens=args.max_new_tokens)
    t = time.perf_counter()
    tok_direct = 0
    for _ in range(k):
        tok_direct += sum(len(c.token_ids) for c in policy.generate(prompts, params))
    wall_direct = time.perf_counter() - t
    single = []
    for i in range(5 * k):
        t = time.perf_counter()
        policy.generate([prompts[i % n]], params)
        single.append(time.perf_counter() - t)
    rs, rd = n * k / wall_served, n * k / wall_direct
    ts, td = tok_served / wall_served, tok_direct / wall_direct
    p50s, p50d, p50w = statistics.median(one), statistics.median(single), statistics.median(one0)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch threads {args.threads}, "
          f"load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{n} clients x {k} rounds, {args.max_new_tokens} new tokens max, tiny-random")
    print(f"served  {rs:7.2f} req/s {ts:8.1f} tok/s ({calls} generate calls, "
          f"engine busy {busy / wall_served:.0%} of the wall time)")  # fmt: skip
    print(f"direct  {rd:7.2f} req/s {td:8.1f} tok/s")
    print(f"ratio served/direct: req/s {rs / rd:.2f}, tok/s {ts / td:.2f}")
    print(f"p50 at 1 client: served {1000 * p50s:.1f} ms, direct {1000 * p50d:.1f} ms, "
          f"ratio {p50s / p50d:.2f}; served without a batching window {1000 * p50w:.1f} ms, "
          f"ratio {p50s / p50w:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
