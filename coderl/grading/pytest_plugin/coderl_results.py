"""pytest plugin that reports per-test events to the grader's observer as tests finish.

Started by ``coderl_boot``'s worker (never by ``-p`` from the environment, never autoloaded); it
imports nothing from coderl and holds no secret. ``start(events, control, spec)`` hands it:

- ``events``: the pipe to the observer (``coderl_boot``), which signs and forwards each line;
- ``control``: the pipe from the observer; one line, read once collection is done (every test
  module imported): ``{"canaries": [...], "placement": HEX}``, the must-pass and must-fail tests
  to place among the real ones and where (two 64-bit draws per canary, :func:`_draw`);
- ``spec``: ``select`` (node ids to keep; others are deselected), ``trace_root`` (record which
  functions under it each test called), ``allowed_conftests`` (the conftest files that may
  register hooks), ``check_code`` (``False``: skip comparing test functions with the bytecode
  of their files, for the grader's second run, which can only take passes away).

Events: one JSON object per line. ``{"t": "collected", "ids"}`` (the selected ids, before the
canaries), ``{"t": "test", "id", "outcome", "longrepr", "trace"}`` when a test's teardown ends,
``{"t": "end", "n", "tampered", "collect_errors", "exitstatus"}`` at session finish. Outcomes are
``passed`` only when setup, call and teardown all passed; otherwise ``failed``, ``error``
(setup/teardown, or a call that never ran), ``skipped``, ``xfailed`` or ``xpassed``.

Integrity checks (reported in ``tampered``): pytest's, pluggy's and unittest's running machinery
and this plugin's own functions are the same objects with the same code at the end as when this
module was imported (before any workspace code ran); every hook implementation comes from the
virtualenv, the standard library, this directory or an allowed conftest; each test function is
the object collected and keeps its code object until it runs. These are tripwires inside the
process under test: code running there can defeat them, and it can write events of its own on
the pipe. What stops that is outside this process (``coderl.grading.grade``: the observer, the
host's checks of every record, and the static detector ``coderl.grading.diffguard``).
"""

from __future__ import annotations

import ast
import io
import json
import os
import sys
import types
import unittest
from typing import Any

import _pytest.assertion.rewrite
import _pytest.main
import _pytest.python
import _pytest.reports
import _pytest.runner
import _pytest.unittest
import pluggy._callers
import pluggy._hooks
import pytest

SPEC: dict[str, Any] = {}
_STATE: dict[str, Any] = {"n": 0, "fd": -1, "control": -1}
_TRACE: dict[str, set[tuple[str, int]]] = {}
_COLLECT_ERRORS: list[str] = []
_TAMPERED: list[str] = []
_TEST_CODE: dict[str, tuple[object, object]] = {}
_CANARY_IDS: set[str] = set()
_write, _read, _join = os.write, os.read, "".join
_int, _str, _type = int, str, type


def _not_json(obj: object) -> object:
    raise TypeError(f"not JSON data: {type(obj).__name__}")


# JSON through the C encoder and scanner, built now (before any workspace code runs) and called
# directly: json.dumps/loads go through JSONEncoder.encode and JSONDecoder.decode, Python methods
# looked up on their classes at every call, which code under test can replace (red team, round
# 5: a diff that patched JSONEncoder.encode rewrote every event's outcome before it was signed).
_ENCODE = json.encoder.c_make_encoder(  # type: ignore[attr-defined]
    None, _not_json, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True
)
_SCAN = json.JSONDecoder().scan_once


def _dumps(obj: object) -> str:
    return _join(_ENCODE(obj, 0))


def _loads(data: bytes) -> object:
    text = data.decode().strip()
    try:
        obj, end = _SCAN(text, 0)
    except StopIteration:  # what the C scanner raises on text that is not JSON
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return obj


_getattr, _open = getattr, io.open
_TRUSTED_PREFIXES = ("/venv/", "/coderl/plugin/", sys.base_prefix + "/lib/", "/usr/lib/python3")


