"""pytest plugin that reports per-test events to the grader's observer as tests finish.

Started by ``coderl_boot``'s worker (never by ``-p`` from the environment, never autoloaded); it
imports nothing from coderl and holds no secret. ``start(events, control, spec, token)`` hands it:

- ``events``: the pipe to the observer (``coderl_boot``), which signs and forwards each line;
- ``control``: the pipe from the observer; one line, read once collection is done (every test
  module imported): ``{"canaries": [...], "placement": HEX}``, the must-pass and must-fail tests
  to place among the real ones and where (two 64-bit draws per canary, :func:`_draw`);
- ``spec``: ``select`` (node ids to keep; others are deselected), ``trace_root`` (record which
  functions under it each test called), ``allowed_conftests`` (the conftest files that may
  register hooks), ``check_code`` (``False``: skip comparing test functions with the bytecode
  of their files, for the grader's second run, which can only take passes away);
- ``token``: goes into every event line (the observer forwards only lines that carry it).

Events: one JSON object per line. ``{"t": "collected", "ids"}`` (the selected ids, before the
canaries), ``{"t": "test", "id", "outcome", "longrepr", "trace"}`` when a test's teardown ends,
``{"t": "end", "n", "tampered", "collect_errors", "exitstatus"}`` at session finish. Outcomes are
``passed`` only when setup, call and teardown all passed; otherwise ``failed``, ``error``
(setup/teardown, or a call that never ran), ``skipped``, ``xfailed`` or ``xpassed``.

State. Everything the verdict depends on (the event descriptor and token, the run's spec, the
per-test outcomes, the canary ids, the recorded test code, the tampering notes, the trace) lives
in the closure of :func:`_plugin`, built at import (before any workspace code runs); the module
keeps only functions and constants, and every helper and builtin the hooks call is bound into
that closure then. Rebinding a module name (``coderl_results._write = f``: the round-7 residual)
therefore changes nothing the hooks do, and it is reported as tampering: each hook first compares
the module's namespace (each name's object and code object) with the one :func:`start` sealed.

Integrity checks (reported in ``tampered``): pytest's, pluggy's and unittest's running machinery
and this plugin's own functions are the same objects with the same code at the end as when this
module was imported (before any workspace code ran); no name of this module is rebound; every
hook implementation comes from the virtualenv, the standard library, this directory or an
allowed conftest; each test function is the object collected and keeps its code object until it
runs. These are tripwires inside the process under test: code running there can defeat them (the
closure's cells are reachable through ``__closure__``, and it can write events of its own on the
pipe). What stops that is outside this process (``coderl.grading.grade``: the observer, the
host's checks of every record, the second run of the FAIL_TO_PASS tests, and the static
detector ``coderl.grading.diffguard``, which denies ``__closure__`` and every route to this
module).
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

_write, _read, _join = os.write, os.read, "".join
_int, _str, _type = int, str, type
_UNSEALED = frozenset({"__warningregistry__"})


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


def _place_canaries(items: list[Any], reply: dict[str, Any], make: Any) -> list[str]:
    """Put the observer's canaries (``reply``: ``canaries`` and ``placement``) among ``items``
    in place, each made by ``make(module, canary)`` in the test module the placement draws and
    inserted at the position it draws; returns the canaries' node ids."""
    modules: list[Any] = []
    for it in items:
        mod = it.getparent(pytest.Module)
        if mod is not None and mod not in modules:
            modules.append(mod)
    placement = reply.get("placement", "")
    ids: list[str] = []
    for i, canary in enumerate(reply.get("canaries", []) if modules else []):
        new = make(modules[_draw(placement, 2 * i, len(modules))], canary)
        ids += [it.nodeid for it in new]
        pos = _draw(placement, 2 * i + 1, len(items) + 1)
        items[pos:pos] = new
    return ids


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


def _make_profiler(root: str, bucket: set[tuple[str, int]]) -> Any:
    prefix = root.rstrip("/") + "/"

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(prefix):
                bucket.add((code.co_filename[len(prefix) :], code.co_firstlineno))

    return profile


