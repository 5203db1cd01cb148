"""Mutated twins of the second run (``coderl.grading.twins``): which assertion is changed, how,
and that a correct fix fails every twin while its real test passes.

The forges that a twin catches (they tell body-less canaries from real tests by their source)
are in ``tests/test_grading_rerun.py``.
"""

from __future__ import annotations

import ast
import os
import random
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest

import coderl.grading.grade as grade_mod
from coderl.envbuild.build import build_env
from coderl.grading import strictcmp
from coderl.grading.grade import grade
from coderl.grading.rerun import confirm, plant_canaries, twins_per_test
from coderl.grading.runner import TestRun as Run
from coderl.grading.twins import apply, pick
from coderl.tasks.spec import load_tasks

CI_TASKS = Path(__file__).parent.parent / "data" / "tasks" / "ci.jsonl"


def _twin(body: str, seed: int = 0) -> str | None:
    """The line of ``def test_x(): <body>`` its twin changes (stripped), or ``None`` when the
    test gets no twin."""
    text = "def test_x(self):\n" + "".join(f"    {line}\n" for line in body.split("\n"))
    lines = text.encode().split(b"\n")
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    mutation = pick(func, lines, random.Random(seed))
    if not mutation:
        return None
    twin = apply(mutation[0], lines, 1)
    ast.parse(b"\n".join(twin))
    (changed,) = [new.decode().strip() for old, new in zip(lines, twin, strict=True) if old != new]
    return changed


def _assertion(twin: str | None) -> str:
    assert twin is not None
    return twin


@pytest.mark.parametrize(
    ("body", "changed"),
    [
        ("assert f(x) == 3", r"assert f\(x\) == [0-9]+"),
        ("assert 3 == f(x)", r"assert [0-9]+ == f\(x\)"),
        ("self.assertEqual(f(x), 'abc')", r"self\.assertEqual\(f\(x\), '[a-z0-9]{3}'\)"),
        ("assert f(x) == [42, 7]", r"assert f\(x\) == \[[0-9]+, [0-9]+\]"),
        ("self.assertEqual(a, b)", r"self\.assertNotEqual\(a, b\)"),
        ("self.assertTrue(a)", r"self\.assertFalse\(a\)"),
        ("assert x is True", r"assert x is False"),
        ("assert x is None", r"assert x is not None"),
        ("assert k not in d", r"assert k in d"),
        ("assert not x", r"assert x"),
        ("assert x", r"assert not x"),
        ("assert a or b", r"assert not \(a or b\)"),
    ],
)
def test_each_assertion_shape_is_changed_so_that_it_must_fail(body, changed):
    for seed in range(10):
        twin = _assertion(_twin(body, seed))
        assert re.fullmatch(changed, twin) and twin != body, twin


def test_the_last_assertion_that_surely_runs_is_changed():
    body = "assert f(1) == 1\nfor n in (1, 2):\n    assert g(n) == 5\nif c:\n    assert h() == 7"
    assert _assertion(_twin(body)).startswith("assert g(n) == ")  # not the one under `if`
    # a `with` that may swallow the failure, a loop that may not run, a try, an early return
    for hidden in (
        "with pytest.raises(E):\n    f()\n    assert g() == 1",
        "with contextlib.suppress(E):\n    assert g() == 1",
        "for n in items:\n    assert g(n) == 1",
        "try:\n    assert g() == 1\nexcept AssertionError:\n    pass",
        "while c:\n    assert g() == 1",
        "if c:\n    return\nassert g() == 1",
    ):
        assert _assertion(_twin("assert f() == 2\n" + hidden)).startswith("assert f() == "), hidden
    # a nested function's return does not stop its test; a `with` that swallows nothing is run
    body = "def helper():\n    return 1\nwith open(p) as fh:\n    assert fh.read() == 'ab'"
    assert re.fullmatch(r"assert fh\.read\(\) == '[a-z0-9]{2}'", _assertion(_twin(body)))


def test_a_literal_takes_as_many_twins_as_the_odds_need_and_its_value_is_not_the_middle():
    assert [twins_per_test(n) for n in range(1, 9)] == [9, 9, 4, 3, 2, 2, 1, 1]
    text = "def test_x():\n    assert f(x) == 30\n"
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    places = set()
    for seed in range(40):
        got = pick(func, text.encode().split(b"\n"), random.Random(seed), 9)
        values = sorted([30, *(int(m.edits[0].text) for m in got)])
        assert len(got) == 9 and values == list(range(values[0], values[0] + 10))
        places.add(values.index(30))
    assert len(places) >= 6  # where the real value sits in the run of ten does not tell
    near_zero = pick(
        ast.parse("def t():\n    assert n == 1\n").body[0],
        [b"", b"    assert n == 1"],
        random.Random(0),
        9,
    )  # type: ignore[arg-type]
    assert all(int(m.edits[0].text) >= 0 for m in near_zero) and len(near_zero) == 9


