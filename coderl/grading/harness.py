"""SWE-bench's own grading beside coderl's: instance images, the harness's test log, its report.

The official harness (the ``swebench`` package, 5.x) grades an instance by running its eval
script in a fresh container of the instance's image with the prediction applied, then reading the
test log between ``>>>>> Start Test Output`` and ``>>>>> End Test Output`` with the repository's
log parser (``swebench.harness.log_parsers.PARSER_REGISTRY``) and deciding FAIL_TO_PASS /
PASS_TO_PASS with ``swebench.harness.grading.get_eval_report``. This module does the same with
the package's own functions (nothing of them is rewritten here):

- :func:`instance_image`: the image an instance names (``image``, SWE-smith's ``image_name``,
  R2E-Gym's ``docker_image``) or the SWE-bench naming scheme
  (``swebench/sweb.eval.x86_64.<instance id, "__" -> "_1776_">:latest``);
- :func:`harness_report`: for a coderl repository task, the agent's diff applied exactly as
  :func:`coderl.grading.grade.grade` applies it (protected paths stripped by ``apply_to_copy``,
  the pristine test files and the environment's ``/venv`` mounted read-only), the task's
  FAIL_TO_PASS + PASS_TO_PASS run with ``pytest -rA`` in a fresh sandbox (a container when the
  run's backend is ``container``), the log parsed by ``parse_log_pytest``, the report made by
  ``get_eval_report``;
- :func:`cross_check`: coderl's out-of-process verdict (:func:`coderl.grading.grade.grade`)
  decides; the harness's report is computed beside it and a disagreement is reported, never
  used as the reward;
- :func:`write_run`: a predictions file and the per-instance ``report.json`` files in the
  harness's log layout, summarised by ``swebench.harness.reporting.make_run_report``.

What the harness's parse can be fooled by (why it only cross-checks here): the graded code runs
in the pytest process that writes the log, so it can print ``PASSED <test id>`` lines of its own
or rewrite pytest's summary; swebench counters a non-zero exit status with no failure (its
``TEST_EXIT_CODE`` check) but not a forged pass with exit status 0. coderl's verdict is signed by
an observer outside the graded process (``coderl.grading.runner``), and the diff guard denies
reward for diffs that reach into process internals (``coderl.grading.diffguard``, run by
``coderl.grading.guardproc``).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

from coderl.grading.apply import HOST_ERRNOS, apply_to_copy, drop_binary
from coderl.grading.grade import grade, pristine_mounts, protection, rollout_base
from coderl.grading.runner import SANDBOX_ENV, SandboxFactory, default_factory
from coderl.grading.verdict import GradeResult
from coderl.sandbox.base import Limits
from coderl.sandbox.workspace import remove_tree
from coderl.tasks.env import EnvRecord, find_env
from coderl.tasks.patches import PatchError
from coderl.tasks.snapshot import cache_dir
from coderl.tasks.spec import Task
from coderl.tasks.swebench import IMAGE_PREFIX, instance_image, task_instance

__all__ = ["instance_image"]  # defined in coderl.tasks.swebench, read here by callers


def eval_script(task: Task, env: EnvRecord) -> list[str]:
    """The harness eval script's lines (no shebang) for ``task``: its FAIL_TO_PASS and
    PASS_TO_PASS tests with ``pytest -rA`` between the harness's markers, the exit status
    recorded by ``swebench.harness.utils.record_test_exit_code``."""
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
    from swebench.harness.utils import record_test_exit_code

    ids = " ".join(shlex.quote(i) for i in dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
    ini = env.info.get("pytest_config")
    config = f" -c {shlex.quote(ini)}" if ini else ""
    test = f"/venv/bin/python -m pytest -rA -p no:cacheprovider{config} -- {ids}"
    lines = ["cd /testbed", f"echo '{START_TEST_OUTPUT}'", test, f"echo '{END_TEST_OUTPUT}'"]
    return record_test_exit_code(lines)


def test_spec(task: Task, env: EnvRecord, image: str) -> Any:
    """The ``swebench.types.TestSpec`` of ``task``: pytest's log parser, pass-and-fail grading."""
    from swebench.types import TestSpec

    return TestSpec(
        instance_id=task.id,
        image=image,
        eval_script_list=eval_script(task, env),
        repo=env.name,
        version=env.version,
        FAIL_TO_PASS=list(task.FAIL_TO_PASS),
        PASS_TO_PASS=list(task.PASS_TO_PASS),
        log_parser="parse_log_pytest",
        eval_type="pass_and_fail",
    )


