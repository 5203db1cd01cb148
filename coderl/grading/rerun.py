"""The second run: a repository task's FAIL_TO_PASS tests again, where the first run cannot reach.

Why. In the graded run (``coderl.grading.grade``) the outcome of each test is decided by objects
in the pytest worker: the results plugin's mapping, its canary ids, the event token. Code under
test that reaches that memory can replace the mapping with one that reports every test passed
except the canaries, whose ids the plugin holds (red team g25x; with the static detector off this
resolves an unfixed task). A FAIL_TO_PASS test therefore counts as passed only when it passed
in the first run *and* in a second one that:

- runs in a fresh sandbox (a new process tree, nothing writable shared with the first run, no
  network), with a new MAC key, event token and canaries drawn for it;
- selects only the FAIL_TO_PASS tests (visible and held out) and its canaries;
- plants its canaries in the test files themselves (:func:`plant_canaries`): ordinary test
  functions named like the file's tests, at top-level boundaries among the FAIL_TO_PASS tests,
  listed in the selection with them in a random order. The worker is never told which tests are
  canaries (the observer sends it none), so nothing in its memory separates a canary from a
  held-out FAIL_TO_PASS test: not the plugin's state, not the selection, not the test files on
  disk, not the tests' positions. Enough of them must fail that passing a random subset of the
  right size is a 1-in-100 bet (:func:`fail_canaries`).

:func:`confirm` merges the two runs. A FAIL_TO_PASS test whose pass/fail differs between them is
a finding (``GradeResult.rerun_disagreed``), the test counts as failed; a planted canary with
the wrong outcome, or a tripwire of the plugin, is tampering.

The real FAIL_TO_PASS tests are renamed in the second run (:func:`plant_canaries`), so names
do not tell them from canaries either. The canaries' bodies are a fixed, recognisable shape (a
sum of a repeated list), so code in the second worker that reads each test's source can tell
them apart; beside each renamed test the second run therefore also plants mutated twins
(``coderl.grading.twins``): copies of the test's own source that must fail, so a forge that
passes what calls the library passes them too (tampering); the twin check
(``coderl.grading.twincheck``) drops, per task and ahead of grading, the twins that break its
gold patch by a side effect in the shared process. Not defended: a test without a twin
(``Planted.twinless``), a forge that carries the visible tests' sources (only the held-out
tests' twins bet against it, :func:`twins_per_test`), and code that reaches the second worker's
memory and forges its own events after telling twins apart; the static guard
(``coderl.grading.diffguard``) bounds those. A test file the host cannot parse, or whose name
pytest would not collect tests from, gets no planted canary; when no file can take one the
second run gets its canaries from the observer as the first run does.
"""

from __future__ import annotations

import ast
import functools
import math
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from coderl.grading.pyparse import parse_python
from coderl.grading.runner import Canary, TestRun, make_canaries, tampering
from coderl.grading.strictcmp import checker_name, released_methods, rewrite
from coderl.grading.twins import Mutation, apply, mutations, pick

PASS_CANARIES = 2
"""Must-pass canaries planted in a second run (they catch a worker that fails everything)."""
MIN_FAIL_CANARIES = 3
"""Fewest must-fail canaries planted in a second run (:func:`fail_canaries`)."""
GUESS_ODDS = 100
"""A forge that cannot tell canaries from FAIL_TO_PASS tests and passes a random subset of the
right size resolves at most once in this many tries (:func:`fail_canaries`)."""
MAX_TWINS = 9
"""Most mutated twins planted per FAIL_TO_PASS test (:func:`twins_per_test`)."""


def fail_canaries(n_tests: int) -> int:
    """Must-fail canaries for ``n_tests`` FAIL_TO_PASS tests: the fewest ``k >= 3`` with
    ``C(n + k, k) >= GUESS_ODDS``, so passing exactly ``n`` of the ``n + k`` chosen at random
    passes the real ones with probability ``1 / C(n + k, k) <= 1%`` (99 for one test, 13 for
    two, 7 for three, 5 for four, 4 for five or six, 3 from seven on)."""
    k = MIN_FAIL_CANARIES
    while math.comb(n_tests + k, k) < GUESS_ODDS:
        k += 1
    return k