def _foreign_hooks(config: pytest.Config, allowed: set[str]) -> list[str]:
    """Hook implementations whose code lies outside the trusted trees and ``allowed`` conftests."""
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


# --- the run's state and the hooks, in closures ---------------------------------------------


class _Run:
    """The mutable state of one worker's run: one instance, made by :func:`_plugin` at import
    and held only by the closures of the hooks it builds (no module name refers to it)."""

    __slots__ = (
        *("spec", "fd", "control", "token", "n", "sealed", "watched", "test_code"),
        *("canary_ids", "collect_errors", "tampered", "traces", "entries", "failed_ids"),
        *("emitted_failing", "foreign", "failed_reports"),
    )

    def __init__(self) -> None:
        self.spec: dict[str, Any] = {}
        self.fd, self.control, self.token, self.n = -1, -1, "", 0
        self.sealed: dict[str, tuple[object, object]] = {}  # the module's names at start
        self.watched: dict[str, tuple[object, object]] = {}  # _watch_targets() at start
        self.test_code: dict[str, tuple[object, object]] = {}
        self.canary_ids: set[str] = set()
        self.collect_errors: list[str] = []
        self.tampered: list[str] = []
        self.traces: dict[str, set[tuple[str, int]]] = {}
        self.entries: dict[str, tuple[str, str, bool]] = {}  # per test across its phases
        self.failed_ids: set[str] = set()  # ids with a failed or error report
        self.emitted_failing: set[str] = set()  # ids emitted failed or error
        self.foreign: list[str] = []  # ids whose outcome was not one of the plugin's own
        self.failed_reports = 0  # failed reports (xfail aside), as pytest counts them


def _io_hooks(run: _Run) -> tuple[Any, Any, Any, Any]:
    """``(start, emit, intact, canaries_from_observer)`` over ``run``, every helper bound now."""
    write, read, join, encode, loads = _write, _read, _join, _ENCODE, _loads
    watch_targets, getattr_, live = _watch_targets, _getattr, globals()
    unsealed = _UNSEALED

    def start(events: int, control: int, spec: dict[str, Any], token: str) -> None:
        """Called once by ``coderl_boot``'s worker before pytest starts (before any workspace
        code runs): the event pipe, the control pipe, the run's spec and the event token; seals
        the module's namespace (:func:`intact` compares it at every hook)."""
        run.fd, run.control, run.token = events, control, token
        run.spec.update(spec)
        run.watched.update(watch_targets())
        run.sealed.update({k: (v, getattr_(v, "__code__", None)) for k, v in list(live.items())})

    def intact() -> None:
        """Note as tampering every name of this module rebound, added or deleted since
        :func:`start`, and every function of it whose code object was swapped
        (``__warningregistry__``, which the warnings machinery adds to the module of a frame a
        warning names, is no verdict state)."""
        if not run.sealed:
            return
        now = {k: (v, getattr_(v, "__code__", None)) for k, v in list(live.items())}
        for k in (run.sealed.keys() | now.keys()) - unsealed:
            was, isn = run.sealed.get(k), now.get(k)
            if was is None or isn is None or was[0] is not isn[0] or was[1] is not isn[1]:
                run.tampered.append(f"coderl_results.{k}")

    def emit(record: dict[str, Any]) -> None:
        run.n += 1
        data = join(encode({**record, "k": run.token}, 0)).encode() + b"\n"
        while data:
            data = data[write(run.fd, data) :]

    def canaries_from_observer(ids: list[str]) -> dict[str, Any]:
        """Report the selection; the observer answers with the canaries and their placement."""
        emit({"t": "collected", "ids": ids})
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = read(run.control, 1 << 16)
            if not chunk:
                return {}
            buf += chunk
        reply = loads(buf)
        return reply if isinstance(reply, dict) else {}

    return start, emit, intact, canaries_from_observer


