"""How many shipped FAIL_TO_PASS tests the second run gives a mutated twin
(``coderl.grading.twins``): static analysis of the pristine test files only, nothing runs.

Plants each repository task's second run as ``grade()`` would (``plant_canaries`` over the
environment's snapshot, the rest of its suite as ``others``) and counts the FAIL_TO_PASS tests
with a twin and without, and the tasks by how many held-out FAIL_TO_PASS tests got a twin (a
forge that carries the visible tests' sources can tell their twins apart; it has to guess
between each twinned held-out test and its twin, a 1 in ``2 ** n`` bet). Run: ``python bench/twin_coverage.py [data/tasks/six.jsonl.gz ...]``
(default: every ``data/tasks/*.jsonl*``); tasks whose environment is not built are skipped;
the twins the twin check dropped (``data/twin_check.json``) are not counted.
"""

from __future__ import annotations

import random
import sys
import tempfile
from collections import Counter
from pathlib import Path

from coderl.grading.rerun import plant_canaries
from coderl.grading.twincheck import twin_policy
from coderl.tasks.env import find_env
from coderl.tasks.spec import load_tasks


def coverage(path: Path) -> Counter[str]:
    """``twinned``/``twinless``/``tasks``/``no env`` counts over the repository tasks of ``path``."""
    out: Counter[str] = Counter()
    for task in load_tasks(path):
        if task.kind != "repo":
            continue
        try:
            env = find_env(task.env_id)
        except (KeyError, FileNotFoundError, ValueError):
            out["no env"] += 1
            continue
        snap = Path(env.snapshot)
        f2p = list(dict.fromkeys(task.FAIL_TO_PASS))
        sources = {rel: snap / rel for rel in {t.split("::")[0] for t in f2p}}
        roots = [snap / t for t in env.test_paths]
        suite = tuple(p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py")))
        with tempfile.TemporaryDirectory() as tmp:
            policy = twin_policy(task)  # without the twins the twin check dropped
            planted = plant_canaries(sources, f2p, random.Random(0), Path(tmp), suite, twins=policy)
        twinless = planted.twinless if planted.mounts else f2p
        out["tasks"] += 1
        out["tasks with every test twinned"] += not twinless
        out["twinned"] += len(f2p) - len(twinless)
        out["twinless"] += len(twinless)
        # a forge that carries the visible tests' sources tells their twins apart; each twinned
        # held-out test is left a coin toss between it and its twin
        held = {t for t in f2p if t in set(task.held_out_tests)} - set(twinless)
        out[f"tasks with {_bucket(len(held))} twinned held-out tests"] += 1
    return out


def _bucket(n: int) -> str:
    return str(n) if n < 2 else ("2-6" if n < 7 else "7+")


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted(Path("data/tasks").glob("*.jsonl*"))
    total: Counter[str] = Counter()
    for path in paths:
        got = coverage(path)
        total += got
        print(f"{path.name}: {dict(got)}", flush=True)
    print(f"all: {dict(total)}")


if __name__ == "__main__":
    main(sys.argv[1:])
