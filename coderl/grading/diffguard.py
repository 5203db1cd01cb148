"""The reward-denying detector: a host-side static check of the code an agent's diff adds.

Repository tests run in the same process as the code under test, so a few lines of Python in a
library can, in principle, reach whatever in that process reports a test's outcome (see
``coderl.grading.runner``). A bug fix has no business reaching into the interpreter, so
``guardproc.scan_change`` reads the graded tree on the host, before any of it runs, and every
finding denies the reward (``GradeResult.denied``: scored 0, failure kind ``agent``, counted,
kept for audit). It reports only what the diff *adds* beyond the base.

Policy: an allowlist that fails closed (why each entry is there: :mod:`.guardlists`; the AST
pre-passes: :mod:`.guardast`; the walk that applies it: :mod:`.guardscan`; false positives and
residual risk: ``docs/tasks-and-grading.md``):

- imports: a module the changed file already imports, one of its own package, or one of
  ``SAFE_MODULES``; process internals, text evaluators and underscore modules are findings;
- members of ``sys``, ``os``, ``os.path`` and ``warnings`` by allowlist, reviewed members of
  allowed modules denied, private members and modules reached as another module's attribute;
- constructs: dunders outside ``DUNDER_ALLOWED``, builtins outside ``BUILTINS_ALLOWED``, three-
  argument ``type``, format templates that reach into their argument, ``getattr``-family calls
  without a literal allowed name, file I/O and file-system or environment probes, frame, code
  and class-graph attributes, banned words in strings, a new metaclass, symbolic links;
- attribute stores only on a method's own ``self``/``cls`` or an object the scope made, and a
  method that stores through its ``self`` reached only bound to one (:mod:`.guardself`);
- a *helper* of the changed file whose body holds a finding, used by name beyond the base.

Findings are counted per rule, name and scope; the base and the released file each allow what
they have in a scope (:func:`added_findings`), and an import the file already has anywhere.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass

from coderl.grading import guardreflect  # rule ``reflective``
from coderl.grading.guardast import (
    dunder,
    first_party,
    imports_module,
    lazy_imports,
    module_defs,
)
from coderl.grading.guardscan import _Scanner  # the walk that collects the findings
from coderl.grading.pyparse import parse_python


@dataclass(frozen=True)
class Finding:
    """One thing the diff adds that the policy forbids."""

    path: str
    """Workspace-relative file."""
    line: int
    """Line in the changed file (0 for whole-file findings)."""
    rule: str
    """Which rule (``import``, ``attr-store``, ``unbound``...: each ``add`` of
    :class:`.guardscan._Scanner`; ``helper``, ``lazy-import``: :func:`added_findings`;
    ``unscannable``: the host could not read the file within bounds, so it fails closed)."""
    what: str
    """The offending name or text (at most 80 characters)."""
    scope: str = ""
    """Qualified name of the enclosing functions and classes (``""`` at module level): a use the
    base or the released file already has counts only in the scope where it has it."""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule} {self.what}"


PYTHON_SUFFIXES = (".py", ".pyw")
"""Files the import system runs as Python source (``importlib.machinery.SOURCE_SUFFIXES``)."""


def _scan(
    source: bytes | str,
    path: str = "",
    shared: frozenset[str] = frozenset(),
    package: frozenset[str] = frozenset(),
) -> _Scanner | None:
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child._parent = parent  # type: ignore[attr-defined]
    scanner = _Scanner(tree, first_party(path), shared, package)
    scanner.run(tree)
    scanner.found += guardreflect.reflective_statements(tree)
    return scanner


def scan_source(source: bytes | str, path: str = "<diff>") -> list[Finding] | None:
    """Every policy finding in one Python module; ``None`` when it does not parse (then it
    cannot run as Python either)."""
    scanner = _scan(source, path)
    if scanner is None:
        return None
    return [Finding(path, line, rule, what, scope) for rule, what, line, scope in scanner.found]


def _known(
    source: bytes | None, path: str, shared: frozenset[str], package: frozenset[str]
) -> tuple[Counter, Counter, set[str], set[str], set[str]]:
    """Counts of findings and of name uses per scope, the *tainted helpers* (the names of the
    functions and classes that hold a finding, a library's own ``sys.modules`` lookup, and the
    names a value with a finding is assigned to outside functions, six's
    ``get_function_globals = operator.attrgetter(_func_globals)``), the modules the file
    imports and the names its module body defines (:func:`module_defs`)."""
    scanner = _scan(source, path, shared, package) if source else None
    if scanner is None:
        return Counter(), Counter(), set(), set(), set()
    found = Counter((rule, what, scope) for rule, what, _, scope in scanner.found)
    refs = Counter((name, scope) for name, _, scope in scanner.refs)
    # a dunder is called implicitly (``obj.attr`` runs ``__get__``), so its name is no route of
    # its own; a module the file imports is allowed everywhere in it, so it taints nothing
    helpers = {
        scope.rsplit(".", 1)[-1]
        for r, _, _, scope in scanner.found
        if scope and r != "import-not-allowed"
    }
    tainted = {name for name in helpers | scanner.flows if not dunder(name)}
    return found, refs, tainted, scanner.import_names, module_defs(scanner.tree)


def added_findings(
    old: bytes | None,
    new: bytes,
    path: str,
    released: bytes | None = None,
    shared: frozenset[str] = frozenset(),
    package: frozenset[str] = frozenset(),
) -> list[Finding]:
    """The findings of ``new`` beyond those of ``old`` (counted per rule, name and scope, so
    moving a line within its function is not a finding, adding a second ``sys._getframe`` or
    moving one into another function or to module level is). ``released`` (the file as the
    repository released it) raises each count to what it had there, so restoring code a
    synthesised bug deleted is never denied, while re-adding a released line anywhere else is.

    A helper of the library that holds a finding (six's ``_SixMetaPathImporter.load_module``
    returns ``sys.modules[name]`` for any name) is a banned facility by another name: a use of
    its name beyond what the file had in that scope is a finding too (rule ``helper``).
    A Python file (``PYTHON_SUFFIXES``) that the host cannot parse, for any reason (a syntax
    error, an AST deeper than the host's parser accepts, memory), is one finding (rule
    ``unscannable``): the sandbox's interpreter may compile what the host's cannot, so a file
    the guard cannot read never passes. Any other file that does not parse gives none: it is
    not imported, and reading it as code needs a banned facility. ``shared``: the methods of
    the diff's other changed files that store through their ``self`` (:func:`unbound_methods`,
    rule ``unbound``); ``package``: those of the package's files the diff does not change
    (:func:`.guardself.package_what`)."""
    scanner = _scan(new, path, shared, package)
    if scanner is None:
        if path.endswith(PYTHON_SUFFIXES):
            return [Finding(path, 0, "unscannable", "the host cannot parse it as Python")]
        return []
    old_found, old_refs, old_tainted, old_imports, old_defs = _known(old, path, shared, package)
    rel_found, rel_refs, rel_tainted, rel_imports, rel_defs = _known(
        released, path, shared, package
    )
    budget = old_found | rel_found  # per key, the larger count
    known = old_imports | rel_imports
    out: list[Finding] = []
    for rule, what, line, scope in scanner.found:
        if rule == "import-not-allowed" and imports_module(what, known):
            continue  # a module the file already imports, anywhere in it
        if budget[(rule, what, scope)] > 0:
            budget[(rule, what, scope)] -= 1
        else:
            out.append(Finding(path, line, rule, what, scope))
    tainted, uses = old_tainted | rel_tainted, old_refs | rel_refs
    lazy = lazy_imports(scanner.from_own, path, (old_defs | rel_defs) - tainted)
    out += [Finding(path, line, "lazy-import", what, scope) for line, what, scope in lazy]
    for name, line, scope in scanner.refs:
        if scanner.alias_of.get(name) in tainted:
            out.append(Finding(path, line, "helper", f"{name} ({scanner.alias_of[name]})", scope))
        if name not in tainted:
            continue
        if uses[(name, scope)] > 0:
            uses[(name, scope)] -= 1
        else:
            out.append(Finding(path, line, "helper", name, scope))
    return out
