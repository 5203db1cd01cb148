"""Strict assertions in the second run: no value of the graded code decides a comparison with a
builtin value.

Why. A twin (``coderl.grading.twins``) must fail wherever its test passes, but an object that
equals everything passes a test and its twins alike where the twin is an inversion (``assert
not f(x) == y``: the object fails it as a real fix would) or where the twin changes a later
assertion than the one the bug shows in. Red team round 10 (``docs/tasks-and-grading.md``)
resolved three unfixed tasks that way with the guard on: a ``str`` subclass whose ``__eq__``
returns True (inflection, parametrized tests), an always-equal ``list`` subclass in an earlier
assertion (parse), and an ``int`` subclass whose ``__eq__`` keeps state and so picks the real
test among its literal twins (toolz). All are a value posing as a builtin: the test wrote the
expected value down as a builtin, and the graded code's own method decided that it matched.

What. In the second run (only: the planted copies of the FAIL_TO_PASS test files that
``coderl.grading.rerun.plant_canaries`` writes), :func:`rewrite` wraps each operand of every
comparison in an ``assert`` statement (``==``, ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``,
``not in``; chains too; not a comparison holding ``is``, where no method decides) and the two
compared arguments of ``self.assertEqual``-like calls (:data:`METHODS`) in a call of the checker
``coderl.grading.strictrt.Strict``, whose source is defined at the top of the file (after its
docstring and ``__future__`` imports) under a name drawn per
grade (:func:`checker_name`: code under test cannot name it before it exists, and nothing of it
is in the workspace). The checker's rule is in ``strictrt``'s doc: builtin semantics between
builtin values, recursively through containers; a failure ("a value posing as <type>") where a
method of the graded code would decide against a builtin value; Python's own comparison
everywhere else. Every function of the planted file is rewritten (the renamed tests, their
twins, the canaries, helpers of the file), so the rewrite tells no test from a canary; the
second run selects only FAIL_TO_PASS tests, twins and canaries, so no PASS_TO_PASS test runs
under it, and the first run never does.

Not defended: ``assert x`` and other truthiness (``__bool__``, ``__len__``), a value compared
with a non-builtin one (a library's object, a ``Decimal``), membership in a container type the
library defines, assertions in helpers outside the planted file (conftest, a helper module),
a test file that takes no canary (the second run then has no planted file), and code that
reaches the test module's globals and replaces the checker (the static guard bounds that).
"""

from __future__ import annotations

import ast
import functools
import re
import secrets
from pathlib import Path

from coderl.grading.pyparse import parse_python
from coderl.grading.strictrt import digests

ENABLED = True
"""Whether :func:`rewrite` rewrites (tests switch it off to show what it defends)."""

METHODS = frozenset(
    {
        "assertEqual",
        "assertEquals",
        "assertNotEqual",
        "assertNotEquals",
        "assertIn",
        "assertNotIn",
        "assertLess",
        "assertLessEqual",
        "assertGreater",
        "assertGreaterEqual",
    }
)
"""``unittest`` assertion methods whose first two arguments the rewrite wraps (they only
compare them with one operator, which then reaches the checker)."""
TYPED = frozenset(
    {
        "assertTupleEqual",
        "assertListEqual",
        "assertSequenceEqual",
        "assertDictEqual",
        "assertSetEqual",
        "assertMultiLineEqual",
    }
)
"""``unittest`` equality methods that check their arguments' types first, so they cannot take
wrapped operands: their two arguments go through the checker's ``pair`` (equal by the strict
rule, else an ``AssertionError``), which hands them on unchanged:
``self.assertTupleEqual(*CHECKER.pair(a, b), msg)``."""
TRUTH = frozenset({"assertTrue", "assertFalse", "assert_", "failUnless", "failIf"})
"""``unittest`` methods whose first argument is read like an ``assert``'s test: the comparisons
in it are wrapped (``self.assertTrue(a == b)``)."""

RUNTIME = Path(__file__).with_name("strictrt.py")
"""The checker's source (``coderl.grading.strictrt``), embedded in each planted file."""


def checker_name() -> str:
    """A fresh name for the checker in one grade's planted files (64 random bits)."""
    return "_" + "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(14))


MAX_FILE = 2 * 1024**2
"""Largest released file whose comparison methods :func:`released_methods` reads."""


def released_methods(test_file: Path, rel: str) -> tuple[str, ...]:
    """Digests (``strictrt.digests``) of the comparison methods of every Python file of the tree
    that holds ``test_file`` at ``rel`` (the released snapshot for a pristine test file);
    cached per tree."""
    root = str(test_file)[: -len(rel)] if str(test_file).endswith(rel) else ""
    return _released(root) if root else ()


@functools.lru_cache(maxsize=64)
def _released(root: str) -> tuple[str, ...]:
    out: set[str] = set()
    for path in sorted(Path(root).rglob("*.py")):
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE:
                continue
            text = path.read_bytes().decode("utf-8", "surrogateescape")
            out |= {d for d, _ in digests(path.relative_to(root).as_posix(), text).values()}
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    return tuple(sorted(out))


@functools.lru_cache(maxsize=256)
def repaired_methods(released: Path, buggy: Path, bug_patch: str) -> tuple[str, ...]:
    """Place digests (``strictrt.digests``) of the comparison methods of the files ``bug_patch``
    changes whose text differs between the ``released`` tree and the ``buggy`` one (the task's
    bug is in them, so a fix rewrites them and their text cannot vouch for them). Cached per
    task: both trees are read-only caches (the environment's snapshot, the rollout base)."""
    out: set[str] = set()
    for rel in sorted(set(re.findall(r"^\+\+\+ b/(\S+)", bug_patch, re.M))):
        try:
            old = digests(rel, (released / rel).read_bytes().decode("utf-8", "surrogateescape"))
            new = digests(rel, (buggy / rel).read_bytes().decode("utf-8", "surrogateescape"))
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        before = {place: text for text, place in old.values()}
        after = {place: text for text, place in new.values()}
        out |= {place for place, text in before.items() if after.get(place) != text}
    return tuple(sorted(out))


