"""False positives of the reward-denying detector on correct fixes written differently from the
gold patch: each entry of ``bench/data/guard_alt_fixes.json`` (task id, text edits to the buggy
file, a note) is applied to the task's buggy tree (snapshot + ``bug_patch``), the detector is run
on the change as the grader runs it (with the released file's allowance), and, with ``--grade``,
the change is graded with the guard off to check that it really fixes the task.

    PYTHONPATH=$PWD .venv/bin/python bench/guard_alt_fixes.py [--grade] [--sdists DIR] [--only ID]

Prints one line per fix (clean or its findings; resolved or not) and the totals. A fix whose
environment is not built can be scanned (from an sdist) but not graded: it is counted apart.
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import json
import tempfile
from pathlib import Path

from diffguard_gold import released_source  # bench/ is the script's directory

from coderl.grading.apply import apply_to_copy
from coderl.grading.grade import grade
from coderl.grading.guardproc import scan_change
from coderl.tasks.env import find_env
from coderl.tasks.spec import Task

ROOT = Path(__file__).resolve().parent.parent
FIXES = ROOT / "bench" / "data" / "guard_alt_fixes.json"


def load_fixes() -> list[dict]:
    """The entries of ``FIXES``: ``{"id", "edits": [[find, replace], ...], "note"}``."""
    return json.loads(FIXES.read_text())


def load_task(task_id: str) -> Task:
    """The shipped task ``task_id`` (``<env name>-<version>/<hash>``) from ``data/tasks``.
    Raises KeyError when no task file holds it."""
    for path in sorted((ROOT / "data" / "tasks").glob("*.jsonl.gz")):
        for line in gzip.open(path, "rt"):
            row = json.loads(line)
            if row["id"] == task_id:
                return Task.model_validate(row)
    raise KeyError(task_id)


def apply_edits(text: str, edits: list[list[str]], task_id: str) -> str:
    """``text`` with each ``[find, replace]`` applied; ``find`` must occur exactly once.
    Raises ValueError naming the task and the edit otherwise."""
    for find, replace in edits:
        if text.count(find) != 1:
            raise ValueError(f"{task_id}: edit found {text.count(find)} times: {find[:60]!r}")
        text = text.replace(find, replace)
    return text


def unified(rel: str, before: str, after: str) -> str:
    """A git-style unified diff of one file (what an agent's sandbox hands the grader)."""
    body = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{rel}", f"b/{rel}"
    )
    return f"diff --git a/{rel} b/{rel}\n" + "".join(body)


def check(fix: dict, source: Path, scratch: Path, graded: bool) -> tuple[list[str], bool | None]:
    """``(findings, resolved)`` of one fix: the detector's findings as graded (strings), and
    whether grading it with the guard off resolves the task (None unless ``graded``)."""
    task = load_task(fix["id"])
    rel = task.extra["file"]
    buggy, fixed = scratch / "buggy", scratch / "fixed"
    apply_to_copy(source, task.bug_patch, lambda p: False, buggy)
    before = (buggy / rel).read_text()
    after = apply_edits(before, fix["edits"], fix["id"])
    diff = unified(rel, before, after)
    changed, _ = apply_to_copy(buggy, diff, lambda p: False, fixed)
    found = [str(f) for f in scan_change(buggy, fixed, changed, source)]
    resolved = grade(task, diff, guard=False).resolved if graded else None
    return found, resolved


def _built(env_id: str) -> bool:
    """Whether ``env_id``'s environment is built here (so a fix can be graded)."""
    try:
        return Path(find_env(env_id).snapshot).is_dir()
    except KeyError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grade", action="store_true", help="also grade each fix, guard off")
    ap.add_argument("--sdists", type=Path, default=None, help="sdists for unbuilt envs")
    ap.add_argument("--only", default=None, help="one task id")
    args = ap.parse_args()
    clean = resolved = graded = scanned = 0
    for fix in load_fixes():
        if args.only and fix["id"] != args.only:
            continue
        env_id = load_task(fix["id"]).env_id
        with tempfile.TemporaryDirectory() as tmp:
            source = released_source(env_id, args.sdists, Path(tmp))
            if source is None:
                print(f"skip {fix['id']}: no source at hand")
                continue
            found, ok = check(fix, source, Path(tmp), args.grade and _built(env_id))
        scanned += 1
        clean += not found
        graded += ok is not None
        resolved += bool(ok)
        state = "clean" if not found else "DENIED " + "; ".join(found)
        print(f"{fix['id']}: {state}; resolved={ok} ({fix['note']})")
    print(f"clean under the guard: {clean} of {scanned}")
    if args.grade:
        print(f"resolved with the guard off: {resolved} of {graded} graded")


if __name__ == "__main__":
    main()
