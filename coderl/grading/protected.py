"""The paths an agent may not change: test files, test configuration, import hooks, caches and
modules that would shadow the standard library or pytest.

:func:`is_protected` decides a single path; :func:`strip_protected` removes the chunks of a diff
that touch one (a text parse, used only for function tasks, whose sandbox holds nothing but the
solution file; repository grading decides on the tree git produced, ``coderl.grading.grade``).
"""

from __future__ import annotations

import fnmatch
import sys

from coderl.tasks.patches import split_diff

PROTECTED_PATTERNS: tuple[str, ...] = (
    "**/test_*.py",
    "**/*_test.py",
    "**/tests/**",
    "**/test/**",
    "**/testing/**",
    "**/conftest.py",
    # every file pytest may take as its configuration, at any depth: the graded run reads only
    # the one ``coderl.grading.pytestcfg.run_config`` names, which must be the base's copy
    "**/pytest.toml",
    "**/.pytest.toml",
    "**/pytest.ini",
    "**/.pytest.ini",
    "**/pyproject.toml",
    "**/tox.ini",
    "**/setup.cfg",
    "noxfile.py",
    "**/*.pth",
    "**/sitecustomize.py",
    "**/usercustomize.py",
    "**/__pycache__/**",
    "**/*.pyc",
    "**/*.so",  # native modules: imported before the source beside them, read by no guard
    "**/*.pyd",
    "**/*.dylib",
    "**/.pytest_cache/**",
    ".hypothesis/**",
    "**/*.dist-info",
    "**/*.dist-info/**",
    "**/*.egg-info",
    "**/*.egg-info/**",
    "**/*.egg-link",
    "**/.git/**",
)
SHADOW_NAMES = frozenset(sys.stdlib_module_names) | {
    "pytest",
    "_pytest",
    "pluggy",
    "py",
    "coderl_results",
    "coderl_boot",
}


def is_protected(
    path: str,
    extra: tuple[str, ...] | list[str] = (),
    source_roots: tuple[str, ...] = (".",),
    shadow: frozenset[str] = frozenset(),
) -> bool:
    """Whether a workspace-relative path may not be changed by the agent: it matches a pattern
    of ``PROTECTED_PATTERNS`` or ``extra``, or its top-level module name (under a source root)
    is in ``SHADOW_NAMES`` or ``shadow`` (e.g. the virtualenv's modules, ``coderl.grading.grade.venv_modules``)."""
    path = path.lstrip("/")
    for pattern in (*PROTECTED_PATTERNS, *extra):
        if fnmatch.fnmatch(path, pattern):
            return True
        if pattern.startswith("**/") and fnmatch.fnmatch(path, pattern[3:]):
            return True
    for root in source_roots:
        rel = (
            path
            if root == "."
            else (path[len(root) + 1 :] if path.startswith(root + "/") else None)
        )
        if rel is not None:
            top = rel.split("/")[0]
            name = top[:-3] if top.endswith(".py") and "/" not in rel else top
            if name in SHADOW_NAMES or name in shadow:
                return True
    return False


def strip_protected(
    diff: str, extra: tuple[str, ...] | list[str] = (), source_roots: tuple[str, ...] = (".",)
) -> tuple[str, list[str]]:
    """Remove every per-file chunk that touches a protected path; returns ``(diff, removed)``.

    A text parse of the diff: used only for function tasks, whose sandbox holds nothing but the
    solution file. Repository tasks decide on the tree git produced (``patches.apply_to_copy``).
    """
    kept, removed = [], []
    for path, chunk in split_diff(diff):
        touched = [path] + [
            ln.split(" ", 2)[2].strip()
            for ln in chunk.splitlines()
            if ln.startswith(("rename from ", "copy from "))
        ]
        if not path or any(is_protected(p, extra, source_roots) for p in touched):
            removed.append(path or "<unparsed chunk>")
        else:
            kept.append(chunk)
    return "".join(kept), removed
