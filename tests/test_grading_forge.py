"""Red team round 7 (A22), the class "the tested code rewrites the verdict the plugin keeps":
a library function the tests call reaches the plugin module (``sys.modules`` through a released
``f_globals``) and rewrites the current test's entry with a ``str`` subclass whose ``==`` lies,
keyed on "this test called my code" (so the canaries, which never call the library, stay true
and the second run agrees). Two halves close it, each tested here with several members:

- runtime: the plugin keeps no per-test state in a module global and compares outcomes by
  identity with its own constants; a rewrite of its closure's state is caught by the cross-check
  against pytest's own counts (the plugin runs here in a subprocess, started as the worker
  starts it but without the sandbox, the observer or the canaries);
- guard: the same forge through released reflective uses other than A22's ``tb_frame``
  (``sys._getframe``, ``inspect.currentframe``, a function's ``__globals__``) is denied, and
  attribute names and module names spelled another way are read as written (graded on six:
  ``tests/test_grading_redteam.py::test_code_rewritten_around_a_released_frame_use_is_denied``).

Round 8 (issue 47): the rest of the plugin's module-level state (its alias of ``os.write``, its
encoder, its spec, its tripwires' records) moved into the hooks' closures, and a rebound module
name is tampering (``MODULE_FORGES``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coderl.grading.diffguard import added_findings

PLUGIN_DIR = Path(__file__).parent.parent / "coderl" / "grading" / "pytest_plugin"

RUN = """
import os, sys, json, threading
sys.path.insert(0, sys.argv[1])
import coderl_results as cr, pytest
r, w = os.pipe(); cr_, cw = os.pipe()
os.write(cw, b'{"canaries": [], "placement": ""}\\n')
cr.start(w, cr_, {}, "tok")
out = []
t = threading.Thread(target=lambda: out.append(b"".join(iter(lambda: os.read(r, 65536), b""))))
t.start()
pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", sys.argv[2]], plugins=[cr])
os.close(w); t.join()
open(sys.argv[3], "wb").write(out[0])
"""

LIAR = """
class _Passed(str):
    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = str.__hash__
"""

CLOSURE = """
    fn = cr.pytest_runtest_logreport
    for cell in getattr(fn, "__closure__", None) or ():
        v = cell.cell_contents
        v = getattr(v, "entries", v)  # since round 8 the per-test state is in the run object
        if isinstance(v, dict) and NODE in v:
            v[NODE] = (OUTCOME, "", True)
"""

# Each forge runs inside the failing test's call (as A22's library code does) and then fails.
FORGES = {
    # A22 itself: update the last entry of the plugin's per-test mapping with a lying str
    "a22_update_last_entry": """
    r = getattr(cr, "_RESULTS", None)
    if isinstance(r, dict) and r:
        r[list(r)[-1]].update(outcome=_Passed("passed"), called=True)
""",
    # any module-level dict of the plugin that holds the test's id
    "any_global_dict": """
    for v in list(vars(cr).values()):
        if isinstance(v, dict) and isinstance(v.get(NODE), dict):
            v[NODE].update(outcome=_Passed("passed"), called=True)
