"""Correct work is never scored zero for a byproduct (issue 47, class 8): a binary or
undiffable file the episode left in the workspace (a SQLite file a test run wrote, a coverage
database, a latin-1 log, a log over 2 MiB, a ``GIT binary patch``) is dropped from the diff,
not applied and not graded (``coderl.grading.apply.drop_binary``), so the fix beside it still
resolves; and dropping never raises a grade (a wrong fix with byproducts stays wrong).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from coderl.grading.apply import drop_binary
from coderl.grading.grade import grade, rollout_base
from coderl.sandbox import Sandbox
from coderl.tasks.humaneval import humaneval_tasks
from coderl.tasks.spec import load_tasks

CI_SPEC = "six==1.17.0"
CI_TASKS = Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl"

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)

SQLITE = "import sqlite3; c = sqlite3.connect('{p}'); c.execute('create table t(x)'); c.commit()"
BYPRODUCTS = {
    "a SQLite file at the root": f'python3 -c "{SQLITE.format(p="test.db")}"',
    "a SQLite file in a new directory": f'mkdir -p out && python3 -c "{SQLITE.format(p="out/cache.sqlite")}"',
    "a coverage database": f'python3 -c "{SQLITE.format(p=".coverage")}"',
    "a latin-1 log": "printf 'caf\\xe9\\n' > run.log",
    "random bytes": "head -c 4096 /dev/urandom > blob.bin",
    "a log over 2 MiB": "yes 'a line of a long log' | head -c 3000000 > big.log",
    "a NUL in a text file": "printf 'a\\0b\\n' > nul.txt",
}  # fmt: skip
GIT_BINARY = (
    "diff --git a/x.bin b/x.bin\nnew file mode 100644\nindex 0000000..e69de29\n"
    "GIT binary patch\nliteral 0\nHcmV?d00001\n\nliteral 0\nHcmV?d00001\n\n"
)


@pytest.fixture(scope="module")
def repo_task():
    from coderl.envbuild.build import build_env

    env = build_env(CI_SPEC)
    return load_tasks(CI_TASKS)[0], env


def _with(task, env, patch: str, command: str) -> str:
    """The diff of an episode that applied ``patch`` and then ran ``command``."""
    with Sandbox.create(rollout_base(task, env)) as sb:
        sb.write_text("/tmp/fix.diff", patch)
        if patch:
            assert sb.exec("cd /testbed && git apply /tmp/fix.diff").exit_code == 0
        r = sb.exec(f"cd /testbed && {command}")
        assert r.exit_code == 0, r.stderr
        return sb.diff()


@pytest.mark.parametrize("name", sorted(BYPRODUCTS))
def test_a_byproduct_beside_a_correct_fix_does_not_void_it(repo_task, name: str) -> None:
    task, env = repo_task
    diff = _with(task, env, task.gold_patch, BYPRODUCTS[name])
    assert "Binary files" in diff  # the byproduct is in the diff, as Sandbox.diff notes it
    g = grade(task, diff, env=env)
    assert g.resolved and g.dropped_paths, (name, g.reason)


def test_a_git_binary_patch_beside_a_correct_fix_is_dropped_not_applied(repo_task) -> None:
    task, env = repo_task
    g = grade(task, task.gold_patch + GIT_BINARY, env=env)
    assert g.resolved and g.dropped_paths == ["x.bin"], g.reason


def test_byproducts_never_raise_a_wrong_fix(repo_task) -> None:
    task, env = repo_task
    diff = _with(task, env, "", BYPRODUCTS["a SQLite file at the root"])
    g = grade(task, diff, env=env)
    assert not g.resolved and g.failure_kind == "agent" and g.dropped_paths == ["test.db"]


def test_a_function_fix_with_a_byproduct_resolves() -> None:
    task = {t.id: t for t in humaneval_tasks("all")}["HumanEval/0"]
    from coderl.grading.function import workspace_base

    with Sandbox.create(workspace_base(task)) as sb:
        sb.write_text("/tmp/fix.diff", task.gold_patch)
        assert sb.exec("cd /testbed && git apply /tmp/fix.diff").exit_code == 0
        sb.exec(f'cd /testbed && python3 -c "{SQLITE.format(p="t.db")}"')
        diff = sb.diff()
    g = grade(task, diff)
    assert g.resolved and g.dropped_paths == ["t.db"], g.reason


def test_drop_binary_keeps_every_text_patch() -> None:
    text = "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+Binary files\n"
    note = (
        "diff --git a/d.db b/d.db\nnew file mode 100644\nBinary files /dev/null and b/d.db differ\n"
    )
    assert drop_binary(text) == (text, [])
    assert drop_binary(note + text + GIT_BINARY) == (text, ["d.db", "x.bin"])


NATIVE = "six.cpython-311-x86_64-linux-gnu.so"  # imported before six.py beside it


def _text_patch(path: str, body: str) -> str:
    lines = body.split("\n")
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{ln}\n" for ln in lines)
    )


@pytest.mark.parametrize(
    "path", [NATIVE, "six.abi3.so", "data.bin", "pkg/x.txt"], ids=["native", "abi3", "bin", "txt"]
)
def test_binary_content_written_as_text_is_dropped(repo_task, path: str) -> None:
    """``git apply`` writes NUL bytes from a text hunk: an ELF image written that way would be
    a native module that shadows the library (no guard reads it). Dropped like a binary note."""
    task, env = repo_task
    elf = "\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0" + "\0" * 32
    g = grade(task, _text_patch(path, elf), env=env)
    assert not g.resolved and g.failure_kind == "agent" and g.dropped_paths == [path], g.reason
    g = grade(task, task.gold_patch + _text_patch(path, elf), env=env)
    assert g.resolved and g.dropped_paths == [path], g.reason


@pytest.mark.parametrize(
    "path", [NATIVE, "six.abi3.so", "six.so", "pkg/_speedups.so", "six.pyd", "lib.dylib"]
)
def test_native_modules_are_protected(path: str) -> None:
    from coderl.grading.protected import is_protected

    assert is_protected(path)


def test_drop_binary_drops_a_text_patch_holding_a_nul() -> None:
    text = _text_patch("a.py", "x = 1")
    nul = _text_patch("b.txt", "a\0b")
    assert drop_binary(text + nul) == (text, ["b.txt"])


# Round 8: text byproducts that parse as Python (a JSON report a test run wrote) are not read with
# the guard's Python rules, so a banned path or a format template in them denies nothing
TEXT_BYPRODUCTS = {
    "a JSON report naming /proc": """printf '["/proc/cpuinfo", 1]\\n' > report.json""",
    "a JSON report with a format template": """printf '{"t": "{0.name}"}\\n' > out/t.json""",
}


@pytest.mark.parametrize("name", sorted(TEXT_BYPRODUCTS))
def test_a_text_byproduct_that_parses_as_python_does_not_void_a_fix(repo_task, name: str) -> None:
    task, env = repo_task
    diff = _with(task, env, task.gold_patch, "mkdir -p out && " + TEXT_BYPRODUCTS[name])
    assert ".json" in diff  # a text file: applied, not dropped
    g = grade(task, diff, env=env)
    assert g.resolved and not g.denied, (name, g.reason)


# What tools leave in the working directory (2026-12-08): each voided the gold patch before it
# was dropped (a symlink denied by the guard, a build copy of six.py read as new code and denied,
# more files than MAX_APPLY_FILES refused by the apply bound)
MANY = "for i in $(seq 1100); do echo '{{}}' > {d}/f$i.json; done"
TOOL_BYPRODUCTS = {
    "a symlink to the module": "ln -s six.py alias",
    "a symlink out of the workspace": "ln -s /proc/self/fd/5 fd5",
    "pip install .'s build copy": "mkdir -p build/lib && cp six.py build/lib/six.py",
    "a virtualenv of any name": "python3 -m venv --without-pip env",
    "a type checker's cache": "mkdir -p .mypy_cache && " + MANY.format(d=".mypy_cache"),
    "1,100 JSON reports": "mkdir -p out && " + MANY.format(d="out"),
}


@pytest.mark.parametrize("name", sorted(TOOL_BYPRODUCTS))
def test_what_tools_leave_beside_a_correct_fix_does_not_void_it(repo_task, name: str) -> None:
    task, env = repo_task
    diff = _with(task, env, task.gold_patch, TOOL_BYPRODUCTS[name])
    g = grade(task, diff, env=env)
    assert g.resolved and g.dropped_paths and not g.denied, (name, g.reason)


def test_tool_byproducts_never_raise_a_wrong_fix(repo_task) -> None:
    task, env = repo_task
    diff = _with(task, env, "", "; ".join(TOOL_BYPRODUCTS[k] for k in sorted(TOOL_BYPRODUCTS)))
    g = grade(task, diff, env=env)
    assert not g.resolved and g.failure_kind == "agent" and len(g.dropped_paths) > 2200


def test_only_byproducts_are_dropped() -> None:
    """A new module, a new data file in a small diff, a file the base has under a tool
    directory's name and a script with a python shebang are work: applied."""
    work = [
        _text_patch("pkg/helpers.py", "x = 1"),
        _text_patch("data/table.json", "{}"),
        _text_patch("run_me", "#!/usr/bin/env python3\nprint(1)"),
        "diff --git a/build/conf.py b/build/conf.py\n--- a/build/conf.py\n+++ b/build/conf.py\n"
        "@@ -1 +1 @@\n-x = 1\n+x = 2\n",
    ]
    diff = "".join(work)
    assert drop_binary(diff) == (diff, [])
    many = "".join(_text_patch(f"out/r{i}.json", "{}") for i in range(1001))
    kept, dropped = drop_binary(diff + many)
    assert kept == diff.replace(work[1], "") and len(dropped) == 1002  # over the bound: data goes
