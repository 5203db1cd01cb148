"""Pure tensor functions for RL post-training: advantages, losses, KL, importance weights,
evaluation estimators. No state, no config objects, no I/O."""

from coderl.algorithms.advantages import episode_gae, gae, group_advantages
from coderl.algorithms.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    KL_LOSS_ESTIMATOR,
    aggregate,
    entropy,
    kl_penalty,
    policy_loss,
    token_logprobs,
    value_loss,
)
from coderl.algorithms.metrics import best_of_n, pass_at_k
from coderl.algorithms.off_policy import importance_weights, logprob_gap
from coderl.algorithms.turn_advantages import mc_turn_values, potential_shaping, turn_advantages

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "KL_LOSS_ESTIMATOR",
    "aggregate",
    "best_of_n",
    "entropy",
    "episode_gae",
    "gae",
    "group_advantages",
    "importance_weights",
    "kl_penalty",
    "logprob_gap",
    "mc_turn_values",
    "pass_at_k",
    "policy_loss",
    "potential_shaping",
    "token_logprobs",
    "turn_advantages",
    "value_loss",
]