_TEST_MODULE = re.compile(r"(^test_.*|.*_test)\.py$")


@dataclass
class Planted:
    """Canaries written into copies of the test files of a second run."""

    mounts: dict[str, str] = field(default_factory=dict)
    """Sandbox path (``/testbed/<file>``) -> host path of the file with canaries in it, mounted
    read-only over the pristine one."""
    expected: dict[str, str] = field(default_factory=dict)
    """Canary node id -> the outcome it must have (``passed`` or ``failed``)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """A renamed FAIL_TO_PASS test's node id in the second run (without parameters) -> its
    published one."""
    twins: dict[str, str] = field(default_factory=dict)
    """A mutated twin's node id (parameters included) -> the published FAIL_TO_PASS id it is a
    twin of (``coderl.grading.twins``): it must fail wherever that test passes."""
    twinless: list[str] = field(default_factory=list)
    """Published FAIL_TO_PASS ids that got no twin (no assertion that surely runs could be
    changed, the test kept its name, its file took no canary, or the twin check dropped its
    twins: :attr:`TwinPolicy.untwinned`)."""


@dataclass(frozen=True)
class TwinPolicy:
    """How a second run plants mutated twins (:func:`plant_canaries`)."""

    untwinned: frozenset[str] = frozenset()
    """Published FAIL_TO_PASS ids that get no twin (their twins break the gold patch:
    ``coderl.grading.twincheck``); every test of the same file and name goes without."""
    side: str = ""
    """``"before"`` or ``"after"``: every twin on that side of its test (the twin check's two
    orders); ``""``: a uniform split (grading, :meth:`sides`)."""

    def sides(self, count: int, rng: random.Random) -> list[bool]:
        """Whether each of a test's ``count`` twins (in ``twins.pick``'s shuffled order) goes
        after it: the first ``k`` before, the rest after, ``k`` uniform in ``0..count``, so
        the test's place among its ``count + 1`` look-alikes in file order is uniform (a coin
        per twin made it binomial, the middle places likeliest). :attr:`side` fixes ``k``; it
        is drawn either way, so the rest of the run's draws do not move."""
        drawn = rng.randint(0, count)
        before = {"before": count, "after": 0}.get(self.side, drawn)
        return [i >= before for i in range(count)]


@dataclass
class Confirmed:
    """The merged verdict of the two runs on the FAIL_TO_PASS tests (:func:`confirm`)."""

    outcomes: dict[str, str]
    """FAIL_TO_PASS id -> ``passed`` only when both runs passed it; else the failing run's."""
    disagreed: list[str]
    """``"<id>: <first> then <second>"`` for each test passed in one run and not the other."""
    tampered: str = ""
    """Why the second run looks tampered with (a canary, a tripwire), or ``""``."""
    twins_not_failed: list[str] = field(default_factory=list)
    """FAIL_TO_PASS ids that passed the second run while a twin of theirs did not fail."""


@functools.lru_cache(maxsize=256)
def _layout(path: str, size: int, mtime_ns: int) -> tuple[tuple[int, ...], frozenset[str]] | None:
    """``(first line of each top-level statement + the line after the last, names bound at top
    level)`` of the Python file at ``path`` (1-based lines); ``None`` when it cannot take a
    canary (it does not parse, or has a line break Python counts and ``\\n`` splitting does not).
    Cached by size and mtime: pristine test files do not change."""
    data = Path(path).read_bytes()
    if b"\r" in data.replace(b"\r\n", b"") or b"\f" in data:
        return None
    try:
        tree = parse_python(data, path)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    starts: list[int] = []
    names: set[str] = set()
    for stmt in tree.body:
        decorators = getattr(stmt, "decorator_list", [])
        starts.append(min([stmt.lineno, *(d.lineno for d in decorators)]))
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(stmt.name)
    end = (tree.body[-1].end_lineno or 0) + 1 if tree.body else 1
    return (*starts, end), frozenset(names)


