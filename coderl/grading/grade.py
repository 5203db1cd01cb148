"""Hack-resistant grading of an agent's diff against a task's tests, held-out ones included.

Every grade runs in a fresh sandbox, never the rollout's. Repo tasks:

1. the base is the task's rollout workspace (``rollout_base``: env snapshot + ``bug_patch``,
   without the held-out test functions, caches, VCS data or egg-info; ``coderl.tasks.holdout``);
2. file patches that carry no text (binary files, noted by ``Sandbox.diff``; ``GIT binary
   patch``) are dropped (``apply.drop_binary``: a test run's SQLite file must not void a fix);
   the rest of the agent's diff is applied by ``git apply`` on the host to a hard-linked copy
   of that base (``apply.apply_to_copy``); every path git changed is compared with the base and each
   protected one is put back (test files and the env's test paths, every ``conftest.py``,
   pytest/tox/setup.cfg/pyproject configuration at any depth, ``*.pth``, ``sitecustomize``/``usercustomize``,
   ``*.dist-info``/``*.egg-info``, caches, and top-level modules that would shadow the standard
   library or pytest). The decision is made on the tree git produced, so no quoting, escaping
   or header trick in the diff text can get a protected path through; modes end 0644/0755;
3. the pristine test paths and egg-info of the snapshot are mounted read-only over the tree, so
   the held-out tests are back and neither the diff nor code running at test time can change
   them; the sandbox has no read-write mount at all and no network;
4. pytest starts through ``coderl_boot`` (``-S -P -B``: no ``sitecustomize``, ``usercustomize``
   or workspace ``.pth``; ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``: no entry point from the workspace;
   the virtualenv's own plugins by explicit ``-p``; ``-c`` at the configuration file pytest
   reads in the pristine tree, or at an empty one outside the workspace, never one pytest would
   discover there: ``coderl.grading.pytestcfg``), with the FAIL_TO_PASS and PASS_TO_PASS ids,
   ``PYTHONHASHSEED=0``, no cache provider and a timeout that kills the whole sandbox;
5. the verdict is streamed, MAC-signed, on a descriptor no subprocess inherits, keyed by a secret
   that reaches pytest through a FIFO before any workspace code runs (``coderl.grading.runner``);
   the sandbox is closed before the stream is read back, lines that do not verify are skipped
   unparsed, and only a stream closed by the plugin's end record counts;
6. a test counts only if it reports an explicit pass (missing, errored, skipped or not collected
   = fail); must-fail canaries, named like the real tests and placed among them, must fail; the
   plugin's integrity checks (runner and plugin functions and their code unchanged, no hook from
   outside the virtualenv/stdlib/pristine conftests, test functions unchanged and equal to the
   bytecode of their pristine file) must be clean. Otherwise the run is ``tampered``;
7. when the first run passed any FAIL_TO_PASS test, those tests run again in a fresh sandbox
   (``coderl.grading.rerun``: new key, token and canaries, the canaries planted in the test
   files among them and never named to the worker); a FAIL_TO_PASS test passes only when it
   passed in both runs, one that passed in only one is recorded (``rerun_disagreed``), and a
   planted canary with the wrong outcome is tampering.

``resolved`` follows SWE-bench (Jimenez et al., 2024, section 2.1): every FAIL_TO_PASS and every
PASS_TO_PASS test passes. ``failure_kind`` says why there is no reward: ``infra`` (the sandbox
could not start, the environment is missing, the grader itself raised; ``grading_error`` is set
and the sample must be masked) or ``agent`` (anything the diff or the code under test caused:
unresolved, tampering, a crash, ``sys.exit`` at import, a timeout, a diff git refuses, a garbled
or forged verdict stream, file names that are not UTF-8, trees 1,000+ levels deep). Agent
failures are ordinary scored failures, so no action of the policy can earn a masked sample.

Not defended (the tests run in the same process as the code under test, which is what a
repository suite needs):
- code under test that reaches its worker's memory (``gc``, frames) can write events of its own
  or rewrite the results plugin's state, in the second run as in the first; the integrity
  checks are tripwires inside that process and can be disarmed by code that knows them (it can
  also give a forged code object a trusted ``co_filename``); what bounds this is the static
  guard (``coderl.grading.diffguard``);
- the first run's canaries are not on disk (code that compares the collected tests with the
  test files can tell them apart); the second run's are, but their bodies have one recognisable
  shape, so code that reads each test's source can still tell them apart;
- held-out tests are absent from the rollout, but the problem statement may quote a failing
  held-out test, and a task whose failing tests all sit in inherited methods (visible in the
  base class) holds none of them out; task files without ``held_out_tests`` get a choice that
  ignores this;
- the kernel is shared with the host (see ``coderl.sandbox.bwrap``), and a diff is applied by
  ``git apply`` on the host (git refuses paths outside the tree and through symlinks; binary
  patches and diffs over 16 MiB are refused);
- a test suite that does not exercise the bug.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coderl.grading.apply import HOST_ERRNOS, apply_to_copy, drop_binary
from coderl.grading.diffguard import Finding
from coderl.grading.function import encode_text, grade_function, workspace_base
from coderl.grading.guardproc import scan_change
from coderl.grading.protected import is_protected
from coderl.grading.pytestcfg import run_config
from coderl.grading.rerun import (
    Planted,
    TwinPolicy,
    confirm,
    original_ids,
    plant_canaries,
    renamed_ids,
)
from coderl.grading.runner import (
    RUN_OUTPUT_BYTES,
    SANDBOX_ENV,
    SandboxFactory,
    TestRun,
    conftests_of,
    default_factory,
    mounts,
    run_dirs,
    run_pytest,
    tampering,
)
from coderl.grading.strictcmp import repaired_methods
from coderl.grading.twincheck import TwinRecordError, twin_policy
from coderl.grading.verdict import GRADER_RAISED, GradeResult
from coderl.sandbox.base import Limits, Sandbox, SandboxError
from coderl.sandbox.workspace import remove_tree
from coderl.tasks.env import EnvRecord, find_env
from coderl.tasks.holdout import rollout_workspace
from coderl.tasks.patches import PatchError
from coderl.tasks.snapshot import cache_dir
from coderl.tasks.spec import Task

SETUP_FAULTS: tuple[type[Exception], ...] = (KeyError, PatchError, SandboxError, OSError)
"""What making a task's rollout workspace (:func:`rollout_base`) or sandbox
(:func:`rollout_sandbox`) raises when it cannot: the environment is not built (KeyError), the
bug patch does not apply (PatchError), the sandbox or the host's I/O failed. Nothing of the
agent's is involved yet: masked and counted; anything else is a bug and propagates."""


