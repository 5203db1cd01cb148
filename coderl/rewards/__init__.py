"""Rewards: composable terms with a per-term breakdown, crash/timeout masking and counting."""

from coderl.rewards.compose import RewardArityError, RewardResult, compute_rewards
from coderl.rewards.terms import REWARD_TERMS, RewardSample

__all__ = ["REWARD_TERMS", "RewardArityError", "RewardResult", "RewardSample", "compute_rewards"]
