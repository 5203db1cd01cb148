"""``ast.parse`` that is safe to call from several threads of one process at once.

Why. CPython 3.11 keeps the AST constructor's recursion depth in per-interpreter state
(``ast_state.recursion_depth`` in ``Python/Python-ast.c``), not per thread. When the garbage
collector runs inside one thread's ``ast.parse`` and a finalizer lets another thread run its own
``ast.parse``, the first one's depth check fails with ``SystemError: AST constructor recursion
depth mismatch (before=.., after=..)`` (CPython issue gh-106905; seen in the wild by pytest,
langchain and others). The grader parses the agent's Python on the host (the diff guard,
:mod:`coderl.grading.diffguard`) while grading in a thread pool, so under load a correct fix was
scored as "the grader raised on the agent's output", an agent failure with reward 0.

What. :func:`parse_python` holds one process-wide lock around ``ast.parse``. Every host-side
parse that may run beside another thread goes through it; a parse that does not (a plain
``ast.parse`` elsewhere in another thread) can still break one of these (residual risk: route it
here too).
"""

from __future__ import annotations

import ast
import threading

_PARSE_LOCK = threading.RLock()  # reentrant: a finalizer that parses runs in the same thread


def parse_python(source: str | bytes, filename: str = "<unknown>") -> ast.Module:
    """``ast.parse(source, filename)`` under the process-wide parse lock.

    Raises:
        SyntaxError, ValueError (null bytes), RecursionError, MemoryError: as ``ast.parse``.
    """
    with _PARSE_LOCK:
        return ast.parse(source, filename)
