"""The grader's verdict, :class:`GradeResult`: what every grader (repository tests, function
checks) returns and what the reward code reads. Plain data, below every grader."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

GRADER_RAISED = "the grader raised on the agent's output"
"""How a verdict's ``reason`` begins (after the function checker's ``failed: ``) when the
grader's own code raised on what the agent produced: scored 0 as the agent's failure, and
flagged (``coderl.rewards.hacks``: ``grader_raised``) so that a grader bug that turns correct
work into zeros shows in the audit instead of passing for ordinary failures."""


@dataclass
class GradeResult:
    """The grader's verdict. The reward code reads ``resolved``, ``fraction_passed``,
    ``grading_error`` and ``tests``."""

    task_id: str
    resolved: bool = False
    """SWE-bench rule: every FAIL_TO_PASS and PASS_TO_PASS test passed (and no tampering)."""
    tests: dict[str, str] = field(default_factory=dict)
    """Expected test id -> outcome (``passed``, ``failed``, ``error``, ``skipped``, ``missing``...)."""
    fraction_passed: float = 0.0
    """Passed / expected tests, in [0, 1]; 0.0 whenever ``tampered``."""
    fail_to_pass_passed: float = 0.0
    """Fraction of the FAIL_TO_PASS tests that passed; 0.0 whenever ``tampered``."""
    partial_credit: float = 0.0
    """``fail_to_pass_passed`` when every PASS_TO_PASS test passed, else 0.0 (0.0 whenever
    ``tampered``): the reward ``reward.tests=fraction`` pays. Not ``fraction_passed``: the
    PASS_TO_PASS tests dominate that, so the unchanged starting state scored 0.99 on a shipped
    task; here it scores 0 (its FAIL_TO_PASS tests fail by definition) and a change that breaks
    working code scores 0 too."""
    grading_error: str | None = None
    """Set only for infrastructure failures (the grader itself failed): mask, do not score."""
    failure_kind: Literal["infra", "agent"] | None = None
    """Why there is no reward: ``infra`` (sandbox could not start, environment missing, grader
    bug; ``grading_error`` says which; the sample is masked) or ``agent`` (anything the graded
    code or diff caused: unresolved, tampering, crash, timeout, garbage; scored as a failure).
    ``None`` when resolved."""
    reason: str = ""
    """Why the task is not resolved (first cause), empty when resolved."""
    tampered: bool = False
    """Canaries misbehaved or pytest/unittest internals were replaced."""
    stripped_paths: list[str] = field(default_factory=list)
    """Protected paths removed from the agent's diff."""
    dropped_paths: list[str] = field(default_factory=list)
    """Files the diff names only as binary (a ``Binary files ... differ`` note or a ``GIT binary
    patch``): not applied, not graded (``coderl.grading.apply.drop_binary``)."""
    duration_s: float = 0.0
    """Wall time of the grade (seconds)."""
    denied: list[str] = field(default_factory=list)
    """Findings of the reward-denying detector (``coderl.grading.diffguard``): what the diff adds
    that reaches into the interpreter, the runner or the process's memory (``path:line: rule
    name``). Non-empty = scored 0 as the agent's failure, whatever the tests said; kept for
    audit (``hack_flags`` reads it)."""
    second_run: bool = False
    """The FAIL_TO_PASS tests ran a second time, in a fresh sandbox with canaries planted among
    them (``coderl.grading.rerun``); it runs whenever the first run passed one of them."""
    twinless: list[str] = field(default_factory=list)
    """FAIL_TO_PASS tests the second run planted no mutated twin of
    (``coderl.grading.twins``: no assertion that surely runs could be changed, the test kept
    its published name, its file took no canary, or the twin check dropped its twins because
    they break the gold patch, ``coderl.grading.twincheck``): only the body-less canaries stand beside
    them, which a forge that reads test sources can tell apart."""
    twins_not_failed: list[str] = field(default_factory=list)
    """FAIL_TO_PASS tests that passed the second run while a mutated twin of theirs did not
    fail (tampering; the twin check, ``coderl.grading.twincheck``, reads it on gold patches)."""
    rerun_disagreed: list[str] = field(default_factory=list)
    """FAIL_TO_PASS tests that passed in one run and not in the other (``"<id>: <first> then
    <second>"``): each counts as failed, the task is unresolved (the agent's failure), and
    ``hack_flags`` raises ``verdict_disagreed``."""