def venv_modules(env: EnvRecord) -> frozenset[str]:
    """Top-level module names installed in ``env``'s virtualenv (pytest's own dependencies and
    the project's): a workspace module of that name would shadow them once pytest puts the
    rootdir first on ``sys.path``. The project itself is uninstalled, so it is not among them."""
    site = Path(env.venv) / "lib" / "python3.11" / "site-packages"
    names: set[str] = set()
    try:
        entries = list(os.scandir(site))
    except OSError:
        return frozenset()
    for entry in entries:
        name = entry.name
        if name.endswith((".dist-info", ".egg-info", ".pth")) or name == "__pycache__":
            continue
        names.add(name.split(".")[0] if not entry.is_dir() else name)
    return frozenset(names - set(env.info.get("top_level", [])) - {""})


def _summarise(result: GradeResult, task: Task, outcomes: dict[str, str]) -> GradeResult:
    expected = list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
    result.tests = {t: outcomes.get(t, "missing") for t in expected}
    n_pass = sum(o == "passed" for o in result.tests.values())
    f2p = sum(result.tests[t] == "passed" for t in task.FAIL_TO_PASS)
    result.fail_to_pass_passed = 0.0 if result.tampered else f2p / len(task.FAIL_TO_PASS)
    result.fraction_passed = 0.0 if result.tampered else n_pass / len(expected)
    kept = all(result.tests[t] == "passed" for t in task.PASS_TO_PASS)
    result.partial_credit = result.fail_to_pass_passed if kept else 0.0
    result.resolved = not result.tampered and n_pass == len(expected)
    if not result.resolved and not result.reason:
        bad = [t for t, o in result.tests.items() if o != "passed"]
        result.reason = (
            f"{len(bad)} of {len(expected)} tests did not pass, e.g. {bad[0]} ({result.tests[bad[0]]})"
            if bad
            else "tampering detected"
        )
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
        return workspace_base(task), {}
    env = find_env(task.env_id)
    return rollout_base(task, env), {"/venv": env.venv}


