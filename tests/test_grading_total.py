"""A grade that raises is a mask (issue 47, class 6): whatever the agent's diff holds, ``grade``
returns, and only a host fault (a sandbox that cannot start, the host's I/O, a task whose own
check fails on its gold) masks. Anything else that raises while the grader handles the agent's
output is the agent's scored failure, because the training loop masks what ``grade`` raises.

Members: hunk headers whose numbers exceed Python's int conversion limit (in each of the four
places), surrogates and NUL bytes in paths, headers without their arguments, and any
exception inside the grader's handling of the diff (injected), for function and repository
tasks. Each must come back ``failure_kind == "agent"`` with no ``grading_error``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import coderl.grading.function as function_grading
import coderl.grading.grade as grading
from coderl.grading.grade import grade
from coderl.sandbox import SandboxError
from coderl.tasks.humaneval import humaneval_tasks
from coderl.tasks.patches import PatchError, split_diff
from coderl.tasks.spec import load_tasks

CI_SPEC = "six==1.17.0"
CI_TASKS = Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl"
BIG = "9" * 5000  # above Python's 4,300-digit int conversion limit

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


def _hunk(path: str, header: str) -> str:
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n{header}\n-x\n+y\n"


DIFFS = {
    "old start of 5,000 digits": lambda p: _hunk(p, f"@@ -{BIG},1 +1,1 @@"),
    "old count of 5,000 digits": lambda p: _hunk(p, f"@@ -1,{BIG} +1,1 @@"),
    "new start of 5,000 digits": lambda p: _hunk(p, f"@@ -1,1 +{BIG},1 @@"),
    "new count of 5,000 digits": lambda p: _hunk(p, f"@@ -1,1 +1,{BIG} @@"),
    "counts of 13 digits": lambda p: _hunk(p, "@@ -1,1234567890123 +1,1234567890123 @@"),
    "a NUL byte": lambda p: _hunk(p, "@@ -1,1 +1,1 @@") + "\x00\n",
    "an undecodable path": lambda p: _hunk(p + "\udc80", "@@ -1,1 +1,1 @@"),
    "a lone surrogate in a path": lambda p: _hunk(p + "\ud800", "@@ -1,1 +1,1 @@"),
    "headers without arguments": lambda p: f"diff --git a/{p} b/{p}\nrename from\nrename to\n",
    "a header with no path": lambda p: "diff --git \n--- \n+++ \n@@ -1 +1 @@\n-x\n+y\n",
}


def test_split_diff_reads_any_hunk_count() -> None:
    for make in DIFFS.values():
        split_diff(make("solution.py"))  # never raises
    [(path, _)] = split_diff(_hunk("a.py", f"@@ -1,{BIG} +1,1 @@"))
    assert path == "a.py"


@pytest.fixture(scope="module")
def fn_task():
    return {t.id: t for t in humaneval_tasks("all")}["HumanEval/0"]


def _scored(g) -> None:
    assert not g.resolved and g.grading_error is None and g.failure_kind == "agent", g


@needs_sandbox
@pytest.mark.parametrize("name", sorted(DIFFS))
def test_a_function_task_scores_any_diff(fn_task, name: str) -> None:
    _scored(grade(fn_task, DIFFS[name]("solution.py"), timeout=30))


@needs_sandbox
@pytest.mark.parametrize("error", [ValueError, RecursionError, MemoryError, KeyError, IndexError])
def test_an_exception_on_the_agents_diff_is_scored_not_masked(fn_task, monkeypatch, error) -> None:
    def boom(*args, **kwargs):
        raise error("raised while reading the agent's diff")

    monkeypatch.setattr(function_grading, "strip_protected", boom)
    g = grade(fn_task, DIFFS["a NUL byte"]("solution.py"), timeout=30)
    _scored(g)
    assert "the grader raised on the agent's output" in g.reason


@needs_sandbox
@pytest.mark.parametrize(
    "fault", [SandboxError("no sandbox"), OSError(28, "No space left on device")]
)
def test_only_a_host_fault_masks_a_function_grade(fn_task, fault) -> None:
    def factory(*args, **kwargs):
        raise fault

    g = grade(fn_task, fn_task.gold_patch, factory=factory, timeout=30)
    assert g.grading_error is not None and g.failure_kind == "infra"


def test_only_a_set_up_that_cannot_be_done_masks(fn_task, monkeypatch) -> None:
    """The grader's set-up reads nothing of the agent's: what it raises when it cannot be done
    (``SETUP_FAULTS``: the environment is not built, the bug patch does not apply, the host's
    I/O; a function task's base: OSError) masks; a bug there is raised with its own message
    instead of masking every sample as a ``setup`` grading error."""
    task = load_tasks(CI_TASKS)[0]
    monkeypatch.setattr(grading, "find_env", lambda env_id: object())
    faults = [KeyError("no built environment"), PatchError("does not apply"), OSError(28, "full")]
    for fault in faults:
        monkeypatch.setattr(grading, "rollout_base", lambda *a, fault=fault: _raise(fault))
        g = grade(task, "", timeout=1)
        assert g.grading_error.startswith("setup: ") and g.failure_kind == "infra", g
    monkeypatch.setattr(function_grading, "workspace_base", lambda *a: _raise(OSError(28, "full")))
    g = grade(fn_task, "", timeout=1)
    assert g.grading_error.startswith("setup: OSError") and g.failure_kind == "infra", g
    for module, name in ((grading, "rollout_base"), (function_grading, "workspace_base")):
        monkeypatch.setattr(
            module, name, lambda *a, name=name: _raise(TypeError(f"a bug in {name}"))
        )
        with pytest.raises(TypeError, match=f"a bug in {name}"):
            grade(task if module is grading else fn_task, "", timeout=1)


def _raise(error: Exception):
    raise error


@pytest.fixture(scope="module")
def repo_task():
    from coderl.envbuild.build import build_env

    build_env(CI_SPEC)
    return load_tasks(CI_TASKS)[0]


@needs_sandbox
@pytest.mark.parametrize("name", sorted(DIFFS))
def test_a_repository_task_scores_any_diff(repo_task, name: str) -> None:
    _scored(grade(repo_task, DIFFS[name](repo_task.extra["file"]), timeout=60))


@needs_sandbox
@pytest.mark.parametrize("error", [ValueError, RecursionError, MemoryError, UnicodeError])
def test_an_exception_in_the_repository_grader_is_scored(repo_task, monkeypatch, error) -> None:
    def boom(*args, **kwargs):
        raise error("raised while scanning the agent's tree")

    monkeypatch.setattr(grading, "scan_change", boom)
    _scored(grade(repo_task, repo_task.gold_patch, timeout=60))


@needs_sandbox
def test_the_guard_decides_before_a_sandbox_failure_masks(repo_task) -> None:
    """A test run that fails in the sandbox or the host is a mask only when the guard passed
    the diff: a denied diff is the agent's scored failure whatever the run did (red team, round
    six: the run's ``SandboxError`` was raised before the guard's findings were read)."""

    def broken(*args, **kwargs):
        raise SandboxError("the sandbox could not start")

    fixed = "+        return iter(d.values(**kw))\n"
    assert fixed in repo_task.gold_patch
    denied = repo_task.gold_patch.replace(
        fixed, "+        return iter(d.values(**kw)) if __import__('ctypes') else None\n"
    )
    g = grade(repo_task, denied, factory=broken, timeout=60)
    assert g.denied and g.failure_kind == "agent" and g.grading_error is None, g
    g = grade(repo_task, repo_task.gold_patch, factory=broken, timeout=60)
    assert g.grading_error and g.failure_kind == "infra", g
