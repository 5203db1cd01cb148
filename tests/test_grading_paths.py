"""Protected paths are removed from the agent's changes before grading (no sandbox; git only)."""

import os
import stat

import pytest

from coderl.grading.apply import apply_to_copy, remove_tree
from coderl.grading.protected import is_protected, strip_protected
from coderl.tasks.patches import PatchError, make_diff


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


# --- protected paths decided on the tree git produces (apply_to_copy) -------------------------

CONFTEST = "def pytest_runtest_makereport(item, call): ...\n"


def _base(tmp_path):
    base = tmp_path / "base"
    (base / "pkg").mkdir(parents=True)
    (base / "tests").mkdir()
    (base / "pkg" / "core.py").write_text("x = 1\n")
    (base / "tests" / "test_core.py").write_text("def test_x(): assert True\n")
    (base / "setup.cfg").write_text("[metadata]\nname = pkg\n")
    return base


def _apply(tmp_path, diff):
    base = _base(tmp_path)
    tree = tmp_path / "tree"
    tree.mkdir()
    changed, stripped = apply_to_copy(base, diff, is_protected, tree)
    return base, tree, changed, stripped


def _new_file(header_a: str, header_b: str, text: str = CONFTEST, git_line: str | None = None):
    body = "".join("+" + line + "\n" for line in text.splitlines())
    n = len(text.splitlines())
    git = git_line if git_line is not None else f"diff --git {header_a} {header_b}\n"
    return f"{git}new file mode 100644\n--- /dev/null\n+++ {header_b}\n@@ -0,0 +1,{n} @@\n{body}"


HEADER_TRICKS = {
    "quoted": _new_file('"a/conftest.py"', '"b/conftest.py"'),
    "octal_escaped": _new_file('"a/con\\146test.py"', '"b/con\\146test.py"'),
    "trailing_whitespace": _new_file(
        "a/conftest.py", "b/conftest.py", git_line="diff --git a/conftest.py b/conftest.py  \n"
    ),
    "carriage_return": _new_file(
        "a/conftest.py", "b/conftest.py", git_line="diff --git a/conftest.py b/conftest.py\r\n"
    ),
    "plain_unified_no_git_header": _new_file("a/conftest.py", "b/conftest.py", git_line=""),
    "nested_dir": _new_file("a/pkg/sub/conftest.py", "b/pkg/sub/conftest.py"),
    "dist_info": _new_file(
        "a/x-1.dist-info/entry_points.txt",
        "b/x-1.dist-info/entry_points.txt",
        "[pytest11]\nx = pkg.core\n",
    ),
}


@pytest.mark.parametrize("trick", sorted(HEADER_TRICKS))
def test_header_tricks_cannot_smuggle_a_protected_file(tmp_path, trick):
    source = make_diff("pkg/core.py", "x = 1\n", "x = 2\n")
    _, tree, changed, stripped = _apply(tmp_path, source + HEADER_TRICKS[trick])
    assert changed == ["pkg/core.py"] and stripped, (changed, stripped)
    assert (tree / "pkg" / "core.py").read_text() == "x = 2\n"
    assert not list(tree.rglob("conftest.py")) and not list(tree.rglob("*.dist-info"))


def test_split_headers_and_edits_of_protected_files_are_undone(tmp_path):
    diff = (
        "--- a/setup.cfg\n+++ b/setup.cfg\n@@ -1,2 +1,3 @@\n [metadata]\n name = pkg\n"
        "+[tool:pytest]\n"
        + "diff --git a/tests/test_core.py b/tests/test_core.py\ndeleted file mode 100644\n"
        "--- a/tests/test_core.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-def test_x(): assert True\n"
    )
    base, tree, changed, stripped = _apply(tmp_path, diff)
    assert changed == [] and stripped == ["setup.cfg", "tests/test_core.py"]
    for rel in ("setup.cfg", "tests/test_core.py"):
        assert os.stat(tree / rel).st_ino == os.stat(base / rel).st_ino  # the pristine file


