"""Held-out tests of repository tasks and the rollout workspace that leaves them out.

A share of each repository task's tests is *held out*: the test functions behind those ids are
absent from the workspace the agent works in, and the grader runs them from the pristine test
files mounted read-only at grading. A fix that special-cases the tests the agent can see does not
resolve the task. The share is chosen per test function (all parameterisations of a function go
together) from the task's own id and test lists, so it is the same on every machine and needs no
files: of the FAIL_TO_PASS functions, half (at least one) are held out, keeping at least one
visible when there are two or more; of the remaining PASS_TO_PASS functions, ``P2P_SHARE``.
Only functions defined in the class their id names can be hidden (an inherited test method's
code is in a base class the agent sees); ``coderl tasks synth`` and the shipped task files
record the choice made with that knowledge (:func:`hideable_in`).

The rollout workspace is the task's starting state (snapshot + ``bug_patch``) with the held-out
functions blanked out of their test files (replaced by ``pass`` and blank lines, so every other
line keeps its number) and without what could reveal the original code or the gold patch:
version-control data, bytecode caches, ``*.pyc``, ``*.egg-info``, test caches, build leftovers.

Not held out: doctest items and other ids that do not name a function in a test file.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from coderl.tasks.patches import materialize
from coderl.tasks.snapshot import cache_dir

P2P_SHARE = 0.2
"""Share of the PASS_TO_PASS test functions held out (rounded down)."""
REVEALING_DIRS = frozenset(
    {".git", ".hg", ".svn", "__pycache__", ".pytest_cache", ".tox", ".nox", ".eggs", ".mypy_cache"}
)
"""Directory names never copied into a rollout workspace (plus any ``*.egg-info``)."""
REVEALING_SUFFIXES = (".pyc", ".pyo", ".orig", ".rej")
"""File suffixes never copied into a rollout workspace."""


def function_of(node_id: str) -> str | None:
    """``path.py::[Class::]name`` without parameters, or None for ids that are not test functions
    in a test file (doctests, nested classes, non-Python files)."""
    parts = node_id.split("[", 1)[0].split("::")
    if len(parts) not in (2, 3) or not parts[0].endswith(".py"):
        return None
    name = os.path.basename(parts[0])
    if not (name.startswith("test_") or name.endswith("_test.py")):
        return None
    return "::".join(parts)


def visible_fail_to_pass(task: Any) -> list[str]:
    """The FAIL_TO_PASS ids whose tests are in the rollout workspace: less the held-out ones and
    those in the task's hidden test files (a function task's check: none are visible)."""
    held = set(getattr(task, "held_out_tests", ()))
    hidden = set(getattr(task, "hidden_tests", {}) or {})
    return [i for i in task.FAIL_TO_PASS if i not in held and i.split("::", 1)[0] not in hidden]


def _ranked(task_id: str, keys: Iterable[str]) -> list[str]:
    return sorted(keys, key=lambda k: hashlib.sha256(f"{task_id}\0{k}".encode()).hexdigest())


def choose_held_out(
    task_id: str,
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    hideable: Callable[[str], bool] | None = None,
) -> list[str]:
    """The held-out ids (a sorted subset of ``fail_to_pass + pass_to_pass``); deterministic.

    ``hideable(function key)`` filters the candidates (:func:`hideable_in` a snapshot: the
    function is defined in the class its id names, not inherited from a base class the agent
    sees anyway). Without it every test function in a test file is a candidate.
    """
    ok = hideable or (lambda key: True)
    f2p = list(dict.fromkeys(f for f in map(function_of, fail_to_pass) if f and ok(f)))
    p2p = [f for f in map(function_of, pass_to_pass) if f and f not in f2p and ok(f)]
    p2p = list(dict.fromkeys(p2p))
    n_f2p = 1 if len(f2p) == 1 else len(f2p) // 2
    hidden = set(_ranked(task_id, f2p)[:n_f2p])
    hidden |= set(_ranked(task_id, p2p)[: int(len(p2p) * P2P_SHARE)])
    return sorted(i for i in {*fail_to_pass, *pass_to_pass} if function_of(i) in hidden)


def defined_tests(
    tree: ast.Module,
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """``(name or Class::name, node)`` for every function defined at module level or in a
    top-level class, including definitions under ``if``/``try``/``with`` (every branch)."""

    def visit(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, Any]]:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef) and not prefix:
                yield from visit(node.body, f"{node.name}::")
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for field in ("body", "orelse", "finalbody"):
                    yield from visit(getattr(node, field, []), prefix)
                for handler in getattr(node, "handlers", []):
                    yield from visit(handler.body, prefix)

    yield from visit(tree.body, "")


def blank_functions(source: str, names: set[str], *, strict: bool = True) -> str:
    """``source`` with the test functions ``names`` (``name`` or ``Class::name``, as in
    :func:`defined_tests`) blanked out: decorators and body become blank lines, the ``def``
    line becomes ``pass``, so every other line keeps its number.

    Raises KeyError naming the functions not found (``strict``; otherwise they are left: an
    inherited method cannot be hidden without hiding it from every class).
    """
    lines = source.splitlines(keepends=True)
    found: set[str] = set()
    for key, node in defined_tests(ast.parse(source)):
        if key not in names:
            continue
        found.add(key)
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        assert node.end_lineno is not None
        indent = lines[node.lineno - 1][: node.col_offset]
        for n in range(first - 1, node.end_lineno):
            lines[n] = "\n"
        lines[node.lineno - 1] = f"{indent}pass\n"
    if strict and names - found:
        raise KeyError(f"test functions not found: {sorted(names - found)}")
    return "".join(lines)


def hideable_in(snapshot: Path) -> Callable[[str], bool]:
    """``key -> bool``: whether test function ``path::[Class::]name`` is defined in its file
    under ``snapshot`` (see :func:`defined_tests`), so blanking it hides it."""
    seen: dict[str, set[str]] = {}

    def hideable(key: str) -> bool:
        path, _, name = key.partition("::")
        if path not in seen:
            try:
                tree = ast.parse((snapshot / path).read_text(encoding="utf-8"))
                seen[path] = {k for k, _ in defined_tests(tree)}
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                seen[path] = set()
        return name in seen[path]

    return hideable


def revealing(rel: str) -> bool:
    """Whether workspace path ``rel`` is a cache, VCS or build leftover kept out of rollouts."""
    parts = rel.split("/")
    if any(p in REVEALING_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
        return True
    return parts[-1].endswith(REVEALING_SUFFIXES) or parts[-1].endswith(".egg-info")


def build_rollout_base(base: Path, held_out: list[str], target: Path) -> Path:
    """Write the rollout workspace of a task whose starting state is ``base`` to ``target``
    (hard links for unchanged files, fresh files where functions were blanked); reused when it
    exists. Held-out ids whose function is not defined in their file stay visible (task files
    written before the field existed get a file-blind choice). Raises KeyError when a held-out
    test file is not in the base."""
    if target.exists():
        return target
    by_file: dict[str, set[str]] = {}
    for node_id in held_out:
        key = function_of(node_id)
        if key is not None:
            path, _, name = key.partition("::")
            by_file.setdefault(path, set()).add(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".rollout-"))
    try:
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = Path(dirpath).relative_to(base)
            dirnames[:] = [d for d in dirnames if not revealing((rel_dir / d).as_posix() + "/x")]
            (staging / rel_dir).mkdir(parents=True, exist_ok=True)
            for name in filenames:
                rel = (rel_dir / name).as_posix()
                if revealing(rel):
                    continue
                if rel in by_file:
                    text = (base / rel).read_text(encoding="utf-8")
                    (staging / rel).write_text(blank_functions(text, by_file[rel], strict=False))
                    os.chmod(staging / rel, 0o644)
                else:
                    os.link(base / rel, staging / rel, follow_symlinks=False)
        missing = set(by_file) - {p for p in by_file if (base / p).is_file()}
        if missing:
            raise KeyError(f"held-out test files not in the base: {sorted(missing)}")
        os.chmod(staging, 0o755)
        try:
            staging.rename(target)
        except OSError:  # another process built it first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def rollout_workspace(snapshot: Path, bug_patch: str, held_out: list[str]) -> Path:
    """The rollout base of a task over ``snapshot`` (cached under ``<cache>/bases``): its
    starting state (:func:`~coderl.tasks.patches.materialize`) through :func:`build_rollout_base`.
    Raises PatchError or KeyError."""
    start = materialize(snapshot, bug_patch)
    key = hashlib.sha256("\0".join([start.name, *held_out]).encode()).hexdigest()[:16]
    return build_rollout_base(start, held_out, cache_dir() / "bases" / f"{key}-rollout")


def held_out_source(snapshot: Path, held_out: Iterable[str]) -> list[str]:
    """The source lines (decorators to last line) of the held-out test functions defined in
    their files under ``snapshot``: what a problem statement must not quote."""
    by_file: dict[str, set[str]] = {}
    for key in filter(None, map(function_of, held_out)):
        path, _, name = key.partition("::")
        by_file.setdefault(path, set()).add(name)
    out: list[str] = []
    for path, names in sorted(by_file.items()):
        try:
            source = (snapshot / path).read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for key, node in defined_tests(tree):
            if key in names and node.end_lineno is not None:
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out += lines[first - 1 : node.end_lineno]
    return out
