"""Hack-resistant grading of an agent's diff against a task's hidden tests.

Every grade runs in a fresh sandbox, never the rollout's. Repo tasks:

1. the base is the task's starting state (env snapshot + ``bug_patch``), read-only below a
   copy-on-write workspace at ``/testbed``;
2. the agent's diff is applied after protected paths are removed from it (test files, every
   ``conftest.py``, pytest/tox/setup.cfg/pyproject configuration, ``*.pth``,
   ``sitecustomize``/``usercustomize``, caches, and top-level modules that would shadow the
   standard library or pytest);
3. the pristine test files of the snapshot are mounted read-only over the workspace's test paths,
   so neither the diff nor code running at test time can change them;
4. the FAIL_TO_PASS and PASS_TO_PASS ids run under pytest with ``PYTHONHASHSEED=0``, no cache
   provider, no network and a timeout; results go to a mount outside the workspace;
5. a test counts only if it reports an explicit pass (missing, errored, skipped or not collected
   = fail), and must-fail canary tests must fail (else the run was tampered with).

``resolved`` follows SWE-bench (Jimenez et al., 2024, section 2.1): every FAIL_TO_PASS and every
PASS_TO_PASS test passes. Infrastructure failures (the sandbox could not start, the grader itself
raised) set ``grading_error``: the sample must be masked, never scored 0. Failures caused by the
agent's code (crash, ``sys.exit`` at import, timeout, a diff that does not apply) are ordinary
failures, so crashing the grader can never earn a masked sample.

Not protected against: code under test that reads the per-run nonce out of the pytest process and
forges the results file, or that recognises and special-cases the canary tests; a test suite that
does not exercise the bug. The canaries and the tripwire in the results plugin make the former
hard, not impossible.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from coderl.sandbox.base import Limits
from coderl.tasks.envbuild import EnvRecord, find_env
from coderl.tasks.holdout import rollout_workspace
from coderl.tasks.patches import PatchError, apply_to_copy, remove_tree, split_diff
from coderl.tasks.runner import (
    RUN_OUTPUT_BYTES,
    SANDBOX_ENV,
    SandboxFactory,
    conftests_of,
    default_factory,
    mounts,
    run_dirs,
    run_pytest,
    tampering,
)
from coderl.tasks.snapshot import cache_dir
from coderl.tasks.spec import Task

PROTECTED_PATTERNS: tuple[str, ...] = (
    "**/test_*.py",
    "**/*_test.py",
    "**/tests/**",
    "**/test/**",
    "**/testing/**",
    "**/conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
    "noxfile.py",
    "**/*.pth",
    "**/sitecustomize.py",
    "**/usercustomize.py",
    "**/__pycache__/**",
    "**/*.pyc",
    "**/.pytest_cache/**",
    ".hypothesis/**",
    "**/*.dist-info",
    "**/*.dist-info/**",
    "**/*.egg-info",
    "**/*.egg-info/**",
    "**/*.egg-link",
    "**/.git/**",
)
SHADOW_NAMES = frozenset(sys.stdlib_module_names) | {
    "pytest",
    "_pytest",
    "pluggy",
    "py",
    "coderl_results",
    "coderl_boot",
}


@dataclass
class GradeResult:
    """The grader's verdict. The reward code reads ``resolved``, ``fraction_passed``,
    ``grading_error`` and ``tests``."""

    task_id: str
    resolved: bool = False
    """SWE-bench rule: every FAIL_TO_PASS and PASS_TO_PASS test passed (and no tampering)."""
    tests: dict[str, str] = field(default_factory=dict)
    """Expected test id -> outcome (``passed``, ``failed``, ``error``, ``skipped``, ``missing``...)."""
    fraction_passed: float = 0.0
    """Passed / expected tests, in [0, 1]; 0.0 whenever ``tampered``."""
    fail_to_pass_passed: float = 0.0
    """Fraction of the FAIL_TO_PASS tests that passed; 0.0 whenever ``tampered``."""
    grading_error: str | None = None
    """Set only for infrastructure failures (the grader itself failed): mask, do not score."""
    failure_kind: Literal["infra", "agent"] | None = None
    """Why there is no reward: ``infra`` (sandbox could not start, environment missing, grader
    bug; ``grading_error`` says which; the sample is masked) or ``agent`` (anything the graded
    code or diff caused: unresolved, tampering, crash, timeout, garbage; scored as a failure).
    ``None`` when resolved."""
    reason: str = ""
    """Why the task is not resolved (first cause), empty when resolved."""
    tampered: bool = False
    """Canaries misbehaved or pytest/unittest internals were replaced."""
    stripped_paths: list[str] = field(default_factory=list)
    """Protected paths removed from the agent's diff."""
    duration_s: float = 0.0
    """Wall time of the grade (seconds)."""