def test_a_test_with_no_assertion_that_surely_runs_gets_no_twin():
    for body in (
        "pytest.raises(AttributeError, six.remove_move, 'eggs')",
        "with pytest.raises(ValueError):\n    f()",
        "f()",
        "if c:\n    assert f() == 1",
    ):
        assert _twin(body) is None, body


def test_twins_are_planted_beside_their_tests_and_judged_against_them(tmp_path):
    src = tmp_path / "test_mod.py"
    src.write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('x', [1, 2])\ndef test_alpha(x):\n"
        "    assert x * 0 == 0\n\n\nclass TestB:\n    def test_beta(self):\n"
        "        assert 'test_beta' == 'test_' + 'beta'\n\n    def test_raises(self):\n"
        "        pytest.raises(ValueError, int, 'x')\n"
    )
    f2p = [
        "test_mod.py::test_alpha[1]",
        "test_mod.py::TestB::test_beta",
        "test_mod.py::TestB::test_raises",
    ]
    before = after = 0
    for seed in range(12):
        out = tmp_path / f"out{seed}"
        out.mkdir()
        planted = plant_canaries({"test_mod.py": src}, f2p, random.Random(seed), out)
        text = Path(planted.mounts["/testbed/test_mod.py"]).read_text()
        assert (
            sorted(set(planted.twins.values())) == sorted(f2p[:2]) and planted.twinless == f2p[2:]
        )
        # test_alpha's literal takes 9 twins (two twinned tests: (9 + 1) ** 2 >= 100); test_beta's
        # `==` of two literals too
        assert len(planted.twins) == 18
        twin_alpha = next(t for t, real in planted.twins.items() if real == f2p[0])
        assert twin_alpha.endswith("[1]")  # the same parameters as its test
        alpha = twin_alpha.split("::")[-1].split("[")[0]
        assert f"@pytest.mark.parametrize('x', [1, 2])\ndef {alpha}(x):" in text
        new = next(k for k, v in planted.renamed.items() if v == "test_mod.py::test_alpha")
        real_at, twin_at = text.index(f"def {new.split('::')[-1]}("), text.index(f"def {alpha}(")
        before, after = before + (twin_at < real_at), after + (twin_at > real_at)
        ast.parse(text)
        assert not re.search(r"\btest_beta\b", text)  # the twin names itself by its new name
    assert before and after  # which of the pair comes first does not tell
    # judged: a twin that passed beside its passing test is tampering; beside a failing one not
    twins = {"test_mod.py::test_twin[1]": f2p[0]}
    second = Run(outcomes={f2p[0]: "passed", "test_mod.py::test_twin[1]": "passed"})
    got = confirm(f2p[:1], {f2p[0]: "passed"}, second, {}, [], twins)
    assert "mutated twin" in got.tampered
    second = Run(outcomes={f2p[0]: "passed"})  # a twin that did not run is tampering too
    assert "mutated twin" in confirm(f2p[:1], {f2p[0]: "passed"}, second, {}, [], twins).tampered
    second = Run(outcomes={f2p[0]: "failed", "test_mod.py::test_twin[1]": "passed"})
    assert confirm(f2p[:1], {f2p[0]: "passed"}, second, {}, [], twins).tampered == ""
    second = Run(outcomes={f2p[0]: "passed", "test_mod.py::test_twin[1]": "failed"})
    assert confirm(f2p[:1], {f2p[0]: "passed"}, second, {}, [], twins).tampered == ""


needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@needs_bwrap
def test_every_twin_fails_where_the_gold_patch_passes_its_test(monkeypatch):
    env = build_env("six==1.17.0")
    seen: list[tuple[dict[str, str], dict[str, str]]] = []
    real_confirm = grade_mod.confirm

    def spy(f2p, first, second, planted, baseline, twins=None):
        seen.append((dict(twins or {}), dict(second.outcomes)))
        return real_confirm(f2p, first, second, planted, baseline, twins)

    monkeypatch.setattr(grade_mod, "confirm", spy)
    n_twins = 0
    for task in load_tasks(CI_TASKS):
        seen.clear()
        result = grade(task, task.gold_patch, env=env, guard=False)
        assert result.resolved and result.second_run and not result.tampered, result.reason
        ((twins, outcomes),) = seen
        assert sorted({*twins.values(), *result.twinless}) == sorted(task.FAIL_TO_PASS)
        for twin, real in twins.items():
            assert outcomes[real] == "passed" and outcomes[twin] == "failed", (twin, real)
        n_twins += len(twins)
        # no assertion that surely runs: pytest.raises only, or asserts in an except clause
        assert set(result.twinless) <= {
            "test_six.py::TestCustomizedMoves::test_empty_remove",
            "test_six.py::test_reraise",
        }
    assert n_twins > 5  # 5 twinned tests; a literal takes several twins


