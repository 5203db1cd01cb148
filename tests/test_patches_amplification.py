"""#25 class 5: a small diff must not make the host write a lot.

Each shape below is a few KB of diff that, applied as is, makes ``git apply`` write far more than
the diff carries (headers without content: copies, renames, mode changes; repeated patches of one
big file; very many files). ``apply_to_copy`` must refuse each before git writes anything
(``PatchError``, the agent's failure), while a big but honest diff still applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from coderl.grading.apply import APPLY_SLACK_BYTES, MAX_APPLY_FILES, apply_to_copy, write_bound
from coderl.tasks.patches import PatchError, make_diff

BIG = "".join(f"line {i:07d} of a big module\n" for i in range(8000))  # ~220 KB, a real upper end


@pytest.fixture()
def base(tmp_path: Path) -> Path:
    root = tmp_path / "base"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "big.py").write_text(BIG)
    (root / "pkg" / "big é.py").write_text(BIG)  # a name git quotes in headers
    (root / "small.py").write_text("x = 1\n")
    return root


def _copy(src: str, dst: str) -> str:
    return f"diff --git a/{src} b/{dst}\nsimilarity index 100%\ncopy from {src}\ncopy to {dst}\n"


def _quoted_copy(n: int) -> str:
    q = '"pkg/big \\303\\251.py"'
    return (
        f'diff --git "a/pkg/big \\303\\251.py" b/c{n}.py\nsimilarity index 100%\n'
        f"copy from {q}\ncopy to c{n}.py\n"
    )


def _mode(path: str, n: int) -> str:
    old, new = ("100644", "100755") if n % 2 == 0 else ("100755", "100644")
    return f"diff --git a/{path} b/{path}\nold mode {old}\nnew mode {new}\n"


def _append(n: int) -> str:  # one more line at the end of big.py, as its own file patch
    last = BIG.splitlines()[-1]
    return (
        "diff --git a/pkg/big.py b/pkg/big.py\n--- a/pkg/big.py\n+++ b/pkg/big.py\n"
        f"@@ -8000 +8000,2 @@\n {last}\n+extra {n}\n"
    )


def _new_file(n: int) -> str:
    return f"diff --git a/f{n} b/f{n}\nnew file mode 100644\n--- /dev/null\n+++ b/f{n}\n@@ -0,0 +1 @@\n+{n}\n"


SHAPES = {
    "copy_many": "".join(_copy("pkg/big.py", f"c{i}.py") for i in range(40)),
    "copy_quoted_name": "".join(_quoted_copy(i) for i in range(40)),
    "copy_chain": "".join(
        _copy("pkg/big.py" if i == 0 else f"c{i - 1}.py", f"c{i}.py") for i in range(40)
    ),
    "rename_then_copy": "diff --git a/pkg/big.py b/r.py\nsimilarity index 100%\n"
    "rename from pkg/big.py\nrename to r.py\n"
    + "".join(_copy("r.py", f"c{i}.py") for i in range(40)),
    "mode_flips_of_one_file": "".join(_mode("pkg/big.py", i) for i in range(40)),
    "many_patches_to_one_file": "".join(_append(i) for i in range(40)),
    "too_many_files": "".join(_new_file(i) for i in range(MAX_APPLY_FILES + 1)),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_amplifying_diff_is_refused_before_git_writes(base: Path, tmp_path: Path, name: str):
    diff = SHAPES[name]
    dest = tmp_path / "dest"
    with pytest.raises(PatchError, match="applying the diff would write up to"):
        apply_to_copy(base, diff, lambda p: False, dest)
    leftovers = [p for p in dest.rglob("*") if p.is_file()]
    assert sorted(p.relative_to(dest).as_posix() for p in leftovers) == [
        "pkg/big é.py",
        "pkg/big.py",
        "small.py",
    ]
    assert all(p.stat().st_nlink > 1 for p in leftovers)  # still the hard links: nothing written


def test_the_bound_counts_copies_but_not_an_honest_edit(base: Path):
    sizes = {"pkg/big.py": len(BIG), "small.py": 6}
    edit = make_diff("pkg/big.py", BIG, BIG.replace("line 0000003", "line three"))
    written, files, allowance = write_bound(edit, sizes)
    assert files == 1 and written <= allowance  # one rewrite of big.py is what an edit costs
    one_copy = _copy("pkg/big.py", "c.py")
    written, files, allowance = write_bound(one_copy, sizes)
    # a header of ~70 bytes that writes the 220 KB file: it earns only the slack
    assert written >= len(BIG) and allowance == len(one_copy) + APPLY_SLACK_BYTES


def test_big_honest_diff_still_applies(tmp_path: Path):
    """Edits to every file of a 2.6 MB tree plus a new 0.4 MB file: large, but all carried by the
    diff or one rewrite per edited file."""
    root = tmp_path / "base"
    root.mkdir()
    texts = {f"m{i}.py": BIG for i in range(12)}
    for rel, text in texts.items():
        (root / rel).write_text(text)
    new = "".join(f"print({i})\n" for i in range(40_000))
    diff = "".join(
        make_diff(rel, text, text.replace("line 0004000", "line four thousand"))
        for rel, text in texts.items()
    ) + make_diff("added.py", "", new).replace(
        "--- a/added.py", "new file mode 100644\n--- /dev/null", 1
    )
    changed, stripped = apply_to_copy(root, diff, lambda p: False, tmp_path / "dest")
    assert stripped == [] and changed == sorted([*texts, "added.py"])
    assert (tmp_path / "dest" / "added.py").read_text() == new
    assert "line four thousand" in (tmp_path / "dest" / "m7.py").read_text()


def test_a_single_honest_copy_of_a_small_file_applies(base: Path, tmp_path: Path):
    changed, _ = apply_to_copy(
        base, _copy("small.py", "small2.py"), lambda p: False, tmp_path / "d"
    )
    assert changed == ["small2.py"]
    assert (tmp_path / "d" / "small2.py").read_text() == "x = 1\n"


def test_lines_that_look_like_headers_inside_a_hunk_apply(tmp_path: Path):
    """A removed ``-- x`` line and an added ``++ y`` read as ``--- x``/``+++ y`` in the diff:
    hunk content to git, so the splitter must not count a second file patch."""
    root = tmp_path / "base"
    root.mkdir()
    (root / "q.sql").write_text("select 1;\n-- old comment\nselect 2;\n")
    diff = make_diff(
        "q.sql", "select 1;\n-- old comment\nselect 2;\n", "select 1;\n++ new\nselect 2;\n"
    )
    assert "\n--- old comment\n+++ new\n" in diff
    changed, _ = apply_to_copy(root, diff, lambda p: False, tmp_path / "dest")
    assert changed == ["q.sql"] and "++ new" in (tmp_path / "dest" / "q.sql").read_text()


def test_the_checks_behind_the_bound(base: Path, tmp_path: Path, monkeypatch):
    """If the bound ever under-counts (a header read differently from git), the tree git wrote
    is measured and refused; and a diff in which git reads another number of file patches than
    the bound counted is refused before git writes."""
    import coderl.grading.apply as patches

    monkeypatch.setattr(patches, "write_bound", lambda diff, sizes: (0, 0, APPLY_SLACK_BYTES))
    with pytest.raises(PatchError, match="applying the diff wrote"):
        apply_to_copy(base, SHAPES["copy_many"], lambda p: False, tmp_path / "d1")
    monkeypatch.undo()
    real = patches.split_diff
    monkeypatch.setattr(patches, "split_diff", lambda diff: real(diff)[:-1])
    two = make_diff("small.py", "x = 1\n", "x = 2\n") + _copy("pkg/big.py", "c.py")
    with pytest.raises(PatchError, match="git reads 2 file patches"):
        apply_to_copy(base, two, lambda p: False, tmp_path / "d2")
    assert not (tmp_path / "d2" / "c.py").exists()


def test_grade_scores_an_amplifying_diff_as_the_agents_failure():
    """Through ``grade()`` on a real repository task: refused, scored, never masked."""
    from coderl.grading.grade import grade
    from coderl.tasks.env import find_env
    from coderl.tasks.spec import load_tasks

    tasks_file = Path(__file__).parents[1] / "data" / "tasks" / "six.jsonl.gz"
    if not tasks_file.exists():
        pytest.skip("no six task file")
    task = load_tasks(str(tasks_file))[0]
    try:
        find_env(task.env_id)
    except KeyError:
        pytest.skip("six environment not built (make envs)")
    diff = "".join(_copy("six.py", f"c{i}.py") for i in range(200)) + task.gold_patch
    r = grade(task, diff)
    assert r.grading_error is None and not r.resolved
    assert r.failure_kind == "agent" and "would write up to" in r.reason
