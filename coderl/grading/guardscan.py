"""The walk of the reward-denying detector: every policy finding in one module's AST.

:class:`_Scanner` visits each node once (an explicit stack, so an AST of any depth is scanned)
and records ``(rule, what, line, scope)`` for what the allowlist forbids, the names used, the
modules imported and the names a finding flows into. The policy it applies, and the comparison
of a changed file's findings with its base's, are :mod:`coderl.grading.diffguard`'s; the
predicates it calls are :mod:`.guardast`'s, the reviewed lists :mod:`.guardlists`'.
"""

from __future__ import annotations

import ast

from coderl.grading import guardreflect, guardself  # rules ``reflective``, ``unbound``
from coderl.grading.guardast import (
    CO_ATTR,
    assigned_names,
    bad_dunder,
    bad_name,
    banned_module,
    bindings,
    called,
    docstrings,
    dunder,
    enclosing_scope,
    foreign_names,
    format_fields,
    fresh_locals,
    new_metaclass,
    numeric,
    private,
    string_hits,
    top_name,
)
from coderl.grading.guardlists import (  # the reviewed lists
    BANNED_ATTRS,
    BANNED_CALLS,
    BUILTIN_NAMES,
    BUILTINS_ALLOWED,
    DUNDER_STORE_DENIED,
    FD_OPEN_CALLS,
    FILE_CALLS,
    FS_PROBES,
    MEMBERS_ALLOWED,
    MEMBERS_DENIED,
    MODULE_ALIASES,
    NAME_ATTR_CALLS,
    RULED_MODULES,
    SAFE_MODULES,
    STDLIB_NAMES,
    SUBMODULES,
    WRAPPER_CALLS,
)

_EXIT = object()  # marks, on the walk's stack, the end of a scope's body


