"""Suite-wide hooks.

CI cannot pass with the security suites skipped: when ``CI`` is set (``true``, ``1`` or ``yes``,
as CI services and ``.ci/run`` set it), a test of the sandbox, grading, checker or red-team suites
that is skipped because the machine lacks what it needs (bubblewrap, root, the sandbox) is
reported as a failure that says why. Elsewhere (a laptop without bubblewrap) those skips stay
skips. Skips for other reasons (no terminal for ``script(1)``, another architecture) are left.
"""

from __future__ import annotations

import gc
import os
import re

import pytest

SECURITY_SUITES = re.compile(
    r"^test_(sandbox|grading|online_sandbox|tasks_humaneval|tasks_holdout|checker)|redteam|attack",
    re.I,
)
"""Test modules (file names) whose skips CI does not accept."""
MISSING_SANDBOX = re.compile(r"bubblewrap|bwrap|\broot\b|sysdeps|sandbox", re.I)
"""Skip reasons that mean "this machine cannot run the sandbox"."""
_failed: list[str] = []


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and in_ci() and not hasattr(report, "wasxfail")):
        return
    reason = _skip_reason(report)
    if SECURITY_SUITES.search(item.path.name) and MISSING_SANDBOX.search(reason):
        report.outcome = "failed"
        report.longrepr = (
            f"CI: security test skipped ({reason}); with CI set, the sandbox, grading and "
            "red-team suites must run: install bubblewrap and run as root (make sysdeps)"
        )
        _failed.append(item.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if _failed:
        terminalreporter.write_line(
            f"CI: {len(_failed)} security tests were skipped and count as failures "
            "(no bubblewrap or not root); see the failures above",
            red=True,
        )


@pytest.fixture(autouse=True, scope="module")
def _freeze_survivors():
    """After each test module, collect its garbage and freeze what survives (``gc.freeze``):
    objects kept alive across modules (imported libraries, caches, tiny models) are then not
    traversed by every later full collection. Without it a full run's process grew to ~1.7 GB of
    tracked objects and allocation-heavy tests (AST deep copies in test_tasks_mutate) spent
    minutes per test in the collector."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module's tests: a tiny model gains nothing from more, and on
    busy cores they cost several times over (``pytestmark = pytest.mark.usefixtures(...)``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_torch_thread_each():
    """:func:`one_torch_thread` set again before each test, for modules whose tests change
    torch's threads themselves (the ``threads`` config key, ``--threads``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
