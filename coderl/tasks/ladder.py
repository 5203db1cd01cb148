"""The horizon ladder: one repository task at four levels of how much its statement gives away.

A level is a variant of a shipped (or synthesised) repo task: the same environment, tests,
held-out tests and patches, graded the same way, with its own problem statement and the id
``<task id>@L<level>``; ``task.extra["ladder"]`` holds ``{"level": k, "of": <task id>}``.

- **L0**: one visible failing test (its output, when the stored statement quotes it) and the
  bug's place, down to the file and line, with the buggy line(s) quoted: about three calls
  (read the window, edit, submit). Offered only when the fix is one edit (one change block).
- **L1**: the failing test and the file of the bug, not the line (read the file's code, edit).
- **L2**: the failing test's output only (search, read, edit, run the visible test, submit).
- **L3**: the stored statement, unchanged (every visible failing test, several outputs).

The bug's place is read from the gold patch's hunk (the ``-`` side of the gold patch is the
task's starting state): the first changed line of its one change block, in the file the
agent's workspace holds. Nothing is taken from the held-out tests: the test output quoted is
the stored statement's (written by :func:`coderl.tasks.statement.write_statement`, which never
quotes a held-out test), and every variant is checked with
:func:`coderl.tasks.statement.held_out_mentions` (names always; the held-out tests' source lines
when the caller passes them). A task whose stored statement is not in the format ``coderl tasks
synth`` writes, or whose variant would name a held-out test, gets no variant at that level.

Limits: the ``-`` lines quoted at L0 are the buggy code itself; an L0 statement is a location,
not a hint about the fix, but the fix of a one-token mutation is often obvious from the line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from coderl.tasks.holdout import visible_fail_to_pass
from coderl.tasks.patches import split_diff
from coderl.tasks.spec import Task
from coderl.tasks.statement import (
    STATEMENT_HEADER,
    held_out_mentions,
    quoted_outputs,
    symptom_blocks,
)

LEVELS = (0, 1, 2, 3)
"""The ladder's levels, easiest first."""
MAX_LEVEL = LEVELS[-1]
SEP = "@L"
"""Separator of a variant's id: ``<task id>@L<level>``."""
_HUNK = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")
_FIX = (
    "Fix the library code so that the failing test passes again without breaking any other test. "
    "Do not modify the tests or the test configuration."
)


@dataclass(frozen=True)
class BugSite:
    """Where a one-block gold patch changes the starting state."""

    path: str
    """Workspace-relative file."""
    line: int
    """1-based first line of the block in the starting state (for a block that only adds
    lines: the line the new lines go before)."""
    old: tuple[str, ...]
    """The block's lines in the starting state (the buggy code; empty when it only adds)."""


def change_blocks(gold_patch: str) -> list[BugSite]:
    """Every change block of ``gold_patch`` (runs of ``-``/``+`` lines inside a hunk), with
    their place in the starting state, in patch order."""
    sites: list[BugSite] = []
    for path, chunk in split_diff(gold_patch):
        line = 0
        block: list[str] | None = None
        start = 0
        for text in chunk.splitlines():
            hunk = _HUNK.match(text)
            if hunk:
                line = int(hunk.group(1))
                continue
            if not line or text.startswith(("--- ", "+++ ", "\\")):
                continue
            if text.startswith(("-", "+")):
                if block is None:
                    block, start = [], line
                if text.startswith("-"):
                    block.append(text[1:])
                    line += 1
                continue
            if block is not None:
                sites.append(BugSite(path, start, tuple(block)))
                block = None
            line += 1
        if block is not None:
            sites.append(BugSite(path, start, tuple(block)))
    return sites


def bug_site(task: Task) -> BugSite | None:
    """The place of ``task``'s one-edit fix (None: the gold patch has several change blocks or
    none)."""
    sites = change_blocks(task.gold_patch)
    return sites[0] if len(sites) == 1 else None


def level_of(task: Any) -> int | None:
    """The ladder level a task variant records (None: not a ladder variant; any object)."""
    info = (getattr(task, "extra", None) or {}).get("ladder")
    return int(info["level"]) if info else None


def shown_test(task: Task) -> str | None:
    """The failing test an L0-L2 statement names: the first visible FAIL_TO_PASS id (sorted) that
    the stored statement quotes output of, else the first visible one whose id names no held-out
    test; None when every failing test is held out."""
    held = task.held_out_tests
    visible = sorted(t for t in visible_fail_to_pass(task) if not held_out_mentions(t, held))
    quoted = quoted_outputs(task.problem_statement)
    return next((t for t in visible if t in quoted), visible[0] if visible else None)


