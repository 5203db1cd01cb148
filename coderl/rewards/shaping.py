"""The potential of potential-based shaping: how far the visible tests have got.

``Phi(s_t)`` is the share of a task's *visible* tests (never the hidden or held-out ones) that
passed at the last ``run`` call the harness executed by boundary ``s_t``; ``Phi(s_0) = 0``:
nothing has run yet. Two sources, one per kind of task:

- **Measured by the harness** (function repair, :func:`coderl.synth.fnrepair.visible_potential`):
  after each ``run`` call the harness itself judges the episode's workspace with the task's
  visible check (the failing assertion its statement shows) in fresh sandboxes, out of the
  candidate's process, and records the value (``ToolCallRecord.potential``). Nothing the agent
  prints or writes into a report counts; only what its files compute.
- **Read from the run's output** (repository tasks, whose visible FAIL_TO_PASS tests are in the
  workspace, :func:`coderl.tasks.holdout.visible_fail_to_pass`): the harness's own parse of
  pytest's per-test lines in the observations of the ``run`` calls it executed
  (:func:`visible_outcomes`); text the agent wrote anywhere else is never read.

Not defended, by design, for the second source: the workspace is the agent's, so a ``run`` can
print anything (``echo PASSED tests/t.py::test_a``, a conftest that fakes reports) and raise
``Phi`` at that boundary (the first source cannot be moved that way; a file that special-cases
the visible check's input does pass it). Neither can raise an episode's shaped return: the
shaping terms telescope to ``-Phi(s_0) = 0`` because the terminal potential is pinned to 0
(:func:`coderl.algorithms.potential_shaping`, Ng et al. 1999), whatever the intermediate
potentials were. A fake moves credit between the episode's turns, never adds to its total.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_STATUS = re.compile(r"\b(PASSED|FAILED|ERROR)\b")


def visible_outcomes(output: str, test_ids: Sequence[str]) -> dict[str, bool]:
    """The tests of ``test_ids`` that a pytest report names with an outcome: id -> passed.

    Reads pytest's per-test lines, ``-v`` (``tests/t.py::test_a PASSED [50%]``) and ``-rA`` /
    the short summary (``PASSED tests/t.py::test_a``, ``FAILED tests/t.py::test_b - Error``):
    a line that holds exactly one status word and the id as a whole word. A test named on no
    such line is left out; on several, the last one wins.
    """
    out: dict[str, bool] = {}
    patterns = {i: re.compile(r"(?<!\S)" + re.escape(i) + r"(?!\S)") for i in test_ids}
    for line in output.splitlines():
        statuses = _STATUS.findall(line)
        if len(statuses) != 1:
            continue
        for test_id, pat in patterns.items():
            if pat.search(line):
                out[test_id] = statuses[0] == "PASSED"
    return out


def visible_potentials(
    tool_calls: Sequence[Any], test_ids: Sequence[str], turns: int
) -> list[float]:
    """``Phi(s_0) .. Phi(s_turns)``: ``turns + 1`` floats in [0, 1] (see the module docstring).

    Args:
        tool_calls: the episode's :class:`coderl.agent.episode.ToolCallRecord` s (``turn`` is
            1-based: the call ran in turn ``turn``, so it is seen at ``s_turn``). A call with a
            ``potential`` measured by the harness sets ``Phi`` to it; one without is parsed
            for ``test_ids``.
        test_ids: the task's visible FAIL_TO_PASS ids read from run output (none: only
            measured potentials count; without those every potential is 0).
        turns: turns the episode took.
    """
    passed = dict.fromkeys(test_ids, False)
    by_turn: dict[int, list[Any]] = {}
    for c in tool_calls:
        if c.name == "run" and c.status == "ok":
            by_turn.setdefault(c.turn, []).append(c)
    phi, current = [0.0], 0.0
    for t in range(1, turns + 1):
        for c in by_turn.get(t, []):
            if getattr(c, "potential", None) is not None:
                current = float(c.potential)
            elif passed:
                passed.update(visible_outcomes(c.observation, test_ids))
                current = sum(passed.values()) / len(passed)
        phi.append(current)
    return phi