def _collection_hooks(run: _Run, intact: Any, ask: Any) -> tuple[Any, Any, Any, Any]:
    """``(pytest_collection_modifyitems, pytest_collection_finish, pytest_collectreport,
    check_test_code)`` over ``run``; ``ask`` is ``canaries_from_observer``."""
    place, make, pristine_code, matches = _place_canaries, _canary_items, _pristine_code, _matches
    defined_in_module, unwrapped_code, getattr_, str_ = (
        _defined_in_module,
        _unwrapped_code,
        _getattr,
        _str,
    )

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        intact()
        wanted = run.spec.get("select")
        if wanted is not None:
            keep_ids = set(wanted)
            keep = [it for it in items if it.nodeid in keep_ids]
            drop = [it for it in items if it.nodeid not in keep_ids]
            items[:] = keep
            if drop:
                config.hook.pytest_deselected(items=drop)
        reply = ask([it.nodeid for it in items])
        run.canary_ids.update(place(items, reply, make))

    def pytest_collection_finish(session: pytest.Session) -> None:
        """Record each test's function and code; a function defined in its test module must
        have the bytecode of that file as it is on disk (the pristine copy mounted read-only),
        so a module rewritten on import (a forged ``.pyc``, an import hook) is caught."""
        intact()
        pristine: dict[str, dict[tuple[str, int], set[bytes]]] = {}
        for item in session.items:
            obj = getattr_(item, "obj", None)
            fn = getattr_(obj, "__func__", obj)
            code = getattr_(fn, "__code__", None)
            run.test_code[item.nodeid] = (fn, code)
            if item.nodeid in run.canary_ids or code is None or not defined_in_module(item, fn):
                continue
            if run.spec.get("check_code") is False:
                continue
            path = str_(item.path)
            try:
                if path not in pristine:
                    pristine[path] = pristine_code(path, session.config)
            except (OSError, SyntaxError, ValueError) as e:
                run.tampered.append(f"test file unreadable: {path}: {type(e).__name__}")
                continue
            if not matches(code, pristine[path]) and (
                code.co_filename == path or not matches(unwrapped_code(fn), pristine[path])
            ):
                run.tampered.append(f"test code: {item.nodeid}")

    def pytest_collectreport(report: pytest.CollectReport) -> None:
        intact()
        if report.failed:
            run.collect_errors.append(f"{report.nodeid}: {str_(report.longrepr)[-2000:]}")

    def check_test_code(item: pytest.Item) -> None:
        recorded = run.test_code.get(item.nodeid)
        if recorded is None:
            return
        obj = getattr_(item, "obj", None)
        fn = getattr_(obj, "__func__", obj)
        if fn is not recorded[0] or getattr_(fn, "__code__", None) is not recorded[1]:
            run.tampered.append(f"test code: {item.nodeid}")

    return (
        pytest_collection_modifyitems,
        pytest_collection_finish,
        pytest_collectreport,
        check_test_code,
    )


def _outcome_hooks(run: _Run, emit: Any, intact: Any, check_code: Any) -> tuple[Any, Any]:
    """``(pytest_runtest_logreport, pytest_runtest_call)`` over ``run``. Each test's state across
    its phases is an immutable ``(outcome, longrepr, called)`` replaced, never updated in place,
    and the outcome is decided when pytest makes the report; an outcome that is not one of this
    module's constants by identity is emitted as ``error`` and counted as tampering. The failed
    ids and counts kept here are what :func:`_end_hook` compares with pytest's own counts."""
    outcome_of, outcomes, make_profiler, setprofile = (
        _outcome,
        _OUTCOMES,
        _make_profiler,
        sys.setprofile,
    )
    passed, failed, error, str_, sorted_, hasattr_ = _PASSED, _FAILED, _ERROR, _str, sorted, hasattr

    def pytest_runtest_logreport(report: pytest.TestReport) -> None:
        intact()
        nodeid, when = report.nodeid, report.when
        outcome, longrepr, called = run.entries.pop(nodeid, (passed, "", False))
        now = outcome_of(report)
        if now is failed or now is error:
            run.failed_ids.add(nodeid)
            if not hasattr_(report, "wasxfail"):
                run.failed_reports += 1
        if now is not passed and outcome is passed:
            outcome = now
            longrepr = str_(report.longrepr)[-4000:] if report.longrepr else ""
        called = called or when == "call"
        if when != "teardown":
            run.entries[nodeid] = (outcome, longrepr, called)
            return
        if outcome is passed and not called:
            outcome = error  # the call phase never ran (e.g. setup skipped it)
        if not any(outcome is known for known in outcomes):
            run.foreign.append(nodeid)
            outcome = error
        if outcome is failed or outcome is error:
            run.emitted_failing.add(nodeid)
        trace = sorted_(run.traces.pop(nodeid, ()))
        emit({"t": "test", "id": nodeid, "outcome": outcome, "longrepr": longrepr, "trace": trace})

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_call(item: pytest.Item) -> Any:
        intact()
        check_code(item)
        root = run.spec.get("trace_root")
        if not root:
            yield
            return
        bucket = run.traces.setdefault(item.nodeid, set())
        setprofile(make_profiler(root, bucket))
        try:
            yield
        finally:
            setprofile(None)

    return pytest_runtest_logreport, pytest_runtest_call