def is_protected(
    path: str, extra: tuple[str, ...] | list[str] = (), source_roots: tuple[str, ...] = (".",)
) -> bool:
    """Whether a workspace-relative path may not be changed by the agent."""
    path = path.lstrip("/")
    for pattern in (*PROTECTED_PATTERNS, *extra):
        if fnmatch.fnmatch(path, pattern):
            return True
        if pattern.startswith("**/") and fnmatch.fnmatch(path, pattern[3:]):
            return True
    for root in source_roots:
        rel = (
            path
            if root == "."
            else (path[len(root) + 1 :] if path.startswith(root + "/") else None)
        )
        if rel is not None:
            top = rel.split("/")[0]
            name = top[:-3] if top.endswith(".py") and "/" not in rel else top
            if name in SHADOW_NAMES:
                return True
    return False


def strip_protected(
    diff: str, extra: tuple[str, ...] | list[str] = (), source_roots: tuple[str, ...] = (".",)
) -> tuple[str, list[str]]:
    """Remove every per-file chunk that touches a protected path; returns ``(diff, removed)``.

    A text parse of the diff: used only for function tasks, whose sandbox holds nothing but the
    solution file. Repository tasks decide on the tree git produced (``patches.apply_to_copy``).
    """
    kept, removed = [], []
    for path, chunk in split_diff(diff):
        touched = [path] + [
            ln.split(" ", 2)[2].strip()
            for ln in chunk.splitlines()
            if ln.startswith(("rename from ", "copy from "))
        ]
        if not path or any(is_protected(p, extra, source_roots) for p in touched):
            removed.append(path or "<unparsed chunk>")
        else:
            kept.append(chunk)
    return "".join(kept), removed


def _summarise(result: GradeResult, task: Task, outcomes: dict[str, str]) -> GradeResult:
    expected = list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
    result.tests = {t: outcomes.get(t, "missing") for t in expected}
    n_pass = sum(o == "passed" for o in result.tests.values())
    f2p = sum(result.tests[t] == "passed" for t in task.FAIL_TO_PASS)
    result.fail_to_pass_passed = 0.0 if result.tampered else f2p / len(task.FAIL_TO_PASS)
    result.fraction_passed = 0.0 if result.tampered else n_pass / len(expected)
    result.resolved = not result.tampered and n_pass == len(expected)
    if not result.resolved and not result.reason:
        bad = [t for t, o in result.tests.items() if o != "passed"]
        result.reason = f"{len(bad)} of {len(expected)} tests did not pass, e.g. {bad[0]} ({result.tests[bad[0]]})"
    return result


def rollout_base(task: Task, env: EnvRecord | None = None) -> Path:
    """The read-only base of ``task``'s rollout workspace: its starting state without the
    held-out test functions and without caches, VCS data or egg-info (``coderl.tasks.holdout``).
    Cached under ``<cache>/bases``. Raises KeyError (environment not built) or PatchError."""
    env = env or find_env(task.env_id)
    return rollout_workspace(Path(env.snapshot), task.bug_patch, task.held_out_tests)


def rollout_sandbox_args(task: Task) -> tuple[Path, dict[str, str]]:
    """``(base, ro_mounts)`` for the rollout sandbox of ``task``:
    ``Sandbox.create(base, ro_mounts=ro_mounts)`` gives the agent the task's rollout workspace
    (:func:`rollout_base`) at ``/testbed`` with the environment's virtualenv at ``/venv`` (repo
    tasks; run the tests with ``/venv/bin/python -m pytest``). Raises KeyError when the
    environment is not built.
    """
    if task.kind == "function":
        from coderl.tasks.humaneval import workspace_base

        return workspace_base(task), {}
    env = find_env(task.env_id)
    return rollout_base(task, env), {"/venv": env.venv}