ROLLOUT_ENV = {k: SANDBOX_ENV[k] for k in ("PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE")}
"""Variables of the graded run that the code under test can observe without a denied facility
(``hash('a')`` shows the hash seed, missing ``__pycache__`` directories the bytecode flag), set
in the agent's sandbox too so a graded run hashes and caches as the agent's own runs do."""


def rollout_sandbox(task: Task, factory: SandboxFactory | None = None) -> Sandbox:
    """A fresh rollout sandbox of ``task`` (the caller closes it): :func:`rollout_sandbox_args`
    through ``factory`` (default ``coderl.sandbox.Sandbox.create``), with ``ROLLOUT_ENV``.
    Raises KeyError when the environment is not built, ``SandboxError`` when the sandbox cannot
    start."""
    base, ro_mounts = rollout_sandbox_args(task)  # held-out tests, caches and egg-info left out
    return (factory or default_factory())(base, ro_mounts=ro_mounts, env=dict(ROLLOUT_ENV))


def grade(
    task: Task,
    agent_diff: str,
    *,
    env: EnvRecord | None = None,
    factory: SandboxFactory | None = None,
    timeout: float = 300.0,
    guard: bool = True,
    twins: TwinPolicy | None = None,
) -> GradeResult:
    """Grade ``agent_diff`` (a unified diff against the task's rollout workspace).

    ``guard=False`` skips the reward-denying detector (``coderl.grading.diffguard``) so that tests
    can exercise the layers under it; training and evaluation never pass it. ``twins``: how the
    second run plants mutated twins; default: as the twin check recorded for the task
    (``coderl.grading.twincheck.twin_policy``; a stale or malformed record is a setup error).

    Never raises for anything the agent did: that is a scored failure (``failure_kind="agent"``);
    infrastructure failures set ``grading_error`` (``failure_kind="infra"``).
    ``function`` tasks are delegated to :func:`coderl.grading.function.grade_function`.
    """
    if task.kind == "function":
        return _attribute(grade_function(task, agent_diff, factory=factory, timeout=timeout))
    start = time.monotonic()
    result = GradeResult(task_id=task.id)
    try:
        env = env or find_env(task.env_id)
        factory = factory or default_factory()
        base = rollout_base(task, env)
        twins = twins or twin_policy(task)
    except (*SETUP_FAULTS, TwinRecordError) as e:  # the grader could not set up: mask, never score
        result.grading_error = f"setup: {type(e).__name__}: {e}"
        return _attribute(result)
    # a lone surrogate (text no codec writes) gets the bytes the function path gives it: git
    # then refuses or applies them, the agent's outcome either way, never an encoding error
    agent_diff = encode_text(agent_diff).decode("utf-8", "surrogateescape")
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".grade-"))
    try:
        tree = tmp / "tree"
        tree.mkdir()
        _grade_tree(task, env, base, agent_diff, tree, factory, timeout, result, guard, twins)
    except (SandboxError, OSError) as e:  # the sandbox or the host's own I/O: mask
        result.grading_error = f"sandbox: {type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - raised on what the agent produced: scored, counted
        result.reason = f"{GRADER_RAISED}: {type(e).__name__}: {e}"[:400]
        _summarise(result, task, {})
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


def protection(task: Task, env: EnvRecord) -> Callable[[str], bool]:
    """Whether the agent may not change a workspace-relative path of ``task``
    (``coderl.grading.protected.is_protected`` with the task's and the environment's test paths,
    source roots and virtualenv modules): what ``apply_to_copy`` strips from its diff."""
    roots = (".",) if env.info.get("source_root", ".") == "." else (".", env.info["source_root"])
    extra = [*task.protected_paths, *env.test_paths, *(f"{p}/**" for p in env.test_paths)]
    shadow = venv_modules(env)
    return lambda p: is_protected(p, extra, roots, shadow)


def pristine_mounts(env: EnvRecord) -> dict[str, str]:
    """Read-only mounts (sandbox path -> host path) that put the environment's pristine test
    files and egg-info back over a graded tree."""
    snapshot = Path(env.snapshot)
    return {
        f"/testbed/{rel}": str(snapshot / rel) for rel in [*env.test_paths, *_egg_info(snapshot)]
    }