def _watch_targets() -> dict[str, tuple[object, object]]:
    """Name -> (object, its code object or None) for the functions a tamperer would replace."""
    targets: dict[str, tuple[object, object]] = {}

    def add(name: str, obj: object) -> None:
        fn = _getattr(obj, "__func__", obj)
        targets[name] = (obj, _getattr(fn, "__code__", None))

    for name in dir(unittest.TestCase):
        if name.startswith(("assert", "fail", "run", "_call", "_callTestMethod")):
            add(f"unittest.TestCase.{name}", _getattr(unittest.TestCase, name))
    mods = (_pytest.runner, _pytest.python, _pytest.reports, _pytest.main, _pytest.unittest)
    for mod in (*mods, pluggy._callers, pluggy._hooks):
        for name, obj in vars(mod).items():
            if callable(obj) and not name.startswith("__"):
                add(f"{mod.__name__}.{name}", obj)
                if isinstance(obj, type) and obj.__module__ == mod.__name__:
                    for attr, value in vars(obj).items():
                        if callable(value) or isinstance(value, (classmethod, staticmethod)):
                            add(f"{mod.__name__}.{name}.{attr}", value)
                        elif isinstance(value, property):  # e.g. BaseReport.passed
                            getter = _getattr(value, "fget", None)
                            code = _getattr(getter, "__code__", None)
                            targets[f"{mod.__name__}.{name}.{attr}"] = (value, code)
    for name, obj in list(globals().items()):
        if callable(obj) and _getattr(obj, "__module__", None) == __name__:
            add(f"coderl_results.{name}", obj)
    for name in ("fail", "skip", "exit"):
        add(f"pytest.{name}", _getattr(pytest, name))
    add("sys.exit", sys.exit)
    add("os._exit", os._exit)
    return targets


_WATCHED: dict[str, tuple[object, object]] = {}


def start(events: int, control: int, spec: dict[str, Any], token: str) -> None:
    """Called once by ``coderl_boot``'s worker before pytest starts. ``token`` goes into every
    event line: the observer forwards only lines that carry it, and no descriptor holds it, so
    code that writes on the event pipe without reading this process's memory is a garbled
    verdict."""
    _STATE.update(fd=events, control=control, k=token)
    SPEC.update(spec)
    _WATCHED.update(_watch_targets())


def _emit(record: dict[str, Any]) -> None:
    _STATE["n"] += 1
    data = _dumps({**record, "k": _STATE["k"]}).encode() + b"\n"
    while data:
        data = data[_write(_STATE["fd"], data) :]


def _canaries_from_observer(ids: list[str]) -> dict[str, Any]:
    """Report the selection; the observer answers with the canaries and their placement."""
    _emit({"t": "collected", "ids": ids})
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = _read(_STATE["control"], 1 << 16)
        if not chunk:
            return {}
        buf += chunk
    reply = _loads(buf)
    return reply if isinstance(reply, dict) else {}


# --- selection and canaries -----------------------------------------------------------------


def _canary_items(module: pytest.Module, canary: dict[str, Any]) -> list[pytest.Item]:
    namespace: dict[str, Any] = {"unittest": unittest}
    exec(compile(canary["source"], str(module.path), "exec"), namespace)
    obj = namespace[canary["name"]]
    if canary["kind"] == "ufail":
        parent = _pytest.unittest.UnitTestCase.from_parent(module, name=canary["name"])
        parent._obj = obj  # not an attribute of the module: pytest would look it up there
        return [it for it in parent.collect() if isinstance(it, pytest.Item)]
    return [pytest.Function.from_parent(module, name=canary["name"], callobj=obj)]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = SPEC.get("select")
    if wanted is not None:
        keep_ids = set(wanted)
        keep = [it for it in items if it.nodeid in keep_ids]
        drop = [it for it in items if it.nodeid not in keep_ids]
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)
    modules: list[pytest.Module] = []
    for it in items:
        mod = it.getparent(pytest.Module)
        if mod is not None and mod not in modules:
            modules.append(mod)
    reply = _canaries_from_observer([it.nodeid for it in items])
    placement = reply.get("placement", "")
    for i, canary in enumerate(reply.get("canaries", []) if modules else []):
        new = _canary_items(modules[_draw(placement, 2 * i, len(modules))], canary)
        _CANARY_IDS.update(it.nodeid for it in new)
        pos = _draw(placement, 2 * i + 1, len(items) + 1)
        items[pos:pos] = new


