"""``reward.tests=fraction`` pays partial credit, never the starting state: the share of
FAIL_TO_PASS tests passed when no PASS_TO_PASS test broke (``GradeResult.partial_credit``).

A red team found that ``fraction`` (then: passed / all expected tests) paid the unchanged toolz
task 0.994 against 1.0 for the fix, because PASS_TO_PASS tests dominate the count.
"""

from __future__ import annotations

import pytest

from coderl.grading.grade import _summarise
from coderl.grading.verdict import GradeResult
from coderl.tasks.spec import Task

F2P = ["t.py::test_bug_a", "t.py::test_bug_b"]
P2P = [f"t.py::test_ok_{i}" for i in range(98)]


def _task() -> Task:
    return Task(
        id="x", kind="repo", env_id="e", problem_statement="fix", FAIL_TO_PASS=F2P,
        PASS_TO_PASS=P2P, gold_patch="--- a\n+++ b\n", source="test", license="MIT",
    )  # fmt: skip


def _grade(passed: set[str], tampered: bool = False) -> GradeResult:
    outcomes = {t: "passed" if t in passed else "failed" for t in F2P + P2P}
    return _summarise(GradeResult(task_id="x", tampered=tampered), _task(), outcomes)


@pytest.mark.parametrize(
    ("passed", "credit"),
    [
        (set(P2P), 0.0),  # the unchanged starting state: 98 of 100 tests pass
        (set(P2P) | {F2P[0]}, 0.5),  # half the bug fixed, nothing broken
        (set(F2P) | set(P2P), 1.0),  # fixed
        (set(F2P) | set(P2P[1:]), 0.0),  # fixed the bug by breaking working code
    ],
)
def test_partial_credit_pays_only_fail_to_pass_progress_without_breakage(passed, credit):
    result = _grade(passed)
    assert result.partial_credit == credit
    assert result.resolved == (credit == 1.0)


def test_the_starting_state_scores_zero_where_the_share_of_all_tests_is_high():
    result = _grade(set(P2P))
    assert result.fraction_passed == 0.98 and result.partial_credit == 0.0


def test_tampering_zeroes_partial_credit():
    assert _grade(set(F2P) | set(P2P), tampered=True).partial_credit == 0.0


def test_the_agent_environment_hands_the_reward_partial_credit():
    """What ``reward.tests=fraction`` reads (``GradeRecord.fraction_passed``) is the partial
    credit, not the share of all tests."""
    from coderl.config import load_config
    from coderl.envs.agent import AgentEnvironment
    from coderl.envs.base import EpisodeRecord
    from coderl.trajectory import Trajectory

    task = _task()
    env = AgentEnvironment(
        load_config(None, []),
        lambda split: [task],
        grader=lambda t, diff, timeout: _grade(set(P2P)),
    )
    [record] = env.grade([task], [EpisodeRecord(task.id, Trajectory(), answer="diff")])
    assert record.fraction_passed == 0.0 and record.result.fraction_passed == 0.98