def _top_level_index(starts: tuple[int, ...], name: str, source: list[bytes]) -> int | None:
    """Index of the top-level statement that defines ``name`` (a test function or class)."""
    pattern = re.compile(rb"^(async\s+def|def|class)\s+" + re.escape(name.encode()) + rb"\b")
    for i, start in enumerate(starts[:-1]):
        stop = starts[i + 1] - 1
        if any(pattern.match(line) for line in source[start - 1 : stop]):
            return i
    return None


@dataclass
class _File:
    """One test file's plan in a second run: its lines, where canaries may go, what to rename."""

    lines: list[bytes]
    slots: dict[str | None, list[tuple[int, bytes]]]
    """Class name (``None``: top level) -> ``(line, indentation)`` a canary may go before."""
    renames: dict[int, tuple[str, str]] = field(default_factory=dict)
    """Line of a ``def`` -> ``(old name, class or "")`` of a FAIL_TO_PASS test to rename (every
    mention of the name in the file is renamed)."""
    defs: dict[int, ast.FunctionDef | ast.AsyncFunctionDef] = field(default_factory=dict)
    """Line of a ``def`` of :attr:`renames` -> its node (for its twin)."""
    twins: dict[int, list[tuple[Mutation, str, bool]]] = field(default_factory=dict)
    """Line of a ``def`` of :attr:`renames` -> its twins' ``(mutation, name, after the test?)``."""
    classes: dict[str, tuple[list[str], set[str]]] = field(default_factory=dict)
    """Top-level class -> (its bases' plain names, the names its body defines)."""

    def defining(self, cls: str, name: str) -> str | None:
        """The class of this file whose ``name`` the class ``cls`` runs: ``cls`` itself, else
        the first of its bases (depth first, left to right, as for single inheritance chains)
        that defines it; ``None`` when no class of the file does."""
        todo, seen = [cls], set()
        while todo:
            k = todo.pop(0)
            if k in seen or k not in self.classes:
                continue
            seen.add(k)
            bases, own = self.classes[k]
            if name in own:
                return k
            todo = bases + todo
        return None


def _def_line(node: ast.AST) -> int:
    return int(getattr(node, "lineno", 0))


def _file_plan(
    host: Path, rel: str, fail_to_pass: list[str]
) -> tuple[_File, frozenset[str]] | None:
    """Where canaries may go in the test file ``rel`` (text at ``host``) and which of its
    FAIL_TO_PASS tests (top-level functions, methods of top-level classes) are renamed, with the
    names it binds; ``None`` when it cannot take a canary."""
    stat = os.stat(host)
    layout = _layout(str(host), stat.st_size, stat.st_mtime_ns)
    if layout is None:
        return None
    starts, names = layout
    lines = Path(host).read_bytes().split(b"\n")
    parts = [i.split("[")[0].split("::")[1:] for i in fail_to_pass if i.split("::")[0] == rel]
    where = [_top_level_index(starts, p[0], lines) for p in parts]
    if not where or None in where:
        return None
    found = [w for w in where if w is not None]
    lo, hi = min(found), max(found) + 1
    plan = _File(lines, {None: [(starts[k], b"") for k in range(lo, hi + 1)]})
    tree = parse_python(b"\n".join(lines), str(host))
    funcs = {p[0] for p in parts if len(p) == 1}
    methods: dict[str, set[str]] = {}
    for p in parts:
        if len(p) == 2:
            methods.setdefault(p[0], set()).add(p[1])
    # fresh names must not be any test-like word of the file (a local, a string)
    taken = set(names) | {w.decode() for w in re.findall(rb"\b[Tt]est\w*", b"\n".join(lines))}
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef):
            bases = [b.id if isinstance(b, ast.Name) else "" for b in stmt.bases]
            own = {getattr(b, "name", "") for b in stmt.body} - {""}
            plan.classes[stmt.name] = (bases, own)
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name in funcs:
            plan.renames[_def_line(stmt)] = (stmt.name, "")
            plan.defs[_def_line(stmt)] = stmt
        if not (isinstance(stmt, ast.ClassDef) and stmt.name in methods and stmt.body):
            continue
        body_starts = [
            min([_def_line(b), *map(_def_line, getattr(b, "decorator_list", []))])
            for b in stmt.body
        ]
        first = lines[body_starts[0] - 1]
        indent = first[: len(first) - len(first.lstrip())]
        if not indent:
            continue
        end = (stmt.body[-1].end_lineno or body_starts[-1]) + 1
        plan.slots[stmt.name] = [(n, indent) for n in [*body_starts, end]]
        for b in stmt.body:
            if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                taken.add(b.name)
                if b.name in methods[stmt.name]:
                    plan.renames[_def_line(b)] = (b.name, stmt.name)
                    plan.defs[_def_line(b)] = b
    return plan, frozenset(taken)


