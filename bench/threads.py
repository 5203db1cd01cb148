"""Oversubscription: ``--procs`` concurrent ``coderl train`` processes of the toy preset at each
``threads`` value, the wall seconds of each process (every process does the same work).

Why: torch starts one intra-op thread per core, so two training processes on a 2-core machine
run 4 threads on 2 cores and spin-wait for each other; ``threads`` (docs/training.md, "Config") caps
each process. Prints the CPU count, the load average before and after,
and per ``threads`` value the processes' wall seconds; run it on a quiet machine.

    .venv/bin/python bench/threads.py                       # 2 processes, threads 1 and 2
    .venv/bin/python bench/threads.py --procs 3 --threads 1,2 --steps 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_round(procs: int, threads: int, steps: int, tmp: Path) -> list[float]:
    """Start ``procs`` toy runs at once at ``threads``; their wall seconds, in start order."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the config decides
    cmd = [sys.executable, "-m", "coderl", "train", str(ROOT / "configs" / "toy.yaml")]
    args = ["progress=false", "tensorboard=false", "eval.before_after=false", "--no-report"]
    args += [f"trainer.steps={steps}", f"threads={threads}"]
    started = []
    for i in range(procs):
        run = tmp / f"t{threads}-p{i}"
        out = subprocess.Popen([*cmd, *args, f"run_dir={run}"], env=env, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        started.append((time.perf_counter(), out))
    walls = []
    for t0, p in started:
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"a run failed ({p.returncode}): {err[-2000:]}")
        walls.append(time.perf_counter() - t0)
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2, help="concurrent processes")
    ap.add_argument("--threads", default="1,2", help="threads values, comma-separated")
    ap.add_argument("--steps", type=int, default=2, help="training steps per process")
    a = ap.parse_args()
    print(f"cpus {os.cpu_count()}, load before {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (int(t) for t in a.threads.split(",")):
            walls = one_round(a.procs, threads, a.steps, Path(tmp))
            shown = ", ".join(f"{w:.1f}" for w in walls)
            print(f"threads={threads}: {a.procs} processes x {a.steps} steps, wall s: {shown}")
    print(f"load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
