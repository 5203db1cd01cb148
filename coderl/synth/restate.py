"""Rewrite stored problem statements so they no longer name or quote held-out tests.

Task files written before ``held_out_tests`` existed (every shipped file up to 2026-12-01) list
every FAIL_TO_PASS test and quote the output of the first three, held out or not. This rewrites
each statement from what the stored statement itself holds (the quoted outputs, ``Output of
<id>:`` blocks) and the held-out tests' source in the environment's snapshot, through
``coderl.synth.repo.statement_for``, the same function ``coderl tasks synth`` uses; no test is
rerun. Every other field stays byte-identical.

    CODERL_CACHE=... python -m coderl.synth.restate data/tasks/*.jsonl.gz

Needs the tasks' environments built (``coderl tasks build-env --from data/repos.txt``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from coderl.synth.repo import statement_for
from coderl.tasks.env import find_env
from coderl.tasks.spec import Task, dump_tasks, load_tasks
from coderl.tasks.statement import STATEMENT_HEADER, quoted_outputs


def restate(task: Task, snapshot: Path) -> str:
    """``task``'s problem statement rewritten from its stored one (see the module docstring).
    Raises ValueError when the stored statement is not in the format ``synth`` writes."""
    header = STATEMENT_HEADER.match(task.problem_statement)
    if header is None:
        raise ValueError(f"{task.id}: statement not written by coderl tasks synth")
    return statement_for(
        header["repo"],
        task.FAIL_TO_PASS,
        task.held_out_tests,
        quoted_outputs(task.problem_statement),
        snapshot,
    )


def main(paths: list[str]) -> int:
    for path in paths:
        tasks = load_tasks(path)
        out = []
        for task in tasks:
            snapshot = Path(find_env(task.env_id).snapshot)
            out.append(task.model_copy(update={"problem_statement": restate(task, snapshot)}))
        changed = sum(
            a.problem_statement != b.problem_statement for a, b in zip(tasks, out, strict=True)
        )
        dump_tasks(out, path)
        print(f"{path}: {changed} of {len(tasks)} statements rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
