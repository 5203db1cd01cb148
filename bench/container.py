"""Container sandbox vs bwrap sandbox, side by side in one run: start, exec and a repository grade.

    .venv/bin/python bench/container.py [--runs 30] [--execs 200] [--grades 5]
        [--tasks data/tasks/parse.jsonl.gz] [--image TAG] [--cli podman|docker|PATH]

Rows (measured round-robin, one run of each in turn, so a shared machine's load weighs on both):

- start-to-first-exec: ``Sandbox.create(base)`` + ``exec("true")``, wall milliseconds (p50/p90);
  ``close`` is timed apart (it is off the rollout's critical path only when done in background);
- exec latency: ``exec("true")`` in a started sandbox, p50/p90 milliseconds;
- grade: ``coderl.grading.grade.grade(task, task.gold_patch)`` for the first task of ``--tasks``
  whose environment is built (``coderl tasks build-env``), the default factory (bwrap) against
  ``Sandbox.create(..., backend="container")``; median seconds and the ratio container / bwrap,
  with the two verdicts (they must agree).

Image: ``--image`` or the Debian base (``coderl.sandbox.images.base_image``, built when missing).
Targets (issue 43): container start-to-first-exec p50 <= 0.5 s; a repository grade in a container
<= 2x the same grade in bwrap. Prints the CPU model and flags count, podman's version and the load
average before and after.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from coderl.sandbox import Sandbox
from coderl.sandbox.container import CLI_ENV, IMAGE_ENV, container_cli
from coderl.sandbox.images import base_image

HOW = """\
how to run it (a quiet machine, as root, nothing else running; a few minutes):
  make sysdeps container-image                    # podman, runc, mmdebstrap; the Debian base
  .venv/bin/python -m coderl tasks build-env parse==1.22.4   # the grade rows' environment
  .venv/bin/python bench/container.py --runs 30 --execs 200 --grades 5
  .venv/bin/python bench/container_parity.py data/tasks/parse.jsonl.gz   # parity, ~10 min
Report the printed rows with the date, the CPU line, the CLI version and both load averages.
--cli docker times Docker's CLI where docker is installed (it never was where this was written).
"""

sys.path.insert(0, str(Path(__file__).parent))
from grading import cpu_flags  # noqa: E402
from sandbox import make_repo  # noqa: E402


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def start_rows(base: Path, runs: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per backend: start-to-first-exec and close, wall milliseconds of each run."""
    out: dict[str, tuple[list[float], list[float]]] = {"bwrap": ([], []), "container": ([], [])}
    for i in range(runs + 1):  # the first round warms up (imports, the reaper, image cache)
        for backend, (starts, closes) in out.items():
            t = time.perf_counter()
            sb = Sandbox.create(base, backend=backend)
            if sb.exec("true").exit_code != 0:
                raise RuntimeError(f"{backend}: first command failed")
            t1 = time.perf_counter()
            sb.close()
            if i:
                starts.append((t1 - t) * 1000)
                closes.append((time.perf_counter() - t1) * 1000)
    return out


def exec_rows(base: Path, execs: int) -> dict[str, list[float]]:
    """Per backend: wall milliseconds of each ``exec("true")`` in one started sandbox."""
    boxes = {b: Sandbox.create(base, backend=b) for b in ("bwrap", "container")}
    out: dict[str, list[float]] = {b: [] for b in boxes}
    try:
        for _ in range(execs):
            for backend, sb in boxes.items():
                t = time.perf_counter()
                sb.exec("true")
                out[backend].append((time.perf_counter() - t) * 1000)
    finally:
        for sb in boxes.values():
            sb.close()
    return out


def grade_rows(tasks_file: str, repeats: int) -> tuple[str, dict[str, list[float]], set[str]]:
    """Task id, per backend the seconds of each gold-patch grade, and the verdicts seen."""
    from coderl.grading.grade import grade
    from coderl.tasks.env import find_env
    from coderl.tasks.spec import load_tasks

    task = None
    for t in load_tasks(tasks_file):
        try:
            find_env(t.env_id)
        except KeyError:
            continue
        task = t
        break
    if task is None:
        raise SystemExit(
            f"no task of {tasks_file} has a built environment (coderl tasks build-env)"
        )
    factories: dict[str, Callable[..., Sandbox]] = {
        "bwrap": functools.partial(Sandbox.create, backend="bwrap"),
        "container": functools.partial(Sandbox.create, backend="container"),
    }
    times: dict[str, list[float]] = {b: [] for b in factories}
    verdicts: set[str] = set()
    for _ in range(repeats):
        for backend, factory in factories.items():
            t = time.perf_counter()
            result = grade(task, task.gold_patch, factory=factory)
            times[backend].append(time.perf_counter() - t)
            verdicts.add(f"{backend}: resolved={result.resolved} error={result.grading_error}")
    return task.id, times, verdicts


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, epilog=HOW, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--execs", type=int, default=200)
    ap.add_argument("--grades", type=int, default=5)
    ap.add_argument("--tasks", default="data/tasks/parse.jsonl.gz")
    ap.add_argument("--image", default=None, help="default: the Debian base, built when missing")
    ap.add_argument("--cli", default=None, help="container CLI (default: podman, else docker)")
    args = ap.parse_args()
    if args.cli:
        os.environ[CLI_ENV] = args.cli
    os.environ[IMAGE_ENV] = args.image or base_image()
    cli = container_cli()[0]
    version = subprocess.run([cli, "--version"], capture_output=True, text=True).stdout
    print(f"cpu: {cpu_flags()}")
    print(f"{version.strip()} ({cli}); image {os.environ[IMAGE_ENV]}")
    print(f"load before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        base = make_repo(Path(tmp) / "r200", 200)
        starts = start_rows(base, args.runs)
        execs = exec_rows(base, args.execs)
    print(f"\nstart-to-first-exec, {args.runs} runs, 200-file repository (ms)")
    for backend, (s, c) in starts.items():
        print(
            f"  {backend:9s} p50 {pct(s, 50):7.1f}  p90 {pct(s, 90):7.1f}   "
            f"close p50 {pct(c, 50):6.1f}"
        )
    ratio = pct(starts["container"][0], 50) / pct(starts["bwrap"][0], 50)
    print(f"  container / bwrap p50: {ratio:.1f}x   (target: container p50 <= 500 ms)")
    print(f"\nexec('true') latency, {args.execs} calls (ms)")
    for backend, xs in execs.items():
        print(f"  {backend:9s} p50 {pct(xs, 50):7.2f}  p90 {pct(xs, 90):7.2f}")
    if args.grades:
        task_id, times, verdicts = grade_rows(args.tasks, args.grades)
        print(f"\ngrade(gold patch) of {task_id}, {args.grades} runs each (s)")
        for backend, xs in times.items():
            print(f"  {backend:9s} median {statistics.median(xs):6.2f}  min {min(xs):6.2f}")
        r = statistics.median(times["container"]) / statistics.median(times["bwrap"])
        print(f"  container / bwrap median: {r:.2f}x   (target <= 2x)")
        for v in sorted(verdicts):
            print(f"  verdict {v}")
    print(f"\nload after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