def _as_method(source: str, indent: bytes) -> list[bytes]:
    """A top-level canary function's lines as a method of a class body indented by ``indent``."""
    text = source.rstrip("\n").replace("():", "(self):", 1)
    return [indent + line.encode() for line in text.split("\n")]


def plant_canaries(
    sources: dict[str, Path],
    fail_to_pass: list[str],
    rng: random.Random,
    out_dir: Path,
    others: tuple[Path, ...] = (),
    held_out: frozenset[str] = frozenset(),
    twins: TwinPolicy | None = None,
    repaired: tuple[str, ...] = (),
) -> Planted:
    """Write the second run's canaries into copies of the files holding ``fail_to_pass`` tests,
    and rename those tests there.

    ``sources``: workspace-relative file -> host path of the text the first run tested (the
    pristine file). Each canary goes to a top-level boundary between the first and the last
    statement holding a FAIL_TO_PASS test of a file, or, as a method, into the body of a class
    holding FAIL_TO_PASS methods (in proportion to how many FAIL_TO_PASS tests are methods).
    Every FAIL_TO_PASS test that is a top-level function or a method of a top-level class is
    renamed to a fresh name drawn as the canaries' names are (:attr:`Planted.renamed` maps
    back), so no name tells a real test from a canary: canaries never take a name the file
    has, and a real test no longer has its published one. A test whose name another file
    mentions (another file of ``sources``, or of ``others``: the rest of the suite) keeps it:
    idna's codec tests call ``test_idna.IDNATests().test_decode``, which a rename in one file
    would break. Files that cannot take a canary are left alone; an empty :class:`Planted`
    means none could. ``twins``: which tests get no twin and where twins go
    (:class:`TwinPolicy`; default: every test that can have one, placed as grading does).
    """
    twins = twins or TwinPolicy()
    plans: dict[str, _File] = {}
    taken: set[str] = set()
    tests_seen: list[str] = list(fail_to_pass)
    for rel, host in sorted(sources.items()):
        if not _TEST_MODULE.match(rel.rsplit("/", 1)[-1]):
            continue
        got = _file_plan(host, rel, fail_to_pass)
        if got is None:
            continue
        plans[rel], names = got
        taken |= names
        tests_seen += [f"{rel}::{n}" for n in names if n.lower().startswith("test")]
    _keep_mentioned_names(plans, sources, others)
    if not plans:
        return Planted()
    n_fail = fail_canaries(len(set(fail_to_pass)))
    n_renames = sum(len(p.renames) for p in plans.values())
    chosen_twins = _choose_twins(plans, rng, held_out, twins.untwinned)
    kinds = ("pass",) * PASS_CANARIES + ("fail",) * n_fail
    kinds += ("name",) * (n_renames + sum(map(len, chosen_twins.values())))
    drawn = make_canaries(rng, tests_seen, kinds, frozenset(taken))
    fresh = iter([c.name for c in drawn if c.kind == "name"])
    for (rel, line), chosen in chosen_twins.items():  # the test at a uniform place among them
        sides = twins.sides(len(chosen), rng)
        plans[rel].twins[line] = [(m, next(fresh), a) for m, a in zip(chosen, sides, strict=True)]
    chosen = [c for c in drawn if c.kind != "name"]
    slots = [(rel, cls) for rel, p in sorted(plans.items()) for cls in p.slots]
    in_class = [sl for sl in slots if sl[1] is not None]
    share = sum(len(i.split("[")[0].split("::")) == 3 for i in fail_to_pass) / max(
        1, len(fail_to_pass)
    )
    planted = Planted()
    inserts: dict[str, dict[int, list[tuple[Canary, str | None, bytes]]]] = {r: {} for r in plans}
    for canary in chosen:
        pool = in_class if in_class and rng.random() < share else [s for s in slots if s[1] is None]
        rel, cls = rng.choice(pool or slots)
        line, indent = rng.choice(plans[rel].slots[cls])
        inserts[rel].setdefault(line, []).append((canary, cls, indent))
    checker = checker_name()  # strict assertions (coderl.grading.strictcmp)
    for k, rel in enumerate(sorted(plans)):
        plan = plans[rel]
        out = _planted_lines(rel, plan, inserts[rel], fresh, planted)
        released = released_methods(sources[rel], rel) + repaired  # strictcmp's doc
        out = rewrite(out, checker, f"/testbed/{rel}", released)
        path = out_dir / f"{k}-{rel.rsplit('/', 1)[-1]}"
        path.write_bytes(b"\n".join(out) + (b"" if plan.lines[-1] == b"" else b"\n"))
        path.chmod(0o644)
        planted.mounts[f"/testbed/{rel}"] = str(path)
    _twin_ids(planted, plans, fail_to_pass)
    return planted


