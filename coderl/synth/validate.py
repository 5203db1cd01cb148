"""Task validation: the gold patch must resolve the task in a fresh sandbox (the SWE-bench rule).

A task is valid when grading its gold patch resolves it (every FAIL_TO_PASS and PASS_TO_PASS test
passes) and, optionally, grading the empty diff does not (the starting state really has the bug).
Invalid tasks are dropped with a reason; grading errors are reported as such, not as invalid.
"""

from __future__ import annotations

from pathlib import Path

from coderl.envbuild.exposure import ExposureError, check_readable
from coderl.grading.grade import grade, rollout_sandbox_args
from coderl.grading.runner import SandboxFactory
from coderl.tasks.env import find_env
from coderl.tasks.patches import paths_in_diff
from coderl.tasks.spec import Task


def validate_task(
    task: Task,
    *,
    factory: SandboxFactory | None = None,
    check_bug: bool = True,
    timeout: float = 300.0,
) -> str | None:
    """``None`` when valid, else the reason (prefixed ``grading error:`` for infrastructure).
    A task whose pristine source (the files its bug patch touches, its held-out test files) a
    rollout sandbox can read is invalid (``coderl.envbuild.exposure``)."""
    exposed = exposure_of(task, factory=factory)
    if exposed:
        return exposed
    gold = grade(task, task.gold_patch, factory=factory, timeout=timeout)
    if gold.grading_error:
        return f"grading error: {gold.grading_error}"
    if not gold.resolved:
        return f"gold patch does not resolve: {gold.reason}"
    if check_bug:
        before = grade(task, "", factory=factory, timeout=timeout)
        if before.grading_error:
            return f"grading error: {before.grading_error}"
        if before.resolved or before.fail_to_pass_passed > 0:
            return "the starting state already passes some FAIL_TO_PASS tests"
    return None


def exposure_of(task: Task, *, factory: SandboxFactory | None = None) -> str | None:
    """Why ``task``'s pristine source is readable in its rollout sandbox, or None."""
    if task.kind != "repo":
        return None
    base, ro_mounts = rollout_sandbox_args(task)
    files = {*paths_in_diff(task.bug_patch), *(t.split("::")[0] for t in task.held_out_tests)}
    snapshot = Path(find_env(task.env_id).snapshot)
    try:
        check_readable(base, ro_mounts, snapshot, sorted(files), factory=factory)
    except ExposureError as e:
        return str(e)
    return None


def validate_tasks(
    tasks: list[Task],
    *,
    factory: SandboxFactory | None = None,
    check_bug: bool = True,
    log: bool = False,
) -> tuple[list[Task], dict[str, str]]:
    """Split ``tasks`` into valid ones and ``{task id: reason}`` for the dropped ones."""
    valid: list[Task] = []
    dropped: dict[str, str] = {}
    for task in tasks:
        reason = validate_task(task, factory=factory, check_bug=check_bug)
        if reason is None:
            valid.append(task)
        else:
            dropped[task.id] = reason
        if log:
            print(f"{task.id}: {'valid' if reason is None else reason}", flush=True)
    return valid, dropped