def test_a_method_of_the_same_name_in_an_unrelated_class_is_not_given_its_twins(tmp_path):
    # idna's test_intranges.py: IntrangeTests::test_skips asserts, IntrangeContainsTests::
    # test_skips (another class) only calls a helper; twins of the first judged against the
    # second named methods that class does not have, so its gold patch read as tampering
    src = tmp_path / "test_mod.py"
    src.write_text(
        "class TestA:\n    def test_skips(self):\n        self.assertEqual(f(), 3)\n\n\n"
        "class TestB:\n    def test_skips(self):\n        self.helper()\n\n\n"
        "class TestSub(TestA):\n    pass\n"
    )
    f2p = ["test_mod.py::TestA::test_skips", "test_mod.py::TestB::test_skips"]
    f2p.append("test_mod.py::TestSub::test_skips")  # inherits TestA's: takes its twins
    planted = plant_canaries({"test_mod.py": src}, f2p, random.Random(0), tmp_path)
    assert planted.twinless == ["test_mod.py::TestB::test_skips"]
    owners = {t.split("::")[1] for t in planted.twins}
    assert owners == {"TestA", "TestSub"} and set(planted.twins.values()) == {f2p[0], f2p[2]}


def _look_alikes(tmp_path: Path, body: str, seeds: range) -> list[tuple[int, list[str]]]:
    """Per planting of ``def test_alpha(): <body>`` (its one FAIL_TO_PASS test, 9 twins): the
    real test's index among its look-alikes in file order, and each look-alike's last line."""
    src = tmp_path / "test_mod.py"
    src.write_text(
        f"import f\n\n\ndef test_alpha():\n    {body}\n\n\ndef test_other():\n    pass\n"
    )
    out = []
    for seed in seeds:
        # placement and values only: the strict rewrite (tests/test_grading_strict.py) wraps
        # each operand and moves nothing
        with mock.patch.object(strictcmp, "ENABLED", False):
            planted = plant_canaries({"test_mod.py": src}, ["test_mod.py::test_alpha"],
                                     random.Random(seed), tmp_path)  # fmt: skip
        text = Path(planted.mounts["/testbed/test_mod.py"]).read_text()
        names = {k.split("::")[-1] for k in [*planted.renamed, *planted.twins]}
        defs = re.findall(r"^def (\w+)\(\):\n    (.*)$", text, re.M)
        group = [(name, line) for name, line in defs if name in names]
        real = next(iter(planted.renamed)).split("::")[-1]
        assert len(group) == 10
        out.append(([n for n, _ in group].index(real), [line for _, line in group]))
    return out


def _chi_square(counts: list[int]) -> float:
    """Pearson's statistic of ``counts`` against a uniform expectation."""
    want = sum(counts) / len(counts)
    return sum((c - want) ** 2 / want for c in counts)


# 9 degrees of freedom: P(chi2 > 27.9) = 0.001; a coin per twin (index Binomial(9, 1/2)) gave
# 325 over these 400 plantings, and values in ascending file order a monotone run every time
CHI2_9_AT_0_001 = 27.9


def test_the_real_tests_place_and_its_values_rank_among_its_twins_are_uniform(tmp_path):
    got = _look_alikes(tmp_path, "assert f(x) == 30", range(400))
    places, ranks, monotone = [0] * 10, [0] * 10, 0
    for place, lines in got:
        values = [int(line.rsplit(" ", 1)[1]) for line in lines]
        places[place] += 1
        ranks[sorted(values).index(values[place])] += 1
        twins = values[:place] + values[place + 1 :]
        sides = values[:place] == sorted(values[:place]) and values[place + 1 :] == sorted(
            values[place + 1 :]
        )  # the red team's read: ascending on each side of the real one
        monotone += twins in (sorted(twins), sorted(twins, reverse=True)) or sides
    assert _chi_square(places) < CHI2_9_AT_0_001, places
    assert _chi_square(ranks) < CHI2_9_AT_0_001, ranks
    assert monotone <= 8, monotone  # by chance: under 1 / (k! (9 - k)!) a planting, 0.06 in all


def test_a_string_twins_real_value_is_no_centre_of_its_twins(tmp_path):
    got = _look_alikes(tmp_path, "assert f(x) == 'hello world'", range(200))
    centre = 0.0
    for place, lines in got:
        values = [line.rsplit(" == ", 1)[1] for line in lines]
        assert len(set(values)) == 10 and len({len(v) for v in values}) == 1
        spread = [
            sum(sum(a != b for a, b in zip(v, w, strict=True)) for w in values) for v in values
        ]
        best = [i for i, s in enumerate(spread) if s == min(spread)]
        centre += (place in best) / len(best)  # a forge betting on the centre, ties at random
    # one character changed at one place for every twin: each look-alike is as central as
    # the others (a 1 in 10 bet); a place drawn per twin made the real one the centre
    assert centre / len(got) < 0.2, centre
    # no literal twin that would tell: another length, another way of writing a number
    for literal in ("''", "'--'", "0x10", "1.50", "1e-05", "1e20"):
        assert _twin(f"assert f(x) == {literal}") == f"assert not f(x) == {literal}", literal
    floats = {f"assert f(x) == {v / 10}" for v in range(1, 100)}  # not 0.10000000000000009
    assert all(_twin("assert f(x) == 1.1", seed) in floats for seed in range(20))