def _end_hook(run: _Run, emit: Any, intact: Any, check_code: Any) -> Any:
    """``pytest_sessionfinish`` over ``run``: the ``end`` event with every tampering note."""
    watch_targets, foreign_hooks, getattr_, int_, phases = (
        _watch_targets,
        _foreign_hooks,
        _getattr,
        _int,
        _PHASES,
    )

    def cross_check(session: pytest.Session) -> list[str]:
        """Tampering where the outcomes this plugin decided disagree with the counts pytest
        keeps on its own: ``session.testsfailed`` (failed test and collection reports, xfail
        aside) and the terminal reporter's ``stats`` (the ids with a failed or error test
        report); every test with a failed report must have been emitted ``failed``/``error``."""
        ids, emitted = frozenset(run.failed_ids), frozenset(run.emitted_failing)
        out = [f"outcomes: not the plugin's own outcome: {i}" for i in run.foreign[:3]]
        if not ids <= emitted:
            out.append(f"outcomes: failed tests emitted as not failed: {sorted(ids - emitted)[:3]}")
        n = run.failed_reports + len(run.collect_errors)  # pytest counts a failed collection too
        if getattr_(session, "testsfailed", n) != n:
            out.append(f"outcomes: {n} failed reports seen, pytest counted {session.testsfailed}")
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        stats = getattr_(reporter, "stats", None)
        if isinstance(stats, dict):
            theirs = {
                r.nodeid
                for key in ("failed", "error")
                for r in stats.get(key, ())
                if getattr_(r, "when", None) in phases
            }
            if theirs != ids:
                out.append(
                    f"outcomes: failed tests differ from pytest's stats: {sorted(theirs ^ ids)[:3]}"
                )
        return out

    def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
        if run.fd < 0:
            return
        intact()
        now = watch_targets()
        found = [
            k
            for k, (obj, code) in run.watched.items()
            if k not in now or now[k][0] is not obj or now[k][1] is not code
        ]
        found += foreign_hooks(session.config, set(run.spec.get("allowed_conftests", [])))
        for item in session.items:
            check_code(item)
        found += run.tampered + cross_check(session)
        record = {"t": "end", "n": run.n, "tampered": sorted(set(found))}
        emit({**record, "collect_errors": list(run.collect_errors), "exitstatus": int_(exitstatus)})

    return pytest_sessionfinish


def _plugin() -> tuple[Any, ...]:
    """Build the run's state and every hook over it (at import, before any workspace code)."""
    run = _Run()
    start, emit, intact, ask = _io_hooks(run)
    modifyitems, collection_finish, collectreport, check_code = _collection_hooks(run, intact, ask)
    logreport, runtest_call = _outcome_hooks(run, emit, intact, check_code)
    sessionfinish = _end_hook(run, emit, intact, check_code)
    return (
        start,
        modifyitems,
        collection_finish,
        collectreport,
        logreport,
        runtest_call,
        sessionfinish,
    )


(
    start,
    pytest_collection_modifyitems,
    pytest_collection_finish,
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_runtest_call,
    pytest_sessionfinish,
) = _plugin()
