"""The grader's host-side Python parsing under threads (coderl.grading.pyparse).

CPython 3.11's AST constructor keeps its recursion depth per interpreter, so two threads in
``ast.parse`` at once (the garbage collector running a finalizer inside one of them) break it
with ``SystemError: AST constructor recursion depth mismatch``: graded in a thread pool under
load, a correct fix was scored as an agent failure. With plain ``ast.parse`` in ``work`` below,
4 threads x 20 parses fail a few times per run on 3.11.7; through the lock, never.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from coderl.grading.diffguard import scan_source

SOURCE = (Path(__file__).parent.parent / "coderl" / "agent" / "oracle.py").read_text()


class _Finalized:
    """Garbage in a cycle whose finalizer releases the GIL: when the collector runs inside one
    thread's parse, another thread gets to run."""

    def __del__(self) -> None:
        time.sleep(0)


def test_the_diff_guard_parses_safely_from_several_threads():
    errors: list[str] = []
    results: list[int] = []

    def work() -> None:
        for _ in range(20):
            junk = _Finalized()
            junk.cycle = junk  # type: ignore[attr-defined]
            del junk
            try:
                found = scan_source(SOURCE, "oracle.py")
            except SystemError as e:
                errors.append(str(e))
            else:
                assert found is not None  # the file parses: findings, not "does not parse"
                results.append(len(found))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter lets them
    try:
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(results) == 80 and len(set(results)) == 1  # every parse saw the same module
