"""Sandbox start-up benchmark: ours vs plain ``subprocess`` (and bare ``bwrap``), same run.

    .venv/bin/python bench/sandbox.py [--runs 60] [--parallel 8]

Measures, for a ~200-file and a ~1,500-file repository: create + first command (``true``) +
close, p50/p90 in milliseconds; and sandboxes per second with ``--parallel`` threads each running
create + command + close. Baselines in the same run: ``subprocess.run(["bash", "-c", "true"])``
(no isolation at all) and ``bwrap --unshare-all ... true`` (namespaces only, no workspace).
Issue #4 targets: p50 <= 15 ms for 200 files, >= 100 sandboxes/s, p50 independent of size.
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


def sandbox_cycle(base: Path) -> Callable[[], None]:
    def run() -> None:
        with Sandbox.create(base) as sb:
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


def latencies(fn: Callable[[], None], runs: int) -> tuple[list[float], float]:
    """Wall milliseconds of each run, and the mean CPU milliseconds per run (load-independent;
    kernel work done in kernel threads, such as namespace teardown, is not counted)."""
    fn()  # warm-up: first-use costs (user namespace for idmapping, imports) are not per sandbox
    out = []
    cpu = cpu_seconds()
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out, (cpu_seconds() - cpu) * 1000 / runs


def throughput(fn: Callable[[], None], total: int, parallel: int) -> float:
    """Completed cycles per second with ``parallel`` threads."""
    t = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(lambda _: fn(), range(total)))
    return total / (time.perf_counter() - t)


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        small = make_repo(Path(tmp) / "r200", 200)
        large = make_repo(Path(tmp) / "r1500", 1500)
        rows = [
            ("subprocess bash -c true", latencies(subprocess_cycle, args.runs)),
            ("bwrap --unshare-all true", latencies(bwrap_cycle, args.runs)),
            ("sandbox, 200 files", latencies(sandbox_cycle(small), args.runs)),
            ("sandbox, 1500 files", latencies(sandbox_cycle(large), args.runs)),
        ]
        total = args.runs * 2
        rate_sub = throughput(subprocess_cycle, total, args.parallel)
        rate_small = throughput(sandbox_cycle(small), total, args.parallel)
    base_p50 = statistics.median(rows[0][1][0])
    load = os.getloadavg()[0]
    print(f"create + first command + close, {args.runs} runs each (ms); load average {load:.1f}")
    print(f"{'':28} {'p50':>8} {'p90':>8} {'p50 / subprocess':>18} {'CPU ms':>8}")
    for name, (xs, cpu) in rows:
        p50 = statistics.median(xs)
        print(f"{name:28} {p50:8.1f} {pct(xs, 90):8.1f} {p50 / base_p50:17.1f}x {cpu:8.1f}")
    size_ratio = statistics.median(rows[3][1][0]) / statistics.median(rows[2][1][0])
    print(f"p50 1500 files / p50 200 files: {size_ratio:.2f}")
    print(f"{args.parallel} concurrent, {total} cycles:")
    print(f"  subprocess  {rate_sub:7.1f} /s")
    print(f"  sandbox     {rate_small:7.1f} /s  ({rate_small / rate_sub:.2f}x subprocess)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
