"""Record the plain-data calls a library's own test suite makes to its functions (standard library
and pytest only: this file runs as a script inside a sandbox, never imported by coderl).

    python trace.py OUT.json MODULE[,MODULE...] -- PYTEST_ARGS...

Every call to a module-level function of the named modules is recorded as ``[args, kwargs,
returned]`` (each ``repr``) when all three are plain data whose ``repr`` reads back with
``ast.literal_eval`` to an equal value; calls that raised, or that take or give anything else
(functions, iterators, user objects), are not recorded. Arguments are captured at call time, so a
function that mutates its input is recorded with the input it was given. At most ``PER_FN``
distinct calls per function are kept.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import threading

PER_FN = 40
_PLAIN = (type(None), bool, int, float, str, bytes, tuple, list, dict, set, frozenset)


def _plain(value: object, depth: int = 0) -> bool:
    if depth > 6 or type(value) not in _PLAIN:
        return False
    if isinstance(value, float) and value != value:
        return False  # NaN never equals itself: no assertion can be written on it
    if isinstance(value, (tuple, list, set, frozenset)):
        return len(value) <= 50 and all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return len(value) <= 50 and all(
            _plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items()
        )
    return not isinstance(value, (str, bytes)) or len(value) <= 200


def _literal(value: object) -> str | None:
    if not _plain(value):
        return None
    text = repr(value)
    try:
        back = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return text if back == value and type(back) is type(value) else None


def main() -> int:
    out, modules = sys.argv[1], sys.argv[2].split(",")
    pytest_args = sys.argv[sys.argv.index("--") + 1 :]
    targets: dict[tuple[str, int], str] = {}
    for name in modules:
        module = __import__(name, fromlist=["_"])
        for fn_name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__:
                code = fn.__code__
                targets[(code.co_filename, code.co_firstlineno)] = f"{name}:{fn_name}"
    calls: dict[str, dict[str, list[str]]] = {}
    pending: dict[int, tuple[str, str | None]] = {}

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        code = frame.f_code
        key = targets.get((code.co_filename, code.co_firstlineno))
        if key is None:
            return
        if event == "call":
            info = inspect.getargvalues(frame)
            args = [info.locals[a] for a in info.args]
            if info.varargs:
                args += list(info.locals[info.varargs])
            kwargs = dict(info.locals[info.keywords]) if info.keywords else {}
            pending[id(frame)] = (key, _literal((tuple(args), kwargs)))
        elif event == "return":
            key_, inputs = pending.pop(id(frame), (key, None))
            done = calls.setdefault(key_, {})
            if inputs is None or len(done) >= PER_FN or inputs in done:
                return
            returned = _literal(arg)
            if returned is not None and sys.exc_info()[0] is None:
                done[inputs] = [inputs, returned]

    import pytest

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        pytest.main(pytest_args)
    finally:
        sys.setprofile(None)
    with open(out, "w") as f:
        json.dump({k: list(v.values()) for k, v in calls.items() if v}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
