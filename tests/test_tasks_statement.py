"""Problem statements never name or quote a held-out test (issue 25, class 4).

Unit tests with hand-written pytest reports, and a walk over every shipped task: no statement
contains a held-out test's id, ``Class::name`` or bare function name (always), nor a distinctive
line of its code (over the environments built in ``$CODERL_CACHE``, six always).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from coderl.synth.repo import statement_for
from coderl.tasks.holdout import function_of, held_out_source
from coderl.tasks.repos import load_repo_tasks, read_repos, repo_of
from coderl.tasks.statement import MIN_BODY_LINE, held_out_mentions, symptoms, write_statement

TEST_FILE = """import pytest


def test_visible():
    assert mod.area(2) == 4


class TestShape:
    @pytest.mark.parametrize("n", [1, 2])
    def test_secret_perimeter(self, n):
        value = mod.perimeter_of_square(n)
        assert value == 4 * n, "perimeter must be four sides"
"""

HIDDEN_REPORT = """self = <test_mod.TestShape object at 0x7f>
    @pytest.mark.parametrize("n", [1, 2])
    def test_secret_perimeter(self, n):
        value = mod.perimeter_of_square(n)
>       assert value == 4 * n, "perimeter must be four sides"
E       AssertionError: perimeter must be four sides
E       assert 3 == (4 * 1)
E        +  where 3 = <function test_secret_perimeter.<locals>.f>
test_mod.py:11: AssertionError"""

VISIBLE_REPORT = """    def test_visible():
>       assert mod.area(2) == 4
E       assert 5 == 4
test_mod.py:5: AssertionError"""

HELD = [
    "test_mod.py::TestShape::test_secret_perimeter[1]",
    "test_mod.py::TestShape::test_secret_perimeter[2]",
]


@pytest.fixture
def snapshot(tmp_path: Path) -> Path:
    (tmp_path / "test_mod.py").write_text(TEST_FILE)
    return tmp_path


def _assert_hides(statement: str, source: list[str]) -> None:
    assert "test_secret_perimeter" not in statement
    assert "TestShape" not in statement
    assert "mod.perimeter_of_square(n)" not in statement
    assert held_out_mentions(statement, HELD, source) == []


def test_held_out_only_task_shows_symptoms_not_the_test(snapshot):
    source = held_out_source(snapshot, HELD)
    assert any("perimeter_of_square" in ln for ln in source)  # the fixture reads the real code
    statement = statement_for("mod 1.0", HELD, HELD, dict.fromkeys(HELD, HIDDEN_REPORT), snapshot)
    _assert_hides(statement, source)
    assert "assert 3 == (4 * 1)" in statement  # the failing behaviour is still described
    assert "where" not in statement  # introspection spells out the test's expressions
    assert "held out" in statement


def test_visible_failing_test_is_quoted_and_held_out_one_is_not(snapshot):
    f2p = ["test_mod.py::test_visible", *HELD]
    reports = {"test_mod.py::test_visible": VISIBLE_REPORT} | dict.fromkeys(HELD, HIDDEN_REPORT)
    statement = statement_for("mod 1.0", f2p, HELD, reports, snapshot)
    _assert_hides(statement, held_out_source(snapshot, HELD))
    assert "Output of test_mod.py::test_visible:" in statement
    assert "assert mod.area(2) == 4" in statement
    assert "2 more failing test(s) are held out" in statement


def test_a_visible_id_sharing_a_held_out_name_is_not_listed(snapshot):
    """An inherited copy of a blanked method carries its name: listing it names the test."""
    inherited = "test_mod.py::TestSquare::test_secret_perimeter[1]"
    f2p = ["test_mod.py::test_visible", inherited, *HELD]
    reports = {"test_mod.py::test_visible": VISIBLE_REPORT}
    statement = statement_for("mod 1.0", f2p, HELD, reports, snapshot)
    _assert_hides(statement, held_out_source(snapshot, HELD))
    assert "- test_mod.py::test_visible" in statement


def test_symptoms_drop_quoted_code_and_rename_the_test():
    out = symptoms(HIDDEN_REPORT, held_out=HELD)
    assert out == ["AssertionError: perimeter must be four sides", "assert 3 == (4 * 1)"]
    message = "E       NameError: name 'test_secret_perimeter' is not defined"
    assert symptoms(message, held_out=HELD) == ["NameError: name '<test>' is not defined"]
    quoting = "E       >   value = mod.perimeter_of_square(n)"  # a whole line of the test's code
    assert symptoms(quoting, ["    value = mod.perimeter_of_square(n)"]) == []


@pytest.mark.parametrize(
    "statement, leaked",
    [
        ("see test_mod.py::TestShape::test_secret_perimeter[2]", True),
        ("see TestShape::test_secret_perimeter", True),
        ("the test test_secret_perimeter fails", True),
        ("value = mod.perimeter_of_square(n)", True),  # a distinctive body line
        ("test_secret_perimeter_other fails", False),  # a longer name is another test
        ("value == 4 * n", False),  # too short to be distinctive
    ],
)
def test_held_out_mentions_finds_names_and_body_lines(snapshot, statement, leaked):
    assert bool(held_out_mentions(statement, HELD, held_out_source(snapshot, HELD))) is leaked


def test_a_statement_needs_a_failing_test():
    with pytest.raises(ValueError):
        write_statement("mod 1.0", {})


# --- every shipped task ---------------------------------------------------------------------

SHIPPED = load_repo_tasks("train") + load_repo_tasks("heldout")


def _names(node_id: str) -> set[str]:
    key = function_of(node_id)
    return {node_id} | ({key, key.split("::", 1)[1], key.rsplit("::", 1)[-1]} if key else set())


def test_no_shipped_statement_names_a_held_out_test():
    assert len(SHIPPED) == 571
    bad = []
    for task in SHIPPED:
        assert task.held_out_tests, task.id  # every shipped task holds some tests out
        for name in set().union(*map(_names, task.held_out_tests)):
            if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", task.problem_statement):
                bad.append((task.id, name))
    assert bad == []


def test_shipped_statements_still_describe_the_failure():
    """Each statement quotes visible output or the held-out tests' symptoms, or lists the
    visible failing tests to run."""
    for task in SHIPPED:
        s = task.problem_statement
        assert "Output of " in s or "The failing tests report:" in s or "Failing tests (" in s, (
            task.id
        )


def _built_repos() -> list[str]:
    from coderl.tasks.env import find_env

    out = []
    for pin in read_repos():
        own = [t for t in SHIPPED if repo_of(t) == pin.name]
        try:
            if own:
                find_env(own[0].env_id)
                out.append(pin.spec)
        except KeyError:
            continue
    return sorted(set(out) | {"six==1.17.0"})


@pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="building an environment needs bubblewrap and root (make sysdeps); CI has both",
)
@pytest.mark.parametrize("spec", _built_repos())
def test_no_shipped_statement_quotes_a_held_out_test_body(spec):
    from coderl.envbuild.build import build_env

    env = build_env(spec)  # cached: the environments the statements were written against
    tasks = [t for t in SHIPPED if t.env_id == env.env_id]
    assert tasks
    for task in tasks:
        source = held_out_source(Path(env.snapshot), task.held_out_tests)
        lines = {ln.strip() for ln in source if len(ln.strip()) >= MIN_BODY_LINE}
        assert [ln for ln in lines if ln in task.problem_statement] == [], task.id
