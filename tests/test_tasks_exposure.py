"""The build check finds every pristine copy of a task's source that a rollout can read
(issue 25, class 3): real bubblewrap sandboxes over a tiny snapshot made in ``tmp_path``.

Each placement below holds a byte-identical copy of the snapshot's ``mylib.py``; the check must
name it. Copies where the sandbox hides them (pip's ``_vendor``, system site-packages) must not
be readable at all, and with the mask taken away the check must find them.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from coderl.envbuild.exposure import (
    MIN_BYTES,
    ExposureError,
    check_readable,
    pristine_index,
    readable_copies,
)
from coderl.sandbox import bwrap

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None,
    reason="the bwrap backend needs root and bubblewrap (make sysdeps)",
)

SOURCE = "".join(f"def f{i}(x):\n    return x * {i} + {i**2}  # pristine {i}\n" for i in range(12))
SITE = "lib/python3.11/site-packages"


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    snap = tmp_path / "snap"
    snap.mkdir()
    (snap / "mylib.py").write_text(SOURCE)
    (snap / "small.py").write_text("x = 1\n")
    (snap / "tests").mkdir()
    (snap / "tests" / "test_mylib.py").write_text(
        "import mylib\n\n\ndef test_f():\n    assert mylib.f1(1)\n"
    )
    return snap


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    v = tmp_path / "venv"
    (v / SITE / "pip" / "_vendor").mkdir(parents=True)
    (v / SITE / "pip" / "__init__.py").write_text("")
    return v


def _copies(snapshot: Path, mounts: dict[str, str]) -> list[str]:
    return [p for p, _ in readable_copies(snapshot, mounts, pristine_index(snapshot))]


def test_clean_environment_passes_and_the_workspace_file_is_not_a_copy(snapshot, venv):
    assert len(SOURCE) >= MIN_BYTES
    assert _copies(snapshot, {"/venv": str(venv)}) == []
    check_readable(snapshot, {"/venv": str(venv)}, snapshot)  # no raise


def test_a_copy_in_the_virtualenv_fails_the_check(snapshot, venv):
    (venv / SITE / "mylib_backup.py").write_text(SOURCE)
    assert _copies(snapshot, {"/venv": str(venv)}) == [f"/venv/{SITE}/mylib_backup.py"]
    with pytest.raises(ExposureError, match="mylib_backup.py"):
        check_readable(snapshot, {"/venv": str(venv)}, snapshot)


def test_a_copy_vendored_under_pip_is_hidden_and_found_when_the_mask_is_off(
    snapshot, venv, monkeypatch
):
    (venv / SITE / "pip" / "_vendor" / "mylib.py").write_text(SOURCE)
    assert _copies(snapshot, {"/venv": str(venv)}) == []  # the mask hides it
    monkeypatch.setattr(bwrap, "VENDORED_GLOBS", ())
    assert _copies(snapshot, {"/venv": str(venv)}) == [f"/venv/{SITE}/pip/_vendor/mylib.py"]


def test_a_copy_in_system_site_packages_is_hidden_and_found_when_the_mask_is_off(
    tmp_path, venv, monkeypatch
):
    """The host's own site-packages (real files, not placed by the test) hold PyPI libraries;
    a snapshot that contains one of them is exposed exactly when the mask is missing."""
    site = Path(sysconfig.get_paths(vars={"base": sys.base_prefix})["purelib"])
    real = next(p for p in sorted(site.rglob("*.py")) if p.stat().st_size >= MIN_BYTES)
    snap = tmp_path / "snap2"
    snap.mkdir()
    shutil.copy(real, snap / "vendored_lib.py")
    assert _copies(snap, {"/venv": str(venv)}) == []
    monkeypatch.setattr(bwrap, "_system_hidden", lambda: ())
    assert str(real) in _copies(snap, {"/venv": str(venv)})


def test_a_symlink_to_a_copy_reachable_through_another_mount_fails_the_check(
    snapshot, venv, tmp_path
):
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text(SOURCE)
    (venv / SITE / "linked.py").symlink_to("/opt/other/data.txt")
    (venv / SITE / "dirlink").symlink_to("/opt/other")
    found = _copies(snapshot, {"/venv": str(venv), "/opt/other": str(other)})
    assert f"/venv/{SITE}/linked.py" in found  # the link itself is named
    assert "/opt/other/data.txt" in found  # and the copy behind it


def test_a_symlink_to_a_hidden_copy_is_dead(snapshot, venv):
    vendored = venv / SITE / "pip" / "_vendor" / "mylib.py"
    vendored.write_text(SOURCE)
    (venv / SITE / "link_to_vendor.py").symlink_to(f"/venv/{SITE}/pip/_vendor/mylib.py")
    (venv / SITE / "link_to_host.py").symlink_to(vendored)  # a host path, not mounted
    assert _copies(snapshot, {"/venv": str(venv)}) == []


def test_a_copy_elsewhere_in_the_workspace_and_inside_a_wheel_fails_the_check(
    snapshot, venv, tmp_path
):
    (snapshot / "build" / "lib").mkdir(parents=True)
    (snapshot / "build" / "lib" / "mylib.py").write_text(SOURCE)
    with zipfile.ZipFile(venv / "cached-1.0-py3-none-any.whl", "w") as z:
        z.writestr("cached/mylib.py", SOURCE)
    found = _copies(snapshot, {"/venv": str(venv)})
    assert found == [  # a twin inside the snapshot is a copy of each other
        "/testbed/build/lib/mylib.py",
        "/testbed/mylib.py",
        "/venv/cached-1.0-py3-none-any.whl!cached/mylib.py",
    ]


def test_task_files_are_checked_whatever_their_size(snapshot, venv):
    (venv / SITE / "small_copy.py").write_text("x = 1\n")
    assert _copies(snapshot, {"/venv": str(venv)}) == []  # below MIN_BYTES at build
    index = pristine_index(snapshot, ["small.py", "tests/test_mylib.py"])
    assert [p for p, _ in readable_copies(snapshot, {"/venv": str(venv)}, index)] == [
        f"/venv/{SITE}/small_copy.py"
    ]


def test_validate_rejects_a_shipped_task_whose_pristine_file_is_readable(tmp_path, monkeypatch):
    """``validate_task``'s exposure step over a real shipped six task: clean as shipped; a copy
    of a bug-patch file reachable through one more read-only mount makes the task invalid."""
    from coderl.envbuild.build import build_env
    from coderl.grading.grade import rollout_sandbox_args
    from coderl.synth import validate
    from coderl.tasks.patches import paths_in_diff
    from coderl.tasks.repos import load_repo_tasks

    env = build_env("six==1.17.0")  # cached under $CODERL_CACHE
    task = next(t for t in load_repo_tasks("train") if t.env_id == env.env_id)
    assert validate.exposure_of(task) is None
    other = tmp_path / "other"
    other.mkdir()
    touched = sorted(paths_in_diff(task.bug_patch))[0]
    shutil.copy(Path(env.snapshot) / touched, other / "copy.py")

    def with_copy(t):
        base, mounts = rollout_sandbox_args(t)
        return base, mounts | {"/opt/other": str(other)}

    monkeypatch.setattr(validate, "rollout_sandbox_args", with_copy)
    reason = validate.exposure_of(task)
    assert reason and "/opt/other/copy.py" in reason and touched in reason
