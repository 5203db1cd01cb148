"""coderl's import graph, as the import-graph tests read it: every ``coderl`` module and the
``coderl`` modules it imports, at module level or inside functions (lazy imports close a
circle at run time just the same; ``TYPE_CHECKING`` imports count too)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parent.parent


def modules() -> dict[str, Path]:
    mods = {}
    for p in (ROOT / "coderl").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every coderl module ``name`` imports, at module level or inside functions (lazy
    imports count: they close a circle at run time just the same)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
    return {m for m in out if m in mods and m != name}


def cycle_through(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A shortest import path from ``start`` back to itself, or None."""
    frontier, seen = [[start]], {start}
    while frontier:
        nxt = []
        for path in frontier:
            for m in sorted(graph[path[-1]]):
                if m == start:
                    return [*path, m]
                if m not in seen:
                    seen.add(m)
                    nxt.append([*path, m])
        frontier = nxt
    return None


def import_graph(mods: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Module -> the coderl modules it imports."""
    mods = modules() if mods is None else mods
    return {m: imports(m, p, mods) for m, p in mods.items()}
