"""Pre-passes of the reward-denying detector (:mod:`coderl.grading.diffguard`) over one AST:
which names each scope binds, which names stand for another package's objects, which string
constants are docstrings or format templates that reach into their argument, and which
top-level package a file belongs to; and the predicates the scanner applies to one node or
name (a banned module, a dunder outside the list, a visibly numeric argument). Pure
functions; every walk is without recursion."""

from __future__ import annotations

import ast
import re
import string

from coderl.grading.guardlists import (
    BANNED_ATTRS,
    BANNED_MODULES,
    DUNDER_ALLOWED,
    FS_PROBES,
    MODULE_ALIASES,
    NUMERIC_CALLS,
    SAFE_MODULES,
    STDLIB_NAMES,
    STRING_PATHS,
    STRING_WORDS,
)

CO_ATTR = re.compile(r"^co_[a-z]+$")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


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


def enclosing_scope(node: ast.AST) -> ast.AST | None:
    """The nearest function, class, lambda or module above ``node`` (by its ``_parent``)."""
    parent = getattr(node, "_parent", None)
    while parent is not None and not isinstance(parent, SCOPES):
        parent = getattr(parent, "_parent", None)
    return parent


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


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _constructor(value: ast.AST, defs: set[str], odd: set[str]) -> bool:
    """A literal, or a call of a CapWords name (a class: a fresh instance) that the file does
    not define as a function and that is no class of the file with ``__new__`` or a
    metaclass (either could hand back another object)."""
    if isinstance(value, (ast.Constant, ast.List, ast.Dict, ast.Set, ast.Tuple, ast.JoinedStr)):
        return True
    if not isinstance(value, ast.Call):
        return False
    fn = value.func
    name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
    return name[:1].isupper() and name not in defs and name not in odd


def fresh_locals(tree: ast.AST) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """Per scope id (as :func:`bindings`), the names whose every binding there is a ``def``,
    a ``class`` or a plain ``name = <literal or constructor call>`` (:func:`_constructor`):
    storing an attribute on one changes only an object the scope made. Parameters, imports,
    loop, ``with`` and walrus targets, unpacking and ``global`` names are never fresh. Second,
    the same without ``def`` and ``class`` names (*instances*: a class's attribute is its
    unbound function)."""
    defs = {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    odd = {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
        and (n.keywords or any(isinstance(b, _DEFS) and b.name == "__new__" for b in n.body))
    }
    ok: dict[int, dict[str, bool]] = {}
    defined: set[tuple[int, str]] = set()  # (scope, name) bound by ``def`` or ``class``
    stack: list[tuple[ast.AST, int]] = [(tree, id(tree))]
    while stack:
        node, scope = stack.pop()
        inner = id(node) if isinstance(node, SCOPES) else scope
        seen = ok.setdefault(scope, {})
        parent = getattr(node, "_parent", None)
        if isinstance(node, _DEFS):
            seen[node.name] = seen.get(node.name, True)
            defined.add((scope, node.name))
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            plain = isinstance(parent, (ast.Assign, ast.AnnAssign)) and node in (
                parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            )
            good = plain and parent.value is not None and _constructor(parent.value, defs, odd)
            seen[node.id] = seen.get(node.id, True) and good
        elif isinstance(node, (ast.arg, ast.alias, ast.ExceptHandler, ast.MatchAs, ast.MatchStar)):
            name = getattr(node, "arg", None) or getattr(node, "asname", None) or node.name
            if isinstance(name, str):
                seen[top_name(name)] = False
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                seen[name] = False
        for child in ast.iter_child_nodes(node):
            stack.append((child, inner))
    fresh = {scope: {n for n, good in names.items() if good} for scope, names in ok.items()}
    made = {
        scope: {n for n in names if (scope, n) not in defined} for scope, names in fresh.items()
    }
    return fresh, made


def assigned_names(node: ast.AST) -> set[str]:
    """The plain names a finding at ``node`` flows into outside any function: the targets of
    every assignment (``=``, ``:=``, ``+=``, ``for``, ``with``) that encloses it up to the
    nearest function (none inside one: the function's own name is tainted instead), class or
    module."""
    out: set[str] = set()
    child, parent = node, getattr(node, "_parent", None)
    while parent is not None and not isinstance(parent, (*_DEFS, ast.Module)):
        targets: list[ast.AST] = []
        if isinstance(parent, ast.Assign) and child is parent.value:
            targets = parent.targets
        elif isinstance(parent, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets = [parent.target]
        elif isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)):
            targets = [parent.target]
        elif isinstance(parent, ast.withitem) and parent.optional_vars is not None:
            targets = [parent.optional_vars]
        for target in targets:
            out |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        child, parent = parent, getattr(parent, "_parent", None)
    if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    return out


def module_defs(tree: ast.AST) -> set[str]:
    """Names the module body binds by ``def``, ``class`` or a plain ``name = ...`` (inside
    module-level ``if``/``try`` too): what ``from <this module> import name`` may ask for."""
    out: set[str] = set()
    todo = list(getattr(tree, "body", []))
    while todo:
        node = todo.pop()
        if isinstance(node, _DEFS):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return out


