"""Parity of the container and bwrap backends on shipped tasks: the gold patch and the empty patch
of every task graded in both, verdicts compared.

    .venv/bin/python bench/container_parity.py [data/tasks/parse.jsonl.gz ...]
        [--limit N] [--image TAG] [--out parity.json]

No files: every shipped ``data/tasks/*.jsonl.gz``.
For each task whose environment is built (``coderl tasks build-env``): ``grade(task, gold)`` and
``grade(task, "")`` through ``Sandbox.create(..., backend=B)`` for B in bwrap, container. Two
grades agree when ``resolved``, ``failure_kind``, the per-test outcomes (``GradeResult.tests``: the
task's FAIL_TO_PASS and PASS_TO_PASS tests), ``tampered`` and ``denied`` are equal. Prints agreement per file and every disagreement
(issue 43's target: 100%), the load average before and after, and writes the rows as JSON.

Each row is also appended, as soon as its four grades are done, to ``OUT`` with ``.jsonl`` for
its suffix (``parity.jsonl`` for ``--out parity.json``), so a crash loses one task at most;
``--resume`` reads that file first and grades only the tasks not in it.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import time
from pathlib import Path

from coderl.grading.grade import grade
from coderl.grading.verdict import GradeResult
from coderl.sandbox import Sandbox
from coderl.sandbox.container import IMAGE_ENV
from coderl.sandbox.images import base_image
from coderl.tasks.env import find_env
from coderl.tasks.spec import Task, load_tasks


def verdict(result: GradeResult) -> dict:
    """What two backends must agree on."""
    return {
        "resolved": result.resolved,
        "failure_kind": result.failure_kind,
        "grading_error": result.grading_error is not None,
        "tests": result.tests,
        "tampered": result.tampered,
        "denied": result.denied,
    }


def grade_both(task: Task) -> dict:
    row: dict = {"task": task.id}
    for backend in ("bwrap", "container"):
        factory = functools.partial(Sandbox.create, backend=backend)
        for name, diff in (("gold", task.gold_patch), ("empty", "")):
            t = time.perf_counter()
            row[f"{backend}/{name}"] = verdict(grade(task, diff, factory=factory))
            row[f"{backend}/{name}/s"] = round(time.perf_counter() - t, 2)
    row["agree"] = all(row[f"bwrap/{n}"] == row[f"container/{n}"] for n in ("gold", "empty"))
    return row


def done_rows(path: Path) -> dict[str, dict]:
    """The rows already in the per-task log ``path``, by task id (empty when there is none); a
    last line cut short by a crash is dropped."""
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        rows[row["task"]] = row
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tasks", nargs="*", default=sorted(glob.glob("data/tasks/*.jsonl.gz")))
    ap.add_argument("--limit", type=int, default=None, help="tasks per file")
    ap.add_argument("--image", default=None)
    ap.add_argument("--out", default="container_parity.json")
    ap.add_argument("--resume", action="store_true", help="skip tasks already in OUT's .jsonl log")
    args = ap.parse_args()
    os.environ[IMAGE_ENV] = args.image or base_image()
    print(f"load before: {os.getloadavg()}")
    log = Path(args.out).with_suffix(".jsonl")
    done = done_rows(log) if args.resume else {}
    if not args.resume:
        log.write_text("")
    rows = []
    for path in args.tasks:
        tasks = load_tasks(path)[: args.limit]
        try:
            find_env(tasks[0].env_id)
        except KeyError:
            print(f"{path}: environment not built, skipped")
            continue
        own = []
        for task in tasks:
            row = done.get(task.id)
            if row is None:
                row = grade_both(task)
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            own.append(row)
        rows += own
        agree = sum(r["agree"] for r in own)
        print(f"{path}: {agree}/{len(own)} tasks agree (gold and empty, both backends)")
    for r in rows:
        if not r["agree"]:
            print(f"DISAGREE {r['task']}: {json.dumps(r)[:600]}")
    total = sum(r["agree"] for r in rows)
    print(f"all: {total}/{len(rows)} agree; load after: {os.getloadavg()}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    return 0 if total == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