""",
    # the state behind the plugin's hook, through its closure (a dunder the guard denies): the
    # identity check and the cross-check with pytest's counts catch it
    "closure_liar": "\n    OUTCOME = _Passed('passed')" + CLOSURE,
    "closure_built_str": "\n    OUTCOME = ''.join(['pas', 'sed'])" + CLOSURE,
}


def _run(tmp_path: Path, forge: str, extra: str = "", header: str = "") -> tuple[dict, dict]:
    body = textwrap.indent(textwrap.dedent(forge), "    ")
    test = (
        "import sys\n" + LIAR + header + "\n\ndef test_forged():\n"
        "    cr = sys.modules['coderl_results']\n    NODE = 'test_x.py::test_forged'\n"
        f"{body}\n    assert 0\n\n\ndef test_fine():\n    pass\n"
    )
    (tmp_path / "test_x.py").write_text(test)
    (tmp_path / "run.py").write_text(RUN)
    if extra:
        (tmp_path / "test_y.py").write_text(extra)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    subprocess.run(
        [sys.executable, "run.py", str(PLUGIN_DIR), ".", "events.jsonl"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    tests = {e["id"]: e["outcome"] for e in events if e["t"] == "test"}
    end = next(e for e in events if e["t"] == "end")
    return tests, end


def _outcome_tamper(end: dict) -> list[str]:
    return [t for t in end["tampered"] if t.startswith("outcomes:")]


@pytest.mark.parametrize("forge", sorted(FORGES))
def test_a_forged_outcome_is_failed_or_flagged(tmp_path, forge):
    tests, end = _run(tmp_path, FORGES[forge])
    assert tests["test_x.py::test_fine"] == "passed"
    forged = tests["test_x.py::test_forged"] != "failed"
    assert not forged or _outcome_tamper(end), (forge, tests, end["tampered"])


def test_honest_outcomes_raise_no_cross_check(tmp_path):
    tests, end = _run(tmp_path, "")
    assert tests == {"test_x.py::test_forged": "failed", "test_x.py::test_fine": "passed"}
    assert not _outcome_tamper(end), end["tampered"]


# --- round 8: the plugin's module-level state (``_write``, ``_STATE``, ``_WATCHED``, ``SPEC``) ----
# Until round 8 the plugin kept its event writer, its encoder, its spec and its tripwires' records
# in module globals a forge that reached the module could rebind or mutate; each member below
# changed the verdict or hid its own tampering then. Now all of it lives in the hooks' closures,
# and a rebound module name is tampering (``coderl_results.<name>``). Each member: the forged test
# still reads failed, and what the forge did is noted.
REWRITE = """
    def liar(fd, data, real=REAL):
        return real(fd, data.replace(b'"failed"', b'"passed"'))
"""
MODULE_FORGES = {
    # the alias of os.write every event went through
    "rebind_write": (
        "    REAL = cr._write" + REWRITE + "    cr._write = liar\n",
        "coderl_results._write",
    ),
    # the C encoder (not callable-watched: its __module__ is _json)
    "rebind_encoder": (
        "    real = cr._ENCODE\n"
        "    def enc(o, i):\n"
        "        return [''.join(real(o, i)).replace('\"failed\"', '\"passed\"')]\n"
        "    cr._ENCODE = enc\n",
        "coderl_results._ENCODE",
    ),
    # the bound str.join that assembled each line
    "rebind_join": (
        "    real = cr._join\n"
        "    cr._join = lambda parts: real(parts).replace('\"failed\"', '\"passed\"')\n",
        "coderl_results._join",
    ),
    # hide a replaced pytest function from the end-of-run comparison
    "update_watched": (
        "    import _pytest.runner as R\n"
        "    new = lambda *a, **k: None\n"
        "    R.show_test_item = new\n"
        "    w = getattr(cr, '_WATCHED', None)\n"
        "    if w is not None:\n"
        "        w['_pytest.runner.show_test_item'] = (new, new.__code__)\n",
        "_pytest.runner.show_test_item",
    ),
    # register a hook from the test file and allow that file as a conftest
    "allow_own_hook": (
        "    import gc\n"
        "    from _pytest.config import Config\n"
        "    cfg = next(o for o in gc.get_objects() if isinstance(o, Config))\n"
        "    cfg.pluginmanager.register(_Hook(), 'forged')\n"
        "    spec = getattr(cr, 'SPEC', None)\n"
        "    if spec is not None:\n"
        "        spec.setdefault('allowed_conftests', []).append(__file__)\n",
        "/test_x.py",  # the note: hook pytest_runtest_logreport: .../test_x.py
    ),
}
HOOK = """

class _Hook:
    def pytest_runtest_logreport(self, report):
        pass
"""


@pytest.mark.parametrize("forge", sorted(MODULE_FORGES))
def test_the_plugins_module_state_is_out_of_reach_or_tampering(tmp_path, forge):
    body, note = MODULE_FORGES[forge]
    tests, end = _run(tmp_path, body, header=HOOK)
    assert tests["test_x.py::test_forged"] == "failed", (forge, tests)
    assert tests["test_x.py::test_fine"] == "passed"
    assert any(note in t for t in end["tampered"]), (forge, end["tampered"])


def test_an_honest_run_notes_no_tampering(tmp_path):
    tests, end = _run(tmp_path, "", header=HOOK)
    assert tests == {"test_x.py::test_forged": "failed", "test_x.py::test_fine": "passed"}
    # outside the sandbox every hook of the test virtualenv reads as foreign (not under /venv/)
    ours = [t for t in end["tampered"] if t.startswith(("coderl_results.", "outcomes:", "test "))]
    assert ours == [], end["tampered"]


# --- the guard half: new code around a released reflective use ---------------------------------
# The released file of each member holds a reflective use in ``where``; the forge keeps it (or
# its count) and adds code around it that reaches ``sys.modules``.
RELEASED = {
    "tb_frame": """