def own_module(path: str) -> str:
    """The dotted module a workspace file is (``six`` for ``six.py``, ``pkg.mod`` for
    ``src/pkg/mod.py``, ``pkg`` for ``pkg/__init__.py``); ``""`` when there is none."""
    parts = [p for p in path.split("/") if p]
    if parts and parts[0] in ("src", "lib") and len(parts) > 1:
        parts = parts[1:]
    if not parts or not parts[-1].endswith(".py"):
        return ""
    parts[-1] = parts[-1].removesuffix(".py")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts) if all(p.isidentifier() for p in parts) else ""


def imports_module(module: str, known: set[str]) -> bool:
    """Whether the file already imports ``module``, a package of it or a module under it."""
    return any(
        module == k or module.startswith(k + ".") or k.startswith(module + ".") for k in known
    )


# --- predicates of the scanner (:class:`coderl.grading.diffguard._Scanner`) --------------------


def banned_module(name: str) -> bool:
    return name in BANNED_MODULES or top_name(name) in BANNED_MODULES


def dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def bad_dunder(name: str) -> bool:
    """A dunder name outside the reviewed ``DUNDER_ALLOWED``."""
    return dunder(name) and name[2:-2] not in DUNDER_ALLOWED


def private(name: str) -> bool:
    return name.startswith("_") and not dunder(name)


def string_hits(text: str) -> list[str]:
    hits = [p for p in STRING_PATHS if p in text]
    for word in _WORD.findall(text):
        parts = {word, *word.split(".")}
        hits += sorted(p for p in parts if p in STRING_WORDS or CO_ATTR.match(p) or bad_dunder(p))
    return hits


def bad_name(part: str) -> bool:
    """An attribute name a literal ``getattr`` may not use."""
    return (
        part in BANNED_ATTRS
        or bool(CO_ATTR.match(part))
        or bad_dunder(part)
        or part.lstrip("_") in MODULE_ALIASES
        or part in FS_PROBES
        or part in STDLIB_NAMES
        and part not in SAFE_MODULES
    )


def method_decorator(node: ast.AST) -> bool:
    """A decorator that keeps a method's first argument the instance or class."""
    if isinstance(node, ast.Name):
        return node.id in ("classmethod", "property")
    return isinstance(node, ast.Attribute) and node.attr in ("setter", "getter", "deleter")


def called(node: ast.AST) -> bool:
    parent = getattr(node, "_parent", None)
    return isinstance(parent, ast.Call) and parent.func is node


def numeric(node: ast.AST) -> bool:
    """Whether ``node`` is visibly a number (so ``open(node)`` opens a descriptor): a numeric
    literal, arithmetic on one, or a call that returns one (``int(...)``, ``x.fileno()``).
    A plain name holding a number is not seen (residual risk). Walked without recursion."""
    todo = [node]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return True  # bool is an int
        if isinstance(node, ast.UnaryOp):
            todo.append(node.operand)
        elif isinstance(node, ast.BinOp):
            todo += [node.left, node.right]
        elif isinstance(node, ast.Call):
            fn = node.func
            if (fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")) in NUMERIC_CALLS:
                return True
    return False


def new_metaclass(node: ast.ClassDef) -> list[str]:
    """A metaclass the class statement defines or names (``metaclass=``, a base that is
    ``type`` or calls it). A metaclass writes the class namespace with keys built at run time
    (round-5 red team: ``__annotations__`` with a field name that ``dataclasses`` pastes into
    the code it execs); a bug fix does not define one."""
    out = [f"{node.name}(metaclass=...)" for kw in node.keywords if kw.arg == "metaclass"]
    for base in node.bases:
        target = base.func if isinstance(base, ast.Call) else base
        if (isinstance(target, ast.Name) and target.id == "type") or (
            isinstance(target, ast.Attribute) and target.attr == "type"
        ):
            out.append(f"{node.name}(type)")
    return out


def lazy_imports(
    from_own: list[tuple[str, str, int, str]], path: str, defs: set[str]
) -> list[tuple[int, str, str]]:
    """``(line, what, scope)`` of each ``from <this module> import name`` (``from_own``: module,
    name, line, scope) for a name its source does not define untainted (``defs``:
    :func:`module_defs` less the tainted ones), and ``from <this module>.sub import name`` where
    this file is a plain module (no package, so ``sub`` is an object it builds at run time:
    six's lazy ``moves`` hand out ``subprocess.getoutput``, ``input``, ``reload``): rule
    ``lazy-import``. Other modules of a package are not read here (residual risk)."""
    own = own_module(path)
    plain = bool(own) and not path.endswith("__init__.py")
    return [
        (line, f"{module}.{name}", scope)
        for module, name, line, scope in from_own
        if module == own and name not in defs or plain and module.startswith(own + ".")
    ]