def test_a_test_directory_replaced_by_a_file_is_restored(tmp_path):
    diff = (
        "diff --git a/tests/test_core.py b/tests/test_core.py\ndeleted file mode 100644\n"
        "--- a/tests/test_core.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-def test_x(): assert True\n"
        + _new_file("a/tests", "b/tests", "not a directory\n")
    )
    base, tree, _, stripped = _apply(tmp_path, diff)
    assert "tests/test_core.py" in stripped
    assert (tree / "tests").is_dir() and (tree / "tests" / "test_core.py").read_text() == (
        base / "tests" / "test_core.py"
    ).read_text()


def test_setuid_mode_and_symlink_escapes_do_not_survive(tmp_path):
    setuid = "diff --git a/pkg/tool b/pkg/tool\nnew file mode 104755\n--- /dev/null\n+++ b/pkg/tool\n@@ -0,0 +1 @@\n+#!/bin/sh\n"
    escape = (
        "diff --git a/pkg/out b/pkg/out\nnew file mode 120000\n--- /dev/null\n+++ b/pkg/out\n"
        "@@ -0,0 +1 @@\n+/etc\n\\ No newline at end of file\n"
        "diff --git a/pkg/out/passwd b/pkg/out/passwd\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/pkg/out/passwd\n@@ -0,0 +1 @@\n+root::0:0::/:/bin/sh\n"
    )
    base = _base(tmp_path)
    tree = tmp_path / "t1"
    tree.mkdir()
    try:
        apply_to_copy(base, setuid, is_protected, tree)
    except PatchError:
        pass  # git refusing the mode is as good
    else:
        assert not os.stat(tree / "pkg" / "tool").st_mode & (stat.S_ISUID | stat.S_ISGID)
    tree2 = tmp_path / "t2"
    tree2.mkdir()
    with pytest.raises(PatchError, match="symbolic link"):
        apply_to_copy(base, escape, is_protected, tree2)


def test_non_utf8_names_and_very_deep_trees_are_read_back(tmp_path):
    deep = "/".join(["d"] * 1100) + "/x.py"
    diff = _new_file(f"a/{deep}", f"b/{deep}", "y = 1\n")
    diff += (
        'diff --git "a/pkg/caf\\351.py" "b/pkg/caf\\351.py"\nnew file mode 100644\n--- /dev/null\n'
        '+++ "b/pkg/caf\\351.py"\n@@ -0,0 +1 @@\n+z = 1\n'
    )
    try:
        _, tree, changed, stripped = _apply(tmp_path, diff)
        assert stripped == [] and len(changed) == 2
        assert os.fsencode("pkg/caf\udce9.py") in [os.fsencode(c) for c in changed]
    finally:  # pytest's own clean-up of old temporary directories recurses once per level
        remove_tree(tmp_path / "tree")


def test_a_test_file_replaced_by_a_directory_is_restored(tmp_path):
    diff = (
        "diff --git a/setup.cfg b/setup.cfg\ndeleted file mode 100644\n--- a/setup.cfg\n"
        "+++ /dev/null\n@@ -1,2 +0,0 @@\n-[metadata]\n-name = pkg\n"
        + _new_file("a/setup.cfg/x", "b/setup.cfg/x", "y\n")
    )
    base, tree, changed, stripped = _apply(tmp_path, diff)
    assert stripped == ["setup.cfg"] and changed == []
    assert (tree / "setup.cfg").is_file() and os.stat(tree / "setup.cfg").st_ino == (
        os.stat(base / "setup.cfg").st_ino
    )


def test_binary_patches_are_refused(tmp_path):
    binary = (
        "diff --git a/pkg/blob b/pkg/blob\nnew file mode 100644\nindex 0000000..1111111\n"
        "GIT binary patch\nliteral 5\nMcmZ?wbYx)T000\n\nliteral 0\nHcmV?d00001\n\n"
    )
    with pytest.raises(PatchError, match="binary"):
        _apply(tmp_path, binary)