class Callpoint:
    @classmethod
    def from_tb(cls, tb):
        func_name = tb.tb_frame.f_code.co_name
        module_name = tb.tb_frame.f_globals.get('__name__', '')
        return cls(module_name, func_name)
""",
    "getframe": """
import sys


def caller_name():
    f = sys._getframe(1)
    return f.f_globals.get('__name__')
""",
    "currentframe": """
import inspect


def caller_name():
    f = inspect.currentframe().f_back
    return f.f_globals.get('__name__')
""",
    "func_globals": """
def namespace_of(func):
    g = func.__globals__
    return sorted(g)
""",
}
FORGED = {
    # A22's shape: bind the released expression to a name, keep the count, use the name anew
    "tb_frame": """
class Callpoint:
    @classmethod
    def from_tb(cls, tb):
        func_name = tb.tb_frame.f_code.co_name
        g = tb.tb_frame.f_globals
        module_name = g.get('__name__', '')
        mods = getattr(g.get('sys'), 'mod' 'ules', None) or {}
        return cls(module_name, func_name)
""",
    # the released statement kept verbatim; a new one reads the name it bound (taint)
    "getframe": """
import sys


def caller_name():
    f = sys._getframe(1)
    m = f
    return m.f_globals.get('__name__')
""",
    "currentframe": """
import inspect


def caller_name():
    f = inspect.currentframe().f_back
    s = f.f_globals.get('sys')
    return f.f_globals.get('__name__')
""",
    "func_globals": """
def namespace_of(func):
    g = func.__globals__
    sys_ = g.get('sys')
    return sorted(g)
""",
}


@pytest.mark.parametrize("route", sorted(FORGED))
def test_new_code_around_a_released_reflective_use_is_denied(route):
    found = added_findings(RELEASED[route].encode(), FORGED[route].encode(), "lib/m.py")
    assert any(f.rule == "reflective" for f in found), (route, found)


@pytest.mark.parametrize("route", sorted(RELEASED))
def test_restoring_released_reflective_code_is_clean(route):
    broken = RELEASED[route].replace("'__name__'", "'__nam__'").replace("sorted(g)", "list(g)")
    assert broken != RELEASED[route]
    assert (
        added_findings(
            broken.encode(), RELEASED[route].encode(), "lib/m.py", RELEASED[route].encode()
        )
        == []
    )


BUILT = {
    # ``getattr(x, 'literal')`` read as ``x.literal``: the rules on ``.format`` and ``.exec``
    "getattr_format": "def f(tpl, o):\n    return getattr(tpl, 'format')(o)\n",
    "getattr_exec": "def f(ns, code):\n    return getattr(ns, 'exec', None)(code)\n",
    "concat": "def f(m):\n    return m.get('cod' + 'erl_results')\n",
    "fstring": "def f(m):\n    return m.get(f'{\"cod\"}erl_results')\n",
    "join": "def f(m):\n    return m.get(''.join(['cod', 'erl_', 'results']))\n",
    "word": "def f(m):\n    return m.get('my_coderl_thing')\n",
}


@pytest.mark.parametrize("route", sorted(BUILT))
def test_getattr_literals_and_built_names_are_read_as_written(route):
    found = added_findings(b"", BUILT[route].encode(), "lib/m.py")
    assert found, route


@pytest.mark.parametrize(
    "extra",
    [
        "def broken(:\n",  # a collection error: pytest counts it among its failed reports
        "import pytest\n\n\n@pytest.mark.xfail(strict=True)\ndef test_xpass():\n    pass\n",
        "import pytest\n\n\n@pytest.fixture\ndef bad():\n    raise RuntimeError\n\n\n"
        "def test_setup_error(bad):\n    pass\n",
    ],
)
def test_other_failures_agree_with_pytests_counts(tmp_path, extra):
    """The cross-check counts as pytest does: a failed collection, a strict xpass, an error
    in setup raise no tampering of their own."""
    tests, end = _run(tmp_path, "", extra)
    assert tests.get("test_x.py::test_forged", "failed") == "failed"  # none run: collection
    assert not _outcome_tamper(end), end["tampered"]