def _grade_tree(
    task: Task,
    env: EnvRecord,
    base: Path,
    agent_diff: str,
    tree: Path,
    factory: SandboxFactory,
    timeout: float,
    result: GradeResult,
    guard: bool = True,
    twins: TwinPolicy | None = None,
) -> None:
    agent_diff, dropped = drop_binary(agent_diff)  # binary byproducts: not applied, not graded
    result.dropped_paths = [_shown(p) for p in dropped]
    try:
        changed, stripped = apply_to_copy(base, agent_diff, protection(task, env), tree)
    except PatchError as e:
        result.reason = f"the diff does not apply: {str(e)[-300:]}"
        _summarise(result, task, {})
        return
    except OSError as e:
        if e.errno in HOST_ERRNOS:
            raise
        result.reason = f"the workspace cannot be read back: {type(e).__name__}: {e}"[:400]
        _summarise(result, task, {})
        return
    result.stripped_paths = [_shown(p) for p in stripped]
    ro = pristine_mounts(env)
    select = list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
    snapshot = Path(env.snapshot)
    with ThreadPoolExecutor(1) as pool:
        # the guard scans private copies of the changed files, taken before any of the tree
        # runs, beside the first test run (its child process and the run use both cores)
        copy, unread = _private_copy(tree, changed) if guard else (tree, [])
        scan = pool.submit(scan_change, base, copy, changed, snapshot) if guard else None
        failed: SandboxError | OSError | None = None
        try:
            run = _run(tree, env, factory, timeout, ro, select, env.canaries_ok)
        except (SandboxError, OSError) as e:
            failed = e  # a mask, unless the guard denies the diff (below)
        found = unread + (scan.result() if scan is not None else [])
    result.denied = [_shown(str(f)) for f in found]
    if failed is not None and not result.denied:
        raise failed  # the sandbox or the host failed on a diff the guard passed: a mask
    if result.denied:  # whatever the run said, the verdict is the guard's
        result.reason = (
            f"reward denied: the diff reaches into process internals: {result.denied[0]}"
        )
        _summarise(result, task, {})
        return
    run.tampered = sorted(set(run.tampered) - set(env.baseline_tampered))
    why = tampering(run, canaries=env.canaries_ok)
    if why:
        result.tampered = True
        result.reason = f"tampering detected: {why}"
    elif run.results_missing:
        result.reason = _no_verdict(run)
    elif not run.outcomes:
        result.reason = "no test ran (collection error, or an exit during collection)"
    outcomes = {} if run.results_missing else dict(run.outcomes)
    if not why and any(outcomes.get(t) == "passed" for t in task.FAIL_TO_PASS):
        _second_run(task, env, tree, factory, timeout, ro, outcomes, result, twins)
    _summarise(result, task, outcomes)


def _private_copy(tree: Path, changed: list[str]) -> tuple[Path, list[Finding]]:
    """Copies of the ``changed`` files of ``tree`` (links as links), for the guard to scan while
    the tree runs, and an ``unscannable`` finding for each file that cannot be copied (a path
    too long for the host once under the copy's folder, a name the host cannot create): the
    agent's failure, as the guard's own unreadable files are, never a mask. Taken before the
    tree runs, so code that rewrites its own files while it runs cannot change what the guard
    reads (the sandbox writes to its own overlay anyway; this does not depend on that). Under
    ``tree``'s parent, removed with it.

    Raises:
        OSError: the host's disk or memory is full (``ENOSPC``, ``EDQUOT``, ``ENOMEM``): a mask.
    """
    copy = Path(tempfile.mkdtemp(dir=tree.parent, prefix="scan-"))
    unread: list[Finding] = []
    for rel in changed:
        src, dst = tree / rel, copy / rel
        try:
            if not (src.is_symlink() or src.is_file()):
                continue  # deleted
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_symlink():
                os.symlink(os.readlink(src), dst)
            else:
                shutil.copyfile(src, dst)
        except OSError as e:
            if e.errno in HOST_ERRNOS:
                raise
            unread.append(Finding(rel, 0, "unscannable", f"{type(e).__name__}: {e}"[:80]))
    return copy, unread


