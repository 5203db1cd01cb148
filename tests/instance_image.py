"""A SWE-bench-format instance that brings its own image, built here without a registry: the
Debian base (``coderl.sandbox.images.base_image``), pytest in a virtualenv, a tiny git repository
at ``/testbed`` whose ``add`` subtracts. Its tag (``localhost/coderl-instance-test:<hash>``) hashes
these inputs, so every test module that calls :func:`calc_instance` finds the one image (PyPI
for pytest the first time). Needs root and podman (make sysdeps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
GOLD_PATCH = (
    "diff --git a/calc.py b/calc.py\n--- a/calc.py\n+++ b/calc.py\n@@ -1,4 +1,4 @@\n"
    " def add(a, b):\n-    return a - b\n+    return a + b\n \n \n"
)


def calc_instance(ctx: Path) -> dict[str, Any]:
    """Build (or find) the image and return its instance (swebench 5.x fields). ``ctx``: an
    empty directory for the build context."""
    from coderl.sandbox.images import base_image, build_layer

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
        "patch": GOLD_PATCH,
        "problem_statement": "calc.add(2, 3) returns -1; it should return 5.",
        "test_patch": TEST_PATCH,
        "eval_script": EVAL_SCRIPT,
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
        "FAIL_TO_PASS": '["tests/test_calc.py::test_add"]',
        "PASS_TO_PASS": '["tests/test_calc.py::test_sub"]',
    }


if __name__ == "__main__":  # make container-image: build it before the tests need it
    import tempfile

    with tempfile.TemporaryDirectory(prefix="coderl-instance-ctx-") as tmp:
        print(calc_instance(Path(tmp))["image"])