def harness_report(
    task: Task,
    agent_diff: str,
    *,
    image: str = "",
    env: EnvRecord | None = None,
    factory: SandboxFactory | None = None,
    timeout: float = 300.0,
    log_path: Path | None = None,
    model: str = "coderl",
) -> dict[str, Any]:
    """The harness's report entry for ``agent_diff`` on repository task ``task``: the dict
    ``get_eval_report`` returns for the instance (``patch_exists``,
    ``patch_successfully_applied``, ``resolved``, ``tests_status``, ...).

    image: recorded in the TestSpec (the sandbox's image comes from the factory/backend).
    log_path: where the test log is written (default: a temporary file, removed).
    Raises KeyError (environment not built), SandboxError (the sandbox failed).
    """
    from swebench.harness.grading import get_eval_report

    env = env or find_env(task.env_id)
    spec = test_spec(task, env, image)
    prediction = {"instance_id": task.id, "model_name_or_path": model, "model_patch": agent_diff}
    tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".harness-"))
    try:
        log = _run_eval(task, env, agent_diff, spec, tmp, factory or default_factory(), timeout)
        path = log_path or tmp / "test_output.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(log)
        return get_eval_report(spec, prediction, str(path), include_tests_status=True)[task.id]
    finally:
        remove_tree(tmp)


