"""Protected paths are stripped from the agent's diff before grading (no sandbox)."""

import pytest

from coderl.tasks.grading import is_protected, strip_protected
from coderl.tasks.patches import make_diff


@pytest.mark.parametrize(
    "path",
    [
        "tests/test_a.py",
        "pkg/tests/util.py",
        "test_six.py",
        "pkg/foo_test.py",
        "conftest.py",
        "pkg/conftest.py",
        "pytest.ini",
        "tox.ini",
        "setup.cfg",
        "pyproject.toml",
        "evil.pth",
        "pkg/x.pth",
        "sitecustomize.py",
        "lib/usercustomize.py",
        "pkg/__pycache__/m.cpython-311.pyc",
        "m.pyc",
        ".pytest_cache/v/x",
        ".hypothesis/db",
        "pytest.py",
        "_pytest/runner.py",
        "unittest.py",
        "json/__init__.py",
        "os.py",
    ],
)
def test_protected(path):
    assert is_protected(path)


@pytest.mark.parametrize(
    "path", ["toolz/itertoolz.py", "src/pkg/core.py", "README.md", "pkg/os_utils.py", "pkg/json.py"]
)
def test_not_protected(path):
    assert not is_protected(path)


def test_shadowing_is_checked_in_the_source_root():
    assert is_protected("src/pytest.py", source_roots=(".", "src"))
    assert not is_protected("src/pkg.py", source_roots=(".", "src"))


def test_strip_keeps_source_and_drops_everything_protected():
    source = make_diff("pkg/core.py", "x = 1\n", "x = 2\n")
    hacks = (
        make_diff("tests/test_core.py", "assert f() == 2\n", "assert True\n")
        + make_diff("conftest.py", "", "def pytest_runtest_makereport(item, call): ...\n")
        + make_diff("sitecustomize.py", "", "import os\n")
        + "diff --git a/tests/test_gone.py b/tests/test_gone.py\ndeleted file mode 100644\n"
        "--- a/tests/test_gone.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-def test_x(): pass\n"
        + "diff --git a/tests/test_b.py b/pkg/moved.py\nsimilarity index 100%\n"
        "rename from tests/test_b.py\nrename to pkg/moved.py\n"
    )
    kept, removed = strip_protected(source + hacks, extra=["docs/**"])
    assert kept == source
    assert removed == [
        "tests/test_core.py",
        "conftest.py",
        "sitecustomize.py",
        "tests/test_gone.py",
        "pkg/moved.py",
    ]
    kept, removed = strip_protected(make_diff("docs/x.md", "", "y\n"), extra=["docs/**"])
    assert (kept, removed) == ("", ["docs/x.md"])
