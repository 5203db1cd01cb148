"""What the reward terms see of one graded episode, and the signature of a term.

The floor below the reward terms (:mod:`coderl.rewards.terms`) and the learned graders
(:mod:`coderl.rewards.learned`), which both read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from coderl.config import RewardConfig


@dataclass
class RewardSample:
    """What the reward terms see of one graded episode."""

    task_id: str
    """The task; episodes of the same task form a group."""
    resolved: bool = False
    """Every FAIL_TO_PASS and PASS_TO_PASS test passed."""
    fraction_passed: float = 0.0
    """Partial credit in [0, 1]: for repository tasks the share of FAIL_TO_PASS tests passed
    when no PASS_TO_PASS test broke, else 0 (``GradeResult.partial_credit``)."""
    grading_error: str | None = None
    """Why grading failed (sandbox crash, timeout of the grader...); such samples are masked."""
    sampled_tokens: int = 0
    """Tokens the policy sampled in the episode (all turns)."""
    token_budget: int = 1
    """Most tokens the episode could sample (turns x tokens per turn), > 0."""
    broken_tool_calls: int = 0
    """Tool calls that could not be parsed or executed as asked."""
    ease: float | None = None
    """Task ease in [0, 1] from metadata (1 = easiest); None: use the group pass rate."""
    group_pass_rate: float = 0.0
    """Fraction of the task's gradable episodes that resolved it (filled in by compute_rewards)."""
    kl_k1: float = 0.0
    """Sum over sampled tokens of ``logp - ref_logp`` (k1 estimate of KL to the reference)."""
    statement: str = ""
    """Task statement (read by the learned graders, ``judge`` and ``rm``)."""
    diff: str = ""
    """The episode's final diff (learned graders)."""
    tool_log: str = ""
    """Tool-call summary, ``coderl.graders.judge.tool_log_summary`` (learned graders)."""
    tests_report: str = ""
    """Test outcomes in words, ``coderl.graders.judge.tests_report`` (learned graders)."""
    details: dict[str, float] = field(default_factory=dict)
    """Extra per-sample numbers a term reports (``judge/<criterion>``); copied into the reward
    breakdown, never summed into the total."""


Term = Callable[[list[RewardSample], RewardConfig], list[float]]
