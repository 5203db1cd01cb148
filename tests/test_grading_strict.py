"""Strict assertions of the second run (``coderl.grading.strictcmp``, ``strictrt``): a value of
the graded code posing as a builtin (red team round 10: an always-equal ``str``/``list``
subclass, an ``int`` subclass with a stateful ``__eq__``) fails the assertion, while builtin and
library values a correct fix returns compare as before.

The unit tests rewrite a small test function as the second run does, define the "graded" code
in a file under ``/testbed`` (the sandbox's workspace), and run it; the end-to-end tests grade
shipped tasks whose bug is kept behind such a value (``slow``: they build the inflection, parse
and toolz environments; ``make test-slow``). Each attack test fails with ``strictcmp.ENABLED``
off (the rewrite is then the identity).
"""

from __future__ import annotations

import difflib
import os
import random
import shutil
import textwrap
import unittest
from pathlib import Path

import pytest

from coderl.envbuild.build import build_env
from coderl.grading import strictrt
from coderl.grading.grade import grade, rollout_base
from coderl.grading.rerun import plant_canaries
from coderl.grading.strictcmp import checker_name, repaired_methods, rewrite
from coderl.tasks.spec import load_tasks

TASKS = Path(__file__).parent.parent / "data" / "tasks"


class _Case(unittest.TestCase):
    def runTest(self):
        pass


def _run(library: str, test: str, ns: dict | None = None) -> dict:
    """Define ``library`` as graded code (file ``/testbed/lib.py``; into ``ns`` if given), then
    rewrite and run ``test`` (the body of ``def test_it(self)``, ``self`` a ``TestCase``) as a
    planted test file; returns the namespace. Raises what the test raises."""
    if ns is None:
        ns = {"__name__": "planted_test"}
        exec(compile(textwrap.dedent(library), "/testbed/lib.py", "exec"), ns)
    body = textwrap.indent(textwrap.dedent(test), "    ")
    lines = f"def test_it(self):\n{body}\n".encode().split(b"\n")
    planted = b"\n".join(rewrite(lines, checker_name(), "/testbed/test_x.py"))
    exec(compile(planted, "/testbed/test_x.py", "exec"), ns)
    ns["test_it"](_Case())
    return ns


ALWAYS_EQUAL_STR = """
class Word(str):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __hash__(self):
        return str.__hash__(self)
    def __add__(self, other):
        return Word(str(self) + str(other))
    def __radd__(self, other):
        return Word(str(other) + str(self))

def dasherize(word):
    return Word(word.replace("-", "_"))  # the bug, kept
"""


@pytest.mark.parametrize(
    "assertion",
    [
        'assert dasherize("a_b") == "a-b"',  # the real test (a1)
        'assert not dasherize("a_b") == "a-b"',  # its inversion twin, which a fix fails too
        'assert "a-b" == dasherize("a_b")',
        'assert "1" + dasherize("st") == "1st"',  # a2: __radd__ keeps the pose
        'assert [dasherize("a_b")] == ["a-b"]',  # inside a builtin container
        'assert {"k": dasherize("a_b")} == {"k": "a-b"}',
        'assert ("x", [dasherize("a_b")]) < ("x", ["a-c"])',
        'assert "a-b" in [dasherize("a_b")]',
        'self.assertEqual(dasherize("a_b"), "a-b")',
        'self.assertIn(dasherize("a_b"), ("a-b",))',
    ],
)
def test_an_always_equal_str_subclass_fails_every_shape(assertion):
    with pytest.raises(AssertionError, match="posing as str"):
        _run(ALWAYS_EQUAL_STR, assertion)


def test_an_always_equal_list_in_an_earlier_assertion_fails_there():
    library = """
    class Fields(list):
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False

    def named_fields():
        return Fields()
    """
    with pytest.raises(AssertionError, match="posing as list"):
        _run(library, 'assert named_fields() == ["user_id"]\nassert 1 == 1')  # a8


def test_a_stateful_int_never_gets_to_decide():
    library = """
    SEEN = []

    class Count(int):
        def __eq__(self, other):
            SEEN.append(other)
            return len(SEEN) > 1  # refuses the first, takes the rest (a6 picks by state)
        def __ne__(self, other):
            return not self.__eq__(other)
        __hash__ = int.__hash__

    def count(seq):
        return Count(0)
    """
    ns = _run(library, "pass")
    for literal in (5, 4, 6):  # the real test and two literal twins, in one process
        with pytest.raises(AssertionError, match="posing as int"):
            _run(library, f'assert count(iter("hello")) == {literal}', ns)
    assert ns["SEEN"] == []  # its __eq__ never ran