def grade(
    task: Task,
    agent_diff: str,
    *,
    env: EnvRecord | None = None,
    factory: SandboxFactory | None = None,
    timeout: float = 300.0,
) -> GradeResult:
    """Grade ``agent_diff`` (a unified diff against the task's rollout workspace).

    Never raises for anything the agent did: that is a scored failure (``failure_kind="agent"``);
    infrastructure failures set ``grading_error`` (``failure_kind="infra"``).
    ``function`` tasks are delegated to :func:`coderl.tasks.humaneval.grade_function`.
    """
    if task.kind == "function":
        from coderl.tasks.humaneval import grade_function

        return _attribute(grade_function(task, agent_diff, factory=factory, timeout=timeout))
    start = time.monotonic()
    result = GradeResult(task_id=task.id)
    try:
        env = env or find_env(task.env_id)
        factory = factory or default_factory()
        base = rollout_base(task, env)
    except Exception as e:  # the grader could not set up: mask, never score
        result.grading_error = f"setup: {type(e).__name__}: {e}"
        return _attribute(result)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".grade-"))
    try:
        tree = tmp / "tree"
        tree.mkdir()
        _grade_tree(task, env, base, agent_diff, tree, factory, timeout, result)
    except Exception as e:  # sandbox failure or grader bug: infrastructure, not the agent
        result.grading_error = f"sandbox: {type(e).__name__}: {e}"
    finally:
        remove_tree(tmp)  # iterative: the agent's tree may be 1,000+ levels deep
    result.duration_s = time.monotonic() - start
    return _attribute(result)


def _attribute(result: GradeResult) -> GradeResult:
    if result.grading_error is not None:
        result.failure_kind = "infra"
    elif not result.resolved:
        result.failure_kind = "agent"
    return result


def _shown(path: str) -> str:
    """A path as text that always encodes (non-UTF-8 bytes as ``\\xNN``)."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _grade_tree(
    task: Task,
    env: EnvRecord,
    base: Path,
    agent_diff: str,
    tree: Path,
    factory: SandboxFactory,
    timeout: float,
    result: GradeResult,
) -> None:
    roots = (".",) if env.info.get("source_root", ".") == "." else (".", env.info["source_root"])
    extra = [*task.protected_paths, *env.test_paths, *(f"{p}/**" for p in env.test_paths)]
    try:
        _, stripped = apply_to_copy(base, agent_diff, lambda p: is_protected(p, extra, roots), tree)
    except PatchError as e:
        result.reason = f"the diff does not apply: {str(e)[-300:]}"
        _summarise(result, task, {})
        return
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
            raise
        result.reason = f"the workspace cannot be read back: {type(e).__name__}: {e}"[:400]
        _summarise(result, task, {})
        return
    result.stripped_paths = [_shown(p) for p in stripped]
    snapshot = Path(env.snapshot)
    ro = {}
    for rel in [*env.test_paths, *_egg_info(snapshot)]:  # pristine, read-only over the tree
        ro[f"/testbed/{rel}"] = str(snapshot / rel)
    with run_dirs() as inp:
        ro.update(mounts(inp, Path(env.venv)))
        limits = Limits(
            timeout_s=timeout,
            cpu_s=int(timeout) + 30,
            memory_bytes=4 * 1024**3,
            output_bytes=RUN_OUTPUT_BYTES,
        )
        sb = factory(
            tree, limits=limits, env=SANDBOX_ENV, ro_mounts=ro, rw_mounts={}, network=False
        )
        try:
            run = run_pytest(
                sb,
                inp,
                paths=env.test_paths,
                select=list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS)),
                canaries=env.canaries_ok,
                timeout=timeout,
                inifile=env.info.get("pytest_config"),
                allowed_conftests=conftests_of(tree),
            )
        finally:
            sb.close()  # every process of the sandbox is gone before the verdict is used
    run.tampered = sorted(set(run.tampered) - set(env.baseline_tampered))
    why = tampering(run, canaries=env.canaries_ok)
    if why:
        result.tampered = True
        result.reason = f"tampering detected: {why}"
    elif run.results_missing:
        timed_out = run.exec is not None and run.exec.timed_out
        result.reason = (
            "test run timed out"
            if timed_out
            else "pytest streamed no complete verdict (crash, exit or a garbled stream)"
        )
    elif not run.outcomes:
        result.reason = "no test ran (collection error, or an exit during collection)"
    _summarise(result, task, {} if run.results_missing else run.outcomes)


def _egg_info(snapshot: Path) -> list[str]:
    """``*.egg-info`` directories at the top of ``snapshot`` or of a ``src`` layout: left out of
    rollout workspaces, mounted back read-only at grading (package metadata tests may read)."""
    found = [p for p in snapshot.glob("*.egg-info") if p.is_dir()]
    found += [p for p in snapshot.glob("src/*.egg-info") if p.is_dir()]
    return sorted(p.relative_to(snapshot).as_posix() for p in found)