def ladder_statement(task: Task, level: int) -> str:
    """``task``'s problem statement at ``level`` (module docstring).

    Raises:
        ValueError: ``level`` is not a ladder level; the stored statement is not in the format
            ``coderl tasks synth`` writes; L0 for a fix of more than one change block; L1 for a
            fix in several files.
    """
    if level not in LEVELS:
        raise ValueError(f"ladder level {level}: valid {list(LEVELS)}")
    if level == MAX_LEVEL:
        return task.problem_statement
    header = STATEMENT_HEADER.match(task.problem_statement)
    if header is None:
        raise ValueError(f"{task.id}: statement not written by coderl tasks synth")
    test = shown_test(task)
    parts = [
        f"A change introduced a bug into {header['repo']}: a test that used to pass now fails."
    ]
    quoted = quoted_outputs(task.problem_statement)
    if test is not None:
        parts += ["", f"Failing test: {test}"]
    if test is not None and test in quoted:
        parts += ["", f"Output of {test}:", "```", quoted[test], "```"]
    else:
        blocks = symptom_blocks(task.problem_statement)
        if blocks:
            parts += ["", "The failing tests report:"]
            for block in blocks[:1]:
                parts += ["```", block, "```"]
    if test is None:
        parts += ["", "The failing tests are held out: they run only at grading."]
    if level == 1:
        files = sorted({s.path for s in change_blocks(task.gold_patch)})
        if len(files) != 1:
            raise ValueError(f"{task.id}: L1 needs a fix in one file, the gold patch has {files}")
        parts += ["", f"The bug is in {files[0]}."]
    if level == 0:
        site = bug_site(task)
        if site is None:
            raise ValueError(f"{task.id}: L0 needs a one-edit fix (one change block)")
        span = (
            f"line {site.line}"
            if len(site.old) <= 1
            else f"lines {site.line}-{site.line + len(site.old) - 1}"
        )
        parts += [
            "",
            f"The bug is at {site.path}, {span}:",
            f'  File "{site.path}", line {site.line}',
            *(f"    {line.strip()}" for line in site.old),
            "Fixing it takes one edit there.",
        ]
    parts += ["", _FIX]
    return "\n".join(parts)


def ladder_task(task: Task, level: int, held_out_source: Iterable[str] = ()) -> Task:
    """The variant of ``task`` at ``level``: id ``<id>@L<level>``, the level's statement,
    ``extra["ladder"]``; every other field is ``task``'s.

    The held-out source is checked against the statement less the library lines L0 quotes:
    those are the workspace's own code (the agent reads them there), so a held-out test line
    that happens to read the same (``return False``) reveals nothing; names are checked
    everywhere.

    Raises:
        ValueError: see :func:`ladder_statement`; the statement would name (or quote, given
            ``held_out_source``) a held-out test.
    """
    statement = ladder_statement(task, level)
    site = bug_site(task) if level == 0 else None
    code = {f"    {line.strip()}" for line in site.old} if site is not None else set()
    prose = "\n".join(line for line in statement.splitlines() if line not in code)
    leaked = held_out_mentions(statement, task.held_out_tests) + held_out_mentions(
        prose, (), held_out_source
    )
    if leaked:
        raise ValueError(f"{task.id}@L{level}: the statement reveals held-out tests {leaked[:3]}")
    extra = {**task.extra, "ladder": {"level": level, "of": task.id}}
    return task.model_copy(
        update={"id": f"{task.id}{SEP}{level}", "problem_statement": statement, "extra": extra}
    )


def ladder_tasks(tasks: Sequence[Task], levels: Sequence[int]) -> list[Task]:
    """The variants of ``tasks`` at ``levels``, task-major (each task's levels in ``levels``
    order); a level a task cannot have (:func:`ladder_task` raises) is left out.

    Raises:
        ValueError: an unknown level.
    """
    bad = [lv for lv in levels if lv not in LEVELS]
    if bad:
        raise ValueError(f"tasks.options.ladder: unknown levels {bad}; valid {list(LEVELS)}")
    out = []
    for t in tasks:
        for lv in levels:
            try:
                out.append(ladder_task(t, lv))
            except ValueError:
                continue
    return out


def family(task: Any) -> str | None:
    """The family a task is reported in (``level L<k>`` for a ladder variant, else its
    ``source``; None without one)."""
    level = level_of(task)
    return f"level L{level}" if level is not None else getattr(task, "source", None)
