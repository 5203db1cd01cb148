"""Reward terms: pure functions from a batch of graded episodes to one number per episode.

Every term has the signature ``term(samples, cfg) -> list[float]`` (one value per sample, in
order) and is registered once in ``REWARD_TERMS``. :func:`coderl.rewards.compute_rewards` weights
and sums them, keeps the per-term breakdown, and masks samples whose term raised or timed out.
"""

from __future__ import annotations

from coderl.config import REWARD_TERM_NAMES, RewardConfig
from coderl.rewards.learned import judge_term, rm_term
from coderl.rewards.sample import RewardSample, Term

__all__ = ["REWARD_TERMS", "RewardSample", "Term"]


def tests_term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """Verifiable outcome: 1/0 for resolved (``cfg.tests="resolved"``) or partial credit
    (``"fraction"``): the share of FAIL_TO_PASS tests that pass when every PASS_TO_PASS test
    passes, else 0 (``GradeResult.partial_credit``; repository tasks)."""
    if cfg.tests == "resolved":
        return [1.0 if s.resolved else 0.0 for s in samples]
    return [float(s.fraction_passed) for s in samples]


def broken_calls_term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """``-broken_call_penalty * min(broken_tool_calls, broken_call_cap)``.

    Config validation guarantees one broken call costs more than the largest length penalty, so
    ending an episode early with a broken call never dodges a negative reward.
    """
    return [
        -cfg.broken_call_penalty * min(s.broken_tool_calls, cfg.broken_call_cap) for s in samples
    ]


def length_term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """Difficulty-scaled, nonlinear length penalty (ours; in the spirit of Kimi k1.5's length
    penalty, Kimi Team 2025, Sec. 2.3.3, and DAPO's overlong shaping, Yu et al. 2025, Sec. 3.4).

    With ``x = sampled_tokens / token_budget`` (clipped to [0, 1]), ``f = free_fraction``,
    ``e`` = task ease (metadata, else the group pass rate) and ``c = coef``::

        excess  = max(0, (x - f) / (1 - f))
        penalty = -c * e**ease_power * excess**power

    An easy task (every episode solved it, e = 1) that uses its whole budget loses ``c``; a hard
    task (no episode solved it, e = 0) loses nothing, so it keeps room to explore. Episodes within
    the free fraction of the budget are never penalised.
    """
    p = cfg.length
    out = []
    for s in samples:
        x = min(max(s.sampled_tokens / max(s.token_budget, 1), 0.0), 1.0)
        excess = max(0.0, (x - p.free_fraction) / (1.0 - p.free_fraction))
        ease = s.ease if s.ease is not None else s.group_pass_rate
        out.append(-p.coef * (ease**p.ease_power) * (excess**p.power))
    return out


def kl_term(samples: list[RewardSample], cfg: RewardConfig) -> list[float]:
    """KL-in-reward with the k1 estimator: ``-kl_coef * sum_t (logp_t - ref_logp_t)`` over the
    sampled tokens (Ziegler et al. 2019, Eq. 2; Ouyang et al. 2022, InstructGPT, Eq. 2;
    estimator from Schulman 2020, "Approximating KL Divergence"). An alternative to KL-in-loss."""
    return [-cfg.kl_coef * s.kl_k1 for s in samples]


REWARD_TERMS: dict[str, Term] = {
    "tests": tests_term,
    "broken_calls": broken_calls_term,
    "length": length_term,
    "kl": kl_term,
    "judge": judge_term,
    "rm": rm_term,
}
if set(REWARD_TERMS) != set(REWARD_TERM_NAMES):  # the names a config may use are these terms
    raise RuntimeError(
        f"coderl.config.REWARD_TERM_NAMES {sorted(REWARD_TERM_NAMES)} differs from the "
        f"registered terms {sorted(REWARD_TERMS)}"
    )
