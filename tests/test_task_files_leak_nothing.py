"""No statement in any task file of the repository lets a policy earn the reward without the
work (issue 47, class 3). Every task file git tracks is read, shipped or fixture:

- a repository task's statement names none of its held-out FAIL_TO_PASS tests (``data/tasks/
  ci.jsonl`` once did in all 4 statements: it missed the restatement the shipped copies got);
- no function task lets a lookup pass: keeping the bug and answering every input the statement
  or workspace shows (the failing assertion, docstring examples) as the gold solution does fails
  the hidden check (:func:`coderl.synth.fnlookup.lookup_passes`; 26 of the 600 shipped repair
  tasks passed it and were dropped). Synthesis refuses such tasks (``fnrepair.validate``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from coderl.synth.fnlookup import lookup_passes, shown_inputs
from coderl.tasks.spec import Task, load_tasks
from coderl.tasks.statement import held_out_mentions

ROOT = Path(__file__).resolve().parent.parent


def _task_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.jsonl", "*.jsonl.gz"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    out = []
    for rel in listed:
        try:
            if load_tasks(ROOT / rel):
                out.append(ROOT / rel)
        except Exception:  # noqa: BLE001 - not a task file (seeds, demonstrations, ...)
            continue
    return out


FILES = _task_files()
TASKS = {path.relative_to(ROOT).as_posix(): load_tasks(path) for path in FILES}


def test_every_task_file_is_read() -> None:
    names = set(TASKS)
    assert {
        "data/tasks/ci.jsonl",
        "data/fnrepair/tasks.jsonl.gz",
        "data/tasks/six.jsonl.gz",
    } <= names
    assert len(names) >= 14


@pytest.mark.parametrize("name", sorted(TASKS))
def test_no_statement_names_a_held_out_test(name: str) -> None:
    bad = [
        (t.id, held_out_mentions(t.problem_statement, t.held_out_tests))
        for t in TASKS[name]
        if t.held_out_tests and held_out_mentions(t.problem_statement, t.held_out_tests)
    ]
    assert bad == [], bad[:3]


def test_shown_inputs_reads_assertions_and_docstring_examples() -> None:
    task = Task(
        id="t",
        kind="function",
        env_id="python3",
        problem_statement="The failing test reports:\n```\n    assert candidate([1, 2], k=3) == 6\n```",
        FAIL_TO_PASS=["hidden_test.py::check"],
        workspace_files={"solution.py": 'def f(x, k=1):\n    """>>> f((1, "a"))\n    2"""\n'},
        extra={"entry_point": "f"},
        gold_patch="x",
        source="test",
        license="MIT",
    )
    assert shown_inputs(task) == ["(([1, 2],), {'k': 3})", "(((1, 'a'),), {})"]


needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@needs_sandbox
def test_no_function_task_lets_a_lookup_pass() -> None:
    tasks = [t for ts in TASKS.values() for t in ts if t.kind == "function"]
    played = lookup_passes(tasks)
    assert len(played) >= 570  # every repair task was played
    assert sorted(i for i, leaked in played.items() if leaked) == []


@needs_sandbox
def test_the_lookup_play_catches_a_statement_that_shows_the_failing_call() -> None:
    """The class's members, planted: a repair task whose statement shows its one failing
    assertion (a single-assertion check), one whose docstring shows it, and one that shows
    every input of the check; and a control whose failing input is not shown."""
    gold = "def f(x):\n    return x * 2\n"
    buggy = "def f(x):\n    return x * 2 if x != 3 else 5\n"
    check = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(3) == 6\n"

    def task(statement: str, workspace: str = buggy) -> Task:
        return Task(
            id=f"t{abs(hash((statement, workspace)))}",
            kind="function",
            env_id="python3",
            problem_statement=statement,
            FAIL_TO_PASS=["hidden_test.py::check"],
            hidden_tests={"hidden_test.py": check},
            workspace_files={"solution.py": workspace},
            extra={"entry_point": "f", "gold_file": gold},
            gold_patch="x",
            source="test",
            license="MIT",
        )

    shown = task("The failing test reports:\n```\n    assert candidate(3) == 6\n```")
    doc = task("fix f", buggy.replace("):\n", '):\n    """f(3) is 6"""\n', 1))
    both = task("assert candidate(1) == 2; assert candidate(3) == 6")
    control = task("The failing test reports:\n```\nAssertionError\n```")
    played = lookup_passes([shown, doc, both, control])
    assert [played[t.id] for t in (shown, doc, both, control)] == [True, True, True, False]
    assert re.search("candidate", shown.problem_statement)
