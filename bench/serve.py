"""``coderl serve`` under concurrent clients against the engine called directly, in one run.

N clients (separate processes, as real clients are, each one HTTP request at a time) send the
same N conversations for R rounds through ``coderl serve`` (the in-process sampler, batched by
the server's :class:`~coderl.endpoint.batching.WindowBatcher`); then
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
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import urllib.request


def _ask(url: str, i: int, max_tokens: int) -> float:
    body = {
        "model": "coderl",
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


def _client(url: str, i: int, rounds: int, max_tokens: int, start: object, done: object) -> None:
    start.wait()  # type: ignore[attr-defined]
    for _ in range(rounds):
        _ask(url, i, max_tokens)
    done.put(time.perf_counter())  # type: ignore[attr-defined]


def served(url: str, clients: int, rounds: int, max_tokens: int) -> float:
    """Wall seconds for ``clients`` concurrent client processes (started before the clock
    runs, released together), each sending ``rounds`` requests; ``perf_counter`` is the
    system's monotonic clock, the same in every process."""
    ctx = mp.get_context("spawn")  # no fork of a process with server threads
    start, done = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, i, rounds, max_tokens, start, done))
             for i in range(clients)]  # fmt: skip
    for p in procs:
        p.start()
    start.wait()
    t = time.perf_counter()
    ends = [done.get() for _ in procs]
    for p in procs:
        p.join()
    return max(ends) - t


def trial(srv, store, policy, url: str, n: int, k: int, max_tokens: int) -> dict:
    """One served run (``n`` client processes x ``k`` rounds) and, right after it, the engine
    called directly with the same ``n`` recorded prompts ``k`` times: throughput of both."""
    from coderl.policy.base import SamplingParams

    before, calls0, busy0 = len(store.interactions()), srv.batcher.batches, srv.batcher.busy_s
    srv.batcher.batch_sizes.clear()
    wall_served = served(url, n, k, max_tokens)
    rows = store.interactions()[before:]
    prompts = [r["prompt_token_ids"] for r in rows[:n]]
    params = SamplingParams(temperature=0.8, max_new_tokens=max_tokens)
    t, tok_direct = time.perf_counter(), 0
    for _ in range(k):
        tok_direct += sum(len(c.token_ids) for c in policy.generate(prompts, params))
    wall_direct = time.perf_counter() - t
    return {
        "served_rps": n * k / wall_served,
        "direct_rps": n * k / wall_direct,
        "served_tps": sum(len(r["completion_token_ids"]) for r in rows) / wall_served,
        "direct_tps": tok_direct / wall_direct,
        "calls": srv.batcher.batches - calls0,
        "sizes": sorted(srv.batcher.batch_sizes.elements()),
        "busy": (srv.batcher.busy_s - busy0) / wall_served,
        "prompts": prompts,
    }


def p50_one_client(url: str, n: int, m: int, max_tokens: int) -> float:
    return statistics.median(_ask(url, i % n, max_tokens) for i in range(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=3, help="served/direct pairs, back to back")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    import torch  # here, not at the top: the client processes import this module

    from coderl.endpoint.http import BackgroundServer
    from coderl.online.server import InteractionServer
    from coderl.online.store import Store
    from coderl.policy import load_policy
    from coderl.policy.base import SamplingParams

    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    policy = load_policy("tiny-random", reference=False)
    store = Store(f"sqlite:///{tempfile.mkdtemp()}/online.db")
    n, k, m, budget = args.clients, args.rounds, 5 * args.rounds, args.max_new_tokens
    servers = {w: InteractionServer(policy, store, version=0, max_new_tokens=budget,
                                    batch_window_s=w) for w in (0.05, 0.0)}  # fmt: skip
    bgs = {w: BackgroundServer(s.app()) for w, s in servers.items()}
    url, url0 = (bgs[w].base_url + "/chat/completions" for w in (0.05, 0.0))
    try:
        _ask(url, 0, budget)  # warm-up
        trials = [
            trial(servers[0.05], store, policy, url, n, k, budget) for _ in range(args.trials)
        ]
        p50s, p50w = p50_one_client(url, n, m, budget), p50_one_client(url0, n, m, budget)
    finally:
        for bg in bgs.values():
            bg.stop()
    params = SamplingParams(temperature=0.8, max_new_tokens=budget)
    single = []
    for i in range(m):
        t = time.perf_counter()
        policy.generate([trials[0]["prompts"][i % n]], params)
        single.append(time.perf_counter() - t)
    p50d = statistics.median(single)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch threads {args.threads}, "
          f"load {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"{n} clients x {k} rounds, {budget} new tokens max, tiny-random, {args.trials} trials")
    for j, r in enumerate(trials):
        print(f"trial {j}: served {r['served_rps']:6.2f} req/s {r['served_tps']:7.1f} tok/s "
              f"({r['calls']} generate calls of {r['sizes']}, engine busy {r['busy']:.0%}); "
              f"direct {r['direct_rps']:6.2f} req/s {r['direct_tps']:7.1f} tok/s; "
              f"ratio req/s {r['served_rps'] / r['direct_rps']:.2f}")  # fmt: skip
    ratios = [r["served_rps"] / r["direct_rps"] for r in trials]
    print(f"ratio served/direct req/s: median {statistics.median(ratios):.2f} "
          f"(trials {', '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
    print(f"p50 at 1 client: served {1000 * p50s:.1f} ms, direct {1000 * p50d:.1f} ms, "
          f"ratio {p50s / p50d:.2f}; served without a batching window {1000 * p50w:.1f} ms, "
          f"ratio {p50s / p50w:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