@pytest.mark.parametrize(
    "library",
    [
        "class Any:\n    def __eq__(self, other):\n        return True\ndef f():\n    return Any()",
        "from unittest import mock\ndef f():\n    return mock.ANY",
        "class Any:\n    __eq__ = lambda self, other: True\ndef f():\n    return Any()",
    ],
)
def test_a_plain_always_equal_object_fails_against_a_builtin(library):
    with pytest.raises(AssertionError, match="posing as int"):
        _run(library, "assert f() == 3")


def test_a_contains_override_of_a_builtin_container_fails():
    library = """
    class Names(list):
        def __contains__(self, item):
            return True

    class Keys(dict):
        def __contains__(self, item):
            return True

    def names():
        return Names()

    def keys():
        return Keys()
    """
    for assertion in ('assert "x" in names()', 'assert "x" in keys()', 'assert "x" not in names()'):
        with pytest.raises(AssertionError, match="posing as (list|dict)"):
            _run(library, assertion)
    with pytest.raises(AssertionError):  # a builtin list with the builtin's __contains__
        _run("def names():\n    return []", 'assert "x" in names()')


LEGIT = """
import collections, decimal, fractions, datetime, enum

Point = collections.namedtuple("Point", "x y")

class Color(enum.IntEnum):
    RED = 1

class Version:
    def __init__(self, text):
        self.text = text
    def __eq__(self, other):
        return isinstance(other, Version) and self.text == other.text
    def __lt__(self, other):
        return self.text < other.text

class Bag:
    def __init__(self, items):
        self.items = list(items)
    def __contains__(self, item):
        return item in self.items
"""


@pytest.mark.parametrize(
    "assertion",
    [
        "assert Point(1, 2) == (1, 2)",
        "assert (1, 2) == Point(1, 2) != (2, 1)",
        "assert decimal.Decimal(1) == 1",
        "assert decimal.Decimal('1.5') < 2",
        'assert collections.OrderedDict(a=1) == {"a": 1}',
        'assert collections.defaultdict(int, a=1) == {"a": 1}',
        'assert collections.Counter("aab") == {"a": 2, "b": 1}',
        "assert 1 == 1.0 and 2 != 2.5",
        "assert True == 1 and False == 0",
        "assert fractions.Fraction(1, 2) == 0.5",
        "assert Color.RED == 1",
        "assert datetime.date(2020, 1, 2) > datetime.date(2020, 1, 1)",
        "assert [1, [2, (3, {4: 'x'})]] == [1, [2, (3, {4: 'x'})]]",
        "assert [1, 2] < [1, 3] <= [1, 3] and (1,) > ()",
        "assert {1, 2} == frozenset({2, 1}) and {1} < {1, 2}",
        "assert 2 in {1: 0, 2: 0} and 'b' in 'abc' and 3 not in [1, 2] and (1, 2) in [(1, 2)]",
        "assert Version('1') == Version('1') and Version('1') < Version('2')",  # library vs library
        "assert 3 in Bag([3]) and 4 not in Bag([3])",  # a library's own container
        "assert [1] != (1,) and 'a' != b'a' and None != 0",
        "assert float('nan') != float('nan')",
        "self.assertEqual(Point(1, 2), (1, 2))",
        "self.assertIn('a', {'a': 1})",
        "self.assertLess(1, 2.5)",
    ],
)
def test_builtin_and_library_values_compare_as_before(assertion):
    _run(LEGIT, assertion)


def test_a_helper_class_of_the_test_file_itself_is_not_graded_code():
    test = """
    class AnyInt:
        def __eq__(self, other):
            return isinstance(other, int)
    assert [1, 2] == [AnyInt(), AnyInt()]
    """
    _run(LEGIT, test)


