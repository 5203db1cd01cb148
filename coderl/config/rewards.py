"""The ``reward`` section: which terms make an episode's reward and how they are weighed.

Each field is documented once, under the field; the order of the terms is checked by
:mod:`coderl.config.reward_order`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coderl.config._base import _Section
from coderl.config.graders import JudgeConfig, RMConfig


class LengthPenaltyConfig(_Section):
    coef: float = Field(0.1, ge=0)
    """Largest penalty (reward units), reached by an easiest task that uses its whole budget."""
    free_fraction: float = Field(0.25, ge=0, lt=1)
    """Fraction of the token budget that is never penalised."""
    power: float = Field(2.0, ge=1)
    """Exponent on the excess length: > 1 makes the penalty grow faster near the budget."""
    ease_power: float = Field(1.0, ge=0)
    """Exponent on the task's ease (group pass rate): larger leaves hard tasks more room."""


REWARD_TERM_NAMES = ("tests", "broken_calls", "length", "kl", "judge", "rm")
"""The reward terms a config may name: the keys of ``coderl.rewards.terms.REWARD_TERMS``
(which checks at import that it registers exactly these; the config floor does not import the
terms it names)."""


class RewardConfig(_Section):
    terms: dict[str, float] = Field(default_factory=lambda: {"tests": 1.0, "broken_calls": 1.0})
    """Reward term name -> weight; names from :data:`REWARD_TERM_NAMES`."""
    tests: Literal["resolved", "fraction"] = "resolved"
    """``resolved``: 1 if every FAIL_TO_PASS and PASS_TO_PASS test passes else 0;
    ``fraction``: partial credit, the share of FAIL_TO_PASS tests that pass when every
    PASS_TO_PASS test passes, else 0 (doing nothing scores 0)."""
    broken_call_penalty: float = Field(0.2, ge=0)
    """Reward subtracted per broken tool call (unparseable, unknown tool, bad arguments)."""
    broken_call_cap: int = Field(5, ge=1)
    """Broken calls counted at most (the penalty saturates)."""
    length: LengthPenaltyConfig = Field(default_factory=LengthPenaltyConfig)
    """Difficulty-scaled length penalty; used when ``length`` is in ``terms``."""
    kl_coef: float = Field(0.0, ge=0)
    """Beta of the k1 KL-in-reward term; used when ``kl`` is in ``terms``."""
    term_timeout_s: float = Field(10.0, gt=0)
    """A term that takes longer masks the samples it was scoring."""
    mask_alarm_rate: float = Field(0.1, ge=0, le=1)
    """Alarm (a logged warning and ``alarm/masked=1``) when more than this share of a step's
    episodes is masked (infrastructure failures and reward-term failures)."""
    hack_alarm_rate: float = Field(0.1, ge=0, le=1)
    """Alarm (a logged warning and ``alarm/hacks=1``) when more than this share of a step's
    episodes has at least one hack flag (``hacks/suspected_rate``, detectors of
    ``coderl.rewards.hacks``; flags never change a reward)."""
    audit_top_k: int = Field(2, ge=0)
    """Highest-reward trajectories of each step appended to ``RUN_DIR/audit.jsonl`` (the audit
    page of ``coderl report``), besides the flagged ones."""
    audit_max_flagged: int = Field(8, ge=0)
    """Most flagged trajectories kept per step (the first ones in task order)."""
    learned_requires_tests: bool = True
    """Learned terms (``judge``, ``rm``) count only on samples whose tests pass (0 elsewhere):
    they rank correct solutions and cannot turn a failing patch into reward. False pays them on
    every sample, accepted only while their weights stay below the test reward
    (``coderl.config.reward_order``)."""
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    """Rubric LLM judge; used when ``judge`` is in ``terms``."""
    rm: RMConfig = Field(default_factory=RMConfig)
    """Reward model from preferences; used when ``rm`` is in ``terms``."""
    shaping: float = Field(0.0, ge=0)
    """Weight of the potential-based shaping of ``vineppo``'s turns (0: off): the share of the
    visible tests passing after each ``run`` call, measured by the harness with the shown check
    (function repair) or read from the run's pytest output (repository tasks)
    (``coderl.rewards.shaping``)."""
