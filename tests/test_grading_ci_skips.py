"""``tests/conftest.py`` turns skipped security tests into failures when ``CI`` is set."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).parent / "conftest.py"
FAKE = """
import pytest

pytestmark = pytest.mark.skipif(True, reason="needs bubblewrap and root (make sysdeps)")

def test_isolated():
    pass
"""
OTHER = """
import pytest

@pytest.mark.skip(reason="needs script(1) for a terminal")
def test_terminal():
    pass
"""


def _run(tmp_path: Path, name: str, source: str, ci: str | None) -> subprocess.CompletedProcess:
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / name).write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )


def test_security_skips_fail_in_ci(tmp_path):
    res = _run(tmp_path, "test_sandbox_fake.py", FAKE, "true")
    assert res.returncode == 1, res.stdout
    assert "1 error" in res.stdout and "security test skipped" in res.stdout  # skipped at setup
    assert "install bubblewrap" in res.stdout


def test_security_skips_stay_skips_outside_ci(tmp_path):
    res = _run(tmp_path, "test_grading_fake.py", FAKE, None)
    assert res.returncode == 0 and "1 skipped" in res.stdout, res.stdout


def test_other_skips_and_other_suites_are_left_alone_in_ci(tmp_path):
    assert "1 skipped" in _run(tmp_path, "test_sandbox_tty.py", OTHER, "true").stdout
    assert "1 skipped" in _run(tmp_path, "test_train_fake.py", FAKE, "1").stdout