def twins_per_test(n_tests: int) -> int:
    """Twins for each of ``n_tests`` twinned tests a forge must guess between: the fewest
    ``t >= 1`` with ``(t + 1) ** n >= GUESS_ODDS`` (picking one of each test's ``t + 1``
    look-alikes at random then passes every real one at most once in 100 tries), at most
    :data:`MAX_TWINS` (9 for one test, a 1-in-10 bet; 9 for two, 4 for three, 3 for four, 2
    for five or six, 1 from seven on)."""
    t = 1
    while (t + 1) ** max(n_tests, 1) < GUESS_ODDS and t < MAX_TWINS:
        t += 1
    return t


def _choose_twins(
    plans: dict[str, _File],
    rng: random.Random,
    held_out: frozenset[str],
    untwinned: frozenset[str] = frozenset(),
) -> dict[tuple[str, int], list[Mutation]]:
    """(file, ``def`` line) -> its twins' mutations, for each renamed test that can have
    twins and whose (file, name) no id of ``untwinned`` has (a method's class aside: an
    inherited method's id names the subclass). How many each: :func:`twins_per_test` of the
    twinned held-out tests (a forge that carries the visible tests' sources tells their twins
    apart), of all twinned tests when none is held out."""
    skip = {(i.split("::")[0], i.split("[")[0].split("::")[-1]) for i in untwinned}
    can = {
        (rel, line)
        for rel, plan in plans.items()
        for line in plan.renames
        if (rel, plan.renames[line][0]) not in skip and mutations(plan.defs[line], plan.lines, rng)
    }
    held = {i.split("[")[0] for i in held_out}

    def published(rel: str, line: int) -> str:
        old, cls = plans[rel].renames[line]
        return "::".join([rel, *([cls] if cls else []), old])

    hidden = [key for key in can if published(*key) in held]
    per = twins_per_test(len(hidden) or len(can))
    return {
        key: pick(plans[key[0]].defs[key[1]], plans[key[0]].lines, rng, per) for key in sorted(can)
    }


def _twin_ids(planted: Planted, plans: dict[str, _File], fail_to_pass: list[str]) -> None:
    """Fill :attr:`Planted.twins` (each FAIL_TO_PASS id of a twinned test, as the twin's id,
    parameters and inheriting classes kept) and :attr:`Planted.twinless`."""
    names: dict[tuple[str, str, str], tuple[str, ...]] = {}
    for rel, plan in plans.items():
        for line, twins in plan.twins.items():
            old, cls = plan.renames[line]
            names[(rel, cls, old)] = tuple(name for _, name, _ in twins)
    for test in dict.fromkeys(fail_to_pass):
        base, sep, params = test.partition("[")
        parts = base.split("::")
        cls = parts[1] if len(parts) == 3 else ""
        got = names.get((parts[0], cls, parts[-1]), ())
        if not got and cls and parts[0] in plans:  # a method inherited from a class of the file
            owner = plans[parts[0]].defining(cls, parts[-1])
            got = names.get((parts[0], owner or "", parts[-1]), ()) if owner != cls else ()
        if not got:
            planted.twinless.append(test)
        for twin in got:
            planted.twins["::".join([*parts[:-1], twin]) + sep + params] = test


