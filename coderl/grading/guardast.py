"""Pre-passes of the reward-denying detector (:mod:`coderl.grading.diffguard`) over one AST:
which names each scope binds, which names stand for another package's objects, which string
constants are docstrings or format templates that reach into their argument, and which
top-level package a file belongs to. Pure functions; every walk is without recursion."""

from __future__ import annotations

import ast
import string

from coderl.grading.guardlists import STDLIB_NAMES


def top_name(name: str) -> str:
    """The first dotted part of a module name (``os`` for ``os.path``)."""
    return name.split(".")[0]


def first_party(path: str) -> frozenset[str]:
    """The package a workspace file belongs to, as an importable top-level name (``toolz`` for
    ``toolz/itertoolz.py``, ``slugify`` for ``src/slugify/slugify.py``, ``six`` for
    ``six.py``); none where that name is a standard-library module's or private."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0] in ("src", "lib") and len(parts) > 1:
        parts = parts[1:]
    name = parts[0].removesuffix(".py") if parts else ""
    if not name.isidentifier() or name in STDLIB_NAMES or name.startswith("_"):
        return frozenset()
    return frozenset({name})


def docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (first statement of a body)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                out.add(id(value))
    return out


def format_fields(text: str) -> list[str]:
    """Replacement fields of ``text`` read as a ``str.format`` template that reach into their
    argument (``{0.attr}``, ``{a[key]}``), nested specs included; none when it is no template."""
    out: list[str] = []
    todo = [text]
    while todo and len(out) < 8:
        try:
            parsed = list(string.Formatter().parse(todo.pop()))
        except (ValueError, IndexError):
            continue
        for _, field, spec, _ in parsed:
            if field and ("." in field or "[" in field):
                out.append(field)
            if spec and "{" in spec:
                todo.append(spec)
    return out


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.Module)


def bindings(tree: ast.AST) -> tuple[dict[int, set[str]], dict[int, set[str]], set[str]]:
    """Names bound in each scope (keyed by the id of its function, class, lambda or module;
    comprehensions count as their enclosing scope), the same without import bindings, and the
    names bound only ever to a string literal (``FMT = "{:>8}"``). Walked without recursion."""
    bound: dict[int, set[str]] = {}
    plain: dict[int, set[str]] = {}
    literal: dict[str, bool] = {}
    stack: list[tuple[ast.AST, int]] = [(tree, id(tree))]
    while stack:
        node, scope = stack.pop()
        inner = id(node) if isinstance(node, SCOPES) else scope
        names: list[str] = []
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.append(node.id)
        elif isinstance(node, ast.arg):
            names.append(node.arg)
        elif isinstance(node, ast.alias):
            names.append(node.asname or top_name(node.name))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.append(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.append(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.setdefault(id(tree), set()).update(node.names)
        for name in names:
            bound.setdefault(scope, set()).add(name)
            if not isinstance(node, ast.alias):
                plain.setdefault(scope, set()).add(name)
            literal[name] = literal.get(name, True) and _str_assign(node)
        for child in ast.iter_child_nodes(node):
            stack.append((child, inner))
    return bound, plain, {n for n, ok in literal.items() if ok}


def foreign_names(tree: ast.AST, first: frozenset[str]) -> tuple[set[str], set[str]]:
    """Names bound to another package's objects: by an import from outside ``first``, and by
    assigning an attribute chain on such a name (``E = json.JSONEncoder``) or ``type(...)``
    (two passes, so an alias of an alias counts; a value passed through a call does not)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            for alias in node.names:
                module = getattr(node, "module", None) or alias.name
                if top_name(module) not in first and module != "__future__":
                    names.add(alias.asname or top_name(alias.name))
    imports, aliases = set(names), set()
    for _ in range(2):
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                value = node.value
                while isinstance(value, ast.Attribute):
                    value = value.value
                typed = isinstance(value, ast.Call) and getattr(value.func, "id", "") == "type"
                if typed or isinstance(value, ast.Name) and value.id in names:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    found = {t.id for t in targets if isinstance(t, ast.Name)}
                    names |= found
                    aliases |= found
    return imports, aliases


def _str_assign(node: ast.AST) -> bool:
    """Whether ``node`` is a plain name target assigned a string literal."""
    parent = getattr(node, "_parent", None)
    return (
        isinstance(node, ast.Name)
        and isinstance(parent, (ast.Assign, ast.AnnAssign))
        and isinstance(parent.value, ast.Constant)
        and isinstance(parent.value.value, str)
    )
