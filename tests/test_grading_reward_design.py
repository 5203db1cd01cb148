"""Repository presets reward resolution: doing nothing, or passing only what already passed,
earns nothing (issue: the fraction of all tests passed paid 0.99 for an empty diff)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from coderl.config import load_config
from coderl.rewards.compose import compute_rewards
from coderl.rewards.terms import RewardSample

PRESETS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
REPO_PRESETS = [  # training presets on repository tasks (online presets have their own schema)
    p for p in PRESETS if (yaml.safe_load(p.read_text()).get("tasks") or {}).get("source") == "repo"
]


def test_there_is_a_repository_preset():
    assert any(p.name == "repo-bugfix.yaml" for p in REPO_PRESETS)


@pytest.mark.parametrize("preset", REPO_PRESETS, ids=lambda p: p.name)
def test_repository_presets_pay_only_for_resolving(preset):
    cfg = load_config(preset)
    assert cfg.reward.tests == "resolved"
    budget = cfg.rollout.max_turns * cfg.rollout.max_new_tokens
    # an empty diff on a shipped six task: 183 of 184 tests already pass
    nothing = RewardSample(
        task_id="t", fraction_passed=183 / 184, sampled_tokens=30, token_budget=budget
    )
    early = RewardSample(task_id="t", fraction_passed=0.999, sampled_tokens=1, token_budget=budget)
    fixed = RewardSample(
        task_id="t", resolved=True, fraction_passed=1.0, sampled_tokens=budget, token_budget=budget
    )
    totals = compute_rewards([nothing, early, fixed], cfg.reward).totals
    assert totals[0] == 0.0 and totals[1] == 0.0
    assert totals[2] > 0.5  # even the longest fix pays far more than stopping early
