"""Reward composition is checked in every pair (issue 47, class 4): no cheaper behaviour (a
shorter wrong episode, a failing patch a learned grader likes, one that gives up after a slip)
can outscore solving, under any config that loads.

The property test draws compositions at random; for every one the config accepts, the best
failing episode must score below the worst solving one with the real terms, so a new term or a
loosened check that lets the order break fails here, not in a training run.
"""

from __future__ import annotations

import random

import pytest

from coderl.config import ConfigError, RewardConfig, load_config
from coderl.rewards import RewardSample, compute_rewards
from coderl.rewards.terms import REWARD_TERMS

REFUSED = {
    "length penalty larger than the test reward": (
        ["reward.terms={tests: 1, length: 1}", "reward.length.coef=1.5", "reward.broken_call_penalty=2"],
        "reward.length.coef",
    ),
    "length penalty equal to the test reward": (
        ["reward.terms={tests: 0.5, length: 1}", "reward.length.coef=0.5"],
        "reward.length.coef",
    ),
    "a heavy length weight, a small coef": (
        ["reward.terms={tests: 1, length: 20}", "reward.length.coef=0.06"],
        "reward.length.coef",
    ),
    "a broken call cheaper than the length saving": (
        ["reward.terms={tests: 1, broken_calls: 1, length: 1}", "reward.broken_call_penalty=0.05"],
        "reward.broken_call_penalty",
    ),
    "one broken call worth the whole test reward": (
        ["reward.terms={tests: 1, broken_calls: 1}", "reward.broken_call_penalty=1.0"],
        "reward.broken_call_penalty",
    ),
    "an ungated judge as heavy as the tests": (
        ["reward.terms={tests: 1, judge: 1}", "reward.learned_requires_tests=false"],
        "learned_requires_tests",
    ),
    "ungated judge and rm adding up past the tests": (
        ["reward.terms={tests: 1, judge: 0.6, rm: 0.6}", "reward.learned_requires_tests=false",
         "reward.rm.checkpoint=x"],
        "learned_requires_tests",
    ),
    "length and an ungated judge together": (
        ["reward.terms={tests: 1, judge: 0.5, length: 1, broken_calls: 1}",
         "reward.length.coef=0.6", "reward.broken_call_penalty=0.7",
         "reward.learned_requires_tests=false"],
        "reward.terms",
    ),
    "an unsquashed reward model, even gated": (
        ["reward.terms={tests: 1, rm: 0.1}", "reward.rm.squash=false", "reward.rm.checkpoint=x"],
        "reward.rm.squash",
    ),
    "fraction tests with a length penalty": (
        ["reward.terms={tests: 1, length: 1}", "reward.tests=fraction", "reward.length.coef=0.01"],
        "reward.tests=fraction",
    ),
    "fraction tests with broken calls": (
        ["reward.terms={tests: 1, broken_calls: 1}", "reward.tests=fraction"],
        "reward.tests=fraction",
    ),
    "a negative broken-call weight (a failing episode's slips paid)": (
        ["reward.terms={tests: 1, broken_calls: -1}"], "negative weights",
    ),
    "a negative length weight (failing at the full budget paid)": (
        ["reward.terms={tests: 1, length: -5}"], "negative weights",
    ),
    "a negative ungated judge cancelling the sum": (
        ["reward.terms={tests: 1, judge: -10, length: 1, broken_calls: 1}",
         "reward.length.coef=0.5", "reward.broken_call_penalty=0.6",
         "reward.learned_requires_tests=false"],
        "negative weights",
    ),
    "a negative gated judge (solving scores below failing)": (
        ["reward.terms={tests: 1, judge: -2}"], "negative weights",
    ),
    "no tests term": (["reward.terms={broken_calls: 1}"], "no positive tests term"),
    "a zero tests weight": (["reward.terms={tests: 0, judge: 1}"], "no positive tests term"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_composition_that_pays_a_cheaper_behaviour_is_refused(name: str) -> None:
    overrides, message = REFUSED[name]
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(None, overrides)


def test_learned_terms_are_gated_on_the_tests_by_default() -> None:
    assert RewardConfig().learned_requires_tests
    assert load_config(None, []).reward.learned_requires_tests


def _extremes(rew: RewardConfig) -> tuple[float, float]:
    """(worst solving total, best failing total) with the real terms and learned terms that
    score the worst way for the order: 0 for the solving episode, 1 for the failing one."""

    def learned(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
        return [0.0 if s.resolved else 1.0 for s in samples]

    terms = {**REWARD_TERMS, "judge": learned, "rm": learned}
    # ease 1 (an easy task); each side at both ends of the budget and of the broken calls (a
    # negative weight would turn the ends around)
    solving = [
        RewardSample("t", resolved=True, fraction_passed=1.0, sampled_tokens=n, token_budget=100,
                     ease=1.0, broken_tool_calls=b)
        for n, b in ((100, 1), (0, 0))
    ]  # fmt: skip
    failing = [
        RewardSample("t", fraction_passed=0.999, sampled_tokens=n, token_budget=100, ease=1.0,
                     broken_tool_calls=b)
        for n, b in ((0, 0), (100, 5))
    ]  # fmt: skip
    res = compute_rewards(solving + failing, rew, terms)
    return min(res.totals[:2]), max(res.totals[2:])


def test_every_accepted_composition_pays_solving_more_than_any_cheaper_behaviour() -> None:
    rng = random.Random(47)
    accepted = 0
    for _ in range(600):
        names = [n for n in ("length", "broken_calls", "judge", "rm") if rng.random() < 0.5]
        # a quarter of the draws allow negative weights: a sign the check must not overlook
        low = -3.0 if rng.random() < 0.25 else 0.05
        terms = {"tests": rng.choice([0.5, 1.0, 2.0])} | {n: rng.uniform(low, 3) for n in names}
        overrides = [
            f"reward.terms={terms}",
            f"reward.tests={rng.choice(['resolved', 'fraction'])}",
            f"reward.length.coef={rng.uniform(0, 2):.3f}",
            f"reward.broken_call_penalty={rng.uniform(0, 2):.3f}",
            f"reward.learned_requires_tests={rng.random() < 0.5}",
            "reward.rm.checkpoint=x",
        ]
        try:
            rew = load_config(None, overrides).reward
        except ConfigError:
            continue
        accepted += 1
        worst_solving, best_failing = _extremes(rew)
        assert worst_solving > best_failing, (overrides, worst_solving, best_failing)
    assert accepted >= 60  # the draw covers accepted compositions, not only refusals


def test_every_shipped_preset_keeps_the_order() -> None:
    from pathlib import Path

    presets = sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))
    assert len(presets) >= 5
    for preset in presets:
        rew = load_config(preset).reward
        worst_solving, best_failing = _extremes(rew)
        assert worst_solving > best_failing, preset.name
