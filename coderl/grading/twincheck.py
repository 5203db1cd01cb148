"""The twin check: which FAIL_TO_PASS tests' mutated twins break a task's gold patch, decided
once per task ahead of grading and recorded in a versioned file that grading reads.

Why. A twin (``coderl.grading.twins``) runs in its test's process, so a twin's side effect can
fail a real test: six's ``test_lazy`` asserts that ``html.parser`` is not imported yet, and its
twin imports it. Deciding at grading time (say, re-running without twins when the runs
disagree) would let the graded code trigger the decision; the decision here depends only on the
task and its gold patch, never on what is graded, so a forge cannot move it. A test whose twins
are dropped is graded as a test without a twin (``GradeResult.twinless``).

How (:func:`check_task`). The gold patch is graded through both runs (guard off: the check is
about the tests) twice, once with every twin before its test and once with every twin after it
(a twin's place relative to other tests is fixed by its test's; pytest runs a file's tests in
file order), so each real test runs after every twin that can precede it in some grade, and
each twin after its own test. A real test that passed the first run and not the second, or
whose twin did not fail, has its twins dropped and the task is checked again; if something
still fails in the second run (or failed there with no such test to blame), every twin of
the task is dropped and the check runs once more (a gold patch that fails even then is
recorded so, with every twin dropped). A failure of the first run, where no twin runs, drops
nothing and is recorded as the gold patch's. Not covered: a
correct fix other than the gold patch that meets a twin's side effect the gold patch does not,
and a literal value (drawn per grade) that decides a side effect.

The record (:data:`TWIN_CHECK`): ``{"version": 1, "rules": <twins.RULES>, "tasks": {id:
{"fingerprint", "untwinned", "gold", "checked"}}}``. A task not in it keeps every twin. A file
that does not parse or has another version or rules, or an entry whose task has changed since
(its fingerprint: environment, patches, tests, held-out tests), raises ``TwinRecordError`` (a ``ValueError``) naming
the file and the command that remakes it; ``grade()`` reports that as a grading error.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coderl.grading.rerun import TwinPolicy
from coderl.grading.twins import RULES
from coderl.grading.verdict import GradeResult
from coderl.tasks.snapshot import CHECKOUT_DATA
from coderl.tasks.spec import Task

TWIN_CHECK = CHECKOUT_DATA / "twin_check.json"
"""The shipped record of the twin check (``coderl tasks twin-check`` writes it)."""
VERSION = 1
"""The record's format version."""
REMAKE = "coderl tasks twin-check"

Grader = Callable[..., GradeResult]


