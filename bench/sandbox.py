"""Sandbox start-up benchmark: ours (fresh and pooled) vs plain ``subprocess`` and bare ``bwrap``.

    .venv/bin/python bench/sandbox.py [--runs 60] [--parallel 8]

Latency: create + first command (``true``) + close, p50/p90 in milliseconds, for a ~200-file and
a ~1,500-file repository, plus the same through a warm ``SandboxPool`` (the latency its caller
sees when a started sandbox is ready: the pool is refilled between calls, outside the timed
region). The rows are measured round-robin, one run of each in turn, so that the load of a
shared machine weighs on all of them alike.

CPU: user + system time of this process and its reaped children per cycle (``getrusage``),
including, for the pooled row, the background start of the replacement. It undercounts bwrap:
processes bwrap leaves to be reaped by the host's init are missing (``perf stat -e task-clock``
over the whole process tree measured ~3.7 ms more per sandbox cycle and ~3 ms more per bare
bwrap), and so are kernel threads (the network-namespace teardown runs in a work queue).

Throughput: cycles per second with ``--parallel`` threads each running create + command +
close. The pooled figure is sustained: the pool starts full and the clock stops only when it is
full again, so it includes every background start (a pool does not create CPU).

Baselines in the same run: ``subprocess.run(["bash", "-c", "true"])`` (no isolation at all) and
``bwrap --unshare-all ... true`` (namespaces only, no workspace, no shell, no uid change).
Issue #4 targets: p50 <= 15 ms for 200 files, >= 100 sandboxes/s on 2 cores, p50 independent of
repository size.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coderl.sandbox import Sandbox
from coderl.sandbox.pool import SandboxPool

BARE_BWRAP = [
    "bwrap", "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
    "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
    "--dev", "/dev", "--", "/bin/true",
]  # fmt: skip


def make_repo(root: Path, n_files: int) -> Path:
    """A synthetic Python repository: ``n_files`` ~2 KB modules, 20 per package."""
    for i in range(n_files):
        pkg = root / f"pkg{i // 20}"
        pkg.mkdir(parents=True, exist_ok=True)
        body = "".join(f"def f{j}(x):\n    return x + {j}\n\n\n" for j in range(60))
        (pkg / f"mod{i}.py").write_text(body)
    return root


def sandbox_cycle(base: Path, pool: SandboxPool | None = None) -> Callable[[], None]:
    def run() -> None:
        with Sandbox.create(base, pool=pool) as sb:
            if sb.exec("true").exit_code != 0:
                raise RuntimeError("first command failed")

    return run


def subprocess_cycle() -> None:
    subprocess.run(["bash", "-c", "true"], check=True)


def bwrap_cycle() -> None:
    subprocess.run(BARE_BWRAP, check=True)


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (user + system), seconds."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def round_robin(
    rows: dict[str, tuple[Callable[[], None], Callable[[], None]]], runs: int
) -> dict[str, tuple[list[float], float]]:
    """Per row: wall milliseconds of each timed call, and mean CPU milliseconds per run.

    ``rows``: name -> (timed call, untimed follow-up whose CPU still counts, e.g. a refill).
    """
    for timed, after in rows.values():  # warm-up: imports, the idmapping user namespace
        timed()
        after()
    wall: dict[str, list[float]] = {name: [] for name in rows}
    cpu = dict.fromkeys(rows, 0.0)
    for _ in range(runs):
        for name, (timed, after) in rows.items():
            c, t = cpu_seconds(), time.perf_counter()
            timed()
            wall[name].append((time.perf_counter() - t) * 1000)
            after()
            cpu[name] += cpu_seconds() - c
    return {name: (wall[name], cpu[name] * 1000 / runs) for name in rows}


def throughput(
    fn: Callable[[], None], total: int, parallel: int, settle: Callable[[], object] = tuple
) -> float:
    """Completed cycles per second with ``parallel`` threads; ``settle`` (inside the clock)
    waits for background work the cycles caused."""
    t = time.perf_counter()
    with ThreadPoolExecutor(parallel) as threads:
        list(threads.map(lambda _: fn(), range(total)))
    settle()
    return total / (time.perf_counter() - t)


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()
    nothing = lambda: None  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp, SandboxPool(size=args.parallel) as pool:
        small = make_repo(Path(tmp) / "r200", 200)
        large = make_repo(Path(tmp) / "r1500", 1500)
        pool.prepare(small, 1)
        pool.wait_ready()
        refill = lambda: pool.wait_ready()  # noqa: E731
        rows = round_robin(
            {
                "subprocess bash -c true": (subprocess_cycle, nothing),
                "bwrap --unshare-all true": (bwrap_cycle, nothing),
                "sandbox, 200 files": (sandbox_cycle(small), nothing),
                "sandbox, 1500 files": (sandbox_cycle(large), nothing),
                "pooled, 200 files": (sandbox_cycle(small, pool), refill),
            },
            args.runs,
        )
        latency_hits = pool.stats.hits
        total = args.runs * 2
        rates = {
            "subprocess": throughput(subprocess_cycle, total, args.parallel),
            "bwrap --unshare-all": throughput(bwrap_cycle, total, args.parallel),
            "sandbox": throughput(sandbox_cycle(small), total, args.parallel),
        }
        pool.prepare(small, args.parallel)
        pool.wait_ready()
        hits, misses = pool.stats.hits, pool.stats.misses
        pooled = throughput(sandbox_cycle(small, pool), total, args.parallel, refill)
        rates["pooled (sustained)"] = pooled
        hits, misses = pool.stats.hits - hits, pool.stats.misses - misses
    base_p50 = statistics.median(rows["subprocess bash -c true"][0])
    load = os.getloadavg()[0]
    print(f"create + first command + close, {args.runs} runs each, round-robin (ms);")
    print(f"load average {load:.1f} on {os.cpu_count()} CPUs")
    print(f"{'':28} {'p50':>8} {'p90':>8} {'p50 / subprocess':>18} {'CPU ms':>8}")
    for name, (xs, cpu) in rows.items():
        p50 = statistics.median(xs)
        print(f"{name:28} {p50:8.1f} {pct(xs, 90):8.1f} {p50 / base_p50:17.1f}x {cpu:8.1f}")
    print(f"  (pooled row: {latency_hits} of {args.runs + 1} calls got a warm sandbox)")
    size_ratio = statistics.median(rows["sandbox, 1500 files"][0]) / statistics.median(
        rows["sandbox, 200 files"][0]
    )
    print(f"p50 1500 files / p50 200 files: {size_ratio:.2f}")
    print(f"{args.parallel} concurrent, {total} cycles:")
    for name, rate in rates.items():
        print(f"  {name:22} {rate:7.1f} /s  ({rate / rates['bwrap --unshare-all']:.2f}x bwrap)")
    print(f"  (pooled: {hits} warm, {misses} started on the spot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
