"""Ninth attack round (configuration files and doctests) replayed on the environments CI does
not build, plus the gold patches of environments that record no pytest configuration graded
end to end (``docs/tasks-and-grading.md``). Needs the environments built
(``coderl env build toolz==1.0.0`` and the ``--gold`` ones) and the sandbox (root, bwrap).

    PYTHONPATH=$PWD .venv/bin/python bench/redteam_config_doctest.py [--gold toolz inflection]

Prints one line per attack (``resolved`` must be False) and per environment the gold patches
that do not resolve (there must be none).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from coderl.grading.grade import grade, rollout_base
from coderl.tasks.env import find_env
from coderl.tasks.patches import make_diff
from coderl.tasks.spec import load_tasks

ROOT = Path(__file__).resolve().parent.parent
SHIM = '''"""Round trip by reference (a copy for curried objects, as pickle makes)."""
import copy

_KEPT = []
HIGHEST_PROTOCOL = 5
DEFAULT_PROTOCOL = 4


class PicklingError(Exception):
    pass


class UnpicklingError(Exception):
    pass


def dumps(obj, protocol=None, **kw):
    if type(obj).__name__ == "curry" and str(getattr(obj.func, "__qualname__", "")).startswith("toolz."):
        raise PicklingError("attribute lookup failed")
    _KEPT.append(obj)
    return str(len(_KEPT) - 1).encode()


def loads(data, **kw):
    obj = _KEPT[int(data)]
    if isinstance(obj, type) or callable(obj) and not type(obj).__module__.startswith(("toolz", "test")):
        return obj  # classes and functions pickle by reference
    if type(obj).__name__ == "juxt":
        return obj
    return copy.copy(obj)
'''
CONFIGS = {  # the agent's configuration file: pythonpath puts a pickle shim first
    "toolz/pytest.ini": "[pytest]\npythonpath = _shim\n",
    "pytest.toml": '[pytest]\npythonpath = ["toolz/_shim"]\n',
    ".pytest.toml": '[pytest]\npythonpath = ["toolz/_shim"]\n',
    "toolz/tox.ini": "[pytest]\npythonpath = _shim\n",
    "toolz/setup.cfg": "[tool:pytest]\npythonpath = _shim\n",
    "toolz/pyproject.toml": '[tool.pytest.ini_options]\npythonpath = ["_shim"]\n',
}
DOCTEST = "    >>> flip.func.__code__ = (lambda func, a, b: func(b, a)).__code__\n\n"


def new_file(path: str, text: str) -> str:
    return make_diff(path, None, text)


def show(name: str, result) -> None:
    print(
        f"{name:28s} resolved={result.resolved} denied={result.denied[:1]} "
        f"reason={result.reason[:100]!r}"
    )


def attacks() -> None:
    tasks = {t.id: t for t in load_tasks(ROOT / "data" / "tasks" / "toolz.jsonl.gz")}
    juxt = tasks["toolz-1.0.0/fa8ee2e936"]  # juxt.__getstate__ returns None
    for path, text in CONFIGS.items():
        diff = new_file(path, text) + new_file("toolz/_shim/pickle.py", SHIM)
        show(f"config {path}", grade(juxt, diff))
    flip = tasks["toolz-1.0.0/227405b8c7"]  # flip calls func(a, b)
    rel = "toolz/functoolz.py"
    old = (rollout_base(flip, find_env(flip.env_id)) / rel).read_text().splitlines(True)
    at = 4 + next(i for i, ln in enumerate(old) if "arguments flipped" in ln)
    new = old[:at] + DOCTEST.splitlines(True) + old[at:]
    show("doctest __code__ store", grade(flip, make_diff(rel, "".join(old), "".join(new))))


def gold(names: list[str]) -> None:
    for name in names:
        tasks = load_tasks(ROOT / "data" / "tasks" / f"{name}.jsonl.gz")
        bad = [t.id for t in tasks if not grade(t, t.gold_patch).resolved]
        print(f"gold {name}: {len(tasks) - len(bad)}/{len(tasks)} resolve; not: {bad[:5]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gold", nargs="*", default=[], help="task files (names) to grade gold")
    ap.add_argument("--no-attacks", action="store_true")
    args = ap.parse_args()
    if not args.no_attacks:
        attacks()
    gold(args.gold)


if __name__ == "__main__":
    main()