def _draw(placement: object, k: int, n: int) -> int:
    """The ``k``-th 64-bit draw of the observer's hex ``placement``, reduced to ``[0, n)`` (bias
    below n / 2**64); 0 where the text is short or not hex. Only ``int``/``str`` operations on
    names bound at import (``random.Random``'s methods are Python code that graded code
    could replace: round-5 red team), so nothing the tested code can reach moves a canary."""
    text = placement[16 * k : 16 * k + 16] if _type(placement) is _str else ""
    try:
        return _int(text, 16) % n if text else 0
    except ValueError:
        return 0


def _pristine_code(path: str, config: pytest.Config) -> dict[tuple[str, int], set[bytes]]:
    """(name, first line) -> bytecode of every function compiled from the file at ``path``
    itself, plain and with pytest's assertion rewriting (what a test module runs)."""
    with _open(path, "rb") as f:
        source = f.read()
    out: dict[tuple[str, int], set[bytes]] = {}
    for rewrite in (False, True):
        tree = ast.parse(source, path)
        if rewrite:
            _pytest.assertion.rewrite.rewrite_asserts(tree, source, path, config)
        stack = [compile(tree, path, "exec", dont_inherit=True)]
        while stack:
            code = stack.pop()
            out.setdefault((code.co_name, code.co_firstlineno), set()).add(code.co_code)
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return out


