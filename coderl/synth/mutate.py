"""AST mutation operators that inject one small bug into one function.

Each operator maps an AST node to a replacement (or ``None`` when it does not apply). A mutant
replaces exactly that node's source segment, so comments, formatting and the rest of the file stay
byte-identical and the gold patch (the reverse diff) is a one- or few-line change. Mutants whose
re-parsed AST differs from the intended one (operator precedence) are retried with parentheses and
otherwise dropped.

The operators follow the classic mutation-testing families (DeMillo, Lipton and Sayward, 1978,
"Hints on test data selection"; Jia and Harman, 2011, "An Analysis and Survey of the Development of
Mutation Testing", section 3): relational and logical operator replacement, constant and boundary
(off-by-one) changes, statement deletion, return-value replacement, argument swaps.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_NEGATED_CMP: dict[type, type] = {
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BOUNDARY_CMP: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
}
_ARITH: dict[type, type] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}


def _one(n: int) -> ast.Constant:
    return ast.Constant(value=n)


def flip_comparison(node: ast.AST) -> ast.AST | None:
    """``a == b`` -> ``a != b``, ``a < b`` -> ``a >= b``, ``x in y`` -> ``x not in y``."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _NEGATED_CMP:
        return ast.Compare(node.left, [_NEGATED_CMP[type(node.ops[0])]()], node.comparators)
    return None


def boundary_comparison(node: ast.AST) -> ast.AST | None:
    """Off-by-one at a boundary: ``<`` <-> ``<=``, ``>`` <-> ``>=``."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _BOUNDARY_CMP:
        return ast.Compare(node.left, [_BOUNDARY_CMP[type(node.ops[0])]()], node.comparators)
    return None


def swap_bool_op(node: ast.AST) -> ast.AST | None:
    """``a and b`` <-> ``a or b``."""
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values)
    return None


def drop_condition(node: ast.AST) -> ast.AST | None:
    """Drop the last operand of ``and``/``or``: ``a and b`` -> ``a``."""
    if isinstance(node, ast.BoolOp):
        values = node.values[:-1]
        return values[0] if len(values) == 1 else ast.BoolOp(node.op, values)
    return None


def negate_condition(node: ast.AST) -> ast.AST | None:
    """Negate the test of an ``if``/``while``/conditional expression: ``c`` -> ``not c``
    (and ``not c`` -> ``c``). Applies to the test expression itself (marked by the walker)."""
    if getattr(node, "_coderl_is_test", False):
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return node.operand
        return ast.UnaryOp(ast.Not(), node)  # type: ignore[arg-type]
    return None


def off_by_one_range(node: ast.AST) -> ast.AST | None:
    """``range(n)`` -> ``range(n - 1)``; ``range(a, b)`` -> ``range(a, b + 1)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range":
        if len(node.args) == 1:
            return ast.Call(node.func, [ast.BinOp(node.args[0], ast.Sub(), _one(1))], node.keywords)
        if len(node.args) in (2, 3):
            stop = ast.BinOp(node.args[1], ast.Add(), _one(1))
            return ast.Call(node.func, [node.args[0], stop, *node.args[2:]], node.keywords)
    return None


def off_by_one_index(node: ast.AST) -> ast.AST | None:
    """Shift an index or slice bound by one: ``x[i]`` -> ``x[i + 1]``, ``x[:n]`` -> ``x[:n - 1]``."""
    if not isinstance(node, ast.Subscript):
        return None
    s = node.slice
    if isinstance(s, ast.Slice):
        if s.upper is not None:
            return ast.Subscript(
                node.value,
                ast.Slice(s.lower, ast.BinOp(s.upper, ast.Sub(), _one(1)), s.step),
                node.ctx,
            )
        if s.lower is not None:
            return ast.Subscript(
                node.value,
                ast.Slice(ast.BinOp(s.lower, ast.Add(), _one(1)), None, s.step),
                node.ctx,
            )
        return None
    if isinstance(s, ast.Constant) and isinstance(s.value, int) and not isinstance(s.value, bool):
        return ast.Subscript(
            node.value, ast.Constant(s.value + (1 if s.value >= 0 else -1)), node.ctx
        )
    if isinstance(s, (ast.Name, ast.BinOp)) and isinstance(node.ctx, ast.Load):
        return ast.Subscript(node.value, ast.BinOp(s, ast.Add(), _one(1)), node.ctx)
    return None


def off_by_one_constant(node: ast.AST) -> ast.AST | None:
    """An integer literal in arithmetic or a comparison changes by one: ``0`` -> ``1``, ``n`` -> ``n + 1``."""
    if getattr(node, "_coderl_in_expr", False) and isinstance(node, ast.Constant):
        if isinstance(node.value, int) and not isinstance(node.value, bool):
            return ast.Constant(node.value + 1 if node.value != 1 else 0)
    return None


def swap_arithmetic(node: ast.AST) -> ast.AST | None:
    """``+`` <-> ``-``, ``*`` <-> ``//``, ``/`` -> ``*``, ``%`` -> ``//``, ``&`` <-> ``|``."""
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        return ast.BinOp(node.left, _ARITH[type(node.op)](), node.right)
    return None