def _keep_mentioned_names(
    plans: dict[str, _File], sources: dict[str, Path], others: tuple[Path, ...]
) -> None:
    """Drop from each plan's renames the tests whose name another file of ``sources`` or
    ``others`` mentions (as a whole word): a rename would break that file's use of it."""
    texts = {str(p): p.read_bytes() for p in {*sources.values(), *others} if p.is_file()}
    for rel, plan in plans.items():
        own = str(sources[rel])
        elsewhere = [t for path, t in texts.items() if path != own]
        plan.renames = {
            line: (old, cls)
            for line, (old, cls) in plan.renames.items()
            if not any(re.search(rb"\b" + re.escape(old.encode()) + rb"\b", t) for t in elsewhere)
        }


def _planted_lines(
    rel: str,
    plan: _File,
    inserts: dict[int, list[tuple[Canary, str | None, bytes]]],
    fresh: Iterator[str],
    planted: Planted,
) -> list[bytes]:
    """The lines of ``rel``'s copy: its renamed tests under names drawn from ``fresh`` (every
    mention in ``plan.lines``, rewritten in place; recorded in ``planted.renamed``), and the
    canaries of ``inserts`` (line -> canaries) before their lines, spaced as their neighbours
    (recorded in ``planted.expected``)."""
    original = plan.lines
    done: dict[str, str] = {}  # one new name per old name in a file (methods of 2 classes)
    for old, cls in plan.renames.values():
        # every mention in the file, not only the def: a test may name itself (six's
        # test_add_metaclass_nested compares a __qualname__ with a string holding its name),
        # and a subclass inheriting the method runs it under the new name too
        if old not in done:
            done[old] = next(fresh)
            word = re.compile(rb"\b" + re.escape(old.encode()) + rb"\b")
            plan.lines = [word.sub(done[old].encode(), line) for line in plan.lines]
        prefix = f"{rel}::{cls}::" if cls else f"{rel}::"
        planted.renamed[prefix + done[old]] = prefix + old
    twins = _twin_lines(plan, original, done)
    out: list[bytes] = []
    for number, line in enumerate(plan.lines, start=1):
        out += twins.pop(number, [])
        for canary, owner, indent in inserts.get(number, []):  # spaced as its neighbours
            gap = len(out) - len(_without_blank_tail(out))
            body = (
                _as_method(canary.source, indent)
                if owner
                else canary.source.rstrip("\n").encode().split(b"\n")
            )
            out += [*body, *[b""] * max(gap, 1)]
            where = f"{rel}::{owner}::" if owner else f"{rel}::"
            planted.expected[where + canary.name] = canary.expected
        out.append(line)
    return out + [x for _, lines in sorted(twins.items()) for x in lines]


def _twin_lines(plan: _File, original: list[bytes], done: dict[str, str]) -> dict[int, list[bytes]]:
    """Line -> the twins' lines to put before it: each twin is its test's ``original`` lines
    (decorators included) with its mutation made and renamed as the file is (its own name to
    the twin's), directly before or after its test, spaced from it as the test is from what
    precedes it (so the pair's order and spacing do not tell which is the copy)."""
    out: dict[int, list[bytes]] = {}
    for line, mutation, twin, after in [
        (k, *v) for k, vs in sorted(plan.twins.items()) for v in vs
    ]:
        node = plan.defs[line]
        first = min([line, *map(_def_line, node.decorator_list)])
        last = node.end_lineno or line
        lines = apply(mutation, original[first - 1 : last], first)
        old = plan.renames[line][0]
        for name, new in [(old, twin), *((o, n) for o, n in done.items() if o != old)]:
            word = re.compile(rb"\b" + re.escape(name.encode()) + rb"\b")
            lines = [word.sub(new.encode(), x) for x in lines]
        gap = len(original[: first - 1]) - len(_without_blank_tail(original[: first - 1]))
        blanks = [b""] * gap
        at, text = (last + 1, blanks + lines) if after else (first, lines + blanks)
        out.setdefault(at, []).extend(text)
    return out


