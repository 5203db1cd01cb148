"""A SWE-bench-format instance that brings its own image (``coderl.grading.harness``): the episode
runs in a container of the image, and the grade runs the instance's eval script in a fresh
container of it, read by ``swebench``'s log parser and ``get_eval_report``.

The image is built here (no registry): the Debian base, pytest in a virtualenv, a tiny git
repository at ``/testbed`` whose ``add`` subtracts. Needs root and podman (make sysdeps); PyPI for
pytest the first time (then cached by its input hash).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("podman") is None,
    reason="instance images need root and podman (make sysdeps)",
)

TEST_PATCH = """\
diff --git a/tests/test_calc.py b/tests/test_calc.py
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -4,0 +5,4 @@ def test_sub():
+
+
+def test_add():
+    assert calc.add(2, 3) == 5
"""
EVAL_SCRIPT = f"""#!/bin/bash
set -uxo pipefail
cd /testbed
git apply -v - <<'EOF_TEST_PATCH'
{TEST_PATCH}EOF_TEST_PATCH
echo '>>>>> Start Test Output'
/venv/bin/python -m pytest -rA -p no:cacheprovider tests/test_calc.py
echo '>>>>> End Test Output'
git checkout -- tests/test_calc.py
"""


@pytest.fixture(scope="module")
def instance(tmp_path_factory) -> dict:
    from coderl.sandbox.images import base_image, build_layer

    ctx = tmp_path_factory.mktemp("ctx")
    repo = ctx / "testbed"
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(
        "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
    )
    (repo / "tests" / "test_calc.py").write_text(
        "import calc\n\ndef test_sub():\n    assert calc.sub(3, 2) == 1\n"
    )
    body = (  # the repository is committed inside the build: the context holds no git stat data
        "RUN python3 -m venv /venv && /venv/bin/pip install -q pytest==8.3.4\n"
        "COPY testbed /testbed\n"
        "RUN cd /testbed && git init -q -b main && git add -A && GIT_AUTHOR_DATE=2026-01-01T00:00Z "
        "GIT_COMMITTER_DATE=2026-01-01T00:00Z git -c user.email=t@t -c user.name=t commit -qm base\n"
        "ENV PYTHONPATH=/testbed\n"
    )
    tag = build_layer("instance-test", base_image(), body, ctx, pip=True)
    return {
        "instance_id": "local__calc-1",
        "repo": "local/calc",
        "version": "0.1",
        "image": tag,
        "test_patch": TEST_PATCH,
        "eval_script": EVAL_SCRIPT,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "FAIL_TO_PASS": '["tests/test_calc.py::test_add"]',
        "PASS_TO_PASS": '["tests/test_calc.py::test_sub"]',
    }


def test_an_episode_in_the_instance_image_is_graded_as_the_harness_grades(instance):
    from coderl.grading.harness import grade_instance, instance_sandbox

    with instance_sandbox(instance) as sb:
        assert sb.exec("/venv/bin/python -c 'import pytest'").exit_code == 0  # the image's env
        assert sb.exec("git log --oneline | wc -l").stdout.strip() == "1"
        sb.exec("sed -i '2s/a - b/a + b/' calc.py")
        diff = sb.diff()
    assert "+    return a + b" in diff and ".git" not in diff
    fixed = grade_instance(instance, diff)
    assert fixed["resolved"] and fixed["patch_successfully_applied"]
    assert fixed["tests_status"]["FAIL_TO_PASS"]["success"] == ["tests/test_calc.py::test_add"]
    empty = grade_instance(instance, "")
    assert not empty["resolved"]
    assert empty["tests_status"]["FAIL_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]


def test_the_instances_test_files_are_not_the_agents_to_change(instance, monkeypatch):
    """A diff that points the test module at a correct stand-in (``import fakecalc as calc``)
    would resolve the instance; the test file is protected (coderl's test-file patterns and the
    files of the instance's test_patch), so that chunk is stripped and ``test_add`` fails against
    the real ``calc``."""
    import coderl.grading.protected as protected
    import coderl.tasks.patches as patches
    from coderl.grading.harness import grade_instance

    old = "import calc\n\ndef test_sub():\n    assert calc.sub(3, 2) == 1\n"
    forged = patches.make_diff(
        "tests/test_calc.py", old, old.replace("import calc", "import fakecalc as calc")
    )
    forged += (
        "diff --git a/fakecalc.py b/fakecalc.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/fakecalc.py\n@@ -0,0 +1,2 @@\n+add = lambda a, b: a + b\n+sub = lambda a, b: a - b\n"
    )
    assert not grade_instance(instance, forged)["resolved"]
    monkeypatch.setattr(protected, "is_protected", lambda *a, **k: False)  # unprotected: it would
    assert grade_instance(instance, forged)["resolved"]


def test_the_image_scheme_names_the_image_when_the_instance_does_not(instance):
    from coderl.grading.harness import instance_image

    assert instance_image(instance) == instance["image"]
    assert Path(instance["image"]).name.startswith("coderl-instance-test:")