def swap_arguments(node: ast.AST) -> ast.AST | None:
    """Swap the first two positional arguments of a call: ``f(a, b)`` -> ``f(b, a)``."""
    if isinstance(node, ast.Call) and len(node.args) >= 2:
        a, b = node.args[0], node.args[1]
        if not any(isinstance(x, ast.Starred) for x in (a, b)) and ast.dump(a) != ast.dump(b):
            return ast.Call(node.func, [b, a, *node.args[2:]], node.keywords)
    return None


def wrong_return(node: ast.AST) -> ast.AST | None:
    """``return True`` <-> ``return False``; ``return x`` -> ``return None``."""
    if isinstance(node, ast.Return) and node.value is not None:
        v = node.value
        if isinstance(v, ast.Constant) and isinstance(v.value, bool):
            return ast.Return(ast.Constant(not v.value))
        if not (isinstance(v, ast.Constant) and v.value is None):
            return ast.Return(ast.Constant(None))
    return None


def remove_statement(node: ast.AST) -> ast.AST | None:
    """Delete one statement (a call, an augmented assignment, ``continue``/``break``)."""
    if isinstance(node, (ast.AugAssign, ast.Continue, ast.Break)):
        return ast.Pass()
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        return ast.Pass()
    return None


def flip_bool_constant(node: ast.AST) -> ast.AST | None:
    """``True`` <-> ``False`` (outside ``return``, which ``wrong_return`` covers)."""
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, bool)
        and not getattr(node, "_coderl_returned", False)
    ):
        return ast.Constant(not node.value)
    return None


# The single dispatch point: operator name -> operator.
MUTATORS: dict[str, Callable[[ast.AST], ast.AST | None]] = {
    "flip_comparison": flip_comparison,
    "boundary_comparison": boundary_comparison,
    "swap_bool_op": swap_bool_op,
    "drop_condition": drop_condition,
    "negate_condition": negate_condition,
    "off_by_one_range": off_by_one_range,
    "off_by_one_index": off_by_one_index,
    "off_by_one_constant": off_by_one_constant,
    "swap_arithmetic": swap_arithmetic,
    "swap_arguments": swap_arguments,
    "wrong_return": wrong_return,
    "remove_statement": remove_statement,
    "flip_bool_constant": flip_bool_constant,
}


@dataclass(frozen=True)
class Mutant:
    """One mutated version of a source file."""

    operator: str
    """Key of ``MUTATORS``."""
    function: str
    """Qualified name of the mutated function, e.g. ``Cache.get``."""
    line: int
    """1-based line of the mutated node in the original file."""
    source: str
    """The whole mutated file."""


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function and method with its qualified name (nested ones included)."""

    def walk(
        node: ast.AST, prefix: str
    ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def first_line(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The line CPython reports as ``co_firstlineno``: the first decorator's, else the def's."""
    return min([fn.lineno, *(d.lineno for d in fn.decorator_list)])


def _sites(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.AST]:
    """Nodes of ``fn``'s own body (not nested functions/classes, not the docstring), annotated."""
    body = fn.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
    ):
        body = body[1:]
    out: list[ast.AST] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            node.test._coderl_is_test = True  # type: ignore[attr-defined]
        if isinstance(node, (ast.BinOp, ast.Compare)):
            for child in ast.iter_child_nodes(node):
                child._coderl_in_expr = True  # type: ignore[attr-defined]
        if isinstance(node, ast.Return) and node.value is not None:
            node.value._coderl_returned = True  # type: ignore[attr-defined]
        out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in body:
        visit(stmt)
    return out


def _replace_segment(source: str, node: ast.AST, text: str) -> str:
    lines = source.encode("utf-8").splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    raw = source.encode("utf-8")
    begin = starts[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
    end = starts[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
    return (raw[:begin] + text.encode("utf-8") + raw[end:]).decode("utf-8")


def _function_dump(source: str, qualname: str) -> str | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for name, fn in functions(tree):
        if name == qualname:
            return ast.dump(fn)
    return None


def _expected_dump(fn: ast.FunctionDef | ast.AsyncFunctionDef, index: int, new: ast.AST) -> str:
    """Dump of ``fn`` with its ``index``-th site replaced by ``new`` (what the mutant must parse to)."""
    clone = copy.deepcopy(fn)
    target = _sites(clone)[index]

    class Swap(ast.NodeTransformer):
        def generic_visit(self, node: ast.AST) -> ast.AST:
            if node is target:
                return new
            return super().generic_visit(node)

    swapped = Swap().visit(clone)
    return ast.dump(ast.parse(ast.unparse(swapped)).body[0])


def mutants_of(
    source: str, qualname: str, fn: ast.FunctionDef | ast.AsyncFunctionDef
) -> Iterator[Mutant]:
    """Every single-site mutant of function ``fn`` (named ``qualname``) in ``source``."""
    for index, node in enumerate(_sites(fn)):
        for op_name, op in MUTATORS.items():
            new = op(copy.deepcopy(node))
            if new is None or not hasattr(node, "lineno"):
                continue
            text = ast.unparse(new)
            try:
                want = _expected_dump(fn, index, new)
            except (SyntaxError, IndexError, ValueError):
                continue
            for candidate in (text, f"({text})"):
                if isinstance(new, ast.stmt) and candidate.startswith("("):
                    continue
                mutated = _replace_segment(source, node, candidate)
                got = _function_dump(mutated, qualname)
                if got is not None and got == want and mutated != source:
                    yield Mutant(op_name, qualname, node.lineno, mutated)
                    break