def _names(renamed: dict[str, str]) -> dict[str, dict[str, str]]:
    """File -> old test name -> new one, from :attr:`Planted.renamed` (a name is renamed
    throughout its file, so every node id that ends in it, inherited ones included, changes)."""
    out: dict[str, dict[str, str]] = {}
    for new, old in renamed.items():
        out.setdefault(old.split("::")[0], {})[old.split("::")[-1]] = new.split("::")[-1]
    return out


def _rename(node_id: str, names: dict[str, dict[str, str]]) -> str:
    base, sep, params = node_id.partition("[")  # parameters may hold "::" (an IPv6 address)
    parts = base.split("::")
    parts[-1] = names.get(parts[0], {}).get(parts[-1], parts[-1])
    return "::".join(parts) + sep + params


def renamed_ids(ids: list[str], renamed: dict[str, str]) -> list[str]:
    """``ids`` as the second run names them: a renamed test's name replaced wherever it ends a
    node id of its file (parameters kept)."""
    names = _names(renamed)
    return [_rename(i, names) for i in ids]


def original_ids(outcomes: dict[str, str], renamed: dict[str, str]) -> dict[str, str]:
    """The second run's ``outcomes`` keyed by the tests' published node ids again."""
    back = {f: {new: old for old, new in m.items()} for f, m in _names(renamed).items()}
    return {_rename(i, back): outcome for i, outcome in outcomes.items()}


def _without_blank_tail(lines: list[bytes]) -> list[bytes]:
    """``lines`` without its trailing blank lines."""
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    return lines[:end]


def confirm(
    fail_to_pass: list[str],
    first: dict[str, str],
    second: TestRun,
    planted: dict[str, str],
    baseline_tampered: list[str],
    twins: dict[str, str] | None = None,
) -> Confirmed:
    """Merge the first run's outcomes ``first`` with the second run on the FAIL_TO_PASS tests.

    ``planted``: canary node id -> expected outcome (:attr:`Planted.expected`); when empty the
    second run's own (observer-sent) canaries are judged as in the first run. A test passes
    only when it passed in both; a planted canary with another outcome than expected while some
    FAIL_TO_PASS test passed, or a tripwire finding not in ``baseline_tampered``, is tampering;
    so is a twin (``twins``: twin id -> FAIL_TO_PASS id, :attr:`Planted.twins`) that did not
    fail while its test passed in this run: a correct fix fails every twin, so a pair that
    both passed was forged (never a flaky mask). A twin that passed beside a failing test is
    no finding (the unfixed code may meet the changed value; the test counts as failed).
    """
    got = {} if second.results_missing else second.outcomes
    outcomes: dict[str, str] = {}
    disagreed: list[str] = []
    for test in dict.fromkeys(fail_to_pass):
        one, two = first.get(test, "missing"), got.get(test, "missing")
        outcomes[test] = "passed" if one == two == "passed" else (two if one == "passed" else one)
        if (one == "passed") != (two == "passed"):
            disagreed.append(f"{test}: {one} then {two}")
    second.tampered = sorted(set(second.tampered) - set(baseline_tampered))
    why = tampering(second, canaries=not planted)
    wrong = [c for c, want in planted.items() if got.get(c, "missing") != want]
    forged = [twin for twin, test in (twins or {}).items() if got.get(test) == "passed"]
    forged = [t for t in forged if got.get(t, "missing") not in ("failed", "error")]
    if not why and forged:
        why = "a mutated twin of a passing test did not fail"
    elif not why and any(got.get(c) == "passed" for c in wrong):
        why = "a must-fail canary passed"
    elif not why and wrong and any(got.get(t) == "passed" for t in fail_to_pass):
        why = "tests passed but the canaries did not behave"
    not_failed = sorted({(twins or {})[t] for t in forged})
    return Confirmed(outcomes, disagreed, f"second run: {why}" if why else "", not_failed)