def _defined_in_module(item: pytest.Item, fn: object) -> bool:
    module = _getattr(item, "module", None)
    return (
        module is not None
        and _getattr(fn, "__module__", None) == module.__name__
        and "<locals>" not in str(_getattr(fn, "__qualname__", "<locals>"))
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Record each test's function and code; a function defined in its test module must have
    the bytecode of that file as it is on disk (the pristine copy mounted read-only), so a
    module rewritten on import (a forged ``.pyc``, an import hook) is caught."""
    pristine: dict[str, dict[tuple[str, int], set[bytes]]] = {}
    for item in session.items:
        obj = _getattr(item, "obj", None)
        fn = _getattr(obj, "__func__", obj)
        code = _getattr(fn, "__code__", None)
        _TEST_CODE[item.nodeid] = (fn, code)
        if item.nodeid in _CANARY_IDS or code is None or not _defined_in_module(item, fn):
            continue
        if SPEC.get("check_code") is False:
            continue
        path = str(item.path)
        try:
            if path not in pristine:
                pristine[path] = _pristine_code(path, session.config)
        except (OSError, SyntaxError, ValueError) as e:
            _TAMPERED.append(f"test file unreadable: {path}: {type(e).__name__}")
            continue
        if not _matches(code, pristine[path]) and (
            code.co_filename == path or not _matches(_unwrapped_code(fn), pristine[path])
        ):
            _TAMPERED.append(f"test code: {item.nodeid}")


def _matches(code: Any, pristine: dict[tuple[str, int], set[bytes]]) -> bool:
    if code is None:
        return False
    return code.co_code in pristine.get((code.co_name, code.co_firstlineno), ())


def _unwrapped_code(fn: object) -> Any:
    """The code of the function a decorator (``functools.wraps``: ``mock.patch``...) wraps."""
    for _ in range(20):
        inner = _getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return _getattr(_getattr(fn, "__func__", fn), "__code__", None)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _COLLECT_ERRORS.append(f"{report.nodeid}: {str(report.longrepr)[-2000:]}")


# --- outcomes -------------------------------------------------------------------------------


# The outcomes, bound now: a verdict is one of these very objects (compared by identity, never by
# ``==`` on a value the tested code could have made: red team, round 7, A22 put a ``str``
# subclass whose ``__eq__`` lies into the per-test state, which was a module global then).
_PASSED, _FAILED, _ERROR, _SKIPPED = "passed", "failed", "error", "skipped"
_XFAILED, _XPASSED = "xfailed", "xpassed"
_OUTCOMES = (_PASSED, _FAILED, _ERROR, _SKIPPED, _XFAILED, _XPASSED)
_PHASES = ("setup", "call", "teardown")


def _outcome(report: pytest.TestReport) -> str:
    """This phase's outcome from pytest's own ``report.outcome`` and ``report.when``, as the
    literals of this function (interned: the very objects of the constants above, whatever a
    module global is rebound to later); ``error`` when either is not a plain ``str``."""
    outcome, when = _getattr(report, "outcome", None), _getattr(report, "when", None)
    if _type(outcome) is not _str or _type(when) is not _str:
        return "error"
    if hasattr(report, "wasxfail"):
        return "xfailed" if outcome == "skipped" else "xpassed"
    if outcome in ("passed", "skipped"):
        return "passed" if outcome == "passed" else "skipped"
    return "failed" if when == "call" else "error"


def _check_test_code(item: pytest.Item) -> None:
    recorded = _TEST_CODE.get(item.nodeid)
    if recorded is None:
        return
    obj = _getattr(item, "obj", None)
    fn = _getattr(obj, "__func__", obj)
    if fn is not recorded[0] or _getattr(fn, "__code__", None) is not recorded[1]:
        _TAMPERED.append(f"test code: {item.nodeid}")


def _outcome_hooks() -> tuple[Any, Any]:
    """``(pytest_runtest_logreport, failing)``. The per-test state across a test's phases lives
    in this closure, not in a module global the tested code can reach by name: each entry is
    an immutable ``(outcome, longrepr, called)`` replaced, never updated in place, and the
    outcome is decided when pytest makes the report; an outcome that is not one of this
    module's constants by identity is emitted as ``error`` and counted as tampering.
    ``failing()`` gives what :func:`_cross_check` compares with pytest's own counts: the ids
    with a failed report, the ids emitted ``failed``/``error``, how many failed reports (xfail
    aside) this hook saw, and the outcomes that were not the plugin's own."""
    # bound here, once: rebinding the module's names later changes nothing below
    outcome_of, emit, outcomes = _outcome, _emit, _OUTCOMES
    passed, failed, error = _PASSED, _FAILED, _ERROR
    entries: dict[str, tuple[str, str, bool]] = {}
    failed_ids: set[str] = set()
    emitted_failing: set[str] = set()
    foreign: list[str] = []
    failed_reports = [0]

    def pytest_runtest_logreport(report: pytest.TestReport) -> None:
        nodeid, when = report.nodeid, report.when
        outcome, longrepr, called = entries.pop(nodeid, (passed, "", False))
        now = outcome_of(report)
        if now is failed or now is error:
            failed_ids.add(nodeid)
            if not hasattr(report, "wasxfail"):
                failed_reports[0] += 1
        if now is not passed and outcome is passed:
            outcome = now
            longrepr = str(report.longrepr)[-4000:] if report.longrepr else ""
        called = called or when == "call"
        if when != "teardown":
            entries[nodeid] = (outcome, longrepr, called)
            return
        if outcome is passed and not called:
            outcome = error  # the call phase never ran (e.g. setup skipped it)
        if not any(outcome is known for known in outcomes):
            foreign.append(nodeid)
            outcome = error
        if outcome is failed or outcome is error:
            emitted_failing.add(nodeid)
        trace = sorted(_TRACE.pop(nodeid, ()))
        emit({"t": "test", "id": nodeid, "outcome": outcome, "longrepr": longrepr, "trace": trace})

    def failing() -> tuple[frozenset[str], frozenset[str], int, tuple[str, ...]]:
        return frozenset(failed_ids), frozenset(emitted_failing), failed_reports[0], (*foreign,)

    return pytest_runtest_logreport, failing


pytest_runtest_logreport, _failing = _outcome_hooks()


def _cross_check(session: pytest.Session) -> list[str]:
    """Tampering where the outcomes this plugin decided disagree with the counts pytest keeps
    on its own: ``session.testsfailed`` (failed test and collection reports, xfail aside) and
    the terminal reporter's ``stats`` (the ids with a failed or error test report); every test
    with a failed report must have been emitted ``failed`` or ``error``."""
    ids, emitted, n, foreign = _failing()
    out = [f"outcomes: not the plugin's own outcome: {i}" for i in foreign[:3]]
    if not ids <= emitted:
        out.append(f"outcomes: failed tests emitted as not failed: {sorted(ids - emitted)[:3]}")
    n += len(_COLLECT_ERRORS)  # pytest counts a failed collection report too
    if _getattr(session, "testsfailed", n) != n:
        out.append(f"outcomes: {n} failed reports seen, pytest counted {session.testsfailed}")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = _getattr(reporter, "stats", None)
    if isinstance(stats, dict):
        theirs = {
            r.nodeid
            for key in ("failed", "error")
            for r in stats.get(key, ())
            if _getattr(r, "when", None) in _PHASES
        }
        if theirs != ids:
            diff = sorted(theirs ^ ids)[:3]
            out.append(f"outcomes: failed tests differ from pytest's stats: {diff}")
    return out


def _make_profiler(root: str, bucket: set[tuple[str, int]]) -> Any:
    prefix = root.rstrip("/") + "/"

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(prefix):
                bucket.add((code.co_filename[len(prefix) :], code.co_firstlineno))

    return profile


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    _check_test_code(item)
    root = SPEC.get("trace_root")
    if not root:
        yield
        return
    bucket = _TRACE.setdefault(item.nodeid, set())
    sys.setprofile(_make_profiler(root, bucket))
    try:
        yield
    finally:
        sys.setprofile(None)


# --- integrity at the end -------------------------------------------------------------------


def _foreign_hooks(config: pytest.Config) -> list[str]:
    """Hook implementations whose code lies outside the trusted trees and allowed conftests."""
    allowed = set(SPEC.get("allowed_conftests", []))
    out: list[str] = []
    for name in dir(config.hook):
        caller = _getattr(config.hook, name, None)
        if not hasattr(caller, "get_hookimpls"):
            continue
        for impl in caller.get_hookimpls():
            code = _getattr(impl.function, "__code__", None)
            filename = _getattr(code, "co_filename", None)
            if filename is None:
                out.append(f"hook {name}: {impl.plugin_name} (no code)")
            elif not filename.startswith(_TRUSTED_PREFIXES) and filename not in allowed:
                out.append(f"hook {name}: {filename}")
    return out


def _tampered(session: pytest.Session) -> list[str]:
    now = _watch_targets()
    found = [
        k
        for k, (obj, code) in _WATCHED.items()
        if k not in now or now[k][0] is not obj or now[k][1] is not code
    ]
    found += _foreign_hooks(session.config)
    for item in session.items:
        _check_test_code(item)
    found += _TAMPERED
    found += _cross_check(session)
    return sorted(set(found))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _STATE["fd"] < 0:
        return
    _emit(
        {
            "t": "end",
            "n": _STATE["n"],
            "tampered": _tampered(session),
            "collect_errors": _COLLECT_ERRORS,
            "exitstatus": int(exitstatus),
        }
    )
