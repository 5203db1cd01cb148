"""Grading wall time vs running the same tests with plain pytest, in the same run.

For each task (from a task file whose environment is built), both arms run the task's
FAIL_TO_PASS + PASS_TO_PASS tests on the fixed code (starting state + gold patch):

- ``plain``: ``<env venv>/bin/python -m pytest -p no:cacheprovider -q <test ids>`` on a host copy
  of the fixed repository (no sandbox, no plugin, no canaries), the environment's own virtualenv;
- ``grade``: ``coderl.tasks.grading.grade(task, gold_patch)``: fresh sandbox, diff stripping and
  ``git apply``, read-only hidden tests, results plugin, canaries.

Prints the median wall time per arm and the overhead ``grade / plain - 1`` (target: <= 10%).

    .venv/bin/python bench/grading.py data/tasks/toolz.jsonl.gz --tasks 5 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from coderl.tasks.envbuild import find_env
from coderl.tasks.grading import grade
from coderl.tasks.patches import apply_patch, materialize
from coderl.tasks.spec import load_tasks


def plain_pytest(task, env) -> float:  # type: ignore[no-untyped-def]
    base = materialize(Path(env.snapshot), task.bug_patch)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "repo"
        shutil.copytree(base, work)
        apply_patch(work, task.gold_patch)
        ids = list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
        src = work if env.info.get("source_root", ".") == "." else work / env.info["source_root"]
        cmd = [f"{env.venv}/bin/python", "-m", "pytest", "-p", "no:cacheprovider", "-q", *ids]
        environ = dict(os.environ, PYTHONPATH=str(src), PYTHONHASHSEED="0")
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=work, env=environ, capture_output=True, text=True)
        elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"plain pytest failed on {task.id}: {proc.stdout[-500:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tasks_file")
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tasks = load_tasks(args.tasks_file)[: args.tasks]
    table = Table(title="grading vs plain pytest (median seconds)")
    for col in ("task", "tests", "plain", "grade", "overhead"):
        table.add_column(col)
    totals = {"plain": 0.0, "grade": 0.0}
    for task in tasks:
        env = find_env(task.env_id)
        plain, graded = [], []
        for _ in range(args.repeats):  # interleaved, so load on the machine hits both arms
            plain.append(plain_pytest(task, env))
            start = time.perf_counter()
            result = grade(task, task.gold_patch, env=env)
            graded.append(time.perf_counter() - start)
            if not result.resolved:
                raise RuntimeError(f"gold patch not resolved for {task.id}: {result.reason}")
        p, g = statistics.median(plain), statistics.median(graded)
        totals["plain"] += p
        totals["grade"] += g
        n = len(task.FAIL_TO_PASS) + len(task.PASS_TO_PASS)
        table.add_row(task.id, str(n), f"{p:.2f}", f"{g:.2f}", f"{g / p - 1:+.0%}")
    table.add_row(
        "total",
        "",
        f"{totals['plain']:.2f}",
        f"{totals['grade']:.2f}",
        f"{totals['grade'] / totals['plain'] - 1:+.0%}",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
