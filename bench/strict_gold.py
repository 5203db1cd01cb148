"""False positives of the second run's strict assertions (``coderl.grading.strictcmp``) on
shipped gold patches: each sampled task of ``data/tasks/*.jsonl.gz`` is graded with its gold
patch (guard off, twins as the twin check recorded) with the rule on; a gold patch that does not
resolve is graded again with the rule off, so a failure the rule causes is told from one it
does not. Tasks are taken round-robin over the libraries (``--per-lib`` each, in a shuffled order
drawn from ``--seed``), so a stopped run still samples every library.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/strict_gold.py [--per-lib N] [--seed S]

Prints one line per task and the totals per library.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from coderl.grading import strictcmp
from coderl.grading.grade import grade
from coderl.tasks.env import find_env
from coderl.tasks.spec import Task, load_tasks

ROOT = Path(__file__).resolve().parent.parent


def sample(per_lib: int, seed: int) -> list[Task]:
    """Up to ``per_lib`` repository tasks of each shipped library with a built environment,
    interleaved library by library."""
    rng = random.Random(seed)
    queues = []
    for path in sorted((ROOT / "data" / "tasks").glob("*.jsonl.gz")):
        tasks = [t for t in load_tasks(str(path)) if t.kind != "function"]
        try:
            if not tasks or not Path(find_env(tasks[0].env_id).snapshot).is_dir():
                print(f"{path.name}: environment not built, skipped", flush=True)
                continue
        except KeyError:
            print(f"{path.name}: environment not built, skipped", flush=True)
            continue
        rng.shuffle(tasks)
        queues.append(tasks[:per_lib] if per_lib else tasks)
    out = []
    for k in range(max(map(len, queues), default=0)):
        out += [q[k] for q in queues if k < len(q)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-lib", type=int, default=0, help="tasks per library (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    totals: dict[str, list[int]] = {}  # library -> [graded, resolved, failed by the rule]
    for task in sample(args.per_lib, args.seed):
        lib = task.id.split("/")[0]
        t0 = time.time()
        strictcmp.ENABLED = True
        r = grade(task, task.gold_patch, guard=False)
        row = totals.setdefault(lib, [0, 0, 0])
        if r.grading_error is not None:
            print(f"{task.id}: grading error {r.grading_error[:120]}", flush=True)
            continue
        row[0] += 1
        row[1] += r.resolved
        verdict = "resolved"
        if not r.resolved:
            strictcmp.ENABLED = False
            off = grade(task, task.gold_patch, guard=False)
            row[2] += off.resolved
            verdict = (
                f"NOT resolved ({'rule' if off.resolved else 'not the rule'}): {r.reason[:160]}"
            )
        print(f"{task.id}: {verdict} ({time.time() - t0:.0f}s)", flush=True)
    for lib, (n, ok, rule) in sorted(totals.items()):
        print(
            f"{lib}: {ok}/{n} gold patches resolved with strict assertions; {rule} failed by the rule"
        )
    n = sum(v[0] for v in totals.values())
    print(
        f"total: {sum(v[1] for v in totals.values())}/{n} resolved; "
        f"{sum(v[2] for v in totals.values())} failed by the rule"
    )


if __name__ == "__main__":
    main()