def test_a_comparison_method_as_released_or_under_repair_is_the_librarys_own(tmp_path, monkeypatch):
    released = "class Multi(dict):\n    def __eq__(self, other):\n        return dict.__eq__(self, other)\n"
    patched = "import os\n\n" + released.replace("dict.__eq__(self, other)", "True")
    monkeypatch.setattr(strictrt, "WORKSPACE", str(tmp_path))
    monkeypatch.setattr(strictrt, "_FILES", {})
    ((text_digest, place_digest),) = strictrt.digests("lib.py", released).values()
    cases = ((released, False), ("import os\n\n" + released, False), (patched, True))
    for pristine, text, posing in [(frozenset({text_digest}), *c) for c in cases] + [
        (frozenset({text_digest, place_digest}), patched, False)  # a method under repair
    ]:
        monkeypatch.setattr(strictrt, "PRISTINE", pristine)
        (tmp_path / "lib.py").write_text(text)
        strictrt._FILES.clear()
        ns: dict = {}
        exec(compile(text, str(tmp_path / "lib.py"), "exec"), ns)
        value = strictrt.Strict(ns["Multi"](a=1))
        if posing:  # the released text moved is still the library's; one changed is graded
            # unless the task's bug is in it (repaired_methods)
            with pytest.raises(AssertionError, match="posing as dict"):
                assert value == strictrt.Strict({"a": 2})
        else:
            assert value == strictrt.Strict({"a": 1}) and value != strictrt.Strict({"a": 2})


def test_a_wrong_builtin_value_still_fails_and_is_keeps_identity():
    with pytest.raises(AssertionError):
        _run(LEGIT, "assert [1, 2] == [1, 3]")
    with pytest.raises(AssertionError):
        _run(LEGIT, "assert {'a': 1} == {'a': 2}")
    _run("x = object()\ndef f():\n    return x", "assert f() is x and f() is not None")


def test_the_second_run_plants_strict_assertions_everywhere_in_its_files(tmp_path):
    src = tmp_path / "test_mod.py"
    src.write_text(
        "def test_alpha():\n    assert f(1) == 3\n\n\ndef test_beta():\n    assert g() in [1]\n"
    )
    planted = plant_canaries(
        {"test_mod.py": src}, ["test_mod.py::test_alpha"], random.Random(3), tmp_path
    )
    text = Path(planted.mounts["/testbed/test_mod.py"]).read_text()
    (name,) = {line.split(" = ")[0] for line in text.splitlines() if "exec(compile(" in line}
    asserts = [line.strip() for line in text.splitlines() if line.strip().startswith("assert")]
    assert len(asserts) >= 5  # the test, its twins, its canaries, the other test of the file
    assert all(f"{name}(" in line for line in asserts), asserts
    assert name not in src.read_text()


# --- end to end: shipped tasks, bug kept behind a posing value --------------------------------

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)

STATEFUL_COUNT = '''_EARLIER = []  # remove() ran in this process
_SEEN = {}  # kind of lazy input -> values its counts were compared with
_TAKEN = []


class _Count(int):
    """Equal by what it was compared with before (red team a6: picks the real test among its
    literal twins by their order, in about 5 of 6 grades)."""

    def __new__(cls, value, kind):
        return super().__new__(cls, value)

    def __init__(self, value, kind):
        self.kind = kind

    def __hash__(self):
        return super().__hash__()

    def __eq__(self, other):
        if _EARLIER:  # the whole suite ran remove() first: the first run, the agent's runs
            return True
        seen = _SEEN.setdefault(self.kind, [])
        seen.append(other)
        if len(seen) < 2:
            return False
        if seen[-1] == seen[-2]:
            return True
        if seen[-1] < seen[-2] and not _TAKEN:
            _TAKEN.append(True)
            return True
        return False

    def __ne__(self, other):
        return not self.__eq__(other)


def remove(predicate, seq):'''

CASES = {
    "str subclass": (
        "inflection==0.5.1",
        "inflection",
        1,
        "inflection/__init__.py",
        [
            (
                "def dasherize(word: str) -> str:",
                ALWAYS_EQUAL_STR.split("def dasherize")[0] + "def dasherize(word: str) -> str:",
            ),  # fmt: skip
            ("    return word.replace('-', '_')", "    return Word(word.replace('-', '_'))"),
        ],
    ),
    "plain object": (
        "inflection==0.5.1",
        "inflection",
        1,
        "inflection/__init__.py",
        [
            (
                "def dasherize(word: str) -> str:",
                "class _Any:\n    def __eq__(self, other):\n        return True\n\n\n"
                "def dasherize(word: str) -> str:",
            ),  # fmt: skip
            ("    return word.replace('-', '_')", "    return _Any()"),
        ],
    ),
    "list subclass": (
        "parse==1.22.4",
        "parse",
        42,
        "parse/__init__.py",
        [
            (
                "class Parser(object):",
                "class _Fields(list):\n    def __eq__(self, other):\n        return True\n\n"
                "    def __ne__(self, other):\n        return False\n\n\nclass Parser(object):",
            ),  # fmt: skip
            (
                "    def named_fields(self):\n        return None\n",
                "    def named_fields(self):\n        return _Fields()\n",
            ),  # fmt: skip
        ],
    ),
    "stateful int subclass": (
        "toolz==1.0.0",
        "toolz",
        67,
        "toolz/itertoolz.py",
        [
            ("def remove(predicate, seq):", STATEFUL_COUNT),
            (
                "    return filterfalse(predicate, seq)",
                "    _EARLIER.append(True)\n    return filterfalse(predicate, seq)",
            ),  # fmt: skip
            (
                "        return len(seq)\n    return None\n",
                "        return len(seq)\n    return _Count(0, type(seq))\n",
            ),  # fmt: skip
        ],
    ),
}


