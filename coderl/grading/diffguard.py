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
import doctest
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


DOCTEST_DEPTH = 3
"""Deepest doctest read inside another doctest's strings; one deeper is a finding."""


def _scan(
    source: bytes | str,
    path: str = "",
    shared: frozenset[str] = frozenset(),
    package: frozenset[str] = frozenset(),
    depth: int = 0,
) -> _Scanner | None:
    """The scanner of ``source`` and of the doctest examples in its strings; a file that does
    not parse as Python (not ``PYTHON_SUFFIXES``) is read as a doctest text file instead
    (``doctest.testfile``), ``None`` when it holds no example."""
    try:
        tree = parse_python(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        if depth or path.endswith(PYTHON_SUFFIXES):
            return None
        text = source.decode("utf-8", "replace") if isinstance(source, bytes) else source
        return _doctest_scan(text, 1, path, shared, package, depth)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child._parent = parent  # type: ignore[attr-defined]
    scanner = _Scanner(tree, first_party(path), shared, package)
    scanner.run(tree)
    scanner.found += guardreflect.reflective_statements(tree)
    scanner.found += _doc_bindings(tree, scanner.literal_names)
    for node in ast.walk(tree):
        text = _outer_string(node)
        if text and ">>>" in text:
            inner = _doctest_scan(text, node.lineno, path, shared, package, depth)
            if inner is not None:
                where = ".".join([*_scope_names(node), "<doctest>"])
                scanner.found += [
                    (r, w, ln, f"{where}.{sc}".rstrip(".")) for r, w, ln, sc in inner.found
                ]
                scanner.refs += [(n, ln, f"{where}.{sc}".rstrip(".")) for n, ln, sc in inner.refs]
    return scanner


def _doc_bindings(tree: ast.AST, literal_names: set[str]) -> list[tuple[str, str, int, str]]:
    """Rule ``doctest-text``: text doctest would run that is made at run time, out of reach of
    the example scan. doctest reads a module's ``__test__`` and each object's ``__doc__``, so a
    binding of ``__test__`` (any), a ``def __doc__`` (a computed docstring) and a ``__doc__``
    store (``f.__doc__ = v``, ``__doc__ = v`` in a body, ``setattr(f, "__doc__", v)``) whose
    value is not docstring text (:func:`_doc_text`) are findings."""
    out: list[tuple[str, str, int, str]] = []
    for node in ast.walk(tree):
        pairs: list[tuple[ast.AST, ast.AST | None]] = []
        if isinstance(node, ast.Assign):
            pairs = [(t, node.value) for t in node.targets]
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            pairs = [(node.target, node.value)]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "__doc__":
            pairs = [(ast.Name("__doc__"), None)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = node.args
            if node.func.id == "setattr" and len(args) == 3 and isinstance(args[1], ast.Constant):
                pairs = [(ast.Attribute(args[0], str(args[1].value)), args[2])]
        for target, value in pairs:
            while isinstance(target, ast.Subscript):
                target = target.value  # ``__test__["name"] = text``
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            if name == "__test__" or (name == "__doc__" and not _doc_text(value, literal_names)):
                where = ".".join(_scope_names(node))
                out.append(("doctest-text", f"{name} bound", getattr(node, "lineno", 0), where))
    return out


def _doc_text(node: ast.AST | None, literal_names: set[str]) -> bool:
    """Whether ``node`` is docstring text the scan reads: a string literal (or one built from
    literals, or a name bound only to one), ``None``, another object's ``__doc__`` (``f.__doc__``,
    ``getattr(f, "__doc__", ...)``), or ``+``/``%``/``.format``/``or``/``if`` of those."""
    if node is None:
        return False
    if isinstance(node, ast.Constant):
        return node.value is None or isinstance(node.value, str)
    if isinstance(node, ast.Name):
        return node.id in literal_names
    if isinstance(node, ast.Attribute):
        return node.attr == "__doc__"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Mod):
        right = node.right.elts if isinstance(node.right, ast.Tuple) else [node.right]
        return all(_doc_text(n, literal_names) for n in [node.left, *right])
    if isinstance(node, ast.BoolOp):
        return all(_doc_text(n, literal_names) for n in node.values)
    if isinstance(node, ast.IfExp):
        return _doc_text(node.body, literal_names) and _doc_text(node.orelse, literal_names)
    if isinstance(node, ast.JoinedStr):
        return all(
            _doc_text(v.value if isinstance(v, ast.FormattedValue) else v, literal_names)
            for v in node.values
        )
    if isinstance(node, ast.Call):
        func, args = node.func, [*node.args, *(k.value for k in node.keywords)]
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            return isinstance(name, ast.Constant) and name.value == "__doc__"
        if isinstance(func, ast.Attribute) and func.attr in ("format", "replace", "strip"):
            return all(_doc_text(n, literal_names) for n in [func.value, *args])
    try:
        return guardreflect.folded_string(node) is not None
    except RecursionError:
        return False


def _outer_string(node: ast.AST) -> str | None:
    """The text of a string literal, or of an outermost string built only from literals
    (``guardreflect.folded_string``): docstrings and every other string alike."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    parent = getattr(node, "_parent", None)
    if not isinstance(node, ast.BinOp | ast.JoinedStr) or isinstance(
        parent, ast.BinOp | ast.JoinedStr | ast.FormattedValue
    ):
        return None
    try:
        return guardreflect.folded_string(node)
    except RecursionError:
        return None  # each literal of a sum too deep to fold is read on its own


def _scope_names(node: ast.AST) -> list[str]:
    """The names of the functions and classes around ``node``, outermost first."""
    names: list[str] = []
    parent = getattr(node, "_parent", None)
    while parent is not None:
        if isinstance(parent, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(parent.name)
        parent = getattr(parent, "_parent", None)
    return names[::-1]


def _doctest_scan(
    text: str,
    first_line: int,
    path: str,
    shared: frozenset[str],
    package: frozenset[str],
    depth: int,
) -> _Scanner | None:
    """The scanner of the doctest examples in ``text`` read as one module, in their order (they
    share one namespace when doctest runs them), lines mapped to ``first_line`` + the example's
    line; ``None`` when there is none.

    What doctest cannot run is left out, as doctest would: a text its parser refuses
    (``ValueError``: no example of that docstring or file runs) and an example that does not
    compile (a ``SyntaxError`` in the sandbox's interpreter, the host's version: it runs
    nothing, the examples after it still run and are read). An example the host cannot parse
    for another reason (depth, memory) is a finding (rule ``unscannable``), as a Python file is.
    """
    try:
        examples = doctest.DocTestParser().get_examples(text)
    except ValueError:
        return None
    sources: list[str] = []
    lines: list[int] = []  # line of the text (from 1) for each line of the joined source
    unscannable = 0
    for example in examples:
        try:
            parse_python(example.source)
        except (SyntaxError, ValueError):
            continue
        except (RecursionError, MemoryError):
            unscannable = first_line + example.lineno
            continue
        sources.append(example.source)
        lines += [first_line + example.lineno + i for i in range(example.source.count("\n"))]
    inner = None
    if sources and depth < DOCTEST_DEPTH:
        inner = _scan("".join(sources), path, shared, package, depth + 1)
    found: list[tuple[str, str, int, str]] = []
    if sources and inner is None:  # too deep, or examples that parse alone but not together
        unscannable = unscannable or lines[0]
    if unscannable:
        found.append(("unscannable", "a doctest example the host cannot parse", unscannable, ""))
    if inner is None and not found:
        return None
    if inner is None:
        inner = _Scanner(ast.Module(body=[], type_ignores=[]))

    def line(n: int) -> int:
        return lines[n - 1] if 0 < n <= len(lines) else first_line

    inner.found = [(r, w, line(n), sc) for r, w, n, sc in inner.found] + found
    inner.refs = [(name, line(n), sc) for name, n, sc in inner.refs]
    return inner


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