def _in_functions(tree: ast.Module) -> list[ast.stmt]:
    """The ``assert`` statements and expression statements inside any function of ``tree``
    (statement lists only: expressions hold no statement, so they are not walked)."""
    out: list[ast.stmt] = []
    todo: list[tuple[list[ast.AST], bool]] = [(list(tree.body), False)]
    while todo:
        body, inside = todo.pop()
        for node in body:
            if inside and isinstance(node, (ast.Assert, ast.Expr)):
                out.append(node)
            deeper = inside or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for name in ("body", "orelse", "finalbody", "handlers", "cases"):
                sub = getattr(node, name, None)
                if isinstance(sub, list):
                    todo.append((sub, deeper))
    return out


def _method_call(stmt: ast.stmt, names: frozenset[str], count: int) -> ast.Call | None:
    """``stmt`` as ``self.<one of names>(...)`` with at least ``count`` plain leading
    arguments, or None."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in names
        and len(call.args) >= count
        and not any(isinstance(a, ast.Starred) for a in call.args[:count])
    ):
        return call
    return None


def _pair(stmt: ast.stmt) -> tuple[ast.expr, ast.expr] | None:
    """The two arguments of a :data:`TYPED` call in ``stmt``, or None."""
    call = _method_call(stmt, TYPED, 2)
    return (call.args[0], call.args[1]) if call else None


def _operands(stmt: ast.stmt) -> list[tuple[ast.expr, int]]:
    """``(operand, depth)`` to wrap in ``stmt`` (module doc); depth orders nested wraps."""
    if isinstance(stmt, ast.Expr):
        call = _method_call(stmt, METHODS, 2)
        if call:
            return [(call.args[0], 0), (call.args[1], 0)]
        call = _method_call(stmt, TRUTH, 1)
        if not call:
            return []
        test: ast.expr = call.args[0]
    elif isinstance(stmt, ast.Assert):
        test = stmt.test
    else:
        return []
    out: list[tuple[ast.expr, int]] = []
    todo: list[tuple[ast.AST, int]] = [(test, 0)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (ast.JoinedStr, ast.Yield, ast.YieldFrom)):
            continue  # f-string positions are unreliable before 3.12; f(yield x) is no syntax
        if isinstance(node, ast.Compare) and not any(
            isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops
        ):
            out += [(side, depth + 1) for side in [node.left, *node.comparators]]
        todo += [(child, depth + 1) for child in ast.iter_child_nodes(node)]
    return out


def rewrite(
    lines: list[bytes], name: str, path: str = "", released: tuple[str, ...] = ()
) -> list[bytes]:
    """``lines`` (a planted test file split at ``\\n``) with every comparison of its functions'
    assertions made strict (module doc) and the checker defined first as ``name``;
    ``lines`` unchanged when :data:`ENABLED` is off or the text does not parse. ``path``: the
    file's sandbox path, whose own classes (a test's helper with an ``__eq__``) are not graded
    code; ``released``: :func:`released_methods`, the library's own methods as released."""
    if not ENABLED:
        return lines
    try:
        tree = parse_python(b"\n".join(lines), "<planted>")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return lines
    inserts: dict[int, list[tuple[int, int, int, bytes]]] = {}
    for stmt in _in_functions(tree):
        pair = _pair(stmt)
        if pair and pair[1].end_lineno is not None and pair[1].end_col_offset is not None:
            first, second = pair
            opening = (first.col_offset, 1, 0, b"*" + name.encode() + b".pair(")
            inserts.setdefault(first.lineno, []).append(opening)
            inserts.setdefault(second.end_lineno, []).append((second.end_col_offset, 0, 0, b")"))
        for node, depth in _operands(stmt):
            end, end_col = node.end_lineno, node.end_col_offset
            if end is None or end_col is None:
                continue
            opening = (node.col_offset, 1, depth, name.encode() + b"(")
            inserts.setdefault(node.lineno, []).append(opening)
            inserts.setdefault(end, []).append((end_col, 0, -depth, b")"))
    out = list(lines)
    for number, edits in inserts.items():
        line, pieces, at = out[number - 1], [], 0
        for col, _, _, text in sorted(edits):  # closings, then openings outermost first
            pieces += [line[at:col], text]
            at = col
        out[number - 1] = b"".join([*pieces, line[at:]])
    source = ascii(RUNTIME.read_text(encoding="utf-8"))
    define = (
        f"{name} = (lambda ns: (exec(compile({source}, {name!r}, 'exec'), ns), "
        f"ns['checker'](({path!r},), {released!r}))[1])({{'__name__': {name!r}}})"
    ).encode()
    at = _head(tree, lines)
    return [*out[:at], define, *out[at:]]


def _head(tree: ast.Module, lines: list[bytes]) -> int:
    """How many lines of the file come before the checker's definition: its docstring and
    ``from __future__`` imports (which must come first), and a coding line (which must stay in
    the first two). The definition goes before anything else runs: a test module may call its
    own functions while it is imported."""
    at = 0
    for i, stmt in enumerate(tree.body):
        docstring = i == 0 and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        future = isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__"
        if not (docstring or future):
            break
        at = stmt.end_lineno or at
    return max(at, *(n + 1 for n, line in enumerate(lines[:2]) if line.startswith(b"#")), 0)
