"""The diff guard fails closed (issue 47, class 2): a Python file the host cannot fully scan
within bounded time and memory is a finding, never a pass. The AST is walked without recursion
(a deep file the host can parse is scanned in full), the parse runs in a child process with
CPU, memory and wall bounds, and whatever that child cannot finish, or any ``.py`` file it
cannot parse (too deep, too big, syntax from a newer interpreter, a syntax error), is a finding.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from coderl.grading.diffguard import added_findings
from coderl.grading.guardproc import scan_bounded, scan_change


def _tree(tmp_path: Path, files: dict[str, str]) -> tuple[Path, Path, list[str]]:
    base, tree = tmp_path / "base", tmp_path / "tree"
    base.mkdir()
    tree.mkdir()
    for rel, text in files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    return base, tree, sorted(files)


def _rules(found) -> list[str]:
    return sorted({f.rule for f in found})


UNSCANNABLE = {
    "a sum 100,000 terms deep": "x = " + "+".join(["1"] * 100_000) + "\n",
    "unary minus 20,000 deep": "x = " + "-" * 20_000 + "1\n",
    "an attribute chain 100,000 deep": "x = a" + ".b" * 100_000 + "\n",
    "not 20,000 deep": "x = " + "not " * 20_000 + "y\n",
    "calls 100,000 deep": "x = f" + "()" * 100_000 + "\n",
    "syntax of a newer Python (PEP 695)": "type Alias = list[int]\n",
    "a syntax error": "def f(:\n    return 1\n",
    "a NUL byte": "x = 1\0\n",
}


@pytest.mark.parametrize("name", sorted(UNSCANNABLE))
def test_a_python_file_the_host_cannot_parse_is_a_finding(tmp_path: Path, name: str) -> None:
    base, tree, changed = _tree(tmp_path, {"pkg/mod.py": UNSCANNABLE[name]})
    found = scan_change(base, tree, changed)
    assert _rules(found) == ["unscannable"] and found[0].path == "pkg/mod.py", name


def test_a_deep_file_the_host_can_parse_is_scanned_in_full(tmp_path: Path) -> None:
    """3,000 terms deep: past the default recursion limit of a recursive walk, inside the
    child's parser limit; the walk is iterative, so the finding at the end is seen, and an
    honest file as deep has none."""
    deep = "+".join(["1"] * 3000)
    base, tree, changed = _tree(
        tmp_path,
        {"a.py": f"import sys\nx = {deep} + sys._getframe().f_lineno\n", "b.py": f"y = {deep}\n"},
    )
    found = scan_change(base, tree, changed)
    rules = {("a.py", "module-attr"), ("a.py", "attr"), ("a.py", "reflective")}
    assert {(f.path, f.rule) for f in found} == rules
    # in this process (recursion limit 1,000) the parse fails: closed, not open
    assert [f.rule for f in added_findings(None, f"y = {deep}\n".encode(), "b.py")] == [
        "unscannable"
    ]


def test_other_files_that_do_not_parse_are_not_findings(tmp_path: Path) -> None:
    base, tree, changed = _tree(tmp_path, {"README.md": "# not (python\n", "data.txt": "-" * 5000})
    assert scan_change(base, tree, changed) == []


def _job(tmp_path: Path, text: str) -> list[tuple[str, None, str, None]]:
    path = tmp_path / "big.py"
    path.write_text(text)
    return [("big.py", None, str(path), None)]


def test_a_scan_past_its_memory_bound_is_a_finding(tmp_path: Path) -> None:
    jobs = _job(tmp_path, "def f():\n" + "    x = y.z(1, 'a')\n" * 30_000)  # 0.6 MiB
    found = scan_bounded(jobs, memory_bytes=64 * 1024**2)
    assert _rules(found) == ["unscannable"]


def test_a_scan_past_its_cpu_bound_is_a_finding(tmp_path: Path) -> None:
    jobs = _job(tmp_path, "def f():\n" + "    x = y.z(1, 'a')\n" * 60_000)
    t = time.monotonic()
    found = scan_bounded(jobs, cpu_s=1)
    assert _rules(found) == ["unscannable"] and time.monotonic() - t < 60


def test_a_scan_past_its_wall_bound_is_a_finding(tmp_path: Path) -> None:
    found = scan_bounded(_job(tmp_path, "x = 1\n"), wall_s=0.001)
    assert _rules(found) == ["unscannable"] and "killed" in found[0].what


def test_the_files_done_before_the_child_died_keep_their_findings(tmp_path: Path) -> None:
    ok = tmp_path / "ok.py"
    ok.write_text("import gc\n")
    big = _job(tmp_path, "def f():\n" + "    x = y.z(1, 'a')\n" * 30_000)
    found = scan_bounded([("ok.py", None, str(ok), None), *big], memory_bytes=64 * 1024**2)
    assert {(f.path, f.rule) for f in found} == {("ok.py", "import"), ("big.py", "unscannable")}


@pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)
def test_a_graded_fix_with_an_unscannable_file_is_denied() -> None:
    from coderl.envbuild.build import build_env
    from coderl.grading.grade import grade
    from coderl.tasks.spec import load_tasks

    env = build_env("six==1.17.0")
    task = load_tasks(Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl")[0]
    deep = "x = " + "-" * 20_000 + "1\n"
    extra = f"diff --git a/deep.py b/deep.py\nnew file mode 100644\n--- /dev/null\n+++ b/deep.py\n@@ -0,0 +1 @@\n+{deep}"
    g = grade(task, task.gold_patch + extra, env=env)
    assert not g.resolved and g.failure_kind == "agent" and g.grading_error is None
    assert any("unscannable" in d for d in g.denied), g.denied


def test_a_path_the_host_cannot_stat_is_a_finding(tmp_path: Path) -> None:
    base, tree, _ = _tree(tmp_path, {"ok.py": "x = 1\n"})
    deep = "/".join(["d" * 200] * 30) + "/m.py"  # 6,000 characters: past PATH_MAX
    found = scan_change(base, tree, ["ok.py", deep])
    assert [(f.path, f.rule) for f in found] == [(deep, "unscannable")]


def test_a_path_too_long_for_the_guards_copy_is_the_agents_failure_not_a_mask() -> None:
    # round-5 red team: a file git writes (its relative path under PATH_MAX) whose path under the
    # guard's private copy is past PATH_MAX made the copy raise OSError, and grade() masked it;
    # any losing episode could add one and turn its 0 into a mask. Never a mask now: alone it
    # is unresolved; beside the gold fix it is an unscannable finding (or, where the copy fits,
    # a harmless new file and the fix resolves). The grader's cleanup of such a tree raised past
    # grade() too (ENAMETOOLONG from remove_tree): it now removes by directory descriptors.
    from coderl.envbuild.build import build_env
    from coderl.grading.grade import grade
    from coderl.tasks.spec import load_tasks

    env = build_env("six==1.17.0")
    task = load_tasks(Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl")[0]
    unscannable = 0
    for n in (3980, 4040, 4080):
        comps, total = [], 0
        while total < n:
            comps.append("d" * min(200, n - total))
            total += len(comps[-1]) + 1
        rel = "/".join(comps) + "/x.txt"
        diff = f"diff --git a/{rel} b/{rel}\nnew file mode 100644\n--- /dev/null\n+++ b/{rel}\n@@ -0,0 +1 @@\n+hello\n"
        alone, with_fix = grade(task, diff, env=env), grade(task, task.gold_patch + diff, env=env)
        for g in (alone, with_fix):
            assert g.grading_error is None, (n, g.grading_error)
        assert not alone.resolved and alone.failure_kind == "agent", (n, alone.reason)
        # beside the fix: resolved where the copy fits, else the agent's failure (an
        # unscannable finding, or a workspace the host cannot read back at all)
        assert with_fix.resolved or with_fix.failure_kind == "agent", (n, with_fix.reason)
        unscannable += any("unscannable" in d for d in with_fix.denied)
    assert unscannable  # the copy's failure was exercised


# Round 8: a new data file a test run leaves behind is not read with Python's rules. Before,
# any changed file that happened to parse as Python (JSON does) was scanned, so a report holding
# a banned path or a format template denied the correct fix beside it.
BYPRODUCT_TEXT = {
    "a JSON report naming /proc": '["/proc/cpuinfo", 1]\n',
    "a JSON report with a format template": '{"greeting": "{0.name}"}\n',
    "a JSON log naming the grader": '{"log": "coderl"}\n',
    "an assignment-like config line": 'status = "/proc/self/status"\n',
}


@pytest.mark.parametrize("name", sorted(BYPRODUCT_TEXT))
def test_a_new_data_file_is_no_finding(tmp_path: Path, name: str) -> None:
    text = BYPRODUCT_TEXT[name]
    assert added_findings(None, text.encode(), "out/report.json")  # read as Python: a finding
    base, tree, changed = _tree(tmp_path, {"out/report.json": text, "ok.py": "x = 1\n"})
    assert scan_change(base, tree, changed) == [], name


def test_python_files_existing_files_and_python_scripts_are_still_scanned(tmp_path: Path) -> None:
    text = BYPRODUCT_TEXT["a JSON report naming /proc"]
    base, tree, _ = _tree(tmp_path, {"new.py": text, "data.json": text, "bin/tool": text})
    (base / "data.json").write_text("[]\n")  # the base has it: a changed file, scanned
    (tree / "bin" / "tool").write_text("#!/usr/bin/env python3\n" + text)  # a script
    found = scan_change(base, tree, ["bin/tool", "data.json", "new.py"])
    assert sorted({f.path for f in found}) == ["bin/tool", "data.json", "new.py"], found
