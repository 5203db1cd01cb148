"""pytest plugin that records per-test outcomes to a JSON file outside the workspace.

Loaded inside a sandbox with ``-p coderl_results`` (this directory is mounted read-only and put on
``PYTHONPATH``); it imports nothing from coderl. Environment variables:

- ``CODERL_RESULTS``: where to write ``{"tests": {nodeid: {"outcome", "longrepr"}}, ...}``.
- ``CODERL_SELECT``: optional file of node ids, one a line; other collected items are deselected.
- ``CODERL_TRACE_ROOT``: optional directory; when set, each test records which functions defined
  under it were called (``[relpath, first line]`` pairs, via ``sys.setprofile``).

Outcomes are ``passed`` only when setup, call and teardown all passed; otherwise ``failed``,
``error`` (setup/teardown), ``skipped``, ``xfailed`` or ``xpassed``. Tests that never report are
absent, and the grader counts absence as failure.

It also notes whether pytest's or unittest's machinery was replaced during the run (identity of
key functions at configure time vs. at the end): code under test that monkeypatches them is
reported in ``tampered``. This is a tripwire, not a boundary: code in the same process can defeat
it, which is why the grader also runs must-fail canary tests.
"""

from __future__ import annotations

import json
import os
import sys
import unittest
from typing import Any

import _pytest.python
import _pytest.reports
import _pytest.runner
import pytest

_RESULTS: dict[str, dict[str, Any]] = {}
_TRACE: dict[str, set[tuple[str, int]]] = {}
_WATCHED: dict[str, object] = {}
_COLLECT_ERRORS: list[str] = []


def _watch_targets() -> dict[str, object]:
    targets: dict[str, object] = {}
    for name in dir(unittest.TestCase):
        if name.startswith(("assert", "fail", "run", "_call", "_callTestMethod")):
            targets[f"unittest.TestCase.{name}"] = getattr(unittest.TestCase, name)
    for mod in (_pytest.runner, _pytest.python, _pytest.reports):
        for name, obj in vars(mod).items():
            if callable(obj) and not name.startswith("__"):
                targets[f"{mod.__name__}.{name}"] = obj
    for name, obj in vars(_pytest.reports.TestReport).items():
        targets[f"TestReport.{name}"] = obj
    targets["pytest.fail"] = pytest.fail
    targets["pytest.skip"] = pytest.skip
    targets["sys.exit"] = sys.exit
    targets["os._exit"] = os._exit
    return targets


def pytest_configure(config: pytest.Config) -> None:
    _WATCHED.update(_watch_targets())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    select = os.environ.get("CODERL_SELECT")
    if not select:
        return
    with open(select, encoding="utf-8") as f:
        wanted = {line.strip() for line in f if line.strip()}
    keep = [it for it in items if it.nodeid in wanted or "coderl_canary" in it.nodeid]
    drop = [it for it in items if it not in keep]
    # canaries run last, after the code under test had every chance to patch things
    keep.sort(key=lambda it: "coderl_canary" in it.nodeid)
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _COLLECT_ERRORS.append(f"{report.nodeid}: {str(report.longrepr)[-2000:]}")


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xfailed" if report.skipped else "xpassed"
    if report.passed:
        return "passed"
    if report.skipped:
        return "skipped"
    return "failed" if report.when == "call" else "error"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _RESULTS.setdefault(report.nodeid, {"outcome": "passed", "longrepr": ""})
    outcome = _outcome(report)
    if outcome != "passed" and entry["outcome"] == "passed":
        entry["outcome"] = outcome
        entry["longrepr"] = str(report.longrepr)[-4000:] if report.longrepr else ""
    if report.when == "call":
        entry["called"] = True


def _make_profiler(root: str, bucket: set[tuple[str, int]]) -> Any:
    prefix = root.rstrip("/") + "/"

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(prefix):
                bucket.add((code.co_filename[len(prefix) :], code.co_firstlineno))

    return profile


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    root = os.environ.get("CODERL_TRACE_ROOT")
    if not root:
        yield
        return
    bucket = _TRACE.setdefault(item.nodeid, set())
    sys.setprofile(_make_profiler(root, bucket))
    try:
        yield
    finally:
        sys.setprofile(None)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("CODERL_RESULTS")
    if not path:
        return
    now = _watch_targets()
    tampered = sorted(k for k, v in _WATCHED.items() if now.get(k) is not v)
    for entry in _RESULTS.values():
        # a test whose call phase never ran (e.g. setup skipped it) is not a pass
        if entry["outcome"] == "passed" and not entry.pop("called", False):
            entry["outcome"] = "error"
        entry.pop("called", None)
    out = {
        "tests": _RESULTS,
        "exitstatus": int(exitstatus),
        "tampered": tampered,
        "collect_errors": _COLLECT_ERRORS,
        "trace": {k: sorted(v) for k, v in _TRACE.items()},
    }
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f)
    os.replace(tmp, path)
