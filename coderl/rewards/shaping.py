"""The potential of potential-based shaping: how far the visible failing tests have got.

``Phi(s_t)`` is the fraction of a task's *visible* FAIL_TO_PASS tests (those in the rollout
workspace, :func:`coderl.tasks.holdout.visible_fail_to_pass`; never the hidden or held-out ones)
that passed in the last report of each the agent has seen by boundary ``s_t``. The harness reads
it from the observations of the ``run`` calls it executed (``status="ok"``: the command ran
and this is its output), with its own parse of pytest's per-test lines
(:func:`visible_outcomes`): text the agent wrote anywhere else (its messages, a file it wrote,
a call the harness did not run) is never read. ``Phi(s_0) = 0``: nothing has run yet.

Not defended, by design: the workspace is the agent's, so a ``run`` can print anything
(``echo PASSED tests/t.py::test_a``, a conftest that fakes reports) and raise ``Phi`` at that
boundary. That cannot raise an episode's shaped return: the shaping terms telescope to
``-Phi(s_0) = 0`` because the terminal potential is pinned to 0
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
            1-based: the call ran in turn ``turn``, so it is seen at ``s_turn``).
        test_ids: the task's visible FAIL_TO_PASS ids; none: every potential is 0.
        turns: turns the episode took.
    """
    passed = dict.fromkeys(test_ids, False)
    by_turn: dict[int, list[Any]] = {}
    for c in tool_calls:
        if c.name == "run" and c.status == "ok":
            by_turn.setdefault(c.turn, []).append(c)
    phi = [0.0]
    for t in range(1, turns + 1):
        for c in by_turn.get(t, []):
            passed.update(visible_outcomes(c.observation, test_ids))
        phi.append(sum(passed.values()) / len(passed) if passed else 0.0)
    return phi