def fingerprint(task: Task) -> str:
    """sha256 (hex) of what the check's verdict on ``task`` depends on: its environment,
    patches, FAIL_TO_PASS and held-out tests, and the twin rules (``twins.RULES``)."""
    parts = [
        task.env_id,
        task.bug_patch,
        task.gold_patch,
        task.FAIL_TO_PASS,
        task.held_out_tests,
        RULES,
    ]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def load(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Task id -> its entry in the record at ``path`` (default :data:`TWIN_CHECK`, read when
    called; ``{}`` when there is no file). Raises
    TwinRecordError (one line: the file, what is wrong, :data:`REMAKE`) for a file that does not
    parse, another format version, other twin rules or a malformed entry."""
    path = path or TWIN_CHECK
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return {}
    return _load(str(path), stat.st_size, stat.st_mtime_ns)


class TwinRecordError(ValueError):
    """The twin check record cannot be used: it does not parse, has another format version or
    twin rules, holds a malformed entry, or an entry made for other task data (stale). Its
    message names the file and :data:`REMAKE`."""


@functools.lru_cache(maxsize=4)
def _load(path: str, size: int, mtime_ns: int) -> dict[str, dict[str, Any]]:
    def bad(why: str) -> TwinRecordError:
        return TwinRecordError(f"{path}: {why}; remake it with `{REMAKE}`")

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"not a twin check record ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), dict):
        raise bad("not a twin check record (no 'tasks' object)")
    if data.get("version") != VERSION:
        raise bad(f"format version {data.get('version')!r}, this code reads {VERSION}")
    if data.get("rules") != RULES:
        raise bad(f"made under twin rules {data.get('rules')!r}, this code plants rules {RULES}")
    for task_id, entry in data["tasks"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("fingerprint"), str)
            and isinstance(entry.get("untwinned"), list)
            and all(isinstance(i, str) for i in entry["untwinned"])
        ):
            raise bad(f"task {task_id}: entry without a fingerprint and an 'untwinned' list")
    return data["tasks"]


def twin_policy(task: Task, path: Path | None = None) -> TwinPolicy:
    """The twins ``task``'s second run plants: without those of its recorded ``untwinned``
    tests; every twin when the record does not hold the task. Raises TwinRecordError (:func:`load`,
    or an entry made for other task data: stale)."""
    entry = load(path).get(task.id)
    if entry is None:
        return TwinPolicy()
    if entry["fingerprint"] != fingerprint(task):
        raise TwinRecordError(
            f"{path or TWIN_CHECK}: task {task.id} is not the task this id's twins were checked "
            "for (another fingerprint): a task of your own needs an id no shipped task has "
            "(rename it, e.g. the instance_id before `coderl tasks import`); a shipped task you "
            f"changed needs its entry remade: `{REMAKE} FILE --ids {task.id}`"
        )
    return TwinPolicy(untwinned=frozenset(entry["untwinned"]))


def _culprits(result: GradeResult) -> set[str]:
    """FAIL_TO_PASS ids whose test passed the first run and not the second, or whose twin
    did not fail."""
    out = set(result.twins_not_failed)
    for line in result.rerun_disagreed:  # "<id>: <first> then <second>"
        test, _, how = line.rpartition(": ")
        if how.startswith("passed then "):
            out.add(test)
    return out


def _second_run_failed(result: GradeResult) -> bool:
    """Whether ``result`` failed in its second run (the only run with twins)."""
    why = result.tampered or result.rerun_disagreed or result.twins_not_failed
    return result.second_run and bool(why or result.reason.startswith("second run"))


def check_task(
    task: Task, grader: Grader, *, env: Any = None, timeout: float = 300.0
) -> dict[str, Any]:
    """The record's entry for ``task`` (module doc): ``untwinned`` (sorted ids), ``gold``
    (``"resolved"``, or why the gold patch did not resolve with the final twins), the
    fingerprint and the date. ``grader`` is ``coderl.grading.grade.grade``. Raises
    RuntimeError on a grading (infrastructure) error."""
    f2p = sorted(set(task.FAIL_TO_PASS))
    untwinned: set[str] = set()
    gold = "resolved"
    for attempt in range(3):
        found: set[str] = set()
        gold, second = "resolved", False
        for side in ("before", "after"):
            policy = TwinPolicy(frozenset(untwinned), side)
            result = grader(
                task, task.gold_patch, env=env, timeout=timeout, guard=False, twins=policy
            )
            if result.grading_error is not None:
                raise RuntimeError(f"task {task.id}: {result.grading_error}")
            found |= _culprits(result)
            second |= _second_run_failed(result)
            if not result.resolved and gold == "resolved":
                gold = result.reason[:300]
        if not second or untwinned == set(f2p):
            break  # resolved, or failed where no twin runs (the first run)
        # a second run that failed for no test of its own (a twin that ends the process, say)
        # or failed again: every twin goes
        untwinned = untwinned | found if attempt == 0 and found else set(f2p)
    return {
        "fingerprint": fingerprint(task),
        "untwinned": sorted(untwinned),
        "gold": gold,
        "checked": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%MZ"),
    }


def save(entries: dict[str, dict[str, Any]], path: Path | None = None) -> None:
    """Merge ``entries`` (task id -> :func:`check_task`'s entry) into the record at ``path``
    (default :data:`TWIN_CHECK`; a record of other rules or format is replaced), written
    atomically."""
    path = path or TWIN_CHECK
    try:
        tasks = dict(load(path))
    except TwinRecordError:
        tasks = {}
    tasks.update(entries)
    text = json.dumps(
        {"version": VERSION, "rules": RULES, "tasks": tasks}, indent=1, sort_keys=True
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