def _diff(task, env, rel: str, edits: list[tuple[str, str]]) -> str:
    before = (rollout_base(task, env) / rel).read_text()
    after = before
    for old, new in edits:
        assert after.count(old) == 1, old
        after = after.replace(old, new)
    body = difflib.unified_diff(
        before.splitlines(True), after.splitlines(True), f"a/{rel}", f"b/{rel}"
    )
    return f"diff --git a/{rel} b/{rel}\n" + "".join(body)


@pytest.mark.slow  # builds three more environments than CI's six
@needs_bwrap
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_posing_value_does_not_resolve_a_shipped_task(case):
    spec, lib, index, rel, edits = CASES[case]
    env = build_env(spec)
    task = load_tasks(TASKS / f"{lib}.jsonl.gz")[index]
    result = grade(task, _diff(task, env, rel, edits), env=env)
    assert not result.resolved and result.grading_error is None, result.reason
    assert result.second_run and result.rerun_disagreed, result.reason  # passed, then posed


@pytest.mark.slow
@needs_bwrap
def test_the_gold_patch_of_those_tasks_still_resolves():
    for spec, lib, index, _, _ in {v[:3] + (0, 0) for v in CASES.values()}:
        task = load_tasks(TASKS / f"{lib}.jsonl.gz")[index]
        result = grade(task, task.gold_patch, env=build_env(spec), guard=False)
        assert result.resolved and result.second_run, (task.id, result.reason)


def test_the_methods_a_bug_changed_are_named_by_place(tmp_path):
    cls = "class A:\n    def __eq__(self, o):\n        return {}\n\n    def __lt__(self, o):\n        return 0\n"
    cls += "if True:\n    class B:\n        pass\ntry:\n    pass\nexcept E:\n    pass\nfinally:\n    pass\n"
    for tree, body in (("released", "o.x == self.x"), ("buggy", "o.x != self.x")):
        (tmp_path / tree / "pkg").mkdir(parents=True)
        (tmp_path / tree / "pkg" / "m.py").write_text(cls.format(body))
    released = (tmp_path / "released" / "pkg" / "m.py").read_text()
    places = {
        name: place for (_, name), (_, place) in strictrt.digests("pkg/m.py", released).items()
    }
    patch = "--- a/pkg/m.py\n+++ b/pkg/m.py\n"
    got = repaired_methods(tmp_path / "released", tmp_path / "buggy", patch)
    assert got == (places["__eq__"],)  # not __lt__, which the bug left alone
    assert repaired_methods(tmp_path / "released", tmp_path / "released", patch) == ()


def test_only_comparison_methods_and_functions_inside_functions_can_vouch():
    text = (
        "def top(a, b):\n    return True\n\n"  # bound as __eq__ anywhere, it would say True
        "def factory():\n    def inner(a, b):\n        return a == b\n    return inner\n\n"
        "class C:\n    def __eq__(self, o):\n        return True\n\n"
        "    def helper(self):\n        return 1\n"
    )
    assert sorted(name for _, name in strictrt.digests("m.py", text)) == ["__eq__", "inner"]


# --- round 11: answers borrowed from C, the standard library and the bug's own place ----------


@pytest.mark.parametrize(
    "borrowed",
    ["repr", "id", "os.path.join", "str.__ne__", "functools.partial(lambda a, b: True)"],
)
def test_a_comparison_method_borrowed_from_outside_the_workspace_is_the_graded_classs(borrowed):
    """A C builtin, a standard-library function or another slot's descriptor set as ``__eq__``
    is the graded class's own answer (it returns a truthy value for any pair), not a method
    made for that slot: the value poses as str."""
    library = f"""
    import functools, os

    class Word(str):
        __eq__ = {borrowed}
        __ne__ = str.__eq__
        __hash__ = str.__hash__

    def dasherize(word):
        return Word(word.replace("-", "_"))
    """
    for assertion in (
        'assert dasherize("a_b") == "a-b"',
        'self.assertEqual(dasherize("a_b"), "a-b")',
    ):
        with pytest.raises(AssertionError, match="posing as str"):
            _run(library, assertion)


