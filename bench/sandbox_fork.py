"""Sandbox fork benchmark: ``Sandbox.fork()`` of a live sandbox vs ``Sandbox.create`` of a fresh one.

    .venv/bin/python bench/sandbox_fork.py [--runs 40] [--files 200] [--changed 20]

The parent holds a ~``--files``-file repository (the same synthetic repository as
``bench/sandbox.py``) with ``--changed`` of its files rewritten, a new file, a deleted one, a
``cd`` and an exported variable, so the fork has real changes to copy. Rows, measured
round-robin (one run of each in turn, so a shared machine's load weighs on all alike), in ms:

- ``fork``: ``parent.fork()`` until it returns (the child's shell is started: the child is usable);
- ``fork + first command + close``: the same plus ``child.exec("true")`` and ``child.close()``;
- ``create + first command + close``: a fresh sandbox of the same repository, the baseline.

Target (docs/sandbox.md, "Fork"): p50 ``fork`` <= 30 ms for a 200-file workspace.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from grading import cpu_flags  # noqa: E402
from sandbox import make_repo, pct  # noqa: E402

from coderl.sandbox import Sandbox  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--changed", type=int, default=20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = make_repo(Path(tmp) / "repo", args.files)
        with Sandbox.create(base) as parent:
            files = sorted(p.relative_to(base) for p in base.rglob("*.py"))
            for rel in files[: args.changed]:
                parent.write_text(str(rel), f"# changed\n{(base / rel).read_text()}")
            parent.write_text("new_module.py", "X = 1\n")
            cmd = f"rm {files[-1]} && mkdir -p work && cd work && export CODERL_BENCH=1"
            if parent.exec(cmd).exit_code != 0:
                raise RuntimeError("preparing the parent failed")

            def fork_only() -> float:
                start = time.perf_counter()
                child = parent.fork()
                elapsed = time.perf_counter() - start
                child.close()
                return elapsed

            def fork_use() -> float:
                start = time.perf_counter()
                with parent.fork() as child:
                    if child.exec("true").exit_code != 0:
                        raise RuntimeError("the child's first command failed")
                return time.perf_counter() - start

            def create_use() -> float:
                start = time.perf_counter()
                with Sandbox.create(base) as sb:
                    if sb.exec("true").exit_code != 0:
                        raise RuntimeError("the fresh sandbox's first command failed")
                return time.perf_counter() - start

            rows: dict[str, Callable[[], float]] = {
                "fork": fork_only,
                "fork + first command + close": fork_use,
                "create + first command + close": create_use,
            }
            for run in rows.values():  # warm-up
                run()
            times: dict[str, list[float]] = {name: [] for name in rows}
            for _ in range(args.runs):
                for name, run in rows.items():
                    times[name].append(run() * 1000)
    print(f"CPU: {cpu_flags()}; load average {os.getloadavg()[0]:.1f}")
    print(f"{args.files}-file repository, {args.changed} files changed; {args.runs} runs (ms)")
    base_p50 = statistics.median(times["create + first command + close"])
    print(f"{'':32} {'p50':>8} {'p90':>8} {'p50 / create':>14}")
    for name, xs in times.items():
        p50 = statistics.median(xs)
        print(f"{name:32} {p50:8.1f} {pct(xs, 90):8.1f} {p50 / base_p50:13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
