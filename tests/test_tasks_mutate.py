"""Mutation operators, diffs and problem statements (no sandbox)."""

import ast
import functools

import pytest

from coderl.synth.mutate import MUTATORS, first_line, functions, mutants_of
from coderl.tasks.patches import PatchError, apply_patch, make_diff, paths_in_diff, split_diff
from coderl.tasks.statement import abridge, write_statement

SOURCE = '''import os


def f(xs, n=2):
    """Doc with > and == inside, never mutated."""
    out = []  # keep this comment
    for i in range(len(xs)):
        if xs[i] > n and i % 2 == 0:
            out.append(xs[i] * 2 + 1)
        else:
            continue
    return out


class A:
    @staticmethod
    def g(a, b):
        return max(a, b) if a < b else True

    def h(self, s):
        return s[:3]
'''


def changed_lines(old, new):
    diff = make_diff("m.py", old, new)
    return [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]


@functools.cache
def all_mutants():
    """Every mutant of SOURCE, made once for the module (the parametrised tests only read it)."""
    tree = ast.parse(SOURCE)
    return tuple(m for name, fn in functions(tree) for m in mutants_of(SOURCE, name, fn))


def test_functions_and_first_lines():
    tree = ast.parse(SOURCE)
    found = {name: first_line(fn) for name, fn in functions(tree)}
    # a decorated function starts at its decorator, as CPython's co_firstlineno does
    assert found == {"f": 4, "A.g": 16, "A.h": 20}


@pytest.mark.parametrize(
    ("operator", "before", "after"),
    [
        (
            "flip_comparison",
            "        if xs[i] > n and i % 2 == 0:",
            "        if xs[i] <= n and i % 2 == 0:",
        ),
        (
            "boundary_comparison",
            "        if xs[i] > n and i % 2 == 0:",
            "        if xs[i] >= n and i % 2 == 0:",
        ),
        (
            "swap_bool_op",
            "        if xs[i] > n and i % 2 == 0:",
            "        if xs[i] > n or i % 2 == 0:",
        ),
        ("drop_condition", "        if xs[i] > n and i % 2 == 0:", "        if xs[i] > n:"),
        (
            "negate_condition",
            "        if xs[i] > n and i % 2 == 0:",
            "        if not (xs[i] > n and i % 2 == 0):",
        ),
        ("off_by_one_range", "    for i in range(len(xs)):", "    for i in range(len(xs) - 1):"),
        ("off_by_one_index", "        return s[:3]", "        return s[:3 - 1]"),
        (
            "off_by_one_constant",
            "            out.append(xs[i] * 2 + 1)",
            "            out.append(xs[i] * 3 + 1)",
        ),
        (
            "swap_arithmetic",
            "            out.append(xs[i] * 2 + 1)",
            "            out.append(xs[i] * 2 - 1)",
        ),
        (
            "swap_arguments",
            "        return max(a, b) if a < b else True",
            "        return max(b, a) if a < b else True",
        ),
        ("wrong_return", "    return out", "    return None"),
        ("remove_statement", "            continue", "            pass"),
        (
            "flip_bool_constant",
            "        return max(a, b) if a < b else True",
            "        return max(a, b) if a < b else False",
        ),
    ],
)
def test_each_operator_changes_one_segment(operator, before, after):
    diffs = [changed_lines(SOURCE, m.source) for m in all_mutants() if m.operator == operator]
    assert ["-" + before, "+" + after] in diffs


def test_every_operator_is_covered_and_mutants_are_minimal():
    mutants = all_mutants()
    assert {m.operator for m in mutants} == set(MUTATORS)
    for m in mutants:
        lines = changed_lines(SOURCE, m.source)
        assert len(lines) == 2, lines  # one line out, one in: comments/formatting untouched
        assert "keep this comment" in m.source and '"""Doc with > and == inside' in m.source
        compile(m.source, "m.py", "exec")


def test_precedence_is_kept_with_parentheses():
    src = "def k(n):\n    return 2 * range(n)[0] if n else -n\n"
    ((_, fn),) = functions(ast.parse(src))
    for m in mutants_of(src, "k", fn):
        # every mutant parses back to exactly the intended tree (checked inside mutants_of);
        # here: the range stop became "n - 1" inside the call, not "2 * range(n) - 1"
        if m.operator == "off_by_one_range":
            assert "range(n - 1)" in m.source


def test_diff_apply_round_trip(tmp_path):
    (tmp_path / "m.py").write_text(SOURCE)
    mutant = all_mutants()[0]
    bug = make_diff("m.py", SOURCE, mutant.source)
    apply_patch(tmp_path, bug)
    assert (tmp_path / "m.py").read_text() == mutant.source
    apply_patch(tmp_path, make_diff("m.py", mutant.source, SOURCE))
    assert (tmp_path / "m.py").read_text() == SOURCE
    with pytest.raises(PatchError):
        apply_patch(tmp_path, make_diff("m.py", mutant.source, SOURCE))  # already applied


def test_diff_without_final_newline(tmp_path):
    (tmp_path / "a.txt").write_text("x\ny")
    apply_patch(tmp_path, make_diff("a.txt", "x\ny", "x\nz"))
    assert (tmp_path / "a.txt").read_text() == "x\nz"


def test_split_diff_by_file():
    diff = make_diff("src/a.py", "1\n", "2\n") + make_diff("tests/test_a.py", "1\n", "3\n")
    plain = "--- a/b.py\n+++ b/b.py\n@@ -1 +1 @@\n-1\n+2\n"
    chunks = split_diff(diff + plain)
    assert [p for p, _ in chunks] == ["src/a.py", "tests/test_a.py", "b.py"]
    assert "".join(c for _, c in chunks) == diff + plain
    assert paths_in_diff(diff) == ["src/a.py", "tests/test_a.py"]


LONGREPR = """def test_add():
>       assert add(1, 2) == 3

tests/test_m.py:4:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _

a = 1, b = 2

    def add(a, b):
>       return a - b
E       assert -1 == 3

m.py:2: AssertionError"""


def test_statement_quotes_tests_not_the_library():
    short = abridge(LONGREPR)
    assert "assert add(1, 2) == 3" in short and "E       assert -1 == 3" in short
    assert "return a - b" not in short  # the mutated line is the answer, never shown
    text = write_statement("m 1.0", {"tests/test_m.py::test_add": LONGREPR})
    assert "tests/test_m.py::test_add" in text and "return a - b" not in text
    with pytest.raises(ValueError):
        write_statement("m 1.0", {})


def test_apply_inside_an_enclosing_git_repository(tmp_path):
    """git apply inside another repository would skip our paths; the ceiling prevents it."""
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    work = tmp_path / "cache" / "base"
    work.mkdir(parents=True)
    (work / "m.py").write_text("x = 1\n")
    apply_patch(work, make_diff("m.py", "x = 1\n", "x = 2\n"))
    assert (work / "m.py").read_text() == "x = 2\n"