def _run_eval(
    task: Task,
    env: EnvRecord,
    diff: str,
    spec: Any,
    tmp: Path,
    factory: SandboxFactory,
    timeout: float,
) -> str:
    """The eval log: the diff applied as ``grade`` applies it, the eval script run in a fresh
    sandbox; a diff that does not apply writes the harness's own failure marker."""
    from swebench.harness.constants import APPLY_PATCH_FAIL

    tree = tmp / "tree"
    tree.mkdir()
    diff, _ = drop_binary(diff)  # as grade: binary byproducts are not applied
    try:
        apply_to_copy(rollout_base(task, env), diff, protection(task, env), tree)
    except PatchError as e:
        return f"{APPLY_PATCH_FAIL}: {str(e)[-300:]}\n"
    ro = pristine_mounts(env)
    limits = Limits(timeout_s=timeout, cpu_s=int(timeout) + 30, memory_bytes=4 * 1024**3)
    ro["/venv"] = env.venv
    # the repository's own pytest plugins load, as under the harness (coderl's runner loads
    # what it needs itself and turns autoloading off)
    env_vars = {k: v for k, v in SANDBOX_ENV.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    sb = factory(tree, limits=limits, env=env_vars, ro_mounts=ro, rw_mounts={}, network=False)
    try:
        res = sb.exec("\n".join(["exec 2>&1", *spec.eval_script_list]), timeout=timeout)
    finally:
        sb.close()
    return res.stdout + res.stderr


def cross_check(
    task: Task,
    agent_diff: str,
    *,
    factory: SandboxFactory | None = None,
    timeout: float = 300.0,
    image: str = "",
    log_path: Path | None = None,
) -> tuple[GradeResult, dict[str, Any]]:
    """coderl's verdict (which decides) and the harness's report beside it, with
    ``report["coderl"] = {"resolved", "harness_resolved", "agree"}`` added and ``report["resolved"]``
    set to coderl's verdict. A grade coderl masks (``grading_error``) is reported as not
    resolved, with ``agree`` None."""
    result = grade(task, agent_diff, factory=factory, timeout=timeout)
    report = harness_report(
        task, agent_diff, image=image, factory=factory, timeout=timeout, log_path=log_path
    )
    harness = bool(report["resolved"])
    agree = None if result.grading_error is not None else harness == result.resolved
    report["coderl"] = {"resolved": result.resolved, "harness_resolved": harness, "agree": agree}
    report["resolved"] = result.resolved
    return result, report


def instance_sandbox(instance: dict[str, Any], *, limits: Limits | None = None) -> Any:
    """A rollout sandbox for a SWE-bench-format instance that brings its own image: a container
    of :func:`instance_image` whose ``/testbed`` is an overlay over the image's own ``/testbed``
    (copied out once, ``coderl.sandbox.images.image_testbed``), with the image's environment
    (its ``PATH``, its interpreters). Raises SandboxError (no such image, no ``/testbed``)."""
    from coderl.sandbox.base import BACKENDS
    from coderl.sandbox.images import image_testbed

    image = instance_image(instance)
    return BACKENDS["container"](
        image_testbed(image),
        limits=limits or Limits(),
        env={},
        ro_mounts={},
        rw_mounts={},
        network=False,
        image=image,
    )


def grade_instance(
    instance: dict[str, Any],
    model_patch: str,
    *,
    model: str = "coderl",
    timeout: float = 1800.0,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """The harness's report entry for ``model_patch`` on a SWE-bench-format instance with its
    own image (swebench 5.x fields ``image``, ``eval_script``, ``log_parser``, ``eval_type``,
    FAIL_TO_PASS, PASS_TO_PASS; ``swebench.harness.utils.make_test_spec``), graded as the harness
    grades it: the patch applied to the image's ``/testbed`` (the files of the instance's
    ``test_patch`` and coderl's protected paths stripped, ``apply_to_copy``), the eval script run
    in a fresh container of the image without network, the log read by the instance's parser.

    Only the log parser decides here (no coderl runner in a foreign image): see the module
    docstring for what graded code can forge in that log. The diff guard
    (``coderl.grading.diffguard``) runs first: a denied diff is reported unresolved with
    ``denied`` set, its tests never run. A log the instance's parser raises on (the graded code
    wrote it) is reported unresolved with ``unreadable_log`` set: the agent's failure, not a
    mask; so is a diff that ``apply_to_copy`` cannot apply or read back (``PatchError``, the
    ``RecursionError``/``UnicodeError`` a pathological diff raises, and an ``OSError`` such as a
    path past the host's ``PATH_MAX``; ``HOST_ERRNOS`` excepted, which are the host's).
    Raises KeyError (a field missing), SandboxError (podman, the image)."""
    from swebench.harness.constants import APPLY_PATCH_FAIL
    from swebench.harness.grading import get_eval_report
    from swebench.harness.utils import make_test_spec

    from coderl.grading.guardproc import scan_change
    from coderl.grading.protected import is_protected
    from coderl.sandbox.images import image_testbed
    from coderl.tasks.patches import paths_in_diff

    image = instance_image(instance)
    spec = make_test_spec({**instance, "image": image})
    base = image_testbed(image)
    test_files = paths_in_diff(instance.get("test_patch") or "")
    prediction = {"instance_id": spec.instance_id, "model_name_or_path": model}
    prediction["model_patch"] = model_patch
    tmp = Path(tempfile.mkdtemp(dir=base.parent, prefix=".grade-"))  # hard links: same fs
    try:
        tree = tmp / "tree"
        tree.mkdir()
        denied: list[str] = []
        try:
            changed, _ = apply_to_copy(
                base, drop_binary(model_patch)[0], lambda p: is_protected(p, test_files), tree
            )
            denied = [str(f) for f in scan_change(base, tree, changed, base)]
        except (PatchError, RecursionError, UnicodeError, OSError) as e:  # the agent's diff
            if isinstance(e, OSError) and e.errno in HOST_ERRNOS:
                raise  # a full disk or no memory: the host's fault (infra)
            log = f"{APPLY_PATCH_FAIL}: {type(e).__name__}: {str(e)[-300:]}\n"
        else:  # podman and the image failing stay infrastructure (grade_image_task)
            log = _instance_log(spec, tree, image, timeout) if not denied else ""
        path = log_path or tmp / "test_output.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(log)
        try:
            report = get_eval_report(spec, prediction, str(path), include_tests_status=True)
        # the parser reads a log the agent's code wrote: whatever it raises on that log is the
        # agent's failure (scored, unresolved), never a mask the policy could choose
        except Exception as e:  # noqa: BLE001
            return {
                "resolved": False,
                "patch_successfully_applied": True,
                "tests_status": {},
                "unreadable_log": f"{type(e).__name__}: {str(e)[:200]}",
            }
        entry = report[spec.instance_id]
        if denied:
            entry["resolved"], entry["denied"] = False, denied
        return entry
    finally:
        remove_tree(tmp)


def _instance_log(spec: Any, tree: Path, image: str, timeout: float) -> str:
    """The eval script's log from a fresh container of ``image`` over ``tree``."""
    from coderl.sandbox.base import BACKENDS

    limits = Limits(timeout_s=timeout, cpu_s=int(timeout) + 30, memory_bytes=8 * 1024**3)
    sb = BACKENDS["container"](
        tree, limits=limits, env={}, ro_mounts={}, rw_mounts={}, network=False, image=image
    )
    try:  # its own bash: the script's `set -uxo pipefail` must not reach the sandbox's shell
        sb.write_text("/tmp/coderl_eval.sh", spec.eval_script)
        res = sb.exec("/bin/bash /tmp/coderl_eval.sh 2>&1", timeout=timeout)
    finally:
        sb.close()
    return res.stdout + res.stderr


def grade_image_task(task: Task, agent_diff: str, *, timeout: float = 1800.0) -> GradeResult:
    """:func:`grade_instance` of an image task (``coderl.tasks.swebench.image_task``) as the
    :class:`GradeResult` the reward reads: ``resolved`` and the per-test outcomes
    (``tests_status``: ``passed`` / ``failed``) from the harness's report, the diff guard's
    findings in ``denied``; an unresolved grade is the agent's failure (a patch that does not
    apply included). Podman or the image failing is infrastructure (``grading_error``), masked.
    Never raises for what the agent did."""
    from coderl.sandbox.base import SandboxError

    start = time.monotonic()
    result = GradeResult(task_id=task.id)
    try:
        report = grade_instance(task_instance(task), agent_diff, timeout=timeout)
    except (SandboxError, OSError) as e:
        result.grading_error, result.failure_kind = f"sandbox: {type(e).__name__}: {e}", "infra"
        return result
    status = report.get("tests_status") or {}
    for group in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        for outcome in ("success", "failure"):
            for test in (status.get(group) or {}).get(outcome, []):
                result.tests[test] = "passed" if outcome == "success" else "failed"
    expected = list(dict.fromkeys(task.FAIL_TO_PASS + task.PASS_TO_PASS))
    for test in expected:
        result.tests.setdefault(test, "missing")
    passed = [t for t in expected if result.tests[t] == "passed"]
    f2p = [t for t in task.FAIL_TO_PASS if result.tests[t] == "passed"]
    result.fraction_passed = len(passed) / len(expected)
    result.fail_to_pass_passed = len(f2p) / len(task.FAIL_TO_PASS)
    result.denied = list(report.get("denied") or [])
    kept = not result.denied and all(result.tests[t] == "passed" for t in task.PASS_TO_PASS)
    result.partial_credit = result.fail_to_pass_passed if kept else 0.0
    result.resolved = bool(report["resolved"]) and not result.denied
    if not result.resolved:
        result.failure_kind = "agent"
        result.reason = (
            "the patch did not apply"
            if not report.get("patch_successfully_applied")
            else f"denied: {result.denied[0]}"
            if result.denied
            else f"the harness could not read the test log ({report['unreadable_log']})"
            if report.get("unreadable_log")
            else f"{len(expected) - len(passed)} of {len(expected)} tests did not pass"
        )
    result.duration_s = time.monotonic() - start
    return result


def eval_rows(
    tasks: list[Task], episodes: list[tuple[Any, bool]], *, timeout: float = 300.0
) -> list[tuple[str, str, dict[str, Any]]]:
    """Harness rows of an evaluation: for each repository task, its first evaluated episode
    (``(view, resolved)`` as ``coderl eval`` collects them: one prediction per instance, as
    SWE-bench takes) graded by :func:`harness_report` in the run's sandbox backend (an image
    task: :func:`grade_instance` in its own image), with coderl's verdict from the evaluation
    deciding ``resolved`` and the harness's beside it. For an image task that verdict was the
    harness's own (:func:`grade_image_task`), so the two differ only if a grade did."""
    by_id = {t.id: t for t in tasks if t.kind == "repo"}
    rows: list[tuple[str, str, dict[str, Any]]] = []
    seen: set[str] = set()
    for view, ok in episodes:
        task = by_id.get(view.task_id)
        if task is None or task.id in seen:
            continue
        seen.add(task.id)
        if task.env_id.startswith(IMAGE_PREFIX):
            report = grade_instance(task_instance(task), view.diff, timeout=timeout)
        else:
            report = harness_report(task, view.diff, timeout=timeout)
        harness = bool(report["resolved"])
        report["coderl"] = {"resolved": ok, "harness_resolved": harness, "agree": harness == ok}
        report["resolved"] = bool(ok)
        rows.append((task.id, view.diff, report))
    return rows


def write_run(
    out_dir: Path, run_id: str, model: str, rows: list[tuple[str, str, dict[str, Any]]]
) -> Path:
    """Write a harness run for ``rows`` (instance id, model patch, report entry): ``out_dir/
    predictions.jsonl`` and ``out_dir/logs/run_evaluation/<run_id>/<model>/<id>/report.json`` (the
    harness's layout), then ``swebench.harness.reporting.make_run_report`` over them; returns
    the summary's path (``out_dir/<model>.<run_id>.json``)."""
    from swebench.harness.constants import LOG_REPORT, RUN_EVALUATION_LOG_DIR
    from swebench.harness.reporting import make_run_report

    out_dir.mkdir(parents=True, exist_ok=True)
    predictions = {
        iid: {"instance_id": iid, "model_name_or_path": model, "model_patch": patch}
        for iid, patch, _ in rows
    }
    with (out_dir / "predictions.jsonl").open("w") as f:
        for p in predictions.values():
            f.write(json.dumps(p) + "\n")
    for iid, _, report in rows:
        folder = out_dir / RUN_EVALUATION_LOG_DIR / run_id / model.replace("/", "__") / iid
        folder.mkdir(parents=True, exist_ok=True)
        (folder / LOG_REPORT).write_text(json.dumps({iid: report}, indent=1))
    dataset = [{"instance_id": iid} for iid, _, _ in rows]
    with contextlib.chdir(out_dir):  # the harness reads its log layout from the cwd
        summary = make_run_report(predictions, dataset, run_id, report_dir=".")
    return out_dir / summary
