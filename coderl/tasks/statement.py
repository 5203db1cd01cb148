"""Problem statements written from failing test output, never from the patch.

The statement names the failing tests and quotes, for each of the first few, the test's own frame
(the test code up to the failing line) and the final error lines (``E ...``). Frames inside the
library are left out: they would point at the mutated line, which is the answer, not the problem.
"""

from __future__ import annotations

import re

_FRAME_SEP = re.compile(r"^(_ )+_?\s*$")


def abridge(longrepr: str, *, max_lines: int = 25) -> str:
    """The test's frame and the last frame's ``E`` lines from a pytest long report."""
    lines = longrepr.splitlines()
    frames: list[list[str]] = [[]]
    for line in lines:
        if _FRAME_SEP.match(line):
            frames.append([])
        else:
            frames[-1].append(line)
    first = [ln for ln in frames[0] if ln.strip()]
    if len(frames) > 1:
        errors = [ln for ln in frames[-1] if ln.startswith("E ")]
        first = [ln for ln in first if not ln.startswith("E ")] + errors
    if len(first) > max_lines:
        first = first[: max_lines // 2] + ["    ..."] + first[-(max_lines - max_lines // 2) :]
    return "\n".join(first)


def write_statement(repo: str, failing: dict[str, str], *, max_tests: int = 3) -> str:
    """A bug report for ``repo`` from failing test ids -> pytest long reports.

    Raises:
        ValueError: ``failing`` is empty (a task needs at least one FAIL_TO_PASS test).
    """
    if not failing:
        raise ValueError("a problem statement needs at least one failing test")
    ids = sorted(failing)
    parts = [
        f"A change introduced a bug into {repo}: tests that used to pass now fail.",
        "",
        f"Failing tests ({len(ids)}):",
        *(f"- {t}" for t in ids[:20]),
        *([f"- ... and {len(ids) - 20} more"] if len(ids) > 20 else []),
    ]
    for test_id in ids[:max_tests]:
        parts += ["", f"Output of {test_id}:", "```", abridge(failing[test_id]), "```"]
    parts += [
        "",
        "Fix the library code so that these tests pass again without breaking any other test. "
        "Do not modify the tests or the test configuration.",
    ]
    return "\n".join(parts)