class _Scanner:
    """Collects ``(rule, what, line, scope)`` for one module's AST, walked with an explicit
    stack (:meth:`run`): an AST of any depth is scanned, never a ``RecursionError`` on the host
    that would leave a file the sandbox compiles unread."""

    def __init__(
        self,
        tree: ast.AST,
        first: frozenset[str] = frozenset(),
        shared: frozenset[str] = frozenset(),
        package: frozenset[str] = frozenset(),
    ) -> None:
        self.found: list[tuple[str, str, int, str]] = []
        self.refs: list[tuple[str, int, str]] = []  # (name, line, scope) of every name used
        self.modules: dict[str, str] = {}  # local name -> ruled module it is bound to
        self.imported: dict[str, str] = {}  # local name -> any module it is bound to (dotted)
        self.is_module: set[str] = set()  # local names bound by ``import X`` (a module)
        self.import_names: set[str] = set()  # every absolute module the file imports
        self.first = first  # the file's own package (:func:`first_party`)
        self.docstrings = docstrings(tree)
        # names of other code's objects (patchable): imported, and aliases of those
        self.foreign, self.aliases = foreign_names(tree, first)
        self.bound, self.plain, self.literal_names = bindings(tree)
        self.fresh, self.made = fresh_locals(tree)  # made: instances only (rule ``unbound``)
        self.flows: set[str] = set()  # names assigned, outside functions, a value with a finding
        self.from_own: list[tuple[str, str, int, str]] = []  # (module, name, line, scope)
        self.alias_of: dict[str, str] = {}  # ``from <own> import name as alias``: alias -> name
        self.scope: list[str] = []
        self.tree = tree
        self.scope_ids: list[tuple[int, bool]] = [(id(tree), False)]  # (scope, is a class)
        self.own: list[str | None] = []  # each enclosing function's unassigned first argument
        self.mine: list[str | None] = [None]  # the same, of an instance method or property only
        self.unbound, self.storing = guardself.storing_methods(tree)  # rule ``unbound`` (guardself)
        self.unbound |= shared
        # the unchanged files' storing methods, reached on a class (rule ``unbound``, guardself)
        self.package = package
        self.classes = guardself.class_aliases(tree) if package else guardself.Classes()

    def add(self, rule: str, what: str, node: ast.AST) -> None:
        self.found.append((rule, what[:80], getattr(node, "lineno", 0), ".".join(self.scope)))
        if rule != "import-not-allowed":
            self.flows |= assigned_names(node)

    def run(self, tree: ast.AST) -> None:
        """Visit every node in pre-order (children in source order), each ``visit_<Type>``
        once; a function's or class's scope is open while its children are visited."""
        stack: list[object] = [tree]
        while stack:
            node = stack.pop()
            if node is _EXIT:
                self.scope.pop()
                self.own.pop()
                self.mine.pop()
                self.scope_ids.pop()
                continue
            assert isinstance(node, ast.AST)
            visit = getattr(self, f"visit_{type(node).__name__}", None)
            if visit is not None:
                visit(node)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack.append(_EXIT)
            stack.extend(reversed(list(ast.iter_child_nodes(node))))

    def _scoped(self, node: ast.AST, own: str | None, mine: str | None = None) -> None:
        """Open ``node``'s scope; :meth:`run` closes it after its children."""
        self.scope.append(getattr(node, "name", "?"))
        self.scope_ids.append((id(node), isinstance(node, ast.ClassDef)))
        self.own.append(own)
        self.mine.append(mine)

    def _is_bound(self, name: str, node: ast.AST) -> bool:
        """Whether ``name`` is bound in an enclosing scope: the innermost (a lambda counts),
        then the enclosing functions and the module (a class body binds only for itself)."""
        parent = enclosing_scope(node)
        chain = [i for i, is_class in self.scope_ids[:-1] if not is_class]
        ids = [*chain, self.scope_ids[-1][0], id(parent)]
        return any(name in self.bound.get(i, ()) for i in ids)

    def _local(self, name: str, node: ast.AST) -> bool:
        """Whether ``name`` is a local variable here (bound, not by an import, in an enclosing
        function, class body or lambda): a local ``copy`` is not the module ``copy``."""
        parent = enclosing_scope(node)
        chain = [i for i, is_class in self.scope_ids[1:-1] if not is_class]
        ids = [*chain, *[i for i, _ in self.scope_ids[-1:] if i != self.scope_ids[0][0]]]
        if parent is not None and parent is not self.tree:
            ids.append(id(parent))
        return any(name in self.plain.get(i, ()) for i in ids)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = [*node.args.posonlyargs, *node.args.args]
        kind = guardself.method_kind(node, self.scope_ids[-1][1])
        # only a method's ``self``/``cls`` is the object the call is about
        first = args[0].arg if args and kind else None
        rebound = any(
            isinstance(n, ast.Name) and n.id == first and not isinstance(n.ctx, ast.Load)
            for stmt in node.body
            for n in ast.walk(stmt)
        )
        own = None if rebound else first
        self._scoped(node, own, own if kind in ("instance", "property") else None)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for what in new_metaclass(node):
            self.add("metaclass", what, node)
        self._scoped(node, None)

    def _ours(self, module: str) -> bool:
        return top_name(module) in self.first

    def _bind(self, local: str, module: str) -> None:
        self.imported[local] = module
        name = module.split(".")[-1].lstrip("_")
        if module in RULED_MODULES:
            self.modules[local] = module
        elif name in MODULE_ALIASES and name in RULED_MODULES and module != name:
            self.modules[local] = name  # ``from shutil import os``

    def _import(self, module: str, node: ast.AST) -> None:
        """The import rules for one absolute module name."""
        self.import_names.add(module)
        if self._ours(module) or module == "__future__":
            return
        if banned_module(module) or any(p.startswith("_") for p in module.split(".")):
            self.add("import", module, node)
        elif module not in SAFE_MODULES:
            self.add("import-not-allowed", module, node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._import(alias.name, node)
            local = alias.asname or top_name(alias.name)
            self._bind(local, alias.name if alias.asname else top_name(alias.name))
            self.is_module.add(local)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        for alias in node.names:  # importing a helper by name is a use of it (rule ``helper``)
            self.ref(alias.name, node)
            if alias.asname:
                self.alias_of[alias.asname] = alias.name
        if node.level:
            return  # the package's own modules (a tainted helper there: residual risk)
        if self._ours(mod):
            self.from_own += [(mod, a.name, node.lineno, ".".join(self.scope)) for a in node.names]
        self._import(mod, node)
        for alias in node.names:
            self._from_name(mod, alias, node)

    def _from_name(self, mod: str, alias: ast.alias, node: ast.ImportFrom) -> None:
        name, full = alias.name, f"{mod}.{alias.name}"
        if mod in RULED_MODULES:
            self._module_attr(mod, name, node)
        if not mod and banned_module(name):
            self.add("import", name, node)
        banned = banned_module(name) or banned_module(full)
        if name in BANNED_ATTRS or bad_dunder(name) or banned and mod != "__future__":
            self.add("import", full, node)
        if not self._ours(mod) and (private(name) or self._foreign_module(name)):
            self.add("module-attr", full, node)
        if name in NAME_ATTR_CALLS and alias.asname not in (None, name):
            self.add("dynamic-attr", f"{name} as {alias.asname}", node)
        self._bind(alias.asname or name, full)
        if name in SUBMODULES.get(mod, {}):
            self.is_module.add(alias.asname or name)  # ``from os import path``

    def _submodule(self, base: ast.AST, attr: str, node: ast.Attribute) -> None:
        """``X.Y`` where ``Y`` is a module inside a reviewed module ``X``: a finding when ``Y``
        is not reviewed itself (``enum.bltns`` is ``builtins``), and when used as a value."""
        owner = self._dotted(base)
        owner = {"os.path": "posixpath"}.get(owner or "", owner)
        real = SUBMODULES.get(owner or "", {}).get(attr)
        if real is None:
            return
        if real not in SAFE_MODULES and top_name(real) not in SAFE_MODULES:
            self.add("module-attr", f"{owner}.{attr} ({real})", node)
        parent = getattr(node, "_parent", None)
        if not (isinstance(parent, ast.Attribute) and parent.value is node):
            self.add("module-value", f"{owner}.{attr}", node)

    def _foreign_module(self, name: str) -> bool:
        """A standard-library module that is neither reviewed nor imported by the file."""
        return name in STDLIB_NAMES and name not in SAFE_MODULES and name != "path"

    def _module_attr(self, module: str, attr: str, node: ast.AST) -> None:
        allowed, denied = MEMBERS_ALLOWED.get(module), MEMBERS_DENIED.get(module, ())
        if (allowed is not None and attr not in allowed) or attr in denied:
            self.add("module-attr", f"{module}.{attr}", node)

    def _dotted(self, node: ast.AST, ours: bool = True) -> str | None:
        """``pkg.sub.name`` when ``node`` is an attribute chain on an imported module (not one
        of the file's own package unless ``ours``)."""
        attrs: list[str] = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or self._local(node.id, node):
            return None
        base = self.imported.get(node.id)
        if not base or not ours and self._ours(base):
            return None
        return ".".join([base, *reversed(attrs)])

    def _own_dict(self, node: ast.Attribute) -> bool:
        """``self.__dict__`` on the enclosing method's first argument, never rebound there."""
        own = self.own[-1] if self.own else None
        return node.attr == "__dict__" and isinstance(node.value, ast.Name) and node.value.id == own

    def ref(self, name: str, node: ast.AST) -> None:
        self.refs.append((name, getattr(node, "lineno", 0), ".".join(self.scope)))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.ref(node.attr, node)
        base, attr = node.value, node.attr
        self._unbound(node)
        if not isinstance(node.ctx, ast.Load):
            self._store(base, attr, node)
        own = isinstance(base, ast.Name) and self._local(base.id, base)
        if isinstance(base, ast.Name) and base.id in self.modules and not own:
            self._module_attr(self.modules[base.id], attr, node)
        elif (dotted := self._dotted(base)) and dotted in RULED_MODULES:
            self._module_attr(dotted, attr, node)  # ``os.path.exists``
        if isinstance(base, ast.Name) and base.id in self.is_module and not own:
            module = self.imported[base.id]
            if not self._ours(module) and (private(attr) or self._foreign_module(attr)):
                self.add("module-attr", f"{module}.{attr}", node)
        self._submodule(base, attr, node)
        if not isinstance(node.ctx, ast.Load) and attr in DUNDER_STORE_DENIED:
            self.add("dunder", f"{attr} assigned", node)
        if attr in ("eval", "exec", "breakpoint"):
            self.add("call", attr, node)  # ``enum.bltns.exec``: the builtin by another path
        if (
            (attr in BANNED_ATTRS and not self._own_dict(node))
            or CO_ATTR.match(attr)
            or attr.lstrip("_") in MODULE_ALIASES
        ):
            self.add("attr", attr, node)
        if bad_dunder(attr):
            self.add("dunder", attr, node)
        if attr in FS_PROBES:
            self.add("fs-probe", attr, node)
        dotted = self._dotted(node)
        if dotted and banned_module(dotted) and not banned_module(dotted.rsplit(".", 1)[0]):
            self.add("attr", dotted, node)  # ``logging.config``
        if attr in NAME_ATTR_CALLS and not called(node):
            self.add("dynamic-attr", f"{attr} as a value", node)
        if attr in ("format", "format_map") and not self._literal(base):
            self.add("format", f"{attr} on a template that is not a literal", node)

    def _store(self, base: ast.AST, what: str, node: ast.AST) -> None:
        """An attribute store or delete fails closed: allowed on a method's ``self``/``cls``
        and on a name this scope binds only to an object it made (:func:`fresh_locals`);
        ``module-store`` on another package's object, ``attr-store`` on anything else (a
        parameter, a subscript, a call's result, a loop variable: any could be one)."""
        if self._foreign(base):
            self.add("module-store", what, node)  # ``json.JSONEncoder.encode = f``
        elif not isinstance(base, ast.Name) or not (
            base.id == (self.own[-1] if self.own else None) or self._fresh(base)
        ):
            self.add("attr-store", what, node)

    def _unbound(self, node: ast.Attribute) -> None:
        """Rule ``unbound`` (:func:`.guardself.unbound_what`) for ``x.attr``."""
        made = node.attr in self.unbound and self._fresh(node.value, self.made)
        dotted = self._dotted(node, False)
        if what := guardself.unbound_what(
            node, self.unbound, self.mine[-1], made, dotted, self.aliases
        ) or guardself.package_what(node, self.package, self.classes, self.mine[-1]):
            self.add("unbound", what, node)

    def _fresh(self, name: ast.AST, table: dict[int, set[str]] | None = None) -> bool:
        if not isinstance(name, ast.Name):
            return False
        parent = enclosing_scope(name)
        table = self.fresh if table is None else table
        return parent is not None and name.id in table.get(id(parent), ())

    def _foreign(self, node: ast.AST) -> bool:
        """Whether ``node`` is (an attribute chain on) a module, class or function the file
        imports from outside its package, a name aliasing one, or a class reached by ``type()``
        or ``__class__``: assigning its attributes patches code the grader runs too."""
        while isinstance(node, ast.Attribute):
            if node.attr == "__class__":
                return True
            node = node.value
        if isinstance(node, ast.Call):
            return isinstance(node.func, ast.Name) and node.func.id == "type"
        if not isinstance(node, ast.Name):
            return False
        return node.id in self.aliases or node.id in self.foreign and not self._local(node.id, node)

    def _literal(self, node: ast.AST) -> bool:
        """A string literal, or a name bound only ever to string literals in this file."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return True
        return isinstance(node, ast.Name) and node.id in self.literal_names

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self.ref(node.id, node)
            self._builtin(node)
            if node.id in self.storing and guardself.in_class_body(node):
                self.add("unbound", f"{node.id} in its class body", node)  # ``alias = put``
        if node.id in ("__builtins__", "__import__", "__loader__", "__spec__"):
            self.add("attr", node.id, node)
        parent = getattr(node, "_parent", None)
        module = not self._local(node.id, node) and (
            node.id in self.modules
            or node.id in self.is_module
            and not self._ours(self.imported[node.id])
        )
        if module and not (isinstance(parent, ast.Attribute) and parent.value is node):
            self.add("module-value", node.id, node)  # ``wraps(typing)`` copies its namespace
        if not isinstance(node.ctx, ast.Load) and node.id in DUNDER_STORE_DENIED:
            self.add("dunder", f"{node.id} assigned", node)
        if node.id in NAME_ATTR_CALLS | BANNED_CALLS and not called(node):
            self.add("dynamic-attr", f"{node.id} as a value", node)  # ``g = getattr``

    def _builtin(self, node: ast.Name) -> None:
        """A name the file does not bind resolves to a builtin: only reviewed ones."""
        name = node.id
        if name in BUILTINS_ALLOWED or self._is_bound(name, node):
            return
        if name in BUILTIN_NAMES or dunder(name):
            self.add("builtin", name, node)

    def visit_Call(self, node: ast.Call) -> None:
        fn = node.func
        name = (
            fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
        )
        if isinstance(fn, ast.Name) and name in BANNED_CALLS:
            self.add("call", name, node)
        if name in NAME_ATTR_CALLS or name in ("__getattribute__", "__getattr__", "__setattr__"):
            self._literal_attrs(name, node)
        if name in WRAPPER_CALLS and (node.keywords or len(node.args) > 2 - (name == "wraps")):
            self.add("dynamic-attr", f"{name} with chosen attribute names", node)
        if name in ("setattr", "delattr", "__setattr__", "__delattr__") and node.args:
            self._store(node.args[0], name, node)
        if name in FILE_CALLS:  # any added file I/O: open(3 + 0, "wb") is the event pipe
            self.add("file-io", name, node)
        if name in FD_OPEN_CALLS:
            first = node.args[0] if node.args else None
            keys = {k.arg for k in node.keywords}
            if (first is not None and numeric(first)) or keys & {"closefd", "opener", "fd"}:
                self.add("fd-open", name, node)
        if name == "type" and isinstance(fn, ast.Name) and len(node.args) + len(node.keywords) > 1:
            self.add("call", "type(name, bases, namespace)", node)
        if name == "join":
            self._built_string(node)  # ``''.join(['cod', 'erl'])``
        if name == "import_module":
            first = node.args[0] if node.args else None
            text = first.value if isinstance(first, ast.Constant) else None
            if not isinstance(text, str) or banned_module(text) or text.startswith("_"):
                self.add("dynamic-attr", "import_module without a literal, allowed name", node)

    def _literal_attrs(self, name: str, node: ast.Call) -> None:
        if name in ("attrgetter", "methodcaller"):
            args = node.args[:1] if name == "methodcaller" else node.args
        else:
            args = node.args[1:2]
        if not args or node.keywords and name != "methodcaller":
            self.add("dynamic-attr", name, node)
        for arg in args:
            if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                self.add("dynamic-attr", name, node)
            elif any(bad_name(p) for p in arg.value.split(".")):
                self.add("dynamic-attr", f"{name} {arg.value}", node)
            else:
                if name in ("getattr", "hasattr") and node.args:
                    self._as_attribute(node.args[0], arg.value, node)
                for part in arg.value.split("."):
                    self.ref(part, node)  # ``getattr(o, "helper")`` uses ``helper``
                    owner = self._dotted(node.args[0], False) if node.args else None
                    library = owner is not None and guardself.library_function(f"{owner}.{part}")
                    mine = part in self.package and name in ("attrgetter", "methodcaller")
                    if part in self.unbound | guardself.BINDERS or library or mine:
                        self.add("unbound", f"{name} {part}", node)

    def _as_attribute(self, base: ast.AST, attr: str, node: ast.Call) -> None:
        """``getattr(base, 'attr'[, default])`` is read by every attribute rule as
        ``base.attr`` (round 7: ``getattr(m, 'modules')`` where ``m.modules`` was denied)."""
        if not attr.isidentifier():
            return
        read = ast.copy_location(ast.Attribute(value=base, attr=attr, ctx=ast.Load()), node)
        read._parent = node  # type: ignore[attr-defined]
        self.visit_Attribute(read)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self._built_string(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self._built_string(node)

    def _built_string(self, node: ast.AST) -> None:
        for hit in guardreflect.built_string_hits(node):
            self.add("string", f"built: {hit}", node)

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        for attr in node.kwd_attrs:  # ``case object(sys=s)`` reads an attribute by name
            if bad_name(attr):
                self.add("dynamic-attr", f"match {attr}=", node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        if isinstance(value, str) and id(node) not in self.docstrings:
            hits = string_hits(value)
            for hit in hits or (["coderl"] if "coderl" in value.lower() else []):
                self.add("string", hit, node)
            for field in format_fields(value):
                self.add("format-field", field, node)