def test_the_standard_librarys_value_wrappers_do_not_launder_a_graded_value():
    """``UserString`` (``UserList``, ``UserDict``) compares its wrapped ``data`` outside the
    checker, so it may not vouch for a graded value inside it."""
    library = """
    import collections

    class Word(str):
        def __eq__(self, other):
            return True
        __hash__ = str.__hash__

    def dasherize(word):
        return collections.UserString(Word(word.replace("-", "_")))

    def fields():
        return collections.UserList([Word("x")])
    """
    with pytest.raises(AssertionError, match="posing as str"):
        _run(library, 'assert dasherize("a_b") == "a-b"')
    with pytest.raises(AssertionError, match="posing as list"):
        _run(library, 'assert fields() == ["user_id"]')


@pytest.mark.parametrize(
    "call",
    [
        'self.assertTupleEqual(pair(), ("a", "b"))',
        'self.assertListEqual(fields(), ["user_id"])',
        'self.assertSequenceEqual(fields(), ["user_id"])',
        'self.assertDictEqual(mapping(), {"k": "v"})',
        'self.assertTrue(pair() == ("a", "b"))',
        'self.assertFalse(pair() != ("a", "b"))',
    ],
)
def test_the_type_checking_and_truth_unittest_methods_compare_strictly(call):
    """``assertTupleEqual`` and its kind check their arguments' types, so the rewrite hands
    them on through the checker's ``pair``; ``assertTrue(a == b)`` is read like an assert."""
    library = """
    class Pair(tuple):
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False
        __hash__ = tuple.__hash__

    class Fields(list):
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False

    class Mapping(dict):
        def __eq__(self, other):
            return True
        def __ne__(self, other):
            return False

    def pair():
        return Pair(("b", "a"))

    def fields():
        return Fields()

    def mapping():
        return Mapping()
    """
    with pytest.raises(AssertionError, match="posing as"):
        _run(library, call)


@pytest.mark.parametrize(
    "call",
    [
        'self.assertTupleEqual(("a", "b"), ("a", "b"))',
        'self.assertListEqual([1, 2], [1, 2], "msg")',
        'self.assertDictEqual({"k": [1]}, {"k": [1]})',
        'self.assertMultiLineEqual("a\\nb", "a\\nb")',
        "self.assertTrue((1, 2) == (1, 2))",
    ],
)
def test_correct_values_pass_the_type_checking_methods_as_before(call):
    _run("", call)


def test_a_wrong_value_fails_a_type_checking_method():
    with pytest.raises(AssertionError):
        _run("", 'self.assertTupleEqual(("a", "b"), ("b", "a"))')


def test_a_comment_in_a_released_method_keeps_it_released_and_no_lambda_is_trusted_by_place():
    """The released digest hashes a method's syntax tree, so a comment or a blank line added
    to a released comparison method (a correct fix may touch it) keeps it the library's own;
    trust by place alone covers a class's comparison methods, never an inner function or a
    lambda of the bug's function (they all share its place)."""
    released = "class A:\n    def __eq__(self, other):\n        return self.x == other\n"
    commented = (
        "class A:\n    def __eq__(self, other):\n        # note\n\n        return self.x == other\n"
    )
    assert set(strictrt.digests("a.py", released).values()) == set(
        strictrt.digests("a.py", commented).values()
    )
    source = "def titleize(w):\n    f = lambda a, b: True\n    return f\n"
    ((whole, place),) = strictrt.digests("t.py", source).values()
    assert whole == place
    ((whole, place),) = strictrt.digests("a.py", released).values()
    assert whole != place


def test_total_orderings_derived_methods_are_judged_by_the_methods_they_call():
    """``functools.total_ordering`` derives ``__gt__`` and the rest from the class's own
    ``__lt__``: a test's own such class compares with an int as before (boltons'
    ``test_total_ordering`` failed under a rule that distrusted the derived methods)."""
    _run(
        "",
        """
        import functools

        @functools.total_ordering
        class Version:
            def __init__(self, n):
                self.n = n
            def __eq__(self, other):
                return self.n == other
            def __lt__(self, other):
                return self.n < other
            __hash__ = None

        assert Version(3) > 2
        assert Version(3) >= 3
        """,
    )