def _run(
    tree: Path,
    env: EnvRecord,
    factory: SandboxFactory,
    timeout: float,
    ro: dict[str, str],
    select: list[str],
    canaries: bool,
    outcomes_only: bool = False,
) -> TestRun:
    """One graded pytest run of ``select`` over ``tree`` in a fresh sandbox (``ro``: the
    read-only test mounts), closed before its verdict is used."""
    ro = dict(ro)
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
            return run_pytest(
                sb,
                inp,
                paths=env.test_paths,
                select=select,
                canaries=canaries,
                timeout=timeout,
                inifile=run_config(
                    Path(env.snapshot), env.info.get("pytest_config"), env.test_paths
                ),
                allowed_conftests=conftests_of(tree),
                outcomes_only=outcomes_only,
            )
        finally:
            sb.close()  # every process of the sandbox is gone before the verdict is used


def _no_verdict(run: TestRun) -> str:
    if run.exec is not None and run.exec.timed_out:
        return "test run timed out"
    return f"no valid verdict (crash, exit or a garbled stream: {run.garbled[:200]})"


def _second_run(
    task: Task,
    env: EnvRecord,
    tree: Path,
    factory: SandboxFactory,
    timeout: float,
    ro: dict[str, str],
    outcomes: dict[str, str],
    result: GradeResult,
    twins: TwinPolicy | None = None,
) -> None:
    """Run the FAIL_TO_PASS tests again in a fresh sandbox with planted canaries
    (``coderl.grading.rerun``) and keep a pass only where both runs passed: updates
    ``outcomes`` and ``result`` (``second_run``, ``rerun_disagreed``, tampering, reason)."""
    f2p = list(dict.fromkeys(task.FAIL_TO_PASS))
    covered = [p.rstrip("/") for p in env.test_paths]
    sources = {}
    for rel in {t.split("::")[0] for t in f2p}:
        pristine = any(rel == p or rel.startswith(p + "/") or p == "." for p in covered)
        sources[rel] = (Path(env.snapshot) if pristine else tree) / rel
    rng = random.Random(secrets.randbits(64))  # drawn now, after the first run has ended
    with tempfile.TemporaryDirectory(dir=tree.parent, prefix="planted-") as tmp:
        os.chmod(tmp, 0o755)
        roots = [Path(env.snapshot) / t for t in env.test_paths]
        suite = tuple(  # the rest of the suite: a renamed test may be called from there
            p for r in roots for p in ([r] if r.is_file() else r.rglob("*.py"))
        )
        fixed = repaired_methods(Path(env.snapshot), rollout_base(task, env), task.bug_patch)
        planted = (
            plant_canaries(
                sources, f2p, rng, Path(tmp), suite, frozenset(task.held_out_tests), twins, fixed
            )
            if env.canaries_ok
            else Planted()
        )
        select = (
            renamed_ids(f2p, planted.renamed) + sorted(planted.expected) + sorted(planted.twins)
        )
        rng.shuffle(select)
        second = _run(
            tree,
            env,
            factory,
            timeout,
            {**ro, **planted.mounts},
            select,
            env.canaries_ok and not planted.expected,
            outcomes_only=True,  # it can only take passes away: the first run had every tripwire
        )
    second.outcomes = original_ids(second.outcomes, planted.renamed)
    merged = confirm(f2p, outcomes, second, planted.expected, env.baseline_tampered, planted.twins)
    result.second_run = True
    result.twinless = planted.twinless if planted.mounts else f2p
    result.twins_not_failed = merged.twins_not_failed
    result.rerun_disagreed = merged.disagreed
    outcomes.update(merged.outcomes)
    if merged.tampered:
        result.tampered = True
        result.reason = f"tampering detected: {merged.tampered}"
    elif second.results_missing and not result.reason:
        result.reason = f"second run: {_no_verdict(second)}"
    elif merged.disagreed and not result.reason:
        result.reason = f"the two runs disagree: {merged.disagreed[0]}"[:400]


def _egg_info(snapshot: Path) -> list[str]:
    """``*.egg-info`` directories at the top of ``snapshot`` or of a ``src`` layout: left out of
    rollout workspaces, mounted back read-only at grading (package metadata tests may read)."""
    found = [p for p in snapshot.glob("*.egg-info") if p.is_dir()]
    found += [p for p in snapshot.glob("src/*.egg-info") if p.is_dir()]
    return sorted(p.relative_to(snapshot).as_posix() for p in found)
