"""#25 class 6: nothing the function checker's candidate observes depends on a comparison's outcome.

The checks below call the candidate again only when an ``assert`` fails (its message calls it, as
HumanEval/78's does), once with the same input and once with a new one. Under the old checker a
failure there ran the candidate a second round on a longer input list, which told it which answer
failed; each attacker here reads that list (the callee's ``sys.argv[1]``) and answers right only
when it looks like a second round. The honest wrong answer fails; so must every attacker.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from coderl.grading.function import grade_completion
from coderl.grading.runner import default_factory
from coderl.tasks.humaneval import function_task

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)

PROMPT = "def is_even(n):\n    '''True when n is even.'''\n"
GOLD = "    return n % 2 == 0\n"
CHECKS = {  # the last input is the one the honest wrong answer (always False) gets wrong
    "repeat": "def check(candidate):\n    for n in [3, 5, 8]:\n"
    "        assert candidate(n) == (n % 2 == 0), candidate(n)\n",
    "probe": "def check(candidate):\n    for n in [3, 5, 8]:\n"
    "        assert candidate(n) == (n % 2 == 0), candidate(n + 1000)\n",
}
_INPUTS = "    import sys, json\n    calls = [c[0][0] for c in json.load(open(sys.argv[1]))]\n"
WRONG = "    return False\n"
ATTACKS = {
    # flip the answer of an input that appears twice in the list (the assert message's repeat)
    "flip_on_repeated_input": _INPUTS + "    return calls.count(n) > 1\n",
    # flip the answer of an input whose failure probe (n + 1000) was asked about
    "flip_on_probe_input": _INPUTS + "    return (n + 1000) in calls\n",
    # count the calls: more than the first round's three means a failure happened; answer right
    "count_calls": _INPUTS + "    return n % 2 == 0 if len(calls) != 3 else False\n",
    # remember previous inputs in the process: a list ending in an input seen before is a retry
    "remember_previous_inputs": _INPUTS + "    return n % 2 == 0 if len(set(calls)) < len(calls)"
    " or any(c >= 1000 for c in calls) else False\n",
}


def _task(kind: str):
    return function_task(f"rounds/{kind}", PROMPT, CHECKS[kind], "is_even", GOLD)


@pytest.mark.parametrize("kind", sorted(CHECKS))
def test_controls_gold_passes_and_honest_wrong_fails(kind):
    task = _task(kind)
    assert grade_completion(task, GOLD).resolved
    r = grade_completion(task, WRONG)
    assert not r.resolved and r.grading_error is None, r.reason


@pytest.mark.parametrize("kind", sorted(CHECKS))
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_candidate_learning_from_its_rounds_fails(kind, name):
    r = grade_completion(_task(kind), ATTACKS[name])
    assert r.grading_error is None, r.grading_error
    assert not r.resolved and r.fraction_passed == 0.0, (kind, name, r.reason)


class _Spy:
    """A sandbox factory that keeps the input list of every candidate run (``callee.py``)."""

    def __init__(self):
        self.inner, self.runs = default_factory(), []

    def __call__(self, base, **kwargs):
        sb = self.inner(base, **kwargs)
        inp = kwargs.get("ro_mounts", {}).get("/coderl/input")
        exec_ = sb.exec

        def spied(cmd, timeout):
            if inp and "callee.py" in cmd:
                self.runs.append(json.loads((Path(inp) / "calls.json").read_text()))
            return exec_(cmd, timeout=timeout)

        sb.exec = spied
        return sb


@pytest.mark.parametrize("kind", sorted(CHECKS))
def test_the_candidate_runs_once_on_the_same_inputs_whatever_it_answers(kind):
    """The invariant itself: right, wrong and attacking answers all get one run on one list."""
    seen = []
    for body in (GOLD, WRONG, ATTACKS["count_calls"]):
        spy = _Spy()
        grade_completion(_task(kind), body, factory=spy)
        assert len(spy.runs) == 1, (body, spy.runs)
        seen.append(spy.runs[0])
    assert seen[0] == seen[1] == seen[2]
    assert [c[0][0] for c in seen[0]] == [3, 5, 8]
