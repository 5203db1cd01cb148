"""Held-out tests of repository tasks and what rollout workspaces may contain."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from coderl.tasks.holdout import (
    blank_functions,
    choose_held_out,
    defined_tests,
    function_of,
    revealing,
    rollout_workspace,
)
from coderl.tasks.patches import paths_in_diff
from coderl.tasks.snapshot import snapshot_spec
from coderl.tasks.spec import load_tasks, parse_task_line

TASK_FILES = sorted((Path(__file__).parent.parent / "data" / "tasks").glob("*.jsonl*"))

SOURCE = """import six


@pytest.mark.parametrize("x", [1, 2])
def test_a(x):
    assert x


if six.PY3:

    def test_b():
        assert True

else:

    def test_b():
        assert False


class TestC:
    def test_d(self):
        assert 1

    def test_e(self):
        assert 2
"""


def test_choice_is_deterministic_and_keeps_a_visible_failing_test():
    f2p = ["t/test_x.py::test_a[1]", "t/test_x.py::test_a[2]", "t/test_x.py::T::test_b"]
    p2p = [f"t/test_y.py::test_{i}" for i in range(10)] + ["pkg/mod.py::pkg.mod.f"]
    held = choose_held_out("task-1", f2p, p2p)
    assert held == choose_held_out("task-1", f2p, p2p)
    assert set(held) <= set(f2p + p2p) and "pkg/mod.py::pkg.mod.f" not in held  # doctest
    hidden_f2p = {function_of(i) for i in held if i in f2p}
    assert len(hidden_f2p) == 1 and set(f2p) - set(held)  # one of two functions, whole
    assert len([i for i in held if i in p2p]) == 2  # 20% of 10
    assert choose_held_out("t", ["a/test_z.py::test_only"], []) == ["a/test_z.py::test_only"]


def test_blanking_keeps_line_numbers_and_other_tests():
    out = blank_functions(SOURCE, {"test_a", "test_b", "TestC::test_d"})
    assert len(out.splitlines()) == len(SOURCE.splitlines())
    keys = {k for k, _ in defined_tests(ast.parse(out))}
    assert keys == {"TestC::test_e"}
    assert out.splitlines()[SOURCE.splitlines().index("    def test_e(self):")] == (
        "    def test_e(self):"
    )
    with pytest.raises(KeyError, match="test_missing"):
        blank_functions(SOURCE, {"test_missing"})


def test_old_task_files_load_with_the_deterministic_share(tmp_path):
    task = load_tasks(TASK_FILES[0])[0]
    raw = json.loads(task.model_dump_json())
    del raw["held_out_tests"]
    old = parse_task_line(json.dumps(raw))
    assert old.held_out_tests == choose_held_out(task.id, task.FAIL_TO_PASS, task.PASS_TO_PASS)
    raw["held_out_tests"] = []
    assert parse_task_line(json.dumps(raw)).held_out_tests == []  # an explicit choice stays
    raw["held_out_tests"] = ["not/a/test.py::x"]
    with pytest.raises(ValueError, match="held_out_tests"):
        parse_task_line(json.dumps(raw))


def test_every_repository_task_holds_some_failing_tests_out():
    for path in TASK_FILES:
        for task in load_tasks(path):
            assert set(task.FAIL_TO_PASS) & set(task.held_out_tests), task.id


def _files(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            assert not revealing(rel) and not revealing(rel + "/x"), rel
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                out[os.path.relpath(full, root)] = Path(full).read_bytes()
    return out


@pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root to download sdists in a sandbox (make sysdeps)",
)
@pytest.mark.parametrize("path", TASK_FILES, ids=lambda p: p.name)
def test_shipped_rollout_workspaces_reveal_neither_the_fix_nor_held_out_tests(path):
    """Walks the rollout workspace of every shipped task: no VCS data, caches, bytecode,
    egg-info or patch leftovers; no copy of the original (pre-bug) file anywhere; held-out test
    functions absent, visible ones present, every test file still parses."""
    snapshots: dict[str, Path] = {}
    for task in load_tasks(path):
        spec = task.source.removeprefix("pypi:")
        if spec not in snapshots:
            snapshots[spec] = snapshot_spec(spec)[1]
        snapshot = snapshots[spec]
        files = _files(rollout_workspace(snapshot, task.bug_patch, task.held_out_tests))
        digests = {hashlib.sha256(b).digest() for b in files.values()}
        for rel in paths_in_diff(task.bug_patch):
            original = (snapshot / rel).read_bytes()
            assert hashlib.sha256(original).digest() not in digests, (task.id, rel)
        held = {function_of(i) for i in task.held_out_tests} - {None}
        for test_file in {k.split("::")[0] for k in held}:

            def defined(text: bytes, test_file: str = test_file) -> set[str]:
                return {f"{test_file}::{k}" for k, _ in defined_tests(ast.parse(text.decode()))}

            before = defined((snapshot / test_file).read_bytes())
            after = defined(files[test_file])
            assert held & before == {k for k in held if k.startswith(test_file + "::")}, task.id
            assert after == before - held, task.id  # exactly the held-out ones are gone
